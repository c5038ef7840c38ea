"""CPU accounting for benchmarks (zserve.loadgen.cpu, psutil): real processes, real CPU time."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from zserve.loadgen.cpu import (
    LOADGEN_PROCESS,
    LOADGEN_WORKERS,
    child_pids,
    cpu_per_request,
    cpu_seconds,
    cpu_snapshot,
)

# The child burns this much CPU, then says so on stdout and waits for its stdin to close.
BURN_S = 0.3
SPINNER = (
    "import sys, time\n"
    f"end = time.process_time() + {BURN_S}\n"
    "while time.process_time() < end: pass\n"
    "print('done', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_cpu_time_of_a_child_that_burns_cpu() -> None:
    child = subprocess.Popen([sys.executable, "-c", SPINNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        assert child.pid in child_pids(os.getpid())
        used = cpu_seconds(child.pid)
        assert used is not None and used >= BURN_S - 0.02  # one clock tick of resolution
        snapshot = cpu_snapshot({"spinner": child.pid, "gone": None})
        assert snapshot["spinner"] >= used
        assert snapshot[LOADGEN_PROCESS] > 0.0
        # The spinner is a named cluster process: not counted again among the workers.
        assert snapshot[LOADGEN_WORKERS] < snapshot["spinner"]
    finally:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        child.wait()
        child.stdout.close()
    assert cpu_seconds(child.pid) is None
    assert child_pids(child.pid) == []


def test_this_process_cpu_time_matches_process_time() -> None:
    start = time.process_time()
    end = start + 0.05
    while time.process_time() < end:
        pass
    used = cpu_seconds(os.getpid())
    assert used is not None and abs(used - time.process_time()) < 0.05


def test_cpu_per_request_over_a_window() -> None:
    start = {"frontend-0": 1.0, LOADGEN_PROCESS: 2.0, LOADGEN_WORKERS: 0.0}
    end = {"frontend-0": 1.5, LOADGEN_PROCESS: 3.0, LOADGEN_WORKERS: 0.0, "late": 9.0}
    out = cpu_per_request(start, end, requests=1000, seconds=2.0)
    assert out is not None
    assert out["per_request_us"] == {"frontend-0": 500.0, LOADGEN_PROCESS: 1000.0}
    assert out["cores"] == {"frontend-0": 0.25, LOADGEN_PROCESS: 0.5}
    assert out["total_cores"] == 0.75
    assert cpu_per_request(start, end, requests=0, seconds=2.0) is None


# Each child burns its own amount, reports its own CPU time, then waits (no more CPU).
SELF_REPORTING = (
    "import sys, time\n"
    "end = time.process_time() + float(sys.argv[1])\n"
    "while time.process_time() < end: pass\n"
    "print(time.process_time(), flush=True)\n"
    "sys.stdin.read()\n"
)
# A reading may exceed the child's own last one by the little it does after reporting.
AFTER_REPORT_S = 0.003


def test_each_process_is_read_under_its_own_name_finer_than_a_clock_tick() -> None:
    """Two children whose CPU differs by 5 ms (half a clock tick): each name reads its own
    child's CPU to within a few ms. Tick-resolution readings (10 ms) made the frontend and the
    generator of a quick protocols run read the same figure, which looked like a mislabel."""
    burns = {"frontend-0": 0.040, "loadgen-like": 0.045}
    children = {name: subprocess.Popen([sys.executable, "-c", SELF_REPORTING, str(burn)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for name, burn in burns.items()}
    try:
        reported = {}
        for name, child in children.items():
            assert child.stdout is not None
            reported[name] = float(child.stdout.readline())
        snapshot = cpu_snapshot({name: child.pid for name, child in children.items()})
        for name in burns:
            assert reported[name] <= snapshot[name] <= reported[name] + AFTER_REPORT_S, (
                name, reported, snapshot)
    finally:
        for child in children.values():
            assert child.stdin is not None and child.stdout is not None
            child.stdin.close()
            child.wait()
            child.stdout.close()


def test_the_protocols_experiment_reads_each_column_from_its_own_processes() -> None:
    from zserve.loadgen.experiments.protocols import _cpu_us

    per = {"frontend-0": 300.0, "shard-0": 100.0, "backend-0": 50.0, "backend-1": 40.0,
           LOADGEN_PROCESS: 20.0, LOADGEN_WORKERS: 110.0}
    assert _cpu_us({"per_request_us": per}) == (300.0, 490.0, 130.0)
    assert _cpu_us(None) == (None, None, None)
