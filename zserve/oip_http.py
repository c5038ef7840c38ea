"""The Open Inference Protocol over HTTP/REST (KServe v2, Triton's flavour), served by aiohttp on
the frontend's loop.

Routes: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2/models/<m>[/versions/<v>]/ready``,
``/v2`` (server metadata), ``/v2/models/<m>[/versions/<v>]`` (model metadata),
``.../config`` (Triton's model configuration) and ``POST .../infer``: JSON tensor data or Triton's
binary tensor data extension (``zserve.oip_tensors``). Health answers 200 or 503 (not ready);
errors answer the status of their kind (``STATUS_OF``) with a JSON body ``{"error": message,
"kind": KIND, "may_have_run": bool}``, and ``Retry-After`` where a retry may succeed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from zserve.errors import BadRequestError, ErrorKind, TooLargeError, ZServeError
from zserve.oip_bridge import EXTENSIONS, SERVER_NAME, OipBridge
from zserve.oip_tensors import (
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    JSON_CONTENT_TYPE,
    decode_http_body,
    encode_http_response,
    encode_json,
    model_config,
    model_metadata,
)

log = logging.getLogger("zserve.frontend")

STATUS_OF = {
    ErrorKind.BAD_REQUEST: 400,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.CANCELLED: 499,  # the client closed the request (nginx's code)
    ErrorKind.BACKEND_FAILED: 500,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.SHUTTING_DOWN: 503,
    ErrorKind.DEADLINE: 504,
}
# Seconds a client should wait before retrying an answer that proves the request never ran
# (the admission queue or a backend may have room by then).
RETRY_AFTER_S = 1
RETRYABLE_STATUSES = frozenset({429, 503})
# JSON tensor data takes several times its binary size in text: the body bound is this multiple
# of ``max_request_bytes`` (plus room for the JSON of a request's description), and the core
# applies the exact bound to the decoded tensors.
JSON_BODY_FACTOR = 4
BODY_SLACK_BYTES = 1 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: ZServeError) -> web.Response:
    status = STATUS_OF.get(error.kind, 500)
    body = {"error": error.message, "kind": error.kind.value, "may_have_run": error.may_have_run}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in RETRYABLE_STATUSES else None
    return web.Response(status=status, body=encode_json(body), content_type=JSON_CONTENT_TYPE,
                        headers=headers)


def _json(value: Any) -> web.Response:
    return web.Response(body=encode_json(value), content_type=JSON_CONTENT_TYPE)


def _health(ok: bool) -> web.Response:
    return web.Response(status=200 if ok else 503)


def _typed_errors(handler: Handler) -> Handler:
    """``handler`` with every ``ZServeError`` it raises turned into its status and JSON body.
    Wrapped once per route rather than as an aiohttp middleware, which aiohttp runs through an
    extra layer of its own on every request."""

    async def typed(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ZServeError as error:
            return error_response(error)

    return typed


class OipHttp:
    """The HTTP/REST routes over one ``OipBridge``."""

    def __init__(self, bridge: OipBridge) -> None:
        self.bridge = bridge

    def app(self, max_request_bytes: int) -> web.Application:
        app = web.Application(
            client_max_size=JSON_BODY_FACTOR * max_request_bytes + BODY_SLACK_BYTES,
        )

        def get(path: str, handler: Handler) -> web.RouteDef:
            return web.get(path, _typed_errors(handler))

        model = "/v2/models/{model}"
        versioned = "/v2/models/{model}/versions/{version}"
        # Inference first: aiohttp tries the routes under one prefix (/v2/models) in the order
        # they were added, a regular expression each, and nearly every request is an inference.
        app.add_routes([
            *(web.post(p + "/infer", _typed_errors(self.infer)) for p in (model, versioned)),
            get("/v2/health/live", self.live), get("/v2/health/ready", self.ready),
            get("/v2", self.server_metadata),
            *(get(p + "/ready", self.model_ready) for p in (model, versioned)),
            *(get(p, self.model_metadata) for p in (model, versioned)),
            *(get(p + "/config", self.model_config) for p in (model, versioned)),
        ])
        return app

    async def live(self, request: web.Request) -> web.Response:
        return _health(True)

    async def ready(self, request: web.Request) -> web.Response:
        return _health(self.bridge.ready())

    async def model_ready(self, request: web.Request) -> web.Response:
        model, version = _model_of(request)
        return _health(self.bridge.model_ready(model, version))

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json({"name": SERVER_NAME, "version": self.bridge.version,
                      "extensions": list(EXTENSIONS)})

    async def model_metadata(self, request: web.Request) -> web.Response:
        model, version = _model_of(request)
        return _json(model_metadata(model, self.bridge.signature(model, version)))

    async def model_config(self, request: web.Request) -> web.Response:
        model, version = _model_of(request)
        signature = self.bridge.signature(model, version)
        return _json(model_config(model, self.bridge.max_batch(model), signature))

    async def infer(self, request: web.Request) -> web.Response:
        model, version = _model_of(request)
        self.bridge.check_model(model, version)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise TooLargeError(f"request body over {request.client_max_size} bytes") from None
        oip = decode_http_body(body, _header_length(request))
        outputs = await self.bridge.submit(model, oip.inputs, oip.slo_ms)
        parts, header_length = encode_http_response(model, oip, outputs)
        if header_length is None:
            return web.Response(body=parts[0], content_type=JSON_CONTENT_TYPE)
        return web.Response(body=b"".join(parts), content_type=BINARY_CONTENT_TYPE,
                            headers={HEADER_LENGTH: str(header_length)})


def _model_of(request: web.Request) -> tuple[str, str]:
    info = request.match_info
    return info["model"], info.get("version", "")


def _header_length(request: web.Request) -> int | None:
    value = request.headers.get(HEADER_LENGTH)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequestError(f"{HEADER_LENGTH} must be an integer, got {value!r}") from None
