"""Re-planning in a real cluster (two emulated backends, two sub-clusters of one backend each):
both models are served by both backends at start; once traffic has been measured, the plan
period's (first, fresh) plan puts each model in a sub-cluster of its own, and the supervisor's
orchestrator moves them there live, make-before-break: each backend ends up serving one model,
and requests of both are answered throughout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from runtime_helpers import wait_until

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config

SLO_MS = 1000.0  # the test is about moves: room for a loaded host's stalls
BACKENDS = ("backend-0", "backend-1")
MODELS = ("left", "right")


def _config() -> ClusterConfig:
    return parse_config({
        "cluster": {"drain_s": 2.0},
        "backends": {"count": 2, "device": "emulated"},
        "models": [{"name": name, "slo_ms": SLO_MS, "max_batch": 4,
                    "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0, "input_shape": [4]}}
                   for name in MODELS],
        "orchestration": {"subclusters": 2, "plan_period_s": 1.0, "rate_window_s": 10.0},
    })


def test_a_replan_moves_each_model_to_its_own_subcluster_live(tmp_path: Path) -> None:
    x = {"x": np.ones((1, 4), dtype=np.float32)}
    with Cluster(_config(), ipc_base=tmp_path) as cluster, \
            zserve.Client(cluster.client_address, timeout=10.0, max_retries=0) as client:
        assert [sorted(cluster.stats(b)["models"]) for b in BACKENDS] == [list(MODELS)] * 2
        late: list[str] = []

        def split_after_traffic() -> list[list[str]] | None:
            for model in MODELS:  # every request is answered, moving or not: with outputs,
                try:  # or, on a stalled host, a typed DEADLINE (a miss, not a request lost)
                    assert "y" in client.infer(model, x)
                except zserve.DeadlineError:
                    late.append(model)
            served = [sorted(cluster.stats(b)["models"]) for b in BACKENDS]
            return served if sorted(m for s in served for m in s) == list(MODELS) else None

        served = wait_until(split_after_traffic, "each model to be moved to one backend")
        assert len(late) <= 2, late
        assert all(len(models) == 1 for models in served)
        assert cluster.supervisor is not None and cluster.supervisor.orchestrator is not None
        assert cluster.supervisor.orchestrator.core.plans >= 1
        for model in MODELS:
            assert "y" in client.infer(model, x)
