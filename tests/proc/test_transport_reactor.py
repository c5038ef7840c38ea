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

from zserve.core.errors import ProtocolError, ZServeError
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


class _Storm:
    """Both ends of the storm: the client streams requests from timers (and follow-ups from its
    handler); the server replies from its handler, from later callbacks and from timers."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pair: Pair, requests: int) -> None:
        self.loop = loop
        self.router, self.dealer = pair
        self.requests = requests
        self.server = SocketReactor(loop)
        self.client = SocketReactor(loop)
        self.want_replies = {("reply", s) for s in range(requests)}
        self.want_replies |= {("follow-reply", s) for s in range(0, requests, 4)}
        self.want_pushes = {("push", s) for s in range(0, requests, 7)}
        self.replies: set[tuple[str, int]] = set()
        self.pushes: set[tuple[str, int]] = set()
        self.done = asyncio.Event()
        self.errors: list[BaseException] = []

    def check(self, error: BaseException | None) -> None:
        if error is not None:
            self.errors.append(error)

    def reply(self, identity: bytes, name: str, seq: int) -> None:
        self.check(self.server.send_nowait(self.router, Heartbeat(name, seq, 0.0), identity))

    def on_server(self, chunk: Chunk) -> None:
        for identity, msg in chunk:
            assert identity == b"peer-0" and isinstance(msg, Heartbeat)
            name = "reply" if msg.name == "req" else "follow-reply"
            if msg.seq % 2:  # later, outside the handler
                self.loop.call_soon(self.reply, identity, name, msg.seq)
            else:  # from inside the handler
                self.reply(identity, name, msg.seq)
            if msg.name == "req" and msg.seq % 7 == 0:  # from a timer callback
                self.loop.call_later(0, self.reply, identity, "push", msg.seq)

    def on_client(self, chunk: Chunk) -> None:
        for identity, msg in chunk:
            assert identity is None and isinstance(msg, Heartbeat)
            if msg.name == "push":
                self.pushes.add((msg.name, msg.seq))
                continue
            self.replies.add((msg.name, msg.seq))
            if msg.name == "reply" and msg.seq % 4 == 0:  # from inside the handler
                self.check(self.client.send_nowait(self.dealer, Heartbeat("follow", msg.seq, 0.0)))
        if self.replies == self.want_replies and self.pushes == self.want_pushes:
            self.done.set()

    def stream(self, first: int) -> None:  # a timer callback, outside every handler
        for seq in range(first, min(first + 3, self.requests)):
            self.check(self.client.send_nowait(self.dealer, Heartbeat("req", seq, 0.0)))
        if first + 3 < self.requests:
            self.loop.call_later(0, self.stream, first + 3)

    def missing(self) -> str:
        return (f"{len(self.want_replies - self.replies)} replies and "
                f"{len(self.want_pushes - self.pushes)} pushes never arrived")


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_storm_in_both_directions_strands_nothing(loop_kind: str, transport_pair: Pair) -> None:
    """Requests from a timer stream and from the client's handler; replies from the server's
    handler and from later callbacks; pushes from server timers. All must arrive."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        storm = _Storm(loop, transport_pair, requests=1500)
        storm.server.watch(transport_pair[0], router=True, on_chunk=storm.on_server)
        storm.client.watch(transport_pair[1], router=False, on_chunk=storm.on_client)
        loop.call_later(0, storm.stream, 0)
        try:
            await _wait(storm.done, storm.missing)
        finally:
            storm.server.close()
            storm.client.close()
        assert not storm.errors
        assert storm.replies == storm.want_replies and storm.pushes == storm.want_pushes

    _run(loop_kind, main)


