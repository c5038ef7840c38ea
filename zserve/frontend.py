"""The frontend process: clients' entry point, input store, and the one place that answers them.

Sockets (docs/runtime.md): a ``client`` ROUTER (clients' DEALERs connect), a ``data`` ROUTER
(backends connect to fetch inputs and push outputs), a DEALER to every scheduler shard (request
metadata out, ``DropNotice`` in), a DEALER to rank (``BackendTable`` in) and the control DEALER.

What it guarantees: every admitted request gets exactly one terminal answer (``InferReply`` or an
``InferError``), because each one carries a deadline timer (one heap, one armed ``call_later``)
that answers ``DEADLINE`` at ``arrival + slo`` if nothing else has; a backend that restarts (a new
pid says ``Hello``) or leaves the ``BackendTable`` fails the requests it had fetched with
``BACKEND_FAILED``. A request's inputs are kept until the backend that runs it fetches them, and
are released when it is answered, cancelled, or its client disconnects (socket monitor events
matched to the connection's file descriptor), so memory stays bounded by the admission limits.

Time: ``arrival``, deadlines and every hop timing are on the cluster clock (``zserve.clock``: the
rank's CLOCK_MONOTONIC), read as ``self.clock.now()``; the frontend estimates its offset before it
connects to the scheduler. Its deadline timers are relative delays on the loop (no conversion).

Event loop structure: the sockets are plain (sync) ZeroMQ sockets, each with its FD watched by
``loop.add_reader``; its callback drains that socket without blocking. ZeroMQ's FD is
edge-triggered: a socket is polled before each receive until it has no more input, and every send
records its socket, which is polled again before the loop sleeps (a send can consume the edge of a
message that arrived meanwhile). What a callback produces is sent when it ends: the admitted
requests' metadata as one ``RequestMetaBatch`` per shard, and the answers to a client that
announced it decodes them (``ClientHello``) as one ``InferAnswers`` per client (a batch's outputs
usually all go to one client connection); other clients get one ``InferReply`` / ``InferError``
per request.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import heapq
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio
import zmq.utils.monitor

from zserve import control_link, peer_map, role_runner
from zserve.clock import ClockSync, ClusterClock
from zserve.config import ModelConfig, RoleConfig, load_config, role_config, shard_for_model
from zserve.errors import ErrorKind, ProtocolError
from zserve.transport import codec, socket_io
from zserve.transport.messages import (
    BackendGone,
    BackendTable,
    BatchFailed,
    BatchOutputs,
    CancelFetched,
    CancelRequest,
    ClientHello,
    ClusterStatsRequest,
    DropNotice,
    Hello,
    InferAnswers,
    InferError,
    InferReply,
    InferRequest,
    InputFetch,
    InputReply,
    Message,
    RequestMetaBatch,
    StatsReply,
    StatsRequest,
)
from zserve.transport.sockets import make_dealer, make_router

log = logging.getLogger("zserve.frontend")

# Messages handled per socket per pass before yielding to the loop (so the per-tick metadata
# flush and timers run between bursts).
RECV_BUDGET = 256
# Hop latency samples kept for stats (a ring; percentiles over the most recent ones).
HOP_SAMPLES = 8192
# Malformed messages: log the first few in full, then one line per this many.
MALFORMED_LOG_FIRST = 10
MALFORMED_LOG_EVERY = 1000
# Plain ints: pyzmq's constants are enum members. Input is looked for with zmq_poll rather than
# getsockopt(EVENTS), which builds a ``SocketOption`` enum on every call (a third dearer).
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SRCFD = int(zmq.SRCFD)
# Built once, because Enum lookups and ``.value`` run Python code: each error kind's wire string,
# the counters it increments, and the kind of a wire string.
_WIRE_ERRORS = {kind: kind.value for kind in ErrorKind}
_ERROR_COUNTERS = {kind: f"error_{kind.value}" for kind in ErrorKind}
_REJECTED_COUNTERS = {kind: f"rejected_{kind.value}" for kind in ErrorKind}
_ERROR_KINDS = {kind.value: kind for kind in ErrorKind}
# Request ids carry the frontend's index in their low digits (see Frontend.__init__).
MAX_FRONTENDS = 1024
# Timer slack: answer deadlines that fall due within this much of now in the same pass.
TIMER_SLACK_S = 0.0005
# A client's ClusterStatsRequest is answered once every peer has, or after this long
# with what came (the ones that did not are listed under "cluster_silent").
PEER_STATS_TIMEOUT_S = 0.5

_QUEUED = 0  # inputs held, waiting for a backend to fetch them
_FETCHED = 1  # a backend holds the inputs; the request may be running


class _Pending:
    """One admitted request, from admission to its terminal answer."""

    __slots__ = (
        "answer_by",
        "arrival",
        "backend",
        "client",
        "client_rid",
        "fetched_at",
        "inputs",
        "model",
        "owner",
        "plan_id",
        "rid",
        "state",
    )

    def __init__(  # noqa: PLR0917
        self,
        rid: int,
        client: bytes,
        client_rid: int,
        model: str,
        inputs: dict[str, Any] | None,
        arrival: float,
        answer_by: float,
    ) -> None:
        self.rid = rid
        self.owner = client  # the client connection's identity (index key)
        self.client: bytes | None = client  # None once the client is gone: answer nobody
        self.client_rid = client_rid
        self.model = model
        self.inputs = inputs
        self.arrival = arrival
        self.answer_by = answer_by
        self.state = _QUEUED
        self.backend = ""
        self.fetched_at = 0.0
        self.plan_id = 0  # the plan whose fetch took the inputs (to cancel it on the backend)


class _Answers:
    """The answers to one client produced in one event-loop tick: one ``InferAnswers``."""

    __slots__ = ("error_ids", "errors", "messages", "outputs", "request_ids")

    def __init__(self) -> None:
        self.request_ids: list[int] = []
        self.outputs: list[dict[str, Any]] = []
        self.error_ids: list[int] = []
        self.errors: list[str] = []
        self.messages: list[str] = []

    def __len__(self) -> int:
        return len(self.request_ids) + len(self.error_ids)


class _StatsGathering:
    """One round of StatsRequests to the frontend's peers, for clients waiting on it."""

    __slots__ = ("handle", "replies", "waiters", "waiting")

    def __init__(self, waiting: set[str]) -> None:
        self.waiting = waiting  # peer process names not yet answered
        self.replies: dict[str, Any] = {}
        self.waiters: list[tuple[bytes, dict[str, Any]]] = []  # (client, frontend's own stats)
        self.handle: asyncio.TimerHandle | None = None


