"""Prefix batching (Nexus, section 2.5): models that share a prefix run it once at their merged
batch, then each runs its own head on its rows.

Specialised models (transfer learning re-trains the output layers) share all but their last
layers. Batched separately, each pays the whole network's fixed cost per batch; grouped, the
rows of every variant join one batch through the shared prefix and only the small heads run
per variant. This module finds the prefix and runs a group:

- ``structural_digests``: a digest per tensor of an ONNX graph from what computes it (operator,
  attributes, the digests of its inputs; an initializer's digest is its dtype, shape and bytes),
  never from names, so two models exported separately with equal layers and weights agree.
- ``find_prefix``: the tensors every model computes alike, and the cut: the shared tensors that a
  model's own layers read. ``split_models`` cuts the files with ``onnx.utils.extract_model``:
  one prefix file (from the first model) and one head file per model, reading the cut.
- ``PrefixGroup``: ONNX Runtime sessions of the prefix and the heads; ``run`` takes each
  variant's rows, runs the prefix once on all of them and each head on its own rows. Its outputs
  equal the full models' (``tests/unit/test_prefix_batching.py``: max abs diff <= 1e-5).
- ``cnn_variants``: the built-in ``cnn`` with its last layer re-drawn per variant (seeded), the
  models the experiment and the tests group.

- ``merge_group`` / ``group_model_file`` / ``backend_groups``: what a backend serves for a
  ``[[prefix_groups]]`` group: one ONNX model holding the prefix once and every head, each row
  routed to its head by the ``HEAD_INPUT`` the frontend adds (docs/runtime.md, "Prefix groups").

``zserve experiment prefix [--live]`` measures what grouping gives, in the simulator, on this
machine's CPU and in a live cluster (docs/performance.md, "Prefix batching").
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zserve.config.cluster import ModelConfig
from zserve.config.prefix_groups import HEAD_INPUT, PrefixGroupConfig, group_model

# A cut tensor is read from a model's own layers; a prefix needs at least this many shared nodes.
MIN_PREFIX_NODES = 1
VARIANT_SEED = 7919  # the seed of variant i's last layer is VARIANT_SEED + i


class NoCommonPrefix(ValueError):
    """The models share no prefix that their heads could start from."""


def _tensor_digest(tensor: Any) -> str:
    from onnx import numpy_helper

    values = numpy_helper.to_array(tensor)
    h = hashlib.sha256()
    h.update(f"init:{values.dtype}:{values.shape}:".encode())
    h.update(np.ascontiguousarray(values).tobytes())
    return h.hexdigest()


def _input_digest(index: int, value_info: Any) -> str:
    dims = value_info.type.tensor_type.shape.dim
    shape = [d.dim_value if d.HasField("dim_value") else "?" for d in dims]
    elem = value_info.type.tensor_type.elem_type
    return hashlib.sha256(f"input:{index}:{elem}:{shape}".encode()).hexdigest()


def structural_digests(model: Any) -> dict[str, str]:
    """Each tensor name of ``model``'s graph -> a digest of what computes it (see the module
    docstring). The graph's nodes must be in topological order, as ONNX requires."""
    graph = model.graph
    digests = {t.name: _tensor_digest(t) for t in graph.initializer}
    for index, value in enumerate(i for i in graph.input if i.name not in digests):
        digests[value.name] = _input_digest(index, value)
    for node in graph.node:
        h = hashlib.sha256(f"{node.domain}:{node.op_type}".encode())
        for attribute in sorted(node.attribute, key=lambda a: a.name):
            h.update(attribute.SerializeToString(deterministic=True))
        for name in node.input:
            h.update(digests.get(name, "absent").encode() if name else b"none")
        node_digest = h.hexdigest()
        for position, name in enumerate(node.output):
            digests[name] = hashlib.sha256(f"{node_digest}:{position}".encode()).hexdigest()
    return digests


@dataclass(frozen=True, slots=True)
class PrefixCut:
    """The shared prefix of a group: ``cut_names[i]`` are model i's names of the cut tensors (in
    one order for every model); ``prefix_nodes``: how many nodes the prefix holds."""

    cut_names: list[list[str]]
    prefix_nodes: int


