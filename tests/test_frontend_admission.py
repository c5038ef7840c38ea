"""FrontendCore's admission past a model's capacity, driven through now / outbox with no sockets.

The model: one GPU, l(b) = 40 b + 160 ms up to b = 8, SLO 2 s, reply allowance 50 ms. Its
capacity at the SLO is 8 / 480 ms = 16.7 r/s, so the predicted-wait bound (pending / capacity <=
max_wait_ms = the SLO) admits 34 requests at once. Past the capacity the rows that wait to be
planned are bounded too: the floor is max(b*, C (SLO - reply - l(b*) (1 + 1/N))) = 16.7 x 0.99 s
= 16.5 rows (17 admitted), where the last of them still finishes within the SLO; the bound adapts
from there, down on DEADLINE answers (never below the floor), up on answers with outputs."""

from __future__ import annotations

from typing import Any

import numpy as np

from zserve.config import parse_config
from zserve.frontend_admission import QUEUE_LIMIT_CUT, ModelAdmission
from zserve.frontend_core import FrontendCore
from zserve.hosting import Outbox
from zserve.profiles import LatencyProfile
from zserve.transport.messages import (
    BatchOutputs,
    DropNotice,
    InferError,
    InferRequest,
    InputFetch,
)

CLIENT = b"client-1"
CAPACITY_RPS = 8 / 0.480
FLOOR_ROWS = 17  # admitted while fewer than 16.7 r/s x (2 - 0.05 - 0.48 x 2) s = 16.5 wait
PREDICTED_WAIT_ROWS = 34  # admitted while pending / capacity <= 2 s: 33 / 16.7 = 1.98 s
INPUTS = {"x": np.zeros((1, 4), np.float32)}


def _core(**model: Any) -> FrontendCore:
    cluster = parse_config({
        "frontends": {"reply_allowance_ms": 50.0},
        "backends": {"count": 1, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 40.0, "beta_ms": 160.0,
                                              "input_shape": [4]},
                    "slo_ms": 2000.0, "max_batch": 8, "max_queue": 1024, **model}]})
    return FrontendCore(name="frontend-0", cluster=cluster, index=0, data_address="ipc://data",
                        profiles={"m": LatencyProfile.linear(40.0, 160.0, 8)})


def _offer(core: FrontendCore, now: float, first_id: int, count: int) -> dict[int, str]:
    """Offer ``count`` requests at ``now``; the errors they were answered with, by id."""
    outbox: Outbox = []
    for request_id in range(first_id, first_id + count):
        core.on_infer(now, CLIENT, InferRequest(request_id, "m", INPUTS), outbox)
    return {msg.request_id: msg.error for _, msg in outbox if isinstance(msg, InferError)}


def test_past_capacity_only_the_rows_that_can_still_finish_in_time_are_admitted() -> None:
    core = _core()
    # A burst before any rate was measured: taken as past the capacity (the safe start). The
    # predicted-wait rule alone admitted 34, whose last would start after four batches of 480 ms.
    errors = _offer(core, 0.0, 0, 40)
    assert core.counters["admitted"] == FLOOR_ROWS
    assert set(errors) == set(range(FLOOR_ROWS, 40))
    assert set(errors.values()) == {"OVERLOADED"}
    # A backend fetching a batch frees its rows from the bound (they are planned): 8 more.
    outbox: Outbox = []
    core.on_fetch(0.1, "backend-0", InputFetch(1, list(core.pending)[:8]), outbox)
    assert model_queued(core) == FLOOR_ROWS - 8
    assert _offer(core, 0.1, 100, 9) == {108: "OVERLOADED"}
    assert core.models["m"].queued == FLOOR_ROWS


def test_within_capacity_only_the_predicted_wait_bounds_admission() -> None:
    core = _core()
    # One second offered at 10 r/s (under 16.7) lifts the bound on queued rows.
    for i in range(10):
        assert _offer(core, i * 0.1, i, 1) == {}
    assert _offer(core, 1.0, 10, 16) == {}  # 26 wait: over the floor, within 2 s of work
    # The 17th row of this window is past what the capacity serves in one: the bound is back at
    # once (the predicted wait, 26 / 16.7 = 1.6 s, alone admits the request).
    assert "wait to be planned" in _message(core, 1.5, 26)
    # A window that ends under the capacity (17 rows in 2 s) lifts it again.
    assert _offer(core, 3.0, 27, 1) == {}


def model_queued(core: FrontendCore) -> int:
    return core.models["m"].queued


def _message(core: FrontendCore, now: float, request_id: int) -> str:
    outbox: Outbox = []
    core.on_infer(now, CLIENT, InferRequest(request_id, "m", INPUTS), outbox)
    (_, msg), = outbox
    assert isinstance(msg, InferError)
    message: str = msg.message
    return message


def test_deadline_answers_lower_the_bound_to_its_floor_and_outputs_raise_it() -> None:
    core = _core()
    model = core.models["m"]
    floor = model.queue_limit(0.0, 0, 1)
    assert FLOOR_ROWS - 1 < floor <= FLOOR_ROWS
    _offer(core, 0.0, 0, FLOOR_ROWS)
    outbox: Outbox = []
    rids = list(core.pending)
    # Outputs raise the bound (a request admitted then counts toward it no more)...
    core.on_fetch(0.1, "backend-0", InputFetch(1, rids[:8]), outbox)
    core.on_outputs(0.6, BatchOutputs(1, rids[:8], [{} for _ in range(8)], 0.1, 0.58), outbox)
    raised = model.queue_limit(0.6, 0, 1)
    assert raised > floor
    # ...and each scheduler DEADLINE drop cuts it, never below the floor.
    core.on_drop(0.7, DropNotice(rids[8:9], "DEADLINE", "late"), outbox)
    assert model.queue_limit(0.7, 0, 1) == max(floor, raised * (1 - QUEUE_LIMIT_CUT))
    core.on_drop(0.8, DropNotice(rids[9:], "DEADLINE", "late"), outbox)
    assert model.queue_limit(0.8, 0, 1) == floor
    assert model.queued == 0 and model.pending == 0


def test_the_bound_can_be_switched_off_per_model() -> None:
    core = _core(shed_past_capacity=False)
    _offer(core, 0.0, 0, 40)
    assert core.counters["admitted"] == PREDICTED_WAIT_ROWS
    assert isinstance(core.models["m"], ModelAdmission)
