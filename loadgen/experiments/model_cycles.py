"""``model-cycles``: a backend's memory across repeated live loads and unloads of one model.

A real cluster (one CPU backend, real ONNX Runtime sessions) whose model repository holds the
built-in CNN, not loaded at start; the experiment loads and unloads it ``CYCLES`` times through
the frontend's OIP HTTP repository endpoints (each load opens, warms at every batch size and
announces the model; each unload withdraws it, closes its session and collects) and reads the
backend process's resident set size (``VmRSS``) after each step. The first cycle brings ONNX
Runtime's libraries and thread pools in for good, so the baseline is the RSS after the first
unload; the check: the RSS after the last unload is within ``LEAK_FRACTION`` of one loaded
model's footprint of that baseline (a leaked session per cycle would add a whole footprint per
cycle), and the trend fitted over the second half of the cycles, carried over all N of them, is
below that too (the allocator settles in the first cycles; a leak goes on growing).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from zserve.backends.builtin import ensure_builtin
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.loadgen.experiments.common import Check, Options, Outcome, Table

CYCLES = 50
QUICK_CYCLES = 10
MODEL = "cnn"
MAX_BATCH = 8
LEAK_FRACTION = 0.1
# The trend is judged only over this many cycles or more (--quick runs fewer).
TREND_MIN_CYCLES = 40
HTTP_TIMEOUT_S = 120.0
MIB = 1024 * 1024


def cycles_cluster(repository: Path) -> ClusterConfig:
    """One CPU backend, the OIP HTTP server on a kernel-chosen port, the repository not loaded
    at start."""
    model_dir = repository / MODEL
    (model_dir / "1").mkdir(parents=True)
    shutil.copy(ensure_builtin("cnn"), model_dir / "1" / "model.onnx")
    (model_dir / "config.toml").write_text(f"slo_ms = 200.0\nmax_batch = {MAX_BATCH}\n")
    return parse_config({
        "frontends": {"http_addresses": ["127.0.0.1:0"]},
        "backends": {"count": 1, "device": "cpu"},
        "repository": {"path": str(repository)},
    })


def rss_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` (``/proc/<pid>/status`` VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _post(address: str, path: str) -> None:
    request = urllib.request.Request(f"http://{address}{path}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
        response.read()


def measure(cycles: int) -> dict[str, Any]:
    """RSS (bytes) of the backend at start and after each load and unload."""
    with tempfile.TemporaryDirectory(prefix="zs-cycles-") as folder, Cluster(
            cycles_cluster(Path(folder) / "repository"), ipc_base=folder) as cluster:
        pid = cluster.pids()["backend-0"]
        assert pid is not None
        address = cluster.http_addresses[0]
        started = rss_bytes(pid)
        loaded, unloaded, seconds = [], [], []
        for _ in range(cycles):
            began = time.perf_counter()
            _post(address, f"/v2/repository/models/{MODEL}/load")
            loaded.append(rss_bytes(pid))
            _post(address, f"/v2/repository/models/{MODEL}/unload")
            unloaded.append(rss_bytes(pid))
            seconds.append(time.perf_counter() - began)
    return {"started": started, "loaded": loaded, "unloaded": unloaded, "cycle_s": seconds}


def _slope(values: list[int]) -> float:
    """Least-squares slope of ``values`` per step (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    xs = range(len(values))
    return float(statistics.linear_regression(xs, values).slope)


def run_model_cycles(opts: Options) -> Outcome:
    cycles = QUICK_CYCLES if opts.quick else CYCLES
    opts.say(f"model-cycles: {cycles} load/unload cycles of {MODEL} on one CPU backend")
    points = measure(cycles)
    loaded, unloaded = points["loaded"], points["unloaded"]
    baseline = unloaded[0]
    footprint = statistics.median(loaded) - statistics.median(unloaded)
    drift = unloaded[-1] - baseline
    half = unloaded[len(unloaded) // 2:]
    trend = _slope(half) * len(unloaded)
    rows = [["at start (nothing loaded)", points["started"] / MIB, "-"],
            ["after the first load", loaded[0] / MIB, "-"],
            ["after the first unload (baseline)", baseline / MIB, 0.0],
            ["loaded, median of all cycles", statistics.median(loaded) / MIB, "-"],
            [f"after unload {len(unloaded)} (the last)", unloaded[-1] / MIB, drift / MIB],
            ["after unloads 2..N: max", max(unloaded[1:] or [baseline]) / MIB,
             (max(unloaded[1:] or [baseline]) - baseline) / MIB],
            [f"trend over unloads {len(unloaded) - len(half) + 1}..N, times N", "-",
             trend / MIB]]
    table = Table(f"backend RSS (MiB) across {cycles} load/unload cycles of the built-in "
                  f"{MODEL} (max batch {MAX_BATCH}; one cycle took "
                  f"{statistics.median(points['cycle_s']):.2f} s, median)",
                  ["when", "RSS MiB", "vs baseline MiB"], rows)
    bound = LEAK_FRACTION * footprint
    checks = [
        Check("the RSS after the last unload is back at the baseline", drift <= bound,
              f"{drift / MIB:+.1f} MiB vs a bound of {bound / MIB:.1f} MiB "
              f"({LEAK_FRACTION:.0%} of one loaded model's {footprint / MIB:.1f} MiB)"),
    ]
    if cycles >= TREND_MIN_CYCLES:  # the allocator settles over the first ~20 cycles
        checks.append(Check("no upward trend across the cycles", trend <= bound,
                            f"{trend / MIB:+.2f} MiB over {cycles} cycles at the second "
                            "half's rate"))
    config = {"cycles": cycles, "model": MODEL, "max_batch": MAX_BATCH, "device": "cpu",
              "leak_fraction": LEAK_FRACTION}
    return Outcome(config=config, tables=[table], checks=checks, points=points)


__all__ = ["CYCLES", "cycles_cluster", "measure", "rss_bytes", "run_model_cycles"]
