"""The backend process: a *plan follower* for one device.

``run_backend(config, control_address)`` (``zserve backend``) serves one device (``cpu``,
``cuda:N`` or ``emulated``) with one executor (``zserve.backends.executor``):

1. Binds its ``plan`` ROUTER (scheduler shards connect), loads every model and warms it at every
   batch size 1..max_batch, fixes each model's latency profile (the configured profile file, the
   emulated alpha/beta, or one measured here), and only then sends ``Ready`` to the supervisor.
2. Connects a DEALER (identity = its name) to the rank and registers (``BackendRegister``: device,
   plan address, models, profiles); heartbeats to the rank every ``HEARTBEAT_INTERVAL_S`` from the
   same event loop that runs the batches, and stops heartbeating while a batch is wedged (runs
   ``WEDGED_FACTOR`` times longer than planned), so the rank removes a stuck device.
3. On a ``BatchPlan``: sends one ``InputFetch`` per frontend named in the plan at once (a DEALER per
   frontend ``data`` address, connected on first use) and files the plan in a heap ordered by
   ``exec_at``, with one timer for the earliest plan. At ``exec_at`` (or at once for a late plan;
   the lateness ``started_at - exec_at`` is recorded) and once its inputs are in, the head plan
   starts -- never while another batch runs on the device. A frontend's missing ids (cancelled,
   already answered) are left out, and so are ids it cancels after the fetch (``CancelFetched``)
   before the batch starts (a plan left empty is skipped); ids whose inputs have not come
   ``INPUT_WAIT_S`` after ``exec_at`` are answered ``UNAVAILABLE`` and the batch runs without them.
   Late shedding: a batch that starts so late that it cannot finish by every request's
   ``finish_by`` (the plan's per-request deadlines) leaves out the requests with the earliest
   ones, one at a time, until the rest can (``now + l(k) <= min finish_by + shed grace``, with
   this backend's own profile l); those are answered ``DEADLINE`` at once (counter
   ``requests_shed_late``) instead of spending device time on answers that would come too late.
4. Assembles the batch with one copy per input into a preallocated batch buffer (none for a batch of
   one), runs it (``Executor.run_async``: ONNX Runtime in the executor's worker thread, an emulated
   batch by timer), and sends one ``BatchOutputs`` per frontend (row views of the batch outputs,
   zero-copy frames) and a ``BatchStats`` to the rank. An execution error fails that batch only:
   one ``BatchFailed(BACKEND_FAILED)`` per frontend; the backend keeps serving. The BatchStats of
   a finished or skipped plan carries ``device_free_at``: the device is free now, plus each plan
   still held, in exec_at order, for its planned duration (``_device_free_at``). The rank moves
   its view of the GPU later to it, so that overruns (timer lateness, the output push, a
   descheduled process) do not accumulate under saturation.
5. On SIGTERM/SIGINT or ``Shutdown``: plans that arrive from then on, and held plans that cannot
   start before the grace period ends, are answered ``SHUTTING_DOWN``; the rest run; it exits 0.

Sends never block the loop: every send is non-blocking, and a message that cannot be queued
(a peer gone, its queue full) is dropped, counted and logged -- the frontends' deadline timers
answer whatever a lost message leaves unanswered.

Time: every time on the wire (``exec_at``, ``started_at``, ...) is on the cluster clock (the rank's
CLOCK_MONOTONIC, ``zserve.clock``): the backend estimates its offset before it registers, reads
``now`` as ``clock.now()``, and arms its plan timer at ``clock.to_local(exec_at)``. (The executors
time batches on the local clock: only durations matter there. ``warm_finished_at`` in the stats is
local too: it is measured before the offset is known.)

Timers: plans are started from one precise timer (``zserve.timers``: a timerfd on Linux; uvloop's
own timers tick in whole milliseconds): a plan starts a few tens of microseconds after its
exec_at, never before it, and the process sleeps until then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import heapq
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from zserve import procutil, timers
from zserve.backends.executor import Executor, TensorMap
from zserve.clock import ClockSync, ClusterClock
from zserve.config import (
    DEFAULT_REPLY_ALLOWANCE_MS,
    ClusterConfig,
    ModelConfig,
    load_config,
    role_config,
)
from zserve.errors import ErrorKind, ZServeError
from zserve.scheduler.profiles import LatencyProfile, load_profiles
from zserve.transport.messages import (
    BackendRegister,
    BatchFailed,
    BatchOutputs,
    BatchPlan,
    BatchStats,
    CancelFetched,
    Heartbeat,
    Hello,
    InputFetch,
    InputReply,
    Message,
    StatsReply,
    StatsRequest,
)
from zserve.transport.reactor import Chunk, SocketReactor
from zserve.transport.sockets import make_dealer, make_router

log = logging.getLogger(__name__)

ROLE = "backend"
HEARTBEAT_INTERVAL_S = procutil.HEARTBEAT_INTERVAL_S
# How long after exec_at the head plan waits for a frontend's InputReply before it runs without
# those requests (a frontend that is alive answers within a millisecond or two).
INPUT_WAIT_S = 0.050
# A plan that starts more than this after its exec_at counts as late in the stats.
LATE_TOLERANCE_S = 0.001
# A batch running longer than max(WEDGED_MIN_S, WEDGED_FACTOR x its planned duration) is wedged.
WEDGED_FACTOR = 10.0
WEDGED_MIN_S = 2.0
# Per-batch timing samples kept for the stats (a ring; percentiles are computed on request).
STATS_WINDOW = 4096
# Repeats per batch size when a profile has to be measured at start-up.
PROFILE_REPEATS = 3
SOCKET_CLOSE_LINGER_MS = 200
# Late shedding keeps a request whose batch finishes up to this fraction of the cluster's reply
# allowance after its finish_by: the reply allowance exists to absorb small lateness (the push
# and the reply hop take well under half of it), so such a request is still answered in time.
SHED_GRACE_FRACTION = 0.5


def shed_late_rows(
    rows: list[int], finish_by: Sequence[float], now: float, table_s: Sequence[float],
    grace_s: float = 0.0,
) -> tuple[list[int], list[int]]:
    """Late shedding for a batch starting at ``now``: ``(kept, shed)`` rows. While the ``k``
    rows left cannot finish by the earliest ``finish_by`` among them (``now + table_s[k] >
    min + grace_s``), the row with the earliest ``finish_by`` is shed. ``kept`` keeps the order
    of ``rows``; ``shed`` is in shedding order. ``table_s[k]`` is l(k) (``LatencyProfile``)."""
    order = sorted(rows, key=finish_by.__getitem__)
    count = len(order)
    cut = 0
    while cut < count and now + table_s[count - cut] > finish_by[order[cut]] + grace_s:
        cut += 1
    if cut == 0:
        return rows, []
    shed = order[:cut]
    dropped = set(shed)
    return [row for row in rows if row not in dropped], shed


# --------------------------------------------------------------------------- plans


@dataclass(slots=True, eq=False)
class _Plan:
    """A plan the backend holds, from arrival to its last output message."""

    plan: BatchPlan
    received_at: float
    awaiting: set[int]  # indices into plan.frontends whose InputReply has not come
    # Keyed by (frontend index in the plan, request id): request ids are unique per frontend
    # only (frontends make them cluster-unique today, but nothing here relies on it).
    inputs: dict[tuple[int, int], TensorMap] = field(default_factory=dict)
    missing: set[tuple[int, int]] = field(default_factory=set)
    # Fetched, then cancelled by their frontend before the batch started: left out of it.
    cancelled: set[tuple[int, int]] = field(default_factory=set)
    inputs_at: float = 0.0  # when the last InputReply came (0: not yet)
    started_at: float = 0.0


@dataclass(slots=True)
class BusyMeter:
    """The device's busy time inside each stats window, exactly: a batch running across a window
    boundary counts in both windows for the part that fell in each. (Summing whole run times
    per window credited a batch to the window in which it ended, so a window could show more
    busy time than its length.)"""

    window_start: float
    accumulated_s: float = 0.0
    running_since: float | None = None

    def start(self, t: float) -> None:
        self.running_since = t

    def stop(self, t: float) -> None:
        if self.running_since is not None:
            self.accumulated_s += max(0.0, t - max(self.running_since, self.window_start))
            self.running_since = None

    def take(self, now: float, reset: bool) -> float:
        """Busy seconds from the window's start to ``now``; ``reset`` starts a new window."""
        busy = self.accumulated_s
        if self.running_since is not None:
            busy += max(0.0, now - max(self.running_since, self.window_start))
        if reset:
            self.accumulated_s = 0.0
            self.window_start = now
        return busy


