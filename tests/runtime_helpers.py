"""Helpers for the runtime tests (tests/test_runtime_*.py): a frontend process driven by the test,
which plays its supervisor, scheduler shard, rank and backends over real sockets."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import zmq

from zserve.config.cluster import ClusterConfig, parse_config, role_config
from zserve.runtime.clock import reply_to_probe
from zserve.transport import socket_io
from zserve.transport.messages import (
    BackendTable,
    BatchOutputs,
    ClockProbe,
    Hello,
    InputFetch,
    InputReply,
    Message,
    Ready,
    RequestMetaBatch,
    StatsReply,
    StatsRequest,
)
from zserve.transport.sockets import make_dealer, make_router

RECV_TIMEOUT_S = 10.0
# wait_until: how often it asks, and for how long by default.
POLL_INTERVAL_S = 0.02
WAIT_BOUND_S = 30.0
MessageT = TypeVar("MessageT", bound=Message)
T = TypeVar("T")


def recv(sock: zmq.Socket[Any], *, router: bool, timeout: float = RECV_TIMEOUT_S) -> tuple[
    bytes | None, Message
]:
    """One message, or AssertionError after ``timeout`` seconds (a hang is a failure). A
    ``ClockProbe`` to a ROUTER the test plays the rank on is answered, as the rank does."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1e3), zmq.POLLIN), "no message within the timeout"
        identity, msg = socket_io.sync_recv(sock, router=router)
        if router and isinstance(msg, ClockProbe):
            socket_io.sync_send(sock, reply_to_probe(msg), identity=identity)
            continue
        return identity, msg


def recv_type(
    sock: zmq.Socket[Any], cls: type[MessageT], *, router: bool
) -> tuple[bytes | None, MessageT]:
    """The next message of type ``cls``, skipping Hello and heartbeats."""
    while True:
        identity, msg = recv(sock, router=router)
        if isinstance(msg, cls):
            return identity, msg


def ask_frontend_stats(address: str, request: Any, identity: bytes) -> dict[str, Any]:
    """Send ``request`` (a StatsRequest or ClusterStatsRequest) to a frontend's client address
    and return the stats of its StatsReply."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = make_dealer(ctx, address, identity=identity)
    try:
        socket_io.sync_send(sock, request)
        assert sock.poll(10_000), "no StatsReply from the frontend"
        _, msg = socket_io.sync_recv(sock, router=False)
    finally:
        sock.close(linger=0)
    assert isinstance(msg, StatsReply)
    return dict(msg.stats)


def emulated_cluster(**overrides: Any) -> ClusterConfig:
    """A one-model emulated cluster config; ``overrides`` patch the model table."""
    model = {
        "name": "m",
        "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0, "input_shape": [4]},
        "slo_ms": 5000.0,
        "max_batch": 8,
        "max_queue": 64,
    }
    model.update(overrides)
    return parse_config(
        {
            "scheduler": {"shards": 1},
            "backends": {"count": 1, "device": "emulated"},
            "frontends": {"max_request_bytes": 4096},
            "cluster": {"drain_s": 1.0},
            "models": [model],
        }
    )


class FrontendHarness:
    """A real frontend process; the test owns its supervisor, shard, rank and backend sockets."""

    def __init__(self, tmp: str, cluster: ClusterConfig) -> None:
        from zserve.frontend.host import run_frontend

        self.ctx: zmq.Context[Any] = zmq.Context()
        self.control, control_ep = make_router(self.ctx, f"ipc://{tmp}/control")
        self.shard, shard_ep = make_router(self.ctx, f"ipc://{tmp}/shard")
        self.rank, rank_ep = make_router(self.ctx, f"ipc://{tmp}/rank")
        config = role_config(cluster, "frontend", 0, ipc_dir=tmp)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_frontend, args=(config, control_ep), name="test-frontend"
        )
        self.process.start()
        identity, ready = recv_type(self.control, Ready, router=True)
        assert identity == b"frontend-0"
        self.endpoints = ready.endpoints
        peers = {"rank/rank": rank_ep, "shard-0/shard": shard_ep}
        socket_io.sync_send(
            self.control, Ready("supervisor", "supervisor", os.getpid(), peers), identity=identity
        )
        # The frontend estimates its clock offset (probes to the rank) before it connects.
        recv_type(self.rank, Hello, router=True)
        recv_type(self.shard, Hello, router=True)
        self.backends: dict[str, zmq.Socket[Any]] = {}

    @property
    def client_address(self) -> str:
        return self.endpoints["client"]

    def backend_table(self, names: list[str], models: list[list[str]],
                      signatures: list[dict[str, dict[str, Any]]] | None = None) -> None:
        """Send the rank's BackendTable; ``signatures`` are what each backend registered."""
        table = BackendTable(list(range(len(names))), names, ["ipc://x"] * len(names), models,
                             signatures=signatures or [])
        socket_io.sync_send(self.rank, table, identity=b"frontend-0")

    def backend(self, name: str = "backend-0", pid: int = 1) -> zmq.Socket[Any]:
        """A backend's DEALER to the frontend's data socket (it says Hello with ``pid``)."""
        sock = self.backends.get(name)
        if sock is None:
            sock = make_dealer(self.ctx, self.endpoints["data"], identity=name.encode())
            self.backends[name] = sock
        socket_io.sync_send(sock, Hello("backend", name, pid))
        return sock

    def control_send(self, msg: Message) -> None:
        socket_io.sync_send(self.control, msg, identity=b"frontend-0")

    def close(self) -> int | None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.ctx.destroy(linger=0)  # closes every socket, including a failed test's
        return self.process.exitcode


