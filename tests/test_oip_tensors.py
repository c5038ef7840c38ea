"""The pure parts of the OIP servers: request bodies (JSON and binary), parameters, output
encoding, metadata shapes, the readiness rule and the config keys."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zserve import readiness
from zserve.config import ConfigError, parse_config
from zserve.errors import BadRequestError
from zserve.oip_tensors import (
    decode_http_body,
    encode_http_response,
    model_metadata,
    requested_slo_ms,
)
from zserve.signature import ModelSignature, TensorSpec


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
