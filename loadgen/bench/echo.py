"""A tiny stand-in for a frontend: answers ``InferRequest`` on a ROUTER after a modelled delay.

It speaks the real wire protocol (``zserve.transport.codec``), so the load generator can be
exercised and calibrated without a cluster:

- ``servers`` FCFS servers, each taking ``service_ms`` per request (an M/D/c queue under Poisson
  load, or a plain fixed delay with ``servers = 0``, meaning unlimited). Capacity is
  ``servers * 1000 / service_ms`` requests per second: a system with a known goodput.
- ``error_every``: every n-th request is answered with an ``OVERLOADED`` error instead.
- ``StatsRequest`` is answered as a backend answers it on its plan socket (every request a batch
  of one that ran ``service_ms``), so the generator's statistics path runs too.

``EchoServer`` runs it in a spawned process (``with EchoServer(...) as server: server.address``);
``zserve bench --max-rate-check`` uses one with zero delay to find the generator's own ceiling.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import multiprocessing
import select
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

import msgpack
import numpy as np
import zmq

from zserve.core.errors import ErrorKind
from zserve.transport import codec
from zserve.transport.messages import (
    InferError,
    InferReply,
    InferRequest,
    InferRequests,
    StatsReply,
    StatsRequest,
)
from zserve.transport.sockets import make_router

START_TIMEOUT_S = 30.0
STATS_WINDOW = 4096  # as a backend: the most recent "batches" a StatsReply describes
STOP_TIMEOUT_S = 5.0
_ECHO_OUTPUT = {"y": np.zeros(1, dtype=np.float32)}


@dataclass(frozen=True)
class EchoConfig:
    bind: str = "tcp://127.0.0.1:0"
    service_ms: float = 0.0
    servers: int = 0  # 0: no queueing, every request waits exactly service_ms
    error_every: int = 0  # answer every n-th request with OVERLOADED (0: never)


def serve(config: EchoConfig, ready: Any, stop: Any) -> None:
    """Serve until ``stop`` (a multiprocessing Event) is set; send the bound address on ``ready``
    (a Connection)."""
    ctx = zmq.Context()
    sock, address = make_router(ctx, config.bind, name="echo")
    ready.send(address)
    fd = cast(int, sock.getsockopt(zmq.FD))  # an int option: getsockopt is typed int | bytes
    service_s = config.service_ms / 1e3
    free_at = [0.0] * config.servers
    due: list[tuple[float, int, bytes, int, bool]] = []  # (at, seq, identity, request_id, error)
    seq = 0
    served: collections.deque[float] = collections.deque(maxlen=STATS_WINDOW)
    try:
        while not stop.is_set():
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, _, identity, request_id, error = heapq.heappop(due)
                reply: Any = (
                    InferError(request_id, ErrorKind.OVERLOADED.value, "echo: every n-th")
                    if error
                    else InferReply(request_id, _ECHO_OUTPUT)
                )
                # A client that is gone or slow: its request times out, as it should.
                with contextlib.suppress(zmq.ZMQError):
                    sock.send_multipart([identity, *codec.encode(reply)], flags=zmq.NOBLOCK)
            while True:
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                arrived = time.monotonic()
                rids = _peek_request_ids(frames[1])
                if not rids:
                    _maybe_answer_stats(sock, frames, served)
                    continue
                for rid in rids:
                    seq += 1
                    served.append(service_s)
                    if config.servers > 0:
                        k = min(range(config.servers), key=free_at.__getitem__)
                        free_at[k] = max(arrived, free_at[k]) + service_s
                        at = free_at[k]
                    else:
                        at = arrived + service_s
                    error = config.error_every > 0 and seq % config.error_every == 0
                    heapq.heappush(due, (at, seq, frames[0].bytes, rid, error))
            timeout = min(due[0][0] - time.monotonic(), 0.05) if due else 0.05
            if timeout > 0 and not (cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN):
                select.select([fd], [], [], timeout)
    finally:
        sock.close(linger=0)
        ctx.term()


def _maybe_answer_stats(
    sock: zmq.Socket[Any], frames: list[Any], served: collections.deque[float]
) -> None:
    """Answer a ``StatsRequest`` as a backend does: each request served is a "batch" of one
    that ran ``service_ms`` (so the load generator's statistics path can be tested)."""
    try:
        msg = codec.decode(frames[1:])
    except Exception:
        return
    if not isinstance(msg, StatsRequest):
        return
    stats = {"samples": {"batch_size": [1] * len(served), "run_s": list(served)}}
    if msg.reset:
        served.clear()
    with contextlib.suppress(zmq.ZMQError):
        sock.send_multipart([frames[0].bytes, *codec.encode(StatsReply("echo", stats))])


def _peek_request_ids(header: Any) -> list[int]:
    """The request ids of an ``InferRequest`` or ``InferRequests`` header (``[KIND, request_id
    or ids, ...]``; empty for anything else): the echo server reads nothing else, so that it
    costs less per request than the generator it measures."""
    try:
        fields = msgpack.unpackb(header, raw=False, strict_map_key=False)
    except Exception:
        return []
    if not isinstance(fields, list) or len(fields) < 2:
        return []
    ids = fields[1]
    if fields[0] == InferRequest.KIND:
        return [ids] if type(ids) is int else []
    if fields[0] == InferRequests.KIND and type(ids) is list:
        return [rid for rid in ids if type(rid) is int]
    return []


class EchoServer:
    """An echo server in a spawned process; ``address`` is where its ROUTER listens."""

    def __init__(self, config: EchoConfig | None = None) -> None:
        self.config = config or EchoConfig()
        mp = multiprocessing.get_context("spawn")
        self._stop = mp.Event()
        parent, child = mp.Pipe(duplex=False)
        self._proc = mp.Process(
            target=serve, args=(self.config, child, self._stop), name="zserve-echo", daemon=True
        )
        self._proc.start()
        child.close()
        try:
            if not parent.poll(START_TIMEOUT_S):
                raise RuntimeError("echo server did not start")
            self.address: str = parent.recv()
        except BaseException:
            self.close()
            raise
        finally:
            parent.close()

    def close(self) -> None:
        self._stop.set()
        self._proc.join(STOP_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(STOP_TIMEOUT_S)

    def __enter__(self) -> EchoServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
