"""CURVE on TCP links: the keys a socket needs, and each process's authorizer and handshake count.

The socket factory (``transport/sockets.py``) is the one place that applies CURVE. A process that
runs with keys installs one :class:`ContextSecurity` on its ZeroMQ context
(``sockets.secure_context``); from then on every ROUTER the factory binds on a ``tcp://`` address
is a CURVE server with the process's key pair, and every DEALER it connects to a ``tcp://`` peer
is a CURVE client that names the peer role's public key. ``ipc://`` and ``inproc://`` links are
left alone: they never leave the host, and the ipc folder is private (0700).

Who may connect is decided by a ZAP handler, pyzmq's ``ThreadAuthenticator``, one per context.
Each server socket carries a ZAP domain: ``cluster`` (the roles' own sockets: any role's public
key) or ``clients`` (a frontend's client socket: the listed client keys). A thread rather than
``AsyncioAuthenticator`` because the roles run their sockets on a uvloop reactor with sync
sockets, and a handshake must not wait for (or take time from) an event loop that is busy
scheduling: the thread answers ZAP requests on its own, and is idle between handshakes.

Failed handshakes on this process's server sockets (an unknown key, a client without CURVE, a
client holding the wrong server key) are counted from socket monitors by one more idle thread:
:attr:`ContextSecurity.auth_failed`, reported as the ``auth_failed`` counter of the role's stats.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

__all__ = (
    "CLIENTS_DOMAIN",
    "CLUSTER_DOMAIN",
    "HANDSHAKE_FAILURE_EVENTS",
    "ContextSecurity",
    "CurveClient",
    "CurveIdentity",
)

log = logging.getLogger(__name__)

# ZAP domains of server sockets: the roles' own sockets, and a frontend's client socket.
CLUSTER_DOMAIN = "cluster"
CLIENTS_DOMAIN = "clients"
# Monitor events of a handshake that failed: ZAP refused the key (AUTH), or the peer spoke
# another mechanism or could not be decrypted (PROTOCOL: no CURVE, a wrong server key).
HANDSHAKE_FAILURE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_MONITOR_IDS = itertools.count()
# A CURVE key in Z85 text is 40 characters (32 bytes).
Z85_KEY_CHARS = 40


def check_z85_key(what: str, key: bytes) -> bytes:
    """``key`` if it is a 40-character Z85 CURVE key, else ValueError naming ``what``."""
    if len(key) != Z85_KEY_CHARS:
        raise ValueError(f"{what}: not a CURVE key (40 Z85 characters), got {len(key)} bytes")
    return key


@dataclass(frozen=True, slots=True)
class CurveClient:
    """What a connecting DEALER needs: its own key pair and the server's public key (Z85)."""

    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes

    def __post_init__(self) -> None:
        check_z85_key("public key", self.public)
        check_z85_key("secret key", self.secret)
        check_z85_key("server public key", self.server_public)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)


@dataclass(frozen=True, slots=True)
class CurveIdentity:
    """A process's CURVE material: its role's key pair, the public key of every role it may
    connect to (``servers``: role -> Z85 key), and who may connect to it (``authorized``: ZAP
    domain -> the Z85 public keys accepted there)."""

    public: bytes
    secret: bytes = field(repr=False)
    servers: Mapping[str, bytes]
    authorized: Mapping[str, frozenset[bytes]]

    def client_to(self, role: str) -> CurveClient:
        """The DEALER settings for a connection to a server of ``role``."""
        try:
            server_public = self.servers[role]
        except KeyError:
            raise ValueError(
                f"no public key for role {role!r} (known: {', '.join(sorted(self.servers))})"
            ) from None
        return CurveClient(self.public, self.secret, server_public)


class _KeyList:
    """A ZAP credentials provider: a fixed set of accepted Z85 public keys per domain."""

    def __init__(self, authorized: Mapping[str, frozenset[bytes]]) -> None:
        self._authorized = authorized

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._authorized.get(domain, frozenset())


