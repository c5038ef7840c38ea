"""``zserve bench`` on a two-model emulated cluster: batch sizes per model (the backends name each
batch's model) and the true queueing delay (batch start - admission, from the frontends)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from zserve.loadgen import cli
from zserve.loadgen.report import ModelOutcome, build_report
from zserve.loadgen.stats_poller import StatsSample, stats_window

CLUSTER = """
[cluster]
name = "loadgen-per-model"

[scheduler]
shards = 0

[frontends]
count = 1

[backends]
count = 1
device = "emulated"

[[models]]
name = "a"
emulated = { alpha_ms = 1.0, beta_ms = 2.0, input_shape = [4], output_shape = [1] }
slo_ms = 100.0
max_batch = 8

[[models]]
name = "b"
emulated = { alpha_ms = 0.5, beta_ms = 1.0, input_shape = [4], output_shape = [1] }
slo_ms = 100.0
max_batch = 8
"""

WORKLOAD = """
[workload]
name = "two"
gpus = 1
rate = 120.0
arrival = "poisson"
warmup_s = 0.5
measure_s = 1.0
cooldown_s = 0.0

[[models]]
name = "a"
slo_ms = 100.0
alpha_ms = 1.0
beta_ms = 2.0

[[models]]
name = "b"
slo_ms = 100.0
alpha_ms = 0.5
beta_ms = 1.0
"""


def test_stats_window_splits_batch_sizes_by_model() -> None:
    samples = [
        StatsSample(1.0, 1.0, "backend-0",
                        {"samples": {"batch_size": [1, 4, 2], "batch_model": ["a", "b", "a"]}}),
        StatsSample(1.0, 1.0, "backend-1",
                        {"samples": {"batch_size": [3], "batch_model": ["b"]}}),
    ]
    window = stats_window(samples, 0.0, 1.0)
    assert window is not None
    a, b = window.sizes_of("a"), window.sizes_of("b")
    assert a is not None and b is not None
    assert a.tolist() == [1, 2] and b.tolist() == [4, 3]
    # A backend that does not name its batches' models: no per-model split.
    samples.append(StatsSample(1.0, 1.0, "old", {"samples": {"batch_size": [5]}}))
    old = stats_window(samples, 0.0, 1.0)
    assert old is not None and old.sizes_of("a") is None and len(old.batch_sizes) == 5


def test_report_has_a_batch_histogram_per_model() -> None:
    empty = np.empty(0)
    outcomes = [
        ModelOutcome("a", 100.0, 3, 3, 0, 0, np.ones(3), batch_sizes=np.array([1, 2, 2])),
        ModelOutcome("b", 100.0, 1, 1, 0, 0, np.ones(1), batch_sizes=np.array([4])),
        ModelOutcome("c", 100.0, 0, 0, 0, 0, empty),
    ]
    report = build_report(outcomes, source="live", workload="w", policy="p", drop="d", seed=0,
                          gpus=1, measure_s=1.0, gpu_busy_fraction=None)
    assert report["per_model"]["a"]["batch_histogram"] == {"1": 1, "2": 2}
    assert report["per_model"]["a"]["median_batch"] == 2.0
    assert report["per_model"]["b"]["batch_histogram"] == {"4": 1}
    assert report["per_model"]["c"]["batch_histogram"] is None
    assert report["batch_size"]["histogram"] == {"1": 1, "2": 2, "4": 1}


def test_bench_reports_per_model_batches_and_true_queueing(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(CLUSTER)
    workload = tmp_path / "workload.toml"
    workload.write_text(WORKLOAD)
    out = tmp_path / "report.json"
    code = cli.main([
        str(cluster), str(workload), "--json", str(out), "--max-lateness-ms", "1000", "--quiet",
    ])
    assert code == cli.EXIT_OK
    live = json.loads(out.read_text())
    total_batches = 0
    for name in ("a", "b"):
        model = live["per_model"][name]
        assert model["total"] > 20 and model["timeouts"] == 0
        assert model["median_batch"] is not None and model["median_batch"] >= 1
        assert sum(model["batch_histogram"].values()) == model["batches"] > 0
        assert model["queueing_p50_ms"] is not None
        total_batches += model["batches"]
    assert sum(live["batch_size"]["histogram"].values()) == total_batches
    queueing = live["queueing_ms"]
    assert queueing["source"].startswith("frontend queueing")
    # Deferred scheduling: a request waits for its batch, but never past its SLO.
    assert 0.0 < queueing["p50"] < 100.0
