"""The simulator hosts the FrontendCore: admission, deadline answers from the core's timer, exactly
one answer per request, the report's counts, and a cluster file's frontend settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zserve.config.cluster import ClusterConfig, parse_config
from zserve.core.request_ids import MAX_FRONTENDS
from zserve.frontend.core import TIMER_COALESCE_S
from zserve.loadgen.sim import cli
from zserve.loadgen.sim.frontends import DROPPED, GOOD, PENDING
from zserve.loadgen.sim.simulator import InvariantError, SimConfig, Simulator
from zserve.loadgen.workload import parse_workload

SLO_A_S = 0.025


def _workload(**section: Any) -> Any:
    """Two models on two GPUs, every arrival in the measure window."""
    table = {"gpus": 2, "rate": 400.0, "warmup_s": 0.0, "measure_s": 1.0, "cooldown_s": 0.0,
             **section}
    return parse_workload({"workload": table, "models": [
        {"name": "a", "slo_ms": SLO_A_S * 1e3, "alpha_ms": 1.053, "beta_ms": 5.072},
        {"name": "b", "slo_ms": 40.0, "alpha_ms": 2.0, "beta_ms": 8.0, "max_batch": 16},
    ]})


def _cluster(max_queue: int, frontends: int = 1) -> ClusterConfig:
    models = [{"name": name, "emulated": {"alpha_ms": 1.0, "beta_ms": 5.0},
               "max_queue": max_queue} for name in ("a", "b")]
    return parse_config({"frontends": {"count": frontends}, "models": models})


def _assert_one_answer_each(sim: Simulator, report: dict[str, Any]) -> None:
    """Every request was answered (AnswerLog refuses a second answer), nothing is left in a
    core, and the report's counts add up to the requests."""
    assert not np.any(sim.status == PENDING)
    assert all(not frontend.core.pending for frontend in sim.frontends)
    assert sum(report["frontends"]["answers"].values()) == sim.n_requests
    for entry in report["per_model"].values():
        assert entry["good"] + entry["late"] + entry["dropped"] + entry["errors"] == \
            entry["total"]
        assert sum(entry["error_kinds"].values()) == entry["dropped"] + entry["errors"]


def test_a_burst_beyond_the_queue_bound_is_refused_overloaded() -> None:
    # 50 requests of "a" at one instant; the frontend queues at most 10 of a model
    sim = Simulator(_workload(), SimConfig(frontend=_cluster(max_queue=10)),
                    arrivals=[np.full(50, 0.5), np.empty(0)])
    report = sim.run()
    entry = report["per_model"]["a"]
    assert entry["error_kinds"] == {"OVERLOADED": 40}
    assert entry["good"] == 10 and entry["total"] == 50
    assert report["frontends"]["max_queue"] == {"a": 10, "b": 10}
    # refused at once, in arrival order: the first ten got through
    refused = np.flatnonzero(sim.answers.error_kind >= 0)
    assert list(refused) == list(range(10, 50))
    assert list(sim.answers.answered_at[refused]) == [0.5] * 40
    _assert_one_answer_each(sim, report)


def test_without_a_cluster_file_no_admission_bound_applies() -> None:
    sim = Simulator(_workload(), arrivals=[np.full(2000, 0.5), np.empty(0)])
    report = sim.run()
    assert report["frontends"]["max_queue"] == {"a": None, "b": None}
    assert "OVERLOADED" not in report["frontends"]["answers"]
    assert report["per_model"]["a"]["errors"] == 0
    _assert_one_answer_each(sim, report)


def test_deadlines_are_answered_by_the_core_timer() -> None:
    # A frontend tick longer than the SLO: request 0's metadata reaches the scheduler 30 ms
    # after it arrived, 5 ms after its SLO; the core's timer answers it DEADLINE once its SLO
    # has passed (one coalescing window after it), and the scheduler's later drop of it is not
    # a second answer.
    sim = Simulator(_workload(sim_tick_ms=30.0), arrivals=[np.array([0.0, 0.02]), np.empty(0)])
    report = sim.run()
    assert sim.status[0] == DROPPED
    assert sim.answers.answered_at[0] == pytest.approx(SLO_A_S + TIMER_COALESCE_S)
    assert sim.models[0].n_arrived == 2 and sim.models[0].n_dropped == 1
    # request 1 reached the scheduler at 30 ms with 15 ms left: served in time
    assert sim.status[1] == GOOD
    assert 0.03 < sim.answers.answered_at[1] <= 0.02 + SLO_A_S
    assert report["frontends"]["answers"] == {"outputs": 1, "DEADLINE": 1}
    _assert_one_answer_each(sim, report)


@pytest.mark.parametrize("frontends", [1, 2])
def test_every_request_gets_one_outcome_under_overload(frontends: int) -> None:
    # 8x what two GPUs serve: refusals, drops, shed rows and outputs, one answer each
    cluster = _cluster(max_queue=16, frontends=frontends)
    sim = Simulator(_workload(rate=12000.0, measure_s=0.3),
                    SimConfig(frontend=cluster, record_plans=True))
    report = sim.run()
    answers = report["frontends"]["answers"]
    assert answers["OVERLOADED"] > 0 and answers["DEADLINE"] > 0 and answers["outputs"] > 0
    assert report["frontends"]["count"] == frontends
    if frontends == 2:  # both cores admitted requests, and batches mix the two
        assert {rid % MAX_FRONTENDS for rid in sim.index_of_rid} == {0, 1}
        assert any(len(plan.frontends) == 2 for plan in sim.plans)
    _assert_one_answer_each(sim, report)


def test_a_second_answer_breaks_an_invariant() -> None:
    sim = Simulator(_workload(), arrivals=[np.array([0.0]), np.empty(0)])
    sim.answers.record(0.001, 0, None)
    with pytest.raises(InvariantError, match="answered twice"):
        sim.answers.record(0.002, 0, "DEADLINE")


def test_sim_cli_takes_the_frontend_settings_of_a_cluster_file(tmp_path: Path) -> None:
    workload = tmp_path / "w.toml"
    workload.write_text(
        "[workload]\ngpus = 2\nrate = 3000.0\nwarmup_s = 0.1\nmeasure_s = 0.3\ncooldown_s = 0.0\n"
        '[[models]]\nname = "a"\nslo_ms = 25.0\nalpha_ms = 1.053\nbeta_ms = 5.072\n')
    cluster = tmp_path / "c.toml"
    cluster.write_text(
        "[frontends]\ncount = 2\nreply_allowance_ms = 1.0\n"
        # named as zserve bench matches it: case aside
        '[[models]]\nname = "A"\nmax_queue = 4\n[models.emulated]\nalpha_ms = 1.0\n'
        "beta_ms = 5.0\n")
    out = tmp_path / "r.json"
    assert cli.main([str(workload), "--allowances-from", str(cluster), "--quiet",
                         "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["frontends"]["count"] == 2
    assert report["frontends"]["max_queue"] == {"a": 4}
    assert report["per_model"]["a"]["error_kinds"]["OVERLOADED"] > 0
    assert report["allowances_ms"]["reply"] == 1.0
    plain = tmp_path / "plain.json"
    assert cli.main([str(workload), "--quiet", "--json", str(plain)]) == 0
    assert json.loads(plain.read_text())["frontends"]["max_queue"] == {"a": None}