def find_prefix(models: Sequence[Any]) -> PrefixCut:
    """The prefix every model in ``models`` computes alike; raises ``NoCommonPrefix``."""
    if len(models) < 2:
        raise NoCommonPrefix("a prefix group needs at least two models")
    per_model = [structural_digests(m) for m in models]
    produced = [{out for node in m.graph.node for out in node.output} for m in models]
    shared = set.intersection(*({d for n, d in digests.items() if n in outs}
                                for digests, outs in zip(per_model, produced, strict=True)))
    cut: list[str] = []  # digests, in first-seen order
    for model, digests in zip(models, per_model, strict=True):
        for node in model.graph.node:
            if any(digests[out] in shared for out in node.output):
                continue  # a shared node: inside the prefix
            for name in node.input:
                digest = digests.get(name)
                if digest in shared and digest not in cut:
                    cut.append(digest)
    prefix_nodes = sum(1 for node in models[0].graph.node
                       if any(per_model[0][out] in shared for out in node.output))
    if not cut or prefix_nodes < MIN_PREFIX_NODES:
        raise NoCommonPrefix("the models share no layer their heads read")
    names = [{d: n for n, d in digests.items()} for digests in per_model]
    return PrefixCut([[by_digest[d] for d in cut] for by_digest in names], prefix_nodes)


@dataclass(frozen=True, slots=True)
class PrefixSplit:
    """The files of a group: the prefix, and per model its head (reading ``cut_names[i]``)."""

    prefix_path: Path
    head_paths: list[Path]
    cut: PrefixCut
    input_names: list[str]


def split_models(paths: Sequence[Path], out_dir: Path) -> PrefixSplit:
    """Cut the ONNX files ``paths`` into one prefix file and a head file each, in ``out_dir``."""
    import onnx
    from onnx.utils import extract_model

    models = [onnx.load(str(p)) for p in paths]
    cut = find_prefix(models)
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs = [i.name for i in models[0].graph.input
              if i.name not in {t.name for t in models[0].graph.initializer}]
    prefix_path = out_dir / "prefix.onnx"
    extract_model(str(paths[0]), str(prefix_path), inputs, cut.cut_names[0])
    heads = []
    for i, (path, model) in enumerate(zip(paths, models, strict=True)):
        head = out_dir / f"head-{i}.onnx"
        extract_model(str(path), str(head), cut.cut_names[i],
                      [o.name for o in model.graph.output])
        heads.append(head)
    return PrefixSplit(prefix_path, heads, cut, inputs)


class PrefixGroup:
    """ONNX Runtime sessions (CPU provider unless ``providers`` says otherwise) of a split group;
    ``run`` runs the prefix once on every variant's rows, then each head on its own rows."""

    def __init__(self, split: PrefixSplit, providers: Sequence[str] = ("CPUExecutionProvider",),
                 threads: int = 1) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.split = split
        self.prefix = ort.InferenceSession(str(split.prefix_path), options,
                                           providers=list(providers))
        self.heads = [ort.InferenceSession(str(p), options, providers=list(providers))
                      for p in split.head_paths]

    def run(self, rows: Mapping[int, Mapping[str, np.ndarray[Any, Any]]]
            ) -> dict[int, list[np.ndarray[Any, Any]]]:
        """``rows``: variant index -> its inputs (batch first); -> each variant's outputs."""
        order = [v for v in rows if len(next(iter(rows[v].values()))) > 0]
        if not order:
            return {}
        merged = {name: np.concatenate([rows[v][name] for v in order])
                  for name in self.split.input_names}
        cut_values = self.prefix.run(self.split.cut.cut_names[0], merged)
        out: dict[int, list[np.ndarray[Any, Any]]] = {}
        start = 0
        for v in order:
            count = len(next(iter(rows[v].values())))
            feed = {name: value[start:start + count] for name, value in
                    zip(self.split.cut.cut_names[v], cut_values, strict=True)}
            out[v] = self.heads[v].run(None, feed)
            start += count
        return out


GROUP_OPSET = 13  # Unsqueeze with an axes input; NonZero, ScatterND and Gather are older


def _const(name: str, values: Sequence[int]) -> Any:
    from onnx import helper, numpy_helper

    return helper.make_node("Constant", [], [name],
                            value=numpy_helper.from_array(np.array(values, np.int64), name))


