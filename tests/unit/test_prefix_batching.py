"""Prefix batching (``zserve.backends.prefix``): the shared prefix of models is found by what
computes each tensor, not by names; models that share no layer are refused; a group run (the
prefix once on every variant's rows, then each head on its own) gives each model's own outputs,
with real ONNX Runtime sessions; the built-in CNN's variants share all but their last layer;
the merged model (what a backend loads for a ``[[prefix_groups]]`` group) runs each row through
its own head; the simulated grouped model's l(b) follows the merged model's rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from zserve.backends.prefix import (
    HEAD_INPUT,
    NoCommonPrefix,
    PrefixGroup,
    backend_groups,
    cnn_variants,
    find_prefix,
    group_model_file,
    merge_group,
    split_models,
)
from zserve.config.cluster import parse_config
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


def test_the_simulated_group_pays_every_heads_fixed_cost_on_every_batch() -> None:
    """The live rule: the merged model runs every head's nodes on every batch (on zero rows when
    none is its own), so l(b) of the group is the full model's plus the other heads' fixed cost,
    whatever the mix."""
    apart = prefix_experiment.variants_workload(1, grouped=False, quick=True)
    grouped = prefix_experiment.variants_workload(1, grouped=True, quick=True)
    assert len(apart.models) == prefix_experiment.VARIANTS and len(grouped.models) == 1
    single = apart.models[0].profile
    group = grouped.models[0].profile
    others_s = (prefix_experiment.VARIANTS - 1) * prefix_experiment.HEAD_BETA_MS / 1e3
    for batch in (1, 4, prefix_experiment.VARIANTS + 2):
        assert group.latency(batch) == pytest.approx(single.latency(batch) + others_s)


def _merged_session(paths: list[Path], tmp_path: Path) -> Any:
    merged = merge_group(split_models(paths, tmp_path / "split"), tmp_path / "group.onnx")
    return ort.InferenceSession(str(merged), providers=["CPUExecutionProvider"])


def test_the_merged_model_runs_each_row_through_its_own_head(tmp_path: Path) -> None:
    paths = _save([_mlp(1, 10 + i, names=f"m{i}_") for i in range(3)], tmp_path)
    session = _merged_session(paths, tmp_path)
    assert [i.name for i in session.get_inputs()] == ["features", HEAD_INPUT]
    full = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in paths]
    rng = np.random.default_rng(9)
    features = rng.standard_normal((7, FEATURES)).astype(np.float32)
    heads = np.array([2, 0, 2, 2, 0, 0, 2], np.int64)  # head 1 has no row in this batch
    (logits,) = session.run(None, {"features": features, HEAD_INPUT: heads})
    for row, head in enumerate(heads):
        want = full[head].run(None, {"features": features[row:row + 1]})[0]
        np.testing.assert_array_equal(logits[row:row + 1], want)  # exactly its model's row
    (one,) = session.run(None, {"features": features[:1], HEAD_INPUT: heads[:1]})
    assert one.shape == (1, CLASSES)


def test_a_group_whose_outputs_differ_is_refused(tmp_path: Path) -> None:
    other = _mlp(1, 11)
    other.graph.output[0].name = "scores"
    other.graph.node[-1].output[0] = "scores"
    paths = _save([_mlp(1, 10), other], tmp_path)
    with pytest.raises(NoCommonPrefix, match="outputs differ"):
        merge_group(split_models(paths, tmp_path / "split"), tmp_path / "group.onnx")


def test_the_group_file_is_built_once_per_set_of_models(tmp_path: Path) -> None:
    paths = cnn_variants(2, tmp_path / "variants")
    first = group_model_file(paths, tmp_path / "cache")
    built_at = first.stat().st_mtime_ns
    assert group_model_file(paths, tmp_path / "cache") == first
    assert first.stat().st_mtime_ns == built_at  # the cached file, not a rebuild
    assert group_model_file(paths[::-1], tmp_path / "cache") != first  # heads in another order
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []


def test_a_backend_loads_a_group_it_serves_whole_as_one_merged_model(tmp_path: Path) -> None:
    paths = cnn_variants(2, tmp_path / "variants")
    config = parse_config({
        "backends": {"count": 1, "device": "cpu"},
        "models": [{"name": "solo", "builtin": "mlp"},
                   *({"name": f"v{i}", "onnx": str(p), "max_queue": 10}
                     for i, p in enumerate(paths))],
        "prefix_groups": [{"name": "heads", "models": ["v0", "v1"]}]})
    loaded = backend_groups(config.prefix_groups, config.models, tmp_path / "cache")
    assert [m.name for m in loaded.models] == ["solo", "heads"]
    heads = loaded.models[1]
    assert heads.onnx is not None and heads.max_queue == 20
    assert set(loaded.grouped) == {"v0", "v1"}
    group, wire = loaded.grouped["v1"]
    assert group == "heads" and [i["name"] for i in wire["inputs"]] == ["image"]
    partial = backend_groups(config.prefix_groups, config.models[:2], tmp_path / "cache")
    assert [m.name for m in partial.models] == ["solo", "v0"] and partial.grouped == {}
