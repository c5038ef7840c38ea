"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService`` on grpcio's asyncio
server, on the frontend's loop.

The service's messages are ``zserve/frontend/oip/oip_inference.proto``
(``zserve.frontend.oip.oip_inference_pb2``); the
methods are registered by name with grpcio's generic handlers, so no generated servicer is
needed. Inputs come as ``raw_input_contents`` (what tritonclient sends) or typed ``contents``;
outputs go back as ``raw_output_contents``. Errors abort the call with the code of their kind
(``CODE_OF``), the message (cut to ``MAX_ERROR_MESSAGE_BYTES``: it travels in the trailers,
which clients cap), and trailing metadata ``zserve-error-kind``, ``zserve-may-have-run`` and,
where a retry may succeed, ``retry-after`` (seconds). A request message that fails to decode is
answered ``INVALID_ARGUMENT`` like any other bad request. An unknown model or version is
``NOT_FOUND``. The model repository methods (``RepositoryIndex``, ``RepositoryModelLoad``,
``RepositoryModelUnload``) are forwarded to the supervisor through the bridge. The methods of
Triton's service that zserve does not serve
(``UNSUPPORTED_METHODS``, ``ModelStreamInfer``) are registered to answer ``UNIMPLEMENTED`` with a
message naming what is not served (grpcio's own answer to a method it does not know says only
"Method not found!"), as Triton answers its ``NOT_FOUND`` and ``UNSUPPORTED`` errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message as ProtoMessage

from zserve.core.errors import BadRequestError, ErrorKind, ZServeError, bounded_message
from zserve.frontend.oip import oip_inference_pb2 as pb
from zserve.frontend.oip.bridge import (
    EXTENSIONS,
    SERVER_NAME,
    OipBridge,
    UnknownModelError,
    UnsupportedEndpointError,
    unsupported,
)
from zserve.frontend.oip.tensors import (
    OipRequest,
    array_from_bytes,
    array_from_values,
    check_unique,
    datatype_of,
    model_config,
    model_metadata,
    requested_slo_ms,
    selected_outputs,
)

SERVICE = "inference.GRPCInferenceService"
CODE_OF = {
    ErrorKind.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.BACKEND_FAILED: grpc.StatusCode.INTERNAL,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Refusals of the server's own, by class before kind (both are BAD_REQUEST): Triton's codes.
CODE_OF_REFUSAL: dict[type[ZServeError], grpc.StatusCode] = {
    UnknownModelError: grpc.StatusCode.NOT_FOUND,
    UnsupportedEndpointError: grpc.StatusCode.UNIMPLEMENTED,
}
# Triton's unary methods that zserve does not serve, each with its extension (Triton's name).
UNSUPPORTED_METHODS = {
    "ModelStatistics": "statistics",
    "SystemSharedMemoryStatus": "system_shared_memory",
    "SystemSharedMemoryRegister": "system_shared_memory",
    "SystemSharedMemoryUnregister": "system_shared_memory",
    "CudaSharedMemoryStatus": "cuda_shared_memory",
    "CudaSharedMemoryRegister": "cuda_shared_memory",
    "CudaSharedMemoryUnregister": "cuda_shared_memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}
# Triton's bidirectional streaming inference (decoupled models): not served either.
STREAM_METHOD = "ModelStreamInfer"
RETRY_AFTER_S = 1
_RETRYABLE_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
# Where typed contents keep each datatype's values.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "INT8": "int_contents",
    "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
    "FP16": "fp32_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
}

Req = TypeVar("Req", bound=ProtoMessage)
Resp = TypeVar("Resp", bound=ProtoMessage)
Method = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[ProtoMessage]]


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: ZServeError) -> None:
    code = CODE_OF_REFUSAL.get(type(error)) or CODE_OF.get(error.kind, grpc.StatusCode.INTERNAL)
    trailers: list[tuple[str, str]] = [
        ("zserve-error-kind", error.kind.value),
        ("zserve-may-have-run", "true" if error.may_have_run else "false"),
    ]
    if code in _RETRYABLE_CODES:
        trailers.append(("retry-after", str(RETRY_AFTER_S)))
    await context.abort(code, bounded_message(error.message), tuple(trailers))


class _Undecodable:
    """A request message that failed to decode, handed to the method in its place: grpcio
    answers a deserializer's exception UNKNOWN, and the client's bytes are a bad request."""

    __slots__ = ("error",)

    def __init__(self, error: BadRequestError) -> None:
        self.error = error


def decode_message(message_type: type[Req], data: bytes) -> Req:
    """``data`` as a ``message_type``; ``BadRequestError`` when it is none."""
    try:
        return message_type.FromString(data)
    except Exception as exc:  # whatever the parser raises, the bytes are the client's
        raise BadRequestError(f"undecodable {message_type.DESCRIPTOR.name}: {exc}") from None


def _lenient(message_type: type[ProtoMessage]) -> Callable[[bytes], Any]:
    """``decode_message`` as a deserializer: an ``_Undecodable`` for bytes that are no message."""

    def deserialize(data: bytes) -> Any:
        try:
            return decode_message(message_type, data)
        except BadRequestError as error:
            return _Undecodable(error)

    return deserialize


def _typed(method: Method) -> Method:
    """A ``ZServeError`` the method raises aborts the call with its kind's code."""

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> ProtoMessage:
        try:
            if type(request) is _Undecodable:
                raise request.error
            return await method(request, context)
        except ZServeError as error:
            await _abort(context, error)
            raise AssertionError("unreachable: abort raises") from None

    return call


