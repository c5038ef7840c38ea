"""SocketReactor (zserve.transport.reactor) over real sockets (ipc:// in a private dir and tcp://
on loopback port 0), on the default asyncio loop and on uvloop (what the processes run).

The storm and ping-pong tests are the missed-wake-up regression tests: a send on a ZeroMQ socket
can consume the edge of its edge-triggered FD, so a message that arrived meanwhile is never
announced. Every receive below must complete without any further traffic to that socket to poke
it; a stranded message shows up as a timeout."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
import zmq
import zmq.asyncio

from zserve.errors import ProtocolError, ZServeError
from zserve.transport import socket_io
from zserve.transport.messages import CancelRequest, Heartbeat
from zserve.transport.reactor import Chunk, SocketReactor
from zserve.transport.sockets import bound_endpoint, make_dealer

Pair = tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
# Generous: a stranded message never arrives, a delivered one takes well under a millisecond.
WAIT_S = 10.0
LOOPS = ["asyncio", "uvloop"]


def _run(loop_kind: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    factory = uvloop.new_event_loop if loop_kind == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


async def _wait(event: asyncio.Event, what: Callable[[], str]) -> None:
    try:
        await asyncio.wait_for(event.wait(), WAIT_S)
    except TimeoutError:
        pytest.fail(f"stranded: {what()}")


# --------------------------------------------------------------------------- the regression tests


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_storm_in_both_directions_strands_nothing(loop_kind: str, transport_pair: Pair) -> None:
    """Requests from a timer stream and from the client's handler; replies from the server's
    handler and from later callbacks; pushes from server timers. All must arrive."""
    router, dealer = transport_pair
    requests = 1500

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = SocketReactor(loop)
        client = SocketReactor(loop)
        want_replies = {("reply", s) for s in range(requests)}
        want_replies |= {("follow-reply", s) for s in range(0, requests, 4)}
        want_pushes = {("push", s) for s in range(0, requests, 7)}
        replies: set[tuple[str, int]] = set()
        pushes: set[tuple[str, int]] = set()
        done = asyncio.Event()
        errors: list[BaseException] = []

        def check(error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)

        def reply(identity: bytes, name: str, seq: int) -> None:
            check(server.send_nowait(router, Heartbeat(name, seq, 0.0), identity))

        def on_server(chunk: Chunk) -> None:
            for identity, msg in chunk:
                assert identity == b"peer-0" and isinstance(msg, Heartbeat)
                name = "reply" if msg.name == "req" else "follow-reply"
                if msg.seq % 2:  # later, outside the handler
                    loop.call_soon(reply, identity, name, msg.seq)
                else:  # from inside the handler
                    reply(identity, name, msg.seq)
                if msg.name == "req" and msg.seq % 7 == 0:  # from a timer callback
                    loop.call_later(0, reply, identity, "push", msg.seq)

        def on_client(chunk: Chunk) -> None:
            for identity, msg in chunk:
                assert identity is None and isinstance(msg, Heartbeat)
                if msg.name == "push":
                    pushes.add((msg.name, msg.seq))
                    continue
                replies.add((msg.name, msg.seq))
                if msg.name == "reply" and msg.seq % 4 == 0:  # from inside the handler
                    check(client.send_nowait(dealer, Heartbeat("follow", msg.seq, 0.0)))
            if replies == want_replies and pushes == want_pushes:
                done.set()

        def stream(first: int) -> None:  # a timer callback, outside every handler
            for seq in range(first, min(first + 3, requests)):
                check(client.send_nowait(dealer, Heartbeat("req", seq, 0.0)))
            if first + 3 < requests:
                loop.call_later(0, stream, first + 3)

        server.watch(router, router=True, on_chunk=on_server)
        client.watch(dealer, router=False, on_chunk=on_client)
        loop.call_later(0, stream, 0)
        try:
            await _wait(done, lambda: f"{len(want_replies - replies)} replies and "
                                      f"{len(want_pushes - pushes)} pushes never arrived")
        finally:
            server.close()
            client.close()
        assert not errors
        assert replies == want_replies and pushes == want_pushes

    _run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_ping_pong_with_sends_on_the_waiting_socket(
    loop_kind: str, transport_ctx: zmq.Context[zmq.Socket[bytes]], transport_pair: Pair
) -> None:
    """One ping or pong in flight at a time, and nothing else ever sent to the socket it goes
    to, so only that message can wake its receiver. Meanwhile the receiving socket keeps
    sending (which is what can consume its FD's edge): the server to a sink peer that never
    answers; the client, on odd steps, noise the server ignores (noise reaching the server could
    wake a stranded ping, so even steps keep the client quiet). Pings come from the coroutine,
    from timers and from later callbacks; pongs from the server's handler."""
    router, dealer = transport_pair
    sink = make_dealer(transport_ctx, bound_endpoint(router), identity=b"sink")
    steps = 300
    noise_sends = 8

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = SocketReactor(loop)
        client = SocketReactor(loop)
        state: dict[str, Any] = {"seq": -1, "got": -1, "client_noise": 0, "server_noise": 0}
        sink_known = asyncio.Event()
        arrived = asyncio.Event()

        def server_noise(left: int) -> None:
            if left and server.send_nowait(router, Heartbeat("noise", left, 0.0), b"sink") is None:
                state["server_noise"] += 1
                loop.call_soon(server_noise, left - 1)

        def on_server(chunk: Chunk) -> None:
            for identity, msg in chunk:
                assert isinstance(msg, Heartbeat)
                if identity == b"sink":
                    sink_known.set()
                elif msg.name == "ping":
                    assert server.send_nowait(router, msg, identity) is None
                    loop.call_soon(server_noise, noise_sends)

        def on_client(chunk: Chunk) -> None:
            for identity, msg in chunk:
                assert identity is None and isinstance(msg, Heartbeat) and msg.name == "ping"
                state["got"] = msg.seq
                if msg.seq == state["seq"]:
                    arrived.set()

        def client_noise(left: int) -> None:
            if left and not arrived.is_set():
                state["client_noise"] += 1
                assert client.send_nowait(dealer, Heartbeat("noise", left, 0.0)) is None
                loop.call_soon(client_noise, left - 1)

        def ping(seq: int) -> None:
            assert client.send_nowait(dealer, Heartbeat("ping", seq, 0.0)) is None

        server.watch(router, router=True, on_chunk=on_server)
        client.watch(dealer, router=False, on_chunk=on_client)
        try:
            socket_io.sync_send(sink, Heartbeat("hello", 0, 0.0))
            await _wait(sink_known, lambda: "the sink's hello")
            for seq in range(steps):
                arrived.clear()
                state["seq"] = seq
                if seq % 3 == 0:
                    ping(seq)  # from the coroutine
                elif seq % 3 == 1:
                    loop.call_later(0, ping, seq)  # from a timer
                else:
                    loop.call_soon(ping, seq)
                if seq % 2:
                    loop.call_soon(client_noise, noise_sends)
                await _wait(arrived, lambda: f"pong {state['seq']} (last {state['got']})")
        finally:
            server.close()
            client.close()
            sink.close(linger=0)
        assert state["client_noise"] > 0 and state["server_noise"] > 0

    _run(loop_kind, main)


# --------------------------------------------------------------------------- chunks and errors


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_chunks_keep_order_and_respect_max_chunk(loop_kind: str, transport_pair: Pair) -> None:
    router, dealer = transport_pair
    count = 200

    async def main() -> None:
        reactor = SocketReactor()
        chunks: list[Chunk] = []
        done = asyncio.Event()

        def on_chunk(chunk: Chunk) -> None:
            chunks.append(chunk)
            if sum(len(c) for c in chunks) == count:
                done.set()

        for seq in range(count):  # queued before the socket is watched
            socket_io.sync_send(dealer, CancelRequest(seq))
        reactor.watch(router, router=True, on_chunk=on_chunk, max_chunk=16)
        try:
            await _wait(done, lambda: f"{count - sum(len(c) for c in chunks)} never arrived")
        finally:
            reactor.close()
        assert all(1 <= len(c) <= 16 for c in chunks)
        assert [m for c in chunks for m in c] == [(b"peer-0", CancelRequest(s))
                                                  for s in range(count)]

    _run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_bad_messages_and_handler_errors_do_not_stop_receiving(
    loop_kind: str, transport_pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    router, dealer = transport_pair

    async def main() -> None:
        reactor = SocketReactor()
        bad: list[ZServeError] = []
        good: list[int] = []
        first = asyncio.Event()
        done = asyncio.Event()

        def on_chunk(chunk: Chunk) -> None:
            for _, msg in chunk:
                assert isinstance(msg, CancelRequest)
                good.append(msg.request_id)
                if msg.request_id == 0:
                    first.set()
                    raise RuntimeError("handler bug")  # the rest of its chunk is lost with it
                if msg.request_id == 2:
                    done.set()

        reactor.watch(router, router=True, on_chunk=on_chunk, on_bad=bad.append)
        try:
            socket_io.sync_send(dealer, CancelRequest(0))
            await _wait(first, lambda: "the first message")
            dealer.send(b"\xc1 not msgpack")
            socket_io.sync_send(dealer, CancelRequest(1))
            dealer.send(b"")  # an empty header frame: also malformed
            socket_io.sync_send(dealer, CancelRequest(2))
            await _wait(done, lambda: f"got {good}")
        finally:
            reactor.close()
        assert good == [0, 1, 2]
        assert len(bad) == 2 and all(isinstance(e, ProtocolError) for e in bad)

    with caplog.at_level(logging.ERROR, logger="zserve.transport.reactor"):
        _run(loop_kind, main)
    assert "error handling a chunk" in caplog.text


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_send_nowait_returns_errors_instead_of_blocking_or_raising(
    loop_kind: str, transport_ctx: zmq.Context[zmq.Socket[bytes]], transport_pair: Pair,
    transport_ipc_dir: Any,
) -> None:
    router, _ = transport_pair

    async def main() -> None:
        reactor = SocketReactor()
        # Connected to an endpoint nobody binds: its queue fills and is never emptied.
        lonely = make_dealer(transport_ctx, transport_ipc_dir.endpoint("nobody"),
                             identity=b"lonely", send_hwm_messages=1)
        try:
            unroutable = reactor.send_nowait(router, CancelRequest(1), b"nobody")
            assert isinstance(unroutable, zmq.ZMQError)
            assert unroutable.errno == zmq.EHOSTUNREACH
            errors = [reactor.send_nowait(lonely, CancelRequest(2)) for _ in range(100)]
            assert any(errors) and all(isinstance(e, zmq.Again) for e in errors if e)
            lonely.close(linger=0)
            closed = reactor.send_nowait(lonely, CancelRequest(3))
            assert isinstance(closed, zmq.ZMQError) and closed.errno == zmq.ENOTSOCK
        finally:
            reactor.close()
            lonely.close(linger=0)

    _run(loop_kind, main)


# --------------------------------------------------------------------------- life cycle


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_close_removes_readers_and_stops_delivery(loop_kind: str, transport_pair: Pair) -> None:
    router, dealer = transport_pair

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reactor = SocketReactor(loop)
        got: list[Chunk] = []
        first = asyncio.Event()

        def on_chunk(chunk: Chunk) -> None:
            got.append(chunk)
            first.set()

        reactor.watch(router, router=True, on_chunk=on_chunk)
        fd = router.getsockopt(zmq.FD)
        assert reactor.watching(router)
        socket_io.sync_send(dealer, CancelRequest(1))
        await _wait(first, lambda: "the first message")
        reactor.send_nowait(router, CancelRequest(2), b"peer-0")  # leaves a drain pending
        reactor.close()
        reactor.close()  # idempotent
        assert not reactor.watching(router)
        if loop_kind == "asyncio":  # only asyncio's loop tells whether a reader was there
            assert loop.remove_reader(fd) is False
        socket_io.sync_send(dealer, CancelRequest(3))
        assert router.poll(int(WAIT_S * 1000), zmq.POLLIN)  # it is queued, and nobody takes it
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(got) == 1
        assert socket_io.sync_recv(router, router=True) == (b"peer-0", CancelRequest(3))
        with pytest.raises(RuntimeError):
            reactor.watch(router, router=True, on_chunk=on_chunk)

    _run(loop_kind, main)


def test_watch_refuses_asyncio_sockets_and_double_watches(transport_pair: Pair) -> None:
    router, _ = transport_pair

    async def main() -> None:
        reactor = SocketReactor()
        actx = zmq.asyncio.Context.shadow(router.context)
        asock = actx.socket(zmq.DEALER)
        try:
            with pytest.raises(TypeError):
                reactor.watch(asock, router=False, on_chunk=lambda chunk: None)
            reactor.watch(router, router=True, on_chunk=lambda chunk: None)
            with pytest.raises(ValueError):
                reactor.watch(router, router=True, on_chunk=lambda chunk: None)
            reactor.unwatch(router)
            reactor.unwatch(router)  # a no-op
            reactor.watch(router, router=True, on_chunk=lambda chunk: None)
        finally:
            reactor.close()
            asock.close(linger=0)

    _run("asyncio", main)
