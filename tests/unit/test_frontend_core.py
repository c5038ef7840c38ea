"""FrontendCore with no sockets: admission, deadlines via wake_at, cancellation, backend failures,
metadata coalescing per tick and outputs delivered once, driven through now / outbox / wake_at."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zserve.config.cluster import ClusterConfig, parse_config
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.core.hosting import Outbox
from zserve.core.stats import merge_snapshots
from zserve.frontend.core import (
    FRONTEND_COUNTERS,
    FRONTEND_HISTOGRAMS,
    TIMER_COALESCE_S,
    TIMER_COMPACT_FACTOR,
    TO_BACKEND,
    TO_CLIENT,
    TO_SHARD,
    FrontendCore,
)
from zserve.transport.messages import (
    BackendTable,
    BatchOutputs,
    CancelFetched,
    CancelQueued,
    CancelRequest,
    ClientHello,
    DropNotice,
    Hello,
    InferAnswers,
    InferError,
    InferReply,
    InferRequest,
    InferRequests,
    InputFetch,
    InputReply,
    Message,
    RequestMetaBatch,
)

CLIENT = b"client-1"
SLO_S = 0.1


def _cluster(**model: Any) -> ClusterConfig:
    # "m" lives on shard 0 and "a" on shard 1 (crc32 of the name, two shards).
    models = [{"name": name, "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0, "input_shape": [4]},
               "slo_ms": SLO_S * 1e3, "max_batch": 8, "max_queue": 64, **model}
              for name in ("m", "a")]
    return parse_config({"scheduler": {"shards": 2}, "backends": {"count": 2,
                        "device": "emulated"}, "frontends": {"max_request_bytes": 4096},
                         "models": models})


def _core(**model: Any) -> FrontendCore:
    return FrontendCore(name="frontend-0", cluster=_cluster(**model), index=0,
                        data_address="ipc://data", profiles={})


def _sample(value: float = 1.0) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.full((1, 4), value, dtype=np.float32)}


def _signature(model: str = "m") -> dict[str, Any]:
    return ModelSignature(model, (TensorSpec("x", "float32", (4,)),),
                          (TensorSpec("y", "float32", (1,)),)).to_dict()


def _table(core: FrontendCore, backends: dict[str, list[str]], *, signed: bool = False) -> None:
    outbox: Outbox = []
    names = list(backends)
    signatures = [{m: _signature(m) for m in backends[n]} for n in names] if signed else []
    core.on_backend_table(0.0, BackendTable(list(range(len(names))), names,
                                            ["ipc://plan"] * len(names),
                                            [backends[n] for n in names],
                                            signatures=signatures), outbox)
    assert outbox == []


def _submit(core: FrontendCore, now: float, request_id: int, *, model: str = "m",
            inputs: dict[str, Any] | None = None, client: bytes = CLIENT) -> Outbox:
    outbox: Outbox = []
    core.on_client_message(now, client, InferRequest(request_id, model,
                                                     inputs or _sample(request_id)), outbox)
    return outbox


def _tick(core: FrontendCore) -> Outbox:
    outbox: Outbox = []
    core.end_tick(outbox)
    return outbox


def _meta_ids(core: FrontendCore) -> list[int]:
    ids: list[int] = []
    for destination, msg in _tick(core):
        assert destination[0] == TO_SHARD and isinstance(msg, RequestMetaBatch)
        ids += msg.request_ids
    return ids


def _errors(outbox: Outbox) -> dict[int, str]:
    return {msg.request_id: msg.error for _, msg in outbox if isinstance(msg, InferError)}


def _only(outbox: Outbox, cls: type[Message]) -> list[Any]:
    return [msg for _, msg in outbox if isinstance(msg, cls)]


# --------------------------------------------------------------------------- admission


def test_admission_refuses_unknown_models_too_large_and_overloaded() -> None:
    core = _core(max_queue=2)
    assert _errors(_submit(core, 0.0, 1, model="nope")) == {1: "BAD_REQUEST"}
    too_large = {"x": np.zeros((1, 2048), np.float32)}
    assert _errors(_submit(core, 0.0, 2, inputs=too_large)) == {2: "TOO_LARGE"}
    assert _submit(core, 0.0, 3) == [] and _submit(core, 0.0, 4) == []
    assert _errors(_submit(core, 0.0, 5)) == {5: "OVERLOADED"}
    assert _errors(_submit(core, 0.0, 3)) == {3: "BAD_REQUEST"}  # id 3 is in flight
    assert len(core.pending) == 2
    assert core.counters["rejected_OVERLOADED"] == 1 and core.counters["admitted"] == 2


def test_inputs_are_validated_once_a_backend_registered_the_signature() -> None:
    core = _core()
    wrong_shape = {"x": np.zeros((1, 5), np.float32)}
    # No signature yet: admitted, the backend validates.
    assert _submit(core, 0.0, 1, inputs=wrong_shape) == []
    _table(core, {"backend-0": ["m", "a"]}, signed=True)
    outbox = _submit(core, 0.0, 2, inputs=wrong_shape)
    assert _errors(outbox) == {2: "BAD_REQUEST"}
    assert "shape" in _only(outbox, InferError)[0].message
    wrong_dtype = {"x": np.zeros((1, 4), np.float64)}
    assert _errors(_submit(core, 0.0, 3, inputs=wrong_dtype)) == {3: "BAD_REQUEST"}
    assert _submit(core, 0.0, 4) == []


def test_a_model_without_backends_is_unavailable() -> None:
    core = _core()
    _table(core, {"backend-0": ["a"]})
    assert _errors(_submit(core, 0.0, 1, model="m")) == {1: "UNAVAILABLE"}
    assert _submit(core, 0.0, 2, model="a") == []


# --------------------------------------------------------------------------- deadlines


def test_deadline_answers_fire_on_time_through_wake_at() -> None:
    core = _core()
    assert core.wake_at == math.inf
    _submit(core, 10.0, 1)
    _submit(core, 10.05, 2)
    _meta_ids(core)
    # One coalescing window after the earliest deadline, never before it.
    assert core.wake_at == pytest.approx(10.0 + SLO_S + TIMER_COALESCE_S)
    outbox: Outbox = []
    core.on_timer(10.0 + SLO_S - 0.01, outbox)  # early: a harmless no-op
    assert outbox == [] and len(core.pending) == 2
    core.on_timer(core.wake_at, outbox)
    assert _errors(outbox) == {1: "DEADLINE"}
    assert core.wake_at == pytest.approx(10.05 + SLO_S + TIMER_COALESCE_S)


def test_an_answered_request_moves_wake_at_to_the_next_pending_deadline() -> None:
    core = _core()
    _submit(core, 0.0, 1)
    _submit(core, 0.02, 2)
    _meta_ids(core)
    outbox: Outbox = []
    core.on_cancel(0.03, CLIENT, 1, outbox)
    core.on_timer(0.04, outbox)  # prunes the answered request's deadline
    assert core.wake_at == pytest.approx(0.02 + SLO_S + TIMER_COALESCE_S)


# --------------------------------------------------------------------------- cancellation


def test_cancelling_a_queued_request_answers_it_and_keeps_it_from_the_backend() -> None:
    core = _core()
    _submit(core, 0.0, 1)
    _submit(core, 0.0, 2)
    rids = _meta_ids(core)
    outbox: Outbox = []
    core.on_client_message(0.01, CLIENT, CancelRequest(2), outbox)
    assert _errors(outbox) == {2: "CANCELLED"}
    outbox.clear()
    core.on_fetch(0.02, "backend-0", InputFetch(7, rids), outbox)
    (reply,) = _only(outbox, InputReply)
    assert reply.request_ids == rids[:1] and reply.missing == rids[1:]


def test_cancelling_a_fetched_request_tells_its_backend_once_per_tick() -> None:
    core = _core()
    for i in range(3):
        _submit(core, 0.0, i)
    rids = _meta_ids(core)
    core.on_fetch(0.01, "backend-0", InputFetch(7, rids), [])
    outbox: Outbox = []
    core.on_cancel(0.02, CLIENT, -1, outbox)  # everything of the connection, unanswered
    assert outbox == [] and not core.pending
    notes = _tick(core)
    assert notes == [((TO_BACKEND, "backend-0"), CancelFetched([7, 7, 7], rids))]


def test_a_gone_client_is_answered_nothing() -> None:
    core = _core()
    _submit(core, 0.0, 1)
    (rid,) = _meta_ids(core)
    core.client_gone(CLIENT)
    # nothing to the client; only its shard hears of it (to take the request off its queue)
    assert not core.pending
    assert _tick(core) == [((TO_SHARD, 0), CancelQueued("ipc://data", [rid], ["m"]))]
    assert core.counters["disconnect_cancelled"] == 1


def test_queued_cancellations_reach_the_owning_shard_once_per_tick() -> None:
    """Cancelled and abandoned queued requests go to their model's shard in one CancelQueued
    per shard per tick, after that tick's metadata; fetched ones go to their backend instead."""
    core = _core()
    for i in range(6):
        _submit(core, 0.0, i, model="m" if i % 3 else "a")
    _meta_ids(core)
    rids = dict(core.requests.by_client[CLIENT])  # client's id -> the frontend's
    core.on_fetch(0.01, "backend-0", InputFetch(7, [rids[1]]), [])
    outbox: Outbox = []
    core.on_cancel(0.02, CLIENT, 2, outbox)  # "m", queued
    core.on_cancel(0.02, CLIENT, 3, outbox)  # "a", queued
    core.on_cancel(0.02, CLIENT, 1, outbox)  # "m", fetched: its backend's business
    _submit(core, 0.02, 9, model="m", client=b"client-2")
    core.client_gone(b"client-2")  # admitted and abandoned in one tick
    sent = _tick(core)
    (meta,) = [(d, m) for d, m in sent if isinstance(m, RequestMetaBatch)]
    late_rid = meta[1].request_ids[0]
    cancels = [(d, m) for d, m in sent if isinstance(m, CancelQueued)]
    assert cancels == [((TO_SHARD, 0), CancelQueued("ipc://data", [rids[2], late_rid],
                                                     ["m", "m"])),
                       ((TO_SHARD, 1), CancelQueued("ipc://data", [rids[3]], ["a"]))]
    assert sent.index(meta) < sent.index(cancels[0])
    assert _only(sent, CancelFetched) == [CancelFetched([7], [rids[1]])]
    assert _tick(core) == []  # sent once


