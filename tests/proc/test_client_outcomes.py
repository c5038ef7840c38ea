"""Every future a client hands out ends (reliability defect 3): with no frontend listening, with a
frontend that dies under load, with a frontend that never answers; invalid addresses fail at
construction; requests after close() fail clearly. Real sockets and a real frontend process."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from runtime_helpers import FrontendHarness, emulated_cluster, meta_ids, sample

import zserve
from zserve.client.async_client import CONNECTION_DOWN_BOUND_S, AsyncClient, ConnectionLostError
from zserve.client.sync_client import Client
from zserve.transport import socket_io
from zserve.transport.messages import InferReply, InferRequest
from zserve.transport.sockets import MAX_FRAME_BYTES, make_router

# Slack over the bound for a loaded 2-core host to run the timer and the callbacks.
SLACK_S = 2.0


@pytest.fixture
def refused_tcp_address() -> Iterator[str]:
    """A tcp address where nothing listens: a port bound (so no one else takes it) but not
    listening, so connects are refused."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    try:
        yield f"tcp://127.0.0.1:{holder.getsockname()[1]}"
    finally:
        holder.close()


def _assert_never_ran_unavailable(outcome: BaseException | None) -> None:
    assert type(outcome) is zserve.UnavailableError, outcome
    assert not outcome.may_have_run and outcome.retryable


@pytest.mark.parametrize("where", ["ipc", "tcp"])
def test_no_listener_resolves_every_future_unavailable_within_the_bound(
    tmp_path: Any, refused_tcp_address: str, where: str
) -> None:
    address = f"ipc://{tmp_path}/nobody" if where == "ipc" else refused_tcp_address

    async def drive() -> None:
        async with AsyncClient(address, timeout=60, max_retries=2) as client:
            start = time.monotonic()
            futures = [client.submit("m", sample(i)) for i in range(50)]
            done, pending = await asyncio.wait(futures, timeout=CONNECTION_DOWN_BOUND_S + SLACK_S)
            assert not pending
            for future in done:
                _assert_never_ran_unavailable(future.exception())
            with pytest.raises(zserve.UnavailableError, match="no connection"):
                await client.infer("m", sample(1))  # retries fail at once: no waiting
            assert time.monotonic() - start < CONNECTION_DOWN_BOUND_S + SLACK_S
            assert client.in_flight == 0

    asyncio.run(drive())


def test_sync_client_no_listener_infer_and_submit_say_unavailable(tmp_path: Any) -> None:
    with Client(f"ipc://{tmp_path}/nobody", timeout=60) as client:
        start = time.monotonic()
        future = client.submit("m", sample(1))
        _assert_never_ran_unavailable(future.exception(CONNECTION_DOWN_BOUND_S + SLACK_S))
        with pytest.raises(zserve.UnavailableError):
            client.infer("m", sample(2))
        assert time.monotonic() - start < CONNECTION_DOWN_BOUND_S + SLACK_S


def test_frontend_dying_under_load_leaves_no_pending_future(tmp_path: Any) -> None:
    harness = FrontendHarness(str(tmp_path), emulated_cluster(max_queue=1000))

    async def drive() -> None:
        async with AsyncClient(harness.client_address, timeout=60, max_retries=0) as client:
            before = [client.submit("m", sample(i)) for i in range(200)]
            await asyncio.to_thread(meta_ids, harness, 1)  # the frontend is taking them
            harness.process.kill()
            await asyncio.to_thread(harness.process.join, 10)
            # The client notices the death: what was in flight may have run.
            with pytest.raises(ConnectionLostError):
                await before[-1]
            after = [client.submit("m", sample(i)) for i in range(600)]
            _, pending = await asyncio.wait(
                before + after, timeout=CONNECTION_DOWN_BOUND_S + SLACK_S
            )
            assert not pending
            assert all(isinstance(f.exception(), ConnectionLostError) for f in before)
            for future in after:  # sent while down: never ran
                _assert_never_ran_unavailable(future.exception())
            assert client.in_flight == 0

    try:
        asyncio.run(drive())
    finally:
        harness.close()


