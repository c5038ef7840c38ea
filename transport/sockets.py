"""The one factory for every ZeroMQ socket in zserve, and the helpers that allocate addresses.

Rules (DESIGN.md section 4): a ROUTER binds, a DEALER connects. Every socket gets finite high-water
marks (backpressure instead of unbounded memory), a bounded LINGER (close never hangs), MAXMSGSIZE
(a peer cannot make us allocate an unbounded frame) and ZMQ heartbeats (a dead peer is noticed even
when TCP is silent). ROUTERs get ROUTER_MANDATORY so that a reply to a vanished peer raises
``UnroutableError`` instead of being dropped silently.

The factories accept a sync ``zmq.Context`` or a ``zmq.asyncio.Context`` and return that context's
socket type. Addresses are allocated, never guessed: ``ipc://`` endpoints live in a private 0700
directory (``IpcDir``), TCP binds to port 0 on loopback and the real port is read back with
``LAST_ENDPOINT`` (``bound_endpoint``).

CURVE (``transport/curve.py``, docs/security.md): a context with keys installed
(``secure_context``) makes every ``tcp://`` ROUTER a CURVE server checked by its ZAP handler
(``clients=True``: the client key list, else the roles' keys), and every ``tcp://`` DEALER a
CURVE client of the server role it names (``peer_role``); ``curve=`` gives a DEALER its keys
directly (the public client). ``ipc://`` and ``inproc://`` links stay unauthenticated.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import tempfile
import weakref
from types import TracebackType
from typing import Any, TypeVar

import zmq

from zserve.core.errors import UnroutableError
from zserve.transport.curve import (
    CLIENTS_DOMAIN,
    CLUSTER_DOMAIN,
    HANDSHAKE_FAILURE_EVENTS,
    ContextSecurity,
    CurveClient,
    CurveIdentity,
)

# Bound on queued messages per peer in each direction. Past it a DEALER send blocks (or raises
# EAGAIN with NOBLOCK) and a ROUTER send to that peer blocks: backpressure, not memory growth.
SEND_HWM_MESSAGES = 10_000
RECV_HWM_MESSAGES = 10_000
# How long close() may keep trying to deliver queued messages.
LINGER_MS = 1_000
# Largest single frame a socket accepts; a peer sending more is disconnected by ZMQ.
MAX_FRAME_BYTES = 256 * 1024 * 1024
# ZMQ-level heartbeats: ping every interval, drop the connection when no traffic arrives within
# the timeout; the TTL tells the remote peer how long to wait for us.
HEARTBEAT_INTERVAL_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 5_000
HEARTBEAT_TTL_MS = 10_000
# Kernel keepalive as a second line for TCP peers behind NATs and idle firewalls.
TCP_KEEPALIVE_IDLE_S = 30
# Reconnect backoff of connecting sockets: start fast, cap so a dead peer is not hammered. The
# cap is also how long after a peer binds (a role started late, or restarted) a connection that
# has been retrying comes up, and with it the messages queued on it: a backend started seconds
# before its frontend fetches the first inputs that late. At 5 s that was past a 2 s SLO
# (tests/proc/test_transport_reconnect.py); one attempt per half second to a missing peer costs
# nothing.
RECONNECT_INTERVAL_MS = 100
RECONNECT_INTERVAL_MAX_MS = 500

# Default bind: loopback, a free port chosen by the kernel (read it back with bound_endpoint).
LOOPBACK_TCP_ANY_PORT = "tcp://127.0.0.1:0"

# Bind hosts that mean "every interface": no peer can connect to them by that name.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]"})

# sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_IPC_PATH_BYTES = 107
# ZMQ reserves routing ids that start with a zero byte for the ones it generates itself.
_MAX_IDENTITY_BYTES = 255

TCP_SCHEME = "tcp://"

_SocketT = TypeVar("_SocketT", bound="zmq.Socket[Any]")


class BindError(zmq.ZMQError):
    """A role cannot bind one of its addresses (a port another program took, a host that is not
    this machine's): the operator's to fix, so the role exits with one line (``role_runner``).
    ``make_router`` raises it; the frontend's HTTP, gRPC and metrics servers too."""


# ctx.underlying -> (the context it was installed on, its security). Keyed by the C context, so
# a zmq.asyncio shadow of the context finds it too; the weak reference tells a live context from
# a terminated one whose address a new context may reuse.
_SECURITY: dict[int, tuple[weakref.ref[zmq.Context[Any]], ContextSecurity]] = {}


def secure_context(ctx: zmq.Context[Any], identity: CurveIdentity) -> ContextSecurity:
    """Install CURVE on ``ctx``: start its ZAP handler and handshake counter, and make the
    factory secure every tcp socket of ``ctx`` (and of its shadows) from now on. Undo with
    ``release_context(ctx)`` before ``ctx.term()``."""
    if context_security(ctx) is not None:
        raise ValueError("this context already has CURVE installed")
    security = ContextSecurity(ctx, identity)
    _SECURITY[ctx.underlying] = (weakref.ref(ctx), security)
    return security


def context_security(ctx: zmq.Context[Any]) -> ContextSecurity | None:
    """The security installed on ``ctx`` (or the context it shadows), if any."""
    entry = _SECURITY.get(ctx.underlying)
    if entry is None:
        return None
    owner = entry[0]()
    if owner is None or owner.closed:
        del _SECURITY[ctx.underlying]
        return None
    return entry[1]


def release_context(ctx: zmq.Context[Any]) -> None:
    """Stop ``ctx``'s ZAP handler and handshake counter (no-op without CURVE). Call it after
    closing the sockets and before ``ctx.term()``, which would wait for their threads."""
    entry = _SECURITY.pop(ctx.underlying, None)
    if entry is not None:
        entry[1].close()


def start_zero_copy_collector() -> None:
    """Start pyzmq's zero-copy collector now, not on the first large send.

    pyzmq frees a ``copy=False`` frame's buffer through a collector thread with its own context,
    started lazily by the first zero-copy frame (one over ``zmq.COPY_THRESHOLD``, 64 KiB, sent
    with ``copy=False``). That start took 1.6 ms of the first 602 KB input fetch, and with a
    batch deferred to its last moment the first request to a cold cluster missed its SLO. Every
    socket the factory makes calls this; after the first call it is one attribute check."""
    global _ZERO_COPY_STARTED
    if not _ZERO_COPY_STARTED:
        zmq.Frame(b"\0", copy=False)  # public API; the frame is freed through the collector
        _ZERO_COPY_STARTED = True


_ZERO_COPY_STARTED = False


def _apply_common_options(
    sock: zmq.Socket[Any],
    *,
    send_hwm_messages: int,
    recv_hwm_messages: int,
    max_message_bytes: int,
    linger_ms: int,
) -> None:
    if send_hwm_messages <= 0 or recv_hwm_messages <= 0:
        raise ValueError("high-water marks must be finite and positive (0 means unbounded in ZMQ)")
    if max_message_bytes <= 0:
        raise ValueError("max_message_bytes must be positive (-1 means unbounded in ZMQ)")
    if linger_ms < 0:
        raise ValueError("linger_ms must be >= 0 (-1 means close may block forever)")
    sock.setsockopt(zmq.SNDHWM, send_hwm_messages)
    sock.setsockopt(zmq.RCVHWM, recv_hwm_messages)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INTERVAL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_INTERVAL_MAX_MS)
    start_zero_copy_collector()


