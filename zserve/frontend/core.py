"""FrontendCore: the frontend's logic with no sockets, no loop and no clock.

It holds the request table and input store, admits requests (model, size, signature, queue and
predicted-wait bounds), answers deadlines, cancellations and backend failures, and coalesces what
a tick produced. Hosting contract (that of ``zserve.scheduler.common``): every method takes
``now`` (seconds on the cluster clock) and an ``outbox`` it appends ``(destination, message)``
to; ``wake_at`` is read back after every call (``on_timer`` is due at it); ``end_tick`` appends
what is sent once per tick: one ``RequestMetaBatch`` and one ``CancelQueued`` per shard, one
``CancelFetched`` per backend and one ``InferAnswers`` per client that accepts them.
Destinations: ``("client", identity)``, ``("shard", index)``, ``("backend", name)``. A host
that cannot deliver a message says so with ``on_send_failed``. Hosted by ``zserve.frontend.host``
(the process) and drivable by a simulator.

Two parts, built by the core and each testable alone:
``zserve.frontend.apps.AppDriver`` drives ``[[apps]]`` requests through their stages (the core is
its ``StageSink``: a stage is a request of the core under the client ``APP_CLIENT``);
``zserve.frontend.cancel.FrontendCancellation`` notes what shards and backends must hear of
cancelled and abandoned requests, and ``zserve.frontend.backend_view.FrontendBackends`` follows
the backends (their table, hellos and deaths) and says which lost the requests they fetched; the
core answers those.

Statistics are one ``zserve.core.stats.Stats`` (``FRONTEND_COUNTERS``, ``FRONTEND_HISTOGRAMS`` and
``queueing/<model>`` per model); ``stats(reset)`` is its snapshot plus the request table's state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from zserve.config.cluster import ClusterConfig, ModelConfig, shard_for_model
from zserve.config.prefix_groups import HEAD_INPUT
from zserve.config.profiles import LatencyProfile
from zserve.config.signature import quoted
from zserve.core.allowances import (
    FLOOR_REPLY_S,
    LEARNED,
    MARGIN_REPLY_S,
    TAIL_QUANTILE,
    AllowanceRule,
    LearnedAllowance,
)
from zserve.core.errors import ErrorKind, ZServeError, bounded_message
from zserve.core.hosting import Destination, Outbox
from zserve.core.request_ids import RequestIds, incarnation_of
from zserve.core.stats import Histogram, Stats
from zserve.core.timer_heap import LazyTimerHeap
from zserve.frontend.admission import ModelAdmission
from zserve.frontend.app_split import (
    AppSplits,
    latency_tables_s,
    scheduling_allowances_s,
    stage_overhead_s,
)
from zserve.frontend.apps import APP_CLIENT, APP_COUNTERS, AppDriver
from zserve.frontend.backend_view import FrontendBackends, LostBackends
from zserve.frontend.cancel import CANCEL_COUNTERS, FrontendCancellation
from zserve.frontend.on_demand import OnDemandHolds, Usage
from zserve.frontend.requests import FETCHED, QUEUED, Answers, Pending, RequestTable
from zserve.transport.messages import (
    BackendGone,
    BackendTable,
    BatchFailed,
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
    protocol_mismatch,
)

log = logging.getLogger("zserve.frontend")

TO_CLIENT = "client"
TO_SHARD = "shard"
TO_BACKEND = "backend"

# The deadline timer fires this long after the earliest pending deadline, so deadlines that fall
# due within it share one wake-up (a wake-up costs tens of us; under overload many requests miss
# together). It only ever delays a DEADLINE answer: a request is never answered DEADLINE before
# its deadline, while a batch could still answer it.
TIMER_COALESCE_S = 0.0005
# The deadline heap is rebuilt from the pending requests once it holds more than this many
# entries and more than this many times the pending requests (most are answered early).
TIMER_COMPACT_MIN = 1024
TIMER_COMPACT_FACTOR = 4
# The admission gates' buckets are resized when the learned reply allowance moved this much
# since they were sized (each resize walks every model).
GATE_REPLY_STEP_S = 0.05e-3
# Built once, because Enum lookups and ``.value`` run Python code.
_WIRE_ERRORS = {kind: kind.value for kind in ErrorKind}
_ERROR_COUNTERS = {kind: f"error_{kind.value}" for kind in ErrorKind}
_REJECTED_COUNTERS = {kind: f"rejected_{kind.value}" for kind in ErrorKind}
_ERROR_KINDS = {kind.value: kind for kind in ErrorKind}

FRONTEND_COUNTERS = (
    "received", "admitted", "replied", "client_disconnects", *CANCEL_COUNTERS,
    "fetches", "fetch_missing",
    "late_outputs", "dropped_by_scheduler", "deadline_timer", "meta_batches", "cancel_notices",
    # refused: what came back for requests of another incarnation (zserve.core.request_ids)
    "stale_outputs", "stale_drops", "stale_failures", "stale_fetched",
    # queued requests re-sent to a scheduler of a new epoch (zserve.core.epochs)
    "requeued",
    # delivery failures the host reported (on_send_failed)
    "fetch_reply_failed", "meta_send_failed", "cancel_notice_failed", "reply_dropped_hwm",
    "reply_unroutable",
    *_REJECTED_COUNTERS.values(), *_ERROR_COUNTERS.values(),
    *APP_COUNTERS,  # app requests (zserve.frontend.apps)
    "app_resplits",  # apps' SLO splits recomputed from measured rates (zserve.frontend.app_split)
)
"""The core's counters: requests received and admitted, answers (``replied`` with outputs,
``error_<KIND>`` with an error, ``rejected_<KIND>`` at admission), cancellations, fetches and
messages sent (``cancel_notices``: CancelFetched), and the delivery failures its host reported."""
FRONTEND_HISTOGRAMS = {
    "admit_to_fetch": "delay",  # admission -> a backend fetched the inputs
    "fetch_to_outputs": "delay",  # the fetch -> the outputs reached this frontend
    "admit_to_answer": "delay",  # admission -> answered (outputs or an error)
    # From the backends' BatchOutputs: batch start - admission (queueing, deferral included),
    # batch start -> finish (execution), batch finish -> outputs handled here (cross-process:
    # may be negative by the clock error) and, per request, answer - admission - execution
    # (issue 7's "overhead").
    "queueing": "delay",
    "execution": "delay",
    "finish_to_answer": "signed",
    "overhead": "signed",
    "app_answered": "delay",  # an app request's admission -> its answer with outputs
}
"""The core's latency histograms (seconds), by bounds scheme; plus, per configured model,
``queueing/<model>`` (the ``queueing`` hop of one model), ``execution/<model>`` (one value per
batch) and ``latency/<model>`` (admission -> answer), and the counters ``outcome/<model>/<o>``
(``o``: ``ok`` or an ``ErrorKind`` value; answers after admission and rejections of a configured
model) that ``zserve.frontend.metrics`` exports. ``admit_to_answer`` and ``queueing`` are the sums
of ``latency/<model>`` and ``queueing/<model>``, summed when a snapshot is taken."""
QUEUEING_OF_MODEL = "queueing/{}"
EXECUTION_OF_MODEL = "execution/{}"
LATENCY_OF_MODEL = "latency/{}"
_PER_MODEL_HISTOGRAMS = (QUEUEING_OF_MODEL, EXECUTION_OF_MODEL, LATENCY_OF_MODEL)
OUTCOME_OF_MODEL = "outcome/{}/{}"
OUTCOME_OK = "ok"


def _outcome_names(models: Iterable[str]) -> dict[str, dict[str, str]]:
    """``outcome/<model>/<outcome>`` counter names by model and outcome (``ok`` or an error
    kind)."""
    outcomes = (OUTCOME_OK, *_WIRE_ERRORS.values())
    return {name: {o: OUTCOME_OF_MODEL.format(name, o) for o in outcomes} for name in models}


def error_kind(value: str) -> ErrorKind:
    return _ERROR_KINDS.get(value, ErrorKind.INTERNAL)


class _Rejected(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _admissions(cluster: ClusterConfig, profiles: dict[str, LatencyProfile | None]
                ) -> dict[str, ModelAdmission]:
    """Each model's admission state; a frontend's share of a model's load is 1 / the
    frontends (clients spread over them)."""
    shards, share = cluster.scheduler.shards, 1.0 / cluster.frontends.count
    reply_s = cluster.frontends.reply_allowance_ms / 1e3
    heads = cluster.group_heads  # a prefix group's models live on the group's shard
    return {m.name: ModelAdmission(m, shard_for_model(heads.get(m.name, (m.name, 0))[0],
                                                      shards),
                                   profiles.get(m.name), reply_s, share)
            for m in cluster.models}


def _learned_reply(cluster: ClusterConfig, configured_s: float) -> LearnedAllowance | None:
    """Under ``[scheduler] allowances = "learned"``: the reply path's p99 (a batch's end -> this
    frontend's answer, plus a margin for the hop to the client), started at and capped by the
    configured value; the deadlines sent to the scheduler follow it. None: ``fixed``."""
    if cluster.scheduler.allowances != LEARNED:
        return None
    # the p99 (TAIL_QUANTILE): the reply's slack is the last a late input can still use, and
    # at the p95 the loaded twin lost more than the fixed rule (docs/performance.md)
    return LearnedAllowance(AllowanceRule.from_configured(
        configured_s, FLOOR_REPLY_S, MARGIN_REPLY_S, TAIL_QUANTILE), 0.0)


class _ShardMeta:
    """The metadata one shard gets at the end of this tick (one ``RequestMetaBatch``)."""

    __slots__ = ("arrivals", "deadlines", "ids", "models", "rows")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.models: list[str] = []
        self.arrivals: list[float] = []
        self.deadlines: list[float] = []  # the scheduler's: answer_by - the reply allowance
        self.rows: list[int] = []  # empty while every request holds one row


class FrontendCore:
    """The frontend's state and decisions; see the module docstring for the hosting contract.

    Names on the hot path: ``p`` is a ``Pending`` request; ``rid`` its id here (unique across the
    cluster's frontends and this frontend's restarts, ``zserve.core.request_ids``), the one the
    scheduler and the backends know; ``client_rid`` the id its client gave it (unique per
    connection); ``answer_by`` the moment its SLO ends; ``rows`` its batch dimension (what
    admission counts).
    """

    def __init__(self, *, name: str, cluster: ClusterConfig, index: int, data_address: str,
                 profiles: dict[str, LatencyProfile | None],
                 host_counters: Iterable[str] = (), incarnation: int = 0) -> None:
        """``profiles``: each model's configured profile (None: learn the one its backends
        measured); ``host_counters``: counters the host bumps in ``counters`` (its own);
        ``incarnation``: this process start's ``new_incarnation()`` (0: a host that never
        restarts), carried in the high bits of every request id."""
        self.name = name
        self.cluster = cluster
        self.data_address = data_address  # where backends fetch this frontend's inputs
        self.reply_allowance_s = cluster.frontends.reply_allowance_ms / 1e3
        self.reply = _learned_reply(cluster, self.reply_allowance_s)
        self._reply_seen_at = 0.0  # the last outputs' time (the summary's clock)
        self._gate_reply_s = self.reply_allowance_s  # what the admission gates were sized with
        self.max_request_bytes = cluster.frontends.max_request_bytes
        self.models = _admissions(cluster, profiles)
        # the names, replaced whole on an addition: read from the metrics thread at a scrape
        self.model_names: tuple[str, ...] = tuple(self.models)
        shards = cluster.scheduler_processes
        self.shard_reachable = [True] * shards  # the host clears the ones it cannot reach
        self.requests = RequestTable()
        # Unique across the cluster's frontends and across this frontend's restarts.
        self.ids = RequestIds(index, incarnation)
        self._stale_logged: set[tuple[str, int]] = set()
        self.epoch, self.draining = 0, False  # epoch: the newest heard of (zserve.core.epochs)
        self._init_stats(host_counters)
        self.backends = FrontendBackends(name=name, models=self.models,
                                         max_request_bytes=self.max_request_bytes)
        # A prefix group's model -> (the group, its head): queued and planned as the group,
        # its fetched inputs carry its head (zserve.config.prefix_groups).
        self.group_heads = cluster.group_heads
        self.scheduled_as = {model: group for model, (group, _) in self.group_heads.items()}
        self.cancels = FrontendCancellation(
            shard_of={model: state.shard for model, state in self.models.items()},
            shards=shards, counters=self.counters, scheduled_as=self.scheduled_as)
        orchestration = cluster.orchestration
        self.on_demand = OnDemandHolds(
            enabled=orchestration is not None and orchestration.load_on_demand,
            report=orchestration is not None)
        self.batched_clients: set[bytes] = set()  # clients that decode InferAnswers
        self.refused_clients: dict[bytes, str] = {}  # another wire protocol: why
        self._answers: dict[bytes, Answers] = {}  # this tick's, per batched client
        self._meta_by_shard = [_ShardMeta() for _ in range(shards)]
        # (answer_by, rid) of every pending request; an entry is live while its request is
        # pending with that deadline (most are answered first: lazily deleted).
        self._timers: LazyTimerHeap[int] = LazyTimerHeap(self._deadline_is_live)
        self.wake_at = math.inf
        plans = cluster.app_graphs()
        # Each app's SLO split, re-run every period from the rates admitted here (the first
        # period starts at the first app request).
        self.app_splits = AppSplits(plans, latency_tables_s(cluster, profiles),
                                    frontends=cluster.frontends.count,
                                    overhead_s=stage_overhead_s(cluster),
                                    delay_s=scheduling_allowances_s(cluster))
        self.apps = AppDriver(plans, self.app_splits.weights, self,
                              overhead_s=stage_overhead_s(cluster), counters=self.counters,
                              observe_answered=self._stats.histograms["app_answered"].observe)

    def _init_stats(self, host_counters: Iterable[str]) -> None:
        """The counters and histograms, the per-request ones bound to attributes once."""
        # counter name of (model, outcome), built once: the answer path only looks it up
        self._outcome_names = _outcome_names(self.models)
        self._stats = Stats(
            (*FRONTEND_COUNTERS, *host_counters,
             *(n for names in self._outcome_names.values() for n in names.values())),
            {**FRONTEND_HISTOGRAMS,
             **{pattern.format(name): "delay" for name in self.models
                for pattern in _PER_MODEL_HISTOGRAMS}})
        self.counters = self._stats.counters
        hist = self._stats.histograms
        self._admit_to_fetch = hist["admit_to_fetch"]
        self._fetch_to_outputs = hist["fetch_to_outputs"]
        self._admit_to_answer = hist["admit_to_answer"]
        self._queueing = hist["queueing"]
        self._execution = hist["execution"]
        self._finish_to_answer = hist["finish_to_answer"]
        self._overhead = hist["overhead"]
        self._queueing_of, self._execution_of, self._latency_of = (
            {name: hist[pattern.format(name)] for name in self.models}
            for pattern in _PER_MODEL_HISTOGRAMS)

    def add_model(self, config: ModelConfig, profile: LatencyProfile | None) -> bool:
        """A model added to the cluster after start (a repository rescan): admitted from now
        on, with its counters and histograms; False when it is known already."""
        if config.name in self.models:
            return False
        name = config.name
        self.models[name] = ModelAdmission(
            config, shard_for_model(name, self.cluster.scheduler.shards), profile,
            self.reply_allowance_s, 1.0 / self.cluster.frontends.count)
        self.model_names = (*self.model_names, name)
        self.cancels.add_model(name, self.models[name].shard)
        names = _outcome_names([name])[name]
        self._outcome_names[name] = names
        for counter in names.values():
            self.counters.setdefault(counter, 0)
        hist = self._stats.histograms
        for pattern, by_model in zip(_PER_MODEL_HISTOGRAMS, (
                self._queueing_of, self._execution_of, self._latency_of), strict=True):
            by_model[name] = hist.setdefault(pattern.format(name), Histogram("delay"))
        self.backends.recount()  # the latest table may list it already
        return True

    @property
    def pending(self) -> dict[int, Pending]:
        return self.requests.pending

    @property
    def backend_models(self) -> dict[str, list[str]] | None:
        """Each backend's models, from the rank's latest ``BackendTable`` (None before one)."""
        return self.backends.table

    # ------------------------------------------------------------------ clients

    def on_client_message(self, now: float, client: bytes, msg: Message,
                          outbox: Outbox) -> bool:
        """Handle a client's InferRequest(s), CancelRequest or ClientHello; False for any other."""
        if type(msg) is InferRequest:
            self.on_infer(now, client, msg, outbox)
        elif type(msg) is InferRequests:  # several at once: each as its own InferRequest
            for request in msg.requests():
                self.on_infer(now, client, request, outbox)
        elif type(msg) is CancelRequest:
            self.on_cancel(now, client, msg.request_id, outbox)
        elif type(msg) is ClientHello:
            self._check_client_protocol(client, msg.protocol)
            if InferAnswers.KIND in msg.accepts:
                self.batched_clients.add(client)
            else:
                self.batched_clients.discard(client)
        else:
            return False
        return True

    def _check_client_protocol(self, client: bytes, protocol: int) -> None:
        """A client of another wire protocol has each of its requests refused BAD_REQUEST with
        the one line naming both versions (it cannot be answered before it sends one)."""
        refusal = protocol_mismatch(f"client {client.hex()}", protocol)
        if refusal is None:
            self.refused_clients.pop(client, None)
        else:
            log.warning("%s: refusing %s", self.name, refusal)
            self.refused_clients[client] = refusal

    def on_infer(self, now: float, client: bytes, req: InferRequest, outbox: Outbox, *,
                 expire_at: float = -math.inf) -> None:
        """Admit ``req`` of ``client`` (or answer why not); ``expire_at``: the frontend answers
        it ``DEADLINE`` no earlier than this (an app's stage request: the app's answer-by)."""
        self.counters["received"] += 1
        if self.apps.names and req.model in self.apps.names:
            self._on_app_infer(now, client, req, outbox)
            return
        try:
            model, rows, hold = self._admit(now, client, req)
        except _Rejected as rejected:
            self.counters[_REJECTED_COUNTERS[rejected.kind]] += 1
            names = self._outcome_names.get(req.model)  # a configured model's rejection only
            if names is not None:
                self.counters[names[_WIRE_ERRORS[rejected.kind]]] += 1
            self._send_error(client, req.request_id, rejected.kind, rejected.message, outbox)
            return
        slo_s = model.slo_s if req.slo_ms <= 0 else min(model.slo_s, req.slo_ms / 1e3)
        answer_by = now + slo_s
        rid = self.ids.take()
        pending = Pending(rid, client, req.request_id, req.model, req.inputs, now, answer_by,
                          rows)
        pending.expire_at = expire_at = max(expire_at, answer_by)
        self.requests.add(pending)
        model.pending += rows
        model.queued += rows
        self.counters["admitted"] += 1
        if self.apps.names:  # the rates the apps' splits are recomputed from
            self.app_splits.note(req.model)
        self._timers.push(expire_at, rid)
        self.wake_at = min(self.wake_at, expire_at + TIMER_COALESCE_S)
        if self.on_demand.report:  # with [orchestration] only: no call per request otherwise
            self.on_demand.note_admitted(req.model)
        if hold:  # no backend serves it: held until one does (an on-demand load)
            self.on_demand.hold(req.model, rid)
            return
        self._queue_meta(model.shard, rid, req.model, now, answer_by - self.reply_allowance_s,
                         rows=rows)

    # ------------------------------------------------------------------ apps (StageSink)

    def _on_app_infer(self, now: float, client: bytes, req: InferRequest,
                      outbox: Outbox) -> None:
        """An app request: refused as a model request would be, else the driver's."""
        refusal = (self.refused_clients.get(client) if self.refused_clients else None)
        kind = ErrorKind.BAD_REQUEST
        if refusal is None and self.draining:
            kind, refusal = ErrorKind.SHUTTING_DOWN, f"frontend {self.name} is shutting down"
        if refusal is not None:
            self.counters[_REJECTED_COUNTERS[kind]] += 1
            self._send_error(client, req.request_id, kind, refusal, outbox)
            return
        if not self.app_splits.started:
            self.app_splits.start(now)
            self.wake_at = min(self.wake_at, self.app_splits.next_at)
        self.apps.on_infer(now, client, req, outbox)

    def submit_stage(self, now: float, stage: InferRequest, outbox: Outbox, *,
                     expire_at: float) -> None:
        """One stage instance of an app request: a request of its model, admitted like a
        client's, answered to the driver; the frontend's timer waits for its outputs until
        ``expire_at`` (its app's answer-by), past the stage's own deadline."""
        self.on_infer(now, APP_CLIENT, stage, outbox, expire_at=expire_at)

    def cancel_stage(self, stage_rid: int) -> None:
        """Withdraw a stage request whose app has its answer: unanswered, as a client's that
        disconnected."""
        rid = self.requests.by_client.get(APP_CLIENT, {}).get(stage_rid)
        p = None if rid is None else self.requests.pending.get(rid)
        if p is not None:
            self.cancels.cancelled(p)
            p.client = None
            self._finish(p)

    def answer_app(self, client: bytes, client_rid: int, outputs: dict[str, Any] | None,
                   error: tuple[ErrorKind, str] | None, outbox: Outbox) -> None:
        """The one answer of an app request: its outputs or its failing stage's error."""
        if error is not None:
            self._send_error(client, client_rid, error[0], error[1], outbox)
        elif client in self.batched_clients:
            answers = self._answers_to(client)
            answers.request_ids.append(client_rid)
            answers.outputs.append(outputs or {})
        else:
            outbox.append(((TO_CLIENT, client), InferReply(client_rid, outputs or {})))

    def _queue_meta(self, shard: int, rid: int, model: str, arrival: float, deadline: float,
                    *, rows: int) -> None:
        """Add one request to the metadata its shard gets at the end of this tick."""
        meta = self._meta_by_shard[shard]
        if rows != 1 or meta.rows:  # one entry per request once one holds several rows
            meta.rows.extend([1] * (len(meta.ids) - len(meta.rows)))
            meta.rows.append(rows)
        meta.ids.append(rid)
        meta.models.append(self.scheduled_as.get(model, model) if self.scheduled_as else model)
        meta.arrivals.append(arrival)
        meta.deadlines.append(deadline)

    def _admit(self, now: float, client: bytes, req: InferRequest
               ) -> tuple[ModelAdmission, int, bool]:
        """The request's model and rows, and whether it is held for an on-demand load, if
        ``req`` may be admitted; raises ``_Rejected`` otherwise."""
        if self.refused_clients and client in self.refused_clients:
            raise _Rejected(ErrorKind.BAD_REQUEST, self.refused_clients[client])
        model = self.models.get(req.model)
        if model is None:
            raise _Rejected(ErrorKind.BAD_REQUEST, f"unknown model {quoted(req.model)}")
        if self.draining:
            raise _Rejected(ErrorKind.SHUTTING_DOWN, f"frontend {self.name} is shutting down")
        if self.requests.in_flight(client, req.request_id):
            raise _Rejected(ErrorKind.BAD_REQUEST, f"request id {req.request_id} is already "
                            "in flight on this connection")
        try:
            rows = model.request_rows(req.inputs, self.max_request_bytes)
        except ZServeError as exc:
            raise _Rejected(exc.kind, exc.message) from None
        except Exception as exc:  # an input that is no array
            raise _Rejected(ErrorKind.BAD_REQUEST, bounded_message(str(exc))) from None
        if not 0.0 <= req.slo_ms < math.inf:  # negative, infinite or NaN
            raise _Rejected(ErrorKind.BAD_REQUEST, f"slo_ms must be >= 0, got {req.slo_ms}")
        if not self.shard_reachable[model.shard]:
            raise _Rejected(ErrorKind.UNAVAILABLE,
                            f"scheduler shard {model.shard} is not reachable")
        gpus = self.backends.gpus_for_model.get(req.model, -1)
        if gpus == 0:
            self._hold_or_refuse(req.model, model)
            return model, rows, True
        if gpus < 0:
            gpus = self.cluster.backends.total
        refusal = model.overload(now, rows, gpus)
        if refusal is not None:
            raise _Rejected(ErrorKind.OVERLOADED, refusal)
        return model, rows, False

    def _hold_or_refuse(self, name: str, model: ModelAdmission) -> None:
        """A request for ``name``, which no backend serves: held for an on-demand load (with
        ``[orchestration]``), else refused ``UNAVAILABLE``."""
        if not self.on_demand.enabled:
            raise _Rejected(ErrorKind.UNAVAILABLE, f"no backend serves model {name!r}")
        if self.on_demand.full(name, model.max_queue, self.requests.pending):
            raise _Rejected(ErrorKind.OVERLOADED, f"{model.max_queue} requests wait for model "
                            f"{name!r} to be loaded")

    # ------------------------------------------------------------------ backends

    def on_fetch(self, now: float, backend: str, msg: InputFetch, outbox: Outbox) -> None:
        """A backend fetches a plan's inputs: hand them over (the ones still queued)."""
        ids: list[int] = []
        inputs: list[dict[str, Any]] = []
        missing: list[int] = []
        observe = self._admit_to_fetch.observe
        for rid in msg.request_ids:
            taken = self.requests.take_inputs(rid, backend, msg.plan_id, now)
            if taken is None:
                missing.append(rid)
                self._refuse_if_stale(rid, "stale_fetched", "an input fetch")
                continue
            p, request_inputs = taken
            self.models[p.model].queued -= p.rows
            ids.append(rid)
            head = self.group_heads.get(p.model) if self.group_heads else None
            if head is not None:  # the group's model runs each row through its own head
                request_inputs = {**request_inputs,
                                  HEAD_INPUT: np.full(p.rows, head[1], np.int64)}
            inputs.append(request_inputs)
            observe(now - p.arrival)
        outbox.append(((TO_BACKEND, backend), InputReply(msg.plan_id, ids, inputs, missing)))
        self.counters["fetches"] += 1
        self.counters["fetch_missing"] += len(missing)

    def _learn_reply(self, now: float, sample_s: float) -> None:
        """A reply-path sample: the deadlines sent from now on keep the learned allowance, and
        the admission gates' buckets follow it when it moved by ``GATE_REPLY_STEP_S``."""
        assert self.reply is not None
        self.reply.observe(now, sample_s)
        self.reply_allowance_s = self.reply.value(now)
        self._reply_seen_at = now
        if abs(self.reply_allowance_s - self._gate_reply_s) >= GATE_REPLY_STEP_S:
            self._gate_reply_s = self.reply_allowance_s
            for model in self.models.values():
                model.set_reply_allowance(self.reply_allowance_s)

    def on_outputs(self, now: float, msg: BatchOutputs, outbox: Outbox) -> None:
        started_at = msg.started_at
        timed = started_at > 0.0 and msg.finished_at >= started_at
        execution = msg.finished_at - started_at if timed else 0.0
        if timed:
            self._execution.observe(execution)
            self._finish_to_answer.observe(now - msg.finished_at)
            if self.reply is not None:
                self._learn_reply(now, now - msg.finished_at)
        fetch_to_outputs = self._fetch_to_outputs.observe
        batch_model: str | None = None
        for rid, outputs in zip(msg.request_ids, msg.outputs, strict=False):
            p = self.requests.pending.get(rid)
            if p is None:  # answered already (cancelled, deadline): the outputs are discarded
                if not self._refuse_if_stale(rid, "stale_outputs", "outputs"):
                    self.counters["late_outputs"] += 1
                continue
            batch_model = p.model
            if p.fetched_at:
                fetch_to_outputs(now - p.fetched_at)
            if started_at > 0.0:
                self._note_queueing(p, started_at - p.arrival)
                if timed:
                    self._overhead.observe(now - p.arrival - execution)
            self._answer_outputs(now, p, outputs, outbox)
        if timed and batch_model is not None:  # a batch runs one model
            self._execution_of[batch_model].observe(execution)

    def _note_queueing(self, p: Pending, delay: float) -> None:
        self._queueing_of[p.model].observe(delay)  # queueing: stats()

    def on_batch_failed(self, now: float, msg: BatchFailed, outbox: Outbox) -> None:
        kind = error_kind(msg.error)
        for rid in msg.request_ids:
            p = self.requests.pending.get(rid)
            if p is not None:
                self._answer_error(now, p, kind, msg.message, outbox)
            else:
                self._refuse_if_stale(rid, "stale_failures", "a batch failure")

    def on_drop(self, now: float, msg: DropNotice, outbox: Outbox) -> None:
        """The scheduler dropped requests (it could not serve them in time)."""
        kind = error_kind(msg.error)
        for rid in msg.request_ids:
            p = self.requests.pending.get(rid)
            if p is not None:
                self.counters["dropped_by_scheduler"] += 1
                self._answer_error(now, p, kind, msg.message, outbox)
            else:
                self._refuse_if_stale(rid, "stale_drops", "a scheduler drop")

    def _refuse_if_stale(self, rid: int, counter: str, what: str) -> bool:
        """Count (and log once per incarnation and kind) a message for a request of another
        incarnation of this frontend; False if ``rid`` is this incarnation's. Such a request is
        never pending here (its id has another incarnation): this only accounts for it."""
        if not self.ids.is_foreign(rid):
            return False
        incarnation = incarnation_of(rid)
        self.counters[counter] += 1
        if (counter, incarnation) not in self._stale_logged:
            self._stale_logged.add((counter, incarnation))
            log.warning("%s: refused %s for request %d of incarnation %d (this is incarnation "
                        "%d): a previous process's request", self.name, what, rid, incarnation,
                        self.ids.incarnation)
        return True

    def _answer_ids(self, now: float, rids: list[int], kind: ErrorKind, message: str,
                    outbox: Outbox) -> None:
        for rid in rids:
            p = self.requests.pending.get(rid)
            if p is not None:
                self._answer_error(now, p, kind, message, outbox)

    # ------------------------------------------------------------------ cancellations

    def on_cancel(self, now: float, client: bytes, client_rid: int, outbox: Outbox) -> None:
        """Cancel one request of ``client`` (answered ``CANCELLED``), or with ``client_rid`` < 0
        every request it has in flight, unanswered (a client closing its connection)."""
        if self.apps.names and self.apps.on_cancel(client, client_rid, outbox):
            return
        client_reqs = self.requests.by_client.get(client)
        if not client_reqs:
            return
        if client_rid < 0:
            for rid in list(client_reqs.values()):
                p = self.requests.pending.get(rid)
                if p is not None:
                    self.cancels.cancelled(p)
                    p.client = None
                    self._finish(p)
            return
        target = client_reqs.get(client_rid)
        p = None if target is None else self.requests.pending.get(target)
        if p is not None:
            self.cancels.cancelled(p)
            self._answer_error(now, p, ErrorKind.CANCELLED, "cancelled by the client", outbox)

    def client_gone(self, client: bytes) -> None:
        """``client``'s connection closed: forget it and its requests, unanswered."""
        self.batched_clients.discard(client)
        self.refused_clients.pop(client, None)
        self._answers.pop(client, None)
        if self.apps.names:
            self.apps.client_gone(client)
        client_reqs = self.requests.by_client.get(client)
        if not client_reqs:
            return
        self.counters["client_disconnects"] += 1
        for rid in list(client_reqs.values()):
            p = self.requests.pending.get(rid)
            if p is not None:
                self.cancels.abandoned(p)
                p.client = None
                self._finish(p)
        self.requests.by_client.pop(client, None)

    # ------------------------------------------------------------------ backends come and go

    def on_backend_hello(self, now: float, msg: Hello, outbox: Outbox) -> None:
        """A backend's Hello: a restarted one (a new pid) lost the requests it fetched."""
        self._backends_lost(now, self.backends.on_hello(msg), outbox)

    def on_backend_gone(self, now: float, msg: BackendGone, outbox: Outbox) -> None:
        """The supervisor says a backend's process died: its fetched requests fail now."""
        self._backends_lost(now, self.backends.on_gone(msg), outbox)

    def on_backend_table(self, now: float, msg: BackendTable, outbox: Outbox) -> None:
        """The rank's table of backends; the fetched requests of one that left it fail now,
        and those held for a model it now lists go to the model's shard."""
        self._backends_lost(now, self.backends.on_table(msg), outbox)
        self.release_held(now)

    def release_held(self, now: float) -> None:
        """Send the requests held for a model that a backend serves now to its shard."""
        for model in self.on_demand.waiting_models():
            if self.backends.gpus_for_model.get(model, 0) <= 0:
                continue
            shard = self.models[model].shard
            for rid in self.on_demand.release(model):
                p = self.requests.pending.get(rid)
                if p is not None and p.state == QUEUED and p.client is not None:
                    self._queue_meta(shard, rid, model, p.arrival,
                                     p.answer_by - self.reply_allowance_s, rows=p.rows)

    def fail_held(self, now: float, model: str, reason: str, outbox: Outbox) -> None:
        """The orchestrator cannot load ``model`` now (``ModelUnservable``): answer the
        requests held for it ``UNAVAILABLE`` at once, not at their deadlines."""
        for rid in self.on_demand.release(model):
            p = self.requests.pending.get(rid)
            if p is not None and p.state == QUEUED:
                self._answer_error(now, p, ErrorKind.UNAVAILABLE,
                                   f"model {model!r} cannot be loaded: {reason}", outbox)

    def take_usage(self) -> Usage | None:
        """For the orchestrator (``ModelUsage``): the requests admitted per model since the last
        call, the ones held and the ones pending per model now; None when there is nothing new
        to report."""
        if not self.on_demand.report:
            return None
        return self.on_demand.usage(self.requests.pending, {
            name: m.pending for name, m in self.models.items() if m.pending})

    def _backends_lost(self, now: float, lost: LostBackends, outbox: Outbox) -> None:
        """Answer ``BACKEND_FAILED`` now, not at their deadline, every request a lost backend
        had fetched."""
        for backend, why in lost:
            for p in self.requests.fetched_requests(backend):
                self._answer_error(now, p, ErrorKind.BACKEND_FAILED, f"{backend}: {why}",
                                   outbox)

    # ------------------------------------------------------------------ delivery failures

    def on_send_failed(self, now: float, destination: Destination, msg: Message,
                       full: bool, outbox: Outbox) -> None:
        """The host could not deliver ``msg`` (``full``: the peer's queue is full; else the peer
        is gone): answer what it carried, or forget the client it was for."""
        kind, target = destination
        if type(msg) is InputReply:
            self.counters["fetch_reply_failed"] += 1
            self._answer_ids(now, msg.request_ids, ErrorKind.BACKEND_FAILED,
                             f"cannot send inputs to {target!s}", outbox)
        elif type(msg) is RequestMetaBatch:
            self.counters["meta_send_failed"] += 1
            if self.cluster.scheduler.standby:  # the next active scheduler gets them (requeue)
                return
            self._answer_ids(now, msg.request_ids, ErrorKind.UNAVAILABLE,
                             f"scheduler shard {target!s} is not accepting", outbox)
        elif type(msg) is CancelFetched:  # the backend is gone: nothing of it will run
            self.counters["cancel_notice_failed"] += 1
        elif kind == TO_CLIENT and isinstance(target, bytes):
            answers = (len(msg.request_ids) + len(msg.error_ids) if isinstance(msg, InferAnswers)
                       else 1)
            if full:
                self.counters["reply_dropped_hwm"] += answers
            else:
                self.counters["reply_unroutable"] += answers
                self.client_gone(target)

    # ------------------------------------------------------------------ answers

    def _send_error(self, client: bytes, request_id: int, kind: ErrorKind, message: str,
                    outbox: Outbox) -> None:
        """Answer ``request_id`` of ``client`` with an error: in this tick's InferAnswers for a
        client that accepts it, else in an InferError of its own."""
        if client == APP_CLIENT:  # a stage of an app request
            self.apps.on_stage_error(request_id, kind, message, outbox)
        elif client in self.batched_clients:
            answers = self._answers_to(client)
            answers.error_ids.append(request_id)
            answers.errors.append(_WIRE_ERRORS[kind])
            answers.messages.append(message)
        else:
            outbox.append(((TO_CLIENT, client),
                           InferError(request_id, _WIRE_ERRORS[kind], message)))

    def _answers_to(self, client: bytes) -> Answers:
        answers = self._answers.get(client)
        if answers is None:
            answers = self._answers[client] = Answers()
        return answers

    def _finish(self, p: Pending) -> None:
        model = self.models[p.model]
        model.pending -= p.rows
        if p.state == QUEUED:
            model.queued -= p.rows
        self.requests.remove(p)

    def _answer_error(self, now: float, p: Pending, kind: ErrorKind, message: str,
                      outbox: Outbox) -> None:
        client = p.client
        self._finish(p)
        if kind is ErrorKind.DEADLINE:
            self.models[p.model].note_answer(deadline_missed=True)
        self.counters[_ERROR_COUNTERS[kind]] += 1
        self.counters[self._outcome_names[p.model][_WIRE_ERRORS[kind]]] += 1
        if client is not None:
            self._send_error(client, p.client_rid, kind, message, outbox)
            self._latency_of[p.model].observe(now - p.arrival)  # admit_to_answer: stats()

    def _answer_outputs(self, now: float, p: Pending, outputs: dict[str, Any],
                        outbox: Outbox) -> None:
        client = p.client
        self._finish(p)
        self.models[p.model].note_answer(deadline_missed=now > p.answer_by)
        self.counters["replied"] += 1
        self.counters[self._outcome_names[p.model][OUTCOME_OK]] += 1
        if client is None:
            return
        if client == APP_CLIENT:  # a stage of an app request: its outputs go on
            self.apps.on_stage_outputs(now, p.client_rid, outputs, outbox)
            return
        if client in self.batched_clients:
            answers = self._answers_to(client)
            answers.request_ids.append(p.client_rid)
            answers.outputs.append(outputs)
        else:
            outbox.append(((TO_CLIENT, client), InferReply(p.client_rid, outputs)))
        self._latency_of[p.model].observe(now - p.arrival)  # admit_to_answer: stats()

    def answer_all(self, now: float, kind: ErrorKind, message: str, outbox: Outbox) -> None:
        for p in list(self.requests.pending.values()):
            self._answer_error(now, p, kind, message, outbox)

    def end_tick(self, outbox: Outbox) -> None:
        """Append what this tick produced to be sent once: the admitted requests' metadata (one
        message per shard), queued cancellations (one CancelQueued per shard), cancellation notes
        (one CancelFetched per backend), answers (one per client)."""
        if self.apps.names:  # stage requests whose app has its answer
            for stage_rid in self.apps.take_cancels():
                self.cancel_stage(stage_rid)
        for shard, meta in enumerate(self._meta_by_shard):
            if meta.ids:
                self._meta_by_shard[shard] = _ShardMeta()
                if meta.rows:
                    meta.rows.extend([1] * (len(meta.ids) - len(meta.rows)))
                outbox.append(((TO_SHARD, shard), RequestMetaBatch(
                    self.data_address, meta.ids, meta.models, meta.arrivals, meta.deadlines,
                    meta.rows, epoch=self.epoch)))
                self.counters["meta_batches"] += 1
        if self.cancels.owed:
            self._cancel_notices(outbox)
        if not self._answers:
            return
        answers, self._answers = self._answers, {}
        for client, batch in answers.items():
            outbox.append(((TO_CLIENT, client), InferAnswers(
                batch.request_ids, batch.outputs, batch.error_ids, batch.errors,
                batch.messages)))

    def _cancel_notices(self, outbox: Outbox) -> None:
        """The tick's CancelQueued per shard, then CancelFetched per backend."""
        # After the shard's RequestMetaBatch: a request admitted this tick is known there.
        for queued in self.cancels.take_queued():
            outbox.append(((TO_SHARD, queued.shard), CancelQueued(
                self.data_address, queued.request_ids, queued.models)))
        for fetched in self.cancels.take_fetched():
            outbox.append(((TO_BACKEND, fetched.backend),
                           CancelFetched(fetched.plan_ids, fetched.request_ids)))
            self.counters["cancel_notices"] += 1

    def requeue_queued(self, now: float, outbox: Outbox) -> None:
        """A scheduler of a new epoch took over: its queues start empty, so the metadata of
        every request still queued here goes to it again (with this tick's); one whose
        scheduler deadline has passed is answered ``DEADLINE`` now."""
        for p in list(self.requests.pending.values()):
            if p.state != QUEUED or p.client is None or self.on_demand.is_held(p.rid):
                continue
            deadline = p.answer_by - self.reply_allowance_s
            if deadline <= now:
                self._answer_error(now, p, ErrorKind.DEADLINE, "its deadline passed while the "
                                   "scheduler was being replaced", outbox)
                continue
            self.counters["requeued"] += 1
            self._queue_meta(self.models[p.model].shard, p.rid, p.model, p.arrival, deadline,
                             rows=p.rows)

    # ------------------------------------------------------------------ deadlines

    def on_timer(self, now: float, outbox: Outbox) -> None:
        """Answer ``DEADLINE`` to every request whose SLO has passed by ``now``, and re-split
        the apps whose period has ended; the next wake-up is ``TIMER_COALESCE_S`` after the
        earliest deadline still pending, or the next re-split if sooner."""
        timers = self._timers
        pending = self.requests.pending
        while (rid := timers.pop_due(now)) is not None:
            p = pending[rid]
            self.counters["deadline_timer"] += 1
            where = ("running on " + p.backend if p.state == FETCHED
                     else "waiting for its model to load" if self.on_demand.is_held(rid)
                     else "queued")
            self._answer_error(now, p, ErrorKind.DEADLINE,
                               f"no answer within the SLO (request was {where})", outbox)
        # Lazy deletion keeps the heap proportional to the pending requests this way.
        timers.compact_if(len(pending), factor=TIMER_COMPACT_FACTOR, minimum=TIMER_COMPACT_MIN)
        splits = self.app_splits
        if now >= splits.next_at:
            for name in splits.models:  # the profiles its backends measured, once learnt
                profile = self.models[name].profile
                if profile is not None:
                    splits.learn(name, profile.table_s[1:profile.max_batch + 1])
            for app in splits.on_timer(now):
                self.apps.set_split(app, splits.weights[app])
                self.counters["app_resplits"] += 1
        self.wake_at = min(timers.next_at() + TIMER_COALESCE_S, splits.next_at)

    def _deadline_is_live(self, expire_at: float, rid: int) -> bool:
        p = self.requests.pending.get(rid)
        return p is not None and p.expire_at == expire_at

    # ------------------------------------------------------------------ stats

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """The request table's state and the ``zserve.core.stats`` snapshot (``counters``,
        ``latency``, ``histograms``); ``reset`` starts a new window."""
        self._sum_per_model()
        return {
            "name": self.name,
            "incarnation": self.ids.incarnation,
            "pending": len(self.requests.pending),
            "draining": self.draining,
            "clients": len(self.requests.by_client),
            "backends": sorted(self.backends.table or {}),
            "fetched_by": self.requests.fetched_counts(),
            "models": {name: m.pending for name, m in self.models.items()},
            "reply_allowance": (
                {"mode": "fixed", "value_ms": self.reply_allowance_s * 1e3} if self.reply is None
                else {"mode": "learned", **self.reply.summary(self._reply_seen_at)}),
            **self._stats.snapshot(reset),
            **({"app_splits": self._app_split_stats()} if self.apps.names else {}),
        }

    def _app_split_stats(self) -> dict[str, dict[str, Any]]:
        """Each app's splitter, whether it (not the fallback) made the current split, each
        stage's share of the SLO (ms) and the rates (r/s) it was made from."""
        splits = self.app_splits
        return {app: {"splitter": plan.config.splitter, "by_splitter": splits.splitter_used[app],
                      "budgets_ms": splits.budgets_ms(app),
                      "rates_rps": splits.rates_rps.get(app, {})}
                for app, plan in splits.plans.items()}

    def _sum_per_model(self) -> None:
        """``admit_to_answer`` and ``queueing`` are the sums of their per-model histograms
        (every pending request's model is configured), so the answer path observes each value
        once; they are summed here, when a snapshot is taken, not per request."""
        for total, parts in ((self._admit_to_answer, self._latency_of),
                             (self._queueing, self._queueing_of)):
            total.reset()
            for part in parts.values():
                total.merge(part)
