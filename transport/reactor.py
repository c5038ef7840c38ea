"""Plain ZeroMQ sockets on an asyncio event loop: receive in per-socket chunks, send without
blocking, with no ``zmq.asyncio`` futures on the hot path. The one receive loop of zserve: every
role process and ``AsyncClient`` receive through it.

    reactor = SocketReactor(loop)
    reactor.watch(sock, router=True, on_chunk=handle, on_bad=count_bad)   # decoded messages
    reactor.watch_frames(sock, on_frames=handle_raw)                     # or raw frames
    error = reactor.send_nowait(sock, msg, identity)    # None, or the ZMQError it did not raise
    ...
    reactor.unwatch(sock); sock.close(linger=...)       # or reactor.close() for all of them

How it works. A ZeroMQ socket's ``ZMQ_FD`` is *edge-triggered*: it becomes readable when the
socket's state may have changed, and any operation on the socket (a receive, a send, asking
``EVENTS``) can consume that edge. So the reactor

- watches each socket's FD with ``loop.add_reader``; when it fires, it drains that socket: it
  receives one whole message without blocking (the FD fired, so one is all but certainly there; a
  receive that finds none consumes the edge as well), asks ``zmq_poll`` with timeout 0 once
  whether more is queued, and if so receives until EAGAIN, up to ``max_chunk`` messages (a drain
  not started by the FD polls first). That strategy won ``python -m
  zserve.transport.bench.reactor_drain`` (CPU per message, against asking ``getsockopt(EVENTS)``
  before every receive, polling before every receive, and receiving until EAGAIN): the cheapest for
  messages that come one at a time (one poll, no failing receive, which raises) and within 10%
  of the cheapest in a flood (one failing receive per chunk, no poll per message). A socket that
  still holds more is drained again on the next loop iteration (``call_soon``), so one busy
  socket cannot starve timers or other sockets;
- hands the messages of one drain to ``on_chunk`` in one call (a ``Chunk`` of
  ``(identity or None, message)``: one scheduling pass and one outbox flush per socket per loop
  tick), or their raw frames to ``on_frames`` (``watch_frames``: for sockets whose frames carry
  more than the message, such as a connection's file descriptor, or that are not zserve
  messages, such as a monitor socket); a malformed message goes to ``on_bad`` and the rest of the
  chunk is kept; an exception in a handler is logged and the socket keeps being served;
- after every send on a watched socket (``send_nowait``, ``send_frames``), drains that socket
  again on the next loop iteration (at most once per iteration however many sends), because the
  send may have consumed the edge of a message that arrived meanwhile; without that, a receive
  could wait for a wake-up that never comes. Every send on a watched socket must therefore go
  through the reactor (or be followed by ``kick``). The first drain after ``watch`` happens the
  same way, for messages queued before the socket was watched.

A socket is either watched by a reactor or used by ``zmq.asyncio``, never both. Everything runs
on the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from zserve.core.errors import ZServeError
from zserve.transport.codec import DEFAULT_LIMITS, DecodeLimits, encode
from zserve.transport.messages import Message
from zserve.transport.socket_io import recv_nowait, send_frames_nowait

log = logging.getLogger(__name__)

# Most messages taken from one socket in one drain before the handler runs.
MAX_CHUNK = 512

# The messages of one drain: (the ROUTER peer's identity, or None on a DEALER; the message).
Chunk = list[tuple[bytes | None, Message]]
ChunkHandler = Callable[[Chunk], None]
BadHandler = Callable[[ZServeError], None]
# The raw messages of one drain (``watch_frames``): each a list of ``zmq.Frame``.
FramesHandler = Callable[[list[list[zmq.Frame]]], None]

# Plain ints: pyzmq's constants are enum members, and enum arithmetic per call costs Python code.
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_GONE = (errno.ENOTSOCK, zmq.ETERM)


class _Watch:
    """One watched socket."""

    __slots__ = ("active", "fd", "limits", "max_chunk", "on_bad", "on_chunk", "on_frames",
                 "pending", "poll_items", "router", "sock")

    def __init__(self, sock: zmq.Socket[Any], fd: int, *, router: bool,
                 on_chunk: ChunkHandler | None, on_frames: FramesHandler | None,
                 on_bad: BadHandler | None, max_chunk: int, limits: DecodeLimits) -> None:
        self.sock = sock
        self.fd = fd
        self.router = router
        self.on_chunk = on_chunk
        self.on_frames = on_frames
        self.on_bad = on_bad
        self.max_chunk = max_chunk
        self.limits = limits
        self.poll_items = [(sock, _POLLIN)]
        self.active = True
        self.pending = False  # queued for the next drain pass


def _recv_frames(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """One whole message, frame by frame: each Frame knows whether more follow (no RCVMORE
    getsockopt per frame, which recv_multipart asks for every one)."""
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


class SocketReactor:
    """Drives plain ZeroMQ sockets from one asyncio event loop; see the module docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._watches: dict[zmq.Socket[Any], _Watch] = {}
        self._pending: list[_Watch] = []
        self._handle: asyncio.Handle | None = None
        self._closed = False

    # ------------------------------------------------------------------ sockets

    def watch(
        self,
        sock: zmq.Socket[Any],
        *,
        router: bool,
        on_chunk: ChunkHandler,
        on_bad: BadHandler | None = None,
        max_chunk: int = MAX_CHUNK,
        limits: DecodeLimits = DEFAULT_LIMITS,
    ) -> None:
        """Receive on ``sock`` (a plain, non-asyncio socket) from now on: each drain's messages
        go to ``on_chunk`` as one ``Chunk``; ``router`` says whether an identity frame leads;
        malformed messages go to ``on_bad`` (dropped when it is None)."""
        self._add(_Watch(sock, self._fd_of(sock, max_chunk), router=router, on_chunk=on_chunk,
                         on_frames=None, on_bad=on_bad, max_chunk=max_chunk, limits=limits))

    def watch_frames(self, sock: zmq.Socket[Any], *, on_frames: FramesHandler,
                     max_chunk: int = MAX_CHUNK) -> None:
        """Like ``watch``, but each drain's messages go to ``on_frames`` undecoded, as lists of
        ``zmq.Frame`` (a ROUTER's identity frame first)."""
        self._add(_Watch(sock, self._fd_of(sock, max_chunk), router=False, on_chunk=None,
                         on_frames=on_frames, on_bad=None, max_chunk=max_chunk,
                         limits=DEFAULT_LIMITS))

    def _fd_of(self, sock: zmq.Socket[Any], max_chunk: int) -> int:
        if self._closed:
            raise RuntimeError("the reactor is closed")
        if isinstance(sock, zmq.asyncio.Socket):
            raise TypeError("a zmq.asyncio socket cannot be watched; use a plain zmq.Socket")
        if sock in self._watches:
            raise ValueError("the socket is already watched")
        if max_chunk < 1:
            raise ValueError("max_chunk must be at least 1")
        return int(sock.getsockopt(zmq.FD))

    def _add(self, watch: _Watch) -> None:
        self._watches[watch.sock] = watch
        self._loop.add_reader(watch.fd, self._on_readable, watch)
        self._mark(watch)  # messages may be queued already, their edge consumed

    def unwatch(self, sock: zmq.Socket[Any]) -> None:
        """Stop receiving on ``sock`` (before closing it); a no-op for a socket not watched."""
        watch = self._watches.pop(sock, None)
        if watch is None:
            return
        watch.active = False
        if all(other.fd != watch.fd for other in self._watches.values()):
            with contextlib.suppress(Exception):  # a closed loop has no readers left anyway
                self._loop.remove_reader(watch.fd)

    def watching(self, sock: zmq.Socket[Any]) -> bool:
        return sock in self._watches

    def close(self) -> None:
        """Unwatch every socket and cancel the pending drain. Sockets stay open: their owners
        close them. Idempotent."""
        self._closed = True
        for sock in list(self._watches):
            self.unwatch(sock)
        self._pending.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    # ------------------------------------------------------------------ send

    def send_nowait(
        self, sock: zmq.Socket[Any], msg: Message, identity: bytes | None = None
    ) -> BaseException | None:
        """Encode and send ``msg`` without ever blocking (``identity`` addresses a ROUTER's
        peer); returns the error instead of raising it (``zmq.Again``: the peer's queue is full;
        EHOSTUNREACH: that peer is not connected; ENOTSOCK: the socket is closed), so a slow or
        vanished peer cannot stall the caller. Schedules a drain of ``sock`` when it is
        watched."""
        frames: list[Any] = encode(msg)
        if identity is not None:
            frames.insert(0, identity)
        return self.send_frames(sock, frames)

    def send_frames(self, sock: zmq.Socket[Any], frames: list[Any]) -> BaseException | None:
        """``send_nowait`` for already-encoded frames (a ROUTER's identity frame first)."""
        error: BaseException | None = None
        try:
            send_frames_nowait(sock, frames)
        except zmq.ZMQError as exc:
            error = exc
        watch = self._watches.get(sock)
        if watch is not None and not watch.pending:
            self._mark(watch)
        return error

    def kick(self, sock: zmq.Socket[Any]) -> None:
        """Drain ``sock`` on the next loop iteration: call it after touching a watched socket
        other than through the reactor's sends (any operation can consume its FD's edge)."""
        watch = self._watches.get(sock)
        if watch is not None and not watch.pending:
            self._mark(watch)

    # ------------------------------------------------------------------ receive

    def _mark(self, watch: _Watch) -> None:
        watch.pending = True
        self._pending.append(watch)
        if self._handle is None and not self._closed:
            self._handle = self._loop.call_soon(self._run_pending)

    def _run_pending(self) -> None:
        self._handle = None
        pending = self._pending
        self._pending = []
        for watch in pending:
            # Cleared before the drain: a send from this drain's handler queues it again.
            watch.pending = False
            if watch.active:
                self._drain(watch, fired=False)

    def _on_readable(self, watch: _Watch) -> None:
        if watch.active:
            self._drain(watch, fired=True)

    def _drain(self, watch: _Watch, *, fired: bool) -> None:
        """Receive up to ``max_chunk`` messages and hand them over. ``fired``: the FD said
        input came, so the first receive goes without a poll."""
        sock = watch.sock
        chunk: list[Any] = []
        bad: list[ZServeError] = []
        receive = self._receive_frames if watch.on_frames is not None else self._receive_message
        poll_items = watch.poll_items
        try:
            for count in range(watch.max_chunk):
                # One poll, after the first message (or before it, unless the FD fired): a lone
                # message costs no failing receive, a flood no poll per message.
                if (count == 1 or (count == 0 and not fired)) and not zmq.zmq_poll(poll_items,
                                                                                     0):
                    break
                receive(watch, chunk, bad)
            else:  # the budget is spent: the rest waits for the next loop iteration
                if not watch.pending:
                    self._mark(watch)
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            if sock.closed or exc.errno in _GONE:
                log.warning("a socket was closed while watched; unwatching it")
                self.unwatch(sock)
            else:
                log.warning("receive failed: %s", exc)
        self._deliver(watch, chunk, bad)

    @staticmethod
    def _receive_message(watch: _Watch, chunk: list[Any], bad: list[ZServeError]) -> None:
        try:
            chunk.append(recv_nowait(watch.sock, router=watch.router, limits=watch.limits))
        except ZServeError as exc:  # consumed whole; the socket stays in sync
            bad.append(exc)

    @staticmethod
    def _receive_frames(watch: _Watch, chunk: list[Any], _bad: list[ZServeError]) -> None:
        chunk.append(_recv_frames(watch.sock))

    @staticmethod
    def _deliver(watch: _Watch, chunk: list[Any], bad: list[ZServeError]) -> None:
        if bad and watch.on_bad is not None:
            for error in bad:
                try:
                    watch.on_bad(error)
                except Exception:
                    log.exception("error handling a bad message")
        if not chunk:
            return
        try:
            if watch.on_frames is not None:
                watch.on_frames(chunk)
            elif watch.on_chunk is not None:
                watch.on_chunk(chunk)
        except Exception:  # a bug handling one chunk must not stop the process receiving
            log.exception("error handling a chunk of %d messages", len(chunk))