def test_submit_future_ends_at_the_client_timeout(tmp_path: Any) -> None:
    """A frontend that takes the request and never answers: the future still ends."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, address = make_router(ctx, f"ipc://{tmp_path}/silent-frontend")

    async def drive() -> None:
        async with AsyncClient(address, timeout=0.3) as client:
            future = client.submit("m", sample(1))
            await asyncio.to_thread(socket_io.sync_recv, router, router=True)  # the hello
            _, request = await asyncio.to_thread(socket_io.sync_recv, router, router=True)
            assert isinstance(request, InferRequest)
            with pytest.raises(zserve.DeadlineError):
                await asyncio.wait_for(future, 30)
            assert client.in_flight == 0

    try:
        asyncio.run(drive())
    finally:
        router.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    "address",
    [
        "garbage",
        "",
        "http://127.0.0.1:80",
        "tcp://no-such-host.invalid:7000",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:99999",
        "tcp://:7000",
        "ipc://",
    ],
)
@pytest.mark.parametrize("client_type", [Client, AsyncClient])
def test_invalid_address_fails_at_construction(
    address: str, client_type: type[Client] | type[AsyncClient]
) -> None:
    with pytest.raises(ValueError, match="invalid zserve address") as error:
        client_type(address)
    message = str(error.value)
    assert repr(address) in message and "\n" not in message


def test_request_after_close_fails_clearly(tmp_path: Any) -> None:
    from zserve.client.async_client import ClientClosedError

    address = f"ipc://{tmp_path}/nobody"
    client = Client(address)
    future = client.submit("m", sample(1))  # starts the I/O thread
    client.close()
    with pytest.raises(zserve.UnavailableError):
        future.result(10)  # closing ends what was in flight
    with pytest.raises(ClientClosedError, match=address):
        client.infer("m", sample(1))
    with pytest.raises(ClientClosedError, match=address):
        client.submit("m", sample(1))
    assert client.cancel(future) is False

    async def drive() -> None:
        async_client = AsyncClient(address)
        await async_client.close()
        with pytest.raises(ClientClosedError, match=address):
            async_client.submit("m", sample(1))
        with pytest.raises(ClientClosedError, match=address):
            await async_client.infer("m", sample(1))

    asyncio.run(drive())


def test_close_ends_a_call_waiting_to_retry(tmp_path: Any) -> None:
    """A call that close() answers UNAVAILABLE goes to retry after a backoff: it must end with
    ClientClosedError, not hang behind the I/O thread's stopped loop."""
    from zserve.client.async_client import ClientClosedError

    client = Client(f"ipc://{tmp_path}/nobody", max_retries=5, backoff_s=0.05, backoff_max_s=0.05)
    client.submit("m", sample(0))  # starts the I/O thread
    assert client._loop is not None
    # What Client.infer schedules, from this thread, so it is surely in flight before close().
    call = asyncio.run_coroutine_threadsafe(client._async.infer("m", sample(1)), client._loop)
    client.close()
    with pytest.raises(ClientClosedError):
        call.result(10)


def test_a_request_timed_out_while_unsent_is_answered_once(tmp_path: Any) -> None:
    async def drive() -> None:
        async with AsyncClient(f"ipc://{tmp_path}/nobody", max_retries=0) as client:
            early = client.submit("m", sample(1), timeout=0.1)
            late = client.submit("m", sample(2), timeout=60)
            with pytest.raises(zserve.DeadlineError):
                await early
            with pytest.raises(zserve.UnavailableError):
                await late  # the bound passed: both were in the queue it discarded
            assert client.unmatched_replies == 0 and client.in_flight == 0

    asyncio.run(drive())


