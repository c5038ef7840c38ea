"""The Open Inference Protocol over HTTP/REST (KServe v2, Triton's flavour), served by aiohttp on
the frontend's loop.

Routes: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2/models/<m>[/versions/<v>]/ready``,
``/v2`` (server metadata), ``/v2/models/<m>[/versions/<v>]`` (model metadata),
``.../config`` (Triton's model configuration) and ``POST .../infer``: JSON tensor data or Triton's
binary tensor data extension (``zserve.frontend.oip.tensors``); the model repository extension:
``POST /v2/repository/index`` and ``/v2/repository/models/<m>/load`` / ``unload``, forwarded to
the supervisor (``OipBridge.repository_index``, ``load_model``, ``unload_model``). Health
answers 200 or 503 (not ready); errors answer the status of their kind (``STATUS_OF``) with a
JSON body ``{"error": message, "kind": KIND, "may_have_run": bool}``, and ``Retry-After``
where a retry may succeed. An unknown model or version answers 404, an endpoint of Triton's
that zserve does not serve (``UNSUPPORTED_ROUTES``: statistics, trace, logging, shared memory,
generate) 501, as Triton answers its ``NOT_FOUND`` and ``UNSUPPORTED`` errors; any other
path 404 (405 with ``Allow`` for a path served under other methods), every one with that JSON
body, so that tritonclient reads the message.

Request limits (docs/security.md, "Request limits"), each answered and counted
(``zserve.frontend.metrics.HTTP_REFUSED_COUNTER``) before a request reaches the core:

- a body over its model's bound (``BodyLimits``: the largest request the model accepts, as JSON
  text) is refused 413 by its ``Content-Length`` before any of it is read, a chunked one as soon
  as it passes the bound;
- a request head not received within ``http_header_timeout_s`` of its first byte, or a body not
  received within ``http_body_timeout_s`` of its head, is answered 408 and its connection closed
  (``LimitedConnection``, one timer per connection, armed only while a head or body is partial);
- past ``http_max_connections`` open connections a new one is answered 503 with ``Retry-After``
  and closed: the cap is the server's capacity, not one client's excess (429's meaning);
- a connection idle for ``http_idle_timeout_s`` is closed (aiohttp's keep-alive timer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from zserve.config.cluster import FrontendsConfig
from zserve.config.signature import ModelSignature
from zserve.core.errors import (
    BadRequestError,
    ErrorKind,
    TooLargeError,
    ZServeError,
    bounded_message,
)
from zserve.frontend.admission import ModelAdmission
from zserve.frontend.metrics import HTTP_REFUSAL_REASONS, HTTP_REFUSED_COUNTER
from zserve.frontend.oip.bridge import (
    EXTENSIONS,
    SERVER_NAME,
    OipBridge,
    UnknownModelError,
    UnsupportedEndpointError,
    unsupported,
)
from zserve.frontend.oip.tensors import (
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
# Refusals of the servers' own, by class before kind (both are BAD_REQUEST): Triton's codes for
# its NOT_FOUND and UNSUPPORTED errors.
STATUS_OF_REFUSAL: dict[type[ZServeError], int] = {
    UnknownModelError: 404,
    UnsupportedEndpointError: 501,
}
NOT_FOUND_STATUS = 404
METHOD_NOT_ALLOWED_STATUS = 405
# Triton's routes that zserve does not serve: (path, extension), any method.
UNSUPPORTED_ROUTES = (
    ("/v2/models/stats", "statistics"),
    ("/v2/models/{model}/stats", "statistics"),
    ("/v2/models/{model}/versions/{version}/stats", "statistics"),
    ("/v2/trace/setting", "trace"),
    ("/v2/models/{model}/trace/setting", "trace"),
    ("/v2/logging", "logging"),
    ("/v2/systemsharedmemory/{tail:.*}", "system_shared_memory"),
    ("/v2/cudasharedmemory/{tail:.*}", "cuda_shared_memory"),
    *((f"/v2/models/{{model}}{version}/{route}", "generate")
      for version in ("", "/versions/{version}") for route in ("generate", "generate_stream")),
)
# Seconds a client should wait before retrying an answer that proves the request never ran
# (the admission queue or a backend may have room by then).
RETRY_AFTER_S = 1
RETRYABLE_STATUSES = frozenset({429, 503})
# Before a model's signature is known (no backend registered it yet) its body bound is this
# multiple of ``max_request_bytes``: JSON text of float32 data, the common case (the core
# applies the exact bound to the decoded tensors).
JSON_BODY_FACTOR = 4
# Room for a request's description around its tensor data: names, shapes, datatypes,
# parameters, the binary extension's JSON header.
BODY_SLACK_BYTES = 64 * 1024
# JSON written by another encoder than Python's (more digits, spaces) gets this much more.
BODY_HEADROOM_FRACTION = 0.25
# The longest JSON text of one element, with its ", " separator: Python's repr of a double is
# at most 24 characters (-2.2250738585072014e-308); an integer its most negative value's digits.
FLOAT_JSON_CHARS = 24 + 2
BOOL_JSON_CHARS = len("false, ")
# Each JSON array of a nested tensor ("[", "]" and its ", ").
ARRAY_JSON_CHARS = 4
# How long a refused connection (or a request answered before its body was read) keeps
# reading and discarding what the client still sends, so its answer is not lost to a reset.
LINGER_S = 1.0
REQUEST_TIMEOUT_STATUS = 408
# The most bytes of a repository call's JSON body ({"ready": true}, load parameters).
REPOSITORY_BODY_BYTES = 64 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --------------------------------------------------------------------------- body bounds


def json_chars_per_element(dtype: np.dtype[Any]) -> int:
    """The longest JSON text of one element of ``dtype``, separator included."""
    if dtype.kind == "b":
        return BOOL_JSON_CHARS
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return max(len(str(info.min)), len(str(info.max))) + 2
    return FLOAT_JSON_CHARS


def _row_sizes(signature: ModelSignature) -> tuple[int, int]:
    """(binary bytes, longest JSON text) of one row of a request's inputs."""
    binary = text = 0
    for tensor in signature.inputs:
        dims = [int(d) if d is not None else 1 for d in tensor.shape]
        dtype = np.dtype(tensor.dtype)
        elements = math.prod(dims)
        binary += dtype.itemsize * elements
        # The arrays of a nested row: its own and one per prefix of its shape.
        arrays = sum(math.prod(dims[:depth]) for depth in range(len(dims)))
        text += elements * json_chars_per_element(dtype) + arrays * ARRAY_JSON_CHARS
    return binary, text


