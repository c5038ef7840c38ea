"""The autoscaler hosted by the simulator (zserve.loadgen.sim.elastic): GPUs released under light
load and added under overload, the drained GPUs' plans all run, every request answered once (the
simulator's invariant checks are on)."""

from __future__ import annotations

from zserve.loadgen.sim.elastic import ElasticConfig
from zserve.loadgen.sim.simulator import SimConfig, simulate, workload_bound_rps
from zserve.loadgen.workload import Workload, parse_workload
from zserve.orchestrator.autoscale import ADD_BAD, RELEASE_IDLE, AutoscalePolicy

POLICY = AutoscalePolicy(max_backends=8, up_window_s=0.5, down_window_s=1.0, settle_s=0.25,
                         down_hold_s=1.0, min_requests=50)


def two_models(gpus: int, rate: float, measure_s: float) -> Workload:
    models = [{"name": f"m{i}", "slo_ms": 100.0, "alpha_ms": 2.05, "beta_ms": 5.378}
              for i in range(2)]
    return parse_workload({"workload": {
        "name": "elastic", "gpus": gpus, "policy": "deferred", "arrival": "poisson",
        "warmup_s": 0.0, "measure_s": measure_s, "cooldown_s": 0.2, "jitter_ms": 1.0,
        "rate": rate}, "models": models}, source="elastic")


def run(start: int, load: float) -> dict:  # type: ignore[type-arg]
    rate = load * workload_bound_rps(two_models(8, 1.0, 1.0))
    config = SimConfig(autoscale=ElasticConfig(POLICY, start, start_delay_s=0.1, tick_s=0.1))
    return simulate(two_models(8, rate, 3.0), config)


def test_light_load_releases_the_highest_gpus_and_loses_nothing() -> None:
    report = run(8, 0.2)
    timeline = report["autoscale"]["timeline"]
    assert timeline[-1]["serving"] <= 4, timeline[-1]  # from 8: half at most per release
    assert any(row["reason"] == RELEASE_IDLE for row in timeline)
    assert all(change < 0 for _, change in report["autoscale"]["changes"])
    # the simulator checked every request was answered exactly once; none was lost or late
    assert report["bad_rate_all"] == 0.0
    assert report["autoscale"]["allocated_gpu_s"] < 8 * timeline[-1]["t"]


def test_overload_adds_gpus_that_join_after_their_start_delay() -> None:
    report = run(2, 0.75)
    timeline = report["autoscale"]["timeline"]
    first_add = next(row for row in timeline if row["change"] > 0)
    assert first_add["reason"] == ADD_BAD and first_add["starting"] == first_add["change"]
    assert timeline[-1]["serving"] >= 5, timeline[-1]
    late = [row for row in timeline if row["t"] >= timeline[-1]["t"] - 1.0]
    assert sum(row["bad"] for row in late) <= 0.01 * sum(row["answered"] for row in late)
