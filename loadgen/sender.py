"""One load-generator worker: send its share of the plan open-loop, record every reply.

``send_loop(spec, t0, monitor)`` runs in the calling process (one worker) or in a spawned one
(``worker_main``, several workers, which share counters with the coordinator through
``Channels``). It never waits for a reply to send: between sends it only reads the replies that
have already arrived (``peek_answers`` reads just their ids and error kinds).

The loop is an asyncio loop with the one receive loop of zserve, ``SocketReactor``: a timer fires
at the next planned send (or monitor tick), sends what is due, and re-arms; the reactor drains the
replies as they come. The loop is the standard library's selector loop, not uvloop: libuv keeps
time in whole milliseconds, and an open-loop generator must send on the planned microsecond.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

from zserve.loadgen.load_plan import (
    BAD,
    COUNTERS,
    DEADLINE_ERROR,
    DECIDED,
    ERROR_INDEX,
    NO_ERROR,
    PLANNED,
    SENT,
    BailRule,
    FloatArray,
    IntArray,
    LoadPlan,
    Outcome,
)
from zserve.transport import codec, socket_io
from zserve.transport.messages import (
    ClientHello,
    InferAnswers,
    InferError,
    InferReply,
    InferRequest,
    TensorMap,
)
from zserve.transport.reactor import SocketReactor
from zserve.transport.sockets import make_dealer

PROTOCOLS = ("native", "http-json", "http-binary", "grpc")
"""The load generator's ways to send: zserve's client socket, or the frontend's Open Inference
Protocol servers (``zserve.loadgen.oip_sender``)."""
# How often a worker publishes its counters, checks the early-stop rule and the stop flag.
MONITOR_INTERVAL_S = 0.05
# After the last send, how long to wait for outstanding replies beyond the largest SLO. The
# frontend answers every admitted request by deadline + reply allowance, so this is generous.
DEFAULT_REPLY_GRACE_S = 1.0
# After an early stop, how long to wait for outstanding replies (they no longer change the verdict).
STOP_GRACE_S = 0.2
# Queue depth of a worker's DEALER toward the frontend: large, because an open-loop generator
# must not stall on its own socket; a send that still finds it full is recorded as an error.
GENERATOR_SEND_HWM = 200_000
WORKER_START_TIMEOUT_S = 60.0
# Most requests sent in one pass of the loop before the replies that arrived are read.
SEND_BURST = 64
_INT_ONLY = {int}
_STR_ONLY = {str}





def peek_answers(frames: Sequence[Any]) -> list[tuple[int, str | None]]:
    """``(request_id, error kind or None)`` of each answer in an ``InferReply``, ``InferError``
    or ``InferAnswers`` message; empty for anything else or anything malformed.

    The generator reads only the header's id and error fields (the codec's layout: ``[KIND,
    field0, ...]``): a full ``codec.decode`` validates and rebuilds every output array, which
    costs several times more and would cap the rate one worker can sustain. Outputs are not
    looked at.
    """
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        return []
    if type(header) is not list or len(header) < 2:
        return []
    kind = header[0]
    if kind == InferAnswers.KIND and len(header) == 6:
        return _batch_answers(header)
    if type(header[1]) is int:
        if kind == InferReply.KIND:
            return [(header[1], None)]
        if kind == InferError.KIND and len(header) >= 3 and type(header[2]) is str:
            return [(header[1], header[2])]
    return []


def _batch_answers(header: list[Any]) -> list[tuple[int, str | None]]:
    """The answers of an ``InferAnswers`` header (one message per batch); empty if malformed."""
    _, request_ids, outputs, error_ids, errors, messages = header
    if not (
        type(request_ids) is type(outputs) is type(error_ids) is type(errors) is list
        and type(messages) is list
        and len(request_ids) == len(outputs)
        and len(error_ids) == len(errors) == len(messages)
        and (not request_ids or set(map(type, request_ids)) == _INT_ONLY)
        and (not error_ids or set(map(type, error_ids)) == _INT_ONLY)
        and (not errors or set(map(type, errors)) == _STR_ONLY)
    ):
        return []
    answers: list[tuple[int, str | None]] = [(rid, None) for rid in request_ids]
    answers.extend(zip(error_ids, errors, strict=True))
    return answers



@dataclass
class WorkerSpec:
    """What one worker needs (picklable for spawned processes)."""

    address: str
    plan: LoadPlan  # this worker's share (request ids are positions in it)
    inputs: dict[str, TensorMap]
    identity: bytes
    reply_grace_s: float = DEFAULT_REPLY_GRACE_S
    bail: BailRule | None = None
    # "native" (zserve's client socket) or an Open Inference Protocol transport
    # (zserve.loadgen.sender.PROTOCOLS; ``address`` is then the server's host:port).
    protocol: str = "native"


@dataclass
class WorkerOutput:
    sent_s: FloatArray
    replied_s: FloatArray
    outcome: np.ndarray[Any, np.dtype[np.int8]]
    error_kind: np.ndarray[Any, np.dtype[np.int8]]
    stopped_early: str | None


Monitor = Callable[[IntArray, float], str | None]
"""Called every MONITOR_INTERVAL_S with the worker's counters (models x COUNTERS) and its
current lag behind schedule in seconds; returns a reason to stop, or None."""


def _templates(spec: WorkerSpec) -> tuple[list[InferRequest], list[int]]:
    """The request templates and each request's template: one per model, or with the plan's
    ``rows`` one per (model, rows), whose inputs repeat the model's one-row inputs that many
    times along the leading dimension."""
    plan = spec.plan

    def template(m: int, rows: int) -> InferRequest:
        name = plan.models[m]
        inputs = spec.inputs.get(name, {})
        if rows != 1:
            inputs = {k: np.ascontiguousarray(np.repeat(a[:1], rows, axis=0))
                      for k, a in inputs.items()}
        return InferRequest(0, name, inputs, plan.slo_ms[m])

    if plan.rows is None:
        return [template(m, 1) for m in range(len(plan.models))], plan.model_index.tolist()
    keys = list(zip(plan.model_index.tolist(), plan.rows.tolist(), strict=True))
    index: dict[tuple[int, int], int] = {}
    for key in keys:
        index.setdefault(key, len(index))
    return [template(m, rows) for m, rows in index], [index[key] for key in keys]


class _Sender:
    """One worker's open-loop run: the per-request records and the steps of its loop.

    The per-request records live in Python lists while the loop runs and become arrays at the
    end: indexing a list costs a fraction of indexing a numpy array element, and the loop does
    it a dozen times per request. The hot steps (``send_due``, ``read_replies``) bind what they
    use to locals once per call, not once per request. The monitor works on arrays of the recent
    window only."""

    def __init__(self, spec: WorkerSpec, t0: float) -> None:
        plan = spec.plan
        n = len(plan)
        self.spec = spec
        self.t0 = t0
        self.n = n
        self.times = plan.times_s.tolist()
        self.model_index = plan.model_index.tolist()
        self.measured = plan.measured.tolist()
        slo_s = np.asarray(plan.slo_ms, dtype=np.float64) / 1e3
        self.request_slo_s = slo_s[plan.model_index].tolist()
        self.max_slo_s = float(slo_s.max()) if len(slo_s) else 0.0
        # One request template per model (and rows per request): each request is its template
        # with its own id, encoded for the cost of packing that id (the same arrays every time);
        # the requests due at once go as one InferRequests, for the cost of packing their ids.
        templates, self.template = _templates(spec)
        self.encoders = [codec.encoder_for_ids(t) for t in templates]
        self.encode_batch = codec.encoder_for_request_batches(templates)
        self.sent = [math.nan] * n
        self.replied = [math.nan] * n
        self.outcome = [int(Outcome.UNSENT)] * n
        self.error_kind = [NO_ERROR] * n
        self.answered = [False] * n
        # Requests resolved-as-bad only by being overdue are counted once, at the monitor.
        self.overdue_counted = [False] * n
        self.overdue_scan_from = 0
        planned = np.bincount(plan.model_index[plan.measured], minlength=len(plan.models))
        self.counters = [[0] * len(COUNTERS) for _ in plan.models]
        for m, count in enumerate(planned.tolist()):
            self.counters[m][PLANNED] = count
        self.i = 0  # the next request to send
        self.outstanding = 0
        self.stopped: str | None = None
        self.next_monitor = t0 + MONITOR_INTERVAL_S
        self.end_at = math.inf

    # 1. Send what is due (at most SEND_BURST, so that reply times stay accurate while
    #    catching up), in one message: one InferRequest, or one InferRequests when several are
    #    due (one send, one frontend wake-up for all of them). Never wait for a reply to send.
    def send_due(self, sock: zmq.Socket[Any], now: float) -> None:
        if self.stopped is not None:
            return
        t0, times, n, first = self.t0, self.times, self.n, self.i
        i, burst_end = first, min(n, first + SEND_BURST)
        while i < burst_end and t0 + times[i] <= now:
            i += 1
        if i == first:
            return
        sent_at = time.monotonic() - t0
        template = self.template
        frames = (self.encoders[template[first]](first) if i == first + 1
                  else self.encode_batch(list(range(first, i)), template[first:i]))
        try:
            socket_io.send_frames_nowait(sock, frames)
            refused = False
        except zmq.Again:
            refused = True
        model_index, measured, counters, sent = (self.model_index, self.measured, self.counters,
                                                 self.sent)
        for k in range(first, i):
            m = model_index[k]
            sent[k] = sent_at
            if refused:
                self._refused(k, m)
            else:
                self.outstanding += 1
            if measured[k]:
                counters[m][SENT] += 1
        self.i = i
        if i == n:
            self.end_at = time.monotonic() + self.max_slo_s + self.spec.reply_grace_s

    def _refused(self, i: int, m: int) -> None:
        """The socket's queue is full: the request ends at once as an error."""
        self.answered[i] = True
        self.replied[i] = self.sent[i]
        self.outcome[i] = int(Outcome.ERROR)
        self.error_kind[i] = ERROR_INDEX["SEND_BLOCKED"]
        if self.measured[i]:
            self.counters[m][DECIDED] += 1
            self.counters[m][BAD] += 1

    # 2. Settle the replies of one reactor drain (each a list of frames; they had all arrived
    #    by the drain, so one timestamp serves them all).
    def on_replies(self, replies: list[list[zmq.Frame]]) -> None:
        bad_reply_error = ERROR_INDEX["BAD_REPLY"]
        settle = self._settle
        t_reply = time.monotonic()
        sent_so_far = self.i
        for reply_frames in replies:
            # Undecodable answers yield nothing: their requests will end as TIMEOUT.
            for k, error in peek_answers(reply_frames):
                kind = NO_ERROR if error is None else ERROR_INDEX.get(error, bad_reply_error)
                if 0 <= k < sent_so_far:
                    settle(k, kind, t_reply)

    def _settle(self, k: int, kind: int, t: float) -> None:
        if self.answered[k]:
            return
        self.answered[k] = True
        self.outstanding -= 1
        self.replied[k] = t - self.t0
        if kind == NO_ERROR:
            good = (t - self.t0) - self.sent[k] <= self.request_slo_s[k]
            self.outcome[k] = int(Outcome.GOOD) if good else int(Outcome.LATE)
        else:
            good = False
            self.outcome[k] = (int(Outcome.DROPPED) if kind == DEADLINE_ERROR
                               else int(Outcome.ERROR))
            self.error_kind[k] = kind
        if self.measured[k] and not self.overdue_counted[k]:
            counts = self.counters[self.model_index[k]]
            counts[DECIDED] += 1
            if not good:
                counts[BAD] += 1

    # 3. Publish counters, apply the early-stop rule, watch our own lag.
    def monitor(self, now: float, monitor: Monitor) -> None:
        self.next_monitor = now + MONITOR_INTERVAL_S
        self._count_overdue(now)
        i, n = self.i, self.n
        lag = now - (self.t0 + self.times[i]) if i < n else 0.0
        reason = monitor(np.array(self.counters, dtype=np.int64), lag)
        if reason is not None and self.stopped is None:
            self.stopped = reason
            self.end_at = min(self.end_at, now + self.max_slo_s + STOP_GRACE_S)

    def _count_overdue(self, now: float) -> None:
        """Count measured requests already past their SLO without an answer as bad now."""
        answered, overdue_counted, measured = self.answered, self.overdue_counted, self.measured
        lo, hi = self.overdue_scan_from, self.i
        if lo < hi:
            late_now = (
                ~np.array(answered[lo:hi], dtype=bool)
                & ~np.array(overdue_counted[lo:hi], dtype=bool)
                & np.array(measured[lo:hi], dtype=bool)
                & (
                    np.array(self.sent[lo:hi]) + np.array(self.request_slo_s[lo:hi])
                    < now - self.t0
                )
            )
            for k in (np.nonzero(late_now)[0] + lo).tolist():
                overdue_counted[k] = True
                counts = self.counters[self.model_index[k]]
                counts[BAD] += 1
                counts[DECIDED] += 1
        scan = self.overdue_scan_from
        while scan < hi and (answered[scan] or overdue_counted[scan] or not measured[scan]):
            scan += 1
        self.overdue_scan_from = scan

    # 4. Done when everything is sent and answered, or the grace period is over.
    def done(self, now: float) -> bool:
        return (self.i == self.n or self.stopped is not None) and (
            self.outstanding == 0 or now >= self.end_at)

    # 5. The next send or monitor tick (replies wake the loop through the reactor).
    def wake_at(self) -> float:
        sending = self.i < self.n and self.stopped is None
        return min(self.t0 + self.times[self.i] if sending else self.end_at, self.next_monitor)

    def output(self) -> WorkerOutput:
        outcomes = np.array(self.outcome, dtype=np.int8)
        sent_s = np.array(self.sent, dtype=np.float64)
        unanswered = ~np.array(self.answered, dtype=bool) & ~np.isnan(sent_s)
        outcomes[unanswered] = Outcome.TIMEOUT
        return WorkerOutput(
            sent_s,
            np.array(self.replied, dtype=np.float64),
            outcomes,
            np.array(self.error_kind, dtype=np.int8),
            self.stopped,
        )


