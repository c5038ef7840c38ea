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

What is not here: the live cluster does not group variants yet (a client's request names one
variant; the scheduler would plan the group as one model with the summed rate, Nexus's NX-12, and
the backend run ``PrefixGroup``). ``zserve experiment prefix`` measures what grouping gives, in
the simulator and on this machine's CPU (docs/performance.md, "Prefix batching").
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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


__all__ = ["NoCommonPrefix", "PrefixCut", "PrefixGroup", "PrefixSplit", "cnn_variants",
           "find_prefix", "split_models", "structural_digests"]
