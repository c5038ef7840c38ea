"""Model memory (zserve.orchestrator.memory): every zoo model has its weights and activations, the
largest batch under the SLO, device budgets, and the overcommit check's one-line refusal."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from zserve.cluster.orchestrator_host import model_memory
from zserve.config.cluster import EmulatedConfig, ModelConfig
from zserve.loadgen.experiments.common import EXAMPLES_DIR
from zserve.loadgen.zoo import load_zoo_csv
from zserve.orchestrator import memory
from zserve.orchestrator.memory import ModelMemory

ZOO_CSVS = ("model_zoo_a100.csv", "model_zoo_gtx1080ti.csv")


@pytest.mark.parametrize("csv_name", ZOO_CSVS)
def test_every_zoo_model_has_static_and_dynamic_memory(csv_name: str) -> None:
    for row in load_zoo_csv(EXAMPLES_DIR / "profiles" / csv_name):
        model = memory.zoo_model_memory(row.name, row.alpha_ms, row.beta_ms, row.slo_ms)
        assert model.static_bytes > 0 and model.dynamic_bytes > 0, row.name
        batch = memory.largest_batch(row.alpha_ms, row.beta_ms, row.slo_ms)
        assert row.alpha_ms * batch + row.beta_ms <= row.slo_ms + 1e-9 or batch == 1, row.name
        assert row.alpha_ms * (batch + 1) + row.beta_ms > row.slo_ms, row.name


def test_static_memory_is_the_published_parameter_count_in_fp32() -> None:
    resnet50 = memory.zoo_model_memory("ResNet50", 0.268, 5.172, 20.0)  # A100 profile
    assert resnet50.static_bytes == 25_600_000 * 4  # Keras Applications: 25.6 M parameters
    # (20 - 5.172) / 0.268 = 55.3: batches up to 55, 128 bytes per pixel of a 224 x 224 image
    assert resnet50.dynamic_bytes == 55 * 128 * 224 * 224
    assert memory.activation_bytes_per_sample("VGG16") == 4 * 128 * 224 * 224


def test_the_largest_batch_is_capped_and_at_least_one() -> None:
    assert memory.largest_batch(1.0, 5.0, 25.0) == 20
    assert memory.largest_batch(1.0, 30.0, 25.0) == 1  # no batch meets the SLO: still one
    assert memory.largest_batch(0.001, 1.0, 1000.0, cap=64) == 64


def test_a_placement_counts_every_weight_and_only_the_largest_activations() -> None:
    models = [ModelMemory("a", 100, 50), ModelMemory("b", 10, 70), ModelMemory("c", 1, 0)]
    assert memory.placement_bytes(models) == 111 + 70
    assert memory.placement_bytes([]) == 0
    assert memory.overcommit_error("gpu0", 181, models) is None


def test_an_overcommitted_device_is_refused_in_one_line() -> None:
    vgg19 = memory.zoo_model_memory("VGG19", 3.059, 7.857, 40.0)  # GTX 1080 Ti profile
    budget = memory.device_budget_bytes("gtx1080ti")
    models = [vgg19] * 19  # 19 x 575 MB of weights (10.2 GiB) and one batch of 10 (0.24 GiB)
    error = memory.overcommit_error("gpu3", budget, models)
    assert error is not None and "\n" not in error
    assert error.startswith("device gpu3 overcommitted: 19 models need ")
    assert "VGG19" in error and "budget 10.00 GiB" in error
    assert memory.overcommit_error("gpu3", budget, models[:10]) is None


def test_unknown_models_and_device_kinds_are_one_line_errors() -> None:
    with pytest.raises(memory.UnknownModelError, match="'GPT-9' has no memory entry"):
        memory.zoo_model_memory("GPT-9", 1.0, 1.0, 10.0)
    with pytest.raises(memory.UnknownDeviceKindError, match=r"'tpu' has no memory budget "
                       r"\(known: a100, a100-80gb, gtx1080ti, h200\)"):
        memory.device_budget_bytes("tpu")


def _known(config: ModelConfig, file_bytes: int | None = None) -> ModelMemory:
    found = memory.configured_memory(config, file_bytes)
    assert found is not None
    return found


def test_a_cluster_model_is_counted_declared_then_zoo_then_file() -> None:
    """``configured_memory``: what a model declares wins, a model named as a zoo model has the
    zoo's figures, an ONNX file's size is the last resort for the weights; none: None."""
    zoo = ModelConfig(name="resnet50", emulated=EmulatedConfig(alpha_ms=0.268, beta_ms=5.172),
                      slo_ms=20.0, max_batch=64)
    # named as a zoo model (case aside): its weights, and activations at its largest batch
    # (55 under the 20 ms SLO with this profile, as the zoo's own figure; max_batch caps it)
    assert memory.configured_memory(zoo, None) == ModelMemory(
        "resnet50", 25_600_000 * 4, 55 * 128 * 224 * 224)
    capped = msgspec.structs.replace(zoo, max_batch=32)
    assert _known(capped).dynamic_bytes == 32 * 128 * 224 * 224
    # a file's size never overrides the zoo; a declared figure overrides either, part by part
    assert memory.configured_memory(zoo, 7) == memory.configured_memory(zoo, None)
    declared = msgspec.structs.replace(zoo, memory_mib=10.0)
    assert memory.configured_memory(declared, 7) == ModelMemory(
        "resnet50", 10 * memory.MIB_BYTES, 55 * 128 * 224 * 224)
    # not in the zoo: the file's size as weights, no activations; nothing known: None
    onnx = ModelConfig(name="mine", onnx="/models/mine.onnx", max_batch=8)
    assert memory.configured_memory(onnx, 123_456) == ModelMemory("mine", 123_456, 0)
    assert memory.configured_memory(onnx, None) is None
    with_activations = msgspec.structs.replace(onnx, activation_mib=2.0)
    assert memory.configured_memory(with_activations, 100) == ModelMemory(
        "mine", 100, 2 * memory.MIB_BYTES)
    # an onnx zoo model's activations take its max_batch (no profile to size the batch)
    vgg = ModelConfig(name="VGG16", onnx="/models/vgg16.onnx", max_batch=4)
    assert _known(vgg, 1).dynamic_bytes == 4 * 512 * 224 * 224


def test_the_orchestrator_counts_a_file_only_where_nothing_else_is_known(tmp_path: Path) -> None:
    """The supervisor's orchestrator (``orchestrator_host.model_memory``): an unknown ONNX model
    is its file's size, a zoo-named one the zoo's figures, one with no source 0 bytes."""
    weights = tmp_path / "model.onnx"
    weights.write_bytes(b"\0" * 4096)
    assert model_memory(ModelConfig(name="mine", onnx=str(weights))) == ModelMemory(
        "mine", 4096, 0)
    zoo = model_memory(ModelConfig(name="bert", onnx=str(weights), max_batch=8))
    assert zoo == ModelMemory("bert", 110_000_000 * 4, 8 * memory.BERT_ACTIVATION_BYTES)
    assert model_memory(ModelConfig(name="gone", onnx=str(tmp_path / "missing.onnx"))) == \
        ModelMemory("gone", 0, 0)
    assert model_memory(ModelConfig(name="mlp", builtin="mlp")) == ModelMemory("mlp", 0, 0)