def send_loop(spec: WorkerSpec, t0: float, monitor: Monitor) -> WorkerOutput:
    """Send ``spec.plan`` open-loop from ``t0`` on; record every reply."""
    if spec.protocol != "native":
        from zserve.loadgen.oip_sender import oip_send_loop

        out = oip_send_loop(spec, lambda: t0, monitor)
        assert out is not None  # a start instant was given
        return out
    loop = asyncio.SelectorEventLoop()  # not uvloop: see the module docstring
    try:
        return loop.run_until_complete(_serve(spec, t0, monitor))
    finally:
        loop.close()


async def _serve(spec: WorkerSpec, t0: float, monitor: Monitor) -> WorkerOutput:
    loop = asyncio.get_running_loop()
    ctx = zmq.Context()
    sock = make_dealer(
        ctx, spec.address, identity=spec.identity, send_hwm_messages=GENERATOR_SEND_HWM
    )
    reactor = SocketReactor(loop)
    host = _SendHost(_Sender(spec, t0), sock, reactor, monitor, loop.create_future())
    try:
        reactor.watch_frames(sock, on_frames=host.on_replies)
        # First on the connection: answers may come coalesced (InferAnswers), one per batch.
        reactor.send_frames(sock, codec.encode(ClientHello(accepts=[InferAnswers.KIND])))
        host.on_timer()
        await host.finished
    finally:
        host.cancel()
        reactor.close()
        sock.close(linger=0)
        ctx.term()
    return host.sender.output()


