"""Request limits of the frontend's OIP servers (docs/security.md, "Request limits").

A real ``FrontendCore`` and ``OipBridge`` behind the real HTTP and gRPC servers
(``zserve.frontend.oip.servers.OipServers``) on kernel-chosen loopback ports, spoken to over raw
sockets (HTTP) and a grpcio channel. The bridge admits into a list (``Served.admitted``): these
tests are about what the servers refuse before admission, so nothing past it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zserve.config.cluster import ConfigError, parse_config
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.frontend.core import FrontendCore
from zserve.frontend.metrics import ClusterCollector
from zserve.frontend.oip import oip_inference_pb2 as pb
from zserve.frontend.oip.bridge import OipBridge
from zserve.frontend.oip.http_server import BODY_SLACK_BYTES, http_body_bound
from zserve.frontend.oip.servers import OipServers, grpc_message_bound
from zserve.transport.messages import InferRequest

# Generous bounds for a loaded 2-core host: how long a test waits for the server's answer.
ANSWER_BOUND_S = 10.0
# The timeouts the servers are configured with here (small, so the tests run fast).
HEADER_TIMEOUT_S = 0.4
BODY_TIMEOUT_S = 0.6
# The slow client sends one byte this often: well inside each timeout, so a per-read timeout
# would never fire.
TRICKLE_INTERVAL_S = 0.05
MAX_REQUEST_BYTES = 1 << 20
# Model m: float32[4] per row, at most 16 rows (the emulated default shape).
M_SIGNATURE = ModelSignature("m", (TensorSpec("x", "float32", (4,)),),
                             (TensorSpec("y", "float32", (1,)),))
INFER_PATH = "/v2/models/m/infer"


@dataclass
class Served:
    core: FrontendCore
    servers: OipServers
    http_port: int
    grpc_target: str
    admitted: list[InferRequest]
    arrived: asyncio.Event  # set on each admission

    async def admissions(self, count: int) -> None:
        """Return once ``count`` requests have been admitted (bounded)."""
        async def wait() -> None:
            while len(self.admitted) < count:
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(wait(), ANSWER_BOUND_S)


def _cluster(frontends: dict[str, Any]) -> Any:
    return parse_config({
        "frontends": {"http_addresses": ["127.0.0.1:0"], "grpc_addresses": ["127.0.0.1:0"],
                      "max_request_bytes": MAX_REQUEST_BYTES, **frontends},
        "models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 1.0},
                    "max_batch": 16}],
    })


@contextlib.asynccontextmanager
async def serving(**frontends: Any) -> AsyncIterator[Served]:
    """Both OIP servers of one frontend, its model's signature registered as a backend's
    registration would."""
    cluster = _cluster(frontends)
    core = FrontendCore(name="frontend-0", cluster=cluster, index=0, data_address="ipc://d",
                        profiles={"m": None})
    core.models["m"].set_signature(M_SIGNATURE.to_dict(), MAX_REQUEST_BYTES)
    admitted: list[InferRequest] = []
    arrived = asyncio.Event()

    def admit(requests: list[InferRequest]) -> None:
        admitted.extend(requests)
        arrived.set()

    bridge = OipBridge(core, admit, lambda request_id: None)
    bridge.open(asyncio.get_running_loop())
    servers = OipServers(bridge, http="127.0.0.1:0", grpc_address="127.0.0.1:0",
                         max_request_bytes=MAX_REQUEST_BYTES)
    endpoints = await servers.start()
    try:
        yield Served(core, servers, int(endpoints["http"].rsplit(":", 1)[1]),
                     endpoints["grpc"], admitted, arrived)
    finally:
        bridge.close("test over")
        await servers.stop()


def _refused(core: FrontendCore) -> dict[str, float]:
    """``zserve_http_refused_total`` by reason, as a Prometheus scrape renders it."""
    collector = ClusterCollector("frontend-0", ["m"], lambda: {**core.stats(), "cluster": {}})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "zserve_http_refused"
            for sample in family.samples}


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer: status, headers (lower-case names) and body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_BOUND_S)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines if line)
    headers = {name.lower(): value for name, value in headers.items()}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])),
                                  ANSWER_BOUND_S)
    return int(status_line.split()[1]), headers, body


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes the connection (bounded)."""
    return await asyncio.wait_for(reader.read(), ANSWER_BOUND_S)


def _post_head(length: int | None) -> bytes:
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    return (f"POST {INFER_PATH} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n\r\n").encode()


# --------------------------------------------------------------------------- derived bounds


