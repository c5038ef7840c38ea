"""The simulator's frontends: the real FrontendCore on a virtual clock, between load and scheduler.

:class:`SimFrontend` hosts one :class:`~zserve.frontend.core.FrontendCore` as the frontend
process does (same calls, same messages) for one simulated client whose request ids are the
simulator's request indexes. The core admits or refuses each arrival, holds the request until a
follower fetches it, takes the batch outputs, answers drops, backend failures and deadlines (its
``wake_at`` timer), and coalesces metadata per tick. Inputs and outputs are empty placeholders
(``{}``, or a request of n rows an ``(n, 0)`` array: its rows and no bytes): admission sees
0 bytes and no registered signature, so no tensor of any size is ever built.

:class:`AnswerLog` records what the core answered the client, exactly once per request; the
simulator's report counts outcomes from it. :func:`frontend_cluster` is the ClusterConfig the
cores read: the workload's models, GPUs and reply allowance, with a cluster file's
``[frontends]`` and per-model admission bounds, or without one a default cluster's settings
and no admission bounds.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import numpy as np

from zserve.config.cluster import (
    BackendsConfig,
    ClusterConfig,
    EmulatedConfig,
    ModelConfig,
    SchedulerConfig,
)
from zserve.core.allowances import FIXED, LEARNED
from zserve.core.errors import ErrorKind
from zserve.core.hosting import Outbox
from zserve.frontend.core import TO_BACKEND, TO_CLIENT, TO_SHARD, FrontendCore
from zserve.loadgen.load_plan import ERROR_INDEX, ERROR_KINDS
from zserve.loadgen.workload import Workload
from zserve.scheduler.common import FEASIBILITY_EPS_S
from zserve.transport.messages import (
    InferError,
    InferReply,
    InferRequest,
    InputReply,
    Message,
    RequestMetaBatch,
)

CLIENT = b"sim-client"
PENDING, GOOD, LATE, DROPPED, ERROR = 0, 1, 2, 3, 4
_DEADLINE = ErrorKind.DEADLINE.value
_NO_INPUTS: dict[str, Any] = {}
# The admission bounds of a run without a cluster file: never reached.
UNBOUNDED_QUEUE = sys.maxsize
UNBOUNDED_WAIT_MS = sys.float_info.max


class InvariantError(AssertionError):
    """The schedule broke an invariant: a bug in the scheduler (or the simulator)."""


def frontend_address(index: int) -> str:
    """Frontend ``index``'s data address: the name the scheduler and the followers use."""
    return "sim" if index == 0 else f"sim-{index}"


def frontend_cluster(w: Workload, cluster: ClusterConfig | None = None, *,
                     learned: bool = False) -> ClusterConfig:
    """The cluster the simulated frontends admit by: the workload's models, SLOs, GPUs and reply
    allowance (the scheduler's deadlines leave exactly that) with ``cluster``'s ``[frontends]``
    and its models' ``max_queue``, ``max_wait_ms`` and ``shed_past_capacity`` (matched by name
    as ``zserve bench`` matches them: exactly, else case-insensitively; a model it lacks gets a
    default cluster's). Without ``cluster`` no admission rule applies (queue and wait bounds
    open: a workload file has no cluster to take them from); the rest is a default cluster's.
    ``learned``: the reply allowance is learned (``[scheduler] allowances``), else fixed."""
    base = cluster if cluster is not None else ClusterConfig()
    frontends = msgspec.structs.replace(base.frontends, reply_allowance_ms=w.reply_ms,
                                        addresses=(), data_addresses=())
    models = []
    for spec in w.models:
        profile = spec.profile
        model = ModelConfig(
            name=spec.name, slo_ms=spec.slo_ms, max_batch=profile.max_batch,
            emulated=EmulatedConfig(alpha_ms=profile.alpha_s * 1e3, beta_ms=profile.beta_s * 1e3))
        configured = _cluster_model(base, spec.name)
        if cluster is None:
            model = msgspec.structs.replace(model, max_queue=UNBOUNDED_QUEUE,
                                            max_wait_ms=UNBOUNDED_WAIT_MS,
                                            shed_past_capacity=False)
        elif configured is not None:
            model = msgspec.structs.replace(
                model, max_queue=configured.max_queue, max_wait_ms=configured.max_wait_ms,
                shed_past_capacity=configured.shed_past_capacity)
        models.append(model)
    scheduler = SchedulerConfig(allowances=LEARNED if learned else FIXED)
    return ClusterConfig(frontends=frontends, models=tuple(models), scheduler=scheduler,
                         backends=BackendsConfig(count=w.gpus, device="emulated"))


def _cluster_model(cluster: ClusterConfig, name: str) -> ModelConfig | None:
    """``cluster``'s model called ``name``, else its one model called so in another case."""
    exact = [m for m in cluster.models if m.name == name]
    folded = [m for m in cluster.models if m.name.lower() == name.lower()]
    found = exact or folded
    return found[0] if len(found) == 1 else None


