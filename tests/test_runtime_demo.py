"""``zserve demo``'s goodput part on the real demo cluster (the built-in CNN on two CPU
backends): its analytic bound comes from the profile the backends measured at start-up."""

from __future__ import annotations

from typing import Any

import pytest

from zserve import demo
from zserve.config import parse_config
from zserve.loadgen.search import search_goodput
from zserve.loadgen.sim import workload_bound_rps
from zserve.supervisor import Cluster

pytestmark = pytest.mark.slow

# Above the search's floor (100 measured requests in a 2 s probe) and low: the test is about where
# the bound comes from, which does not depend on the probe's verdict.
START_RPS = 100.0


def test_demo_bound_comes_from_the_profile_measured_at_start_up() -> None:
    # The demo's OIP servers on ports the kernel picks: tests never take fixed ports.
    frontends = {**demo.DEMO_CONFIG["frontends"], "http_addresses": ["127.0.0.1:0"],
                 "grpc_addresses": ["127.0.0.1:0"]}
    config = parse_config({**demo.DEMO_CONFIG, "frontends": frontends})
    model = config.models[0]
    assert model.alpha_ms is None and model.profile is None  # nothing configured: measured
    with Cluster(config) as cluster:
        tables = [cluster.stats(name)["profiles_ms"][model.name]
                  for role, name, _ in config.process_names() if role == "backend"]
        profile = demo.startup_profile(cluster, config, model)
        # A budget of 0 s: one probe, then the search stops.
        report = demo.measure_goodput(cluster, config, model, START_RPS, 0.0)
    assert len(tables) == config.backends.total
    slowest = [max(t[b] for t in tables) for b in range(min(len(t) for t in tables))]
    assert profile.latency_ms_list() == pytest.approx(slowest)
    workload = demo.demo_workload(config, model, START_RPS, profile)
    assert workload.models[0].profile.latency_ms_list() == pytest.approx(slowest)
    expected_bound = workload_bound_rps(workload)
    assert len(report["search"]["probes"]) == 1
    assert report["bound_rps"] == pytest.approx(expected_bound, abs=0.1)


def test_demo_search_stops_at_its_time_budget_or_below_its_floor() -> None:
    """Halving below the floor cannot pass a probe (too few requests to judge): once there, the
    search stops instead of filling the headline with 40 instant probes of no verdict."""
    floor_rps = 50.0
    assert not demo.search_should_stop(86.8, 10.0, ends_at=20.0, floor_rps=floor_rps)
    assert demo.search_should_stop(43.4, 10.0, ends_at=20.0, floor_rps=floor_rps)
    assert demo.search_should_stop(400.0, 20.0, ends_at=20.0, floor_rps=floor_rps)

    def probe(rate: float) -> dict[str, Any]:
        return {"bad_rate": 1.0, "bailed": True}  # the generator falls behind at every rate

    found = search_goodput(probe, 347.2, on_probe=lambda rate, report: demo.search_should_stop(
        rate, 0.0, ends_at=20.0, floor_rps=floor_rps))
    assert [p["rate"] for p in found["search"]["probes"]] == [347.2, 173.6, 86.8, 43.4]
    assert found["goodput_rps"] == 0.0
