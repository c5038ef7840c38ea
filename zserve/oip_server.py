"""The frontend's Open Inference Protocol servers: start and stop them on the frontend's loop.

``OipServers(bridge, http=..., grpc=...)`` binds the HTTP/REST server (aiohttp) and the gRPC
server (grpcio's asyncio server) on the addresses of ``[frontends] http_addresses`` /
``grpc_addresses`` (``host:port``; port 0: the kernel picks one, read back into the endpoints the
frontend announces). Neither starts unless configured. The frontend host starts them before it
announces its endpoints (requests that come before it is connected are answered
``UNAVAILABLE``) and stops them at the end of its drain, after every request has its answer.
"""

from __future__ import annotations

import logging

import grpc
from aiohttp import web

from zserve.errors import ZServeError
from zserve.oip_bridge import OipBridge
from zserve.oip_grpc import OipGrpc
from zserve.oip_http import BODY_SLACK_BYTES, OipHttp

log = logging.getLogger("zserve.frontend")

# How long stopping waits for handlers still writing their answer (every request has been
# answered by then: this bounds only the last writes).
STOP_GRACE_S = 1.0


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
        self._runner: web.AppRunner | None = None
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
        app = OipHttp(self.bridge).app(self.max_request_bytes)
        runner = self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                              shutdown_timeout=STOP_GRACE_S)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_port=False)
        try:
            await site.start()
        except OSError as exc:
            raise OipBindError(f"cannot serve HTTP on {address}: {exc}") from None
        bound_port = runner.addresses[0][1]
        return f"{host}:{bound_port}"

    async def _start_grpc(self, address: str) -> str:
        host, port = split_address(address)
        server = self._grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self.max_request_bytes + BODY_SLACK_BYTES),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),  # two frontends on one port is a configuration error
        ])
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
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
