"""A load-generator worker that sends over the Open Inference Protocol instead of zserve's own
client socket: HTTP/REST with JSON tensor data, HTTP/REST with Triton's binary tensor data, or
gRPC with ``raw_input_contents``.

The worker's records, monitor and early stop are those of ``zserve.loadgen.sender`` (its
``_Sender``); only sending and receiving differ. Each model's request body is encoded once (the
same inputs every time, as the native sender does); each send starts one call on the worker's
loop (aiohttp's client, grpcio's asyncio channel), never waiting for an answer to send the next,
and the call's end settles the request: the HTTP status with the ``kind`` of a zserve error body,
or the gRPC code with its ``zserve-error-kind`` trailer. Like the native worker, it runs on the
standard library's selector loop (microsecond timers).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import grpc
import numpy as np

from zserve import oip_inference_pb2 as pb
from zserve.loadgen.load_plan import ERROR_INDEX, NO_ERROR, SENT
from zserve.loadgen.sender import (
    PROTOCOLS,
    SEND_BURST,
    Monitor,
    WorkerOutput,
    WorkerSpec,
    _Sender,
)
from zserve.oip_tensors import HEADER_LENGTH, datatype_of
from zserve.transport.messages import TensorMap

_BAD_REPLY = ERROR_INDEX["BAD_REPLY"]
_UNAVAILABLE = ERROR_INDEX["UNAVAILABLE"]
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
CONNECT_TIMEOUT_S = 30.0

Done = Callable[[int, int], None]
"""``done(request index, error index or NO_ERROR)``."""


def _kind_index(kind: Any) -> int:
    return ERROR_INDEX.get(kind, _BAD_REPLY) if isinstance(kind, str) else _BAD_REPLY


class HttpChannel:
    """POSTs to ``/v2/models/<m>/infer``, JSON or binary, over a pool of keep-alive
    connections (HTTP/1.1: one connection per request in flight)."""

    def __init__(self, address: str, models: tuple[str, ...], inputs: dict[str, TensorMap],
                 binary: bool) -> None:
        self.requests = [self._encode(address, name, inputs.get(name, {}), binary)
                         for name in models]
        self.session: aiohttp.ClientSession | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    @staticmethod
    def _encode(address: str, model: str, tensors: TensorMap,
                binary: bool) -> tuple[str, bytes, dict[str, str]]:
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
        headers = {"Content-Type": "application/json"}
        body = header
        if binary:
            body = header + b"".join(np.ascontiguousarray(a).tobytes() for a in tensors.values())
            headers = {"Content-Type": "application/octet-stream",
                       HEADER_LENGTH: str(len(header))}
        return f"http://{address}/v2/models/{model}/infer", body, headers

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    def send(self, index: int, model: int, done: Done) -> None:
        task = asyncio.get_running_loop().create_task(self._post(index, model, done))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _post(self, index: int, model: int, done: Done) -> None:
        url, body, headers = self.requests[model]
        assert self.session is not None
        try:
            async with self.session.post(url, data=body, headers=headers) as response:
                answer = await response.read()
                status = response.status
        except (aiohttp.ClientError, OSError):
            done(index, _UNAVAILABLE)
            return
        if status == 200:
            done(index, NO_ERROR)
            return
        try:
            kind = json.loads(answer).get("kind")
        except ValueError:
            kind = None
        done(index, _kind_index(kind))

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.session is not None:
            await self.session.close()


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


def oip_send_loop(spec: WorkerSpec, t0: float, monitor: Monitor) -> WorkerOutput:
    """``send_loop`` for ``spec.protocol`` other than native."""
    loop = asyncio.SelectorEventLoop()
    try:
        return loop.run_until_complete(_serve(spec, t0, monitor))
    finally:
        loop.close()


def _channel(spec: WorkerSpec) -> HttpChannel | GrpcChannel:
    models = spec.plan.models
    if spec.protocol == "grpc":
        return GrpcChannel(spec.address, models, spec.inputs)
    if spec.protocol in ("http-json", "http-binary"):
        return HttpChannel(spec.address, models, spec.inputs, spec.protocol == "http-binary")
    raise ValueError(f"unknown protocol {spec.protocol!r} (one of {', '.join(PROTOCOLS)})")


async def _serve(spec: WorkerSpec, t0: float, monitor: Monitor) -> WorkerOutput:
    sender = _OipSender(spec, t0)
    channel = _channel(spec)
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
        await channel.open()
        on_timer()
        await finished
    finally:
        if timer[0] is not None:
            timer[0].cancel()
        await channel.close()
    return sender.output()
