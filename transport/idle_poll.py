"""Idle polling: keep the host's CPUs awake so that a woken process runs at once.

Why: on a virtual machine (and on bare metal in deep C-states) a CPU with nothing to run halts,
and waking it again for the next message costs far more than the message. Measured on this
project's 2-vCPU KVM guest with ``zserve bench-wakeup`` (``zserve.loadgen.bench.wakeup``: two
processes ping-ponging one byte over a socket pair, 1 ms apart): round trip p50 144 us, p90
1.5 ms, p99 5.5 ms with the CPUs left to halt, against p50 64 us, p90 83 us, p99 112 us with
idle pollers. A Symphony request crosses about eight such hops (frontend, shard, rank, shard,
backend, frontend and back), and deferred scheduling spends the SLO's slack on purpose, so a few
milliseconds per wake-up decide whether a batch meets its deadline.

What: one *idle poller* per CPU the supervisor may run on, each a child process that lowers
itself to ``SCHED_IDLE`` (the kernel runs it only when nothing else on that CPU is runnable, and
any other task that wakes preempts it at once) and spins. A CPU therefore never halts while the
cluster runs, and the cluster's own processes lose no CPU time to the pollers: they see the
latency of an awake CPU. This is the user-space form of booting with ``idle=poll`` or disabling
deep C-states (``cpupower idle-set -D 0``), which latency-critical serving hosts do.

Cost: the host's CPUs show 100% busy and draw full power while the cluster runs, and on a shared
VM host the spinning vCPUs take CPU time from the host's other tenants. That is why it is off by
default (``[cluster] idle_poll = false``); the benchmark clusters in ``examples/clusters/`` and
the clusters ``zserve experiment --live`` starts turn it on.

The pollers die with the supervisor (``PR_SET_PDEATHSIG``), so a killed supervisor leaves no
spinning processes behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
import signal
import subprocess
import sys
import time

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# How long ``stop`` waits for a poller to exit after SIGTERM before it kills it.
POLLER_STOP_TIMEOUT_S = 2.0
# Ready handshake: a poller writes this byte to its stdout once it runs at SCHED_IDLE; ``start``
# waits up to the timeout for it (a Python start-up each, in parallel), so a cluster's CPUs are
# kept awake from its first request on, not from whenever the pollers get there.
POLLER_READY_BYTE = b"R"
POLLER_READY_TIMEOUT_S = 10.0


def available_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _become_idle_poller() -> None:
    """In the poller process: die with the parent, drop to SCHED_IDLE, spin forever."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(0)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    os.nice(19)  # where SCHED_IDLE is missing, at least yield to everything else
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    os.write(1, POLLER_READY_BYTE)
    os.close(1)
    while True:
        pass


def _await_ready(process: subprocess.Popen[bytes], deadline: float) -> bool:
    """Wait (until ``deadline``) for a poller's ready byte; closes its stdout either way."""
    assert process.stdout is not None
    try:
        readable, _, _ = select.select([process.stdout], [], [],
                                       max(0.0, deadline - time.monotonic()))
        return bool(readable) and process.stdout.read(1) == POLLER_READY_BYTE
    finally:
        process.stdout.close()


class IdlePollers:
    """``count`` idle poller processes (default: one per available CPU); ``start``/``stop``, or a
    context manager; ``start`` returns once every poller runs at ``SCHED_IDLE`` (one that does not
    say so in time is killed and left out). Does nothing (and says so once) where
    ``SCHED_IDLE`` does not exist.
    ``live_pids()`` lists this process's running pollers, so that CPU accounting can leave them
    out (they burn only time no one else wanted)."""

    _live: set[int] = set()

    def __init__(self, count: int | None = None) -> None:
        self.count = available_cpus() if count is None else count
        self.processes: list[subprocess.Popen[bytes]] = []

    @classmethod
    def live_pids(cls) -> frozenset[int]:
        return frozenset(cls._live)

    @staticmethod
    def supported() -> bool:
        return hasattr(os, "SCHED_IDLE") and sys.platform.startswith("linux")

    def start(self) -> IdlePollers:
        if not self.supported():
            log.warning("idle_poll: SCHED_IDLE is not available on this platform; not polling")
            return self
        started = [
            subprocess.Popen(
                [sys.executable, "-c", "from zserve.transport.idle_poll import "
                 "_become_idle_poller; _become_idle_poller()"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                close_fds=True,
            )
            for _ in range(self.count)
        ]
        deadline = time.monotonic() + POLLER_READY_TIMEOUT_S
        for process in started:
            if _await_ready(process, deadline):
                self.processes.append(process)
                self._live.add(process.pid)
            else:
                log.warning("idle_poll: poller %d did not reach SCHED_IDLE in time; stopped",
                            process.pid)
                process.kill()
                process.wait()
        log.info("idle_poll: %d idle poller(s) keep the CPUs awake (SCHED_IDLE)",
                 len(self.processes))
        return self

    def stop(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=POLLER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            self._live.discard(process.pid)
        self.processes = []

    def __enter__(self) -> IdlePollers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
