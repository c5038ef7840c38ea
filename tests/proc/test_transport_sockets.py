"""The socket factory, address allocation, ROUTER_MANDATORY, and the asyncio send/recv helpers,
all over real sockets (ipc:// in a private dir and tcp:// on loopback port 0)."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio
from transport_helpers import SAMPLE_MESSAGES, assert_messages_equal, buffer_owner, recv_within

from zserve.core.errors import ErrorKind, ProtocolError, UnroutableError
from zserve.transport import socket_io, sockets
from zserve.transport.messages import CancelRequest, Heartbeat, InferReply, Message
from zserve.transport.sockets import (
    IpcDir,
    advertised_endpoint,
    bound_endpoint,
    make_dealer,
    make_router,
)

Pair = tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
AsyncPair = tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]
Ctx = zmq.Context[zmq.Socket[bytes]]
ASYNC_TIMEOUT_S = 5.0


def test_factory_sets_every_option(transport_pair: Pair) -> None:
    router, dealer = transport_pair
    for sock in (router, dealer):
        assert sock.getsockopt(zmq.SNDHWM) == sockets.SEND_HWM_MESSAGES
        assert sock.getsockopt(zmq.RCVHWM) == sockets.RECV_HWM_MESSAGES
        assert sock.getsockopt(zmq.LINGER) == sockets.LINGER_MS
        assert sock.getsockopt(zmq.MAXMSGSIZE) == sockets.MAX_FRAME_BYTES
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == sockets.HEARTBEAT_INTERVAL_MS
        assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == sockets.HEARTBEAT_TIMEOUT_MS
        assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
    assert dealer.getsockopt(zmq.ROUTING_ID) == b"peer-0"
    assert router.type == zmq.ROUTER and dealer.type == zmq.DEALER


def test_the_factory_starts_the_zero_copy_collector_before_the_first_send(
        tmp_path: Path) -> None:
    # In a fresh interpreter: pyzmq starts its collector thread lazily, on the first zero-copy
    # frame; the factory starts it with the socket, so no request pays for it.
    probe = (
        "import zmq\n"
        "from zmq.utils.garbage import gc\n"
        "from zserve.transport.sockets import make_dealer\n"
        "ctx = zmq.Context()\n"
        "before = gc.is_alive()\n"
        "sock = make_dealer(ctx, 'inproc://nowhere', identity=b'probe')\n"
        "print(before, gc.is_alive())\n"
        "sock.close(0)\n"
        "ctx.term()\n"
    )
    # Run from an empty folder: the checkout's root holds a ``zserve`` folder of its own.
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60, check=True, cwd=tmp_path)
    assert result.stdout.split() == ["False", "True"]


def test_default_bind_is_loopback_with_a_kernel_chosen_port(transport_ctx: Ctx) -> None:
    router, endpoint = make_router(transport_ctx)
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert bound_endpoint(router) == endpoint
    dealer = make_dealer(transport_ctx, endpoint, identity=b"d")
    socket_io.sync_send(dealer, CancelRequest(1))
    assert recv_within(router, router=True) == (b"d", CancelRequest(1))


def test_ipc_dir_is_private_and_removed(transport_ctx: Ctx) -> None:
    with IpcDir() as ipc_dir:
        assert stat.S_IMODE(os.stat(ipc_dir.path).st_mode) == 0o700
        endpoint = ipc_dir.endpoint("frontend-0")
        assert endpoint == f"ipc://{ipc_dir.path}/frontend-0"
        router, bound = make_router(transport_ctx, endpoint)
        assert bound == endpoint
        router.close(linger=0)
    assert not os.path.exists(ipc_dir.path)
    ipc_dir.close()  # idempotent


@pytest.mark.parametrize("name", ["", "a/b", "..", "x\x00y", "n" * 200])
def test_ipc_dir_refuses_bad_names(transport_ipc_dir: IpcDir, name: str) -> None:
    with pytest.raises(ValueError):
        transport_ipc_dir.endpoint(name)


@pytest.mark.parametrize("identity", [b"", b"\x00abc", b"x" * 256])
def test_dealer_identity_must_be_valid(transport_ctx: Ctx, identity: bytes) -> None:
    with pytest.raises(ValueError, match="identity"):
        make_dealer(transport_ctx, "tcp://127.0.0.1:1", identity=identity)


@pytest.mark.parametrize(
    "options",
    [{"send_hwm_messages": 0}, {"recv_hwm_messages": -1}, {"max_message_bytes": -1},
     {"linger_ms": -1}],
)  # fmt: skip
def test_unbounded_options_are_refused(transport_ctx: Ctx, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        make_router(transport_ctx, **options)


def test_bind_failure_names_the_socket_and_address(transport_ctx: Ctx) -> None:
    _, endpoint = make_router(transport_ctx)
    with pytest.raises(zmq.ZMQError, match="frontend client: cannot bind"):
        make_router(transport_ctx, endpoint, name="frontend client")


def test_send_to_unknown_peer_raises_unroutable(transport_pair: Pair) -> None:
    router, dealer = transport_pair
    with pytest.raises(UnroutableError, match="nobody") as caught:
        socket_io.sync_send(router, CancelRequest(1), identity=b"nobody")
    assert caught.value.kind == ErrorKind.UNAVAILABLE and caught.value.retryable
    # The router is unharmed: a known peer is still reachable.
    socket_io.sync_send(dealer, CancelRequest(2))
    recv_within(router, router=True)
    socket_io.sync_send(router, CancelRequest(3), identity=b"peer-0")
    assert recv_within(dealer, router=False) == (None, CancelRequest(3))


# --------------------------------------------------------------------------- asyncio


async def _async_recv(sock: zmq.asyncio.Socket, *, router: bool) -> tuple[bytes | None, Message]:
    return await asyncio.wait_for(socket_io.async_recv(sock, router=router), ASYNC_TIMEOUT_S)


async def test_every_message_class_round_trips_over_asyncio(
    transport_async_pair: AsyncPair,
) -> None:
    router, dealer = transport_async_pair
    for message in SAMPLE_MESSAGES:
        await socket_io.async_send(dealer, message)
        identity, at_router = await _async_recv(router, router=True)
        assert identity == b"peer-0"
        assert_messages_equal(at_router, message)
        await socket_io.async_send(router, at_router, identity=identity)
        _, at_dealer = await _async_recv(dealer, router=False)
        assert_messages_equal(at_dealer, message)


async def test_async_recv_waits_for_a_message_that_is_not_there_yet(
    transport_async_pair: AsyncPair,
) -> None:
    router, dealer = transport_async_pair
    receiving = asyncio.ensure_future(_async_recv(router, router=True))
    done, _ = await asyncio.wait([receiving], timeout=0.05)
    assert not done  # nothing was sent: it must be waiting, not failing
    await socket_io.async_send(dealer, Heartbeat("d", 1, 2.0))
    assert await receiving == (b"peer-0", Heartbeat("d", 1, 2.0))


async def test_async_arrays_arrive_without_copy(transport_async_pair: AsyncPair) -> None:
    router, dealer = transport_async_pair
    array = np.arange(50_000, dtype=np.int64)
    await socket_io.async_send(dealer, InferReply(1, {"y": array}))
    _, message = await _async_recv(router, router=True)
    assert isinstance(message, InferReply)
    assert isinstance(buffer_owner(message.outputs["y"]), zmq.Frame)
    np.testing.assert_array_equal(message.outputs["y"], array)


async def test_async_malformed_message_is_rejected_and_the_loop_goes_on(
    transport_async_pair: AsyncPair,
) -> None:
    router, dealer = transport_async_pair
    await dealer.send_multipart([b"\x92\xa6cancel"])  # truncated msgpack
    await socket_io.async_send(dealer, CancelRequest(7))
    with pytest.raises(ProtocolError):
        await _async_recv(router, router=True)
    assert await _async_recv(router, router=True) == (b"peer-0", CancelRequest(7))


async def test_async_send_to_unknown_peer_raises_unroutable(
    transport_async_pair: AsyncPair,
) -> None:
    router, _ = transport_async_pair
    with pytest.raises(UnroutableError):
        await socket_io.async_send(router, CancelRequest(1), identity=b"nobody")


async def test_async_send_waits_at_the_high_water_mark_and_keeps_order(
    transport_async_ctx: zmq.asyncio.Context, transport_bind: str
) -> None:
    # Tiny HWMs make the sender hit backpressure, which exercises the awaiting send path.
    router, endpoint = make_router(
        transport_async_ctx, transport_bind, send_hwm_messages=2, recv_hwm_messages=2
    )
    dealer = make_dealer(
        transport_async_ctx, endpoint, identity=b"fast", send_hwm_messages=2, recv_hwm_messages=2
    )
    payload = np.zeros(256 * 1024, dtype=np.uint8)  # big frames fill the kernel buffers too
    count = 200

    async def produce() -> None:
        for index in range(count):
            await socket_io.async_send(dealer, InferReply(index, {"y": payload}))

    producer = asyncio.ensure_future(produce())
    done, _ = await asyncio.wait([producer], timeout=0.2)
    assert not done  # the producer is held back: nobody is receiving
    for index in range(count):
        _, message = await _async_recv(router, router=True)
        assert isinstance(message, InferReply) and message.request_id == index
    await asyncio.wait_for(producer, ASYNC_TIMEOUT_S)


def test_wildcard_binds_are_advertised_by_a_reachable_name(transport_ctx: Ctx) -> None:
    """A socket bound to every interface is announced as a host peers can connect to."""
    assert advertised_endpoint("tcp://0.0.0.0:7000", "10.0.0.2") == "tcp://10.0.0.2:7000"
    assert advertised_endpoint("tcp://[::]:7000", "node-b") == "tcp://node-b:7000"
    assert advertised_endpoint("tcp://0.0.0.0:7000") == f"tcp://{socket.gethostname()}:7000"
    for unchanged in ("tcp://127.0.0.1:7000", "tcp://10.0.0.2:7000", "ipc:///tmp/x"):
        assert advertised_endpoint(unchanged, "elsewhere") == unchanged
    router, endpoint = make_router(transport_ctx, "tcp://0.0.0.0:0", advertise_host="127.0.0.1")
    port = bound_endpoint(router).rsplit(":", 1)[1]
    assert bound_endpoint(router) == f"tcp://0.0.0.0:{port}" and port != "0"
    assert endpoint == f"tcp://127.0.0.1:{port}"
    dealer = make_dealer(transport_ctx, endpoint, identity=b"peer")
    socket_io.sync_send(dealer, Heartbeat("peer", 1, 0.0))
    identity, msg = recv_within(router, router=True)
    assert identity == b"peer" and isinstance(msg, Heartbeat)
