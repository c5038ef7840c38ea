"""``zserve bench`` against a real (emulated) zserve cluster it starts from cluster.toml: requests
carry the model's signature, and the statistics come over the wire from the backend (batch sizes,
busy time), the rank (its counters) and the frontend (queueing delay)."""

from __future__ import annotations

import json
from pathlib import Path

from zserve.loadgen import cli
from zserve.loadgen.sim.simulator import simulate
from zserve.loadgen.workload import load_workload

CLUSTER = """
[cluster]
name = "loadgen-test"

[scheduler]
shards = 0

[frontends]
count = 1

[backends]
count = 1
device = "emulated"

[[models]]
name = "m"
emulated = { alpha_ms = 1.0, beta_ms = 2.0, input_shape = [4], output_shape = [1] }
slo_ms = 100.0
max_batch = 8
"""

WORKLOAD = """
[workload]
name = "tiny"
gpus = 1
rate = 100.0
arrival = "poisson"
warmup_s = 0.5
measure_s = 1.0
cooldown_s = 0.0

[[models]]
name = "M"          # matched to the cluster's "m" (case-insensitive)
slo_ms = 100.0
alpha_ms = 1.0
beta_ms = 2.0
"""


def test_bench_starts_a_cluster_and_reads_its_statistics(tmp_path: Path) -> None:
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
    sim = simulate(load_workload(workload))
    assert set(sim) - set(live) <= {"sim_requests", "sim_rps_wall", "backends", "frontends"}
    assert live["target"]["models"] == {"M": "m"}
    model = live["per_model"]["M"]
    # Every request was answered, and the frontend accepted the generated inputs.
    assert model["timeouts"] == 0 and "BAD_REQUEST" not in model["error_kinds"]
    assert model["total"] > 50
    assert live["stats"]["processes"] == ["backend-0"]
    assert sum(live["batch_size"]["histogram"].values()) > 0
    assert 0.0 < live["gpu_busy_fraction"] <= 1.0
    assert live["rank"]["grants"] > 0
    assert live["queueing_ms"]["p50"] is not None
    assert "frontend-0" in live["frontend_hops_ms"]