def test_a_frontend_that_comes_up_after_the_bound_is_used(tmp_path: Any) -> None:
    """Past the bound the client fails requests at once, yet it keeps reconnecting (on a
    replacement socket): once a frontend listens, the next request reaches it."""
    address = f"ipc://{tmp_path}/late-frontend"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    async def drive() -> None:
        async with AsyncClient(address, timeout=60, max_retries=0) as client:
            with pytest.raises(zserve.UnavailableError):
                await client.submit("m", sample(1))  # the bound passed: the socket is replaced
            router, _ = make_router(ctx, address)
            try:
                await asyncio.to_thread(socket_io.sync_recv, router, router=True)  # its hello
                future = client.submit("m", sample(2))
                _, request = await asyncio.to_thread(socket_io.sync_recv, router, router=True)
                assert isinstance(request, InferRequest) and request.request_id == 2
                assert client.connected and not future.done()
            finally:
                router.close(linger=0)

    try:
        asyncio.run(drive())
    finally:
        ctx.term()


class _AnsweringFrontend:
    """A test-owned ROUTER playing the frontend on its own thread: it answers every
    InferRequest at once with the request's own input as its output."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self.router, self.address = make_router(ctx, address)
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="answering-frontend")
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            identity, message = socket_io.sync_recv(self.router, router=True)
            if isinstance(message, InferRequest):
                self.received += 1
                socket_io.sync_send(self.router, InferReply(message.request_id,
                                                            {"y": message.inputs["x"]}),
                                    identity=identity)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.router.close(linger=0)


def test_a_client_stalled_right_after_connecting_still_sees_its_live_frontend(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reliability defect: the client attached its socket monitor after connecting, so a
    handshake completed while its thread was held up (a loaded host) was never reported, and
    the client failed everything UNAVAILABLE against a live frontend. Its thread is stalled for
    0.2 s right after the connect here; a closed loop that runs past the connection-down bound
    must get every answer, its own."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    frontend = _AnsweringFrontend(ctx, f"ipc://{tmp_path}/frontend")
    real_connect = zmq.Socket.connect

    def stalled_connect(sock: zmq.Socket[Any], address: str) -> Any:
        result = real_connect(sock, address)
        if address == frontend.address:
            time.sleep(0.2)  # the loaded host's scheduling, made deterministic
        return result

    monkeypatch.setattr(zmq.Socket, "connect", stalled_connect)

    async def drive() -> list[float]:
        answers: list[float] = []
        async with AsyncClient(frontend.address, timeout=30, max_retries=0) as client:
            end = time.monotonic() + CONNECTION_DOWN_BOUND_S * 1.5
            while time.monotonic() < end and len(answers) < 1_000_000:
                outputs = await client.infer("m", sample(len(answers)))
                answers.append(float(outputs["y"][0, 0]))
            assert client.connected
        return answers

    try:
        answers = asyncio.run(drive())
    finally:
        frontend.close()
        ctx.term()
    assert answers == [float(i) for i in range(len(answers))]
    assert frontend.received == len(answers) >= 2


def test_an_input_over_the_frame_limit_is_refused_at_once_and_nothing_else_is_lost(
    tmp_path: Any
) -> None:
    """Reliability defect: an input larger than any zserve socket accepts (``MAX_FRAME_BYTES``)
    was sent anyway; the frontend's ZeroMQ dropped it, and the call waited out its whole timeout
    (DEADLINE). The client refuses it at once, TOO_LARGE (never ran), and keeps serving."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    frontend = _AnsweringFrontend(ctx, f"ipc://{tmp_path}/frontend")
    # np.zeros maps untouched pages: the test does not hold 256 MiB of memory.
    oversized = {"x": np.zeros((1, MAX_FRAME_BYTES // 4 + 1), dtype=np.float32)}

    async def drive() -> None:
        async with AsyncClient(frontend.address, timeout=30, max_retries=0) as client:
            assert float((await client.infer("m", sample(1)))["y"][0, 0]) == 1.0
            with pytest.raises(zserve.TooLargeError, match="frame limit") as refused:
                await asyncio.wait_for(client.infer("m", oversized), CONNECTION_DOWN_BOUND_S)
            assert not refused.value.may_have_run and not refused.value.retryable
            assert float((await client.infer("m", sample(2)))["y"][0, 0]) == 2.0
            assert client.connected and client.in_flight == 0

    try:
        asyncio.run(drive())
    finally:
        frontend.close()
        ctx.term()
    assert frontend.received == 2