class AnswerLog:
    """Every request's answer from its frontend: outcome, time and error kind, at most one each.

    ``OK`` outputs are good when answered by the request's scheduling deadline (arrival + SLO -
    reply allowance), else late; a ``DEADLINE`` error is a drop (the scheduler's or the core's
    timer), any other error is counted by kind (as the live load generator counts them)."""

    def __init__(self, deadlines: np.ndarray[Any, Any], model_of: np.ndarray[Any, Any],
                 arrivals: np.ndarray[Any, Any], window: tuple[float, float],
                 models: int) -> None:
        total = len(deadlines)
        self.status = np.zeros(total, dtype=np.int8)
        self.answered_at = np.full(total, np.nan)
        self.error_kind = np.full(total, -1, dtype=np.int8)
        self.deadlines = deadlines
        self.model_of = model_of
        self.arrivals = arrivals
        self.window = window
        self.measured_bad = [0] * models  # bad answers to requests of the measure window
        self.n_answered = 0  # every answer so far, and the bad ones (the autoscaler's signals)
        self.n_bad = 0

    def record(self, now: float, index: int, error: str | None) -> None:
        if self.status[index] != PENDING:
            raise InvariantError(f"t={now:.6f}: request {index} answered twice")
        if error is None:
            good = now <= self.deadlines[index] + FEASIBILITY_EPS_S
            self.status[index] = GOOD if good else LATE
        else:
            self.status[index] = DROPPED if error == _DEADLINE else ERROR
            self.error_kind[index] = ERROR_INDEX.get(error, ERROR_INDEX[ErrorKind.INTERNAL.value])
        self.answered_at[index] = now
        self.n_answered += 1
        if self.status[index] != GOOD:
            self.n_bad += 1
            lo, hi = self.window
            if lo <= self.arrivals[index] < hi:
                self.measured_bad[int(self.model_of[index])] += 1

    def error_counts(self, mask: np.ndarray[Any, Any]) -> dict[str, int]:
        """Error answers among ``mask``'s requests, by kind."""
        kinds = self.error_kind[mask]
        counts = np.bincount(kinds[kinds >= 0], minlength=len(ERROR_KINDS))
        return {ERROR_KINDS[i]: int(c) for i, c in enumerate(counts) if c}


def _rows_placeholder(rows: int) -> dict[str, Any]:
    """Inputs of ``rows`` rows and no bytes: what the core reads a request's rows from."""
    return {"rows": np.empty((rows, 0), np.uint8)}


class SimFrontend:
    """One simulated frontend: a FrontendCore, its client's answers, its outbox routed.

    The host calls :meth:`admit` per arrival, :meth:`end_tick` once per tick (every event at one
    instant, or ``sim_tick_ms``), :meth:`call` for anything else the core handles, and reads
    ``core.wake_at`` back after each (its ``on_timer`` answers deadlines). What the core sends
    elsewhere lands in ``to_scheduler`` and ``to_backends`` for the host to deliver."""

    def __init__(self, index: int, cluster: ClusterConfig, w: Workload, answers: AnswerLog,
                 index_of_rid: dict[int, int]) -> None:
        self.address = frontend_address(index)
        self.core = FrontendCore(name=f"sim-frontend-{index}", cluster=cluster, index=index,
                                 data_address=self.address,
                                 profiles={m.name: m.profile for m in w.models})
        self.answers = answers
        self.index_of_rid = index_of_rid  # shared by every frontend: rids are cluster-unique
        self.meta_unsent = False  # admitted requests whose metadata end_tick has not sent
        self.to_scheduler: list[RequestMetaBatch] = []
        self.to_backends: list[tuple[str, Message]] = []
        self._outbox: Outbox = []

    def admit(self, now: float, index: int, model: str, rows: int = 1) -> None:
        """Request ``index`` of ``model``, holding ``rows`` rows, arrives: the core admits it or
        answers it at once."""
        core = self.core
        outbox = self._outbox
        inputs = _NO_INPUTS if rows == 1 else _rows_placeholder(rows)
        core.on_infer(now, CLIENT, InferRequest(index, model, inputs), outbox)
        if outbox:
            self.route(now, outbox)
            return
        rid = core.requests.by_client[CLIENT][index]
        self.index_of_rid[rid] = index
        self.meta_unsent = True

    def end_tick(self, now: float) -> None:
        self.meta_unsent = False
        self.core.end_tick(self._outbox)
        self.route(now, self._outbox)

    def timer(self, now: float) -> None:
        self.core.on_timer(now, self._outbox)
        self.route(now, self._outbox)

    def outbox(self) -> Outbox:
        """The outbox to pass to a core handler the host calls itself; then :meth:`route`."""
        return self._outbox

    def route(self, now: float, outbox: Outbox) -> None:
        """Record the client's answers; queue the rest for the host; empty ``outbox``."""
        record = self.answers.record
        for (kind, target), msg in outbox:
            if kind == TO_CLIENT:
                if type(msg) is InferReply:
                    record(now, msg.request_id, None)
                else:
                    assert isinstance(msg, InferError)
                    record(now, msg.request_id, msg.error)
            elif kind == TO_SHARD:
                assert isinstance(msg, RequestMetaBatch)
                self.to_scheduler.append(msg)
            else:
                assert kind == TO_BACKEND and isinstance(target, str)
                self.to_backends.append((target, msg))
        outbox.clear()

    def fetch_replies(self) -> list[tuple[str, InputReply]]:
        """The InputReplies queued for backends (the only backend-bound message a simulated
        run produces besides CancelFetched, which it never does: no client cancels)."""
        sent, self.to_backends = self.to_backends, []
        replies = []
        for backend, msg in sent:
            assert isinstance(msg, InputReply), msg
            replies.append((backend, msg))
        return replies