def _worst_data(tensor: TensorSpec, rows: int) -> Any:
    """The longest JSON data of ``rows`` rows of ``tensor`` Python's encoder writes: every
    value the longest text of its type, nested to the full shape."""
    dtype = np.dtype(tensor.dtype)
    data: Any = -2.2250738585072014e-308 if dtype.kind == "f" else (
        False if dtype.kind == "b" else int(np.iinfo(dtype).min))
    for size in reversed([rows, *(int(d) for d in tensor.shape if d is not None)]):
        data = [data] * size
    return data


def _worst_json_body(signature: ModelSignature, rows: int) -> bytes:
    return json.dumps({"inputs": [
        {"name": t.name, "shape": [rows, *t.shape], "datatype": "FP32",
         "data": _worst_data(t, rows)} for t in signature.inputs]}).encode()


def test_body_bound_is_the_largest_request_a_signature_accepts() -> None:
    signature = ModelSignature("s", (TensorSpec("image", "float32", (3, 4)),
                                     TensorSpec("mask", "uint8", (2,))), ())
    # One row: 12 float32 (48 bytes) and 2 uint8; as JSON text 12 x 26 + 2 x 5 characters of
    # values and 4 + 1 arrays of 4 characters each: 342. Eight rows, and one array per input.
    text = 8 * 342 + 2 * 4
    assert http_body_bound(signature, 8, MAX_REQUEST_BYTES) == (
        math.ceil(text * 1.25) + BODY_SLACK_BYTES)
    assert sum(len(json.dumps(_worst_data(t, 8))) for t in signature.inputs) <= text
    # max_request_bytes admits two rows of 50 bytes: the bound is two rows' text.
    assert http_body_bound(signature, 8, 100) == (
        math.ceil((2 * 342 + 8) * 1.25) + BODY_SLACK_BYTES)
    for dtype in ("bool", "int8", "int64", "uint64", "float16", "float64"):
        one = ModelSignature("t", (TensorSpec("x", dtype, (5, 3)),), ())
        data_text = len(json.dumps(_worst_data(one.inputs[0], 4)))
        assert data_text + 4 <= http_body_bound(one, 4, MAX_REQUEST_BYTES) - BODY_SLACK_BYTES
        assert len(_worst_json_body(one, 4)) <= http_body_bound(one, 4, MAX_REQUEST_BYTES)


def test_grpc_bound_is_the_largest_request_the_file_tells() -> None:
    cluster = _cluster({})
    # m: 16 rows of float32[4], as raw bytes.
    assert grpc_message_bound(cluster.models, MAX_REQUEST_BYTES) == 16 * 16 + BODY_SLACK_BYTES
    onnx = parse_config({"models": [{"name": "o", "builtin": "cnn"}]})
    assert grpc_message_bound(onnx.models, 4096) == 4096 + BODY_SLACK_BYTES


def test_limit_keys_are_validated_naming_the_key() -> None:
    for frontends, message in (
            ({"http_max_connections": 0}, "frontends.http_max_connections: must be >= 1"),
            ({"http_body_timeout_s": 0.0}, "frontends.http_body_timeout_s: must be a finite"),
            ({"http_header_timeout_s": 80.0},
             "frontends.http_header_timeout_s: must be <= http_idle_timeout_s (75)"),
            ({"grpc_max_message_bytes": "1MB"},
             "frontends.grpc_max_message_bytes: must be an integer")):
        with pytest.raises(ConfigError) as raised:
            _cluster(frontends)
        assert str(raised.value).startswith(message), str(raised.value)
        assert "\n" not in str(raised.value)


# --------------------------------------------------------------------------- bodies


async def test_body_over_the_bound_is_refused_by_its_length_before_it_is_sent() -> None:
    async with serving() as served:
        reader, writer = await _connect(served.http_port)
        writer.write(_post_head(100 * 1024 * 1024))  # no body: the answer must not need one
        status, headers, body = await _answer(reader)
        assert status == 413
        assert headers["connection"] == "close"
        assert json.loads(body)["kind"] == "TOO_LARGE"
        bound = http_body_bound(M_SIGNATURE, 16, MAX_REQUEST_BYTES)
        assert f"over {bound} bytes" in json.loads(body)["error"]
        writer.close()
        assert _refused(served.core) == {"timeout": 0, "too_large": 1, "connections": 0}
        assert served.admitted == []