class _ModelState:
    """Per-model admission state: the queued bound and the predicted-wait bound."""

    __slots__ = (
        "_capacity",
        "_profile",
        "config",
        "max_queue",
        "pending",
        "request_spec",
        "shard",
        "signature",
        "slo_s",
        "wait_bound_s",
    )

    def __init__(self, config: ModelConfig, shard: int, signature: Any) -> None:
        self.config = config
        self.shard = shard
        self.signature = signature
        self.max_queue = config.max_queue
        self.wait_bound_s = config.wait_bound_ms / 1e3
        self.slo_s = config.slo_ms / 1e3
        self.pending = 0
        # (name, dtype, shape) of every input of a valid request, when the signature fixes them
        # (set by the frontend, which knows the size bound); see _request_spec.
        self.request_spec: RequestSpec | None = None
        self._capacity: dict[int, float] = {}
        self._profile = _load_profile(config)

    @property
    def profile(self) -> Any:
        return self._profile

    @profile.setter
    def profile(self, value: Any) -> None:
        self._profile = value
        self._capacity.clear()

    def capacity_rps(self, gpus: int) -> float:
        """The analytic throughput of ``gpus`` coordinated GPUs at this model's SLO (DESIGN
        section 3): b = the largest batch with l(b) * (1 + 1/N) <= SLO; N * b / l(b)."""
        capacity = self._capacity.get(gpus)
        if capacity is None:
            capacity = math.inf
            if self._profile is not None and gpus > 0:
                budget = self.config.slo_ms / 1e3 / (1.0 + 1.0 / gpus)
                batch = max(1, self._profile.largest_batch_within(budget))
                capacity = gpus * batch / self._profile.latency(batch)
            self._capacity[gpus] = capacity
        return capacity


def _load_profile(config: ModelConfig) -> Any:
    from zserve.profiles import configured_profile

    try:
        return configured_profile(config)
    except (OSError, ValueError) as exc:
        log.warning("model %s: cannot read profile %s: %s", config.name, config.profile, exc)
    return None


RequestSpec = tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]


def _request_spec(signature: Any, max_request_bytes: int) -> RequestSpec | None:
    """The exact ``(name, dtype, shape)`` of every input of a request that ``signature`` accepts,
    when it fixes every dimension and such a request is within ``max_request_bytes``; else None.
    A request that matches it passes every input check of admission (size bound, signature),
    checked in a few comparisons (``_matches_spec``); any other takes the full checks, which
    name the problem."""
    if signature is None:
        return None
    spec = []
    total_bytes = 0
    try:
        for tensor in signature.inputs:
            if any(dim is None for dim in tensor.shape):
                return None
            dtype = np.dtype(tensor.dtype)
            shape = (1, *(int(dim) for dim in tensor.shape))
            total_bytes += dtype.itemsize * math.prod(shape)
            spec.append((str(tensor.name), dtype, shape))
    except (AttributeError, TypeError, ValueError):
        return None
    if not spec or total_bytes > max_request_bytes:
        return None
    return tuple(spec)


def _matches_spec(inputs: dict[str, Any], spec: RequestSpec) -> bool:
    if len(inputs) != len(spec):
        return False
    for name, dtype, shape in spec:
        array = inputs.get(name)
        if array is None or array.dtype != dtype or array.shape != shape:
            return False
    return True


def model_signature(config: ModelConfig) -> Any:
    """The ``ModelSignature`` requests for ``config`` are validated against (read without ONNX
    Runtime), or None when it cannot be read here (then the backend validates)."""
    try:
        if config.kind == "emulated":
            from zserve.backends.emulated import EmulatedModel

            assert config.alpha_ms is not None and config.beta_ms is not None
            return EmulatedModel(
                config.name,
                config.alpha_ms,
                config.beta_ms,
                max_batch=config.max_batch,
                input_shape=config.input_shape,
                input_dtype=config.input_dtype,
                output_shape=config.output_shape,
            ).signature
        from zserve.backends.builtin import ensure_builtin
        from zserve.backends.onnx_executor import read_signature

        path = ensure_builtin(config.builtin) if config.builtin else config.onnx
        assert path is not None
        return read_signature(path, config.name)
    except Exception as exc:
        log.warning("model %s: no signature at the frontend (%s); backends validate", config.name,
                    exc)
        return None


class _HopStats:
    """Latency samples of one hop, in seconds, in a bounded ring."""

    def __init__(self) -> None:
        self.samples: collections.deque[float] = collections.deque(maxlen=HOP_SAMPLES)

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"count": 0}
        values = np.fromiter(self.samples, dtype=np.float64) * 1e3
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return {
            "count": len(values),
            "mean_ms": float(values.mean()),
            "p50_ms": float(p50),
            "p90_ms": float(p90),
            "p99_ms": float(p99),
        }


