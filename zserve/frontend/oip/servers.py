"""The frontend's Open Inference Protocol servers: start and stop them on the frontend's loop.

``OipServers(bridge, http=..., grpc=...)`` binds the HTTP/REST server (aiohttp) and the gRPC
server (grpcio's asyncio server) on the addresses of ``[frontends] http_addresses`` /
``grpc_addresses`` (``host:port``; port 0: the kernel picks one, read back into the endpoints the
frontend announces). Neither starts unless configured. The frontend host starts them before it
announces its endpoints (requests that come before it is connected are answered
``UNAVAILABLE``) and stops them at the end of its drain, after every request has its answer.

Both run under the request limits of ``[frontends]`` (docs/security.md, "Request limits"): the
HTTP server's are ``zserve.frontend.oip.http_server``'s (each connection a ``LimitedConnection``);
the gRPC server's are grpcio's options, fixed when it starts: the largest message
(``grpc_message_bound``:
the largest request a configured model accepts, where the file alone tells its inputs), the
concurrent RPCs, the HTTP/2 handshake's timeout and the idle connection's.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from aiohttp import web

from zserve.config.cluster import FrontendsConfig, ModelConfig
from zserve.core.errors import ZServeError
from zserve.frontend.oip.bridge import OipBridge
from zserve.frontend.oip.grpc_server import OipGrpc
from zserve.frontend.oip.http_server import BODY_SLACK_BYTES, OipHttp

log = logging.getLogger("zserve.frontend")

# How long stopping waits for handlers still writing their answer (every request has been
# answered by then: this bounds only the last writes).
STOP_GRACE_S = 1.0


# Bits of payload per byte of a protobuf varint.
VARINT_BITS_PER_BYTE = 7
# A negative int32 or int64 in a varint field is sign-extended to 64 bits: ten bytes.
SIGNED_VARINT_BYTES = 10


def grpc_bytes_per_element(dtype: np.dtype[Any]) -> int:
    """The most bytes one element takes in a gRPC request: its own size in
    ``raw_input_contents``; in the typed contents of ``InferTensorContents`` a varint for an
    integer (``int_contents``, ``uint_contents``, ...) or one byte for a bool."""
    if dtype.kind == "i":
        return SIGNED_VARINT_BYTES
    if dtype.kind == "u":
        return max(dtype.itemsize, math.ceil(dtype.itemsize * 8 / VARINT_BITS_PER_BYTE))
    return dtype.itemsize


def _configured_row(model: ModelConfig) -> tuple[np.dtype[Any], int] | None:
    """(dtype, elements) of one row of ``model``'s input where the file alone tells them (an
    emulated model); None where only its backends know (an ONNX or built-in model)."""
    if model.emulated is None:
        return None
    return np.dtype(model.input_dtype), math.prod(model.input_shape)


def grpc_message_bound(models: Sequence[ModelConfig], max_request_bytes: int) -> int:
    """The largest gRPC request any of ``models`` accepts, plus room for its description:
    grpcio's bound is one number for the server, fixed at its start, before any backend has
    registered a signature, so a model whose inputs the file does not tell counts as
    ``max_request_bytes`` of raw tensor data (the core's own bound)."""
    largest = 0
    for model in models:
        row = _configured_row(model)
        if row is None:
            largest = max(largest, max_request_bytes)
            continue
        dtype, elements = row
        rows = min(model.max_batch, max_request_bytes // max(1, dtype.itemsize * elements))
        largest = max(largest, rows * elements * grpc_bytes_per_element(dtype))
    return largest + BODY_SLACK_BYTES


def grpc_options(frontends: FrontendsConfig,
                 models: Sequence[ModelConfig]) -> list[tuple[str, int]]:
    """grpcio's options for the limits of ``frontends``."""
    max_message = frontends.grpc_max_message_bytes
    if max_message is None:
        max_message = grpc_message_bound(models, frontends.max_request_bytes)
    return [
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),  # two frontends on one port is a configuration error
        # A connection's TLS-less HTTP/2 preface and settings, the gRPC "request head".
        ("grpc.server_handshake_timeout_ms", round(frontends.http_header_timeout_s * 1e3)),
        ("grpc.max_connection_idle_ms", round(frontends.http_idle_timeout_s * 1e3)),
    ]


class OipBindError(ZServeError):
    """An OIP server could not bind its configured address."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    return host.strip("[]"), int(port)


class OipServers:
    """The HTTP and gRPC servers of one frontend (each optional)."""

    def __init__(self, bridge: OipBridge, *, http: str | None, grpc_address: str | None,
                 max_request_bytes: int) -> None:
        self.bridge = bridge
        self.http_address = http
        self.grpc_address = grpc_address
        self.max_request_bytes = max_request_bytes
        self.frontends = bridge.core.cluster.frontends
        self.models = bridge.core.cluster.models
        self.http: OipHttp | None = None
        self._runner: web.AppRunner | None = None
        self._http_server: asyncio.Server | None = None
        self._grpc: grpc.aio.Server | None = None

    async def start(self) -> dict[str, str]:
        """Bind and serve; the endpoints bound (``http``, ``grpc``: ``host:port``)."""
        endpoints: dict[str, str] = {}
        if self.http_address is not None:
            endpoints["http"] = await self._start_http(self.http_address)
        if self.grpc_address is not None:
            endpoints["grpc"] = await self._start_grpc(self.grpc_address)
        return endpoints

    async def _start_http(self, address: str) -> str:
        host, port = split_address(address)
        http = self.http = OipHttp(self.bridge, self.frontends)
        runner = self._runner = web.AppRunner(http.app(), access_log=None, handle_signals=False,
                                              shutdown_timeout=STOP_GRACE_S)
        await runner.setup()
        assert runner.server is not None
        loop = asyncio.get_running_loop()
        # Our own listening socket rather than a ``web.TCPSite``: each connection is made by
        # the gate's factory (a ``LimitedConnection``); the runner still shuts them down.
        try:
            server = self._http_server = await loop.create_server(
                http.gate.protocol_factory(runner.server, loop), host, port, reuse_port=False)
        except OSError as exc:
            raise OipBindError(f"cannot serve HTTP on {address}: {exc}") from None
        bound_port = server.sockets[0].getsockname()[1]
        return f"{host}:{bound_port}"

    async def _start_grpc(self, address: str) -> str:
        host, port = split_address(address)
        # Past ``maximum_concurrent_rpcs`` a new RPC is answered RESOURCE_EXHAUSTED at once.
        # (Not ``grpc.max_concurrent_streams``: past that HTTP/2 bound a client queues its
        # RPCs on the connection, silently, until their deadline.)
        server = self._grpc = grpc.aio.server(
            options=grpc_options(self.frontends, self.models),
            maximum_concurrent_rpcs=self.frontends.grpc_max_concurrent_rpcs)
        server.add_generic_rpc_handlers([OipGrpc(self.bridge).handler()])
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound_port = server.add_insecure_port(target)
        except RuntimeError as exc:
            raise OipBindError(f"cannot serve gRPC on {address}: {exc}") from None
        await server.start()
        return f"{host}:{bound_port}"

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(STOP_GRACE_S)
            self._grpc = None
        if self._http_server is not None:
            self._http_server.close()  # no new connections; the runner closes the open ones
            self._http_server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
