"""A cluster's statistics through its frontend's client socket (what ``zserve bench ADDRESS``
reads): ``ClusterStatsRequest`` gathers the scheduler's and the backends' stats, and
``reset`` starts every counter again; the backend's per-model batch sizes are in them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from runtime_helpers import ask_frontend_stats

import zserve
from zserve.client.cluster_stats import FRONTEND_AT_ADDRESS, frontend_stats_reader
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import parse_config
from zserve.transport.messages import ClusterStatsRequest


def _ask(address: str, *, reset: bool) -> dict[str, Any]:
    return ask_frontend_stats(address, ClusterStatsRequest(reset=reset), b"test-cluster-stats")


def test_frontend_gathers_and_resets_cluster_stats(tmp_path: Path) -> None:
    config = parse_config({
        "cluster": {"drain_s": 2.0},
        "scheduler": {"shards": 0, "d_ctrl_ms": 5.0},
        "frontends": {"count": 1, "reply_allowance_ms": 20.0},
        "backends": {"count": 1, "device": "emulated"},
        "models": [
            {"name": name, "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0, "input_shape": [4]},
             "slo_ms": 400.0, "max_batch": 8}
            for name in ("a", "b")
        ],
    })
    with Cluster(config, ipc_base=tmp_path) as cluster:
        with zserve.Client(cluster.client_address, timeout=10) as client:
            for name in ("a", "b", "a"):
                client.infer(name, {"x": np.ones((1, 4), np.float32)})
        stats = _ask(cluster.client_address, reset=True)
        assert stats["cluster_silent"] == []
        assert set(stats["cluster"]) == {"shard-0", "backend-0"}
        backend = stats["cluster"]["backend-0"]
        assert backend["counters"]["requests_ok"] == 3
        sizes = backend["batch_sizes"]
        assert set(sizes) == {"a", "b"}
        assert sum(sizes["a"].values()) >= 1 and sum(sizes["b"].values()) == 1
        assert stats["latency"]["queueing"]["count"] == 3
        assert {k for k in stats["latency"] if k.startswith("queueing/")} == {
            "queueing/a", "queueing/b"}  # per model
        # The reset reached every process.
        after = _ask(cluster.client_address, reset=False)
        assert after["cluster"]["backend-0"]["counters"]["requests_ok"] == 0
        assert after["latency"]["queueing"] == {"count": 0}
        # What `zserve bench ADDRESS` reads at its marks.
        read = frontend_stats_reader(cluster.client_address)
        assert read(FRONTEND_AT_ADDRESS)["name"] == "frontend-0"
        assert read("rank")["name"] == "shard-0"  # the scheduler that embeds the rank
