"""Idle polling: keep the host's CPUs awake so that a woken process runs at once.

Why: on a virtual machine (and on bare metal in deep C-states) a CPU with nothing to run halts,
and waking it again for the next message costs far more than the message. Measured on this
project's 2-vCPU KVM guest with ``python -m zserve.idle_poll`` (two processes ping-ponging one
byte over a socket pair, 1 ms apart): round trip p50 144 us, p90 1.5 ms, p99 5.5 ms with the CPUs
left to halt, against p50 64 us, p90 83 us, p99 112 us with idle pollers. A Symphony request
crosses about eight such hops (frontend, shard, rank, shard, backend, frontend and back), and
deferred scheduling spends the SLO's slack on purpose, so a few milliseconds per wake-up decide
whether a batch meets its deadline.

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

import argparse
import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# How long ``stop`` waits for a poller to exit after SIGTERM before it kills it.
POLLER_STOP_TIMEOUT_S = 2.0
# Ready handshake: a poller writes this byte to its stdout once it runs at SCHED_IDLE; ``start``
# waits up to the timeout for it (a Python start-up each, in parallel), so a cluster's CPUs are
# kept awake from its first request on, not from whenever the pollers get there.
POLLER_READY_BYTE = b"R"
POLLER_READY_TIMEOUT_S = 10.0
# ``--bench``: gaps between ping-pongs, and round trips per gap.
BENCH_GAPS_S = (0.0, 0.001, 0.005, 0.02)
BENCH_ROUND_TRIPS = 400


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
                [sys.executable, "-c", "from zserve.idle_poll import _become_idle_poller; "
                 "_become_idle_poller()"],
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


# --------------------------------------------------------------------------- wake-up benchmark


def ping_pong_rtts_us(gap_s: float, round_trips: int = BENCH_ROUND_TRIPS) -> np.ndarray:
    """Round trips (us) of one byte between this process and a forked child over a socket pair,
    ``gap_s`` apart: the cost of waking a process that was asleep, which is what a message hop
    between two zserve processes pays."""
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child echoes until the parent closes its end
        parent.close()
        while data := child.recv(8):
            child.send(data)
        os._exit(0)
    child.close()
    rtts = np.empty(round_trips)
    try:
        for i in range(round_trips):
            start = time.perf_counter()
            parent.send(b"x")
            parent.recv(8)
            rtts[i] = (time.perf_counter() - start) * 1e6
            if gap_s:
                time.sleep(gap_s)
    finally:
        parent.close()
        os.waitpid(pid, 0)
    return rtts


def bench(gaps_s: tuple[float, ...] = BENCH_GAPS_S, round_trips: int = BENCH_ROUND_TRIPS) -> str:
    """The wake-up round-trip table, without and with idle pollers."""
    lines = ["| idle pollers | gap ms | p50 us | p90 us | p99 us | max us |",
             "| --- | --- | --- | --- | --- | --- |"]
    for polling in (False, True):
        pollers = IdlePollers().start() if polling else None  # returns once they spin
        try:
            for gap in gaps_s:
                r = ping_pong_rtts_us(gap, round_trips)
                lines.append(
                    f"| {'yes' if polling else 'no'} | {gap * 1e3:g} | {np.median(r):.0f} | "
                    f"{np.percentile(r, 90):.0f} | {np.percentile(r, 99):.0f} | {r.max():.0f} |")
        finally:
            if pollers is not None:
                pollers.stop()
    return "\n".join(lines)


# ``--stalls``: a gap in a spinning loop longer than this is counted as a stall.
STALL_MIN_S = 0.002


def spin_gaps(duration_s: float, min_gap_s: float = STALL_MIN_S) -> list[tuple[float, float]]:
    """Spin for ``duration_s`` reading the monotonic clock; return each gap between two
    consecutive readings longer than ``min_gap_s`` as (seconds from the start, gap seconds).
    With nothing else runnable on the CPU, a gap is time the CPU was taken away from a runnable
    process: by the host (a VM's vCPU not scheduled) or by the kernel's own work."""
    gaps: list[tuple[float, float]] = []
    start = last = time.monotonic()
    end = start + duration_s
    while last < end:
        now = time.monotonic()
        if now - last > min_gap_s:
            gaps.append((last - start, now - last))
        last = now
    return gaps


def _spin_gaps_child(duration_s: float, conn: Connection) -> None:
    conn.send(spin_gaps(duration_s))
    conn.close()


def stall_probe(duration_s: float, cpus: int | None = None) -> str:
    """One spinning process per CPU for ``duration_s``: the stalls each one saw (gaps longer
    than STALL_MIN_S), as a table. Run it on an otherwise idle machine: it measures the floor
    of what any process on this host can be delayed by, whatever zserve does."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    count = cpus or available_cpus()
    pipes = [ctx.Pipe(duplex=False) for _ in range(count)]
    procs = [ctx.Process(target=_spin_gaps_child, args=(duration_s, w)) for _, w in pipes]
    for proc in procs:
        proc.start()
    for _, write_end in pipes:
        write_end.close()  # the children hold theirs: a child that dies gives EOFError, not a hang
    try:
        results = [read_end.recv() for read_end, _ in pipes]
    finally:
        for proc in procs:
            proc.join(timeout=duration_s + POLLER_STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
    lines = [f"{count} spinning process(es), {duration_s:g} s each; a stall is a gap > "
             f"{STALL_MIN_S * 1e3:g} ms between two clock readings",
             "| process | stalls | > 5 ms | > 10 ms | longest ms | stalls per minute |",
             "| --- | --- | --- | --- | --- | --- |"]
    for i, gaps in enumerate(results):
        sizes = [g for _, g in gaps]
        lines.append(
            f"| {i} | {len(sizes)} | {sum(g > 0.005 for g in sizes)} | "
            f"{sum(g > 0.010 for g in sizes)} | {max(sizes, default=0.0) * 1e3:.1f} | "
            f"{len(sizes) * 60.0 / duration_s:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zserve.idle_poll",
        description="Measure process wake-up latency with and without idle pollers, or "
                    "(--stalls S) how often and how long this host stalls a running process.")
    p.add_argument("--round-trips", type=int, default=BENCH_ROUND_TRIPS)
    p.add_argument("--stalls", type=float, metavar="SECONDS",
                   help="instead: spin one process per CPU this long and report its stalls")
    args = p.parse_args(argv)
    if args.stalls is not None:
        if not args.stalls > 0:
            p.error("--stalls must be > 0")
        print(stall_probe(args.stalls))
        return 0
    print(f"{available_cpus()} CPU(s); one-byte socket-pair ping-pong, "
          f"{args.round_trips} round trips per gap")
    print(bench(round_trips=args.round_trips))
    return 0


if __name__ == "__main__":
    sys.exit(main())
