"""The shipped gRPC messages: generated from zserve/frontend/oip/oip_inference.proto as it
stands, and wire-compatible with what tritonclient sends and expects (same names, numbers and
types); and how a ModelInferRequest decodes: typed contents checked like JSON values, names once
each, bytes that are no message a BadRequestError."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.model_config_pb2 as triton_config
import tritonclient.grpc.service_pb2 as triton_service
from google.protobuf import descriptor_pb2

from zserve.core.errors import BadRequestError
from zserve.frontend.oip import oip_inference_pb2 as pb
from zserve.frontend.oip.grpc_server import decode_message, decode_request

REPO = Path(__file__).resolve().parents[2]
GENERATED = Path("zserve/frontend/oip")
PROTO = str(GENERATED / "oip_inference.proto")
POOL_EDIT = ("_descriptor_pool.Default()", "_descriptor_pool.DescriptorPool()")


def _generate(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO),
                    f"--python_out={out}", f"--pyi_out={out}",
                    f"--descriptor_set_out={out / 'set.pb'}", str(REPO / PROTO)],
                   check=True, capture_output=True, text=True)


def test_shipped_modules_are_generated_from_the_proto(tmp_path: Path) -> None:
    _generate(tmp_path)
    fresh = (tmp_path / GENERATED / "oip_inference_pb2.py").read_text()
    shipped = (REPO / GENERATED / "oip_inference_pb2.py").read_text()
    assert shipped == fresh.replace(*POOL_EDIT), f"regenerate: see {PROTO}"
    fresh_stub = (tmp_path / GENERATED / "oip_inference_pb2.pyi").read_text()
    assert (REPO / GENERATED / "oip_inference_pb2.pyi").read_text() == fresh_stub
    shipped_proto = importlib.resources.files("zserve.frontend.oip").joinpath("oip_inference.proto")
    assert shipped_proto.is_file()


def test_every_field_matches_tritonclients(tmp_path: Path) -> None:
    """Each message, field number, type and label, the enum values and the service's methods
    are those of tritonclient's generated ``inference`` package (what the clients speak)."""
    _generate(tmp_path)
    files = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "set.pb").read_bytes())
    ours = files.file[0]
    theirs = {**triton_service.DESCRIPTOR.message_types_by_name,
              **triton_config.DESCRIPTOR.message_types_by_name}
    checked = 0
    for message in ours.message_type:
        checked += _compare(message, theirs[message.name])
    assert checked > 60
    enum = triton_config.DESCRIPTOR.enum_types_by_name["DataType"]
    assert {v.name: v.number for v in ours.enum_type[0].value} == {
        v.name: v.number for v in enum.values}
    service = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.package == "inference" and ours.service[0].name == service.name
    for method in ours.service[0].method:
        theirs_method = service.methods_by_name[method.name]
        assert method.input_type == "." + theirs_method.input_type.full_name
        assert method.output_type == "." + theirs_method.output_type.full_name


def _compare(message: descriptor_pb2.DescriptorProto, theirs: object) -> int:
    fields = theirs.fields_by_name  # type: ignore[attr-defined]
    nested = theirs.nested_types_by_name  # type: ignore[attr-defined]
    count = 0
    for field in message.field:
        other = fields[field.name]
        assert (field.number, field.type) == (other.number, other.type), field.name
        assert (field.label == field.LABEL_REPEATED) == other.is_repeated, field.name
        count += 1
    for inner in message.nested_type:
        count += _compare(inner, nested[inner.name])
    return count


def _request(*tensors: tuple[str, str, list[int]]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


def test_typed_contents_are_checked_against_the_datatype() -> None:
    """int_contents carry INT8 and INT16 as int32, uint_contents UINT8 and UINT16 as uint32 and
    fp32_contents FP16: a value beyond the datatype's range is a BadRequestError (numpy would
    raise OverflowError, or turn a float32 of 1e6 into FP16 infinity)."""
    for datatype, field, good, bad in [("INT8", "int_contents", -128, 1000),
                                       ("UINT16", "uint_contents", 65535, 65536),
                                       ("FP16", "fp32_contents", 65504.0, 1e6),
                                       ("FP32", "fp32_contents", 1.5, float("inf"))]:
        request = _request(("x", datatype, [1, 1]))
        getattr(request.inputs[0].contents, field).append(good)
        assert decode_request(request).inputs["x"].tolist() == [[good]]
        getattr(request.inputs[0].contents, field)[0] = bad
        with pytest.raises(BadRequestError, match=f"input 'x': data is not {datatype}"):
            decode_request(request)


def test_shapes_names_and_raw_contents() -> None:
    """A 65-dimension shape, a negative dimension, an input or requested output named twice:
    each a BadRequestError naming it."""
    deep = _request(("x", "FP32", [1] * 65))
    deep.raw_input_contents.append(b"\0" * 4)
    with pytest.raises(BadRequestError, match="shape of 65 dimensions"):
        decode_request(deep)
    negative = _request(("x", "FP32", [-1, 1]))
    negative.raw_input_contents.append(b"")
    with pytest.raises(BadRequestError, match="dimension < 0"):
        decode_request(negative)
    twice = _request(("x", "FP32", [1]), ("x", "FP32", [1]))
    twice.raw_input_contents.extend([np.float32(1).tobytes(), np.float32(2).tobytes()])
    with pytest.raises(BadRequestError, match="input 'x' appears more than once"):
        decode_request(twice)
    outputs = _request(("x", "FP32", [1]))
    outputs.raw_input_contents.append(np.float32(1).tobytes())
    outputs.outputs.add(name="y")
    assert decode_request(outputs).outputs == [("y", True)]
    outputs.outputs.add(name="y")
    with pytest.raises(BadRequestError, match="output 'y' appears more than once"):
        decode_request(outputs)


def test_bytes_that_are_no_message() -> None:
    """``decode_message`` parses a message or raises BadRequestError: the gRPC server hands
    the error to the method in the request's place, so it is answered INVALID_ARGUMENT."""
    request = _request(("x", "FP32", [1]))
    assert decode_message(pb.ModelInferRequest, request.SerializeToString()) == request
    for garbage in (b"\xff" * 16, b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x02\xc3\x28"):
        with pytest.raises(BadRequestError, match="undecodable ModelInferRequest"):
            decode_message(pb.ModelInferRequest, garbage)
