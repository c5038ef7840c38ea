"""Built-in ONNX models, generated on first use and cached; never downloaded.

zserve ships no model files. The built-in models are *generated* with the ``onnx`` package from
seeded numpy weights the first time they are needed, and cached as ONNX files:

- ``cnn``: a small ResNet-style CNN on float32 ``N x 3 x 64 x 64`` images -> ``N x 10`` logits.
  A convolutional trunk (stem, residual blocks, strided downsampling) feeds a global average pool
  and a wide classifier head. The head's large weight matrices cost the same to stream through the
  caches whether the batch holds 1 image or 32, so the model shows a clear batching effect on a
  CPU (``l(b) = alpha*b + beta`` with beta several times alpha), like a real CNN on a GPU.
- ``mlp``: float32 ``N x 64`` -> ``N x 10``, two dense layers; tiny, for fast tests.
- ``cnn-u8`` / ``cnn-f16``: ``cnn`` taking uint8 pixels (normalised inside the graph) or float16
  images: a quarter or half of the bytes on the wire (``zserve.backends.wire_inputs``).

Every input and output has the dynamic batch dimension ``"N"``.

Cache: ``$ZSERVE_CACHE_DIR`` if set, else ``~/.cache/zserve/models``. Files are named
``NAME-vVERSION.onnx``; VERSION changes whenever a generator changes, so a stale file is never
reused. Files are written atomically (temporary file in the same folder, then ``os.replace``), so
concurrent processes building the same model at once are safe and a crash leaves no half file.

Model specs (how every zserve command names a model):

- ``cnn`` or ``mlp``: a built-in model (built on first use).
- ``NAME=PATH.onnx``: any ONNX file, served under the name NAME.
- ``PATH.onnx`` (anything containing ``/`` or ending in ``.onnx``): any ONNX file, served under
  its file stem (``models/resnet50.onnx`` -> ``resnet50``).

A model file must have a dynamic first (batch) dimension on every input and output and fixed
sizes in every other input dimension; the ONNX Runtime executor refuses anything else at load
time with a message naming the input.

Command line (``zserve models``)::

    zserve models list            # the built-in models, whether they are cached, and their paths
    zserve models build [NAME..]  # build (all, by default) into the cache
    zserve models path NAME       # print the cached file's path (building it if needed)
    zserve models narrow IN.onnx OUT.onnx --input uint8|float16   # smaller inputs on the wire
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CACHE_ENV_VAR = "ZSERVE_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/zserve/models")
BATCH_DIM = "N"
# The ONNX opset the generators target; ONNX Runtime >= 1.18 supports it.
OPSET = 17
SEED = 20240521
CACHE_FILE_MODE = 0o644


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model to serve: its name and the ONNX file that holds it."""

    name: str
    path: Path


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    name: str
    version: int
    description: str
    build: Callable[[], bytes]


