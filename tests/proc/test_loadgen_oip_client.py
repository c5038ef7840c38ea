"""The load generator's HTTP client (``zserve.loadgen.oip_sender.HttpChannel``) against a real
aiohttp server on the test's loop: the pre-encoded request is one the frontend's decoder reads;
each answer settles its request by status and error kind; a connection carries one request at a
time, a new one opens when all are busy, a lost one settles its request UNAVAILABLE and leaves
the pool; ``Connection: close`` is honoured."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httptools
import numpy as np
import pytest
from aiohttp import web

from zserve.frontend.oip.tensors import HEADER_LENGTH, decode_http_body
from zserve.loadgen.load_plan import ERROR_INDEX, NO_ERROR
from zserve.loadgen.oip_sender import HttpChannel, encode_http_request, peak_in_flight

INPUTS = {"x": np.arange(4, dtype=np.float32).reshape(1, 4)}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Request:
    """httptools' request callbacks: what a server would read of the encoded request."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


@pytest.mark.parametrize("binary", [True, False])
def test_the_encoded_request_is_one_http_request_the_frontend_decodes(binary: bool) -> None:
    parsed = _Request()
    parser = httptools.HttpRequestParser(parsed)
    parser.feed_data(encode_http_request("127.0.0.1:8000", "a/b", INPUTS, binary))
    assert parsed.complete and parser.get_method() == b"POST"
    assert parsed.url == b"/v2/models/a%2Fb/infer" and parser.should_keep_alive()
    assert parsed.headers["host"] == "127.0.0.1:8000"
    assert int(parsed.headers["content-length"]) == len(parsed.body)
    header_length = parsed.headers.get(HEADER_LENGTH.lower())
    assert (header_length is not None) == binary
    request = decode_http_body(parsed.body, int(header_length) if header_length else None)
    np.testing.assert_array_equal(request.inputs["x"], INPUTS["x"])
    assert request.binary_outputs == binary


def test_peak_in_flight_counts_the_most_sends_within_a_window() -> None:
    times = np.array([0.0, 0.01, 0.02, 0.5, 0.505, 0.51, 0.515, 2.0])
    assert peak_in_flight(times, 0.025) == 4
    assert peak_in_flight(times, 0.0) == 1
    assert peak_in_flight(np.array([]), 1.0) == 0


async def _server(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", handler)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def served() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def serve(handler: Handler) -> str:
        runner, address = await _server(handler)
        runners.append(runner)
        return address

    yield serve
    for runner in runners:
        await runner.cleanup()


class _Settled:
    """The ``done`` callback: each request's error index, and a future per request."""

    def __init__(self) -> None:
        self.kinds: dict[int, int] = {}
        self.waiting: dict[int, asyncio.Future[int]] = {}

    def future(self, index: int) -> asyncio.Future[int]:
        return self.waiting.setdefault(index, asyncio.get_running_loop().create_future())

    def __call__(self, index: int, kind: int) -> None:
        assert index not in self.kinds, f"request {index} settled twice"
        self.kinds[index] = kind
        self.future(index).set_result(kind)

    async def all(self, count: int) -> list[int]:
        return list(await asyncio.gather(*(self.future(i) for i in range(count))))



@contextlib.asynccontextmanager
async def _open(address: str, models: tuple[str, ...] = ("m",), *, binary: bool = True,
                connections: int = 1) -> AsyncIterator[HttpChannel]:
    """An opened HttpChannel on ``address`` sending INPUTS for each model, closed on exit."""
    channel = HttpChannel(address, models, {m: INPUTS for m in models}, binary=binary,
                          connections=connections)
    await channel.open()
    try:
        yield channel
    finally:
        await channel.close()

async def test_each_answer_settles_its_request_by_status_and_kind(
        served: Callable[[Handler], Awaitable[str]]) -> None:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        model = request.match_info["model"]
        if model == "busy":
            return web.json_response({"error": "queue full", "kind": "OVERLOADED"}, status=429)
        if model == "odd":
            return web.Response(status=502, text="bad gateway")
        if model == "alien":
            return web.json_response({"kind": "NOT_A_KIND"}, status=500)
        return web.json_response({"model_name": model, "outputs": []})

    address = await served(handler)
    models = ("ok", "busy", "odd", "alien")
    settled = _Settled()
    async with _open(address, models) as channel:
        for index in range(len(models)):
            channel.send(index, index, settled)
            await settled.future(index)  # one connection: sent one after the other
        assert await settled.all(4) == [NO_ERROR, ERROR_INDEX["OVERLOADED"],
                                        ERROR_INDEX["BAD_REPLY"], ERROR_INDEX["BAD_REPLY"]]
        assert len(channel.live) == 1 and len(channel.idle) == 1  # kept alive throughout


async def test_one_request_per_connection_and_a_new_one_when_all_are_busy(
        served: Callable[[Handler], Awaitable[str]]) -> None:
    """Five requests at once on a pool of two: the server holds each answer until all five
    arrived, so they can only arrive on five connections."""
    arrived: list[tuple[str, int]] = []
    all_arrived = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        assert request.transport is not None
        arrived.append(request.transport.get_extra_info("peername"))
        if len(arrived) == 5:
            all_arrived.set()
        await all_arrived.wait()
        return web.json_response({})

    address = await served(handler)
    settled = _Settled()
    async with _open(address, binary=False, connections=2) as channel:
        assert len(channel.idle) == 2
        for index in range(5):
            channel.send(index, 0, settled)
        assert await settled.all(5) == [NO_ERROR] * 5
        assert len(set(arrived)) == 5
        assert len(channel.idle) == len(channel.live) == 5


async def test_a_connection_lost_mid_request_settles_it_unavailable_and_leaves_the_pool(
        served: Callable[[Handler], Awaitable[str]]) -> None:
    async def handler(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.abort()
        raise asyncio.CancelledError

    address = await served(handler)
    settled = _Settled()
    async with _open(address) as channel:
        channel.send(0, 0, settled)
        assert await settled.all(1) == [ERROR_INDEX["UNAVAILABLE"]]
        assert not channel.live and not channel.idle


async def test_connection_close_is_honoured(
        served: Callable[[Handler], Awaitable[str]]) -> None:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({}, headers={"Connection": "close"})

    address = await served(handler)
    settled = _Settled()
    async with _open(address) as channel:
        channel.send(0, 0, settled)
        channel.send(1, 0, settled)  # the pool's one connection is busy: a new one
        assert await settled.all(2) == [NO_ERROR, NO_ERROR]
        assert not channel.idle  # neither went back to the pool


async def test_no_server_settles_unavailable() -> None:
    with socket.socket() as probe:  # a port nothing listens on (bound, never listening)
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
        settled = _Settled()
        async with _open(address, connections=0) as channel:
            channel.send(0, 0, settled)
            assert await settled.all(1) == [ERROR_INDEX["UNAVAILABLE"]]


async def test_requests_in_flight_at_close_stay_unanswered(
        served: Callable[[Handler], Awaitable[str]]) -> None:
    """The run is over: a request still in flight ends as the sender's TIMEOUT, not as an
    error the client made up."""
    got, release = asyncio.Event(), asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        got.set()
        await release.wait()  # no answer before the channel is closed
        return web.json_response({})

    address = await served(handler)
    channel = HttpChannel(address, ("m",), {"m": INPUTS}, binary=True)
    settled = _Settled()
    await channel.open()
    channel.send(0, 0, settled)
    await got.wait()
    await channel.close()
    release.set()  # the server's handler may end (its connection is gone)
    assert settled.kinds == {}