def _output_specs(model: Any) -> list[tuple[str, int, list[int]]]:
    """(name, element type, per-row dims) of each output; the per-row dims must be fixed, since
    the group's outputs start as zeros of that shape that each head scatters its rows into."""
    specs = []
    for out in model.graph.output:
        dims = out.type.tensor_type.shape.dim
        rest = [d.dim_value for d in list(dims)[1:]]
        if any(v <= 0 for v in rest):
            raise NoCommonPrefix(f"output {out.name!r} has a dynamic per-row dimension")
        specs.append((out.name, out.type.tensor_type.elem_type, rest))
    return specs


def _route_head(v: int, split: PrefixSplit, head: Any, acc: dict[str, str]) -> list[Any]:
    """The nodes that run head ``v`` on its rows: select them (Equal, NonZero), gather the cut
    tensors' rows, run the head's own nodes (names prefixed ``h<v>_``), and scatter its
    outputs into the group's (``acc``: output -> the tensor holding it so far, updated)."""
    from onnx import helper

    tag = f"h{v}_"
    nodes = [_const(f"{tag}id", [v]),
             helper.make_node("Equal", [HEAD_INPUT, f"{tag}id"], [f"{tag}mask"]),
             helper.make_node("NonZero", [f"{tag}mask"], [f"{tag}nz"]),
             helper.make_node("Reshape", [f"{tag}nz", "zs_flat"], [f"{tag}rows"]),
             helper.make_node("Unsqueeze", [f"{tag}rows", "zs_axis1"], [f"{tag}where"])]
    for prefix_name, own_name in zip(split.cut.cut_names[0], split.cut.cut_names[v],
                                     strict=True):
        nodes.append(helper.make_node("Gather", [prefix_name, f"{tag}rows"],
                                      [tag + own_name], axis=0))
    nodes.extend(head.graph.node)
    for out, so_far in list(acc.items()):
        nodes.append(helper.make_node("ScatterND", [so_far, f"{tag}where", tag + out],
                                      [f"{tag}acc_{out}"]))
        acc[out] = f"{tag}acc_{out}"
    return nodes


def merge_group(split: PrefixSplit, out_path: Path) -> Path:
    """One ONNX model for a split group: the prefix once on every row, then each head on the
    rows whose ``HEAD_INPUT`` names it (gathered, run, scattered back into row order). Every
    head's nodes run on every batch, on zero rows when none is its own, so the model's l(b)
    does not depend on the mix: the scheduler plans the group as one model by it. The heads'
    outputs must agree in names, types and per-row shapes (a variant's answer has its model's
    outputs)."""
    import onnx
    from onnx import TensorProto, helper
    from onnx.compose import add_prefix

    prefix = onnx.load(str(split.prefix_path))
    heads = [onnx.load(str(p)) for p in split.head_paths]
    specs = _output_specs(heads[0])
    for v, head in enumerate(heads[1:], start=1):
        if _output_specs(head) != specs:
            raise NoCommonPrefix(f"model {v}'s outputs differ from model 0's: {specs}")
    nodes = list(prefix.graph.node)
    nodes += [_const("zs_flat", [-1]), _const("zs_axis1", [1]),
              helper.make_node("Shape", [HEAD_INPUT], ["zs_rows"])]
    acc: dict[str, str] = {}
    for name, elem, rest in specs:
        nodes += [_const(f"zs_rest_{name}", rest),
                  helper.make_node("Concat", ["zs_rows", f"zs_rest_{name}"],
                                   [f"zs_shape_{name}"], axis=0),
                  helper.make_node("ConstantOfShape", [f"zs_shape_{name}"], [f"zs_zero_{name}"],
                                   value=helper.make_tensor("zero", elem, [1], [0]))]
        acc[name] = f"zs_zero_{name}"
    initializers = list(prefix.graph.initializer)
    for v, head in enumerate(heads):
        renamed = add_prefix(head, f"h{v}_")
        initializers += list(renamed.graph.initializer)
        nodes += _route_head(v, split, renamed, acc)
    nodes += [helper.make_node("Identity", [acc[name]], [name]) for name, _, _ in specs]
    inputs = [i for i in prefix.graph.input if i.name in split.input_names]
    inputs.append(helper.make_tensor_value_info(HEAD_INPUT, TensorProto.INT64, ["N"]))
    graph = helper.make_graph(nodes, "prefix_group", inputs, list(heads[0].graph.output),
                              initializer=initializers)
    opset = max([GROUP_OPSET] + [o.version for o in prefix.opset_import if o.domain == ""])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = prefix.ir_version
    onnx.checker.check_model(model)
    onnx.save(model, str(out_path))
    return out_path


