"""Every bad Open Inference Protocol request is a typed 4xx, never an exception out of a handler.

First, properties (hypothesis, no server): arbitrary JSON documents, arbitrary binary bodies with
and without ``Inference-Header-Content-Length``, arbitrary ModelInferRequest messages and raw
bytes sent as one, through the decoders (``decode_http_body``, ``decode_message`` and
``decode_request``) and the signature validation the frontend's core applies: each ends in a
request of OIP-typed arrays the model takes, or a ``ZServeError`` of kind BAD_REQUEST or
TOO_LARGE with a one-line message.

Then the defects those properties found, through a real cluster and the real clients: values out
of their datatype's range and shapes numpy cannot hold (once HTTP 500, gRPC UNKNOWN), bytes that
are no ModelInferRequest (once UNKNOWN), inputs named twice (once the last one silently won),
absurd parameters, and an error naming hundreds of unexpected inputs (once a gRPC trailer over
tritonclient's limit, answered RESOURCE_EXHAUSTED): each is answered 400 / INVALID_ARGUMENT with
a message of at most ``MAX_ERROR_MESSAGE_BYTES``, and the frontend goes on serving.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oip_helpers import grpc_input, http_input, oip_cluster
from tritonclient.utils import InferenceServerException

from zserve.cluster.supervisor import Cluster
from zserve.config.signature import MAX_NAMED_ITEMS, ModelSignature, TensorSpec
from zserve.core.errors import MAX_ERROR_MESSAGE_BYTES, ErrorKind, ZServeError, bounded_message
from zserve.frontend.oip import oip_inference_pb2 as pb
from zserve.frontend.oip.grpc_server import decode_message, decode_request
from zserve.frontend.oip.tensors import (
    HEADER_LENGTH,
    OipRequest,
    datatype_of,
    decode_http_body,
)

# --------------------------------------------------------------------------- properties

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # deterministic: the same examples on every run
    suppress_health_check=[HealthCheck.too_slow],
)
# A model of three inputs of different datatypes and ranks, so that valid requests happen too.
SIGNATURE = ModelSignature(
    "m", (TensorSpec("a", "int8", (2,)), TensorSpec("b", "bool", ()),
          TensorSpec("c", "float16", (3,))), (TensorSpec("y", "float32", (1,)),))
MAX_ROWS = 4
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64"]
REFUSED_KINDS = (ErrorKind.BAD_REQUEST, ErrorKind.TOO_LARGE)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(
        st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
names = st.sampled_from(["a", "b", "c", "x"]) | st.text(max_size=6)
datatypes = st.sampled_from([*DATATYPES, "BYTES", "fp32", ""])
shapes = (st.lists(st.integers(-1, 3), max_size=3) | st.lists(st.integers(), max_size=70)
          | json_values)
numbers = st.integers(-300, 300) | st.floats() | st.booleans() | st.integers()
tensor_data = (st.lists(numbers, max_size=12)
               | st.lists(st.lists(numbers, max_size=3), max_size=4) | json_values)
parameters = st.dictionaries(
    st.sampled_from(["timeout", "slo_ms", "binary_data_output", "binary_data", "other"]),
    json_values | st.integers(-5, 10**6), max_size=3)
json_tensors = st.fixed_dictionaries(
    {"name": names, "shape": shapes, "datatype": datatypes},
    optional={"data": tensor_data, "parameters": parameters})
# SIGNATURE's input dtypes: their OIP datatypes, values in their range, values that are not.
OIP_DATATYPE = {"int8": "INT8", "bool": "BOOL", "float16": "FP16"}
IN_RANGE = {"int8": st.integers(-128, 127), "bool": st.booleans(),
            "float16": st.floats(-65504, 65504)}
OUT_OF_RANGE = {"int8": st.integers(128, 10**20) | st.booleans() | st.floats(),
                "bool": st.integers(0, 2) | st.none(),
                "float16": st.floats(65520, 1e300) | st.text(max_size=3)}


@st.composite
def near_valid_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Requests for SIGNATURE's inputs, each one right seven times in ten (else of another
    shape or datatype, or with a value out of range): many are valid."""
    rows = draw(st.integers(0, MAX_ROWS + 1))
    inputs = []
    for spec in SIGNATURE.inputs:
        shape: Any = [rows, *(d or 0 for d in spec.shape)]
        count = int(np.prod(shape))
        values: list[Any] = draw(st.lists(IN_RANGE[spec.dtype], min_size=count, max_size=count))
        datatype = OIP_DATATYPE[spec.dtype]
        wrong = draw(st.integers(0, 9))
        if wrong == 0:
            shape = draw(shapes)
        elif wrong == 1:
            datatype = draw(datatypes)
        elif wrong == 2 and values:
            values[draw(st.integers(0, count - 1))] = draw(OUT_OF_RANGE[spec.dtype])
        inputs.append({"name": spec.name, "shape": shape, "datatype": datatype, "data": values})
    return {"inputs": draw(st.permutations(inputs)),
            "parameters": draw(st.just({}) | parameters)}


