"""FrontendCore's admission past a model's capacity, driven through now / outbox with no sockets.

The model: one GPU, l(b) = 40 b + 160 ms up to b = 8, SLO 2 s, reply allowance 50 ms. Its
capacity at the SLO is 8 / 480 ms = 16.7 r/s, so a predicted-wait bound of the SLO (pending /
capacity <= max_wait_ms = 2 s, set explicitly) admits 34 requests at once. Past the capacity the
rows that wait to be planned are bounded, from max(b*, C (SLO - reply - l(b*) (1 + 2/N))) = 16.7
x 0.51 s = 8.5 rows (9 admitted), where the last of them still finishes within the SLO with
l(b*) to spare; the bound adapts from there, down on DEADLINE answers (to 1 row at least), up on
answers with outputs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zserve.config import parse_config
from zserve.frontend_admission import QUEUE_LIMIT_CUT, QUEUE_LIMIT_GROW, ModelAdmission
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
FLOOR_ROWS = 9  # admitted while fewer than 16.7 r/s x (2 - 0.05 - 0.48 x 3) s = 8.5 wait
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
    # A burst before any rate was measured: taken as past the capacity (the safe start). The old
    # default, a predicted-wait bound of the SLO, admitted 34, whose last would start after four
    # batches of 480 ms.
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


def test_within_capacity_the_waiting_rows_are_not_bounded() -> None:
    core = _core()
    # One second offered at 8 r/s (under 16.7) lifts the bound on queued rows.
    for i in range(8):
        assert _offer(core, i * 0.125, i, 1) == {}
    assert _offer(core, 1.0, 8, 16) == {}  # 24 wait: over the bound, within 2 s of work
    # The 17th row of this window is past what the capacity serves in one: the bound is back at
    # once (a predicted-wait bound of the SLO, 24 / 16.7 = 1.4 s, would admit the request).
    assert "wait to be planned" in _message(core, 1.5, 24)
    # A window that ends under the capacity (17 rows in 2 s) lifts it again.
    assert _offer(core, 3.0, 25, 1) == {}


def model_queued(core: FrontendCore) -> int:
    return core.models["m"].queued


def _message(core: FrontendCore, now: float, request_id: int) -> str:
    outbox: Outbox = []
    core.on_infer(now, CLIENT, InferRequest(request_id, "m", INPUTS), outbox)
    (_, msg), = outbox
    assert isinstance(msg, InferError)
    message: str = msg.message
    return message


def test_deadline_answers_lower_the_bound_and_outputs_raise_it() -> None:
    # At a 1.5 s SLO the last of b* = 8 queued rows has no l(b*) to spare: the bound starts at
    # one batch, 8 rows, and may fall to 1.
    core = _core(slo_ms=1500.0)
    model = core.models["m"]
    start = model.queue_limit(0.0, 0, 1)
    assert start == 8.0
    assert _offer(core, 0.0, 0, 9) == {8: "OVERLOADED"}
    outbox: Outbox = []
    rids = list(core.pending)
    # Outputs raise the bound (and the fetched rows count toward it no more)...
    core.on_fetch(0.1, "backend-0", InputFetch(1, rids[:4]), outbox)
    core.on_outputs(0.6, BatchOutputs(1, rids[:4], [{} for _ in range(4)], 0.1, 0.58), outbox)
    raised = model.queue_limit(0.6, 0, 1)
    assert raised == pytest.approx(start * (1 + QUEUE_LIMIT_GROW) ** 4) and raised > start
    # ...and each DEADLINE answer (here the scheduler's drops) cuts it.
    core.on_drop(0.7, DropNotice(rids[4:], "DEADLINE", "late"), outbox)
    cut = model.queue_limit(0.7, 0, 1)
    assert cut == pytest.approx(raised * (1 - QUEUE_LIMIT_CUT) ** 4)
    assert model.queued == 0 and model.pending == 0
    # 6.5 rows may wait now, not 8.
    assert _offer(core, 0.8, 100, 8) == {107: "OVERLOADED"}
    for _ in range(200):
        model.note_answer(deadline_missed=True)
    assert model.queue_limit(0.9, 0, 1) == 1.0


def test_the_bound_can_be_switched_off_and_the_predicted_wait_bound_set_per_model() -> None:
    core = _core(shed_past_capacity=False)
    _offer(core, 0.0, 0, 40)
    assert core.counters["admitted"] == 40  # by default no bound on the predicted wait
    core = _core(shed_past_capacity=False, max_wait_ms=2000.0)
    _offer(core, 0.0, 0, 40)
    assert core.counters["admitted"] == PREDICTED_WAIT_ROWS
    assert isinstance(core.models["m"], ModelAdmission)