@dataclass(slots=True)
class _Timings:
    """Rings of per-batch durations in seconds (for stats and the benchmark)."""

    lateness: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    # exec_at - plan received: how much of the allowance d_ctrl + d_data*bs was left on arrival
    slack: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    fetch: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    assemble: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    run: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    push: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    batch_size: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    batch_model: deque[str] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    # Every batch run since the last reset, per model: {model: {str(batch size): batches}}.
    batch_histogram: dict[str, dict[str, int]] = field(default_factory=dict)

    def add_batch(self, model: str, size: int) -> None:
        self.batch_size.append(size)
        self.batch_model.append(model)
        sizes = self.batch_histogram.setdefault(model, {})
        sizes[str(size)] = sizes.get(str(size), 0) + 1

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("lateness", "slack", "fetch", "assemble", "run", "push"):
            ring: deque[float] = getattr(self, name)
            if ring:
                values = np.asarray(ring) * 1e3
                out[f"{name}_ms"] = {
                    "count": len(values),
                    "p50": float(np.median(values)),
                    "p99": float(np.percentile(values, 99)),
                    "max": float(values.max()),
                    "mean": float(values.mean()),
                }
        return out

    def samples(self) -> dict[str, Any]:
        return {
            "batch_size": list(self.batch_size),
            "batch_model": list(self.batch_model),  # the model of each batch_size entry
            "fetch_s": list(self.fetch),
            "assemble_s": list(self.assemble),
            "run_s": list(self.run),
            "push_s": list(self.push),
            "lateness_s": list(self.lateness),
            "slack_s": list(self.slack),
        }

    def clear(self) -> None:
        for ring in (self.lateness, self.slack, self.fetch, self.assemble, self.run, self.push):
            ring.clear()
        self.batch_size.clear()
        self.batch_model.clear()
        self.batch_histogram.clear()


