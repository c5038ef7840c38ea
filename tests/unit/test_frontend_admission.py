"""FrontendCore's admission past a model's capacity, driven through now / outbox with no sockets.

The model: one GPU, l(b) = 40 b + 160 ms up to b = 8, SLO 2 s, reply allowance 50 ms. Its
capacity at the SLO is 8 / 480 ms = 16.7 r/s, so a predicted-wait bound of the SLO (pending /
capacity <= max_wait_ms = 2 s, set explicitly) admits 34 requests at once. Past the capacity the
frontend admits rows at a rate (a token bucket of max(b*, one batch, C (SLO - reply - l(b*)
(1 + 2/N))) = 16.7 x 0.51 = 8.5 rows, refilled at the capacity to start with) that follows the
model's answers once per rate window: down by the excess of its deadline misses over
GATE_MISS_TARGET, up by GATE_PROBE_UP while it refuses and misses stay under the target."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zserve.config.cluster import parse_config
from zserve.config.profiles import LatencyProfile
from zserve.core.hosting import Outbox
from zserve.frontend.admission import (
    GATE_CEILING_FRACTION,
    GATE_FLOOR_FRACTION,
    GATE_MAX_CUT,
    GATE_MIN_CUT,
    GATE_MISS_TARGET,
    GATE_PROBE_UP,
    GATE_RECOVER,
    RATE_WINDOW_S,
    ModelAdmission,
)
from zserve.frontend.core import FrontendCore
from zserve.transport.messages import (
    BatchOutputs,
    DropNotice,
    InferError,
    InferRequest,
    InputFetch,
)

CLIENT = b"client-1"
CAPACITY_RPS = 8 / 0.480
BUCKET_ROWS = 8  # of the bucket's 8.5 rows: those that still finish in time waiting at capacity
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


def test_past_capacity_rows_are_admitted_at_the_capacity_rate() -> None:
    core = _core()
    # A burst before any rate was measured: taken as past the capacity (the safe start). One
    # batch fits the bucket; the old default, a predicted-wait bound of the SLO, admitted 34,
    # whose last would start after four batches of 480 ms.
    errors = _offer(core, 0.0, 0, 40)
    assert core.counters["admitted"] == BUCKET_ROWS
    assert set(errors) == set(range(BUCKET_ROWS, 40))
    assert set(errors.values()) == {"OVERLOADED"}
    assert "admitting 16.7 rows/s" in _message(core, 0.0, 40)
    # The bucket refills at the capacity, whatever the scheduler holds back: 0.3 s later, 5 rows.
    assert _offer(core, 0.3, 100, 6) == {105: "OVERLOADED"}
    assert core.models["m"].queued == BUCKET_ROWS + 5


def test_within_capacity_the_waiting_rows_are_not_bounded() -> None:
    core = _core()
    # One second offered at 8 r/s (under 16.7) lifts the gate.
    for i in range(8):
        assert _offer(core, i * 0.125, i, 1) == {}
    # A burst of 12 at once: more than the bucket, within a Poisson stream's surge at the
    # capacity (3 x sqrt(16.7 r/s x 1 s) = 12.2 rows): no rate past the capacity.
    assert _offer(core, 1.0, 8, 12) == {}  # 20 wait, within 2 s of work
    # The 13th row at that instant is: the gate is back at once, its bucket spent on the burst
    # (a predicted-wait bound of the SLO, 20 / 16.7 = 1.2 s, would admit the request).
    assert "offered past its capacity" in _message(core, 1.0, 20)
    # A window that ends under the capacity (13 rows in 2 s) lifts it again.
    assert _offer(core, 3.0, 21, 1) == {}


def model_queued(core: FrontendCore) -> int:
    return core.models["m"].queued


def _message(core: FrontendCore, now: float, request_id: int) -> str:
    outbox: Outbox = []
    core.on_infer(now, CLIENT, InferRequest(request_id, "m", INPUTS), outbox)
    (_, msg), = outbox
    assert isinstance(msg, InferError)
    message: str = msg.message
    return message


def _offer_at_rate(core: FrontendCore, start: float, end: float, rate: float,
                   first_id: int) -> None:
    """Requests every 1 / ``rate`` s from ``start`` until before ``end``."""
    count = round((end - start) * rate)
    for i in range(count):
        _offer(core, start + i / rate, first_id + i, 1)


def _answer_all(core: FrontendCore, now: float, missed: int) -> int:
    """Answer every pending request, the first ``missed`` by the scheduler's drop and the others
    with outputs; how many were answered."""
    rids = list(core.pending)
    outbox: Outbox = []
    core.on_drop(now, DropNotice(rids[:missed], "DEADLINE", "late"), outbox)
    served = rids[missed:]
    core.on_fetch(now, "backend-0", InputFetch(1, served), outbox)
    core.on_outputs(now, BatchOutputs(1, served, [{} for _ in served], now, now), outbox)
    return len(rids)


def test_the_admitted_rate_follows_the_deadline_misses() -> None:
    core = _core(max_queue=4096)
    gate = core.models["m"].gate(1)
    assert gate is not None and gate.rate_rps == pytest.approx(CAPACITY_RPS)
    # Twice the capacity for a second: one bucket and a second of the capacity get in.
    _offer_at_rate(core, 0.0, RATE_WINDOW_S, 2 * CAPACITY_RPS, 0)
    answered = _answer_all(core, 0.99, missed=3)
    assert answered == BUCKET_ROWS + round(CAPACITY_RPS) - 1
    # The window ends: the rate falls by the excess of its misses over the target.
    _offer_at_rate(core, RATE_WINDOW_S, 2 * RATE_WINDOW_S, 2 * CAPACITY_RPS, 1000)
    excess = 3 / answered - GATE_MISS_TARGET
    cut = CAPACITY_RPS * (1.0 - min(GATE_MAX_CUT, max(GATE_MIN_CUT, excess)))
    assert gate.rate_rps == pytest.approx(cut)
    # Fewer than GATE_MIN_ANSWERS answers (one second at the lowered rate): no change yet...
    _answer_all(core, 1.99, missed=0)
    _offer_at_rate(core, 2 * RATE_WINDOW_S, 3 * RATE_WINDOW_S, 2 * CAPACITY_RPS, 2000)
    assert gate.rate_rps == pytest.approx(cut)
    # ...until two windows add up to enough, none missed while the gate refused: below the
    # capacity it closes GATE_RECOVER of the gap (a cut may have answered a passing stall)...
    _answer_all(core, 2.99, missed=0)
    _offer_at_rate(core, 3 * RATE_WINDOW_S, 4 * RATE_WINDOW_S, 2 * CAPACITY_RPS, 3000)
    recovered = cut + GATE_RECOVER * (CAPACITY_RPS - cut)
    assert gate.rate_rps == pytest.approx(recovered)
    # ...and above it probes by GATE_PROBE_UP.
    gate.rate_rps = CAPACITY_RPS
    for window in range(4, 7):
        _answer_all(core, window * RATE_WINDOW_S - 0.01, missed=0)
        _offer_at_rate(core, window * RATE_WINDOW_S, (window + 1) * RATE_WINDOW_S,
                       2 * CAPACITY_RPS, window * 1000)
    assert gate.rate_rps == pytest.approx(CAPACITY_RPS * (1.0 + GATE_PROBE_UP))


def test_the_admitted_rate_stays_between_its_floor_and_ceiling() -> None:
    core = _core(max_queue=4096)
    gate = core.models["m"].gate(1)
    assert gate is not None
    window = 0
    while gate.rate_rps > GATE_FLOOR_FRACTION * CAPACITY_RPS and window < 500:
        now = window * RATE_WINDOW_S  # every answer a miss: at most GATE_MAX_CUT per window
        before = gate.rate_rps
        _offer_at_rate(core, now, now + RATE_WINDOW_S, 3 * CAPACITY_RPS, window * 1000)
        assert gate.rate_rps >= before * (1.0 - GATE_MAX_CUT) - 1e-9
        _answer_all(core, now + 0.99, missed=len(core.pending))
        window += 1
    assert gate.rate_rps == pytest.approx(GATE_FLOOR_FRACTION * CAPACITY_RPS)
    while gate.rate_rps < GATE_CEILING_FRACTION * CAPACITY_RPS and window < 2000:
        now = window * RATE_WINDOW_S  # never a miss: the rate probes up to its ceiling
        _offer_at_rate(core, now, now + RATE_WINDOW_S, 3 * CAPACITY_RPS, window * 1000)
        _answer_all(core, now + 0.99, missed=0)
        window += 1
    _offer_at_rate(core, window, window + 5 * RATE_WINDOW_S, 3 * CAPACITY_RPS, window * 1000)
    assert gate.rate_rps == pytest.approx(GATE_CEILING_FRACTION * CAPACITY_RPS)


def test_outputs_past_the_deadline_count_as_misses() -> None:
    core = _core(max_queue=4096)
    _offer_at_rate(core, 0.0, RATE_WINDOW_S, 2 * CAPACITY_RPS, 0)
    rids = list(core.pending)
    outbox: Outbox = []
    core.on_fetch(1.0, "backend-0", InputFetch(1, rids), outbox)
    core.on_outputs(2.5, BatchOutputs(1, rids, [{} for _ in rids], 1.0, 2.4), outbox)  # late
    _offer(core, 2.5, 1000, 1)
    gate = core.models["m"].gate(1)
    assert gate is not None
    assert gate.rate_rps == pytest.approx(CAPACITY_RPS * (1.0 - GATE_MAX_CUT))


def test_the_bound_can_be_switched_off_and_the_predicted_wait_bound_set_per_model() -> None:
    core = _core(shed_past_capacity=False)
    _offer(core, 0.0, 0, 40)
    assert core.counters["admitted"] == 40  # by default no bound on the predicted wait
    core = _core(shed_past_capacity=False, max_wait_ms=2000.0)
    _offer(core, 0.0, 0, 40)
    assert core.counters["admitted"] == PREDICTED_WAIT_ROWS
    assert isinstance(core.models["m"], ModelAdmission)


def test_a_slow_models_burst_that_one_batch_serves_is_not_past_its_capacity() -> None:
    """l(b) = 3 s, SLO 4.5 s, one GPU: a capacity of 1/3 r/s (b* = 1), yet up to 8 requests at
    once fit one batch (3.008 s). Before any rate is measured (taken as past the capacity) the
    bucket holds the batch one idle GPU finishes within the SLO (8 rows), not b* = 1: the pair is
    admitted, the ninth row of the burst is refused. Afterwards a rate window spans two of b*'s
    runs (6 s), so a pair in it is not read as 2 r/s past the capacity."""
    cluster = parse_config({
        "backends": {"count": 1, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 3000.0,
                                              "input_shape": [4]},
                    "slo_ms": 4500.0, "max_batch": 8}]})
    core = FrontendCore(name="frontend-0", cluster=cluster, index=0, data_address="ipc://data",
                        profiles={"m": LatencyProfile.linear(1.0, 3000.0, 8)})
    assert _offer(core, 0.0, 1, 2) == {}
    assert _offer(core, 0.5, 3, 7) == {9: "OVERLOADED"}


def _burst_admitted(admission: ModelAdmission, gpus: int) -> int:
    """Rows of one burst at t = 0 the gate admits (before any rate: past the capacity)."""
    gate = admission.gate(gpus)
    assert gate is not None
    admitted = 0
    while gate.admit(0.0, 1) and admitted < 10_000:
        admitted += 1
    return admitted


def test_the_gate_bucket_follows_the_learned_reply_allowance() -> None:
    """A slow model on 8 GPUs (l(b) = 10 b + 10 ms, SLO 1 s): its bucket is the rows that,
    waiting at capacity, still finish within the SLO less the reply allowance, so a learned
    allowance resizes it as if the gate had been made with it."""
    cluster = parse_config({
        "backends": {"count": 8, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 10.0, "beta_ms": 10.0,
                                              "input_shape": [4]},
                    "slo_ms": 1000.0, "max_batch": 8, "max_queue": 100_000}]})
    profile = LatencyProfile.linear(10.0, 10.0, 8)
    config = cluster.models[0]
    wide = _burst_admitted(ModelAdmission(config, 0, profile, reply_allowance_s=0.5), 8)
    narrow = ModelAdmission(config, 0, profile, reply_allowance_s=0.05)
    assert _burst_admitted(ModelAdmission(config, 0, profile, reply_allowance_s=0.05), 8) > wide
    narrow.gate(8)
    narrow.set_reply_allowance(0.5)  # learned wider: the bucket shrinks to the wide one's
    assert _burst_admitted(narrow, 8) == wide