class Frontend:
    """The frontend's state and handlers. ``run_frontend`` drives it; tests may too."""

    def __init__(self, config: RoleConfig, ctx: zmq.Context[Any]) -> None:
        self.name: str = config.name
        self.cluster = config.cluster
        self.ctx = ctx
        self.bind_addresses: dict[str, str] = config.bind
        self.advertise_host: str | None = config.advertise_host
        # Offset 0 until _serve has estimated it (the rank's clock is the cluster clock).
        self.clock = ClusterClock()
        self.reply_allowance_s = self.cluster.frontends.reply_allowance_ms / 1e3
        self.max_request_bytes = self.cluster.frontends.max_request_bytes
        shards = self.cluster.scheduler.shards
        self.models: dict[str, _ModelState] = {
            m.name: _ModelState(m, shard_for_model(m.name, shards), model_signature(m))
            for m in self.cluster.models
        }
        for state in self.models.values():
            state.request_spec = _request_spec(state.signature, self.max_request_bytes)
        self.pending: dict[int, _Pending] = {}
        self.by_client: dict[bytes, dict[int, int]] = {}
        self.fetched_by: dict[str, set[int]] = {}
        self.backend_pids: dict[str, int] = {}
        self.backend_models: dict[str, list[str]] | None = None  # from rank's BackendTable
        self.gpus_for_model: dict[str, int] = {}
        # Request ids are unique across the cluster's frontends, not only within this one:
        # id = seq * MAX_FRONTENDS + frontend index, so a batch that mixes frontends never holds
        # two requests with one id (a backend may key a plan's inputs by id alone).
        self.rid_stride = MAX_FRONTENDS
        self.next_rid = MAX_FRONTENDS + config.index % MAX_FRONTENDS
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()
        self.counters: collections.Counter[str] = collections.Counter()
        self.hops = {
            "admit_to_fetch": _HopStats(),
            "fetch_to_outputs": _HopStats(),
            "admit_to_answer": _HopStats(),
            # From the backends' BatchOutputs: batch start - admission (the true queueing
            # delay, deferral included) and batch start -> finish (execution).
            "queueing": _HopStats(),
            "execution": _HopStats(),
            # batch finish -> its outputs handled here (the push and the BatchOutputs hop), per
            # batch; and per request, answer - admission - execution: everything a request
            # spends outside its batch's run, deferral included (issue 7's "overhead").
            "finish_to_answer": _HopStats(),
            "overhead": _HopStats(),
        }
        self.queueing_by_model: dict[str, _HopStats] = {name: _HopStats() for name in self.models}
        self._answer_hop = self.hops["admit_to_answer"].samples  # appended once per answer
        # Clients that announced (ClientHello) that they decode InferAnswers, and the answers to
        # them of this tick, sent once per tick (_flush_answers).
        self._batched_clients: set[bytes] = set()
        self._answers: dict[bytes, _Answers] = {}
        # Cancellations of fetched requests, per backend, sent once per tick (CancelFetched).
        self._cancel_notes: dict[str, tuple[list[int], list[int]]] = {}
        self._gathering: _StatsGathering | None = None
        self._rank_embedded = False  # rank lives in shard-0 (shards = 0): ask it once
        # Per-shard metadata of this tick (struct of arrays), flushed once per tick.
        nshards = self.cluster.scheduler_processes
        self._meta: list[tuple[list[int], list[str], list[float], list[float]]] = [
            ([], [], [], []) for _ in range(nshards)
        ]
        # What a tick produced is sent once, by _flush_tick: at the end of the socket or timer
        # callback that produced it (_in_callback), else from a call_soon.
        self._flush_scheduled = False
        self._in_callback = False
        self._drain_scheduled = False
        # Sockets sent on since their input was last looked for (see _recheck_sent).
        self._sent_on: set[zmq.Socket[Any]] = set()
        self._closed = False
        self._timers: list[tuple[float, int]] = []
        self._timer_handle: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        # Client connections: fd -> identities seen on it, identity -> fd.
        self._fd_clients: dict[int, set[bytes]] = {}
        self._client_fd: dict[bytes, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.client_sock: zmq.Socket[Any] | None = None
        self.data_sock: zmq.Socket[Any] | None = None
        self.monitor_sock: zmq.Socket[Any] | None = None
        self.shard_socks: list[zmq.Socket[Any] | None] = [None] * nshards
        self.rank_sock: zmq.Socket[Any] | None = None
        self.endpoints: dict[str, str] = {}
        # Every socket's handler, and the zmq_poll items asking them all (in drain order) and
        # each one alone.
        self._handlers: dict[zmq.Socket[Any], Callable[[list[Any]], None]] = {}
        self._poll_items: list[tuple[zmq.Socket[Any], int]] = []
        self._poll_one: dict[zmq.Socket[Any], list[tuple[zmq.Socket[Any], int]]] = {}

    # ------------------------------------------------------------------ set-up

    def bind(self) -> dict[str, str]:
        self.client_sock, client_ep = make_router(
            self.ctx, self.bind_addresses["client"], name=f"{self.name} client",
            advertise_host=self.advertise_host,
        )
        self.data_sock, data_ep = make_router(
            self.ctx, self.bind_addresses["data"], name=f"{self.name} data",
            advertise_host=self.advertise_host,
        )
        self.monitor_sock = self.client_sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        self.endpoints = {"client": client_ep, "data": data_ep}
        return self.endpoints

    def connect(self, peers: dict[str, str]) -> None:
        """Connect to the shards and rank named in the peer map."""
        identity = self.name.encode()
        hello = Hello(role="frontend", name=self.name, pid=os.getpid())
        shard_eps = peer_map.endpoints_of(peers, "shard")
        for index in range(len(self.shard_socks)):
            address = shard_eps.get(f"shard-{index}")
            if address is None:
                log.error("%s: no address for shard-%d: its models are unavailable",
                          self.name, index)
                continue
            sock = make_dealer(self.ctx, address, identity=identity)
            socket_io.sync_send(sock, hello)
            self.shard_socks[index] = sock
        rank_eps = peer_map.endpoints_of(peers, "rank")
        rank_address = rank_eps.get("rank") or rank_eps.get("shard-0")
        # shards = 0: shard-0 hosts the rank (also when a flag named its address "rank/rank").
        self._rank_embedded = self.cluster.scheduler.shards == 0
        if rank_address is not None:
            self.rank_sock = make_dealer(self.ctx, rank_address, identity=identity)
            socket_io.sync_send(self.rank_sock, hello)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        handlers: list[tuple[zmq.Socket[Any] | None, Callable[[list[Any]], None]]] = [
            (self.monitor_sock, self._on_monitor_event),
            (self.data_sock, self._on_data),
            *((sock, self._on_shard) for sock in self.shard_socks),
            (self.rank_sock, self._on_rank),
            (self.client_sock, self._on_client),
        ]
        self._handlers = {sock: handler for sock, handler in handlers if sock is not None}
        self._poll_items = [(sock, _POLLIN) for sock in self._handlers]
        self._poll_one = {sock: [(sock, _POLLIN)] for sock in self._handlers}
        for sock in self._handlers:
            loop.add_reader(sock.fileno(), self._on_socket_readable, sock)
        self._schedule_drain()

    def _sockets(self) -> list[zmq.Socket[Any]]:
        socks = [self.monitor_sock, self.data_sock, *self.shard_socks, self.rank_sock]
        socks.append(self.client_sock)
        return [s for s in socks if s is not None]

    def close(self) -> None:
        self._flush_answers()  # answers queued this tick (answer_all's at shutdown) go out first
        self._closed = True  # a drain pass already scheduled must not touch closed sockets
        if self._timer_handle is not None:
            self._timer_handle.cancel()
        for sock in self._sockets():
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(sock.fileno())
        if self.client_sock is not None and self.monitor_sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.client_sock.disable_monitor()
        for sock in self._sockets():
            sock.close(linger=control_link.CLOSE_LINGER_MS)

    # ------------------------------------------------------------------ receive

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self._loop is not None:
            self._drain_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        """A drain pass over every socket (at start, after a budget ran out, after sends from
        outside socket callbacks)."""
        self._drain_scheduled = False
        if self._closed:
            return
        # One zmq_poll asks every socket for input (it reads each one's EVENTS, which is what
        # consumes ZeroMQ's edge-triggered FD), for the price of about two getsockopt calls.
        try:
            ready = zmq.zmq_poll(self._poll_items, 0)
        except zmq.ZMQError as exc:
            log.warning("%s: poll failed: %s", self.name, exc)
            return
        more = False
        self._in_callback = True
        try:
            for sock, _ in ready:
                more |= self._drain(sock, self._handlers[sock])
        finally:
            self._in_callback = False
        self._end_callback(more)

    def _on_socket_readable(self, sock: zmq.Socket[Any]) -> None:
        """``sock``'s FD fired: drain that socket alone (every socket has an FD and a reader of
        its own, so the others need no look). The first receive is tried without a poll: the FD
        fires for a message all but every time (6 times in 12,000 not, in a bench run), and a
        receive that finds nothing consumes the edge as a poll would."""
        if self._closed or self._drain_scheduled:
            return  # a pass over every socket is about to run
        self._in_callback = True
        try:
            more = self._drain(sock, self._handlers[sock])
        finally:
            self._in_callback = False
        self._end_callback(more)

    def _end_callback(self, more: bool) -> None:
        """End of a socket or timer callback: send what it produced (no extra loop iteration
        for that), and drain again if a socket may hold input (``more``, or a socket sent on
        has some)."""
        if self._flush_scheduled:
            self._flush_tick()  # it looks for input on the sockets it sent on
        if self._sent_on:
            more |= self._sent_on_has_input()
        if more:
            self._schedule_drain()

    def _send(self, sock: zmq.Socket[Any], frames: list[Any]) -> None:
        """Send without blocking (raises zmq.Again or ZMQError like send_frames_nowait). Every
        send goes through here: it records the socket, whose input must be looked for again
        before the loop sleeps, because a send can consume the edge of the socket's
        edge-triggered FD that a message arriving meanwhile raised."""
        self._sent_on.add(sock)
        socket_io.send_frames_nowait(sock, frames)

    def _sent_on_has_input(self) -> bool:
        """Whether a socket sent on since the last look has input; clears the record. Asking
        (one zmq_poll) also rearms their FDs: cheaper than a whole drain pass."""
        socks, self._sent_on = self._sent_on, set()
        try:
            return bool(zmq.zmq_poll([(sock, _POLLIN) for sock in socks if not sock.closed], 0))
        except zmq.ZMQError:
            return True  # let a drain pass find out

    def _recheck_sent(self) -> None:
        """After sends from outside a drain pass (timers, flushes): drain if they left input."""
        if self._sent_on and self._sent_on_has_input():
            self._schedule_drain()

    def _drain(self, sock: zmq.Socket[Any], handler: Callable[[list[Any]], None]) -> bool:
        """Handle up to RECV_BUDGET messages of ``sock``, which is expected to hold one; True if
        it may hold more. Before each message but the first it polls the socket: asking for its
        events is the documented way to consume the edge-triggered FD, and several times cheaper
        than a receive failing with EAGAIN."""
        poll_items = self._poll_one[sock]
        for count in range(RECV_BUDGET):
            try:
                if count and not zmq.zmq_poll(poll_items, 0):
                    return False
                # One whole message, frame by frame: each Frame knows whether more follow, so
                # no RCVMORE getsockopt per frame (recv_multipart asks it for every one).
                frame = sock.recv(_NOBLOCK, copy=False)
                frames = [frame]
                while frame.more:
                    frame = sock.recv(_NOBLOCK, copy=False)
                    frames.append(frame)
            except zmq.Again:
                return False
            except zmq.ZMQError as exc:
                log.warning("%s: receive failed: %s", self.name, exc)
                return False
            try:
                handler(frames)
            except Exception:
                self.counters["handler_errors"] += 1
                log.exception("%s: handler failed", self.name)
        return True

    def _malformed(self, where: str, exc: Exception) -> None:
        self.counters["malformed"] += 1
        count = self.counters["malformed"]
        if count <= MALFORMED_LOG_FIRST or count % MALFORMED_LOG_EVERY == 0:
            log.warning("%s: malformed message on %s (%d so far): %s", self.name, where, count, exc)

    # ------------------------------------------------------------------ clients

    def _on_client(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._malformed("client", ProtocolError("no header frame"))
            return
        identity = frames[0].bytes
        try:  # the connection's file descriptor, to match disconnect events to clients
            fd = int(frames[1].get(_SRCFD))
        except (zmq.ZMQError, TypeError, ValueError):
            fd = -1
        if self._client_fd.get(identity) != fd:
            self._client_fd[identity] = fd
            self._fd_clients.setdefault(fd, set()).add(identity)
        try:
            msg = codec.decode(frames[1:])
        except ProtocolError as exc:
            self._malformed("client", exc)
            request_id = _recover_request_id(frames[1])
            if request_id is not None:
                kind = ErrorKind.TOO_LARGE if isinstance(exc, codec.MessageTooLargeError) else (
                    ErrorKind.BAD_REQUEST
                )
                self._send_client(identity, InferError(request_id, kind.value, str(exc)))
            return
        if type(msg) is InferRequest:
            self._on_infer(identity, msg)
        elif type(msg) is CancelRequest:
            self._on_cancel(identity, msg.request_id)
        elif type(msg) is StatsRequest:  # counters for a frontend started without supervisor
            self._send_client(identity, StatsReply(self.name, self.stats(msg.reset)))
        elif type(msg) is ClusterStatsRequest:  # and those of its peers (`zserve bench ADDR`)
            self._gather_stats(identity, msg.reset)
        elif type(msg) is ClientHello:
            if InferAnswers.KIND in msg.accepts:
                self._batched_clients.add(identity)
            else:
                self._batched_clients.discard(identity)
        elif type(msg) is Hello:
            pass
        else:
            self._malformed("client", ProtocolError(f"unexpected {type(msg).__name__}"))

    def _reject(self, identity: bytes, request_id: int, kind: ErrorKind, message: str) -> None:
        self.counters[_REJECTED_COUNTERS[kind]] += 1
        self._send_error(identity, request_id, kind, message)

    def _send_error(self, client: bytes, request_id: int, kind: ErrorKind, message: str) -> None:
        """Answer ``request_id`` of ``client`` with an error: in this tick's InferAnswers for a
        client that accepts it, else in an InferError of its own."""
        if client in self._batched_clients:
            answers = self._answers_to(client)
            answers.error_ids.append(request_id)
            answers.errors.append(_WIRE_ERRORS[kind])
            answers.messages.append(message)
        else:
            self._send_client(client, InferError(request_id, _WIRE_ERRORS[kind], message))

    def _on_infer(self, identity: bytes, req: InferRequest) -> None:
        self.counters["received"] += 1
        model = self.models.get(req.model)
        if model is None:
            self._reject(identity, req.request_id, ErrorKind.BAD_REQUEST,
                         f"unknown model {req.model!r}")
            return
        if self.draining:
            self._reject(identity, req.request_id, ErrorKind.SHUTTING_DOWN,
                         f"frontend {self.name} is shutting down")
            return
        client_reqs = self.by_client.get(identity)
        if client_reqs is not None and req.request_id in client_reqs:
            self._reject(identity, req.request_id, ErrorKind.BAD_REQUEST,
                         f"request id {req.request_id} is already in flight on this connection")
            return
        spec = model.request_spec
        if spec is None or not _matches_spec(req.inputs, spec):
            # Not the one form the model takes (or no such form is known): the full checks.
            nbytes = sum(int(a.nbytes) for a in req.inputs.values())
            if nbytes > self.max_request_bytes:
                self._reject(identity, req.request_id, ErrorKind.TOO_LARGE,
                             f"inputs of {nbytes} bytes exceed {self.max_request_bytes}")
                return
            if model.signature is not None:
                try:
                    model.signature.validate_request(req.inputs)
                except Exception as exc:
                    self._reject(identity, req.request_id, ErrorKind.BAD_REQUEST, str(exc))
                    return
        if not 0.0 <= req.slo_ms < math.inf:  # negative, infinite or NaN
            self._reject(identity, req.request_id, ErrorKind.BAD_REQUEST,
                         f"slo_ms must be >= 0, got {req.slo_ms}")
            return
        if self.shard_socks[model.shard] is None:
            self._reject(identity, req.request_id, ErrorKind.UNAVAILABLE,
                         f"scheduler shard {model.shard} is not reachable")
            return
        gpus = self.gpus_for_model.get(req.model, -1)
        if gpus == 0:
            self._reject(identity, req.request_id, ErrorKind.UNAVAILABLE,
                         f"no backend serves model {req.model!r}")
            return
        if model.pending >= model.max_queue:
            self._reject(identity, req.request_id, ErrorKind.OVERLOADED,
                         f"model {req.model!r}: {model.pending} requests queued "
                         f"(limit {model.max_queue})")
            return
        if gpus < 0:
            gpus = self.cluster.backends.total
        predicted_wait_s = model.pending / model.capacity_rps(gpus)
        if predicted_wait_s > model.wait_bound_s:
            self._reject(identity, req.request_id, ErrorKind.OVERLOADED,
                         f"model {req.model!r}: predicted wait {predicted_wait_s * 1e3:.1f} ms "
                         f"exceeds {model.wait_bound_s * 1e3:.1f} ms")
            return
        slo_s = model.slo_s
        if req.slo_ms > 0:
            slo_s = min(slo_s, req.slo_ms / 1e3)
        arrival = self.clock.now()
        answer_by = arrival + slo_s
        rid = self.next_rid
        self.next_rid += self.rid_stride
        pending = self.pending
        if not pending:
            self.idle.clear()
        client_rid = req.request_id
        pending[rid] = _Pending(rid, identity, client_rid, req.model, req.inputs, arrival,
                                answer_by)
        if client_reqs is None:
            client_reqs = self.by_client[identity] = {}
        client_reqs[client_rid] = rid
        model.pending += 1
        self.counters["admitted"] += 1
        self._push_timer(answer_by, rid)
        ids, models, arrivals, deadlines = self._meta[model.shard]
        ids.append(rid)
        models.append(req.model)
        arrivals.append(arrival)
        deadlines.append(answer_by - self.reply_allowance_s)
        if not self._flush_scheduled:
            self._schedule_flush()

    def _on_cancel(self, identity: bytes, client_rid: int) -> None:
        client_reqs = self.by_client.get(identity)
        if not client_reqs:
            return
        if client_rid < 0:  # cancel everything this connection has in flight (client close)
            for rid in list(client_reqs.values()):
                self._cancel(rid, answer=False)
            return
        target = client_reqs.get(client_rid)
        if target is not None:
            self._cancel(target, answer=True)

    def _cancel(self, rid: int, *, answer: bool) -> None:
        """Cancel a request that has not started; one that has runs on and is answered."""
        p = self.pending.get(rid)
        if p is None:
            return
        if p.state == _QUEUED:
            self.counters["cancelled"] += 1
        else:
            # Fetched: the backend drops it if its batch has not started; if it has, the
            # outputs come back for a request already answered and are discarded.
            self.counters["cancelled_fetched"] += 1
            self._note_cancel(p)
        if answer:
            self._answer_error(p, ErrorKind.CANCELLED, "cancelled by the client")
        else:
            p.client = None
            self._finish(p)

    def _on_monitor_event(self, frames: list[Any]) -> None:
        event = zmq.utils.monitor.parse_monitor_message([f.bytes for f in frames])
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        fd = event["value"]
        for identity in self._fd_clients.pop(fd, ()):
            if self._client_fd.get(identity) != fd:
                continue
            del self._client_fd[identity]
            self._client_gone(identity)

    def _client_gone(self, identity: bytes) -> None:
        self._batched_clients.discard(identity)
        client_reqs = self.by_client.get(identity)
        if not client_reqs:
            return
        self.counters["client_disconnects"] += 1
        for rid in list(client_reqs.values()):
            p = self.pending.get(rid)
            if p is None:
                continue
            if p.state == _QUEUED:
                self.counters["disconnect_cancelled"] += 1
            else:
                self.counters["disconnect_cancelled_fetched"] += 1
                self._note_cancel(p)
            p.client = None
            self._finish(p)
        self.by_client.pop(identity, None)

    def _note_cancel(self, p: _Pending) -> None:
        """Tell the backend that fetched ``p`` to leave it out (one message per backend per
        tick, sent from ``_flush_cancels``)."""
        plans, rids = self._cancel_notes.setdefault(p.backend, ([], []))
        plans.append(p.plan_id)
        rids.append(p.rid)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            if not self._in_callback:  # else the callback flushes when it ends
                self._loop.call_soon(self._flush_tick)

    def _flush_tick(self) -> None:
        """Send what a callback produced: the admitted requests' metadata (one message per
        shard), cancellation notes (one per backend) and the answers to batched clients (one
        per client); then look once for input on the sockets sent on."""
        if not self._flush_scheduled:
            return  # flushed already, at the end of a callback
        self._flush_scheduled = False
        if self._closed:
            return
        self._flush_meta()
        self._flush_cancels()
        self._flush_answers()
        self._recheck_sent()

    def _flush_cancels(self) -> None:
        notes, self._cancel_notes = self._cancel_notes, {}
        if self._closed or self.data_sock is None:
            return
        for backend, (plans, rids) in notes.items():
            frames: list[Any] = codec.encode(CancelFetched(plans, rids))
            frames.insert(0, backend.encode())
            try:
                self._send(self.data_sock, frames)
                self.counters["cancel_notices"] += 1
            except zmq.ZMQError as exc:  # the backend is gone: nothing of it will run
                self.counters["cancel_notice_failed"] += 1
                log.debug("%s: cannot tell %s to cancel %d requests: %s", self.name, backend,
                          len(rids), exc)

    # ------------------------------------------------------------------ answers

    def _send_client(self, identity: bytes, msg: Message, answers: int = 1) -> bool:
        """Send ``msg`` (carrying ``answers`` answers, for the counters) to a client."""
        assert self.client_sock is not None
        frames: list[Any] = codec.encode(msg)
        frames.insert(0, identity)
        try:
            self._send(self.client_sock, frames)
        except zmq.Again:
            self.counters["reply_dropped_hwm"] += answers
            return False
        except zmq.ZMQError as exc:
            self.counters["reply_unroutable"] += answers
            log.debug("%s: reply to a gone client: %s", self.name, exc)
            self._client_gone(identity)
            return False
        return True

    def _answers_to(self, client: bytes) -> _Answers:
        """This tick's answers to ``client`` (a client that decodes InferAnswers)."""
        answers = self._answers.get(client)
        if answers is None:
            answers = self._answers[client] = _Answers()
            self._schedule_flush()
        return answers

    def _flush_answers(self) -> None:
        """Send each client the answers of this tick in one InferAnswers."""
        pending, self._answers = self._answers, {}
        if self._closed or self.client_sock is None or not pending:
            return
        for client, answers in pending.items():
            msg = InferAnswers(answers.request_ids, answers.outputs, answers.error_ids,
                               answers.errors, answers.messages)
            try:
                self._send_client(client, msg, len(answers))
            except Exception:  # one client's answers that cannot be sent must not stop the rest
                self.counters["handler_errors"] += 1
                log.exception("%s: cannot answer %d requests", self.name, len(answers))

    def _finish(self, p: _Pending) -> None:
        """Forget a request: release its inputs and every index entry."""
        del self.pending[p.rid]
        p.inputs = None
        model = self.models[p.model]
        model.pending -= 1
        if p.state == _FETCHED:
            fetched = self.fetched_by.get(p.backend)
            if fetched is not None:
                fetched.discard(p.rid)
        client_reqs = self.by_client.get(p.owner)
        if client_reqs is not None and client_reqs.get(p.client_rid) == p.rid:
            del client_reqs[p.client_rid]
            if not client_reqs:
                del self.by_client[p.owner]
        if not self.pending:
            self.idle.set()

    def _answer_error(self, p: _Pending, kind: ErrorKind, message: str) -> None:
        client = p.client
        self._finish(p)
        self.counters[_ERROR_COUNTERS[kind]] += 1
        if client is not None:
            self._send_error(client, p.client_rid, kind, message)
            self._answer_hop.append(self.clock.now() - p.arrival)

    def _answer_outputs(self, p: _Pending, outputs: dict[str, Any], now: float) -> None:
        client = p.client
        self._finish(p)
        self.counters["replied"] += 1
        if client is not None:
            if client in self._batched_clients:
                answers = self._answers_to(client)
                answers.request_ids.append(p.client_rid)
                answers.outputs.append(outputs)
            else:
                self._send_client(client, InferReply(p.client_rid, outputs))
            self._answer_hop.append(now - p.arrival)

    # ------------------------------------------------------------------ scheduler

    def _flush_meta(self) -> None:
        data_address = self.endpoints["data"]
        for shard, (ids, models, arrivals, deadlines) in enumerate(self._meta):
            if not ids:
                continue
            self._meta[shard] = ([], [], [], [])
            sock = self.shard_socks[shard]
            msg = RequestMetaBatch(data_address, ids, models, arrivals, deadlines)
            try:
                assert sock is not None
                self._send(sock, codec.encode(msg))
                self.counters["meta_batches"] += 1
            except (zmq.ZMQError, AssertionError) as exc:
                self.counters["meta_send_failed"] += 1
                for rid in ids:
                    p = self.pending.get(rid)
                    if p is not None:
                        self._answer_error(p, ErrorKind.UNAVAILABLE,
                                           f"scheduler shard {shard} is not accepting: {exc}")

    def _on_shard(self, frames: list[Any]) -> None:
        try:
            msg = codec.decode(frames)
        except ProtocolError as exc:
            self._malformed("shard", exc)
            return
        if type(msg) is DropNotice:
            kind = _error_kind(msg.error)
            for rid in msg.request_ids:
                p = self.pending.get(rid)
                if p is not None:
                    self.counters["dropped_by_scheduler"] += 1
                    self._answer_error(p, kind, msg.message)
        elif type(msg) is BackendTable:
            self._on_backend_table(msg)
        elif type(msg) is StatsReply:
            self._on_peer_stats(msg)
        else:
            self.counters["ignored"] += 1

    def _on_rank(self, frames: list[Any]) -> None:
        try:
            msg = codec.decode(frames)
        except ProtocolError as exc:
            self._malformed("rank", exc)
            return
        if type(msg) is BackendTable:
            self._on_backend_table(msg)
        elif type(msg) is DropNotice:
            self._on_shard(frames)
        elif type(msg) is StatsReply:
            self._on_peer_stats(msg)
        else:
            self.counters["ignored"] += 1

    def _on_backend_table(self, msg: BackendTable) -> None:
        table = dict(zip(msg.names, msg.models, strict=False))
        previous = self.backend_models or {}
        self.backend_models = table
        for name in previous:
            if name not in table:
                self._backend_failed(name, "backend left the cluster")
        counts: dict[str, int] = dict.fromkeys(self.models, 0)
        for models in table.values():
            for model in models:
                if model in counts:
                    counts[model] += 1
        self.gpus_for_model = counts
        # Models without a configured profile use the one their backends measured.
        for profiles in msg.profiles_ms:
            for model, table_ms in profiles.items():
                state = self.models.get(model)
                if state is not None and state.profile is None and table_ms:
                    from zserve.profiles import LatencyProfile

                    with contextlib.suppress(ValueError):
                        state.profile = LatencyProfile.from_table_ms(table_ms)

    def _backend_failed(self, backend: str, why: str) -> None:
        rids = self.fetched_by.pop(backend, set())
        for rid in list(rids):
            p = self.pending.get(rid)
            if p is not None and p.state == _FETCHED and p.backend == backend:
                self._answer_error(p, ErrorKind.BACKEND_FAILED, f"{backend}: {why}")

    # ------------------------------------------------------------------ backends

    def _on_data(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._malformed("data", ProtocolError("no header frame"))
            return
        identity = frames[0].bytes
        try:
            msg = codec.decode(frames[1:])
        except ProtocolError as exc:
            self._malformed("data", exc)
            return
        if type(msg) is InputFetch:
            self._on_fetch(identity, msg)
        elif type(msg) is BatchOutputs:
            self._on_outputs(msg)
        elif type(msg) is BatchFailed:
            self._on_batch_failed(msg)
        elif type(msg) is Hello:
            self._on_backend_hello(msg)
        elif type(msg) is StatsReply:
            self._on_peer_stats(msg)
        else:
            self._malformed("data", ProtocolError(f"unexpected {type(msg).__name__}"))

    def on_control_message(self, msg: Message) -> None:
        """The supervisor says a backend's process died (``BackendGone``): the requests that
        backend had fetched are answered ``BACKEND_FAILED`` now, not at their deadline."""
        if type(msg) is BackendGone:
            # Recorded as pid 0, a process that no Hello can have: its next Hello is a restart.
            self._on_backend_hello(Hello(role="backend", name=msg.name, pid=0))
            self._recheck_sent()  # answers were sent from outside the socket callbacks

    def _on_backend_hello(self, msg: Hello) -> None:
        previous = self.backend_pids.get(msg.name)
        self.backend_pids[msg.name] = msg.pid
        if previous is not None and previous != msg.pid:
            self._backend_failed(msg.name, "backend restarted")

    def _on_fetch(self, identity: bytes, msg: InputFetch) -> None:
        backend = identity.decode(errors="replace")
        now = self.clock.now()
        ids: list[int] = []
        inputs: list[dict[str, Any]] = []
        missing: list[int] = []
        fetched = self.fetched_by.setdefault(backend, set())
        hop = self.hops["admit_to_fetch"].samples
        for rid in msg.request_ids:
            p = self.pending.get(rid)
            if p is None or p.state != _QUEUED or p.inputs is None or p.client is None:
                missing.append(rid)
                continue
            ids.append(rid)
            inputs.append(p.inputs)
            p.inputs = None  # the backend has them now; the send below holds the frames
            p.state = _FETCHED
            p.backend = backend
            p.fetched_at = now
            p.plan_id = msg.plan_id
            fetched.add(rid)
            hop.append(now - p.arrival)
        reply = InputReply(msg.plan_id, ids, inputs, missing)
        frames: list[Any] = codec.encode(reply)
        frames.insert(0, identity)
        assert self.data_sock is not None
        try:
            self._send(self.data_sock, frames)
        except zmq.ZMQError as exc:
            self.counters["fetch_reply_failed"] += 1
            for rid in ids:
                p = self.pending.get(rid)
                if p is not None:
                    self._answer_error(p, ErrorKind.BACKEND_FAILED,
                                       f"cannot send inputs to {backend}: {exc}")
        self.counters["fetches"] += 1
        self.counters["fetch_missing"] += len(missing)

    def _on_outputs(self, msg: BatchOutputs) -> None:
        now = self.clock.now()
        hop = self.hops["fetch_to_outputs"].samples
        started_at = msg.started_at
        queueing = self.hops["queueing"].samples
        # overhead (answer - admission - execution) only for batches that reported both times
        overhead = None
        execution = 0.0
        if started_at > 0.0 and msg.finished_at >= started_at:
            execution = msg.finished_at - started_at
            self.hops["execution"].samples.append(execution)
            self.hops["finish_to_answer"].samples.append(now - msg.finished_at)
            overhead = self.hops["overhead"].samples
        for rid, outputs in zip(msg.request_ids, msg.outputs, strict=False):
            p = self.pending.get(rid)
            if p is None:  # answered already (cancelled, deadline): the outputs are discarded
                self.counters["late_outputs"] += 1
                continue
            if p.fetched_at:
                hop.append(now - p.fetched_at)
            if started_at > 0.0:
                delay = started_at - p.arrival
                queueing.append(delay)
                if overhead is not None:
                    overhead.append(now - p.arrival - execution)
                by_model = self.queueing_by_model.get(p.model)
                if by_model is not None:
                    by_model.samples.append(delay)
            self._answer_outputs(p, outputs, now)

    def _on_batch_failed(self, msg: BatchFailed) -> None:
        kind = _error_kind(msg.error)
        for rid in msg.request_ids:
            p = self.pending.get(rid)
            if p is not None:
                self._answer_error(p, kind, msg.message)

    # ------------------------------------------------------------------ deadline timers

    def _push_timer(self, at: float, rid: int) -> None:
        heapq.heappush(self._timers, (at, rid))
        if at < self._timer_at:
            self._arm_timer(at)

    def _arm_timer(self, at: float) -> None:
        if self._timer_handle is not None:
            self._timer_handle.cancel()
        assert self._loop is not None
        self._timer_at = at
        # A relative delay on the loop's (local) clock: the cluster time needs no conversion.
        self._timer_handle = self._loop.call_later(max(0.0, at - self.clock.now()),
                                                   self._on_timer)

    def _on_timer(self) -> None:
        self._timer_handle = None
        self._timer_at = math.inf
        now = self.clock.now() + TIMER_SLACK_S
        timers = self._timers
        pending = self.pending
        self._in_callback = True
        try:
            while timers and timers[0][0] <= now:
                at, rid = heapq.heappop(timers)
                p = pending.get(rid)
                if p is not None and p.answer_by == at:
                    self.counters["deadline_timer"] += 1
                    where = "running on " + p.backend if p.state == _FETCHED else "queued"
                    self._answer_error(p, ErrorKind.DEADLINE,
                                       f"no answer within the SLO (request was {where})")
        finally:
            self._in_callback = False
        # Lazy deletion: entries of answered requests stay in the heap. Drop the ones on top, so
        # that the timer is armed for a request still pending: most requests are answered well
        # before their deadline, and without this the timer would fire once for each of them.
        while timers:
            at, rid = timers[0]
            p = pending.get(rid)
            if p is not None and p.answer_by == at:
                break
            heapq.heappop(timers)
        # Compact when the heap is mostly stale so it stays proportional to the pending requests.
        if len(timers) > 1024 and len(timers) > 4 * len(pending):
            self._timers = [(p.answer_by, p.rid) for p in pending.values()]
            heapq.heapify(self._timers)
            timers = self._timers
        if timers:
            self._arm_timer(timers[0][0])
        self._end_callback(False)

    # ------------------------------------------------------------------ cluster stats

    def _gather_stats(self, client: bytes, reset: bool) -> None:
        """Answer ``client`` with this frontend's stats and, under ``cluster``, those of every
        shard, the rank and every backend it knows, asked now (with ``reset``). A request that
        comes while a round is open joins it (that round's peers reset once, if the first
        asked to)."""
        own = self.stats(reset)
        gathering = self._gathering
        if gathering is None:
            gathering = self._gathering = _StatsGathering(self._ask_peers(reset))
            assert self._loop is not None
            gathering.handle = self._loop.call_later(PEER_STATS_TIMEOUT_S, self._stats_gathered)
        gathering.waiters.append((client, own))
        if not gathering.waiting:
            self._stats_gathered()

    def _ask_peers(self, reset: bool) -> set[str]:
        """Send StatsRequest to every peer; the names of those it reached."""
        request = codec.encode(StatsRequest(reset=reset))
        asked: set[str] = set()
        for index, sock in enumerate(self.shard_socks):
            if sock is not None and self._try_send(sock, list(request)):
                asked.add(f"shard-{index}")
        if self.rank_sock is not None and not self._rank_embedded and self._try_send(
            self.rank_sock, list(request)
        ):
            asked.add("rank")
        backends = set(self.backend_models or {}) | {
            name for name, pid in self.backend_pids.items() if pid
        }
        for name in sorted(backends):
            assert self.data_sock is not None
            if self._try_send(self.data_sock, [name.encode(), *request]):
                asked.add(name)
        return asked

    def _try_send(self, sock: zmq.Socket[Any], frames: list[Any]) -> bool:
        try:
            self._send(sock, frames)
        except zmq.ZMQError:
            return False  # not connected (a backend that never fetched), or its queue is full
        return True

    def _on_peer_stats(self, msg: StatsReply) -> None:
        gathering = self._gathering
        if gathering is None or msg.name not in gathering.waiting:
            self.counters["late_peer_stats"] += 1
            return
        gathering.waiting.discard(msg.name)
        gathering.replies[msg.name] = msg.stats
        if not gathering.waiting:
            self._stats_gathered()

    def _stats_gathered(self) -> None:
        gathering, self._gathering = self._gathering, None
        if gathering is None or self._closed:
            return
        if gathering.handle is not None:
            gathering.handle.cancel()
        silent = sorted(gathering.waiting)
        for client, own in gathering.waiters:
            stats = {**own, "cluster": gathering.replies, "cluster_silent": silent}
            self._send_client(client, StatsReply(self.name, stats))
        self._recheck_sent()

    # ------------------------------------------------------------------ drain and stats

    def answer_all(self, kind: ErrorKind, message: str) -> None:
        for p in list(self.pending.values()):
            self._answer_error(p, kind, message)

    def stats(self, reset: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "pending": len(self.pending),
            "draining": self.draining,
            "clients": len(self.by_client),
            "backends": sorted(self.backend_models or {}),
            "fetched_by": {name: len(ids) for name, ids in self.fetched_by.items() if ids},
            "counters": dict(self.counters),
            "hops": {name: hop.summary() for name, hop in self.hops.items()},
            "queueing_by_model": {
                name: hop.summary() for name, hop in self.queueing_by_model.items()
            },
            "models": {name: m.pending for name, m in self.models.items()},
            "clock": self.clock.stats(),
        }
        if reset:
            self.counters.clear()
            for hop in (*self.hops.values(), *self.queueing_by_model.values()):
                hop.samples.clear()
        return out


def _error_kind(value: str) -> ErrorKind:
    return _ERROR_KINDS.get(value, ErrorKind.INTERNAL)


def _recover_request_id(header: Any) -> int | None:
    """The request id of a malformed client message, if its header still names one."""
    try:
        data = header.bytes if isinstance(header, zmq.Frame) else bytes(header)
        if len(data) > 4096:
            data = data[:4096]
        unpacker = msgpack.Unpacker(max_buffer_size=8192, raw=False, strict_map_key=False)
        unpacker.feed(data)
        size = unpacker.read_array_header()
        if size < 2:
            return None
        unpacker.skip()
        value = unpacker.unpack()
    except Exception:
        return None
    return value if type(value) is int else None


# --------------------------------------------------------------------------- process entry


async def _serve(config: RoleConfig, control_address: str | None) -> int:
    loop = asyncio.get_running_loop()
    ctx: zmq.Context[Any] = zmq.Context()
    actx = zmq.asyncio.Context.shadow(ctx)
    frontend = Frontend(config, ctx)
    control = await control_link.ControlLink.open(
        actx,
        control_address,
        role="frontend",
        name=frontend.name,
        stats=frontend.stats,
        drain_s=frontend.cluster.drain_s,
        peers=config.peers,
        on_message=frontend.on_control_message,
    )
    clock_sync: ClockSync | None = None
    try:
        endpoints = frontend.bind()
        log.info("%s: clients connect to %s", frontend.name, endpoints["client"])
        peers = await control.ready(endpoints)
        # Arrivals and deadlines are stamped on the cluster clock: estimate it before admitting.
        clock_sync = await role_runner.sync_cluster_clock(actx, peers, name=frontend.name,
                                                       drain=control.drain, clock=frontend.clock)
        if clock_sync is None:
            return 0 if control.drain.requested else 2
        frontend.connect(peers)
        frontend.start(loop)
        await control.drain.wait()
        frontend.draining = True
        drain_s = control.drain.drain_s
        log.info("%s: draining (%s), %d in flight, up to %.1f s", frontend.name,
                 control.drain.reason, len(frontend.pending), drain_s)
        await control.drain.grace(frontend.idle)
        frontend.answer_all(ErrorKind.SHUTTING_DOWN, f"frontend {frontend.name} shut down")
        log.info("%s: stopped; counters %s", frontend.name, dict(frontend.counters))
    finally:
        if clock_sync is not None:
            await clock_sync.close()
        frontend.close()
        await control.close()
        ctx.term()
    return 0


def run_frontend(config: RoleConfig, control_address: str | None) -> int:
    """Process entry point (docs/runtime.md)."""
    return role_runner.run_role(_serve(config, control_address), name=config.name)


def main(argv: list[str]) -> int:
    """``zserve frontend --config CLUSTER.toml --index N``: run one frontend on its own; its
    peers' addresses come from the file, overridden by the flags."""
    parser = argparse.ArgumentParser(prog="zserve frontend", description=main.__doc__)
    parser.add_argument("--config", required=True, help="cluster.toml")
    parser.add_argument("--index", type=int, default=0, help="which frontend (default 0)")
    parser.add_argument("--control", default=None, help="supervisor control address")
    parser.add_argument("--ipc-dir", default=None, help="folder of ipc:// endpoints")
    parser.add_argument("--client", help="bind the client socket here")
    parser.add_argument("--data", help="bind the data socket here")
    parser.add_argument("--rank", help="the rank's address")
    parser.add_argument("--shard", action="append", default=[],
                        help="a scheduler shard's address, in shard order (repeat)")
    parser.add_argument("--advertise", default=None, metavar="HOST",
                        help="host name peers use for a socket bound to a wildcard (0.0.0.0) "
                             "address (default: this machine's host name)")
    args = parser.parse_args(argv)
    cluster = load_config(args.config)
    ipc_dir = args.ipc_dir or cluster.ipc_dir
    config = role_config(cluster, "frontend", args.index, ipc_dir=ipc_dir,
                         peers=cluster.static_peers(ipc_dir), advertise_host=args.advertise)
    if args.client:
        config.bind["client"] = args.client
    if args.data:
        config.bind["data"] = args.data
    if args.rank:
        config.peers[peer_map.peer_key("rank", "rank")] = args.rank
    for index, address in enumerate(args.shard):
        config.peers[peer_map.peer_key(f"shard-{index}", "shard")] = address
    return run_frontend(config, args.control)
