"""Message I/O on ZeroMQ sockets: encode and send, receive and decode, one whole multipart
message at a time (``codec`` does the bytes, ``sockets`` makes the sockets).

Sync sockets use ``sync_send``/``sync_recv``; the hot paths of processes driven by an event loop
use ``send_frames_nowait``/``recv_nowait`` (``reactor``); ``zmq.asyncio`` sockets use
``async_send``/``async_recv``, which try a non-blocking call on a sync twin first. A malformed
message is always consumed whole before it raises ``ProtocolError``, so the socket never falls
out of step.
"""

from __future__ import annotations

import weakref
from typing import Any

import zmq
import zmq.asyncio

from zserve.core.errors import ProtocolError
from zserve.transport.codec import DEFAULT_LIMITS, DecodeLimits, decode, encode
from zserve.transport.messages import Message
from zserve.transport.sockets import typed_send_error

# These send and receive frame by frame with plain ``send``/``recv`` instead of
# ``send_multipart``/``recv_multipart``: for small messages that halves pyzmq's per-message cost
# (no per-part type checks, and the header arrives as ``bytes``, which msgspec reads fastest,
# while buffer frames arrive as zero-copy ``zmq.Frame``s). A multipart message is atomic in ZMQ:
# once its first frame can be sent or received, so can the rest, so only the first call may block.


# Frames smaller than this are sent by copy. For a small buffer pyzmq's zero-copy path (a Frame
# object, a memoryview, a release callback from the I/O thread) costs more than copying the
# bytes; zero-copy pays off only for large buffers. It equals pyzmq's own default copy threshold
# (zmq.COPY_THRESHOLD), but deciding here skips the memoryview pyzmq builds to apply it. For the
# frames ``encode`` makes (bytes, 1-D byte memoryviews) ``len`` is the byte count.
ZERO_COPY_MIN_BYTES = 64 * 1024
# Plain ints: pyzmq's constants are enum members, and ``flags | zmq.SNDMORE`` or
# ``getsockopt(zmq.RCVMORE)`` would run Python-level enum code on every frame.
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def _send_frames(sock: zmq.Socket[Any], frames: list[Any], first_flags: int) -> None:
    """Send ``frames`` as one message; only the first send can raise ``zmq.Again``."""
    last = len(frames) - 1
    if last == 0:
        sock.send(frames[0], first_flags)
        return
    send = sock.send
    frame = frames[0]
    send(frame, first_flags | _SNDMORE, copy=len(frame) < ZERO_COPY_MIN_BYTES)
    for index in range(1, last):
        frame = frames[index]
        send(frame, _SNDMORE, copy=len(frame) < ZERO_COPY_MIN_BYTES)
    frame = frames[last]
    send(frame, 0, copy=len(frame) < ZERO_COPY_MIN_BYTES)


def _recv_frames(
    sock: zmq.Socket[Any], first_flags: int, router: bool, limits: DecodeLimits
) -> tuple[bytes | None, Message]:
    """Receive one whole message (the first recv may raise ``zmq.Again``), then decode it.
    Every frame is consumed before decoding, so a bad message never desynchronises the socket."""
    identity: bytes | None = None
    first = sock.recv(first_flags)
    if router:
        if not sock.getsockopt(_RCVMORE):
            raise ProtocolError("a routed message needs an identity frame and a header frame")
        identity, first = first, sock.recv()
    if not sock.getsockopt(_RCVMORE):
        return identity, decode((first,), limits=limits)
    frames: list[Any] = [first]
    while True:
        frames.append(sock.recv(copy=False))
        if not sock.getsockopt(_RCVMORE):
            break
    return identity, decode(frames, limits=limits)


