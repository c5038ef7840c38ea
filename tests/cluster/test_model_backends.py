"""A cluster file that places a model on named backends (``[[models]] backends``), in a real
cluster of two emulated backends: only the named backend loads the model, the supervisor's
repository places it there, the rank's membership (the backends' registrations) grants it only
that backend's GPU, and every request of it is answered with outputs. Each backend announces
the device kind the file gives it (``[backends] kinds``), and the rank's table carries it; a
model with a profile file per kind (``[[models]] profiles``) runs and registers each kind's on
its backends, and the shard plans each GPU with its kind's profile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.config.profiles import LatencyProfile, save_profiles

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


FAST_MS = [1.0, 1.5, 2.0, 2.5]  # the model's l(b) on an "a100" backend
SLOW_MS = [4.0, 6.0, 8.0, 10.0]  # and on a "gtx1080ti" one


def test_each_kind_runs_and_is_planned_with_its_own_profile_file(tmp_path: Path) -> None:
    save_profiles(tmp_path / "a100.json", {"k": LatencyProfile.from_table_ms(FAST_MS)}, "a100")
    save_profiles(tmp_path / "gtx.json", {"k": LatencyProfile.from_table_ms(SLOW_MS)},
                  "gtx1080ti")
    config = parse_config({
        "cluster": {"drain_s": 2.0},
        "backends": {"count": 2, "device": "emulated", "kinds": ["a100", "gtx1080ti"]},
        "models": [{"name": "k", "slo_ms": SLO_MS, "max_batch": 4,
                    "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0, "input_shape": [4]},
                    "profiles": {"a100": "a100.json", "gtx1080ti": "gtx.json"}}],
    }, base_dir=tmp_path)
    x = {"x": np.ones((1, 4), dtype=np.float32)}
    (tmp_path / "run").mkdir()
    with Cluster(config, ipc_base=tmp_path / "run") as cluster, \
            zserve.Client(cluster.client_address, timeout=10.0, max_retries=0) as client:
        # each backend runs (and registered) its kind's file, not the emulated line
        assert cluster.stats("backend-0")["profiles_ms"]["k"] == pytest.approx(FAST_MS)
        assert cluster.stats("backend-1")["profiles_ms"]["k"] == pytest.approx(SLOW_MS)
        shard = cluster.stats("shard-0")
        gpu_of = {g["name"]: gpu for gpu, g in shard["rank"]["gpus"].items()}
        # the model's own profile is the slowest (the GTX's); the A100's GPU has its own
        planned = shard["models"]["k"]
        assert planned["l1_ms"] == pytest.approx(SLOW_MS[0])
        assert planned["gpu_l1_ms"] == {gpu_of["backend-0"]: pytest.approx(FAST_MS[0])}
        answered = 0
        for _ in range(REQUESTS):
            try:  # outputs, or on a stalled host a typed DEADLINE (a miss)
                assert "y" in client.infer("k", x)
                answered += 1
            except zserve.DeadlineError:
                pass
        assert answered >= REQUESTS // 2
        ran = [cluster.stats(b) for b in ("backend-0", "backend-1")]
        assert [stats["counters_total"]["plans_refused"] for stats in ran] == [0, 0]
