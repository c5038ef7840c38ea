"""Wake-up and stall probes: what a halted CPU and the host cost a message hop.

``zserve bench-wakeup`` (or ``python -m zserve.loadgen.bench.wakeup``) measures round trips of one
byte between two processes over a socket pair, at several gaps, without and with the idle pollers of
``zserve.transport.idle_poll``: the cost of waking a process that was asleep, which every hop
between two zserve processes pays. ``--stalls S`` instead spins one process per CPU for S seconds
and reports each gap between two clock readings longer than ``STALL_MIN_S``: how often and how long
this host takes a CPU away from a running process, the floor under any hop whatever zserve does.

These are benchmarks, so they live with the tools; the pollers themselves are runtime
(``zserve.transport.idle_poll``, started by the supervisor).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from zserve.transport.idle_poll import POLLER_STOP_TIMEOUT_S, IdlePollers, available_cpus

__all__ = ("STALL_MIN_S", "bench", "main", "ping_pong_rtts_us", "spin_gaps", "stall_probe")

# Gaps between ping-pongs, and round trips per gap.
BENCH_GAPS_S = (0.0, 0.001, 0.005, 0.02)
BENCH_ROUND_TRIPS = 400


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
        prog="zserve bench-wakeup",
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
