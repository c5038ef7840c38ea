"""Request sizes in workloads: ``[workload] request_rows`` is strictly typed, the simulator draws
each request's rows and batches them in rows, and the live load generator sends requests of
those sizes to a real cluster; both report rows/s beside requests/s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zserve.loadgen import cli
from zserve.loadgen.load_plan import plan_for_workload
from zserve.loadgen.sim.simulator import SimConfig, Simulator
from zserve.loadgen.workload import WorkloadError, parse_workload

MODEL = {"name": "m", "slo_ms": 100.0, "alpha_ms": 1.0, "beta_ms": 2.0, "max_batch": 16}


def _workload(request_rows: dict[str, Any] | None, **table: Any) -> Any:
    workload: dict[str, Any] = {"gpus": 2, "rate": 400.0, "warmup_s": 0.5, "measure_s": 2.0,
                                "cooldown_s": 0.2, **table}
    if request_rows is not None:
        workload["request_rows"] = request_rows
    return parse_workload({"workload": workload, "models": [MODEL]})


@pytest.mark.parametrize(("rows", "message"), [
    ({"dist": "normal"}, "workload.request_rows.dist: Invalid value 'normal'"),
    ({"dist": "constant", "rows": 0}, "workload.request_rows.rows: must be >= 1"),
    ({"dist": "constant", "rows": "4"}, "workload.request_rows.rows: must be an integer"),
    ({"dist": "uniform", "min": 4, "max": 2}, "workload.request_rows.max: must be >= min (4)"),
    ({"dist": "uniform", "min": 1}, "workload.request_rows.max: required"),
    ({"dist": "choice", "values": []}, "workload.request_rows.values: must be of length >= 1"),
    ({"dist": "choice", "values": [1, 2], "weights": [1.0]},
     "workload.request_rows.weights: needs one weight per value (2), got 1"),
    ({"dist": "constant", "rows": 2, "max": 3}, "workload.request_rows.max: unknown key"),
    ({"dist": "constant", "rows": 17},
     "workload.request_rows: a request of 17 rows exceeds model m's max_batch of 16"),
], ids=str)
def test_request_rows_errors_name_the_key(rows: dict[str, Any], message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        _workload(rows)
    assert message in str(info.value)


def test_each_distribution_draws_its_values() -> None:
    constant = _workload({"dist": "constant", "rows": 4})
    uniform = _workload({"dist": "uniform", "min": 2, "max": 5})
    choice = _workload({"dist": "choice", "values": [1, 8], "weights": [3.0, 1.0]})
    assert np.all(plan_for_workload(constant).rows == 4)
    drawn = plan_for_workload(uniform).rows
    assert drawn is not None and set(drawn.tolist()) == {2, 3, 4, 5}
    picked = plan_for_workload(choice).rows
    assert picked is not None and set(picked.tolist()) == {1, 8}
    assert 0.6 < float(np.mean(picked == 1)) < 0.9
    assert plan_for_workload(_workload(None)).rows is None  # one row each: no per-request list


def test_the_simulator_batches_rows_and_never_splits_a_request() -> None:
    workload = _workload({"dist": "choice", "values": [1, 3, 8]})
    sim = Simulator(workload, SimConfig(record_plans=True))  # check=True: every invariant
    report = sim.run()
    assert sim.rows_all is not None
    index_of = sim.index_of_rid
    planned: list[int] = []
    for plan in sim.plans:
        rows = plan.rows or [1] * len(plan.request_ids)  # empty: a batch of one-row requests
        assert len(rows) == len(plan.request_ids)
        assert sum(rows) <= 16
        indexes = [index_of[rid] for rid in plan.request_ids]
        assert rows == sim.rows_all[indexes].tolist()  # each request whole, its own rows
        planned.extend(indexes)
    assert len(planned) == len(set(planned))
    assert any(len(set(plan.rows)) > 1 for plan in sim.plans)  # sizes shared batches
    assert report["request_rows"] == "choice:1,3,8"
    assert 3.0 < report["mean_rows"] < 5.0
    assert report["good_rows_per_s"] > 2.5 * report["good_rps"]
    assert max(int(size) for size in report["batch_size"]["histogram"]) <= 16


def test_one_row_per_request_is_the_default_and_changes_nothing() -> None:
    plain = Simulator(_workload(None)).run()
    explicit = Simulator(_workload({"dist": "constant", "rows": 1})).run()
    for key in ("good_rps", "offered_rps", "bad_rate", "batch_size", "latency_ms"):
        assert plain[key] == explicit[key]
    assert plain["good_rows_per_s"] == plain["good_rps"]


CLUSTER = """
[cluster]
name = "rows-bench"

[backends]
count = 1
device = "emulated"

[[models]]
name = "m"
emulated = { alpha_ms = 1.0, beta_ms = 2.0, input_shape = [4], output_shape = [1] }
slo_ms = 300.0
max_batch = 16
"""

WORKLOAD = """
[workload]
gpus = 1
rate = 100.0
warmup_s = 0.5
measure_s = 1.0
cooldown_s = 0.0
request_rows = { dist = "choice", values = [1, 4, 8] }

[[models]]
name = "m"
slo_ms = 300.0
alpha_ms = 1.0
beta_ms = 2.0
max_batch = 16
"""


def test_the_live_generator_sends_requests_of_the_drawn_sizes(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(CLUSTER)
    workload = tmp_path / "workload.toml"
    workload.write_text(WORKLOAD)
    out = tmp_path / "report.json"
    code = cli.main([str(cluster), str(workload), "--json", str(out), "--max-lateness-ms",
                     "1000", "--quiet"])
    assert code == cli.EXIT_OK
    live = json.loads(out.read_text())
    model = live["per_model"]["m"]
    # Every request was answered and the frontend accepted inputs of every size.
    assert model["timeouts"] == 0 and not model["error_kinds"]
    assert model["total"] > 50
    assert live["request_rows"] == "choice:1,4,8"
    assert live["good_rows_per_s"] > 2.0 * live["good_rps"]
    sizes = {int(size): count for size, count in live["batch_size"]["histogram"].items()}
    assert max(sizes) <= 16 and any(size not in (1, 4, 8) for size in sizes)