def make_router(
    ctx: zmq.Context[_SocketT],
    bind: str = LOOPBACK_TCP_ANY_PORT,
    *,
    name: str = "router",
    advertise_host: str | None = None,
    clients: bool = False,
    send_hwm_messages: int = SEND_HWM_MESSAGES,
    recv_hwm_messages: int = RECV_HWM_MESSAGES,
    max_message_bytes: int = MAX_FRAME_BYTES,
    linger_ms: int = LINGER_MS,
) -> tuple[_SocketT, str]:
    """Create a ROUTER bound to ``bind`` and return it with the endpoint peers connect to.

    ``bind`` is an explicit address (from cluster.toml), ``IpcDir.endpoint(...)``, or the default
    ``tcp://127.0.0.1:0`` whose kernel-chosen port is read back. A wildcard host
    (``tcp://0.0.0.0:PORT``, every interface) is returned as ``advertise_host`` (default: this
    machine's host name), because that is the name other hosts can reach; see
    ``advertised_endpoint``. ``name`` only labels errors. With CURVE on ``ctx`` a tcp ROUTER
    is a CURVE server accepting the roles' keys, or the client keys when ``clients``.
    """
    sock = ctx.socket(zmq.ROUTER)
    try:
        _apply_common_options(
            sock,
            send_hwm_messages=send_hwm_messages,
            recv_hwm_messages=recv_hwm_messages,
            max_message_bytes=max_message_bytes,
            linger_ms=linger_ms,
        )
        # A send to an identity that is not connected raises EHOSTUNREACH instead of vanishing.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted peer that reconnects with the same identity takes over the old route at
        # once, rather than being refused until heartbeats time the dead connection out.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        security = context_security(ctx) if bind.startswith(TCP_SCHEME) else None
        if security is not None:
            security.secure_server(sock, CLIENTS_DOMAIN if clients else CLUSTER_DOMAIN)
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            # os.strerror: pyzmq's own text repeats the address.
            reason = os.strerror(exc.errno) if exc.errno else exc.strerror
            raise BindError(exc.errno, f"{name}: cannot bind {bind}: {reason}") from exc
        return sock, advertised_endpoint(bound_endpoint(sock), advertise_host)
    except BaseException:
        sock.close(linger=0)
        raise