class _PingPong:
    """Both ends of the ping-pong: the server answers pings and sends noise to a sink that never
    answers; the client sends pings (from several kinds of callback) and noise."""

    NOISE_SENDS = 8

    def __init__(self, loop: asyncio.AbstractEventLoop, pair: Pair) -> None:
        self.loop = loop
        self.router, self.dealer = pair
        self.server = SocketReactor(loop)
        self.client = SocketReactor(loop)
        self.seq = -1
        self.got = -1
        self.client_noise_sent = 0
        self.server_noise_sent = 0
        self.sink_known = asyncio.Event()
        self.arrived = asyncio.Event()

    def server_noise(self, left: int) -> None:
        if left and self.server.send_nowait(
                self.router, Heartbeat("noise", left, 0.0), b"sink") is None:
            self.server_noise_sent += 1
            self.loop.call_soon(self.server_noise, left - 1)

    def on_server(self, chunk: Chunk) -> None:
        for identity, msg in chunk:
            assert isinstance(msg, Heartbeat)
            if identity == b"sink":
                self.sink_known.set()
            elif msg.name == "ping":
                assert self.server.send_nowait(self.router, msg, identity) is None
                self.loop.call_soon(self.server_noise, self.NOISE_SENDS)

    def on_client(self, chunk: Chunk) -> None:
        for identity, msg in chunk:
            assert identity is None and isinstance(msg, Heartbeat) and msg.name == "ping"
            self.got = msg.seq
            if msg.seq == self.seq:
                self.arrived.set()

    def client_noise(self, left: int) -> None:
        if left and not self.arrived.is_set():
            self.client_noise_sent += 1
            assert self.client.send_nowait(self.dealer, Heartbeat("noise", left, 0.0)) is None
            self.loop.call_soon(self.client_noise, left - 1)

    def ping(self, seq: int) -> None:
        assert self.client.send_nowait(self.dealer, Heartbeat("ping", seq, 0.0)) is None

    def step(self, seq: int) -> None:
        """Send ping ``seq`` from the coroutine, a timer or a later callback; noise on odd
        steps."""
        self.arrived.clear()
        self.seq = seq
        if seq % 3 == 0:
            self.ping(seq)  # from the coroutine
        elif seq % 3 == 1:
            self.loop.call_later(0, self.ping, seq)  # from a timer
        else:
            self.loop.call_soon(self.ping, seq)
        if seq % 2:
            self.loop.call_soon(self.client_noise, self.NOISE_SENDS)


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

    async def main() -> None:
        game = _PingPong(asyncio.get_running_loop(), transport_pair)
        game.server.watch(router, router=True, on_chunk=game.on_server)
        game.client.watch(dealer, router=False, on_chunk=game.on_client)
        try:
            socket_io.sync_send(sink, Heartbeat("hello", 0, 0.0))
            await _wait(game.sink_known, lambda: "the sink's hello")
            for seq in range(steps):
                game.step(seq)
                await _wait(game.arrived, lambda: f"pong {game.seq} (last {game.got})")
        finally:
            game.server.close()
            game.client.close()
            sink.close(linger=0)
        assert game.client_noise_sent > 0 and game.server_noise_sent > 0

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
        fd = int(router.getsockopt(zmq.FD))
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


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_raw_frame_watch_hands_over_whole_messages_in_order(
    loop_kind: str, transport_pair: Pair
) -> None:
    """``watch_frames``: each message's frames (a ROUTER's identity first), undecoded, in
    order, in chunks of at most ``max_chunk``; replies through ``send_frames`` strand nothing."""
    router, dealer = transport_pair
    count = 300

    async def main() -> None:
        reactor = SocketReactor()
        server = SocketReactor()
        received: list[list[bytes]] = []
        sizes: list[int] = []
        echoed: list[bytes] = []
        done = asyncio.Event()

        def on_router(messages: list[list[zmq.Frame]]) -> None:
            sizes.append(len(messages))
            for frames in messages:
                received.append([f.bytes for f in frames])
                error = server.send_frames(router, [frames[0], b"echo", frames[2]])
                assert error is None

        def on_dealer(messages: list[list[zmq.Frame]]) -> None:
            for frames in messages:
                assert frames[0].bytes == b"echo"
                echoed.append(frames[1].bytes)
            if len(echoed) == count:
                done.set()

        for seq in range(count // 2):  # half queued before the watch, half after
            dealer.send_multipart([b"head", str(seq).encode()])
        server.watch_frames(router, on_frames=on_router, max_chunk=32)
        reactor.watch_frames(dealer, on_frames=on_dealer)
        for seq in range(count // 2, count):
            assert reactor.send_frames(dealer, [b"head", str(seq).encode()]) is None
        try:
            await _wait(done, lambda: f"{count - len(echoed)} echoes never arrived")
        finally:
            reactor.close()
            server.close()
        assert received == [[b"peer-0", b"head", str(s).encode()] for s in range(count)]
        assert echoed == [str(s).encode() for s in range(count)]
        assert all(1 <= size <= 32 for size in sizes)

    _run(loop_kind, main)
