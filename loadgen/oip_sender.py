"""A load-generator worker that sends over the Open Inference Protocol instead of zserve's own
client socket: HTTP/REST with JSON tensor data, HTTP/REST with Triton's binary tensor data, or
gRPC with ``raw_input_contents``.

The worker's records, monitor and early stop are those of ``zserve.loadgen.sender`` (its
``_Sender``); only sending and receiving differ. The generator must measure the server's path,
not its own client: on a small host the two share the CPUs, so every microsecond the client
spends is taken from the cluster. Each model's request is therefore encoded once. Over HTTP the
whole HTTP/1.1 request (request line, headers, body) is built once and written as it is on a
pool of keep-alive connections driven by an ``asyncio.Protocol``, one request in flight per
connection (no pipelining, as Triton's perf_analyzer), answers parsed by llhttp
(``httptools``); the connections the plan needs are opened before the run. Over gRPC each send
starts one call on grpcio's asyncio channel. The answer settles the request: the HTTP status
with the ``kind`` of a zserve error body, or the gRPC code with its ``zserve-error-kind``
trailer; a lost connection is UNAVAILABLE. Like the native worker, it runs on the standard
library's selector loop (docs/performance.md, "Protocols", has the uvloop comparison).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import quote

import grpc
import httptools
import numpy as np

from zserve.frontend.oip import oip_inference_pb2 as pb
from zserve.frontend.oip.servers import split_address
from zserve.frontend.oip.tensors import (
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    JSON_CONTENT_TYPE,
    datatype_of,
)
from zserve.loadgen.load_plan import ERROR_INDEX, NO_ERROR, SENT
from zserve.loadgen.sender import (
    PROTOCOLS,
    SEND_BURST,
    Monitor,
    WorkerOutput,
    WorkerSpec,
    _Sender,
)
from zserve.transport.messages import TensorMap

_BAD_REPLY = ERROR_INDEX["BAD_REPLY"]
_UNAVAILABLE = ERROR_INDEX["UNAVAILABLE"]
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
CONNECT_TIMEOUT_S = 30.0
# At most this many HTTP connections are opened before a run (more open during it if needed).
MAX_PREOPENED = 256

Done = Callable[[int, int], None]
"""``done(request index, error index or NO_ERROR)``."""


def _kind_index(kind: Any) -> int:
    return ERROR_INDEX.get(kind, _BAD_REPLY) if isinstance(kind, str) else _BAD_REPLY


def encode_http_request(address: str, model: str, tensors: TensorMap, binary: bool) -> bytes:
    """The whole HTTP/1.1 request (request line, headers, body) of one inference of ``model``:
    the same bytes for every request of the model, so they are built once."""
    described = []
    for name, array in tensors.items():
        entry: dict[str, Any] = {"name": name, "shape": list(array.shape),
                                 "datatype": datatype_of(array.dtype)}
        if binary:
            entry["parameters"] = {"binary_data_size": int(array.nbytes)}
        else:
            entry["data"] = np.asarray(array).reshape(-1).tolist()
        described.append(entry)
    header = json.dumps({"inputs": described,
                         "parameters": {"binary_data_output": binary}}).encode()
    lines = [f"POST /v2/models/{quote(model, safe='')}/infer HTTP/1.1", f"Host: {address}"]
    body = header
    if binary:
        body = header + b"".join(np.ascontiguousarray(a).tobytes() for a in tensors.values())
        lines += [f"Content-Type: {BINARY_CONTENT_TYPE}", f"{HEADER_LENGTH}: {len(header)}"]
    else:
        lines.append(f"Content-Type: {JSON_CONTENT_TYPE}")
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _error_kind(status: int, body: bytes) -> int:
    """The error index of a non-200 answer: the ``kind`` of zserve's JSON error body."""
    try:
        kind = json.loads(body).get("kind")
    except (ValueError, AttributeError):
        kind = None
    return _kind_index(kind) if kind is not None else _BAD_REPLY


