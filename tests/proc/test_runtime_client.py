"""zserve.Client / AsyncClient against a real frontend process: retries only where safe, client
timeouts, many threads on one connection, AsyncClient.submit/cancel, nothing at import time."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from runtime_helpers import (
    FrontendHarness,
    emulated_cluster,
    fetch,
    meta_ids,
    run_batch,
    sample,
    stats,
    wait_stats,
)

import zserve
from zserve.transport import socket_io
from zserve.transport.messages import (
    ClientHello,
    DropNotice,
    InferAnswers,
    InferReply,
    InferRequest,
)
from zserve.transport.sockets import make_router


@pytest.fixture
def frontend(tmp_path: Any) -> Iterator[FrontendHarness]:
    harness = FrontendHarness(str(tmp_path), emulated_cluster(max_queue=2))
    yield harness
    harness.close()


def test_retries_only_errors_that_prove_the_request_never_ran(frontend: FrontendHarness) -> None:
    with zserve.Client(frontend.client_address, timeout=10, max_retries=2, seed=1) as client:
        held = [client.submit("m", sample(i)) for i in range(2)]
        ids = meta_ids(frontend, 2)
        with pytest.raises(zserve.OverloadedError) as overloaded:
            client.infer("m", sample(9))
        assert not overloaded.value.may_have_run and overloaded.value.retryable
        assert client._async.retries == 2  # three attempts in all
        assert stats(frontend)["counters"]["rejected_OVERLOADED"] == 3
        # DEADLINE may have run: never retried.
        socket_io.sync_send(frontend.shard, DropNotice(ids[:1], "DEADLINE", "late"),
                        identity=b"frontend-0")
        with pytest.raises(zserve.DeadlineError) as late:
            held[0].result(10)
        assert late.value.may_have_run and not late.value.retryable
        assert client._async.retries == 2


def test_client_timeout_cancels_the_request(frontend: FrontendHarness) -> None:
    backend = frontend.backend()
    with zserve.Client(frontend.client_address, timeout=0.3, max_retries=0) as client:
        start = time.monotonic()
        # The client tells the frontend its timeout as the request's SLO, so either side may
        # call it first: the client's timer, or the frontend's deadline timer.
        with pytest.raises(zserve.DeadlineError):
            client.infer("m", sample(1))
        assert time.monotonic() - start < 5.0
        (rid,) = meta_ids(frontend, 1)
        wait_stats(frontend, lambda st: st["pending"] == 0)  # cancelled, or timed out
        assert fetch(backend, [rid]).missing == [rid]


def test_many_threads_share_one_connection(tmp_path: Any) -> None:
    h = FrontendHarness(str(tmp_path), emulated_cluster(max_queue=64))
    try:
        backend = h.backend()
        results: dict[int, float] = {}
        with zserve.Client(h.client_address, timeout=20) as client:

            def call(value: int) -> None:
                results[value] = float(client.infer("m", sample(value))["y"][0, 0])

            threads = [threading.Thread(target=call, args=(v,)) for v in range(24)]
            for thread in threads:
                thread.start()
            run_batch(backend, meta_ids(h, 24))
            for thread in threads:
                thread.join(20)
        assert results == {v: 8.0 * v for v in range(24)}
    finally:
        h.close()


def test_async_client_submit_cancel_and_torch(frontend: FrontendHarness) -> None:
    backend = frontend.backend()

    async def drive() -> None:
        async with zserve.AsyncClient(frontend.client_address, timeout=10) as client:
            first = client.submit("m", sample(1))
            second = client.submit("m", sample(2))
            ids = await asyncio.to_thread(meta_ids, frontend, 2)
            assert client.cancel(second)
            with pytest.raises(zserve.CancelledError):
                await second
            await asyncio.to_thread(run_batch, backend, ids)
            assert (await first)["y"][0, 0] == pytest.approx(8.0)
            outputs = (await first)["y"]
            assert isinstance(outputs, np.ndarray) and not outputs.flags.writeable  # zero-copy

    asyncio.run(drive())


def test_torch_tensors_are_accepted(frontend: FrontendHarness) -> None:
    torch = pytest.importorskip("torch")
    backend = frontend.backend()
    with zserve.Client(frontend.client_address, timeout=10) as client:
        future = client.submit("m", {"x": torch.full((1, 4), 3.0)})
        run_batch(backend, meta_ids(frontend, 1))
        assert future.result(10)["y"][0, 0] == pytest.approx(24.0)


# Run in a fresh interpreter: what importing zserve and building a Client leave behind, as
# the process's own threads (/proc/self/task: zmq's I/O threads are native, which
# threading.active_count() does not see) and open descriptors (/proc/self/fd: a zmq context
# holds eventfds and an epoll, a socket adds its own), compared with a baseline taken after
# numpy (a dependency whose BLAS may start threads of its own at import).
IMPORT_PROBE = """
import os, threading
import numpy

def snapshot():
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the descriptor listdir itself had open
            pass
    return set(os.listdir("/proc/self/task")), fds

tasks, fds = snapshot()
import zserve, zserve.client.async_client
client = zserve.Client("ipc:///nonexistent/socket")
tasks_now, fds_now = snapshot()
assert threading.active_count() == 1, threading.enumerate()
assert tasks_now == tasks, f"new threads: {sorted(tasks_now - tasks)}"
opened = {fd: target for fd, target in fds_now.items() if fds.get(fd) != target}
assert not opened, f"new descriptors: {opened}"
client.close()
"""


def test_import_creates_no_threads_or_sockets() -> None:
    """Neither importing zserve nor constructing a Client starts a thread (Python or native) or
    opens a descriptor (a zmq context or socket): both wait for the first request."""
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_client_announces_and_decodes_answers_in_one_message(tmp_path: Any) -> None:
    """Against a test-owned socket playing the frontend: the client says first that it accepts
    InferAnswers, then resolves every future such a message names (outputs and errors), counts
    an answer for no request in flight, and still takes the one-per-request form."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, address = make_router(ctx, f"ipc://{tmp_path}/fake-frontend")

    def receive() -> tuple[bytes, Any]:
        identity, message = socket_io.sync_recv(router, router=True)
        assert identity is not None
        return identity, message

    async def drive() -> None:
        async with zserve.AsyncClient(address, timeout=10, max_retries=0) as client:
            futures = [client.submit("m", sample(i)) for i in range(4)]
            identity, hello = await asyncio.to_thread(receive)
            assert hello == ClientHello(accepts=[InferAnswers.KIND])
            requests = [(await asyncio.to_thread(receive))[1] for _ in futures]
            assert all(isinstance(r, InferRequest) for r in requests)
            ids = [r.request_id for r in requests]
            outputs = [{"y": np.full((1, 1), i, np.float32)} for i in range(2)]
            answers = InferAnswers(ids[:2], outputs, [ids[2], 999], ["OVERLOADED", "DEADLINE"],
                                   ["busy", "nobody's"])
            socket_io.sync_send(router, answers, identity=identity)
            assert (await futures[0])["y"][0, 0] == 0.0
            assert (await futures[1])["y"][0, 0] == 1.0
            with pytest.raises(zserve.OverloadedError, match="busy"):
                await futures[2]
            socket_io.sync_send(router, InferReply(ids[3], outputs[1]), identity=identity)
            assert (await futures[3])["y"][0, 0] == 1.0
            assert client.unmatched_replies == 1 and client.in_flight == 0

    try:
        asyncio.run(drive())
    finally:
        router.close(linger=0)
        ctx.term()
