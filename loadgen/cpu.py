"""CPU accounting for benchmarks: the CPU time each process of a run used, and per request.

A process's CPU cost per request is a steadier figure than wall throughput on a shared machine:
its sustainable rate on one core of its own is about 1 / cost. ``cpu_snapshot`` reads every
cluster process, this process and its other children (the generator's workers) at one instant;
``cpu_per_request`` turns two snapshots into microseconds per request and cores used.

On Linux a reading is the process's CPU-time clock (``clock_getcpuclockid(3)``: every thread's
run time, dead threads included, in nanoseconds). Elsewhere it is ``psutil``'s user + system
time, whose resolution is one clock tick (10 ms): over the 1 s measure window of a quick run at
~700 r/s, one tick is ~15 us per request, and two processes that used about the same CPU then
read the very same figure (the frontend and the load generator of ``zserve experiment
protocols --quick`` both read 341.8 us/request, 23 ticks each over 673 requests).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import psutil

from zserve.transport.idle_poll import IdlePollers

__all__ = (
    "LOADGEN_PROCESS",
    "LOADGEN_WORKERS",
    "child_pids",
    "cpu_per_request",
    "cpu_seconds",
    "cpu_snapshot",
)

LOADGEN_PROCESS = "loadgen"
LOADGEN_WORKERS = "loadgen workers"


# Linux's CPU-time clock of another process, as glibc's clock_getcpuclockid(3) builds its id
# (the kernel's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)); Python has no binding for it.
_PROCESS_CLOCKS = sys.platform.startswith("linux")
_CPUCLOCK_SCHED = 2


def _cpu_clock_id(pid: int) -> int:
    return (~pid << 3) | _CPUCLOCK_SCHED


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds a process has used so far (nanosecond resolution on Linux, else user +
    system to one clock tick); None when it is gone or not ours to read."""
    if _PROCESS_CLOCKS:
        try:
            return time.clock_gettime(_cpu_clock_id(pid))
        except OSError:  # EINVAL: no such process
            return None
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return float(times.user) + float(times.system)


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` ([] when it is gone)."""
    try:
        return [int(child.pid) for child in psutil.Process(parent).children()]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def cpu_snapshot(cluster_pids: dict[str, int | None]) -> dict[str, float]:
    """CPU seconds used so far by every cluster process, by this process (the generator's first
    worker, the stats poller and the supervisor thread) and, summed, by this process's other
    children (the generator's spawned workers). Empty where the readings are not available."""
    snapshot: dict[str, float] = {}
    known: set[int] = set()
    for name, pid in cluster_pids.items():
        if pid is None:
            continue
        known.add(pid)
        seconds = cpu_seconds(pid)
        if seconds is not None:
            snapshot[name] = seconds
    me = os.getpid()
    own = cpu_seconds(me)
    if own is None:
        return snapshot
    snapshot[LOADGEN_PROCESS] = own
    known |= IdlePollers.live_pids()  # they run only on otherwise idle CPU: not load
    workers = [cpu_seconds(p) for p in child_pids(me) if p not in known]
    snapshot[LOADGEN_WORKERS] = sum(w for w in workers if w is not None)
    return snapshot


def cpu_per_request(
    start: dict[str, float], end: dict[str, float], requests: int, seconds: float
) -> dict[str, Any] | None:
    """Each process's CPU over a window: microseconds per request sent in it, and cores used."""
    names = [n for n in end if n in start]
    if not names or requests <= 0 or seconds <= 0:
        return None
    used = {n: max(0.0, end[n] - start[n]) for n in names}
    if used.get(LOADGEN_WORKERS) == 0.0:
        del used[LOADGEN_WORKERS]  # one worker: it runs in this process
    return {
        "per_request_us": {n: round(v / requests * 1e6, 1) for n, v in sorted(used.items())},
        "cores": {n: round(v / seconds, 3) for n, v in sorted(used.items())},
        "total_cores": round(sum(used.values()) / seconds, 3),
        "requests": requests,
        "seconds": round(seconds, 3),
        "cpus": os.cpu_count(),
        "source": ("the CPU-time clock of each process (psutil's user + system off Linux) at the "
                   "measure window's start and end"),
    }
