"""A cluster file that places a model on named backends (``[[models]] backends``), in a real
cluster of two emulated backends: only the named backend loads the model, the supervisor's
repository places it there, the rank's membership (the backends' registrations) grants it only
that backend's GPU, and every request of it is answered with outputs. Each backend announces
the device kind the file gives it (``[backends] kinds``), and the rank's table carries it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config

SLO_MS = 1000.0  # room for a loaded host's stalls: the test is about where models run
REQUESTS = 20


def _config() -> ClusterConfig:
    model = {"slo_ms": SLO_MS, "max_batch": 4,
             "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0, "input_shape": [4]}}
    return parse_config({
        "cluster": {"drain_s": 2.0},
        "backends": {"count": 2, "device": "emulated", "kinds": ["a100", "gtx1080ti"]},
        "models": [{"name": "placed", "backends": ["backend-1"], **model},
                   {"name": "everywhere", **model}],
    })


def test_a_model_named_on_one_backend_runs_only_there(tmp_path: Path) -> None:
    x = {"x": np.ones((1, 4), dtype=np.float32)}
    with Cluster(_config(), ipc_base=tmp_path) as cluster, \
            zserve.Client(cluster.client_address, timeout=10.0, max_retries=0) as client:
        gpus = cluster.stats("shard-0")["rank"]["gpus"]  # the embedded rank's table
        assert sorted((g["name"], g["kind"]) for g in gpus.values()) == [
            ("backend-0", "a100"), ("backend-1", "gtx1080ti")]
        assert sorted(cluster.stats("backend-0")["models"]) == ["everywhere"]
        assert sorted(cluster.stats("backend-1")["models"]) == ["everywhere", "placed"]
        assert cluster.supervisor is not None
        repository = cluster.supervisor.repository
        assert repository.served_by("backend-0") == ["everywhere"]
        assert sorted(repository.served_by("backend-1")) == ["everywhere", "placed"]
        answered = {"placed": 0, "everywhere": 0}
        for _ in range(REQUESTS):
            for model in answered:  # outputs, or on a stalled host a typed DEADLINE (a miss):
                try:  # never UNAVAILABLE, which a plan refused on backend-0 would answer
                    assert "y" in client.infer(model, x)
                    answered[model] += 1
                except zserve.DeadlineError:
                    pass
        assert min(answered.values()) >= REQUESTS // 2, answered
        # "placed" ran only on backend-1 (its batches by model), and no plan was refused
        ran = {b: cluster.stats(b) for b in ("backend-0", "backend-1")}
        assert "placed" not in ran["backend-0"]["batch_sizes"]
        assert "placed" in ran["backend-1"]["batch_sizes"]
        assert [stats["counters_total"]["plans_refused"] for stats in ran.values()] == [0, 0]