# --------------------------------------------------------------------------- backend failures


@pytest.mark.parametrize("how", ["left-table", "restarted"])
def test_a_backend_failure_fails_exactly_its_requests(how: str) -> None:
    core = _core()
    _table(core, {"backend-0": ["m"], "backend-1": ["m"]})
    outbox: Outbox = []
    core.on_backend_hello(0.0, Hello("backend", "backend-0", 100), outbox)
    for i in range(5):
        _submit(core, 0.0, i)
    rids = _meta_ids(core)
    core.on_fetch(0.01, "backend-0", InputFetch(1, rids[:2]), outbox)
    core.on_fetch(0.01, "backend-1", InputFetch(2, rids[2:4]), outbox)
    outbox.clear()
    if how == "left-table":
        core.on_backend_table(0.02, BackendTable([1], ["backend-1"], ["ipc://plan"], [["m"]]),
                              outbox)
    else:
        core.on_backend_hello(0.02, Hello("backend", "backend-0", 101), outbox)
    assert _errors(outbox) == {0: "BACKEND_FAILED", 1: "BACKEND_FAILED"}
    assert sorted(core.pending) == rids[2:]


def test_inputs_that_cannot_reach_the_backend_fail_their_requests() -> None:
    core = _core()
    _submit(core, 0.0, 1)
    rids = _meta_ids(core)
    outbox: Outbox = []
    core.on_fetch(0.01, "backend-0", InputFetch(1, rids), outbox)
    ((destination, reply),) = outbox
    outbox.clear()
    core.on_send_failed(0.01, destination, reply, False, outbox)
    assert _errors(outbox) == {1: "BACKEND_FAILED"} and not core.pending


