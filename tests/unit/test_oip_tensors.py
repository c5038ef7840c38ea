"""The pure parts of the OIP servers: request bodies (JSON and binary), parameters, output
encoding, metadata shapes, the readiness rule and the config keys."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zserve.config.cluster import ConfigError, parse_config
from zserve.config.signature import MAX_NAMED_ITEMS, ModelSignature, TensorSpec
from zserve.core.errors import MAX_ERROR_MESSAGE_BYTES, BadRequestError, bounded_message
from zserve.frontend import readiness
from zserve.frontend.oip.tensors import (
    MAX_TENSOR_ELEMENTS,
    MAX_TENSOR_RANK,
    decode_http_body,
    encode_http_response,
    model_metadata,
    requested_slo_ms,
)


def _binary_body(array: np.ndarray, **parameters: object) -> tuple[bytes, int]:
    header = json.dumps({"id": "7", "parameters": parameters, "inputs": [
        {"name": "x", "shape": list(array.shape), "datatype": "FP32",
         "parameters": {"binary_data_size": array.nbytes}}]}).encode()
    return header + array.tobytes(), len(header)


def test_binary_input_is_a_view_over_the_body() -> None:
    array = np.arange(6, dtype=np.float32).reshape(1, 6)
    body, length = _binary_body(array, binary_data_output=True)
    request = decode_http_body(body, length)
    decoded = request.inputs["x"]
    np.testing.assert_array_equal(decoded, array)
    assert decoded.base is not None and not decoded.flags.owndata  # no copy of the tensor
    assert request.request_id == "7" and request.binary_outputs


def test_json_input_and_bad_bodies() -> None:
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "INT64",
                                   "data": [[3, 4]]}]}).encode()
    request = decode_http_body(body, None)
    assert request.inputs["x"].dtype == np.int64 and request.inputs["x"].tolist() == [[3, 4]]
    array = np.zeros((1, 2), dtype=np.float32)
    full, length = _binary_body(array)
    with pytest.raises(BadRequestError, match="bytes after the last binary input"):
        decode_http_body(full + b"x", length)
    with pytest.raises(BadRequestError, match="outside the body"):
        decode_http_body(full, len(full) + 1)
    with pytest.raises(BadRequestError, match="values for shape"):
        decode_http_body(body.replace(b"[[3, 4]]", b"[3]"), None)
    with pytest.raises(BadRequestError, match="unsupported datatype 'BYTES'"):
        decode_http_body(body.replace(b"INT64", b"BYTES"), None)
    with pytest.raises(BadRequestError, match="bad inference request"):
        decode_http_body(b"{not json", None)


def _json_body(datatype: str, shape: object, data: object, **extra: object) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": datatype,
                                   "data": data}], **extra}).encode()


# Each datatype's JSON values: in range (decoded as given) and out of it or of the wrong kind.
IN_RANGE: dict[str, list[object]] = {
    "BOOL": [True, False], "UINT8": [0, 255], "UINT16": [0, 65535], "UINT32": [0, 2**32 - 1],
    "UINT64": [0, 2**64 - 1], "INT8": [-128, 127], "INT16": [-(2**15), 2**15 - 1],
    "INT32": [-(2**31), 2**31 - 1], "INT64": [-(2**63), 2**63 - 1],
    # FP16's largest is 65504; anything under 65520 rounds to it.
    "FP16": [-65519.0, 65519], "FP32": [-3.4e38, 3.4028235e38], "FP64": [-1.7e308, 5],
}
OUT_OF_RANGE: dict[str, list[object]] = {
    "BOOL": [0, 1, 2, 1.0, "true", None, {}],
    "UINT8": [256, -1, 1.0, True, "1", None], "UINT16": [65536, -1], "UINT32": [2**32, -1],
    "UINT64": [2**64, -1, 1.5], "INT8": [1000, -129, 0.5, False, {"a": 1}],
    "INT16": [2**15, -(2**15) - 1], "INT32": [2**31, -(2**31) - 1, 1e10],
    "INT64": [2**63, -(2**63) - 1, 10**30],
    "FP16": [65520, -1e6, True, "1.5", None], "FP32": [3.5e38, -1e300, False, {}],
    "FP64": ["nan", None, True],
}


@pytest.mark.parametrize("datatype", sorted(IN_RANGE))
def test_each_datatype_takes_its_values_and_refuses_others(datatype: str) -> None:
    """Every datatype decodes its own JSON values and answers any other value (out of range,
    another JSON type, a bool for a number or a number for a bool) BadRequestError naming the
    input and the datatype, never OverflowError or a silent conversion (numpy would turn 1000
    into an INT8, ``"1.5"`` into an FP32 and ``1e6`` into FP16 infinity)."""
    decoded = decode_http_body(_json_body(datatype, [2], IN_RANGE[datatype]), None).inputs["x"]
    assert decoded.shape == (2,)
    expected = np.array(IN_RANGE[datatype], dtype=decoded.dtype)
    np.testing.assert_array_equal(decoded, expected)
    assert np.isfinite(decoded.astype(np.float64)).all()
    for value in OUT_OF_RANGE[datatype]:
        with pytest.raises(BadRequestError, match=f"input 'x': .*{datatype}"):
            decode_http_body(_json_body(datatype, [1], [value]), None)


def test_json_beyond_float_range_is_refused() -> None:
    """A number no double holds (1e999) is refused while the body is parsed."""
    body = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP64", "data": [1e999]}]}'
    with pytest.raises(BadRequestError, match="out of range"):
        decode_http_body(body, None)


def test_data_flat_or_nested_as_the_shape() -> None:
    """Data is one flat array or arrays nested exactly as the shape; any other nesting, ragged
    arrays, a bare value for a shaped tensor or no data at all is a BadRequestError."""
    nested = decode_http_body(_json_body("INT32", [2, 2], [[1, 2], [3, 4]]), None).inputs["x"]
    assert nested.tolist() == [[1, 2], [3, 4]]
    flat = decode_http_body(_json_body("INT32", [2, 2], [1, 2, 3, 4]), None).inputs["x"]
    assert flat.tolist() == [[1, 2], [3, 4]]
    scalar = decode_http_body(_json_body("FP32", [], 5), None).inputs["x"]
    assert scalar.shape == () and scalar == 5
    refused = {
        "nested 2 deep": ([2], [[1], [2]]), "nested as shape": ([2, 2], [[1, 2, 3]]),
        "different lengths": ([2, 2], [[1, 2, 3], [4]]), "single value": ([1], 7),
        "3 values": ([2], [1, 2, 3]), "neither data": ([1], None),
        "not INT32": ([1], ["abc"]),
    }
    for message, (shape, data) in refused.items():
        with pytest.raises(BadRequestError, match=message):
            decode_http_body(_json_body("INT32", shape, data), None)


def test_shapes_are_bounded() -> None:
    """A shape of more than MAX_TENSOR_RANK dimensions (numpy stops at 64), a negative, huge or
    non-integer dimension, or dimensions whose product passes MAX_TENSOR_ELEMENTS (zeros left
    out: an empty tensor's other dimensions are bounded too) is a BadRequestError, in both the
    JSON and the binary form."""
    bad_shapes = {
        "65 dimensions": [1] * 65, f"{MAX_TENSOR_RANK + 1} dimensions": [1] * (MAX_TENSOR_RANK + 1),
        "dimension < 0": [-1], "dimension > ": [10**30],
        "describes over": [0, 2**40, 2**40],
    }
    for message, shape in bad_shapes.items():
        with pytest.raises(BadRequestError, match=message):
            decode_http_body(_json_body("FP32", shape, [1.0]), None)
        header = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                         "parameters": {"binary_data_size": 4}}]}).encode()
        with pytest.raises(BadRequestError, match=message):
            decode_http_body(header + b"\0" * 4, len(header))
    deepest = decode_http_body(_json_body("FP32", [1] * MAX_TENSOR_RANK, [1.0]), None)
    assert deepest.inputs["x"].ndim == MAX_TENSOR_RANK
    with pytest.raises(BadRequestError, match="Expected `int`, got `float`"):
        decode_http_body(_json_body("FP32", [1.5], [1.0]), None)
    assert MAX_TENSOR_ELEMENTS * 8 < 2**63  # numpy's byte count of the largest shape fits


def test_duplicate_names_and_bad_parameters() -> None:
    """An input or a requested output named twice is refused (the last one no longer silently
    wins), and so is a parameter of the wrong type or out of range."""
    twice = json.dumps({"inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]},
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [2.0]}]}).encode()
    with pytest.raises(BadRequestError, match="input 'x' appears more than once"):
        decode_http_body(twice, None)
    outputs = [{"name": "y"}, {"name": "y"}]
    with pytest.raises(BadRequestError, match="output 'y' appears more than once"):
        decode_http_body(_json_body("FP32", [1], [1.0], outputs=outputs), None)
    bad_parameters = [({"binary_data_output": "yes"}, "binary_data_output"),
                      ({"binary_data_output": 1}, "binary_data_output"),
                      ({"timeout": 10**400}, "timeout"), ({"slo_ms": 10**400}, "slo_ms"),
                      ({"slo_ms": [1] * 1000}, "a list of 1000")]
    for parameters, message in bad_parameters:
        with pytest.raises(BadRequestError, match=message):
            decode_http_body(_json_body("FP32", [1], [1.0], parameters=parameters), None)
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(BadRequestError, match="bad inference request"):
        decode_http_body(b'{"inputs": [], "parameters": {"p": ' + deep + b"}}", None)


def test_error_messages_are_bounded() -> None:
    """A request of 10,000 unexpected inputs, or of a megabyte-long name, gets a message of a
    few hundred bytes: names are cut, lists name their first few and count the rest, and
    ``bounded_message`` cuts what a frontend sends to MAX_ERROR_MESSAGE_BYTES of valid UTF-8."""
    signature = ModelSignature("m", (TensorSpec("x", "float32", (4,)),), ())
    inputs = {f"unexpected-{i}": np.zeros((1, 4), np.float32) for i in range(10_000)}
    with pytest.raises(BadRequestError) as raised:
        signature.validate_request(inputs)
    message = raised.value.message
    assert len(message) < 500 and f"and {10_000 - MAX_NAMED_ITEMS} more" in message, message
    long_name = json.dumps({"inputs": [{"name": "n" * 1_000_000, "shape": [1],
                                        "datatype": "FP32", "data": [1, 2]}]}).encode()
    with pytest.raises(BadRequestError) as raised:
        decode_http_body(long_name, None)
    assert len(raised.value.message) < 200 and "nnn..." in raised.value.message
    for text in ("é" * 5000, "x" * 5000, "\ud800" * 3000):
        cut = bounded_message(text)
        assert len(cut.encode()) <= MAX_ERROR_MESSAGE_BYTES and cut.endswith("more bytes)")
    assert bounded_message("short") == "short"


def test_slo_parameters() -> None:
    assert requested_slo_ms({}) == 0.0
    assert requested_slo_ms({"timeout": 250_000}) == 250.0  # microseconds, as tritonclient sends
    assert requested_slo_ms({"timeout": 250_000, "slo_ms": 40}) == 40.0
    for bad in ({"timeout": -1}, {"timeout": 1.5}, {"slo_ms": 0}, {"slo_ms": "x"}):
        with pytest.raises(BadRequestError):
            requested_slo_ms(bad)


def test_response_binary_and_json_outputs() -> None:
    array = np.arange(3, dtype=np.float32).reshape(1, 3)
    body, length = _binary_body(array)
    request = decode_http_body(body, length)
    outputs = {"y": np.array([[1.5, 2.5]], dtype=np.float32), "z": np.array([[7]])}
    parts, header_length = encode_http_response("m", request, outputs)
    assert header_length is None  # JSON alone: no output asked for binary
    answer = json.loads(parts[0])
    assert answer["id"] == "7" and answer["outputs"][0]["data"] == [1.5, 2.5]
    request.outputs = [("y", True)]
    parts, header_length = encode_http_response("m", request, outputs)
    assert header_length == len(parts[0]) and b"".join(parts)[header_length:] == \
        outputs["y"].tobytes()
    assert [o["name"] for o in json.loads(parts[0])["outputs"]] == ["y"]
    request.outputs = [("nope", False)]
    with pytest.raises(BadRequestError, match="unknown output 'nope'"):
        encode_http_response("m", request, outputs)


def test_metadata_marks_the_batch_dimension() -> None:
    signature = ModelSignature("m", (TensorSpec("x", "float16", (3, 4)),),
                               (TensorSpec("y", "int32", (None,)),))
    meta = model_metadata("m", signature)
    assert meta["inputs"] == [{"name": "x", "datatype": "FP16", "shape": [-1, 3, 4]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "INT32", "shape": [-1, -1]}]


def test_readiness_rule() -> None:
    table = {"backend-0": ["a"], "backend-1": ["a", "b"]}
    assert readiness.frontend_ready(True, ["a", "b"], table)
    assert not readiness.frontend_ready(False, ["a", "b"], table)  # draining
    assert not readiness.frontend_ready(True, ["a", "b"], {"backend-0": ["a"]})
    assert not readiness.frontend_ready(True, ["a"], None)  # no table yet
    assert readiness.unready_models(["a", "b", "c"], table) == ["c"]


def test_config_keys() -> None:
    def frontends(**keys: object) -> dict[str, object]:
        return {"frontends": keys, "models": [{"name": "m", "emulated": {"alpha_ms": 1,
                                                                          "beta_ms": 1}}]}

    config = parse_config(frontends(count=2, http_addresses=["127.0.0.1:8000", "[::1]:8000"],
                                    grpc_addresses=["127.0.0.1:0", "127.0.0.1:0"]))
    assert config.bind_addresses("frontend", 1, None)["http"] == "[::1]:8000"
    with pytest.raises(ConfigError, match=r"frontends.http_addresses\[1\]: .*its own port"):
        parse_config(frontends(count=2, http_addresses=["127.0.0.1:8000", "127.0.0.1:8000"]))
    with pytest.raises(ConfigError, match=r"frontends.grpc_addresses\[0\]: must be host:port"):
        parse_config(frontends(grpc_addresses=["tcp://127.0.0.1:8001"]))
    with pytest.raises(ConfigError, match=r"frontends\.http_addresses: more addresses"):
        parse_config(frontends(http_addresses=["127.0.0.1:1", "127.0.0.1:2"]))


def test_a_metadata_shape_sent_as_it_reads_is_explained() -> None:
    """``[-1, 4]`` copied from a model's metadata: the error says what -1 stands for and that
    the first dimension is the batch."""
    with pytest.raises(BadRequestError) as raised:
        decode_http_body(_json_body("FP32", [-1, 4], [0.0, 1.0, 2.0, 3.0]), None)
    assert "-1 in a model's metadata means any size" in raised.value.message
    assert "the first dimension is the batch" in raised.value.message
