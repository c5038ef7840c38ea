"""Closed-loop clients (``zserve bench --closed-loop N``) against the demo cluster with its
defaults: the built-in CNN on two CPU backends, SLO 200 ms, the deferred policy. A closed-loop
client sends its next request only once its last is answered, so nothing can join a batch the
scheduler holds back: deferral must notice that waiting gains nothing and stop (before, a sync
client waited 190 ms a request, the SLO, where eager answers in about 5)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from zserve import demo
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import parse_config
from zserve.loadgen.closed_loop import run_closed_loop
from zserve.loadgen.target import target_for_cluster
from zserve.loadgen.workload import load_workload

pytestmark = pytest.mark.slow

WORKLOAD = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "cnn-cpu.toml"
SLO_S = 0.2


def test_closed_loop_clients_are_not_held_for_the_slo() -> None:
    data = tomllib.loads(demo.DEMO_TOML.read_text().replace(":8000", ":0").replace(":8001", ":0")
                         .replace(":8002", ":0"))
    config = parse_config(data)
    assert config.scheduler.policy == "deferred" and config.models[0].slo_ms == SLO_S * 1e3
    workload = load_workload(WORKLOAD)
    with Cluster(config) as cluster:
        target = target_for_cluster(cluster, config, workload, {})
        reports = {clients: run_closed_loop(target, workload, clients=clients, warmup_s=1.0,
                                            measure_s=2.0) for clients in (1, 4)}
    for clients, report in reports.items():
        assert report["errors"] == {} and report["good"] == report["answers"] > 0, report
        # l(b) is a few ms here and the allowances about 3: a batch held to its aim would put
        # the median near the SLO. A quarter of it leaves a loaded host its stalls.
        assert report["latency_ms"]["p50"] < 0.25 * SLO_S * 1e3, (clients, report)
