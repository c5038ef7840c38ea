"""Abandoned requests leave the scheduler's queue (issue 16, defect 4), on a real cluster: a
client submits 1,000 requests to a model whose one emulated GPU runs ~25 of them a second,
then its connection goes away. The frontend tells the shard (``CancelQueued``), the shard takes
them off the ModelThread's queue, and the backend runs almost none of them; the cancellation
counters of the frontend, the shard and the backend add up exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from runtime_helpers import ask_frontend_stats, wait_until

from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import parse_config
from zserve.transport import socket_io
from zserve.transport.messages import ClusterStatsRequest, InferRequest
from zserve.transport.sockets import make_dealer

REQUESTS = 1000
# l(b) = 40 b + 10 ms up to 16: one GPU runs ~25 requests/s, so 1,000 take ~40 s; the SLO (and
# the frontend's predicted-wait bound, which is the SLO) admits them all and no deadline
# answers any of them while the test runs.
MODEL = {"name": "m", "emulated": {"alpha_ms": 40.0, "beta_ms": 10.0, "input_shape": [4]},
         "slo_ms": 60_000.0, "max_batch": 16, "max_queue": 5000}
# What may run: the batches planned before the disconnect reached the shard. The client's
# submission and the wait for its admission take well under 3 s even on a loaded 2-core
# machine (~75 requests at 25/s); the rest must not run.
MAX_EXECUTED = 200
WAIT_S = 60.0


def _cluster_stats(address: str) -> dict[str, Any]:
    return ask_frontend_stats(address, ClusterStatsRequest(reset=False), b"test-cancel-queued")


def _wait(address: str, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Ask for the cluster's stats until ``predicate`` holds, and return them."""
    last: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        last.clear()
        last.update(_cluster_stats(address))
        return dict(last) if predicate(last) else None

    return wait_until(reached, lambda: f"a stats condition; last stats {last}", timeout_s=WAIT_S)


def _settled(stats: dict[str, Any]) -> bool:
    """Nothing pending at the frontend or queued at the shard, and every planned request
    accounted for by the backend."""
    shard = stats["cluster"].get("shard-0")
    backend = stats["cluster"].get("backend-0")
    if stats["pending"] or shard is None or backend is None:
        return False
    counters = backend["counters"]
    accounted = sum(counters[f"requests_{what}"] for what in (
        "ok", "failed", "missing", "unavailable", "cancelled", "shed_late"))
    return bool(shard["models"]["m"]["queued"] == 0
                and accounted == shard["counters"]["planned_requests"])


def test_a_gone_clients_queued_requests_leave_the_scheduler(tmp_path: Path) -> None:
    config = parse_config({
        "cluster": {"drain_s": 2.0},
        "scheduler": {"shards": 0},
        "frontends": {"count": 1},
        "backends": {"count": 1, "device": "emulated"},
        "models": [MODEL],
    })
    with Cluster(config, ipc_base=tmp_path) as cluster:
        address = cluster.client_address
        ctx: zmq.Context[Any] = zmq.Context()
        raw = make_dealer(ctx, address, identity=b"vanishing")
        try:
            x = {"x": np.ones((1, 4), np.float32)}
            for i in range(REQUESTS):
                socket_io.sync_send(raw, InferRequest(i, "m", x))
            _wait(address, lambda st: st["counters"]["admitted"] == REQUESTS)
        finally:
            raw.close(linger=0)  # no cancel: the connection just goes away
            ctx.term()
        stats = _wait(address, _settled)
    frontend = stats["counters"]
    shard = stats["cluster"]["shard-0"]
    backend = stats["cluster"]["backend-0"]["counters"]
    assert frontend["client_disconnects"] == 1
    abandoned_queued = frontend["disconnect_cancelled"]
    assert abandoned_queued + frontend["disconnect_cancelled_fetched"] + frontend["replied"] \
        == REQUESTS
    # Every abandoned queued request was taken off the shard's queue, or was already in a
    # plan sent to the backend, which then found it missing: nothing else.
    assert shard["counters"]["cancelled"] == shard["models"]["m"]["cancelled"]
    assert abandoned_queued == shard["counters"]["cancelled"] + frontend["fetch_missing"]
    assert frontend["fetch_missing"] == backend["requests_missing"]
    assert shard["models"]["m"]["arrived"] == (
        shard["models"]["m"]["planned"] + shard["counters"]["cancelled"]
        + shard["models"]["m"]["dropped"])
    executed = backend["requests_ok"]
    assert executed <= MAX_EXECUTED, (executed, stats)
    assert shard["counters"]["cancelled"] >= REQUESTS - MAX_EXECUTED