class _SendHost:
    """Hosts a ``_Sender`` on the event loop: one timer for its next send or monitor tick, the
    reactor's drains for its replies. ``finished`` ends with the run (or with the error that
    ended it: the reactor would only log an exception raised in its handler)."""

    def __init__(self, sender: _Sender, sock: zmq.Socket[Any], reactor: SocketReactor,
                 monitor: Monitor, finished: asyncio.Future[None]) -> None:
        self.sender = sender
        self.sock = sock
        self.reactor = reactor
        self.monitor = monitor
        self.finished = finished
        self._loop = finished.get_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.nan

    def on_timer(self) -> None:
        self._timer = None
        try:
            self.sender.send_due(self.sock, time.monotonic())
            # The sends went around the reactor (a tight loop): they may have consumed the FD's
            # edge of a reply that arrived meanwhile.
            self.reactor.kick(self.sock)
            self._step()
        except BaseException as exc:
            self._fail(exc)

    def on_replies(self, replies: list[list[zmq.Frame]]) -> None:
        try:
            self.sender.on_replies(replies)
            self._step()
        except BaseException as exc:
            self._fail(exc)

    def _step(self) -> None:
        sender = self.sender
        now = time.monotonic()
        if now >= sender.next_monitor:
            sender.monitor(now, self.monitor)
        if sender.done(now):
            self.cancel()
            if not self.finished.done():
                self.finished.set_result(None)
            return
        wake = sender.wake_at()
        if self._timer is None or wake != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = wake
            self._timer = self._loop.call_at(wake, self.on_timer)

    def _fail(self, exc: BaseException) -> None:
        self.cancel()
        if not self.finished.done():
            self.finished.set_exception(exc)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