# --------------------------------------------------------------------------- executors


def build_executor(device: str, models: Sequence[ModelConfig]) -> Executor:
    """The executor for ``device``: emulated for ``emulated`` (every model then needs a profile:
    emulated alpha/beta or a profile file), else ONNX Runtime on the device (``cpu``, ``cuda:N``)
    for the ``builtin`` and ``onnx`` models."""
    if device == "emulated":
        from zserve.backends.emulated import EmulatedExecutor

        return EmulatedExecutor([_emulated_model(m) for m in models])
    from zserve.backends.builtin import ModelSpec, ensure_builtin
    from zserve.backends.onnx_executor import OnnxExecutor

    specs: list[ModelSpec] = []
    for m in models:
        if m.kind == "builtin" and m.builtin:
            specs.append(ModelSpec(m.name, ensure_builtin(m.builtin)))
        elif m.kind == "onnx" and m.onnx:
            specs.append(ModelSpec(m.name, Path(m.onnx)))
        else:
            raise ValueError(f"model {m.name!r} ({m.kind}) needs device 'emulated', not {device!r}")
    return OnnxExecutor(specs, device=device, max_batch={m.name: m.max_batch for m in models})


def _emulated_model(model: ModelConfig) -> Any:
    from zserve.backends.emulated import EmulatedModel

    profile = configured_profile(model)
    if profile is None:
        raise ValueError(f"model {model.name!r} on an emulated device needs emulated alpha_ms/"
                         "beta_ms or a profile file")
    return EmulatedModel(model.name, profile.alpha_s * 1e3, profile.beta_s * 1e3,
                         max_batch=profile.max_batch,
                         latency_ms=tuple(profile.latency_ms_list()),
                         input_shape=tuple(model.input_shape), input_dtype=model.input_dtype,
                         output_shape=tuple(model.output_shape))


def configured_profile(model: ModelConfig) -> LatencyProfile | None:
    """The profile cluster.toml gives for ``model``: its profile file, or emulated alpha/beta."""
    if model.profile:
        profiles = load_profiles(model.profile)
        if model.name not in profiles:
            raise ValueError(f"profile file {model.profile} has no entry for {model.name!r}")
        return profiles[model.name]
    if model.alpha_ms is not None and model.beta_ms is not None:
        return LatencyProfile.linear(model.alpha_ms, model.beta_ms, model.max_batch)
    return None


# --------------------------------------------------------------------------- the follower


