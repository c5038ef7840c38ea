"""The embeddable client: ``zserve.AsyncClient``, and what ``zserve.Client`` (sync, thread-safe,
``zserve/client/sync_client.py``) builds on.

::

    with zserve.Client("ipc:///tmp/zs-x/frontend-0.client") as client:
        outputs = client.infer("cnn", {"input": image[None]}, timeout=1.0)   # dict of arrays

    async with zserve.AsyncClient(address) as client:
        outputs = await client.infer("cnn", {"input": image[None]})
        future = client.submit("cnn", {"input": image[None]})   # send now, await later
        client.cancel(future)

One connection (a DEALER) carries any number of requests in flight; replies are matched to
requests by a per-connection id. A request's inputs are ``{input name: array}`` with a leading
dimension of n rows, the same in every input (1 <= n <= the model's max batch; a request is
never split across batches), and its outputs have the same n rows; numpy arrays, CPU or CUDA
torch tensors and CuPy arrays are accepted (device arrays are staged to host once, by the
codec). Outputs are read-only numpy arrays over the received frames (no copy); ``np.array(x)``
makes a writable one.

Errors are typed (``zserve.core.errors``): every terminal answer the frontend sends becomes its
``ZServeError`` subclass. ``infer`` retries automatically only when the error proves the request
never ran and the condition is transient (``OVERLOADED``, ``UNAVAILABLE``), with full-jitter
exponential backoff, at most ``max_retries`` times and never past the call's timeout. A call that
gets no answer within its timeout raises ``DeadlineError`` (and cancels the request at the
frontend); a lost connection to the frontend raises ``ConnectionLostError``.

No future is ever left pending: ``submit`` futures carry the client's timeout too
(``DEFAULT_TIMEOUT_S``, ``DeadlineError``), and the connection's state is read from a ZMQ socket
monitor on the DEALER (handshake succeeded / disconnected). A request sent while the connection is
down waits in the socket's queue; when the connection has been down for
``CONNECTION_DOWN_BOUND_S`` those requests get ``UnavailableError`` (never ran, retryable) and the
socket is replaced, discarding them, so they cannot run later. Until the connection is up again,
new requests get ``UnavailableError`` at once, so a client of an address where nothing listens says
so within about ``CONNECTION_DOWN_BOUND_S``. An address that cannot be connected to (bad scheme,
garbage, an unresolvable host) raises ``ValueError`` at construction; a request after ``close()``
raises ``ClientClosedError``.

A frontend whose client socket is on tcp with CURVE (docs/security.md) is reached with keys:
``AsyncClient(address, server_key="keys/frontend.key", client_key="keys/client.key_secret")``
(each a key file's path, or the server's 40-character Z85 key and a (public, secret) pair). A
client without keys, or with a key the frontend does not list, gets nothing delivered: its
handshake fails, so it sees ``UnavailableError`` after ``CONNECTION_DOWN_BOUND_S``, as with an
address where nothing listens. On ipc:// the keys are not used.

Nothing happens at import time: the socket is created on first use, and ``Client`` starts its
one I/O thread then.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import random
import socket
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import numpy as np
import zmq
import zmq.utils.monitor

from zserve.core.errors import (
    DeadlineError,
    OverloadedError,
    TooLargeError,
    UnavailableError,
    ZServeError,
    error_from_wire,
)
from zserve.core.timer_heap import LazyTimerHeap
from zserve.runtime.keys import client_curve
from zserve.transport import codec, socket_io
from zserve.transport.messages import (
    CancelRequest,
    ClientHello,
    InferAnswers,
    InferError,
    InferReply,
    InferRequest,
)
from zserve.transport.reactor import Chunk, SocketReactor
from zserve.transport.sockets import MAX_FRAME_BYTES, make_monitored_dealer

Outputs = dict[str, np.ndarray[Any, Any]]

# Every call and every submitted future ends by this time at the latest (DeadlineError), so a
# frontend that never answers cannot leave a caller waiting forever.
DEFAULT_TIMEOUT_S = 60.0
# How long the connection may be down (never up yet, or lost) before the requests waiting in the
# socket's queue are answered UNAVAILABLE and new ones fail at once. Ten of the DEALER's first
# reconnect intervals (100 ms): a live peer's reconnect fits well inside it, yet a dead address is
# reported within the "second or two" that tells it from a hang; no SLO is this long anyway.
CONNECTION_DOWN_BOUND_S = 1.0
_CONNECTION_UP = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
DEFAULT_MAX_RETRIES = 3
DEFAULT_BACKOFF_S = 0.005
DEFAULT_BACKOFF_MAX_S = 0.25
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_ADDRESS_SCHEMES = ("tcp", "ipc", "inproc")
# What this client tells the frontend it decodes: answers coalesced per event-loop tick.
_HELLO = codec.encode(ClientHello(accepts=[InferAnswers.KIND]))
# CancelRequest id that cancels every request of the connection (sent by close()).
CANCEL_ALL = -1
_CLOSE_LINGER_MS = 200


class ConnectionLostError(UnavailableError):
    """The connection to the frontend broke while the request was in flight. Unlike a plain
    ``UNAVAILABLE`` answer, the request may have run, so it is never retried automatically."""

    @property
    def may_have_run(self) -> bool:
        return True

    @property
    def retryable(self) -> bool:
        return False


class ClientClosedError(RuntimeError):
    """A request or a cancel on a client after its ``close()``."""


def check_address(address: str) -> str:
    """``address`` if a DEALER can connect to it; else a one-line ``ValueError`` naming it. A tcp
    host is resolved here, so a typo fails now rather than as a silent reconnect loop."""
    scheme, sep, rest = address.partition("://") if isinstance(address, str) else ("", "", "")
    if not sep or scheme not in _ADDRESS_SCHEMES or not rest:
        raise ValueError(
            f"invalid zserve address {address!r}: expected tcp://HOST:PORT, ipc://PATH or "
            "inproc://NAME"
        )
    if scheme != "tcp":
        return address
    host, colon, port = rest.rpartition(";")[2].rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid zserve address {address!r}: expected tcp://HOST:PORT")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"invalid zserve address {address!r}: cannot resolve {host!r} "
                         f"({exc})") from None
    return address


def to_host_array(value: Any) -> Any:
    """numpy arrays pass through; torch tensors become numpy views (CUDA ones are copied to host
    once); CuPy arrays pass through (the codec stages them); anything else goes to np.asarray."""
    if isinstance(value, np.ndarray):
        return value
    module = type(value).__module__
    if module.startswith("torch"):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return tensor.numpy()
    if module.startswith("cupy"):
        return value
    return np.asarray(value)


def _inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    if type(inputs) is dict and all(
        type(name) is str and type(value) is np.ndarray for name, value in inputs.items()
    ):
        return inputs  # the common case, as is: no conversion to make
    if not isinstance(inputs, Mapping):
        raise TypeError(f"inputs must be a mapping of input name to array, got {type(inputs)}")
    return {str(name): to_host_array(value) for name, value in inputs.items()}


def _oversized_input(inputs: Mapping[str, Any]) -> TooLargeError | None:
    """The error for an input whose frame no frontend would take (``MAX_FRAME_BYTES``: ZeroMQ
    drops the connection on such a frame, and the request would wait out its timeout), else
    None."""
    for name, array in inputs.items():
        nbytes = getattr(array, "nbytes", 0)
        if nbytes > MAX_FRAME_BYTES:
            return TooLargeError(
                f"input {name!r} is {nbytes} bytes, over the {MAX_FRAME_BYTES}-byte frame limit "
                "of a zserve connection: the request was not sent")
    return None


class AsyncClient:
    """An asyncio client of one frontend. Use it from one event loop (the one that first uses
    it). ``submit`` sends at once and returns a future (one attempt, no retry): an open-loop
    load generator sends on schedule without awaiting replies."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
        seed: int | None = None,
        ctx: zmq.Context[Any] | None = None,
        server_key: str | bytes | os.PathLike[str] | None = None,
        client_key: str | os.PathLike[str] | tuple[bytes, bytes] | None = None,
    ) -> None:
        self.address = check_address(address)
        if (server_key is None) != (client_key is None):
            raise ValueError("CURVE needs both server_key and client_key (or neither)")
        # Read now: a missing or shared key file is an error at construction, not a hang.
        self._curve = None if server_key is None or client_key is None else client_curve(
            server_key, client_key)
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._rng = random.Random(seed)
        self._ctx = ctx
        self._own_ctx = ctx is None
        self._sock: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future[Outputs]] = {}
        self._reactor: SocketReactor | None = None
        self._closed = False
        # Connection state, from the socket monitor: down since when (monotonic s), None if up.
        self._down_since: float | None = None
        # Requests sent while the connection was down: still in the socket's queue, never sent.
        self._unsent: set[int] = set()
        self._down_timer: asyncio.TimerHandle | None = None
        # Client timeouts of requests in flight: (request id, timeout s) at their deadline
        # (monotonic s), in one heap behind one loop timer (a loop timer per request would
        # triple the cost of a submit); an answered request's entry is dropped lazily.
        self._expiries: LazyTimerHeap[tuple[int, float]] = LazyTimerHeap(self._expiry_is_live)
        self._expiry_timer: asyncio.TimerHandle | None = None
        self._expiry_timer_at = math.inf
        self.retries = 0  # automatic retries made (for reports)
        # Answers that matched no request in flight: late answers to requests this client gave
        # up on (timeout, cancel), or a frontend bug (a second answer to one request).
        self.unmatched_replies = 0

    # ------------------------------------------------------------------ connection

    def _ensure(self) -> zmq.Socket[Any]:
        if self._closed:
            raise ClientClosedError(f"the zserve client of {self.address} is closed")
        if self._sock is not None:
            return self._sock
        self._loop = asyncio.get_running_loop()
        if self._ctx is None:
            self._ctx = zmq.Context()
        # Replies arrive through the reactor every zserve process receives with (an undecodable
        # one cannot be matched to its request: on_bad drops it, its timeout answers it).
        self._reactor = SocketReactor(self._loop)
        self._connection_down(time.monotonic())
        return self._open_socket()

    def _open_socket(self) -> zmq.Socket[Any]:
        assert self._ctx is not None and self._reactor is not None
        identity = b"c" + os.urandom(8).hex().encode()
        # The monitor is attached before the socket connects, so the connection's first
        # handshake is always seen (attached after, a loaded host's scheduling could hide it and
        # leave the client taking a live frontend for a dead one). Its endpoint is named after
        # the identity: pyzmq's default names it after the file descriptor, which a replacement
        # socket may reuse while the old endpoint lingers.
        made: tuple[zmq.Socket[Any], zmq.Socket[Any]] = make_monitored_dealer(
            self._ctx, self.address, identity=identity, curve=self._curve,
            monitor_events=_CONNECTION_UP | _DISCONNECTED,
            monitor_addr=f"inproc://zserve-client-monitor-{identity.decode()}",
        )
        sock, self._monitor = made
        # First on the connection (a DEALER keeps order): the answer forms this client decodes.
        # A fresh socket's queue is empty, so this cannot meet the HWM.
        socket_io.send_frames_nowait(sock, list(_HELLO))
        self._sock = sock
        self._reactor.watch(sock, router=False, on_chunk=self._on_replies)
        self._reactor.watch_frames(self._monitor, on_frames=self._on_monitor_events)
        return sock

    def _close_socket(self, linger_ms: int) -> None:
        sock, monitor = self._sock, self._monitor
        if sock is None or monitor is None:
            return
        assert self._reactor is not None
        self._reactor.unwatch(sock)
        self._reactor.unwatch(monitor)
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=linger_ms)
        self._sock = self._monitor = None

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    @property
    def connected(self) -> bool:
        """Whether the connection to the frontend is up (as the socket monitor last said)."""
        return self._sock is not None and self._down_since is None

    async def close(self) -> None:
        """Cancel what is in flight at the frontend and close the connection."""
        if self._closed:
            return
        self._closed = True
        for request_id in self._unsent & self._futures.keys():  # in the discarded queue
            self._fail(request_id, UnavailableError("client closed before sending the request"))
        if self._sock is not None and self._futures:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send_multipart(codec.encode(CancelRequest(CANCEL_ALL)), zmq.NOBLOCK)
        self._close_socket(_CLOSE_LINGER_MS)
        if self._reactor is not None:
            self._reactor.close()
        for timer in (self._down_timer, self._expiry_timer):
            if timer is not None:
                timer.cancel()
        for future in self._futures.values():
            if not future.done():
                future.set_exception(ConnectionLostError("client closed"))
        self._futures.clear()
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        slo_ms: float = 0.0,
        timeout: float | None = None,
    ) -> asyncio.Future[Outputs]:
        """Send one request now; the future resolves to its outputs or raises its typed error
        (``DeadlineError`` after ``timeout`` seconds, default the client's). ``slo_ms`` (0: the
        model's SLO) may only tighten the model's SLO."""
        timeout = self.timeout if timeout is None else timeout
        sock = self._ensure()
        assert self._loop is not None and self._reactor is not None
        future: asyncio.Future[Outputs] = self._loop.create_future()
        prepared = _inputs(inputs)
        oversized = _oversized_input(prepared)
        if oversized is not None:
            future.set_exception(oversized)
            return future
        if self._down_for_too_long():
            self._drain_monitor()  # it may be up again, its event not read yet
            if self._down_for_too_long():
                future.set_exception(self._unavailable())
                return future
        request_id = next(self._ids)
        frames = codec.encode(InferRequest(request_id, model, prepared, float(slo_ms)))
        error = self._reactor.send_frames(sock, frames)
        if isinstance(error, zmq.Again):
            future.set_exception(OverloadedError("client send queue is full"))
            return future
        if error is not None:
            raise error
        self._futures[request_id] = future
        future.request_id = request_id  # type: ignore[attr-defined]
        if self._down_since is not None:
            self._unsent.add(request_id)
        if timeout is not None:
            self._expire_at(time.monotonic() + timeout, request_id, timeout)
        return future

    def cancel(self, future: asyncio.Future[Outputs]) -> bool:
        """Ask the frontend to cancel a submitted request: it is answered ``CancelledError``
        (a batch that already started runs, and its output is discarded). False if it is no
        longer in flight."""
        request_id = getattr(future, "request_id", None)
        if request_id is None or request_id not in self._futures or self._sock is None:
            return False
        assert self._reactor is not None
        self._reactor.send_nowait(self._sock, CancelRequest(request_id))  # an error: nothing to do
        return True

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        timeout: float | None = None,
        slo_ms: float = 0.0,
        max_retries: int | None = None,
    ) -> Outputs:
        """Run ``model`` on ``inputs`` and return its outputs; raises a typed ``ZServeError``.
        ``timeout`` (seconds; default the client's) bounds the whole call, retries included."""
        timeout = self.timeout if timeout is None else timeout
        retries_left = self.max_retries if max_retries is None else max_retries
        end = None if timeout is None else time.monotonic() + timeout
        prepared = _inputs(inputs)
        attempt = 0
        while True:
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineError(f"no answer within the client timeout of {timeout} s")
            attempt_slo = slo_ms
            if remaining is not None:
                # The server need not work for longer than the caller will wait.
                attempt_slo = min(slo_ms or float("inf"), remaining * 1e3)
            future = self.submit(model, prepared, slo_ms=attempt_slo, timeout=remaining)
            try:
                return await future
            except asyncio.CancelledError:
                self.cancel(future)  # the caller gave up: do not run it if it has not started
                self._forget(future)
                raise
            except ZServeError as exc:
                if not exc.retryable or retries_left <= 0:
                    raise
                retries_left -= 1
                attempt += 1
                self.retries += 1
                delay = self._rng.uniform(0, min(self.backoff_max_s, self.backoff_s * 2**attempt))
                if end is not None and time.monotonic() + delay >= end:
                    raise
                await asyncio.sleep(delay)

    def _expire_at(self, when: float, request_id: int, timeout: float) -> None:
        expiries = self._expiries
        expiries.push(when, (request_id, timeout))
        # Entries of answered requests leave only at their deadline: bound them by the live ones.
        expiries.compact_if(len(self._futures), factor=2.0, minimum=4096)
        if when < self._expiry_timer_at:
            self._arm_expiry_timer(when)

    def _arm_expiry_timer(self, when: float) -> None:
        assert self._loop is not None
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
        self._expiry_timer_at = when
        self._expiry_timer = self._loop.call_later(
            max(0.0, when - time.monotonic()), self._on_expiry_timer
        )

    def _expiry_is_live(self, _when: float, entry: tuple[int, float]) -> bool:
        return entry[0] in self._futures

    def _on_expiry_timer(self) -> None:
        self._expiry_timer, self._expiry_timer_at = None, math.inf
        now = time.monotonic()
        while (entry := self._expiries.pop_due(now)) is not None:
            request_id, timeout = entry
            future = self._futures[request_id]
            self.cancel(future)  # tell the frontend, so it does not run a request nobody awaits
            self._fail(request_id, DeadlineError(
                f"no answer within the client timeout of {timeout} s"))
        next_at = self._expiries.next_at()
        if next_at < math.inf and not self._closed:
            self._arm_expiry_timer(next_at)

    def _forget(self, future: asyncio.Future[Outputs]) -> None:
        request_id = getattr(future, "request_id", None)
        if request_id is not None:
            self._futures.pop(request_id, None)
            self._unsent.discard(request_id)

    # ------------------------------------------------------------------ connection state

    def _down_for_too_long(self) -> bool:
        down_since = self._down_since
        return down_since is not None and time.monotonic() - down_since >= CONNECTION_DOWN_BOUND_S

    def _unavailable(self) -> UnavailableError:
        return UnavailableError(
            f"no connection to the frontend {self.address} for {CONNECTION_DOWN_BOUND_S} s "
            "(nothing listens there, or it is down): the request was not sent"
        )

    def _connection_down(self, since: float) -> None:
        self._down_since = since
        assert self._loop is not None
        if self._down_timer is None:
            delay_s = max(0.0, since + CONNECTION_DOWN_BOUND_S - time.monotonic())
            self._down_timer = self._loop.call_later(delay_s, self._on_down_bound)

    def _connection_up(self) -> None:
        self._down_since = None
        self._unsent.clear()  # the socket sends its queue now

    def _on_down_bound(self) -> None:
        """The connection has been down for the bound (unless it came up meanwhile): answer the
        requests waiting in the socket's queue, and replace the socket so they are never sent."""
        self._down_timer = None
        if self._closed or self._down_since is None:
            return
        self._drain_monitor()  # a connection made just now must not be taken for a dead one
        if self._down_since is None:
            return
        if not self._down_for_too_long():
            self._connection_down(self._down_since)
            return
        unsent, self._unsent = self._unsent, set()
        for request_id in unsent:
            if request_id in self._futures:  # not timed out meanwhile
                self._fail(request_id, self._unavailable())
        if unsent:
            self._close_socket(linger_ms=0)  # discards the queued requests
            self._open_socket()

    def _drain_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        events: list[list[zmq.Frame]] = []
        with contextlib.suppress(zmq.Again):
            while True:
                events.append(monitor.recv_multipart(zmq.NOBLOCK, copy=False))
        self._on_monitor_events(events)

    # ------------------------------------------------------------------ receive

    def _on_monitor_events(self, messages: list[list[zmq.Frame]]) -> None:
        for frames in messages:  # rare: a connection event
            event = zmq.utils.monitor.parse_monitor_message([f.bytes for f in frames])
            if event["event"] == _CONNECTION_UP:
                self._connection_up()
            elif event["event"] == _DISCONNECTED and self._down_since is None:
                self._connection_down(time.monotonic())
                self._connection_lost()

    def _on_replies(self, chunk: Chunk) -> None:
        if self._down_since is not None:
            # A reply proves the connection up, whatever the monitor said last: its event may
            # still be queued behind this chunk.
            self._connection_up()
        futures = self._futures
        for _, msg in chunk:
            if type(msg) is InferAnswers:
                self._on_answers(msg)
            elif type(msg) is InferReply:
                future = futures.pop(msg.request_id, None)
                if future is None:
                    self.unmatched_replies += 1
                elif not future.done():
                    future.set_result(msg.outputs)
            elif type(msg) is InferError:
                self._fail(msg.request_id, error_from_wire(msg.error, msg.message))

    def _on_answers(self, msg: InferAnswers) -> None:
        futures = self._futures
        for request_id, outputs in zip(msg.request_ids, msg.outputs, strict=True):
            future = futures.pop(request_id, None)
            if future is None:
                self.unmatched_replies += 1
            elif not future.done():
                future.set_result(outputs)
        for request_id, error, message in zip(msg.error_ids, msg.errors, msg.messages,
                                              strict=True):
            self._fail(request_id, error_from_wire(error, message))

    def _fail(self, request_id: int, error: BaseException) -> None:
        future = self._futures.pop(request_id, None)
        if future is None:
            self.unmatched_replies += 1
        elif not future.done():
            future.set_exception(error)

    def _connection_lost(self) -> None:
        futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(
                    ConnectionLostError(f"connection to the frontend {self.address} was lost")
                )
