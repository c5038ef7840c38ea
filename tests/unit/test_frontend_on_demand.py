"""A frontend's part in on-demand loading (``zserve.frontend.on_demand`` in ``FrontendCore``):
with ``[orchestration]`` a request for a model no backend serves is held (not sent to its shard),
counted in the usage reported to the orchestrator, and sent to its shard once the rank's table
lists the model; a held request whose deadline passes is answered DEADLINE once; one cancelled
is not sent later; the held bound refuses OVERLOADED; a scheduler's new epoch does not re-send
held requests; a model added after start is admitted. Without ``[orchestration]`` such a
request is refused UNAVAILABLE at once, as before."""

from __future__ import annotations

from typing import Any

import numpy as np

from zserve.config.cluster import ClusterConfig, ModelConfig, parse_config
from zserve.core.hosting import Outbox
from zserve.frontend.core import TO_SHARD, FrontendCore
from zserve.transport.messages import (
    BackendTable,
    CancelRequest,
    InferError,
    InferRequest,
    RequestMetaBatch,
)

CLIENT = b"client-1"
SLO_S = 1.0


def _cluster(orchestration: dict[str, Any] | None) -> ClusterConfig:
    models = [{"name": name, "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0, "input_shape": [4]},
               "slo_ms": SLO_S * 1e3, "max_batch": 8, "max_queue": 3} for name in ("m", "a")]
    data: dict[str, Any] = {"backends": {"count": 2, "device": "emulated"}, "models": models}
    if orchestration is not None:
        data["orchestration"] = orchestration
    return parse_config(data)


def _core(orchestration: dict[str, Any] | None = None) -> FrontendCore:
    return FrontendCore(name="frontend-0", cluster=_cluster(orchestration), index=0,
                        data_address="ipc://data", profiles={})


def _table(core: FrontendCore, now: float, served: dict[str, list[str]]) -> None:
    names = list(served)
    core.on_backend_table(now, BackendTable(list(range(len(names))), names,
                                            ["ipc://plan"] * len(names),
                                            [served[n] for n in names]), [])


def _submit(core: FrontendCore, now: float, request_id: int, model: str = "m") -> Outbox:
    outbox: Outbox = []
    core.on_client_message(now, CLIENT, InferRequest(
        request_id, model, {"x": np.ones((1, 4), dtype=np.float32)}), outbox)
    return outbox


def _sent(core: FrontendCore) -> list[int]:
    outbox: Outbox = []
    core.end_tick(outbox)
    return [rid for dest, msg in outbox if dest[0] == TO_SHARD
            and isinstance(msg, RequestMetaBatch) for rid in msg.request_ids]


def _errors(outbox: Outbox) -> list[tuple[int, str]]:
    return [(msg.request_id, msg.error) for _, msg in outbox if isinstance(msg, InferError)]


def test_without_orchestration_a_model_no_backend_serves_is_refused_at_once() -> None:
    core = _core()
    _table(core, 0.0, {"backend-0": ["a"]})
    assert _errors(_submit(core, 0.1, 1)) == [(1, "UNAVAILABLE")]
    assert core.take_usage() is None


def test_a_held_request_goes_to_its_shard_once_a_backend_serves_the_model() -> None:
    core = _core({})
    _table(core, 0.0, {"backend-0": ["a"]})
    assert _submit(core, 0.1, 1) == [] and _submit(core, 0.2, 2) == []
    assert _sent(core) == []  # held, not sent to the shard
    assert core.take_usage() == ({"m": 2}, {"m": 2}, {"m": 2})
    _table(core, 0.5, {"backend-0": ["a", "m"]})
    assert sorted(_sent(core)) == sorted(core.pending)
    assert len(core.pending) == 2
    assert core.take_usage() == ({}, {}, {"m": 2})  # none held any more, two pending
    for p in list(core.pending.values()):
        core.on_cancel(0.6, CLIENT, p.client_rid, [])
    assert core.take_usage() is None  # nothing new


def test_a_held_request_past_its_deadline_is_answered_once_and_never_sent() -> None:
    core = _core({})
    _table(core, 0.0, {"backend-0": ["a"]})
    _submit(core, 0.0, 1)
    outbox: Outbox = []
    core.on_timer(core.wake_at, outbox)
    assert _errors(outbox) == [(1, "DEADLINE")]
    assert any("waiting for its model to load" in msg.message for _, msg in outbox
               if isinstance(msg, InferError))
    _table(core, 2.0, {"backend-0": ["a", "m"]})
    assert _sent(core) == [] and not core.pending


def test_a_cancelled_held_request_is_not_sent_later() -> None:
    core = _core({})
    _table(core, 0.0, {"backend-0": ["a"]})
    _submit(core, 0.0, 1)
    outbox: Outbox = []
    core.on_client_message(0.1, CLIENT, CancelRequest(1), outbox)
    assert _errors(outbox) == [(1, "CANCELLED")]
    _table(core, 0.2, {"backend-0": ["a", "m"]})
    assert _sent(core) == []


def test_the_held_bound_refuses_overloaded_and_a_new_epoch_keeps_them_held() -> None:
    core = _core({})
    _table(core, 0.0, {"backend-0": ["a"]})
    for rid in (1, 2, 3):
        assert _submit(core, 0.0, rid) == []
    assert _errors(_submit(core, 0.0, 4)) == [(4, "OVERLOADED")]
    outbox: Outbox = []
    core.requeue_queued(0.1, outbox)
    assert _sent(core) == []


def test_with_load_on_demand_off_usage_is_still_reported() -> None:
    core = _core({"load_on_demand": False})
    _table(core, 0.0, {"backend-0": ["a"]})
    assert _errors(_submit(core, 0.0, 1)) == [(1, "UNAVAILABLE")]
    _submit(core, 0.0, 2, model="a")
    assert core.take_usage() == ({"a": 1}, {}, {"a": 1})


def test_a_model_added_after_start_is_admitted_and_held_until_served() -> None:
    core = _core({})
    _table(core, 0.0, {"backend-0": ["a", "late"]})
    assert _errors(_submit(core, 0.0, 1, model="late")) == [(1, "BAD_REQUEST")]
    late = ModelConfig(name="late", builtin="mlp", slo_ms=SLO_S * 1e3)
    assert core.add_model(late, None)
    assert not core.add_model(late, None)
    # the latest table lists it already: served, so sent to its shard at once
    assert _submit(core, 0.1, 2, model="late") == []
    assert len(_sent(core)) == 1
    assert "outcome/late/ok" in core.counters


def test_held_requests_of_a_model_that_cannot_be_loaded_are_answered_unavailable_at_once(
        ) -> None:
    core = _core({})
    _table(core, 0.0, {"backend-0": ["a"]})
    assert _submit(core, 0.1, 1) == [] and _submit(core, 0.2, 2) == []
    outbox: Outbox = []
    core.fail_held(0.3, "m", "its load failed: UNAVAILABLE: no backend loaded it", outbox)
    assert _errors(outbox) == [(1, "UNAVAILABLE"), (2, "UNAVAILABLE")]
    assert "cannot be loaded" in next(m for _, m in outbox if isinstance(m, InferError)).message
    assert core.take_usage() is not None and core.on_demand.waiting_models() == []
    # nothing more for them later: no deadline answer, nothing sent once a backend serves m
    later: Outbox = []
    core.on_timer(0.2 + 2 * SLO_S, later)
    assert _errors(later) == []
    _table(core, 3.0, {"backend-0": ["a", "m"]})
    assert _sent(core) == []