def group_model_file(paths: Sequence[Path], cache: Path) -> Path:
    """The merged model (``merge_group``) of the ONNX files ``paths``, in order, built once and
    cached under ``cache`` by a digest of the files' bytes; written atomically (a temporary
    folder, then ``os.replace``), so backends that build it at once are safe."""
    import os
    import tempfile

    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    target = cache / f"prefix-group-{digest.hexdigest()[:20]}.onnx"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".group-") as tmp:
        split = split_models(paths, Path(tmp))
        os.replace(merge_group(split, Path(tmp) / "group.onnx"), target)
    return target


@dataclass(frozen=True, slots=True)
class BackendGroups:
    """What a backend loads for its prefix groups: ``models``, its models with each group whose
    every model it serves replaced by the group's merged model; ``grouped``: each such model ->
    (its group, its own signature in wire form, which the frontends validate its requests by)."""

    models: list[ModelConfig]
    grouped: dict[str, tuple[str, dict[str, Any]]]


def model_file(config: ModelConfig) -> Path:
    """The ONNX file of an ``onnx`` or ``builtin`` model (a built-in one generated first)."""
    from zserve.backends.builtin import ensure_builtin

    if config.builtin is not None:
        return ensure_builtin(config.builtin)
    if config.onnx is None:
        raise NoCommonPrefix(f"model {config.name!r} has no ONNX file")
    return Path(config.onnx)


def backend_groups(groups: Sequence[PrefixGroupConfig], served: Sequence[ModelConfig],
                   cache: Path) -> BackendGroups:
    """Replace in ``served`` each group of ``groups`` whose every model it holds by the group's
    merged model (``group_model_file``, cached under ``cache``)."""
    from zserve.backends.onnx_executor import read_signature

    by_name = {m.name: m for m in served}
    models = list(served)
    grouped: dict[str, tuple[str, dict[str, Any]]] = {}
    for group in groups:
        if not all(name in by_name for name in group.models):
            continue
        paths = [model_file(by_name[name]) for name in group.models]
        merged = group_model(group, served, onnx=str(group_model_file(paths, cache)))
        at = min(models.index(by_name[name]) for name in group.models)
        models = [m for m in models if m.name not in group.models]
        models.insert(min(at, len(models)), merged)
        for name, path in zip(group.models, paths, strict=True):
            grouped[name] = (group.name, read_signature(path, name).to_dict())
    return BackendGroups(models, grouped)


def cnn_variants(count: int, out_dir: Path) -> list[Path]:
    """``count`` variants of the built-in ``cnn``: its layers, with the last layer's weights and
    bias re-drawn per variant (seeded), as fine-tuned classifiers are; files in ``out_dir``."""
    import onnx
    from onnx import numpy_helper

    from zserve.backends.builtin import ensure_builtin

    base = onnx.load(str(ensure_builtin("cnn")))
    last = base.graph.node[-1]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for v in range(count):
        model = onnx.ModelProto()
        model.CopyFrom(base)
        rng = np.random.default_rng(VARIANT_SEED + v)
        for tensor in model.graph.initializer:
            if tensor.name in last.input[1:]:
                values = numpy_helper.to_array(tensor)
                fresh = rng.normal(0.0, float(values.std()) or 0.01, size=values.shape)
                tensor.CopyFrom(numpy_helper.from_array(fresh.astype(values.dtype),
                                                        tensor.name))
        path = out_dir / f"cnn-variant-{v}.onnx"
        onnx.save(model, str(path))
        paths.append(path)
    return paths


__all__ = [
    "HEAD_INPUT",
    "BackendGroups",
    "NoCommonPrefix",
    "PrefixCut",
    "PrefixGroup",
    "PrefixSplit",
    "backend_groups",
    "cnn_variants",
    "find_prefix",
    "group_model_file",
    "merge_group",
    "model_file",
    "split_models",
    "structural_digests",
]