class Backend:
    """The plan follower and its sockets. Created and run by ``_main``; all methods run on the
    event loop."""

    def __init__(
        self,
        *,
        name: str,
        device: str,
        executor: Executor,
        ctx: zmq.Context[zmq.Socket[bytes]],
        plan_sock: zmq.Socket[Any],
        plan_address: str,
        reactor: SocketReactor,
        clock: ClusterClock | None = None,
        shed_grace_s: float = 0.0,
    ) -> None:
        self.name = name
        # How far past a request's finish_by its batch may finish before late shedding drops it.
        self.shed_grace_s = shed_grace_s
        # Set before the backend starts (its offset is estimated after Ready, before it serves).
        self.clock = clock if clock is not None else ClusterClock()
        self.identity = name.encode()
        self.device = device
        self.executor = executor
        self.ctx = ctx
        self.plan_sock = plan_sock
        self.plan_address = plan_address
        self.loop = asyncio.get_running_loop()
        self.reactor = reactor
        self.rank_sock: zmq.Socket[Any] | None = None
        self.data_socks: dict[str, zmq.Socket[Any]] = {}
        self.profiles: dict[str, LatencyProfile] = {}
        self.models = list(executor.models)
        self.warmed: dict[str, list[int]] = {}
        self.warm_s = 0.0
        self.warm_finished_at = 0.0

        self._plans: dict[int, _Plan] = {}
        self._heap: list[tuple[float, int, int]] = []  # (exec_at, seq, plan_id)
        self._seq = 0
        self._running: _Plan | None = None
        self._precise = timers.timers_for(self.loop)
        self._timer: timers.TimerHandle | None = None
        self._timer_at = 0.0
        self._buffers: dict[tuple[str, str], np.ndarray[Any, Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stuck = False
        self._draining = False
        self._drain_deadline = float("inf")
        self._idle = asyncio.Event()
        self._idle.set()
        self._hb_seq = 0
        self._wedged_logged = False
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "plans",
                "batches_ok",
                "batches_failed",
                "requests_ok",
                "requests_failed",
                "requests_missing",
                "requests_unavailable",
                "requests_cancelled",
                "requests_shed_late",
                "cancels_too_late",
                "batches_skipped",
                "late_plans",
                "plans_refused",
                "send_dropped",
                "bad_messages",
            ),
            0,
        )
        self.timings = _Timings()
        self.busy = BusyMeter(self.clock.now())
        self._counted_before_reset: dict[str, int] = {}

    # ------------------------------------------------------------------ start-up

    def load_and_warm(self, models: Sequence[ModelConfig]) -> None:
        """Load every model, warm it at every batch size, allocate the batch buffers and fix the
        profiles. Blocking: runs before the process reports Ready."""
        started = time.monotonic()
        self.executor.load()
        self.executor.warm()
        for model in self.models:
            self.warmed[model] = list(range(1, self.executor.max_batch(model) + 1))
            for spec in self.executor.signature(model).inputs:
                shape = (self.executor.max_batch(model), *(int(d or 0) for d in spec.shape))
                buffer = np.empty(shape, np.dtype(spec.dtype))
                buffer.fill(0)  # touch every page now, not on the first batch
                self._buffers[(model, spec.name)] = buffer
        by_name = {m.name: m for m in models}
        for model in self.models:
            profile = configured_profile(by_name[model]) if model in by_name else None
            if profile is None:
                measured = self.executor.profile(model, repeats=PROFILE_REPEATS, warmup=0)
                profile = LatencyProfile.from_table_ms(measured.table_ms())
            self.profiles[model] = profile
        self.warm_finished_at = time.monotonic()
        self.warm_s = self.warm_finished_at - started
        log.info("%s: %d model(s) loaded and warmed in %.2f s", self.name, len(self.models),
                 self.warm_s)

    def connect_rank(self, rank_address: str) -> None:
        self.rank_sock = make_dealer(self.ctx, rank_address, identity=self.identity)
        self._watch(self.rank_sock, router=False, on_chunk=self._on_rank_chunk)
        self._register()
        self._spawn(self._rank_heartbeat_loop())

    def _register(self) -> None:
        assert self.rank_sock is not None
        profiles_ms = {m: p.latency_ms_list() for m, p in self.profiles.items()}
        self._send(
            self.rank_sock,
            BackendRegister(
                name=self.name,
                device=self.device,
                plan_address=self.plan_address,
                models=list(self.models),
                profiles_ms=profiles_ms,
                signatures={m: self.executor.signature(m).to_dict() for m in self.models},
            ),
        )

    def start(self) -> None:
        self._watch(self.plan_sock, router=True, on_chunk=self._on_plan_chunk)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)  # a strong reference until it is done (one task per batch)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ I/O helpers

    def _send(self, sock: zmq.Socket[Any], msg: Message, identity: bytes | None = None) -> bool:
        """Non-blocking send; False (counted, logged) when ZeroMQ cannot take the message."""
        error = self.reactor.send_nowait(sock, msg, identity)
        if error is None:
            return True
        self.counters["send_dropped"] += 1
        log.warning("%s: dropped %s (%s)", self.name, type(msg).__name__, error)
        return False

    def _watch(self, sock: zmq.Socket[Any], *, router: bool,
               on_chunk: Callable[[Chunk], None]) -> None:
        """Per loop tick: every message already queued on ``sock``, handed over as one chunk."""
        self.reactor.watch(sock, router=router, on_chunk=on_chunk, on_bad=self._on_bad)

    def _on_bad(self, exc: ZServeError) -> None:
        self.counters["bad_messages"] += 1
        log.warning("%s: bad message: %s", self.name, exc)

    # ------------------------------------------------------------------ messages

    def _on_plan_chunk(self, messages: Chunk) -> None:
        for identity, msg in messages:
            if isinstance(msg, BatchPlan):
                self._on_plan(msg)
            elif isinstance(msg, StatsRequest):
                assert identity is not None
                self._send(self.plan_sock, StatsReply(self.name, self.stats(msg.reset)), identity)
            elif not isinstance(msg, Hello | Heartbeat):
                log.warning("%s: unexpected %s on the plan socket", self.name, type(msg).__name__)
        self._maybe_start()

    def _on_rank_chunk(self, messages: Chunk) -> None:
        for _, msg in messages:
            if isinstance(msg, Hello):  # a restarted rank asks who we are
                self._register()
            elif not isinstance(msg, Heartbeat):
                log.debug("%s: ignoring %s from rank", self.name, type(msg).__name__)

    def _on_data_chunk(self, address: str, messages: Chunk) -> None:
        for _, msg in messages:
            if isinstance(msg, InputReply):
                self._on_input_reply(address, msg)
            elif isinstance(msg, CancelFetched):
                self._on_cancel_fetched(address, msg)
            elif isinstance(msg, StatsRequest):  # a frontend collecting its cluster's stats
                self._send(self._data_sock(address),
                           StatsReply(self.name, self.stats(msg.reset)))
            else:
                log.warning("%s: unexpected %s on a data socket", self.name, type(msg).__name__)
        self._maybe_start()

    def _on_plan(self, plan: BatchPlan) -> None:
        now = self.clock.now()
        self.counters["plans"] += 1
        count = len(plan.request_ids)
        if count == 0:
            return
        if self._draining or plan.plan_id in self._plans or plan.model not in self.profiles or (
            len(plan.request_frontend) != count
            or any(not 0 <= i < len(plan.frontends) for i in plan.request_frontend)
            or count > self.executor.max_batch(plan.model)
            or (plan.finish_by and len(plan.finish_by) != count)
        ):
            self._refuse(plan, now)
            return
        self.timings.slack.append(plan.exec_at - now)
        held = _Plan(plan, now, set(range(len(plan.frontends))))
        self._plans[plan.plan_id] = held
        self._seq += 1
        heapq.heappush(self._heap, (plan.exec_at, self._seq, plan.plan_id))
        self._idle.clear()
        # Fetch at once: one InputFetch per frontend of the plan.
        for index, address in enumerate(plan.frontends):
            ids = [rid for rid, f in zip(plan.request_ids, plan.request_frontend, strict=True)
                   if f == index]
            if not self._send(self._data_sock(address), InputFetch(plan.plan_id, ids)):
                held.awaiting.discard(index)  # nothing will come: run without them
        if not held.awaiting:
            held.inputs_at = now

    def _refuse(self, plan: BatchPlan, now: float) -> None:
        self.counters["plans_refused"] += 1
        if self._draining:
            kind, why = ErrorKind.SHUTTING_DOWN, f"backend {self.name} is shutting down"
        elif plan.plan_id in self._plans:
            kind, why = ErrorKind.INTERNAL, f"duplicate plan id {plan.plan_id}"
        elif plan.model not in self.profiles:
            kind, why = ErrorKind.INTERNAL, f"backend {self.name} does not serve {plan.model!r}"
        else:
            kind, why = ErrorKind.INTERNAL, f"malformed plan {plan.plan_id}"
        log.warning("%s: refusing plan %d: %s", self.name, plan.plan_id, why)
        if kind is not ErrorKind.INTERNAL or len(plan.request_frontend) == len(plan.request_ids):
            with contextlib.suppress(IndexError):
                self._fail_requests(plan, list(range(len(plan.request_ids))), kind, why)
        self._send_stats(plan, 0, now, now, ok=False)

    def _on_input_reply(self, address: str, reply: InputReply) -> None:
        held = self._plans.get(reply.plan_id)
        if held is None or held.started_at:
            return  # the plan already started without this frontend's inputs, or was refused
        try:
            index = held.plan.frontends.index(address)
        except ValueError:
            log.warning("%s: InputReply for plan %d from %s, which the plan does not name",
                        self.name, reply.plan_id, address)
            return
        held.awaiting.discard(index)
        for rid, tensors in zip(reply.request_ids, reply.inputs, strict=False):
            held.inputs[(index, rid)] = tensors
        held.missing.update((index, rid) for rid in reply.missing)
        if not held.awaiting:
            held.inputs_at = self.clock.now()

    def _on_cancel_fetched(self, address: str, msg: CancelFetched) -> None:
        """Leave cancelled requests out of their plans if those have not started (a started
        batch runs; its frontend discards the outputs)."""
        for plan_id, rid in zip(msg.plan_ids, msg.request_ids, strict=False):
            held = self._plans.get(plan_id)
            if held is None or held.started_at:
                self.counters["cancels_too_late"] += 1
                continue
            try:
                index = held.plan.frontends.index(address)
            except ValueError:
                continue
            key = (index, rid)
            if held.inputs.pop(key, None) is not None:
                held.cancelled.add(key)
                self.counters["requests_cancelled"] += 1

    def _data_sock(self, address: str) -> zmq.Socket[Any]:
        sock = self.data_socks.get(address)
        if sock is None:
            sock = make_dealer(self.ctx, address, identity=self.identity)
            self.data_socks[address] = sock
            self._watch(sock, router=False,
                        on_chunk=functools.partial(self._on_data_chunk, address))
            # The pid tells the frontend when a backend of this name restarted (it then fails
            # the requests the old process had fetched).
            self._send(sock, Hello(role=ROLE, name=self.name, pid=os.getpid()))
        return sock

    # ------------------------------------------------------------------ following plans

    def _arm(self, when: float) -> None:
        """One timer for the follower, at cluster time ``when``: a ``zserve.timers`` precise
        timer (uvloop's own tick in whole milliseconds; a plan must start at its exec_at), armed
        at the local time of ``when``."""
        if self._timer is not None:
            if self._timer_at == when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._precise.call_at(self.clock.to_local(when), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._maybe_start()

    def _maybe_start(self) -> None:
        """Start the head plan if its time has come, its inputs are in and the device is idle."""
        if self._running is not None:
            return
        while self._heap:
            exec_at, _, plan_id = self._heap[0]
            held = self._plans[plan_id]
            now = self.clock.now()
            if now < exec_at:
                self._arm(exec_at)
                return
            if held.awaiting:
                give_up_at = max(exec_at, held.received_at) + INPUT_WAIT_S
                if now < give_up_at:
                    self._arm(give_up_at)  # or the InputReply comes first and calls us again
                    return
            heapq.heappop(self._heap)
            if self._start(held, now):
                return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._idle.set()

    def _start(self, held: _Plan, now: float) -> bool:
        """Start ``held``; False when nothing was left to run (the caller moves on)."""
        plan = held.plan
        held.started_at = now
        # Inputs still missing after INPUT_WAIT_S: answer them and run the rest.
        late_ids = [
            i
            for i, (rid, f) in enumerate(zip(plan.request_ids, plan.request_frontend, strict=True))
            if f in held.awaiting and (f, rid) not in held.inputs
            and (f, rid) not in held.cancelled
        ]
        if late_ids:
            self.counters["requests_unavailable"] += len(late_ids)
            self._fail_requests(plan, late_ids, ErrorKind.UNAVAILABLE,
                                f"inputs did not reach backend {self.name} in time")
        keys = list(zip(plan.request_frontend, plan.request_ids, strict=True))
        rows = [i for i, key in enumerate(keys) if key in held.inputs]
        self.counters["requests_missing"] += sum(
            1 for key in keys if key in held.missing and key not in held.inputs
        )
        lateness = now - plan.exec_at
        shed: list[int] = []
        if rows and plan.finish_by:
            rows, shed = shed_late_rows(rows, plan.finish_by, now,
                                        self.profiles[plan.model].table_s, self.shed_grace_s)
            if shed:
                self.counters["requests_shed_late"] += len(shed)
                self._fail_requests(
                    plan, shed, ErrorKind.DEADLINE,
                    f"batch started {lateness * 1e3:.2f} ms late on backend {self.name}; "
                    "could not finish by its deadline",
                )
        if not rows:  # every request cancelled, missing or shed: the batch is skipped
            del self._plans[plan.plan_id]
            if held.cancelled or shed:
                self.counters["batches_skipped"] += 1
            self._send_stats(plan, 0, now, now, ok=True, cancelled=len(held.cancelled),
                             device_free_at=self._device_free_at(self.clock.now()))
            return False
        self.timings.lateness.append(lateness)
        if lateness > LATE_TOLERANCE_S:
            self.counters["late_plans"] += 1
            if held.received_at > plan.exec_at:
                log.debug("%s: plan %d arrived %.3f ms after its exec_at", self.name,
                          plan.plan_id, (held.received_at - plan.exec_at) * 1e3)
        self.timings.fetch.append((held.inputs_at or now) - held.received_at)
        self._running = held
        self._spawn(self._execute(held, rows))
        return True

    def _assemble(self, model: str, requests: list[TensorMap]) -> TensorMap:
        """One stacked batch: one copy per input into the preallocated buffer, none for one
        request. A request whose arrays do not match fails the batch (ValueError/TypeError)."""
        if len(requests) == 1:
            return requests[0]
        batch: TensorMap = {}
        size = len(requests)
        for spec in self.executor.signature(model).inputs:
            buffer = self._buffers[(model, spec.name)]
            np.concatenate([r[spec.name] for r in requests], axis=0, out=buffer[:size],
                           casting="no")
            batch[spec.name] = buffer[:size]
        return batch

    async def _execute(self, held: _Plan, rows: list[int]) -> None:
        plan = held.plan
        started_at = held.started_at
        ok = False
        outputs: list[TensorMap] = []
        error = ""
        try:
            t0 = self.clock.now()
            batch = self._assemble(
                plan.model,
                [held.inputs[(plan.request_frontend[i], plan.request_ids[i])] for i in rows],
            )
            t1 = self.clock.now()
            self.busy.start(t1)
            try:
                outputs = await self.executor.run_async(plan.model, batch)
            finally:
                t2 = self.clock.now()
                self.busy.stop(t2)
            if len(outputs) != len(rows):
                raise ValueError(f"executor returned {len(outputs)} outputs for {len(rows)} rows")
            self.timings.assemble.append(t1 - t0)
            self.timings.run.append(t2 - t1)
            ok = True
        except Exception as exc:  # an execution error fails this batch only
            error = f"{type(exc).__name__}: {exc}"
            log.error("%s: batch %d of %s (%d requests) failed: %s", self.name, plan.plan_id,
                      plan.model, len(rows), error)
        finished_at = self.clock.now()
        try:
            if ok:
                self._push_outputs(plan, rows, outputs, started_at, finished_at)
                self.counters["batches_ok"] += 1
                self.counters["requests_ok"] += len(rows)
            else:
                self._fail_requests(plan, rows, ErrorKind.BACKEND_FAILED,
                                    f"backend {self.name}: {error}")
                self.counters["batches_failed"] += 1
                self.counters["requests_failed"] += len(rows)
            pushed_at = self.clock.now()
            self.timings.push.append(pushed_at - finished_at)
            self.timings.add_batch(plan.model, len(rows))
            # The next plan can start only now, after the push: project from here.
            self._send_stats(plan, len(rows), started_at, finished_at, ok=ok,
                             cancelled=len(held.cancelled),
                             device_free_at=self._device_free_at(pushed_at))
        finally:
            self._plans.pop(plan.plan_id, None)
            self._running = None
            self._maybe_start()

    def _push_outputs(self, plan: BatchPlan, rows: list[int], outputs: list[TensorMap],
                      started_at: float, finished_at: float) -> None:
        by_frontend: dict[int, tuple[list[int], list[TensorMap]]] = {}
        for row, out in zip(rows, outputs, strict=True):
            ids, outs = by_frontend.setdefault(plan.request_frontend[row], ([], []))
            ids.append(plan.request_ids[row])
            outs.append(out)
        for index, (ids, outs) in by_frontend.items():
            self._send(self._data_sock(plan.frontends[index]),
                       BatchOutputs(plan.plan_id, ids, outs, started_at, finished_at))

    def _fail_requests(self, plan: BatchPlan, rows: list[int], kind: ErrorKind, why: str) -> None:
        by_frontend: dict[int, list[int]] = {}
        for row in rows:
            by_frontend.setdefault(plan.request_frontend[row], []).append(plan.request_ids[row])
        for index, ids in by_frontend.items():
            self._send(self._data_sock(plan.frontends[index]),
                       BatchFailed(plan.plan_id, ids, kind.value, why))

    def _send_stats(self, plan: BatchPlan, size: int, started_at: float, finished_at: float, *,
                    ok: bool, cancelled: int = 0, device_free_at: float = 0.0) -> None:
        if self.rank_sock is not None:
            self._send(self.rank_sock, BatchStats(plan.plan_id, plan.model, plan.gpu_id, size,
                                                  plan.exec_at, started_at, finished_at, ok,
                                                  cancelled, device_free_at))

    def _device_free_at(self, free_at: float) -> float:
        """When the device will be free, given that it is free at ``free_at`` (no batch running):
        each plan still held runs at max(previous finish, its exec_at) for its planned duration
        (``expected_finish_at - exec_at``), in exec_at order."""
        if not self._heap:
            return free_at
        plans = self._plans
        for exec_at, _, plan_id in sorted(self._heap):
            plan = plans[plan_id].plan
            free_at = max(free_at, exec_at) + max(0.0, plan.expected_finish_at - plan.exec_at)
        return free_at

    # ------------------------------------------------------------------ liveness and drain

    def wedged(self, now: float) -> bool:
        """True while the running batch has overrun its planned duration many times over."""
        held = self._running
        if held is None:
            return False
        planned = max(0.0, held.plan.expected_finish_at - held.plan.exec_at)
        return now - held.started_at > max(WEDGED_MIN_S, WEDGED_FACTOR * planned)

    async def _rank_heartbeat_loop(self) -> None:
        while True:
            now = self.clock.now()
            if self.wedged(now):
                if not self._wedged_logged:
                    self._wedged_logged = True
                    log.error("%s: batch %d is wedged; heartbeats to the rank stop", self.name,
                              self._running.plan.plan_id if self._running else -1)
            elif self.rank_sock is not None:
                self._wedged_logged = False
                self._hb_seq += 1
                self._send(self.rank_sock, Heartbeat(self.name, self._hb_seq, now))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def drain(self, drain_s: float) -> None:
        """Refuse new plans; run the held plans that can start within ``drain_s``; answer the
        others SHUTTING_DOWN; wait (bounded) for the running batch."""
        self._draining = True
        now = self.clock.now()
        self._drain_deadline = now + drain_s
        self._shed_beyond(self._drain_deadline)
        self._maybe_start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=drain_s)
        self._shed_beyond(-float("inf"))
        if self._running is not None:
            held = self._running
            grace = max(0.0, held.plan.expected_finish_at - self.clock.now()) + WEDGED_MIN_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=grace)
        log.info("%s: drained; counters since start %s", self.name, self.counter_totals())

    def _shed_beyond(self, deadline: float) -> None:
        """Answer SHUTTING_DOWN for every held, unstarted plan with exec_at > deadline."""
        keep: list[tuple[float, int, int]] = []
        for entry in self._heap:
            held = self._plans[entry[2]]
            if entry[0] > deadline:
                plan = held.plan
                self._fail_requests(plan, list(range(len(plan.request_ids))),
                                    ErrorKind.SHUTTING_DOWN,
                                    f"backend {self.name} is shutting down")
                now = self.clock.now()
                self._send_stats(plan, 0, now, now, ok=False)
                del self._plans[entry[2]]
            else:
                keep.append(entry)
        heapq.heapify(keep)
        self._heap = keep

    async def close(self) -> None:
        # A batch still running now holds the executor's worker thread (it cannot be cancelled).
        self._stuck = self._running is not None
        if self._timer is not None:
            self._timer.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        socks = [self.plan_sock, *self.data_socks.values()]
        if self.rank_sock is not None:
            socks.append(self.rank_sock)
        for sock in socks:
            self.reactor.unwatch(sock)
            sock.close(linger=SOCKET_CLOSE_LINGER_MS)
        if not self._stuck:
            self.executor.close()

    @property
    def stuck(self) -> bool:
        """True when a batch still ran at close: the executor's worker thread cannot be joined,
        so the process must exit without waiting for it."""
        return self._stuck

    # ------------------------------------------------------------------ stats

    def stats(self, reset: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": ROLE,
            "name": self.name,
            "device": self.device,
            "models": list(self.models),
            "warmed": {m: list(b) for m, b in self.warmed.items()},
            "warm_s": self.warm_s,
            "warm_finished_at": self.warm_finished_at,
            "held_plans": len(self._plans),
            "counters": dict(self.counters),
            "counters_total": self.counter_totals(),
            "timings": self.timings.summary(),
            "samples": {**self.timings.samples(),
                        "busy_s": self.busy.take(self.clock.now(), reset)},
            "batch_sizes": {m: dict(h) for m, h in self.timings.batch_histogram.items()},
            "clock": self.clock.stats(),
        }
        if reset:
            self.timings.clear()
            for key, value in self.counters.items():
                self._counted_before_reset[key] = self._counted_before_reset.get(key, 0) + value
                self.counters[key] = 0
        return out

    def counter_totals(self) -> dict[str, int]:
        """The counters since the process started (``stats(reset=True)`` zeroes the live ones)."""
        return {key: self._counted_before_reset.get(key, 0) + value
                for key, value in self.counters.items()}