def make_dealer(
    ctx: zmq.Context[_SocketT],
    connect: str,
    *,
    identity: bytes,
    peer_role: str | None = None,
    curve: CurveClient | None = None,
    send_hwm_messages: int = SEND_HWM_MESSAGES,
    recv_hwm_messages: int = RECV_HWM_MESSAGES,
    max_message_bytes: int = MAX_FRAME_BYTES,
    linger_ms: int = LINGER_MS,
) -> _SocketT:
    """Create a DEALER with routing ``identity`` connected to ``connect``.

    The identity is what the peer ROUTER sees (and addresses replies to), so it must be stable
    and unique among that ROUTER's peers, e.g. ``b"backend-0"``. On a tcp address the
    DEALER is a CURVE client with ``curve``'s keys, else, with CURVE on ``ctx``, with the
    process's key pair and the public key of ``peer_role`` (required then: ``"rank"``,
    ``"shard"``, ``"backend"``, ``"frontend"``, ``"supervisor"``).
    """
    sock = _unconnected_dealer(
        ctx, connect, identity=identity, peer_role=peer_role, curve=curve,
        send_hwm_messages=send_hwm_messages, recv_hwm_messages=recv_hwm_messages,
        max_message_bytes=max_message_bytes, linger_ms=linger_ms,
    )
    try:
        sock.connect(connect)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def make_monitored_dealer(
    ctx: zmq.Context[_SocketT],
    connect: str,
    *,
    identity: bytes,
    monitor_events: int,
    monitor_addr: str,
    curve: CurveClient | None = None,
) -> tuple[_SocketT, zmq.Socket[Any]]:
    """``make_dealer``'s DEALER and its monitor socket (``monitor_events`` at
    ``monitor_addr``), the monitor attached *before* the DEALER connects: a handshake that
    completes at once (a peer on the same host) is always reported. Attached after the
    connect, the monitor misses the first connection's events whenever the caller's thread is
    slower than the handshake, as on a loaded host."""
    sock = _unconnected_dealer(ctx, connect, identity=identity, curve=curve)
    monitor: zmq.Socket[Any] | None = None
    try:
        monitor = sock.get_monitor_socket(monitor_events, addr=monitor_addr)
        sock.connect(connect)
    except BaseException:
        if monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
        raise
    return sock, monitor


def _unconnected_dealer(
    ctx: zmq.Context[_SocketT],
    connect: str,
    *,
    identity: bytes,
    peer_role: str | None = None,
    curve: CurveClient | None = None,
    send_hwm_messages: int = SEND_HWM_MESSAGES,
    recv_hwm_messages: int = RECV_HWM_MESSAGES,
    max_message_bytes: int = MAX_FRAME_BYTES,
    linger_ms: int = LINGER_MS,
) -> _SocketT:
    """A DEALER with every option of ``make_dealer`` set, not connected yet."""
    if not identity or len(identity) > _MAX_IDENTITY_BYTES or identity[0] == 0:
        raise ValueError(
            f"identity must be 1..{_MAX_IDENTITY_BYTES} bytes not starting with a zero byte, "
            f"got {identity!r}"
        )
    sock = ctx.socket(zmq.DEALER)
    try:
        _apply_common_options(
            sock,
            send_hwm_messages=send_hwm_messages,
            recv_hwm_messages=recv_hwm_messages,
            max_message_bytes=max_message_bytes,
            linger_ms=linger_ms,
        )
        sock.setsockopt(zmq.ROUTING_ID, identity)
        if connect.startswith(TCP_SCHEME):
            curve = curve or _process_curve(ctx, connect, peer_role)
            if curve is not None:
                curve.apply(sock)
        return sock
    except BaseException:
        sock.close(linger=0)
        raise