@dataclass
class Channels:
    """Shared-memory and synchronisation objects between the coordinator and its workers."""

    counters: Any  # RawArray int64 (workers x models x COUNTERS)
    lag_s: Any  # RawArray float64 (workers)
    ready: Any  # Semaphore: released once by each worker when it is ready to start
    go: Any  # Event: start_at is set, start
    start_at: Any  # RawValue float64: t0
    stop: Any  # Event: stop sending now


def worker_main(spec: WorkerSpec, slot: int, channels: Channels, out_path: str) -> None:
    """Entry point of a spawned worker process."""
    width = len(spec.plan.models) * len(COUNTERS)
    base = slot * width
    view = np.frombuffer(channels.counters, dtype=np.int64)

    def publish(counters: IntArray, lag_s: float) -> str | None:
        view[base : base + width] = counters.reshape(-1)
        channels.lag_s[slot] = lag_s
        return "stopped by the coordinator" if channels.stop.is_set() else None

    def start() -> float | None:
        """Report ready, wait for the others: the agreed start instant (None: called off)."""
        channels.ready.release()
        if not channels.go.wait(WORKER_START_TIMEOUT_S) or channels.stop.is_set():
            return None
        return float(channels.start_at.value)

    if spec.protocol == "native":
        t0 = start()
        out = None if t0 is None else send_loop(spec, t0, publish)
    else:  # an OIP worker connects before it reports ready (connecting is not measured)
        from zserve.loadgen.oip_sender import oip_send_loop

        out = oip_send_loop(spec, start, publish)
    if out is None:
        return
    np.savez(
        out_path,
        sent_s=out.sent_s,
        replied_s=out.replied_s,
        outcome=out.outcome,
        error_kind=out.error_kind,
    )