# --------------------------------------------------------------------------- entry points


async def _main(config: dict[str, Any], control_address: str | None) -> int:
    name: str = config["name"]
    cluster = ClusterConfig.from_dict(config["cluster"]) if config.get("cluster") else None
    models = [ModelConfig.from_dict(m) for m in config.get("models", [])]
    device: str = config.get("device", "cpu")
    drain_s = float(config.get("drain_s", cluster.drain_s if cluster else procutil.DEFAULT_DRAIN_S))
    # Plain sockets on the reactor (the control link shadows the context with zmq.asyncio).
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    reactor = SocketReactor(asyncio.get_running_loop())
    backend: Backend | None = None
    link = None
    clock_sync: ClockSync | None = None
    try:
        backend_ref: list[Backend] = []
        link = await procutil.ControlLink.open(
            ctx, control_address, role=ROLE, name=name, drain_s=drain_s,
            stats=lambda reset: backend_ref[0].stats(reset) if backend_ref else {},
        )
        plan_sock, plan_address = make_router(ctx, config["bind"]["plan"], name=f"{name} plan",
                                              advertise_host=config.get("advertise_host"))
        reply_allowance_ms = (cluster.frontends.reply_allowance_ms if cluster is not None
                              else DEFAULT_REPLY_ALLOWANCE_MS)
        backend = Backend(name=name, device=device, executor=build_executor(device, models),
                          ctx=ctx, plan_sock=plan_sock, plan_address=plan_address,
                          reactor=reactor,
                          shed_grace_s=SHED_GRACE_FRACTION * reply_allowance_ms / 1e3)
        backend_ref.append(backend)
        # Loading blocks the loop on purpose: nothing else may happen before Ready.
        backend.load_and_warm(models)
        peers = {**config.get("peers", {}), **await link.ready({"plan": plan_address})}
        if link.drain.requested:
            return 0
        # The plan timer and every timestamp use the cluster clock: estimate it before serving.
        clock_sync = await procutil.sync_cluster_clock(ctx, peers, name=name, drain=link.drain,
                                                       clock=backend.clock)
        if clock_sync is None:
            return 0 if link.drain.requested else 2
        rank_address = procutil.rank_address(peers)
        assert rank_address is not None
        backend.start()
        backend.connect_rank(rank_address)
        await link.drain.wait()
        await backend.drain(link.drain.drain_s)
        return 0
    finally:
        if clock_sync is not None:
            await clock_sync.close()
        if backend is not None:
            await backend.close()
        reactor.close()
        if link is not None:
            await link.close()
        ctx.destroy(linger=SOCKET_CLOSE_LINGER_MS)
        if backend is not None and backend.stuck:
            # A wedged batch holds the executor's worker thread, which the interpreter would
            # join at exit forever: leave now (sockets are closed; the frontends' deadline timers
            # answer the batch's requests).
            log.error("%s: a batch is still running after the drain; exiting without it", name)
            logging.shutdown()
            os._exit(1)


