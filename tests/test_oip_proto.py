"""The shipped gRPC messages: generated from zserve/oip_inference.proto as it stands, and
wire-compatible with what tritonclient sends and expects (same names, numbers and types)."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from pathlib import Path

import tritonclient.grpc.model_config_pb2 as triton_config
import tritonclient.grpc.service_pb2 as triton_service
from google.protobuf import descriptor_pb2

REPO = Path(__file__).resolve().parent.parent
PROTO = "zserve/oip_inference.proto"
POOL_EDIT = ("_descriptor_pool.Default()", "_descriptor_pool.DescriptorPool()")


def _generate(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO),
                    f"--python_out={out}", f"--pyi_out={out}",
                    f"--descriptor_set_out={out / 'set.pb'}", str(REPO / PROTO)],
                   check=True, capture_output=True, text=True)


def test_shipped_modules_are_generated_from_the_proto(tmp_path: Path) -> None:
    _generate(tmp_path)
    fresh = (tmp_path / "zserve" / "oip_inference_pb2.py").read_text()
    shipped = (REPO / "zserve" / "oip_inference_pb2.py").read_text()
    assert shipped == fresh.replace(*POOL_EDIT), "regenerate: see zserve/oip_inference.proto"
    fresh_stub = (tmp_path / "zserve" / "oip_inference_pb2.pyi").read_text()
    assert (REPO / "zserve" / "oip_inference_pb2.pyi").read_text() == fresh_stub
    assert importlib.resources.files("zserve").joinpath("oip_inference.proto").is_file()


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