# --------------------------------------------------------------------------- coalescing


def test_metadata_is_coalesced_per_tick_one_message_per_shard() -> None:
    core = _core()
    for i in range(6):
        assert _submit(core, 0.001 * i, i, model="m" if i % 3 else "a") == []
    sent = _tick(core)
    assert [destination for destination, _ in sent] == [(TO_SHARD, 0), (TO_SHARD, 1)]
    by_shard = {destination[1]: msg for destination, msg in sent
                if isinstance(msg, RequestMetaBatch)}
    assert by_shard[0].models == ["m"] * 4 and by_shard[1].models == ["a"] * 2
    for msg in by_shard.values():
        assert msg.frontend == "ipc://data"
        # The scheduler's deadline leaves the reply allowance for the answer's way back.
        budget = SLO_S - core.reply_allowance_s
        assert all(d == pytest.approx(a + budget) for a, d in zip(msg.arrivals, msg.deadlines,
                                                                  strict=True))
    assert _tick(core) == []  # sent once


# --------------------------------------------------------------------------- outputs


def test_outputs_are_delivered_once() -> None:
    core = _core()
    _submit(core, 0.0, 1)
    _submit(core, 0.0, 2)
    rids = _meta_ids(core)
    outbox: Outbox = []
    core.on_fetch(0.01, "backend-0", InputFetch(1, rids), outbox)
    outputs = [{"y": np.full((1, 1), float(i), np.float32)} for i in range(2)]
    outbox.clear()
    core.on_outputs(0.02, BatchOutputs(1, rids, outputs), outbox)
    core.on_outputs(0.03, BatchOutputs(1, rids, outputs), outbox)  # a duplicate
    replies = _only(outbox, InferReply)
    assert sorted(r.request_id for r in replies) == [1, 2]
    assert core.counters["late_outputs"] == 2 and not core.pending
    core.on_timer(1.0, outbox)
    assert len(outbox) == 2  # no deadline answer after the outputs