def _refusal(extension: str, method: str) -> Callable[[Any, Any], Awaitable[None]]:
    """A method of Triton's that zserve does not serve: its calls end ``UNIMPLEMENTED``
    (the request, unary or a stream, is never read)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await _abort(context, unsupported(extension, method))

    return refuse


def _refusals() -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        name: grpc.unary_unary_rpc_method_handler(_refusal(extension, name))
        for name, extension in UNSUPPORTED_METHODS.items()}
    handlers[STREAM_METHOD] = grpc.stream_stream_rpc_method_handler(
        _refusal("streaming", STREAM_METHOD))
    return handlers


def _parameters(params: Any) -> dict[str, Any]:
    """A protobuf parameter map as plain values."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is not None:
            out[key] = getattr(value, choice)
    return out


def decode_request(request: pb.ModelInferRequest) -> OipRequest:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequestError(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    check_unique("input", [tensor.name for tensor in request.inputs])
    inputs: dict[str, np.ndarray[Any, Any]] = {}
    for index, tensor in enumerate(request.inputs):
        if raw:
            array = array_from_bytes(tensor.name, tensor.datatype, tensor.shape, raw[index])
        else:
            field = _CONTENTS_FIELD.get(tensor.datatype, "")
            values = list(getattr(tensor.contents, field)) if field else []
            array = array_from_values(tensor.name, tensor.datatype, tensor.shape, values)
        inputs[tensor.name] = array
    outputs = None
    if request.outputs:
        outputs = [(o.name, True) for o in request.outputs]
        check_unique("output", [name for name, _ in outputs])
    return OipRequest(inputs, outputs, request.id or None,
                      requested_slo_ms(_parameters(request.parameters)), True)


def encode_response(model: str, request: OipRequest,
                    outputs: dict[str, Any]) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model, model_version="1",
                                     id=request.request_id or "")
    for name, array, _ in selected_outputs(request, outputs):
        response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
    return response


class OipGrpc:
    """The gRPC methods over one ``OipBridge``."""

    def __init__(self, bridge: OipBridge) -> None:
        self.bridge = bridge

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, tuple[Method, Any, Any]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest,
                               pb.ServerMetadataResponse),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest,
                              pb.ModelMetadataResponse),
            "ModelConfig": (self.model_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
            "ModelInfer": (self.model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
            "RepositoryIndex": (self.repository_index, pb.RepositoryIndexRequest,
                                pb.RepositoryIndexResponse),
            "RepositoryModelLoad": (self.load_model, pb.RepositoryModelLoadRequest,
                                    pb.RepositoryModelLoadResponse),
            "RepositoryModelUnload": (self.unload_model, pb.RepositoryModelUnloadRequest,
                                      pb.RepositoryModelUnloadResponse),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                _typed(method), request_deserializer=_lenient(request_type),
                response_serializer=response_type.SerializeToString)
            for name, (method, request_type, response_type) in methods.items()
        }
        return grpc.method_handlers_generic_handler(SERVICE, {**handlers, **_refusals()})

    async def server_live(self, request: pb.ServerLiveRequest,
                          context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: pb.ServerReadyRequest,
                           context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.bridge.ready())

    async def model_ready(self, request: pb.ModelReadyRequest,
                          context: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.bridge.model_ready(request.name,
                                                                   request.version))

    async def server_metadata(self, request: pb.ServerMetadataRequest,
                              context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self.bridge.version,
                                         extensions=EXTENSIONS)

    async def model_metadata(self, request: pb.ModelMetadataRequest,
                             context: Any) -> pb.ModelMetadataResponse:
        signature = self.bridge.signature(request.name, request.version)
        return pb.ModelMetadataResponse(**model_metadata(request.name, signature))

    async def model_config(self, request: pb.ModelConfigRequest,
                           context: Any) -> pb.ModelConfigResponse:
        signature = self.bridge.signature(request.name, request.version)
        config = model_config(request.name, self.bridge.max_batch(request.name), signature)
        return pb.ModelConfigResponse(config=config)

    async def model_infer(self, request: pb.ModelInferRequest,
                          context: Any) -> pb.ModelInferResponse:
        self.bridge.check_model(request.model_name, request.model_version)
        oip = decode_request(request)
        future = self.bridge.submit(request.model_name, oip.inputs, oip.slo_ms)
        try:
            outputs = await future
        except asyncio.CancelledError:  # the call was cancelled: so is the request, if it can be
            self.bridge.forget(future)
            raise
        return encode_response(request.model_name, oip, outputs)

    async def repository_index(self, request: pb.RepositoryIndexRequest,
                               context: Any) -> pb.RepositoryIndexResponse:
        """Every model with its state (``ready``: the READY ones only)."""
        index = await self.bridge.repository_index()
        return pb.RepositoryIndexResponse(models=[
            pb.RepositoryIndexResponse.ModelIndex(**entry) for entry in index
            if entry["state"] == "READY" or not request.ready])

    async def load_model(self, request: pb.RepositoryModelLoadRequest,
                         context: Any) -> pb.RepositoryModelLoadResponse:
        if request.parameters:
            raise BadRequestError("load parameters (config or file overrides) are not served: "
                                  "zserve loads the model as its repository folder holds it")
        await self.bridge.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def unload_model(self, request: pb.RepositoryModelUnloadRequest,
                           context: Any) -> pb.RepositoryModelUnloadResponse:
        await self.bridge.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()
