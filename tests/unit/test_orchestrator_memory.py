"""Model memory (zserve.orchestrator.memory): every zoo model has its weights and activations, the
largest batch under the SLO, device budgets, and the overcommit check's one-line refusal."""

from __future__ import annotations

import pytest

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