def run_backend(config: dict[str, Any], control_address: str | None) -> int:
    """Run one backend process until it is told to stop; returns the exit code."""
    return procutil.run_role(_main(config, control_address), name=config["name"])


def main(argv: list[str]) -> int:
    """``zserve backend``: run backend ``--index`` of a cluster.toml on its own."""
    parser = argparse.ArgumentParser(prog="zserve backend", description=main.__doc__)
    parser.add_argument("--config", required=True, help="cluster.toml")
    parser.add_argument("--index", type=int, default=0, help="which backend (default 0)")
    parser.add_argument("--control", default=None, help="supervisor control address")
    parser.add_argument("--rank", default=None, help="rank address (overrides cluster.toml)")
    parser.add_argument("--bind", default=None, help="plan socket bind address")
    parser.add_argument("--advertise", default=None, metavar="HOST",
                        help="host name peers use for a socket bound to a wildcard (0.0.0.0) "
                             "address (default: this machine's host name)")
    parser.add_argument("--ipc-dir", default=None, help="folder of ipc:// endpoints")
    args = parser.parse_args(argv)
    cluster = load_config(args.config)
    ipc_dir = args.ipc_dir or cluster.ipc_dir
    config = role_config(cluster, ROLE, args.index, ipc_dir=ipc_dir,
                         peers=cluster.static_peers(ipc_dir), advertise_host=args.advertise)
    if args.bind:
        config["bind"]["plan"] = args.bind
    if args.rank:
        config["peers"][procutil.peer_key("rank", "rank")] = args.rank
    return run_backend(config, args.control)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["Backend", "build_executor", "main", "run_backend", "shed_late_rows"]