def sample(value: float) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.full((1, 4), value, dtype=np.float32)}


def stats(h: FrontendHarness) -> dict[str, Any]:
    h.control_send(StatsRequest(reset=False))
    _, reply = recv_type(h.control, StatsReply, router=True)
    return reply.stats


def wait_stats(
    h: FrontendHarness, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0
) -> dict[str, Any]:
    """Ask the frontend for its stats until ``predicate`` holds, and return them (bounded by
    ``timeout``; the failure names the last stats seen)."""
    last: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        last.clear()
        last.update(stats(h))
        return dict(last) if predicate(last) else None

    return wait_until(reached, lambda: f"a stats condition; last stats {last}", timeout_s=timeout)


def _describe(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


def wait_until(predicate: Callable[[], T | None], what: str | Callable[[], str], *,
               timeout_s: float = WAIT_BOUND_S, interval_s: float = POLL_INTERVAL_S) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns a true value, and return that
    value; fail the test naming ``what`` after ``timeout_s`` (a callable ``what`` is called only
    then, so the message can show the state at the failure: a role's log, the last stats). A
    bounded poll of a real condition (a stats value of another process, a health endpoint, a
    counter another thread bumps) that has no event to wait on; never a sleep standing in for
    one."""
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < end, (
            f"timed out after {timeout_s:g} s waiting for {_describe(what)}")
        time.sleep(interval_s)


async def wait_until_async(predicate: Callable[[], Awaitable[T | None]],
                           what: str | Callable[[], str], *, timeout_s: float = WAIT_BOUND_S,
                           interval_s: float = POLL_INTERVAL_S) -> T:
    """``wait_until`` for a test on an event loop: ``predicate`` is awaited, and the loop runs
    the test's other tasks (its load, the code under test) between two calls."""
    end = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < end, (
            f"timed out after {timeout_s:g} s waiting for {_describe(what)}")
        await asyncio.sleep(interval_s)


def meta_ids(h: FrontendHarness, count: int) -> list[int]:
    """Receive request metadata from the frontend until ``count`` ids have arrived."""
    ids: list[int] = []
    while len(ids) < count:
        _, meta = recv_type(h.shard, RequestMetaBatch, router=True)
        assert meta.models == ["m"] * len(meta.request_ids)
        assert all(a < d <= a + 5.0 for a, d in zip(meta.arrivals, meta.deadlines, strict=True))
        ids += meta.request_ids
    return ids


def fetch(backend: zmq.Socket[Any], ids: list[int], plan_id: int = 1) -> InputReply:
    socket_io.sync_send(backend, InputFetch(plan_id, ids))
    _, reply = recv_type(backend, InputReply, router=False)
    assert reply.plan_id == plan_id
    return reply


def run_batch(backend: zmq.Socket[Any], ids: list[int], plan_id: int = 1) -> InputReply:
    """Fetch, 'execute' (y = 2 * sum(x)), push outputs: what a backend does with one plan."""
    reply = fetch(backend, ids, plan_id)
    outputs = [{"y": np.array([[2 * float(t["x"].sum())]], np.float32)} for t in reply.inputs]
    socket_io.sync_send(backend, BatchOutputs(plan_id, reply.request_ids, outputs))
    return reply