json_bodies = near_valid_bodies() | st.fixed_dictionaries(
    {"inputs": st.lists(json_tensors, max_size=4)},
    optional={"id": json_values, "parameters": parameters,
              "outputs": st.lists(st.fixed_dictionaries({"name": names},
                                                        optional={"parameters": parameters}),
                                  max_size=3)}) | json_values


def _decoded_or_refused(decode: Callable[[], OipRequest]) -> None:
    """Decoding, then validating against SIGNATURE, either yields the rows of a request of
    OIP-typed arrays, or raises a ZServeError of kind BAD_REQUEST or TOO_LARGE with a one-line
    message; any other exception fails the test."""
    try:
        request = decode()
        for array in request.inputs.values():
            assert isinstance(array, np.ndarray)
            datatype_of(array.dtype)
        rows = SIGNATURE.validate_request(request.inputs, max_rows=MAX_ROWS)
        assert 1 <= rows <= MAX_ROWS
        assert request.inputs["a"].shape == (rows, 2)
    except ZServeError as error:
        assert error.kind in REFUSED_KINDS, repr(error)
        assert "\n" not in error.message, error.message
        assert len(bounded_message(error.message).encode()) <= MAX_ERROR_MESSAGE_BYTES


def test_a_valid_request_passes_the_checks() -> None:
    """The properties' model takes requests at all: one valid JSON body, one valid message."""
    valid = [("a", "INT8", [2, 2], [-128, 127, 0, 1]), ("b", "BOOL", [2], [True, False]),
             ("c", "FP16", [2, 3], [0.5, -65504, 65519, 1, 2, 3])]
    body = json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                   "data": data} for name, datatype, shape, data in valid]})
    decoded = decode_http_body(body.encode(), None)
    assert SIGNATURE.validate_request(decoded.inputs, max_rows=MAX_ROWS) == 2
    message = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape, data in valid:
        tensor = message.inputs.add(name=name, datatype=datatype, shape=shape)
        field = {"INT8": "int_contents", "BOOL": "bool_contents", "FP16": "fp32_contents"}
        getattr(tensor.contents, field[datatype]).extend(data)
    request = decode_request(decode_message(pb.ModelInferRequest, message.SerializeToString()))
    assert SIGNATURE.validate_request(request.inputs, max_rows=MAX_ROWS) == 2
    np.testing.assert_array_equal(request.inputs["c"], decoded.inputs["c"])


@FUZZ
@given(json_bodies)
def test_arbitrary_json_bodies(body: Any) -> None:
    text = json.dumps(body).encode()  # NaN and Infinity included: not JSON, refused
    _decoded_or_refused(lambda: decode_http_body(text, None))


@FUZZ
@given(st.binary(max_size=200), st.none() | st.integers(-5, 250))
def test_arbitrary_binary_bodies(body: bytes, header_length: int | None) -> None:
    _decoded_or_refused(lambda: decode_http_body(body, header_length))