async def test_chunked_body_is_refused_once_past_the_bound() -> None:
    async with serving() as served:
        bound = http_body_bound(M_SIGNATURE, 16, MAX_REQUEST_BYTES)
        reader, writer = await _connect(served.http_port)
        writer.write(_post_head(None))
        chunk = b"[" * 16384
        for _ in range(bound // len(chunk) + 2):  # just past the bound, never ended
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, headers, body = await _answer(reader)
        assert (status, headers["connection"]) == (413, "close")
        assert json.loads(body)["kind"] == "TOO_LARGE"
        assert await _closed(reader) == b""
        writer.close()
        assert _refused(served.core)["too_large"] == 1


async def test_body_within_the_bound_is_admitted() -> None:
    async with serving() as served:
        request = json.dumps({"inputs": [{"name": "x", "shape": [16, 4], "datatype": "FP32",
                                          "data": [0.5] * 64}]}).encode()
        _reader, writer = await _connect(served.http_port)
        writer.write(_post_head(len(request)) + request)
        await served.admissions(1)
        assert served.admitted[0].inputs["x"].shape == (16, 4)
        writer.close()
        assert _refused(served.core)["too_large"] == 0


# --------------------------------------------------------------------------- slow clients


async def _trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Send ``data`` one byte every ``TRICKLE_INTERVAL_S`` (a slowloris client) until the server
    closes the connection."""
    with contextlib.suppress(ConnectionError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(TRICKLE_INTERVAL_S)


async def test_slow_head_is_answered_408_and_closed_within_its_timeout() -> None:
    async with serving(http_header_timeout_s=HEADER_TIMEOUT_S) as served:
        reader, writer = await _connect(served.http_port)
        started = time.monotonic()
        trickle = asyncio.create_task(_trickle(writer, _post_head(10) * 100))
        answer = await _closed(reader)
        elapsed = time.monotonic() - started
        trickle.cancel()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
        assert HEADER_TIMEOUT_S <= elapsed < HEADER_TIMEOUT_S + ANSWER_BOUND_S / 2
        assert _refused(served.core)["timeout"] == 1


async def test_slow_body_is_answered_408_and_closed_within_its_timeout() -> None:
    async with serving(http_body_timeout_s=BODY_TIMEOUT_S) as served:
        reader, writer = await _connect(served.http_port)
        writer.write(_post_head(1000))
        started = time.monotonic()
        trickle = asyncio.create_task(_trickle(writer, b" " * 1000))
        status, headers, body = await _answer(reader)
        assert await _closed(reader) == b""
        elapsed = time.monotonic() - started
        trickle.cancel()
        writer.close()
        assert (status, headers["connection"]) == (408, "close"), body
        assert BODY_TIMEOUT_S <= elapsed < BODY_TIMEOUT_S + ANSWER_BOUND_S / 2
        assert _refused(served.core)["timeout"] == 1
        assert served.admitted == []


async def test_idle_connection_is_closed_after_its_timeout() -> None:
    async with serving(http_header_timeout_s=0.2, http_idle_timeout_s=0.5) as served:
        reader, writer = await _connect(served.http_port)
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await _answer(reader))[0] == 200
        answered = time.monotonic()
        assert await _closed(reader) == b""  # nothing more sent: closed, no answer
        assert time.monotonic() - answered >= 0.5
        writer.close()
        assert _refused(served.core)["timeout"] == 0


# --------------------------------------------------------------------------- connections


async def test_connection_past_the_cap_is_answered_503_and_closed() -> None:
    async with serving(http_max_connections=3) as served:
        held = []
        for _ in range(3):
            reader, writer = await _connect(served.http_port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await _answer(reader))[0] == 200  # open and kept alive
            held.append(writer)
        reader, writer = await _connect(served.http_port)
        status, headers, body = await _answer(reader)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert json.loads(body)["kind"] == "UNAVAILABLE"
        assert await _closed(reader) == b""
        writer.close()
        for kept in held:
            kept.close()
        assert _refused(served.core) == {"timeout": 0, "too_large": 0, "connections": 1}


# --------------------------------------------------------------------------- gRPC


def _grpc_request(rows: int) -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[rows, 4])
    return pb.ModelInferRequest(model_name="m", inputs=[tensor],
                                raw_input_contents=[np.zeros((rows, 4), np.float32).tobytes()])


async def test_grpc_message_over_the_bound_is_resource_exhausted() -> None:
    async with serving() as served, grpc.aio.insecure_channel(served.grpc_target) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await infer(_grpc_request(BODY_SLACK_BYTES // 16 + 16), timeout=ANSWER_BOUND_S)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert served.admitted == []


async def test_grpc_rpcs_past_the_cap_are_resource_exhausted() -> None:
    async with serving(grpc_max_concurrent_rpcs=2) as served, grpc.aio.insecure_channel(
            served.grpc_target) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        # Admitted, never answered: they stay in flight.
        pending = [infer(_grpc_request(1), timeout=ANSWER_BOUND_S) for _ in range(2)]
        await served.admissions(2)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await infer(_grpc_request(1), timeout=ANSWER_BOUND_S)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in pending:
            call.cancel()