def test_the_deadline_heap_stays_proportional_to_the_pending_requests() -> None:
    """Answered requests leave their deadline entries behind (lazy deletion); a timer pass
    drops them once they dominate, and wake_at is the one pending request's deadline."""
    core = _core(max_queue=4096)
    answered = 3000
    _submit(core, 0.0, answered)  # stays pending: its deadline is the heap's top
    for request_id in range(answered):
        _submit(core, 0.01, request_id)
    rids = _meta_ids(core)[1:]
    outbox: Outbox = []
    core.on_fetch(0.02, "backend-0", InputFetch(1, rids), outbox)
    core.on_outputs(0.03, BatchOutputs(1, rids, [{"y": np.zeros((1, 1), np.float32)}] * answered),
                    outbox)
    assert len(core.pending) == 1
    core.on_timer(0.04, outbox)  # before any deadline: answers nothing, drops the stale entries
    assert len(core.pending) == 1 and core.wake_at == pytest.approx(SLO_S + TIMER_COALESCE_S)
    assert len(core._timers) <= TIMER_COMPACT_FACTOR  # the heap itself (private): one entry


def test_stats_are_the_one_schema_and_frontends_merge() -> None:
    """Counters and hop histograms in the ``zserve.core.stats`` schema; two frontends' snapshots add
    up; a reset starts a new window."""
    cores = [FrontendCore(name=f"frontend-{i}", cluster=_cluster(), index=i,
                          data_address=f"ipc://data-{i}", profiles={}) for i in range(2)]
    for core in cores:
        _submit(core, 0.0, 1)
        rids = _meta_ids(core)
        outbox: Outbox = []
        core.on_fetch(0.010, "backend-0", InputFetch(1, rids), outbox)
        # the batch ran 0.012 -> 0.020; its outputs are handled at 0.025
        core.on_outputs(0.025, BatchOutputs(1, rids, [{"y": np.zeros((1, 1), np.float32)}],
                                            0.012, 0.020), outbox)
    stats = cores[0].stats()
    assert set(stats["counters"]) >= set(FRONTEND_COUNTERS)
    assert stats["counters"]["replied"] == 1 and stats["counters"]["admitted"] == 1
    latency = stats["latency"]
    assert set(latency) == {*FRONTEND_HISTOGRAMS, *(f"{hop}/{model}" for model in ("m", "a")
                                                    for hop in ("queueing", "execution",
                                                                "latency"))}
    # one sample each: exact (a histogram keeps its min and max)
    expected_ms = {"admit_to_fetch": 10.0, "fetch_to_outputs": 15.0, "admit_to_answer": 25.0,
                   "queueing": 12.0, "queueing/m": 12.0, "execution": 8.0, "execution/m": 8.0,
                   "latency/m": 25.0, "finish_to_answer": 5.0, "overhead": 17.0}
    assert stats["counters"]["outcome/m/ok"] == 1 and stats["counters"]["outcome/a/ok"] == 0
    for metric, value_ms in expected_ms.items():
        assert latency[metric]["count"] == 1
        assert latency[metric]["p50_ms"] == pytest.approx(value_ms), metric
    assert latency["queueing/a"] == {"count": 0}
    merged = merge_snapshots([core.stats() for core in cores])
    assert merged["counters"]["replied"] == 2
    assert merged["latency"]["admit_to_answer"]["count"] == 2
    assert merged["latency"]["admit_to_answer"]["p50_ms"] == pytest.approx(25.0)
    cores[0].stats(reset=True)
    after = cores[0].stats()
    assert after["counters"]["replied"] == 0 and after["latency"]["queueing"] == {"count": 0}