binary_tensors = st.fixed_dictionaries({
    "name": names, "shape": shapes, "datatype": datatypes,
    "parameters": st.fixed_dictionaries({"binary_data_size": st.integers(-2, 24) | json_values}),
})


@FUZZ
@given(st.lists(binary_tensors, max_size=4), st.binary(max_size=64), st.integers(-2, 2))
def test_binary_extension_bodies(tensors: list[Any], tail: bytes, skew: int) -> None:
    """A JSON header of binary inputs, arbitrary bytes after it, and a header length that is
    right or a few bytes off."""
    header = json.dumps({"inputs": tensors}).encode()
    _decoded_or_refused(lambda: decode_http_body(header + tail, len(header) + skew))


# (typed contents field, the values protobuf lets it hold)
CONTENTS = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
}
PARAMETER_CHOICES = {
    "bool_param": st.booleans(), "int64_param": st.integers(-(2**63), 2**63 - 1),
    "string_param": st.text(max_size=5), "double_param": st.floats(),
    "uint64_param": st.integers(0, 2**64 - 1),
}


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id=draw(st.text(max_size=4)))
    for _ in range(draw(st.integers(0, 4))):
        shape = draw(st.lists(st.integers(-1, 3), max_size=3)
                     | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=70))
        tensor = request.inputs.add(name=draw(names), datatype=draw(datatypes), shape=shape)
        field = draw(st.sampled_from(sorted(CONTENTS)))
        getattr(tensor.contents, field).extend(draw(st.lists(CONTENTS[field], max_size=8)))
    if draw(st.booleans()):
        request.raw_input_contents.extend(draw(st.lists(st.binary(max_size=24), max_size=5)))
    for key in draw(st.lists(st.sampled_from(["timeout", "slo_ms", "other"]), max_size=2)):
        choice = draw(st.sampled_from(sorted(PARAMETER_CHOICES)))
        setattr(request.parameters[key], choice, draw(PARAMETER_CHOICES[choice]))
    for name in draw(st.lists(names, max_size=3)):
        request.outputs.add(name=name)
    return request


@FUZZ
@given(infer_requests())
def test_arbitrary_infer_request_messages(request: pb.ModelInferRequest) -> None:
    data = request.SerializeToString()
    _decoded_or_refused(lambda: decode_request(decode_message(pb.ModelInferRequest, data)))


@FUZZ
@given(infer_requests(), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                  max_size=4), st.binary(max_size=200))
def test_raw_bytes_as_infer_requests(request: pb.ModelInferRequest,
                                     flips: list[tuple[int, int]], garbage: bytes) -> None:
    """Bytes a gRPC client may send as a ModelInferRequest: a message with a few bytes changed,
    and arbitrary bytes."""
    data = bytearray(request.SerializeToString())
    for position, value in flips:
        if data:
            data[position % len(data)] = value
    for payload in (bytes(data), garbage):
        _decoded_or_refused(lambda: decode_request(decode_message(pb.ModelInferRequest,
                                                                  payload)))  # noqa: B023


# --------------------------------------------------------------------------- end to end

X = np.arange(4, dtype=np.float32).reshape(1, 4)
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
# Unexpected inputs of long names, whose full list (about 26 KB) is over what a gRPC client takes
# in trailers (8-16 KiB), in a request well within the frontend's message and body bounds.
UNEXPECTED_GRPC_INPUTS = 500
UNEXPECTED_HTTP_INPUTS = 300
NAME_CHARS = 48
# A per-request SLO (ms) for the requests that check the frontend still serves: deferred
# batching holds a lone request until near its deadline, and model m's own SLO is 5 s.
CHECK_SLO_MS = 1500


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(oip_cluster(), ipc_base=tmp_path_factory.mktemp("oip-validation")) as running:
        yield running


def _unexpected_name(index: int) -> str:
    return f"unexpected-{index}".ljust(NAME_CHARS, "-")


