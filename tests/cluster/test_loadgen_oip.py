"""The load generator sends through the frontend's OIP servers (``--protocol``): every request
of a light open-loop run is answered, good, through each path; and a refused request is recorded
with its zserve error kind, read from the HTTP body or the gRPC trailers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from oip_helpers import oip_cluster

from zserve.cluster.supervisor import Cluster
from zserve.loadgen.generator import run_load
from zserve.loadgen.load_plan import ERROR_INDEX, LoadPlan, Outcome, plan_for_workload
from zserve.loadgen.sender import PROTOCOLS
from zserve.loadgen.workload import parse_workload

INPUTS = {"x": np.zeros((1, 4), dtype=np.float32)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = oip_cluster(slow_beta_ms=1000.0, slow_slo_ms=3000.0, slow_max_queue=1)
    with Cluster(config, ipc_base=tmp_path_factory.mktemp("loadgen-oip")) as running:
        yield running


def _plan(model: str, rate: float, measure_s: float) -> LoadPlan:
    return plan_for_workload(parse_workload({
        "workload": {"gpus": 1, "rate": rate, "arrival": "constant", "warmup_s": 0.2,
                     "measure_s": measure_s, "cooldown_s": 0.1, "policy": "deferred"},
        "models": [{"name": model, "slo_ms": 5000.0 if model == "m" else 3000.0,
                    "alpha_ms": 1.0, "beta_ms": 2.0}],
    }, source="test"))


def _addresses(cluster: Cluster, protocol: str) -> list[str]:
    if protocol == "native":
        return cluster.client_addresses
    return cluster.grpc_addresses if protocol == "grpc" else cluster.http_addresses


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_request_answered_through_each_path(cluster: Cluster, protocol: str) -> None:
    result = run_load(_plan("m", 40.0, 1.0), _addresses(cluster, protocol),
                      inputs={"m": INPUTS}, protocol=protocol, refuse_if_behind=False)
    counts = result.outcome_counts(measured=False)
    kinds = sorted(set(result.error_kind[result.outcome == Outcome.ERROR].tolist()))
    assert counts["good"] + counts["late"] == len(result.plan), (counts, kinds)


@pytest.mark.parametrize("protocol", PROTOCOLS[1:])
def test_refusals_are_recorded_by_kind(cluster: Cluster, protocol: str) -> None:
    """Model ``slow`` queues one request for about 2 s: the others of a burst are OVERLOADED."""
    result = run_load(_plan("slow", 20.0, 0.5), _addresses(cluster, protocol),
                      inputs={"slow": INPUTS}, protocol=protocol, refuse_if_behind=False)
    errors = result.error_kind[result.outcome == Outcome.ERROR]
    assert len(errors) > 0 and set(errors.tolist()) == {ERROR_INDEX["OVERLOADED"]}


def test_unknown_protocol_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown protocol"):
        run_load(_plan("m", 10.0, 0.1), "127.0.0.1:1", inputs={"m": INPUTS},
                 protocol="carrier-pigeon", refuse_if_behind=False)
