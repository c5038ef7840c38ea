"""A restarted frontend never takes what belongs to its previous incarnation: outputs, drops,
failures and fetches of another incarnation's request ids are refused and counted (the core);
a frontend SIGKILLed while long batches run is restarted and every answer its new incarnation
gives is the request's own (a real cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from runtime_helpers import wait_until

import zserve
from zserve.backends.emulated import EmulatedModel
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.core.hosting import Outbox
from zserve.core.request_ids import INCARNATIONS, RequestIds, incarnation_of, new_incarnation
from zserve.frontend.core import FrontendCore
from zserve.transport.messages import (
    BatchFailed,
    BatchOutputs,
    DropNotice,
    InferError,
    InferReply,
    InferRequest,
    InputFetch,
    InputReply,
    RequestMetaBatch,
)

SLO_S = 5.0


def _cluster() -> ClusterConfig:
    return parse_config({
        "backends": {"count": 1, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0,
                                               "input_shape": [4]},
                    "slo_ms": SLO_S * 1e3, "max_batch": 8, "max_queue": 64}],
    })


def _core(incarnation: int) -> FrontendCore:
    return FrontendCore(name="frontend-0", cluster=_cluster(), index=0,
                        data_address="ipc://data", profiles={}, incarnation=incarnation)


def _admit(core: FrontendCore, client_ids: range) -> list[int]:
    """Admit one request per client id; the frontend's request ids, in order."""
    outbox: Outbox = []
    for client_rid in client_ids:
        x = np.full((1, 4), float(client_rid), np.float32)
        core.on_client_message(0.0, b"c", InferRequest(client_rid, "m", {"x": x}), outbox)
    core.end_tick(outbox)
    return [rid for _, msg in outbox if isinstance(msg, RequestMetaBatch)
            for rid in msg.request_ids]


def _outputs(count: int) -> list[dict[str, Any]]:
    return [{"y": np.full((1, 1), -1.0, np.float32)}] * count


def test_request_ids_carry_the_incarnation() -> None:
    core = _core(incarnation=5)
    rids = _admit(core, range(3))
    assert [incarnation_of(rid) for rid in rids] == [5, 5, 5]
    assert len(set(rids)) == 3
    assert all(0 <= rid < 1 << 63 for rid in rids)  # an int64 on the wire
    assert 0 < new_incarnation() < INCARNATIONS  # 0 is left to hosts that never restart


def test_a_new_incarnation_refuses_the_old_ones_outputs_drops_failures_and_fetches() -> None:
    old = _core(incarnation=1)
    old_rids = _admit(old, range(6))
    new = _core(incarnation=2)  # the restart: same index, same data address
    new_rids = _admit(new, range(6))
    assert not set(old_rids) & set(new_rids)
    outbox: Outbox = []
    new.on_fetch(0.1, "backend-0", InputFetch(1, old_rids[:2] + new_rids[:2]), outbox)
    [(_, reply)] = outbox
    assert isinstance(reply, InputReply)
    assert reply.request_ids == new_rids[:2] and reply.missing == old_rids[:2]
    outbox.clear()
    new.on_outputs(0.2, BatchOutputs(1, old_rids[:2], _outputs(2)), outbox)
    new.on_drop(0.2, DropNotice(old_rids[2:4], "DEADLINE", "dropped"), outbox)
    new.on_batch_failed(0.2, BatchFailed(2, old_rids[4:], "BACKEND_FAILED", "x"), outbox)
    new.end_tick(outbox)
    assert not [m for _, m in outbox if isinstance(m, InferReply | InferError)]
    assert len(new.pending) == 6
    counters = new.counters
    assert counters["stale_fetched"] == 2 and counters["stale_outputs"] == 2
    assert counters["stale_drops"] == 2 and counters["stale_failures"] == 2
    assert counters["late_outputs"] == 0 and counters["replied"] == 0
    assert new.stats()["incarnation"] == 2
    # Its own requests are still answered, each with its own outputs.
    outbox.clear()
    new.on_outputs(0.3, BatchOutputs(1, new_rids[:2], _outputs(2)), outbox)
    assert sorted(m.request_id for _, m in outbox if isinstance(m, InferReply)) == [0, 1]


