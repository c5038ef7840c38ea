"""Open Inference Protocol tensors: datatypes, shapes, and the HTTP request and response bodies.

Pure functions shared by the HTTP and gRPC servers of the frontend
(``zserve.frontend.oip.http_server``,
``zserve.frontend.oip.grpc_server``) and by the load generator's OIP senders: the OIP datatype of
each numpy dtype, a signature's tensors as OIP metadata (``-1`` for the batch dimension and for any
size the model does not fix), the request parameters zserve reads (``timeout`` in microseconds, as
tritonclient sends it, and ``slo_ms``), and the HTTP/REST body in both forms: JSON tensor data,
and Triton's binary tensor data extension (a JSON header of ``Inference-Header-Content-Length``
bytes followed by each binary tensor's bytes, in order). A binary input becomes a numpy view over
the request body: no copy on the way to the frontend core. Every problem with a request raises
``BadRequestError`` with one line naming it, never another exception: JSON values and typed gRPC
contents are checked against their datatype (``BOOL`` takes ``true``/``false`` only, integers take
integers within the type's range, floats take numbers that round to a finite value of the type:
``1e6`` is no ``FP16``; NaN and infinities travel as binary data only), shapes are bounded
(``MAX_TENSOR_RANK``, ``MAX_TENSOR_ELEMENTS``), and a name may appear once among the inputs and
once among the requested outputs. Error messages are cut to ``MAX_ERROR_MESSAGE_BYTES`` where a
frontend sends them (``zserve.core.errors.bounded_message``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec
import numpy as np

from zserve.config.signature import ModelSignature, TensorSpec, quoted
from zserve.core.errors import BadRequestError

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"
JSON_CONTENT_TYPE = "application/json"

# OIP datatype -> numpy dtype; BYTES (strings) is not a type a zserve model takes.
_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
_DATATYPES = {dtype: name for name, dtype in _DTYPES.items()}
# Triton's model configuration names of the same types (``TYPE_FP32``).
CONFIG_TYPE_PREFIX = "TYPE_"
# The most dimensions a tensor's shape may have: far above any model input's, and within every
# numpy's limit (32 before numpy 2, 64 since).
MAX_TENSOR_RANK = 32
# The most elements a shape may describe, its zero dimensions left out (numpy's size arithmetic
# must fit 63 bits even for an empty tensor): 8 TiB of FP64, far above any request's bound.
MAX_TENSOR_ELEMENTS = 1 << 40
# The longest error message a frontend sends, in UTF-8 bytes: gRPC carries it in trailing
# metadata (percent-encoded, up to 3 bytes a byte), which clients cap at 8-16 KiB in all.
# The largest number a parameter zserve reads may hold (Triton's parameters are int64; a JSON
# integer may be longer, and no float holds one of 400 digits).
_MAX_PARAMETER = (1 << 63) - 1


def _json_element_type(dtype: np.dtype[Any]) -> Any:
    """The msgspec type of one JSON value of ``dtype``: ``bool`` alone for BOOL, an integer in
    range for the integer types, a number that rounds to a finite value for the float types."""
    if dtype.kind == "b":
        return bool
    if dtype.kind in "iu":
        ints = np.iinfo(dtype)
        if ints.max > np.iinfo(np.int64).max:  # msgspec bounds fit int64: numpy checks UINT64's
            return Annotated[int, msgspec.Meta(ge=0)]
        return Annotated[int, msgspec.Meta(ge=int(ints.min), le=int(ints.max))]
    floats = np.finfo(dtype)
    largest = float(floats.max)
    if dtype.itemsize == 8:  # every finite double is one
        return Annotated[float, msgspec.Meta(ge=-largest, le=largest)]
    # A number half a unit in the last place above the largest rounds to infinity.
    overflow = largest + 2.0 ** (floats.maxexp - floats.nmant - 2)
    return Annotated[float, msgspec.Meta(gt=-overflow, lt=overflow)]


_ELEMENT_TYPES = {name: _json_element_type(dtype) for name, dtype in _DTYPES.items()}
# (datatype, nesting depth) -> the msgspec type of values nested that deep.
_VALUE_TYPES: dict[tuple[str, int], Any] = {}


def _values_type(datatype: str, depth: int) -> Any:
    found = _VALUE_TYPES.get((datatype, depth))
    if found is None:
        found = _ELEMENT_TYPES[datatype]
        for _ in range(depth):
            found = list[found]  # type: ignore[valid-type]
        _VALUE_TYPES[(datatype, depth)] = found
    return found


def datatype_of(dtype: np.dtype[Any] | str) -> str:
    """The OIP datatype name of a numpy dtype (``float32`` -> ``FP32``)."""
    name = _DATATYPES.get(np.dtype(dtype))
    if name is None:
        raise BadRequestError(f"dtype {dtype} has no Open Inference Protocol datatype")
    return name


def dtype_of(datatype: str) -> np.dtype[Any]:
    dtype = _DTYPES.get(datatype)
    if dtype is None:
        raise BadRequestError(f"unsupported datatype {quoted(datatype)} (zserve takes "
                              f"{', '.join(_DTYPES)})")
    return dtype


def oip_shape(spec: TensorSpec) -> list[int]:
    """A tensor's OIP shape: ``-1`` for the batch dimension and for unfixed dimensions."""
    return [-1, *(-1 if dim is None else dim for dim in spec.shape)]