def cache_dir() -> Path:
    """Where built-in models are cached (``$ZSERVE_CACHE_DIR`` or ``~/.cache/zserve/models``)."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured).expanduser() if configured else DEFAULT_CACHE_DIR.expanduser()


def builtin_names() -> list[str]:
    return list(_BUILTINS)


def builtin_path(name: str) -> Path:
    """The cache path of built-in model ``name`` (whether or not it exists yet)."""
    model = _builtin(name)
    return cache_dir() / f"{model.name}-v{model.version}.onnx"


def ensure_builtin(name: str) -> Path:
    """The path of built-in model ``name``, generating and caching it first if needed."""
    path = builtin_path(name)
    if path.is_file():
        return path
    data = _builtin(name).build()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic publish: a reader sees either no file or the whole file, never a partial one.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            os.fchmod(tmp.fileno(), CACHE_FILE_MODE)  # mkstemp creates 0600
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def resolve_model_spec(spec: str) -> ModelSpec:
    """Turn a model spec (``cnn``, ``NAME=PATH.onnx`` or ``PATH.onnx``) into a ModelSpec.

    Built-in names are built into the cache on first use. Paths are not opened here (the executor
    reports a missing or corrupt file when it loads the model).
    """
    spec = spec.strip()
    if not spec:
        raise ValueError("empty model spec")
    if "=" in spec:
        name, _, path_text = spec.partition("=")
        name, path_text = name.strip(), path_text.strip()
        if not name or not path_text:
            raise ValueError(f"model spec {spec!r}: expected NAME=PATH.onnx")
        return ModelSpec(name, Path(path_text).expanduser())
    if spec in _BUILTINS:
        return ModelSpec(spec, ensure_builtin(spec))
    if "/" in spec or spec.endswith(".onnx"):
        path = Path(spec).expanduser()
        return ModelSpec(path.stem, path)
    raise ValueError(
        f"model spec {spec!r} is neither a built-in model ({', '.join(_BUILTINS)}) "
        "nor NAME=PATH.onnx nor a path to an .onnx file"
    )


def _builtin(name: str) -> BuiltinModel:
    try:
        return _BUILTINS[name]
    except KeyError:
        raise ValueError(
            f"unknown built-in model {name!r} (built-in: {', '.join(_BUILTINS)})"
        ) from None


# --------------------------------------------------------------------------- generators


class _GraphBuilder:
    """Collects nodes and seeded initializers of one ONNX graph."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._counter = 0

    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def weight(self, prefix: str, shape: tuple[int, ...], fan_in: int) -> str:
        from onnx import numpy_helper

        # He-normal initialisation keeps activations of a ReLU network at a sane scale.
        values = self.rng.normal(0.0, np.sqrt(2.0 / fan_in), size=shape).astype(np.float32)
        name = self.fresh(prefix)
        self.initializers.append(numpy_helper.from_array(values, name))
        return name

    def bias(self, prefix: str, size: int) -> str:
        from onnx import numpy_helper

        values = self.rng.normal(0.0, 0.01, size=(size,)).astype(np.float32)
        name = self.fresh(prefix)
        self.initializers.append(numpy_helper.from_array(values, name))
        return name

    def node(self, op: str, inputs: list[str], out: str = "", **attrs: Any) -> str:
        from onnx import helper

        out = out or self.fresh(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def conv(self, x: str, c_in: int, c_out: int, stride: int = 1) -> str:
        w = self.weight("conv_w", (c_out, c_in, 3, 3), fan_in=c_in * 9)
        b = self.bias("conv_b", c_out)
        return self.node("Conv", [x, w, b], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         strides=[stride, stride])

    def dense(self, x: str, n_in: int, n_out: int, out: str = "") -> str:
        w = self.weight("fc_w", (n_in, n_out), fan_in=n_in)
        b = self.bias("fc_b", n_out)
        return self.node("Gemm", [x, w, b], out=out)

    def model_bytes(self, name: str, input_name: str, input_shape: list[int | str],
                    output_name: str, output_shape: list[int | str]) -> bytes:
        from onnx import TensorProto, checker, helper

        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, input_shape)],
            [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, output_shape)],
            initializer=self.initializers,
        )
        model = helper.make_model(
            graph,
            producer_name="zserve",
            opset_imports=[helper.make_opsetid("", OPSET)],
        )
        # Keep the IR version loadable by older ONNX Runtime builds.
        model.ir_version = 8
        checker.check_model(model)
        return bytes(model.SerializeToString())


# CNN shape parameters. The trunk sets the per-image cost (alpha); the classifier head's weights
# (HEAD_WIDTH^2 floats) set the per-batch cost (beta). Tuned so that on a 1-thread CPU l(1) is a
# few ms and l(32) stays well under 60 ms.
CNN_IMAGE_SIZE = 64
CNN_CHANNELS = (16, 32)
CNN_HEAD_WIDTH = 3072