class ContextSecurity:
    """The CURVE authorizer and handshake counter of one ZeroMQ context (one per process).

    ``close()`` stops both threads; call it after closing the sockets and before
    ``ctx.term()``, which would otherwise wait for the threads' sockets forever.
    """

    def __init__(self, ctx: zmq.Context[Any], identity: CurveIdentity) -> None:
        self.identity = identity
        # Sync sockets for both threads, also when ``ctx`` is a zmq.asyncio context: a shadow
        # shares its C context, so ZAP and the monitors' inproc endpoints are the same.
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        self._auth = ThreadAuthenticator(self._sync_ctx, log=logging.getLogger("zserve.zap"))
        self._auth.start()
        provider = _KeyList(identity.authorized)
        for domain in identity.authorized:
            self._auth.configure_curve_callback(domain=domain, credentials_provider=provider)
        self._watch = _HandshakeWatch()
        self._reported = 0
        self._closed = False

    @property
    def auth_failed(self) -> int:
        """Failed handshakes on this context's server sockets since it was installed."""
        return self._watch.failures

    def auth_failed_window(self, reset: bool) -> int:
        """Failed handshakes since the last ``reset`` (the stats counter's window)."""
        failures = self._watch.failures
        count = failures - self._reported
        if reset:
            self._reported = failures
        return count

    def secure_server(self, sock: zmq.Socket[Any], domain: str) -> None:
        """Make ``sock`` (not yet bound) a CURVE server that ZAP checks under ``domain``,
        and count its failed handshakes."""
        if domain not in self.identity.authorized:
            raise ValueError(f"unknown ZAP domain {domain!r}")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.identity.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.identity.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        # Attached before bind, so no connection's handshake goes uncounted. A sync PAIR even
        # when ``sock`` is a zmq.asyncio socket: the watch thread reads it with blocking calls.
        address = f"inproc://zserve-handshake-{id(sock):x}-{next(_MONITOR_IDS)}"
        sock.monitor(address, HANDSHAKE_FAILURE_EVENTS)
        monitor = self._sync_ctx.socket(zmq.PAIR)
        monitor.connect(address)
        self._watch.add(monitor)

    def note_event(self, event: int) -> None:
        """Count ``event`` (a monitor event id) if it is a failed handshake: for a server
        socket whose monitor its owner took over (libzmq allows one monitor per socket)."""
        if event & HANDSHAKE_FAILURE_EVENTS:
            self._watch.note_failure()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._watch.stop()
        self._auth.stop()


class _HandshakeWatch:
    """A thread that reads the monitor sockets of server sockets and counts failed
    handshakes. New monitors are handed over through a queue and a wake-up pipe, so the thread
    sleeps in ``poll`` with no timeout and never touches a socket another thread uses."""

    def __init__(self) -> None:
        self.failures = 0
        self._lock = threading.Lock()
        self._pending: list[zmq.Socket[Any]] = []
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="zserve-handshake-watch",
                                        daemon=True)
        self._thread.start()

    def note_failure(self) -> None:
        with self._lock:
            self.failures += 1

    def add(self, monitor: zmq.Socket[Any]) -> None:
        with self._lock:
            self._pending.append(monitor)
        os.write(self._wake_w, b"a")

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        os.write(self._wake_w, b"s")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        monitors: list[zmq.Socket[Any]] = []
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    with self._lock:
                        added, self._pending = self._pending, []
                        stopping = self._stopping
                    monitors += added
                    for monitor in added:
                        poller.register(monitor, zmq.POLLIN)
                    if stopping:
                        return
                self._count(monitor for monitor in monitors if monitor in ready)
        finally:
            for monitor in monitors:
                monitor.close(linger=0)
            with self._lock:
                for monitor in self._pending:
                    monitor.close(linger=0)

    def _count(self, readable: Iterable[zmq.Socket[Any]]) -> None:
        for monitor in readable:
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())
                if event["event"] & HANDSHAKE_FAILURE_EVENTS:
                    self.note_failure()
                    log.debug("handshake failed: %s on %s", event["event"], event["endpoint"])