def tensor_metadata(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    return [{"name": s.name, "datatype": datatype_of(s.dtype), "shape": oip_shape(s)}
            for s in specs]


def model_metadata(name: str, signature: ModelSignature | None) -> dict[str, Any]:
    """The body of ``GET /v2/models/<name>`` (the gRPC ModelMetadata has the same fields)."""
    inputs = outputs = []
    if signature is not None:
        inputs, outputs = tensor_metadata(signature.inputs), tensor_metadata(signature.outputs)
    return {"name": name, "versions": ["1"], "platform": "zserve", "inputs": inputs,
            "outputs": outputs}


def model_config(name: str, max_batch: int, signature: ModelSignature | None) -> dict[str, Any]:
    """Triton's model configuration, the fields zserve fills: dims are per sample (the batch
    dimension is implied by ``max_batch_size``), ``-1`` where the model does not fix them."""

    def tensors(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
        return [{"name": s.name, "data_type": CONFIG_TYPE_PREFIX + datatype_of(s.dtype),
                 "dims": [-1 if d is None else d for d in s.shape]} for s in specs]

    return {"name": name, "platform": "zserve", "backend": "zserve", "max_batch_size": max_batch,
            "input": tensors(signature.inputs) if signature else [],
            "output": tensors(signature.outputs) if signature else []}


def requested_slo_ms(parameters: Mapping[str, Any]) -> float:
    """The per-request SLO the parameters ask for, in ms (0: the model's): ``timeout`` in
    microseconds (tritonclient's ``timeout=``) and ``slo_ms``; the smaller one when both."""
    slo_ms = math.inf
    timeout_us = parameters.get("timeout")
    if timeout_us is not None:
        if type(timeout_us) is not int or not 0 < timeout_us <= _MAX_PARAMETER:
            raise BadRequestError(f"parameter timeout must be a positive integer of "
                                  f"microseconds, got {quoted(timeout_us)}")
        slo_ms = timeout_us / 1e3
    asked = parameters.get("slo_ms")
    if asked is not None:
        if type(asked) not in (int, float) or not 0 < asked <= _MAX_PARAMETER:
            raise BadRequestError(f"parameter slo_ms must be a number > 0, got {quoted(asked)}")
        slo_ms = min(slo_ms, float(asked))
    return 0.0 if slo_ms == math.inf else slo_ms


def array_from_bytes(name: str, datatype: str, shape: Sequence[int], data: Any, *,
                     offset: int = 0, nbytes: int = -1) -> np.ndarray[Any, Any]:
    """A read-only view of ``shape`` over ``data`` (bytes-like) from ``offset``, ``nbytes`` long
    (-1: the rest)."""
    dtype = dtype_of(datatype)
    dims = _checked_shape(name, shape)
    count = math.prod(dims)
    available = (len(data) - offset) if nbytes < 0 else nbytes
    if available != count * dtype.itemsize:
        raise BadRequestError(f"input {quoted(name)}: {available} bytes of data for shape "
                              f"{list(dims)} of {datatype} ({count * dtype.itemsize} bytes)")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(dims)


def array_from_values(name: str, datatype: str, shape: Sequence[int],
                      values: Any) -> np.ndarray[Any, Any]:
    """An array of ``shape`` from Python values (typed gRPC contents, decoded JSON): a flat list
    in row-major order, or lists nested as the shape, each value of the datatype's kind and
    within its range (``_json_element_type``)."""
    dtype = dtype_of(datatype)
    dims = _checked_shape(name, shape)
    depth = 0
    inner = values
    while type(inner) in (list, tuple) and depth <= MAX_TENSOR_RANK:
        depth += 1
        inner = inner[0] if inner else None
    value_type = _values_type(datatype, _checked_depth(name, depth, dims))
    try:
        checked = msgspec.convert(values, value_type)
    except msgspec.ValidationError as exc:
        raise _not_of(name, datatype, exc) from None
    return _shaped(name, dtype, dims, checked, depth)


def _checked_depth(name: str, depth: int, dims: tuple[int, ...]) -> int:
    """``depth`` if values nested that deep may describe a tensor of ``dims``: a flat list, lists
    nested as the shape, or a lone value for a shape of no dimensions."""
    if depth == 1 or depth == len(dims):
        return depth
    got = "a single value" if depth == 0 else f"arrays nested {depth} deep"
    raise BadRequestError(f"input {quoted(name)}: data is {got} for shape {list(dims)} (send "
                          f"one flat array, or arrays nested {len(dims)} deep as the shape)")


def _not_of(name: str, datatype: str, exc: Exception) -> BadRequestError:
    where = str(exc).replace("`$", "`data")  # msgspec's path, from the data's root
    return BadRequestError(f"input {quoted(name)}: data is not {datatype}: {where}")


def _shaped(name: str, dtype: np.dtype[Any], dims: tuple[int, ...], values: Any,
            depth: int) -> np.ndarray[Any, Any]:
    """The array of ``dims`` from checked ``values`` nested ``depth`` deep."""
    try:
        array = np.array(values, dtype=dtype)
    except OverflowError:  # a UINT64 value over 2**64 - 1
        raise BadRequestError(f"input {quoted(name)}: a value out of {_DATATYPES[dtype]}'s "
                              "range") from None
    except ValueError:  # lists of different lengths side by side
        raise BadRequestError(f"input {quoted(name)}: nested arrays of different lengths "
                              f"for shape {list(dims)}") from None
    if depth <= 1:
        if array.size != math.prod(dims):
            raise BadRequestError(f"input {quoted(name)}: {array.size} values for shape "
                                  f"{list(dims)}")
        return array.reshape(dims)
    if array.shape != dims:
        raise BadRequestError(f"input {quoted(name)}: data nested as shape {list(array.shape)} "
                              f"for shape {list(dims)}")
    return array


def _checked_shape(name: str, shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as a tuple, if it is at most ``MAX_TENSOR_RANK`` integers >= 0 that describe at
    most ``MAX_TENSOR_ELEMENTS`` elements."""
    if len(shape) > MAX_TENSOR_RANK:
        raise BadRequestError(f"input {quoted(name)}: shape of {len(shape)} dimensions (at most "
                              f"{MAX_TENSOR_RANK})")
    dims = tuple(shape)
    elements = 1
    for dim in dims:
        # A dimension's value is named only once it is known to be small (a huge one would fill
        # the message; one of over 4300 digits is not even printable).
        if type(dim) is not int:
            raise BadRequestError(f"input {quoted(name)}: shape holds a {type(dim).__name__}, "
                                  "not an integer")
        if dim < 0:  # the model's metadata shape copied: its -1s stand for sizes to choose
            raise BadRequestError(f"input {quoted(name)}: shape has a dimension < 0 (send each "
                                  "dimension's size: -1 in a model's metadata means any size, "
                                  "and the first dimension is the batch, the request's number "
                                  "of rows)")
        if dim > MAX_TENSOR_ELEMENTS:
            raise BadRequestError(f"input {quoted(name)}: shape has a dimension "
                                  f"> {MAX_TENSOR_ELEMENTS}")
        elements *= dim or 1
    if elements > MAX_TENSOR_ELEMENTS:
        raise BadRequestError(f"input {quoted(name)}: shape {list(dims)} describes over "
                              f"{MAX_TENSOR_ELEMENTS} elements")
    return dims


# --------------------------------------------------------------------------- HTTP bodies


class HttpInput(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] = {}
    data: Any = None


class HttpOutput(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    parameters: dict[str, Any] = {}


class HttpInferBody(msgspec.Struct, forbid_unknown_fields=False):
    inputs: list[HttpInput]
    id: str | None = None
    parameters: dict[str, Any] = {}
    outputs: list[HttpOutput] | None = None


_BODY_DECODER = msgspec.json.Decoder(HttpInferBody)
_ENCODER = msgspec.json.Encoder()


class OipRequest(msgspec.Struct):
    """An inference request as both transports hand it to the frontend: the inputs, the
    requested outputs (None: all) with whether each goes back as binary data, the id to echo
    and the requested SLO."""

    inputs: dict[str, np.ndarray[Any, Any]]
    outputs: list[tuple[str, bool]] | None
    request_id: str | None
    slo_ms: float
    binary_outputs: bool  # the default for outputs not named in ``outputs``


def decode_http_body(body: bytes, header_length: int | None) -> OipRequest:
    """Decode ``POST /v2/models/<m>/infer``: JSON alone, or a JSON header of ``header_length``
    bytes followed by the binary inputs' bytes (Triton's binary tensor data extension)."""
    if header_length is None:
        header_length = len(body)
    if not 0 <= header_length <= len(body):
        raise BadRequestError(f"{HEADER_LENGTH} {header_length} is outside the body of "
                              f"{len(body)} bytes")
    try:
        parsed = _BODY_DECODER.decode(memoryview(body)[:header_length])
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise BadRequestError(f"bad inference request: {exc}") from None
    inputs = _http_inputs(parsed.inputs, body, header_length)
    binary_default = flag_parameter(parsed.parameters, "binary_data_output", False)
    outputs = None
    if parsed.outputs is not None:
        outputs = [(o.name, flag_parameter(o.parameters, "binary_data", binary_default))
                   for o in parsed.outputs]
        check_unique("output", [name for name, _ in outputs])
    return OipRequest(inputs, outputs, parsed.id, requested_slo_ms(parsed.parameters),
                      binary_default)


def flag_parameter(parameters: Mapping[str, Any], key: str, default: bool) -> bool:
    """The boolean parameter ``key`` (``default`` when absent)."""
    value = parameters.get(key, default)
    if type(value) is not bool:
        raise BadRequestError(f"parameter {key} must be true or false, got {quoted(value)}")
    return value


def check_unique(kind: str, names: Sequence[str]) -> None:
    """Refuse a request that names one input (or requested output) twice: which one would be
    meant is not for zserve to guess."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise BadRequestError(f"{kind} {quoted(name)} appears more than once in the "
                                  "request")
        seen.add(name)


def _http_inputs(inputs: list[HttpInput], body: bytes,
                 offset: int) -> dict[str, np.ndarray[Any, Any]]:
    check_unique("input", [tensor.name for tensor in inputs])
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for tensor in inputs:
        size = tensor.parameters.get("binary_data_size")
        if size is not None:
            if type(size) is not int or size < 0 or offset + size > len(body):
                raise BadRequestError(f"input {quoted(tensor.name)}: binary_data_size "
                                      f"{quoted(size)} does not fit the body")
            arrays[tensor.name] = array_from_bytes(tensor.name, tensor.datatype, tensor.shape,
                                                   body, offset=offset, nbytes=size)
            offset += size
        elif tensor.data is None:
            raise BadRequestError(f"input {quoted(tensor.name)} has neither data nor "
                                  "binary_data_size")
        else:
            arrays[tensor.name] = array_from_values(tensor.name, tensor.datatype, tensor.shape,
                                                    tensor.data)
    if offset != len(body):
        raise BadRequestError(f"{len(body) - offset} bytes after the last binary input")
    return arrays


def selected_outputs(request: OipRequest,
                     outputs: Mapping[str, Any]) -> list[tuple[str, Any, bool]]:
    """``(name, array, binary)`` of each output to return, in the order asked."""
    if request.outputs is None:
        return [(name, array, request.binary_outputs) for name, array in outputs.items()]
    chosen = []
    for name, binary in request.outputs:
        array = outputs.get(name)
        if array is None:
            raise BadRequestError(f"unknown output {quoted(name)} (the model returns "
                                  f"{', '.join(map(repr, outputs))})")
        chosen.append((name, array, binary))
    return chosen


def encode_http_response(model: str, request: OipRequest,
                         outputs: Mapping[str, Any]) -> tuple[list[Any], int | None]:
    """The response body's parts (the JSON header, then each binary output's buffer) and the
    header's length when any output is binary (None: the body is JSON alone)."""
    described: list[dict[str, Any]] = []
    tails: list[Any] = []
    for name, output, binary in selected_outputs(request, outputs):
        array = np.ascontiguousarray(output)
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(array.dtype),
                                 "shape": list(array.shape)}
        if binary:
            entry["parameters"] = {"binary_data_size": array.nbytes}
            tails.append(array.data.cast("B"))
        else:
            entry["data"] = array.reshape(-1).tolist()
        described.append(entry)
    response: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": described}
    if request.request_id is not None:
        response["id"] = request.request_id
    header = _ENCODER.encode(response)
    return [header, *tails], (len(header) if tails else None)


def encode_json(value: Any) -> bytes:
    return _ENCODER.encode(value)