def _build_cnn() -> bytes:
    g = _GraphBuilder(SEED)
    c1, c2 = CNN_CHANNELS
    x = g.node("Relu", [g.conv("image", 3, c1, stride=2)])  # 32x32
    x = _residual_block(g, x, c1)
    x = g.node("Relu", [g.conv(x, c1, c2, stride=2)])  # 16x16
    x = _residual_block(g, x, c2)
    x = g.node("GlobalAveragePool", [x])
    x = g.node("Flatten", [x], axis=1)
    x = g.node("Relu", [g.dense(x, c2, CNN_HEAD_WIDTH)])
    x = g.node("Relu", [g.dense(x, CNN_HEAD_WIDTH, CNN_HEAD_WIDTH)])
    g.dense(x, CNN_HEAD_WIDTH, 10, out="logits")
    size = CNN_IMAGE_SIZE
    return g.model_bytes("zserve_cnn", "image", [BATCH_DIM, 3, size, size], "logits",
                         [BATCH_DIM, 10])


def _residual_block(g: _GraphBuilder, x: str, channels: int) -> str:
    y = g.node("Relu", [g.conv(x, channels, channels)])
    y = g.conv(y, channels, channels)
    return g.node("Relu", [g.node("Add", [x, y])])


def _build_mlp() -> bytes:
    g = _GraphBuilder(SEED + 1)
    x = g.node("Relu", [g.dense("features", 64, 128)])
    g.dense(x, 128, 10, out="logits")
    return g.model_bytes("zserve_mlp", "features", [BATCH_DIM, 64], "logits", [BATCH_DIM, 10])


def _build_cnn_u8() -> bytes:
    from zserve.backends.wire_inputs import narrow_input

    return narrow_input(_build_cnn(), "uint8")


def _build_cnn_f16() -> bytes:
    from zserve.backends.wire_inputs import narrow_input

    return narrow_input(_build_cnn(), "float16")


_BUILTINS: dict[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel("cnn", 1, "ResNet-style CNN, float32 Nx3x64x64 -> Nx10", _build_cnn),
        BuiltinModel("mlp", 1, "two-layer MLP, float32 Nx64 -> Nx10", _build_mlp),
        BuiltinModel("cnn-u8", 1, "cnn taking uint8 pixels, normalised in the graph",
                     _build_cnn_u8),
        BuiltinModel("cnn-f16", 1, "cnn taking float16 Nx3x64x64", _build_cnn_f16),
    )
}


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str]) -> int:
    """``zserve models list|build|path``."""
    parser = argparse.ArgumentParser(
        prog="zserve models",
        description="Build (or list) the built-in ONNX models. They are generated from seeded "
        f"weights, never downloaded, and cached in ${CACHE_ENV_VAR} "
        "(default ~/.cache/zserve/models).",
    )
    sub = parser.add_subparsers(dest="action")
    sub.add_parser("list", help="list the built-in models and their cache paths (default)")
    build = sub.add_parser("build", help="build models into the cache")
    build.add_argument("names", nargs="*", help="models to build (default: all)")
    path = sub.add_parser("path", help="print a built-in model's path, building it if needed")
    path.add_argument("name")
    narrow = sub.add_parser("narrow", help="rewrite a float32 image model to take uint8 "
                            "(normalised in the graph) or float16 inputs")
    narrow.add_argument("source", type=Path)
    narrow.add_argument("target", type=Path)
    narrow.add_argument("--input", choices=("uint8", "float16"), default="uint8")
    args = parser.parse_args(list(argv))

    try:
        if args.action in (None, "list"):
            print(f"cache: {cache_dir()}")
            for model in _BUILTINS.values():
                file = builtin_path(model.name)
                state = "cached" if file.is_file() else "not built"
                print(f"  {model.name:<7} {model.description:<52} {state:<9} {file}")
        elif args.action == "narrow":
            from zserve.backends.wire_inputs import narrow_input

            args.target.write_bytes(narrow_input(args.source.read_bytes(), args.input))
            print(args.target)
        elif args.action == "build":
            for name in args.names or builtin_names():
                print(ensure_builtin(name))
        else:
            print(ensure_builtin(args.name))
    except (ValueError, OSError) as exc:
        print(f"zserve models: {exc}", file=sys.stderr)
        return 2
    return 0