def test_request_ids_wrap_within_the_incarnation() -> None:
    ids = RequestIds(index=3, incarnation=INCARNATIONS - 1)
    ids.next = ids.last  # the last id this incarnation numbers before it wraps
    assert ids.take() == ids.last < 1 << 63
    assert ids.take() == ids.first and incarnation_of(ids.first) == INCARNATIONS - 1
    assert ids.first % 1024 == ids.last % 1024 == 3  # the frontend's index stays in the low bits
    assert not ids.is_foreign(ids.last) and ids.is_foreign(ids.last + (1 << 39))


# --------------------------------------------------------------------------- a real cluster


BATCH_S = 1.2
CONSTANT = EmulatedModel("m", 0.0, 0.0).model_constant  # what y adds to 2 * sum(x)
REQUESTS = 40
BATCH_START_BOUND_S = 10.0  # the first batch of the REQUESTS starts within this


def _input(i: int) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.full((1, 4), float(i), np.float32)}


def test_restarted_frontend_answers_only_with_its_own_requests_outputs(tmp_path: Path) -> None:
    """SIGKILL the frontend while 1.2 s batches of its requests run; the supervisor restarts it
    on the same data address; every answer the new incarnation gives is its request's own
    outputs (2 * sum(inputs) + the model's constant) or a typed error, and the stale outputs
    that reached it are counted."""
    config = parse_config({
        "cluster": {"drain_s": 1.0},
        "scheduler": {"policy": "eager", "d_ctrl_ms": 5.0},
        "frontends": {"count": 1, "reply_allowance_ms": 20.0},
        "backends": {"count": 2, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 0.0, "beta_ms": BATCH_S * 1e3},
                    "slo_ms": 10_000.0, "max_batch": 16, "max_queue": 1000}],
    })
    with Cluster(config, ipc_base=tmp_path) as cluster:
        with zserve.Client(cluster.client_address, timeout=30, max_retries=0) as client:
            for i in range(REQUESTS):
                client.submit("m", _input(i))  # its answers die with the frontend
            wait_until(lambda: cluster.stats("frontend-0")["fetched_by"], "a batch running",
                       timeout_s=BATCH_START_BOUND_S)
            old_incarnation = cluster.stats("frontend-0")["incarnation"]
            cluster.kill("frontend-0")
        cluster.wait_ready("frontend-0", incarnation=2)
        new_incarnation_ = cluster.stats("frontend-0")["incarnation"]
        assert new_incarnation_ != old_incarnation
        # The new incarnation numbers its requests as the old one did, save the incarnation:
        # the same count of requests lands on the same low ids while the old batches finish.
        answers: dict[str, int] = {}
        with zserve.Client(cluster.client_address, timeout=30, max_retries=0) as client:
            inputs = [REQUESTS + 1000 + i for i in range(REQUESTS)]
            futures = [client.submit("m", _input(i)) for i in inputs]
            for value, future in zip(inputs, futures, strict=True):
                try:
                    y = future.result(30.0)["y"]
                    expected = np.full((1, 1), 8.0 * value + CONSTANT, np.float32)
                    np.testing.assert_array_equal(y, expected)  # 2 * sum(x) + the constant
                    kind = "OK"
                except zserve.ZServeError as exc:
                    kind = exc.kind.value
                answers[kind] = answers.get(kind, 0) + 1
        counters = cluster.stats("frontend-0")["counters"]
        stale = {k: v for k, v in counters.items() if k.startswith("stale_")}
        assert answers.get("OK", 0) > 0, answers
        assert sum(stale.values()) > 0, (stale, answers)
