"""CURVE through the one socket factory, over real tcp sockets on loopback: matching keys talk;
an unknown client key, a client without CURVE and a client holding the wrong server key get
nothing delivered, and each failure is counted (``auth_failed``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from runtime_helpers import wait_until

from zserve.transport.curve import CLIENTS_DOMAIN, CLUSTER_DOMAIN, CurveClient, CurveIdentity
from zserve.transport.sockets import (
    context_security,
    make_dealer,
    make_router,
    release_context,
    secure_context,
)

RECV_TIMEOUT_MS = 5_000
# How long a refused peer is given to get a message through (it never should): several of the
# DEALER's reconnect attempts (100 ms apart), each a handshake the server refuses.
REFUSED_WINDOW_S = 1.0
WAIT_BOUND_S = 10.0

Keys = tuple[bytes, bytes]


def keypair() -> Keys:
    public, secret = zmq.curve_keypair()
    return public, secret


@pytest.fixture
def server_keys() -> Keys:
    return keypair()


@pytest.fixture
def role_keys() -> Keys:
    return keypair()


@pytest.fixture
def client_keys() -> Keys:
    return keypair()


@pytest.fixture
def secured(server_keys: Keys, role_keys: Keys, client_keys: Keys
            ) -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A context with CURVE installed: its servers accept ``role_keys`` on cluster sockets and
    ``client_keys`` on client sockets."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    identity = CurveIdentity(
        public=server_keys[0], secret=server_keys[1],
        servers={"frontend": server_keys[0]},
        authorized={CLUSTER_DOMAIN: frozenset({role_keys[0]}),
                    CLIENTS_DOMAIN: frozenset({client_keys[0]})},
    )
    secure_context(ctx, identity)
    yield ctx
    release_context(ctx)
    ctx.destroy(linger=0)


def auth_failures(ctx: zmq.Context[Any]) -> int:
    """The context's failed CURVE handshakes (a counter its ZAP thread bumps)."""
    security = context_security(ctx)
    assert security is not None
    return security.auth_failed


def test_matching_keys_exchange_messages_over_tcp(
    secured: zmq.Context[zmq.Socket[bytes]], server_keys: Keys, client_keys: Keys,
) -> None:
    router, endpoint = make_router(secured, "tcp://127.0.0.1:0", clients=True)
    plain: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        curve = CurveClient(client_keys[0], client_keys[1], server_keys[0])
        dealer = make_dealer(plain, endpoint, identity=b"client-1", curve=curve)
        dealer.send(b"ping")
        assert router.poll(RECV_TIMEOUT_MS)
        assert router.recv_multipart() == [b"client-1", b"ping"]
        router.send_multipart([b"client-1", b"pong"])
        assert dealer.poll(RECV_TIMEOUT_MS)
        assert dealer.recv() == b"pong"
        assert dealer.getsockopt(zmq.MECHANISM) == zmq.CURVE
        assert router.getsockopt(zmq.CURVE_SERVER) == 1
        security = context_security(secured)
        assert security is not None and security.auth_failed == 0
        dealer.close(linger=0)
    finally:
        router.close(linger=0)
        plain.destroy(linger=0)


def test_roles_dealer_uses_the_peer_roles_key(
    secured: zmq.Context[zmq.Socket[bytes]], server_keys: Keys, role_keys: Keys,
) -> None:
    """A process with CURVE installed connects as a CURVE client of the role it names; the
    cluster domain accepts the role's key."""
    router, endpoint = make_router(secured, "tcp://127.0.0.1:0")
    peer: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer_identity = CurveIdentity(public=role_keys[0], secret=role_keys[1],
                                  servers={"frontend": server_keys[0]},
                                  authorized={CLUSTER_DOMAIN: frozenset()})
    secure_context(peer, peer_identity)
    try:
        with pytest.raises(ValueError, match="peer_role"):
            make_dealer(peer, endpoint, identity=b"backend-0")
        dealer = make_dealer(peer, endpoint, identity=b"backend-0", peer_role="frontend")
        dealer.send(b"hello")
        assert router.poll(RECV_TIMEOUT_MS)
        assert router.recv_multipart() == [b"backend-0", b"hello"]
        dealer.close(linger=0)
    finally:
        router.close(linger=0)
        release_context(peer)
        peer.destroy(linger=0)


def _refused_curve(case: str, server_keys: Keys, role_keys: Keys) -> CurveClient | None:
    if case == "unknown client key":
        unknown = keypair()
        return CurveClient(unknown[0], unknown[1], server_keys[0])
    if case == "wrong server key":
        return CurveClient(role_keys[0], role_keys[1], keypair()[0])
    assert case == "no CURVE"
    return None


@pytest.mark.parametrize("case", ["unknown client key", "no CURVE", "wrong server key"])
@pytest.mark.parametrize("clients", [True, False], ids=["client socket", "cluster socket"])
def test_refused_peer_gets_nothing_delivered_and_is_counted(
    secured: zmq.Context[zmq.Socket[bytes]], server_keys: Keys, role_keys: Keys, case: str,
    clients: bool,
) -> None:
    router, endpoint = make_router(secured, "tcp://127.0.0.1:0", clients=clients)
    plain: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    curve = _refused_curve(case, server_keys, role_keys)
    try:
        dealer = make_dealer(plain, endpoint, identity=b"intruder", curve=curve)
        for _ in range(10):
            dealer.send(b"let me in", zmq.NOBLOCK)
        wait_until(lambda: auth_failures(secured) >= 1, "a failed handshake counted",
                   timeout_s=WAIT_BOUND_S)
        assert not router.poll(int(REFUSED_WINDOW_S * 1e3)), f"{case}: a message got through"
        dealer.close(linger=0)
    finally:
        router.close(linger=0)
        plain.destroy(linger=0)


def test_ipc_links_stay_without_curve(secured: zmq.Context[zmq.Socket[bytes]],
                                      tmp_path: Any) -> None:
    router, endpoint = make_router(secured, f"ipc://{tmp_path}/r")
    try:
        assert router.getsockopt(zmq.CURVE_SERVER) == 0
        dealer = make_dealer(secured, endpoint, identity=b"local")  # no peer_role needed
        dealer.send(b"x")
        assert router.poll(RECV_TIMEOUT_MS)
        assert router.recv_multipart() == [b"local", b"x"]
        dealer.close(linger=0)
    finally:
        router.close(linger=0)


def test_a_terminated_context_leaves_no_security_behind() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    public, secret = keypair()
    secure_context(ctx, CurveIdentity(public=public, secret=secret, servers={},
                                      authorized={CLUSTER_DOMAIN: frozenset()}))
    with pytest.raises(ValueError, match="already"):
        secure_context(ctx, CurveIdentity(public=public, secret=secret, servers={},
                                          authorized={}))
    release_context(ctx)
    assert context_security(ctx) is None
    ctx.term()