def test_a_client_that_accepts_it_gets_one_message_per_tick() -> None:
    core = _core()
    outbox: Outbox = []
    core.on_client_message(0.0, CLIENT, ClientHello(accepts=[InferAnswers.KIND]), outbox)
    for i in range(3):
        _submit(core, 0.0, i)
    rids = _meta_ids(core)
    core.on_fetch(0.01, "backend-0", InputFetch(1, rids[:2]), outbox)
    outbox.clear()
    outputs = [{"y": np.zeros((1, 1), np.float32)}] * 2
    core.on_outputs(0.02, BatchOutputs(1, rids[:2], outputs), outbox)
    core.on_cancel(0.02, CLIENT, 2, outbox)
    assert outbox == []
    sent = _tick(core)
    assert sent[0] == ((TO_SHARD, 0), CancelQueued("ipc://data", [rids[2]], ["m"]))
    ((destination, answers),) = sent[1:]
    assert destination == (TO_CLIENT, CLIENT) and isinstance(answers, InferAnswers)
    assert answers.request_ids == [0, 1] and answers.error_ids == [2]
    assert answers.errors == ["CANCELLED"]


def test_a_request_batch_is_admitted_and_refused_request_by_request() -> None:
    core = _core(max_queue=2)
    outbox: Outbox = []
    batch = InferRequests([7, 8, 9, 10], ["m", "nope", "m", "m"],
                          [_sample(1.0), _sample(2.0), _sample(3.0), _sample(4.0)],
                          [0.0, 0.0, 0.0, 0.0])
    core.on_client_message(0.0, CLIENT, batch, outbox)
    # The unknown model and the one over max_queue are refused, each with its own error.
    assert _errors(outbox) == {8: "BAD_REQUEST", 10: "OVERLOADED"}
    rids = _meta_ids(core)
    assert len(rids) == 2 and core.counters["received"] == 4 and core.counters["admitted"] == 2
    assert sorted(p.client_rid for p in core.pending.values()) == [7, 9]


@pytest.mark.parametrize("full", [True, False])
def test_a_batched_answer_that_cannot_be_sent_counts_each_answer(full: bool) -> None:
    core = _core()
    outbox: Outbox = []
    core.on_client_message(0.0, CLIENT, ClientHello(accepts=[InferAnswers.KIND]), outbox)
    for i in range(3):
        _submit(core, 0.0, i)
    for i in range(3):
        core.on_cancel(0.01, CLIENT, i, outbox)
    ((destination, answers),) = [(d, m) for d, m in _tick(core) if d[0] == TO_CLIENT]
    assert isinstance(answers, InferAnswers) and answers.error_ids == [0, 1, 2]
    core.on_send_failed(0.02, destination, answers, full, outbox)
    counter = "reply_dropped_hwm" if full else "reply_unroutable"
    assert core.counters[counter] == 3


