"""Prefix batching (``zserve.backends.prefix``): the shared prefix of models is found by what
computes each tensor, not by names; models that share no layer are refused; a group run (the
prefix once on every variant's rows, then each head on its own) gives each model's own outputs,
with real ONNX Runtime sessions; the built-in CNN's variants share all but their last layer;
the simulated grouped model's l(b) adds a head's fixed cost per variant present."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from zserve.backends.prefix import (
    NoCommonPrefix,
    PrefixGroup,
    cnn_variants,
    find_prefix,
    split_models,
)
from zserve.loadgen.experiments import prefix as prefix_experiment

FEATURES, HIDDEN, CLASSES = 8, 16, 4


def _mlp(trunk_seed: int, head_seed: int, names: str = "") -> Any:
    """features -> Gemm -> Relu -> Gemm -> logits; ``names`` prefixes every tensor name."""
    trunk, head = np.random.default_rng(trunk_seed), np.random.default_rng(head_seed)
    w1 = numpy_helper.from_array(trunk.standard_normal((FEATURES, HIDDEN)).astype(np.float32),
                                 f"{names}w1")
    w2 = numpy_helper.from_array(head.standard_normal((HIDDEN, CLASSES)).astype(np.float32),
                                 f"{names}w2")
    nodes = [helper.make_node("Gemm", ["features", f"{names}w1"], [f"{names}h"]),
             helper.make_node("Relu", [f"{names}h"], [f"{names}r"]),
             helper.make_node("Gemm", [f"{names}r", f"{names}w2"], ["logits"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("features", TensorProto.FLOAT,
                                                     ["N", FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        initializer=[w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _save(models: list[Any], folder: Path) -> list[Path]:
    paths = []
    for i, model in enumerate(models):
        path = folder / f"m{i}.onnx"
        onnx.save(model, str(path))
        paths.append(path)
    return paths


def test_the_prefix_is_found_by_structure_whatever_the_tensor_names() -> None:
    cut = find_prefix([_mlp(1, 10), _mlp(1, 11, names="renamed_"), _mlp(1, 12)])
    assert cut.cut_names == [["r"], ["renamed_r"], ["r"]]  # the Relu's output, in each model
    assert cut.prefix_nodes == 2


def test_models_that_share_no_layer_are_refused() -> None:
    with pytest.raises(NoCommonPrefix, match="share no layer"):
        find_prefix([_mlp(1, 10), _mlp(2, 10)])  # equal heads, different trunks
    with pytest.raises(NoCommonPrefix, match="at least two"):
        find_prefix([_mlp(1, 10)])


def test_a_group_run_gives_each_model_its_own_outputs(tmp_path: Path) -> None:
    paths = _save([_mlp(1, 10 + i) for i in range(3)], tmp_path)
    split = split_models(paths, tmp_path / "split")
    group = PrefixGroup(split)
    rng = np.random.default_rng(5)
    rows = {v: {"features": rng.standard_normal((count, FEATURES)).astype(np.float32)}
            for v, count in ((0, 2), (1, 0), (2, 3))}  # variant 1 has no row this batch
    out = group.run(rows)
    assert set(out) == {0, 2}
    for v in (0, 2):
        full = ort.InferenceSession(str(paths[v]), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(out[v][0], full.run(None, rows[v])[0], atol=1e-5)
    assert group.run({0: {"features": np.zeros((0, FEATURES), np.float32)}}) == {}


def test_the_builtin_cnn_variants_share_all_but_their_last_layer(tmp_path: Path) -> None:
    paths = cnn_variants(2, tmp_path)
    models = [onnx.load(str(p)) for p in paths]
    cut = find_prefix(models)
    last = models[0].graph.node[-1]
    assert cut.cut_names[0] == [last.input[0]]  # the cut is the last layer's input
    assert cut.prefix_nodes == len(models[0].graph.node) - 1


def test_the_grouped_model_pays_a_head_per_variant_present() -> None:
    apart = prefix_experiment.variants_workload(1, grouped=False, quick=True)
    grouped = prefix_experiment.variants_workload(1, grouped=True, quick=True)
    assert len(apart.models) == prefix_experiment.VARIANTS and len(grouped.models) == 1
    single = apart.models[0].profile
    group = grouped.models[0].profile
    head_s = prefix_experiment.HEAD_BETA_MS / 1e3
    assert group.latency(1) == pytest.approx(single.latency(1))
    assert group.latency(4) == pytest.approx(single.latency(4) + 3 * head_s)
    batch = prefix_experiment.VARIANTS + 2
    assert group.latency(batch) == pytest.approx(
        single.latency(batch) + (prefix_experiment.VARIANTS - 1) * head_s)