def _post(cluster: Cluster, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST a JSON inference request to model ``m``: the status and the JSON answer."""
    request = urllib.request.Request(
        f"http://{cluster.http_addresses[0]}/v2/models/m/infer",
        data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            text = answer.read()
            header_length = int(answer.headers.get(HEADER_LENGTH, len(text)))
            return int(answer.status), json.loads(text[:header_length])
    except urllib.error.HTTPError as error:
        with error:
            text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:  # aiohttp's own page for an exception out of a handler
            return error.code, {"error": text.decode(errors="replace")}


def _call_raw(cluster: Cluster, payload: bytes) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """Send ``payload`` as ModelInfer's request bytes: the code, message and trailers."""
    with grpc.insecure_channel(cluster.grpc_addresses[0]) as channel:
        # No serializers: the bytes go as they are.
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(MODEL_INFER)
        try:
            call(payload, timeout=60)
        except grpc.RpcError as exc:
            trailers = {str(item.key): str(item.value) for item in exc.trailing_metadata() or ()}
            return exc.code(), str(exc.details()), trailers
    return grpc.StatusCode.OK, "", {}


def _json_input(datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": shape, "datatype": datatype, "data": data}]}


def _still_serving(cluster: Cluster) -> None:
    body = {**_json_input("FP32", [1, 4], [0, 1, 2, 3]), "parameters": {"slo_ms": CHECK_SLO_MS}}
    status, answer = _post(cluster, body)
    assert status == 200 and answer["outputs"][0]["name"] == "y", answer


@pytest.mark.parametrize(("datatype", "shape", "data", "problem"), [
    ("INT8", [1, 4], [1000, 0, 0, 0], "INT8"),
    ("UINT8", [1, 4], [-1, 0, 0, 0], "UINT8"),
    ("FP16", [1, 4], [1e6, 0, 0, 0], "FP16"),
    ("FP32", [1, 4], [True, 0, 0, 0], "FP32"),
    ("FP32", [1, 4], ["1", "2", "3", "4"], "FP32"),
    ("FP32", [1, 4], [[0, 1], [2, 3]], "nested as shape [2, 2]"),
    ("FP32", [1] * 65, [0], "65 dimensions"),
    ("FP32", [2**62, 2**62], [0], "dimension >"),
])
def test_bad_json_values_are_400(cluster: Cluster, datatype: str, shape: list[int], data: Any,
                                 problem: str) -> None:
    """Out of range (once HTTP 500: numpy's OverflowError), of another kind, nested wrong, or
    of a shape numpy cannot hold (once 500: reshape to 65 dimensions): 400 BAD_REQUEST."""
    status, answer = _post(cluster, _json_input(datatype, shape, data))
    assert status == 400, answer
    assert answer["kind"] == "BAD_REQUEST" and problem in answer["error"], answer


def test_bad_typed_contents_and_shapes_over_grpc(cluster: Cluster) -> None:
    """The same over gRPC: INT8 typed contents out of range and a 65-dimension shape were
    UNKNOWN (an exception out of the method); now INVALID_ARGUMENT, kind BAD_REQUEST."""
    out_of_range = pb.ModelInferRequest(model_name="m")
    tensor = out_of_range.inputs.add(name="x", datatype="INT8", shape=[1, 4])
    tensor.contents.int_contents.extend([1000, 0, 0, 0])
    deep = pb.ModelInferRequest(model_name="m", raw_input_contents=[X.tobytes()])
    deep.inputs.add(name="x", datatype="FP32", shape=[1] * 63 + [1, 4])
    for request, problem in ((out_of_range, "data is not INT8"), (deep, "65 dimensions")):
        code, message, trailers = _call_raw(cluster, request.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and problem in message, (code, message)
        assert trailers["zserve-error-kind"] == "BAD_REQUEST"
    _still_serving(cluster)


def test_undecodable_grpc_message_is_invalid_argument(cluster: Cluster) -> None:
    """Bytes that are no ModelInferRequest (once UNKNOWN, grpcio's answer to a deserializer's
    exception): INVALID_ARGUMENT, kind BAD_REQUEST, never ran."""
    for garbage in (b"\xff" * 32, b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x02\xc3\x28"):
        code, message, trailers = _call_raw(cluster, garbage)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)
        assert "undecodable ModelInferRequest" in message
        assert trailers["zserve-error-kind"] == "BAD_REQUEST"
        assert trailers["zserve-may-have-run"] == "false"
    _still_serving(cluster)


def test_duplicate_names_are_refused(cluster: Cluster) -> None:
    """An input named twice (once accepted, the last one silently winning) or an output asked
    for twice: 400 / INVALID_ARGUMENT naming it, through tritonclient."""
    http = httpclient.InferenceServerClient(cluster.http_addresses[0])
    grpc_client = grpcclient.InferenceServerClient(cluster.grpc_addresses[0])
    try:
        with pytest.raises(InferenceServerException, match="'x' appears more than once") as raised:
            http.infer("m", [http_input("x", X), http_input("x", X + 1)])
        assert raised.value.status() == "400"
        outputs = [httpclient.InferRequestedOutput("y")] * 2
        with pytest.raises(InferenceServerException, match="'y' appears more than once"):
            http.infer("m", [http_input("x", X)], outputs=outputs)
        with pytest.raises(InferenceServerException, match="'x' appears more than once") as raised:
            grpc_client.infer("m", [grpc_input("x", X), grpc_input("x", X + 1)])
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        answer = http.infer("m", [http_input("x", X)], timeout=CHECK_SLO_MS * 1000)
        assert answer.as_numpy("y") is not None
    finally:
        http.close()
        grpc_client.close()


def test_absurd_parameters_are_400(cluster: Cluster) -> None:
    """Parameters of the wrong type or beyond any number (once accepted as truthy, or a 500
    from float overflow): 400 naming the parameter."""
    for parameters, name in [({"binary_data_output": "yes"}, "binary_data_output"),
                             ({"timeout": "soon"}, "timeout"),
                             ({"timeout": 10**400}, "timeout"), ({"slo_ms": 10**400}, "slo_ms")]:
        body = {**_json_input("FP32", [1, 4], [0, 1, 2, 3]), "parameters": parameters}
        status, answer = _post(cluster, body)
        assert status == 400 and name in answer["error"], (parameters, status, answer)
    _still_serving(cluster)


def test_error_naming_many_inputs_fits_the_client(cluster: Cluster) -> None:
    """Hundreds of unexpected inputs over gRPC: the error once named them all in a trailer over
    tritonclient's metadata limit, so the client saw RESOURCE_EXHAUSTED instead (10,000 short
    names: 88 KB). Now INVALID_ARGUMENT with a message of at most MAX_ERROR_MESSAGE_BYTES
    naming the first few; the same over HTTP."""
    empty = np.zeros((1, 0), dtype=np.float32)
    grpc_client = grpcclient.InferenceServerClient(cluster.grpc_addresses[0])
    try:
        inputs = [grpc_input(_unexpected_name(i), empty) for i in range(UNEXPECTED_GRPC_INPUTS)]
        with pytest.raises(InferenceServerException) as raised:
            grpc_client.infer("m", inputs)
    finally:
        grpc_client.close()
    message = str(raised.value.message())
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT", raised.value
    assert f"and {UNEXPECTED_GRPC_INPUTS - MAX_NAMED_ITEMS} more" in message, message
    assert len(message.encode()) <= MAX_ERROR_MESSAGE_BYTES
    http = httpclient.InferenceServerClient(cluster.http_addresses[0])
    try:
        inputs = [http_input(_unexpected_name(i), empty) for i in range(UNEXPECTED_HTTP_INPUTS)]
        with pytest.raises(InferenceServerException) as raised:
            http.infer("m", inputs)
    finally:
        http.close()
    message = str(raised.value.message())
    assert raised.value.status() == "400" and "more" in message, raised.value
    assert len(message.encode()) <= MAX_ERROR_MESSAGE_BYTES
    _still_serving(cluster)