# --------------------------------------------------------------------------- exactly one answer

Op = tuple[str, int, int]
_OPS = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(0, 1)),
    st.tuples(st.just("fetch"), st.integers(0, 1), st.integers(1, 4)),
    st.tuples(st.just("outputs"), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 2), st.integers(-1, 8)),
    st.tuples(st.just("drop"), st.integers(0, 8), st.just(0)),
    st.tuples(st.just("restart"), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("gone"), st.integers(0, 2), st.just(0)),
    st.tuples(st.just("advance"), st.integers(1, 80), st.just(0)),
    st.tuples(st.just("hello"), st.integers(0, 2), st.just(0)),  # answers batched per tick
)


class _VirtualHost:
    """Hosts a FrontendCore on a virtual clock the way the process host does: each event, then
    end_tick; on_timer whenever the clock passes wake_at. Counts the answers each request got."""

    def __init__(self) -> None:
        self.core = _core(max_queue=6)
        self.now = 0.0
        self.next_id = [0, 0, 0]
        self.answers: dict[tuple[bytes, int], int] = {}
        self.exempt: set[tuple[bytes, int]] = set()  # in flight when its client went away
        self.fetched: dict[str, list[int]] = {"backend-0": [], "backend-1": []}
        self.pids = {"backend-0": 1, "backend-1": 1}

    def deliver(self, outbox: Outbox) -> None:
        self.core.end_tick(outbox)
        for (kind, target), msg in outbox:
            if kind != TO_CLIENT:
                continue
            assert isinstance(target, bytes)
            ids = [msg.request_id] if isinstance(msg, InferReply | InferError) else (
                [*msg.request_ids, *msg.error_ids] if isinstance(msg, InferAnswers) else [])
            for request_id in ids:
                key = (target, request_id)
                self.answers[key] = self.answers.get(key, 0) + 1

    def advance(self, to: float) -> None:
        while self.core.wake_at <= to:
            self.now = max(self.now, self.core.wake_at)
            outbox: Outbox = []
            self.core.on_timer(self.now, outbox)
            self.deliver(outbox)
        self.now = to

    def apply(self, op: Op) -> None:
        kind, a, b = op
        outbox: Outbox = []
        getattr(self, f"_{kind}")(a, b, outbox)
        self.deliver(outbox)

    def _submit(self, client_index: int, model: int, outbox: Outbox) -> None:
        client = f"client-{client_index}".encode()
        request_id = self.next_id[client_index]
        self.next_id[client_index] += 1
        self.answers.setdefault((client, request_id), 0)
        self.core.on_client_message(self.now, client, InferRequest(
            request_id, "m" if model else "a", _sample(request_id)), outbox)

    def _fetch(self, backend_index: int, count: int, outbox: Outbox) -> None:
        backend = f"backend-{backend_index}"
        queued = [p.rid for p in self.core.pending.values() if p.inputs is not None][:count]
        self.core.on_fetch(self.now, backend, InputFetch(1, queued), outbox)
        self.fetched[backend] += queued

    def _outputs(self, backend_index: int, _: int, outbox: Outbox) -> None:
        backend = f"backend-{backend_index}"
        rids, self.fetched[backend] = self.fetched[backend], []
        outputs = [{"y": np.zeros((1, 1), np.float32)}] * len(rids)
        self.core.on_outputs(self.now, BatchOutputs(1, rids, outputs), outbox)

    def _cancel(self, client_index: int, client_rid: int, outbox: Outbox) -> None:
        client = f"client-{client_index}".encode()
        if client_rid < 0:  # the client closes: what it has in flight is answered nothing
            self._exempt(client)
        self.core.on_cancel(self.now, client, client_rid, outbox)

    def _drop(self, first: int, _: int, outbox: Outbox) -> None:
        rids = sorted(self.core.pending)[first:first + 2]
        self.core.on_drop(self.now, DropNotice(rids, "DEADLINE", "late"), outbox)

    def _restart(self, backend_index: int, _: int, outbox: Outbox) -> None:
        backend = f"backend-{backend_index}"
        self.pids[backend] += 1
        self.core.on_backend_hello(self.now, Hello("backend", backend, self.pids[backend]),
                                   outbox)

    def _gone(self, client_index: int, _: int, outbox: Outbox) -> None:
        client = f"client-{client_index}".encode()
        self._exempt(client)
        self.core.client_gone(client)

    def _hello(self, client_index: int, _: int, outbox: Outbox) -> None:
        client = f"client-{client_index}".encode()
        self.core.on_client_message(self.now, client, ClientHello([InferAnswers.KIND]), outbox)

    def _advance(self, milliseconds: int, _: int, outbox: Outbox) -> None:
        self.advance(self.now + milliseconds * 1e-3)

    def _exempt(self, client: bytes) -> None:
        for client_rid in self.core.requests.by_client.get(client, {}):
            self.exempt.add((client, client_rid))