def http_body_bound(signature: ModelSignature, max_rows: int, max_request_bytes: int) -> int:
    """The largest body a request of this model may need: the JSON text of its largest
    admissible request (``max_rows`` rows, and no more than ``max_request_bytes`` of tensor
    data), plus headroom for other encoders and room for the request's description. Binary
    tensor data is never longer than its JSON text, so this bounds both encodings."""
    row_bytes, row_text = _row_sizes(signature)
    rows = max_rows if row_bytes == 0 else min(max_rows, max_request_bytes // row_bytes)
    text = rows * row_text + len(signature.inputs) * ARRAY_JSON_CHARS
    return math.ceil(text * (1.0 + BODY_HEADROOM_FRACTION)) + BODY_SLACK_BYTES


class BodyLimits:
    """Each model's body bound: ``http_max_body_bytes`` when the file sets it, else
    ``http_body_bound`` of the signature its backends registered (before one did:
    ``JSON_BODY_FACTOR`` x ``max_request_bytes``). Kept per model until its signature
    changes, so a request pays a dict lookup and an identity check."""

    def __init__(self, models: Mapping[str, ModelAdmission], frontends: FrontendsConfig) -> None:
        self.models = models
        self.override = frontends.http_max_body_bytes
        self.max_request_bytes = frontends.max_request_bytes
        self.unknown_signature_bytes = (
            JSON_BODY_FACTOR * frontends.max_request_bytes + BODY_SLACK_BYTES)
        self._cached: dict[str, tuple[ModelSignature | None, int]] = {}

    def of(self, model: str) -> int:
        if self.override is not None:
            return self.override
        state = self.models.get(model)
        if state is None:  # an app (zserve.frontend.apps): its stages check their inputs
            return self.unknown_signature_bytes
        signature = state.signature
        cached = self._cached.get(model)
        if cached is not None and cached[0] is signature:
            return cached[1]
        if signature is None:
            bound = self.unknown_signature_bytes
        else:
            bound = http_body_bound(signature, self.models[model].config.max_batch,
                                    self.max_request_bytes)
        self._cached[model] = (signature, bound)
        return bound


class BodyTimeoutError(asyncio.TimeoutError):
    """A request body not received within ``http_body_timeout_s``: set on its stream, so the
    handler reading it answers 408 (a TimeoutError, so aiohttp's lingering read, which reads
    a body nobody wanted, stops on it too)."""


async def read_capped(content: StreamReader, limit: int) -> bytes:
    """The whole body of ``content``; ``TooLargeError`` as soon as it passes ``limit``."""
    chunk = await content.readany()
    if content.at_eof() and len(chunk) <= limit:
        return chunk  # the usual case: it had all come in already, no copy
    body = bytearray(chunk)
    while chunk:
        if len(body) > limit:
            raise TooLargeError(f"request body over {limit} bytes")
        chunk = await content.readany()
        body += chunk
    return bytes(body)


# --------------------------------------------------------------------------- connections


def _raw_answer(status: int, reason: str, error: str, kind: ErrorKind,
                retry_after: bool = False) -> bytes:
    """A whole HTTP/1.1 answer that closes its connection, written straight to a transport
    (no request object exists yet)."""
    body = encode_json({"error": error, "kind": kind.value, "may_have_run": False})
    retry = f"Retry-After: {RETRY_AFTER_S}\r\n" if retry_after else ""
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {JSON_CONTENT_TYPE}\r\n"
            f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n")
    return head.encode("ascii") + body


class HttpGate:
    """The connection-level limits of one HTTP server, shared by its connections: the open
    connections and their cap, the timeouts, and the refusal counters (in the frontend's
    stats, ``counters``)."""

    def __init__(self, frontends: FrontendsConfig, counters: dict[str, int]) -> None:
        self.max_connections = frontends.http_max_connections
        self.header_timeout_s = frontends.http_header_timeout_s
        self.body_timeout_s = frontends.http_body_timeout_s
        self.idle_timeout_s = frontends.http_idle_timeout_s
        self.open = 0
        self.counters = counters
        for reason in HTTP_REFUSAL_REASONS:
            counters.setdefault(HTTP_REFUSED_COUNTER.format(reason), 0)
        self.header_timeout_answer = _raw_answer(
            REQUEST_TIMEOUT_STATUS, "Request Timeout",
            f"request head not received within {self.header_timeout_s:g} s",
            ErrorKind.BAD_REQUEST)
        self.full_answer = _raw_answer(
            503, "Service Unavailable",
            f"the server has {self.max_connections} connections open, its limit",
            ErrorKind.UNAVAILABLE, retry_after=True)

    def refused(self, reason: str) -> None:
        self.counters[HTTP_REFUSED_COUNTER.format(reason)] += 1

    def protocol_factory(self, server: web.Server,
                         loop: asyncio.AbstractEventLoop) -> Callable[[], LimitedConnection]:
        """What ``loop.create_server`` makes each connection with."""
        return lambda: LimitedConnection(server, gate=self, loop=loop, access_log=None,
                                         keepalive_timeout=self.idle_timeout_s,
                                         lingering_time=LINGER_S)


class LimitedConnection(RequestHandler):
    """aiohttp's connection protocol under an ``HttpGate``: past the connection cap it answers
    503 and closes; otherwise it times the request head from its first byte and the body from
    the end of its head. The timer exists only while a head or a body is partial: a request
    that comes in one read (the usual case) arms none."""

    def __init__(self, manager: web.Server, *, gate: HttpGate, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.gate = gate
        self.refused_transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None  # a body being received, under its deadline

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self.gate
        if gate.open >= gate.max_connections:
            self._refuse(transport)
            return
        gate.open += 1
        super().connection_made(transport)

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        """Answer 503 and half-close; close for good on the client's EOF or after
        ``LINGER_S`` (an answer closed on unread data may be lost to a reset)."""
        assert isinstance(transport, asyncio.Transport)
        self.refused_transport = transport
        self.gate.refused("connections")
        transport.write(self.gate.full_answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._deadline = self._loop.call_later(LINGER_S, transport.close)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_deadline()
        if self.refused_transport is not None:
            self.refused_transport = None
            return
        self.gate.open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused_transport is not None:
            return  # discarded: the answer is sent
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:  # a head is complete
            self._cancel_deadline()
            body = self._messages[-1][1] if self._messages else None
            if body is not None and not body.is_eof():
                self._body = body
                self._deadline = self._loop.call_later(self.gate.body_timeout_s,
                                                       self._body_timed_out)
            else:
                self._body = None
        elif self._body is not None:
            if self._body.is_eof():
                self._body = None
                self._cancel_deadline()
        elif self._deadline is None and data and self.transport is not None:
            self._deadline = self._loop.call_later(self.gate.header_timeout_s,
                                                   self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._deadline = None
        transport = self.transport
        if transport is None:
            return
        self.gate.refused("timeout")
        if not self._request_in_progress and not self._messages:
            transport.write(self.gate.header_timeout_answer)  # no answer has begun
        self.force_close()

    def _body_timed_out(self) -> None:
        """Fail the body's stream: its reader answers 408 (``OipHttp.infer``) and the
        connection closes after the answer; a body nobody reads just ends the connection."""
        self._deadline = None
        body, self._body = self._body, None
        if body is not None and not body.is_eof():
            body.set_exception(BodyTimeoutError(
                f"request body not received within {self.gate.body_timeout_s:g} s"))

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


# --------------------------------------------------------------------------- routes

def error_response(error: ZServeError, status: int | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """``error`` as its status (``STATUS_OF_REFUSAL``, else ``STATUS_OF``, unless ``status``
    says) and its JSON body."""
    if status is None:
        status = STATUS_OF_REFUSAL.get(type(error)) or STATUS_OF.get(error.kind, 500)
    body = {"error": bounded_message(error.message), "kind": error.kind.value,
            "may_have_run": error.may_have_run}
    if status in RETRYABLE_STATUSES:
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return web.Response(status=status, body=encode_json(body), content_type=JSON_CONTENT_TYPE,
                        headers=headers)


def _refusal(response: web.Response, gate: HttpGate, reason: str) -> web.Response:
    """``response`` to a request refused before admission: counted, and its connection closed
    (its body may be unread)."""
    gate.refused(reason)
    response.force_close()
    return response


def _timeout_response(message: str) -> web.Response:
    body = {"error": message, "kind": ErrorKind.BAD_REQUEST.value, "may_have_run": False}
    return web.Response(status=REQUEST_TIMEOUT_STATUS, body=encode_json(body),
                        content_type=JSON_CONTENT_TYPE)


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
    """The HTTP/REST routes over one ``OipBridge``, under the limits of ``frontends`` (the
    cluster's ``[frontends]`` table): ``body_limits`` per model, ``gate`` per connection."""

    def __init__(self, bridge: OipBridge, frontends: FrontendsConfig) -> None:
        self.bridge = bridge
        self.body_limits = BodyLimits(bridge.core.models, frontends)
        self.gate = HttpGate(frontends, bridge.core.counters)

    def app(self) -> web.Application:
        # Bodies are read by ``read_capped`` under each model's bound, never by aiohttp's
        # ``request.read()`` (whose ``client_max_size`` is one bound for every route).
        app = web.Application()

        def get(path: str, handler: Handler) -> web.RouteDef:
            return web.get(path, _typed_errors(handler))

        model = "/v2/models/{model}"
        versioned = "/v2/models/{model}/versions/{version}"
        # Inference first: aiohttp tries the routes under one prefix (/v2/models) in the order
        # they were added, a regular expression each, and nearly every request is an inference.
        repository = "/v2/repository/models/{model}"
        app.add_routes([
            *(web.post(p + "/infer", _typed_errors(self.infer)) for p in (model, versioned)),
            web.post("/v2/repository/index", _typed_errors(self.repository_index)),
            web.post(repository + "/load", _typed_errors(self.load_model)),
            web.post(repository + "/unload", _typed_errors(self.unload_model)),
            get("/v2/health/live", self.live), get("/v2/health/ready", self.ready),
            get("/v2", self.server_metadata),
            # Before the model metadata: /v2/models/stats is no model's.
            *(web.route("*", path, _unsupported_handler(extension))
              for path, extension in UNSUPPORTED_ROUTES),
            *(get(p + "/ready", self.model_ready) for p in (model, versioned)),
            *(get(p, self.model_metadata) for p in (model, versioned)),
            *(get(p + "/config", self.model_config) for p in (model, versioned)),
            # Last: aiohttp tries it only where no other route's path matches.
            web.route("*", "/{path:.*}", _no_such_endpoint),
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
        limit = self.body_limits.of(model)
        length = request.content_length
        try:
            if length is not None and length > limit:
                raise TooLargeError(f"request body of {length} bytes is over {limit} bytes, the "
                                    f"largest request of model {model!r}")
            body = await read_capped(request.content, limit)
        except TooLargeError as error:
            return _refusal(error_response(error), self.gate, "too_large")
        except BodyTimeoutError as error:
            return _refusal(_timeout_response(str(error)), self.gate, "timeout")
        oip = decode_http_body(body, _header_length(request))
        outputs = await self.bridge.submit(model, oip.inputs, oip.slo_ms)
        parts, header_length = encode_http_response(model, oip, outputs)
        if header_length is None:
            return web.Response(body=parts[0], content_type=JSON_CONTENT_TYPE)
        return web.Response(body=b"".join(parts), content_type=BINARY_CONTENT_TYPE,
                            headers={HEADER_LENGTH: str(header_length)})


    async def repository_index(self, request: web.Request) -> web.Response:
        """Triton's index: every model with its state; ``{"ready": true}`` in the body: the
        READY ones only."""
        ready_only = bool((await _repository_body(request)).get("ready", False))
        index = await self.bridge.repository_index()
        return _json([e for e in index if e["state"] == "READY" or not ready_only])

    async def load_model(self, request: web.Request) -> web.Response:
        await _repository_body(request, refuse_parameters=True)
        await self.bridge.load_model(request.match_info["model"])
        return _json({})

    async def unload_model(self, request: web.Request) -> web.Response:
        await _repository_body(request)
        await self.bridge.unload_model(request.match_info["model"])
        return _json({})


async def _repository_body(request: web.Request, *,
                           refuse_parameters: bool = False) -> dict[str, Any]:
    """A repository call's JSON body ({} when empty); a load's ``parameters`` (Triton's
    config or file overrides) are refused: zserve loads what the repository folder holds."""
    body = await read_capped(request.content, REPOSITORY_BODY_BYTES)
    if not body.strip():
        return {}
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise BadRequestError(f"repository request body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise BadRequestError("repository request body must be a JSON object")
    if refuse_parameters and document.get("parameters"):
        raise BadRequestError("load parameters (config or file overrides) are not served: "
                              "zserve loads the model as its repository folder holds it")
    return document


def _unsupported_handler(extension: str) -> Handler:
    async def refuse(request: web.Request) -> web.Response:
        return error_response(unsupported(extension, f"{request.method} {request.path}"))

    return refuse


async def _no_such_endpoint(request: web.Request) -> web.Response:
    """A path no route serves (404), or one served under other methods (405 naming them):
    the JSON body tritonclient reads, where aiohttp would answer plain text."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    endpoint = f"{request.method} {request.path}"
    if allowed:
        return error_response(BadRequestError(f"{endpoint}: this path is served for "
                                              f"{', '.join(sorted(allowed))} only"),
                              METHOD_NOT_ALLOWED_STATUS, {"Allow": ", ".join(sorted(allowed))})
    return error_response(BadRequestError(f"no endpoint {endpoint} (zserve serves the Open "
                                          "Inference Protocol under /v2)"), NOT_FOUND_STATUS)


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