class _HttpConnection(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight (HTTP/1.1 without
    pipelining). Its answer is parsed by llhttp (``httptools``); a 200's body is not kept."""

    def __init__(self, channel: HttpChannel) -> None:
        self.channel = channel
        self.transport: asyncio.Transport | None = None
        self.gone: asyncio.Future[None] | None = None  # set once the connection is closed
        self.parser = httptools.HttpResponseParser(self)
        self.index = -1  # the request in flight; -1: idle
        self.done: Done | None = None
        self.error_body: list[bytes] | None = None  # a non-200 answer's body
        self.keep_alive = True
        self.complete = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP connection's
        self.gone = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._finish(_BAD_REPLY, keep=False)
            return
        if self.complete:
            self.complete = False
            status = self.parser.get_status_code()
            kind = NO_ERROR if status == 200 else _error_kind(status,
                                                              b"".join(self.error_body or ()))
            self.error_body = None
            self._finish(kind, keep=self.keep_alive)

    def connection_lost(self, exc: Exception | None) -> None:
        self.channel.lost(self)
        if self.gone is not None and not self.gone.done():
            self.gone.set_result(None)
        self._finish(_UNAVAILABLE, keep=False)

    # httptools' callbacks (only those defined are called)
    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() != 200:
            self.error_body = []
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.error_body is not None:
            self.error_body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True  # settled after feed_data: an exception here would be wrapped

    def send(self, index: int, request: bytes, done: Done) -> None:
        assert self.transport is not None
        self.index, self.done = index, done
        self.transport.write(request)

    def _finish(self, kind: int, *, keep: bool) -> None:
        """Settle the request in flight (none: an idle connection); back to the idle pool, or
        closed. Nothing is settled once the channel is closed: those requests end unanswered."""
        index, done = self.index, self.done
        if done is None:
            if not keep and self.transport is not None:
                self.transport.close()
            return
        self.index, self.done = -1, None
        if keep:
            self.channel.idle.append(self)
        elif self.transport is not None:
            self.transport.close()
        if not self.channel.closed:
            done(index, kind)


class HttpChannel:
    """POSTs to ``/v2/models/<m>/infer``, JSON or binary, over a pool of keep-alive
    connections: each request goes on an idle one, or on a new one when all are busy (the
    pool pre-opens ``connections`` before the run, so that connecting is not measured)."""

    def __init__(self, address: str, models: tuple[str, ...], inputs: dict[str, TensorMap],
                 binary: bool, connections: int = 1) -> None:
        self.host, self.port = split_address(address)
        self.requests = [encode_http_request(address, name, inputs.get(name, {}), binary)
                         for name in models]
        self.connections = connections
        self.idle: list[_HttpConnection] = []  # LIFO: the fewest connections stay warm
        self.live: set[_HttpConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    async def open(self) -> None:
        opened = await asyncio.wait_for(
            asyncio.gather(*(self._connect() for _ in range(self.connections))),
            CONNECT_TIMEOUT_S)
        self.idle.extend(opened)

    async def _connect(self) -> _HttpConnection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(lambda: _HttpConnection(self),
                                                     self.host, self.port)
        self.live.add(connection)
        return connection

    def send(self, index: int, model: int, done: Done) -> None:
        if self.idle:
            self.idle.pop().send(index, self.requests[model], done)
            return
        task = asyncio.get_running_loop().create_task(self._send_on_new(index, model, done))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send_on_new(self, index: int, model: int, done: Done) -> None:
        try:
            connection = await self._connect()
        except OSError:
            done(index, _UNAVAILABLE)
            return
        connection.send(index, self.requests[model], done)

    def lost(self, connection: _HttpConnection) -> None:
        self.live.discard(connection)
        if connection in self.idle:
            self.idle.remove(connection)

    async def close(self) -> None:
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        live = list(self.live)
        for connection in live:
            if connection.transport is not None:
                connection.transport.abort()
        # The sockets close in connection_lost, which runs on the loop: let it.
        await asyncio.gather(*(c.gone for c in live if c.gone is not None))
        self.idle.clear()


class GrpcChannel:
    """``ModelInfer`` calls on one HTTP/2 channel, the request bytes encoded once per model."""

    def __init__(self, address: str, models: tuple[str, ...],
                 inputs: dict[str, TensorMap]) -> None:
        self.requests = [self._encode(name, inputs.get(name, {})) for name in models]
        self.channel: grpc.aio.Channel | None = None
        self.call: Any = None
        self.address = address
        self.tasks: set[asyncio.Task[None]] = set()

    @staticmethod
    def _encode(model: str, tensors: TensorMap) -> bytes:
        request = pb.ModelInferRequest(model_name=model)
        for name, array in tensors.items():
            request.inputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
        return request.SerializeToString()

    async def open(self) -> None:
        """Connect before the run starts (a first connection inside it would be measured)."""
        self.channel = grpc.aio.insecure_channel(self.address)
        # No (de)serializers: the request goes as encoded, the answer is not parsed.
        self.call = self.channel.unary_unary(MODEL_INFER)
        await asyncio.wait_for(self.channel.channel_ready(), CONNECT_TIMEOUT_S)

    def send(self, index: int, model: int, done: Done) -> None:
        task = asyncio.get_running_loop().create_task(self._call(index, model, done))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _call(self, index: int, model: int, done: Done) -> None:
        try:
            # wait_for_ready: a call made while the connection is re-established waits for it
            # instead of failing at once (the server has not seen it: not a zserve answer).
            await self.call(self.requests[model], wait_for_ready=True)
        except grpc.aio.AioRpcError as error:
            trailers = dict(error.trailing_metadata() or ())
            kind = trailers.get("zserve-error-kind")
            done(index, _kind_index(kind) if kind else _UNAVAILABLE)
            return
        done(index, NO_ERROR)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.channel is not None:
            await self.channel.close()


class _OipSender(_Sender):
    """``_Sender``'s records and monitor, sending through an OIP channel."""

    def send_due_oip(self, channel: HttpChannel | GrpcChannel, now: float, done: Done) -> None:
        if self.stopped is not None:
            return
        t0, times, n, i = self.t0, self.times, self.n, self.i
        model_index, measured, counters, sent = (self.model_index, self.measured,
                                                 self.counters, self.sent)
        burst_end = i + SEND_BURST
        while i < n and i < burst_end and t0 + times[i] <= now:
            m = model_index[i]
            sent[i] = time.monotonic() - t0
            channel.send(i, m, done)
            self.outstanding += 1
            if measured[i]:
                counters[m][SENT] += 1
            i += 1
            if i == n:
                self.end_at = time.monotonic() + self.max_slo_s + self.spec.reply_grace_s
        self.i = i


def oip_send_loop(spec: WorkerSpec, start: Callable[[], float | None],
                  monitor: Monitor) -> WorkerOutput | None:
    """``send_loop`` for ``spec.protocol`` other than native. The channel connects first, then
    ``start()`` says when the run starts (its ``t0``; None: the run was called off, and the
    result is None): a spawned worker reports itself ready there and waits for the others."""
    loop = asyncio.SelectorEventLoop()
    channel = _channel(spec)
    try:
        loop.run_until_complete(channel.open())
        t0 = start()
        if t0 is None:
            return None
        return loop.run_until_complete(_serve(spec, channel, t0, monitor))
    finally:
        loop.run_until_complete(channel.close())
        loop.close()


def peak_in_flight(times_s: Any, window_s: float) -> int:
    """The most requests of a plan sent within any ``window_s``: how many are in flight at
    once at most when each is answered within ``window_s``."""
    times = np.asarray(times_s, dtype=np.float64)
    if len(times) == 0:
        return 0
    ends = np.searchsorted(times, times + window_s, side="right")
    return int((ends - np.arange(len(times))).max())


def _channel(spec: WorkerSpec) -> HttpChannel | GrpcChannel:
    plan = spec.plan
    if spec.protocol == "grpc":
        return GrpcChannel(spec.address, plan.models, spec.inputs)
    if spec.protocol in ("http-json", "http-binary"):
        slo_s = max(plan.slo_ms, default=0.0) / 1e3
        connections = min(MAX_PREOPENED, max(1, peak_in_flight(plan.times_s, slo_s)))
        return HttpChannel(spec.address, plan.models, spec.inputs,
                           spec.protocol == "http-binary", connections)
    raise ValueError(f"unknown protocol {spec.protocol!r} (one of {', '.join(PROTOCOLS)})")


async def _serve(spec: WorkerSpec, channel: HttpChannel | GrpcChannel, t0: float,
                 monitor: Monitor) -> WorkerOutput:
    sender = _OipSender(spec, t0)
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    timer: list[asyncio.TimerHandle | None] = [None]
    timer_at = [math.nan]

    def step() -> None:
        now = time.monotonic()
        if now >= sender.next_monitor:
            sender.monitor(now, monitor)
        if sender.done(now):
            if not finished.done():
                finished.set_result(None)
            return
        wake = sender.wake_at()
        if timer[0] is None or wake != timer_at[0]:
            if timer[0] is not None:
                timer[0].cancel()
            timer_at[0] = wake
            timer[0] = loop.call_at(wake, on_timer)

    def done(index: int, kind: int) -> None:
        sender._settle(index, kind, time.monotonic())
        step()

    def on_timer() -> None:
        timer[0] = None
        timer_at[0] = math.nan
        sender.send_due_oip(channel, time.monotonic(), done)
        step()

    try:
        on_timer()
        await finished
    finally:
        if timer[0] is not None:
            timer[0].cancel()
    return sender.output()