def monitor_server(sock: zmq.Socket[Any], events: int, addr: str | None = None
                   ) -> zmq.Socket[Any]:
    """The monitor socket of a ROUTER the factory made, for its owner's own events. libzmq
    allows one monitor per socket, and a CURVE server's is the handshake counter's: this one
    takes it over and adds the failed-handshake events, and the owner passes every event id it
    reads to ``note_monitor_event``."""
    security = context_security(sock.context)
    if security is not None and sock.getsockopt(zmq.CURVE_SERVER):
        events |= HANDSHAKE_FAILURE_EVENTS
    return sock.get_monitor_socket(events, addr=addr)


def note_monitor_event(sock: zmq.Socket[Any], event: int) -> None:
    """Count ``event`` of ``monitor_server(sock, ...)`` if it is a failed CURVE handshake."""
    security = context_security(sock.context)
    if security is not None:
        security.note_event(event)


def _process_curve(
    ctx: zmq.Context[Any], connect: str, peer_role: str | None
) -> CurveClient | None:
    security = context_security(ctx)
    if security is None:
        return None
    if peer_role is None:
        raise ValueError(f"CURVE is on: a DEALER to {connect} must name its peer_role")
    return security.identity.client_to(peer_role)


def bound_endpoint(sock: zmq.Socket[Any]) -> str:
    """The endpoint the socket last bound, with the real port for ``tcp://host:0``."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


def advertised_endpoint(endpoint: str, advertise_host: str | None = None) -> str:
    """Where peers connect to a socket bound at ``endpoint``: unchanged, except that a tcp
    wildcard host (``0.0.0.0``, ``*``, ``::``) becomes ``advertise_host``, else this machine's
    host name (``socket.gethostname()``, which the other hosts must be able to resolve; give an
    address when they cannot)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or host not in WILDCARD_HOSTS:
        return endpoint
    return f"tcp://{advertise_host or socket.gethostname()}:{port}"


def typed_send_error(exc: zmq.ZMQError, peer: bytes | None) -> Exception:
    """The typed error for a failed send: ROUTER_MANDATORY's EHOSTUNREACH becomes
    ``UnroutableError`` naming the peer; anything else is returned unchanged.

    A function rather than a context manager because it sits on the send hot path, where a
    ``with`` block would cost more than the send. Use it as
    ``raise typed_send_error(exc, peer) from exc``.
    """
    if exc.errno == errno.EHOSTUNREACH:
        return UnroutableError(f"peer {peer!r} is not connected")
    return exc


class IpcDir:
    """A private (0700) temporary directory for ``ipc://`` endpoints, removed on exit.

    Use as a context manager or call ``close()``. ``base`` defaults to the system temp dir; keep it
    short, because a Unix socket path may not exceed 107 bytes.
    """

    def __init__(self, base: str | os.PathLike[str] | None = None, *, prefix: str = "zserve-"):
        # mkdtemp creates the directory readable and writable by its owner only (0700), so no
        # other user can connect to or replace our sockets.
        self.path: str = tempfile.mkdtemp(prefix=prefix, dir=base)
        self._closed = False

    def endpoint(self, name: str) -> str:
        """``ipc://<dir>/<name>``; ``name`` is a plain file name such as ``"frontend-0"``."""
        if not name or "/" in name or name in {".", ".."} or "\x00" in name:
            raise ValueError(f"invalid ipc endpoint name {name!r}")
        path = os.path.join(self.path, name)
        if len(path.encode()) > _MAX_IPC_PATH_BYTES:
            raise ValueError(
                f"ipc path {path!r} exceeds {_MAX_IPC_PATH_BYTES} bytes; use a shorter base or name"
            )
        return f"ipc://{path}"

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> IpcDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