def send_frames_nowait(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send already-encoded ``frames`` as one message on a sync socket without blocking: raises
    ``zmq.Again`` at the peer's HWM (nothing was sent) and ``zmq.ZMQError`` EHOSTUNREACH for a
    ROUTER peer that is gone. The hot-path send of every process; same copy rule as
    ``sync_send``."""
    _send_frames(sock, frames, _NOBLOCK)


def sync_send(sock: zmq.Socket[Any], message: Message, *, identity: bytes | None = None) -> None:
    """Encode and send ``message``; ``identity`` addresses a ROUTER's peer. Array frames of
    ``ZERO_COPY_MIN_BYTES`` (64 KiB) and more go zero-copy, smaller frames are copied. Blocks
    while the peer's queue is at its HWM. Raises ``UnroutableError`` when that peer is not
    connected, ``ProtocolError`` when the message cannot be encoded."""
    frames: list[Any] = encode(message)
    if identity is not None:
        frames.insert(0, identity)
    try:
        _send_frames(sock, frames, 0)
    except zmq.ZMQError as exc:
        raise typed_send_error(exc, identity) from exc


def sync_recv(
    sock: zmq.Socket[Any], *, router: bool, limits: DecodeLimits = DEFAULT_LIMITS
) -> tuple[bytes | None, Message]:
    """Receive one message: ``(peer identity or None, message)``; ``router`` says whether a
    ROUTER's identity frame leads. A malformed message is consumed whole and raises
    ``ProtocolError``, so the caller's loop can log it and receive the next one."""
    return _recv_frames(sock, 0, router, limits)


# A sync twin of each asyncio socket (same underlying ZMQ socket) for the non-blocking first try.
_SYNC_TWINS: weakref.WeakKeyDictionary[zmq.asyncio.Socket, zmq.Socket[bytes]] = (
    weakref.WeakKeyDictionary()
)


def _sync_twin(sock: zmq.asyncio.Socket) -> zmq.Socket[bytes]:
    if sock.closed:  # the twin does not own the ZMQ socket and must not touch a closed one
        raise zmq.ZMQError(zmq.ENOTSOCK, "socket is closed")
    twin = _SYNC_TWINS.get(sock)
    if twin is None:
        twin = _SYNC_TWINS[sock] = zmq.Socket.shadow(sock.underlying)
    return twin


async def async_send(
    sock: zmq.asyncio.Socket, message: Message, *, identity: bytes | None = None
) -> None:
    """``sync_send`` for a ``zmq.asyncio`` socket.

    It first tries a plain non-blocking send, which succeeds unless the peer's queue is at its
    HWM and skips the future and callbacks of pyzmq's asyncio path; only then does it await.
    Like pyzmq's own path, a send that succeeds at once does not yield to the event loop."""
    frames: list[Any] = encode(message)
    if identity is not None:
        frames.insert(0, identity)
    try:
        try:
            _send_frames(_sync_twin(sock), frames, _NOBLOCK)
        except zmq.Again:
            await sock.send_multipart(frames, copy=False)
    except zmq.ZMQError as exc:
        raise typed_send_error(exc, identity) from exc


async def async_recv(
    sock: zmq.asyncio.Socket, *, router: bool, limits: DecodeLimits = DEFAULT_LIMITS
) -> tuple[bytes | None, Message]:
    """``sync_recv`` for a ``zmq.asyncio`` socket. A queued message is taken at once through
    the sync twin (no future, no callbacks); otherwise it awaits pyzmq's asyncio receive."""
    try:
        return _recv_frames(_sync_twin(sock), _NOBLOCK, router, limits)
    except zmq.Again:
        pass  # nothing queued; the first recv raised, so no frame was consumed
    received: list[Any] = await sock.recv_multipart(copy=False)
    identity: bytes | None = None
    if router:
        if len(received) < 2:
            raise ProtocolError("a routed message needs an identity frame and a header frame")
        identity = received[0].bytes
        del received[0]
    return identity, decode(received, limits=limits)


# The asyncio helpers under their design names: every zserve process runs on asyncio.
send_message = async_send
recv_message = async_recv


# --------------------------------------------------------------------------- non-blocking receive


def recv_nowait(
    sock: zmq.Socket[Any], *, router: bool, limits: DecodeLimits = DEFAULT_LIMITS
) -> tuple[bytes | None, Message]:
    """``sync_recv`` that never blocks, for a plain socket driven by an event loop
    (``zserve.transport.reactor``): raises ``zmq.Again`` when nothing is queued (nothing was
    consumed). A malformed message is consumed whole and raises ``ProtocolError``."""
    return _recv_frames(sock, _NOBLOCK, router, limits)