@settings(max_examples=150, deadline=None)
@given(st.lists(_OPS, max_size=60))
def test_every_request_is_answered_exactly_once(ops: list[Op]) -> None:
    host = _VirtualHost()
    for op in ops:
        host.apply(op)
    host.advance(host.now + 2 * SLO_S)  # every deadline passes
    assert not host.core.pending and host.core.wake_at == math.inf
    for key, count in host.answers.items():
        # One answer each; none for a request whose client went away while it was in flight.
        assert count == (0 if key in host.exempt else 1), (key, count)


class _DeadlineHost(_VirtualHost):
    """A ``_VirtualHost`` that records when each request was admitted and checks every
    ``DEADLINE`` its timer answers: never before the request's SLO has passed."""

    def __init__(self) -> None:
        super().__init__()
        self.admitted_at: dict[tuple[bytes, int], float] = {}
        self.timer_deadlines = 0

    def _submit(self, client_index: int, model: int, outbox: Outbox) -> None:
        client = f"client-{client_index}".encode()
        self.admitted_at[(client, self.next_id[client_index])] = self.now
        super()._submit(client_index, model, outbox)

    def advance(self, to: float) -> None:
        while self.core.wake_at <= to:
            self.now = max(self.now, self.core.wake_at)
            outbox: Outbox = []
            self.core.on_timer(self.now, outbox)
            self.deliver(outbox)
            for (_, client), msg in outbox:
                ids = [msg.request_id] if isinstance(msg, InferError) else (
                    msg.error_ids if isinstance(msg, InferAnswers) else [])
                for request_id in ids:
                    assert isinstance(client, bytes)
                    self.timer_deadlines += 1
                    early_s = self.admitted_at[(client, request_id)] + SLO_S - self.now
                    assert early_s <= 0.0, f"DEADLINE answered {early_s * 1e6:.1f} us early"
        self.now = to

    def _advance_us(self, microseconds: int, _: int, outbox: Outbox) -> None:
        self.advance(self.now + microseconds * 1e-6)


_DEADLINE_OPS = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(0, 1)),
    st.tuples(st.just("advance_us"), st.integers(1, 2000), st.just(0)),
    st.tuples(st.just("advance"), st.integers(1, 120), st.just(0)),
    st.tuples(st.just("hello"), st.integers(0, 2), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_DEADLINE_OPS, max_size=80))
def test_no_deadline_answer_before_the_deadline(ops: list[Op]) -> None:
    """Whatever the schedule, the frontend's timer answers DEADLINE only once the request's SLO
    has passed: a batch may still answer it until then (it answered requests whose deadline was
    within 0.5 ms of the timer, which a policy finishing batches that close lost at any load)."""
    host = _DeadlineHost()
    for op in ops:
        host.apply(op)
    host.advance(host.now + 2 * SLO_S)
    assert not host.core.pending
    assert all(count == 1 for count in host.answers.values())
