"""Model memory for placement: each zoo model's static memory (its weights) and dynamic memory (its
activations at its largest batch), device-kind memory budgets, and the overcommit check that refuses
a placement, in one line, before anything loads.

Static memory is the published parameter count times 4 bytes (fp32 weights). The counts are the
"Parameters" column of the Keras Applications table (https://keras.io/api/applications/, rounded
there to 0.1 M) for every zoo model Keras lists; the three it does not list come from their papers:
MobileNetV3Small / Large 2.5 M / 5.4 M (Howard et al. 2019, "Searching for MobileNetV3", Table 3,
multiplier 1.0), SSDMobilenet 6.8 M (Howard et al. 2017, "MobileNets", Table 13, SSD 300) and BERT
110 M (Devlin et al. 2019, BERT-base).

Dynamic memory is an estimate, not a measurement: the peak activation bytes of one sample times the
model's largest batch. Per sample, an ImageNet CNN's largest live tensors are at its stride-2 stem:
about 64 channels at H/2 x W/2, i.e. 16 fp32 values per input pixel, and a layer holds its input and
its output at once, so the peak is about 2 x 16 x 4 = 128 bytes per input pixel (ResNet50 at 224 x
224: 6.4 MB). VGG's first convolutions run at full resolution with 64 channels: four times that.
BERT-base at 128 tokens holds its feed-forward intermediate (128 x 3072), two hidden states (128 x
768) and the attention scores (12 x 128 x 128), fp32. Input sides are Keras's defaults. The largest
batch is the largest b with alpha*b + beta <= SLO (the default cap of a zoo model's batch,
zserve.loadgen.workload), at most ``DEFAULT_MAX_BATCH``. Symphony's Table 1 measured 1.5-6.2 GB of
dynamic memory under TensorFlow's allocator; this estimate is lower (no allocator slack): it ranks
the models and bounds the peak, it is not a promise of what a runtime allocates.

A cluster file's model (:func:`configured_memory`) counts what it declares first, then these zoo
figures when it is named as a zoo model, then its ONNX file's size as its weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from zserve.config.cluster import ModelConfig
from zserve.config.profiles import DEFAULT_MAX_BATCH

FP32_BYTES = 4
MIB_BYTES = 1 << 20
GIB_BYTES = 1 << 30
CNN_ACTIVATION_BYTES_PER_PIXEL = 128
"""Peak activation bytes per input pixel of one sample (stride-2 stem, 64 channels, in + out)."""
VGG_ACTIVATION_BYTES_PER_PIXEL = 4 * CNN_ACTIVATION_BYTES_PER_PIXEL
BERT_SEQUENCE_TOKENS = 128
BERT_ACTIVATION_BYTES = FP32_BYTES * (BERT_SEQUENCE_TOKENS * (3072 + 2 * 768)
                                      + 12 * BERT_SEQUENCE_TOKENS * BERT_SEQUENCE_TOKENS)
"""Peak activation bytes of one BERT-base sample of 128 tokens."""

ZOO_PARAMETERS_M: dict[str, tuple[float, int]] = {
    # name: (parameters in millions, default input side in pixels; BERT: 0, it takes tokens)
    "Xception": (22.9, 299), "VGG16": (138.4, 224), "VGG19": (143.7, 224),
    "ResNet50": (25.6, 224), "ResNet50V2": (25.6, 224), "ResNet101": (44.7, 224),
    "ResNet101V2": (44.7, 224), "ResNet152": (60.4, 224), "ResNet152V2": (60.4, 224),
    "InceptionV3": (23.9, 299), "InceptionResNetV2": (55.9, 299), "MobileNet": (4.3, 224),
    "MobileNetV2": (3.5, 224), "DenseNet121": (8.1, 224), "DenseNet169": (14.3, 224),
    "DenseNet201": (20.2, 224), "NASNetMobile": (5.3, 224), "NASNetLarge": (88.9, 331),
    "EfficientNetB0": (5.3, 224), "EfficientNetB1": (7.9, 240), "EfficientNetB2": (9.2, 260),
    "EfficientNetB3": (12.3, 300), "EfficientNetB4": (19.5, 380), "EfficientNetB5": (30.6, 456),
    "EfficientNetB6": (43.3, 528), "EfficientNetB7": (66.7, 600),
    "EfficientNetV2B0": (7.2, 224), "EfficientNetV2B1": (8.2, 240),
    "EfficientNetV2B2": (10.2, 260), "EfficientNetV2B3": (14.5, 300),
    "EfficientNetV2S": (21.6, 384), "EfficientNetV2M": (54.4, 480),
    "EfficientNetV2L": (119.0, 480),
    "MobileNetV3Small": (2.5, 224), "MobileNetV3Large": (5.4, 224),
    "SSDMobilenet": (6.8, 300), "BERT": (110.0, 0),
}
"""Every model of the papers' zoo profiles (examples/profiles/model_zoo_*.csv); sources above."""
_ZOO_BY_LOWER = {name.lower(): name for name in ZOO_PARAMETERS_M}

DEVICE_MEMORY_BUDGET_BYTES: dict[str, int] = {
    # the card's memory less 1 GiB for the CUDA context and the runtime's workspace
    "gtx1080ti": 10 * GIB_BYTES,
    "a100": 39 * GIB_BYTES,
    "a100-80gb": 79 * GIB_BYTES,
    "h200": 130 * GIB_BYTES,
}
"""Memory a placement may use on one device of each kind (GTX 1080 Ti 11 GiB, A100 40 or 80 GiB,
H200 141 GB = 131 GiB, each less 1 GiB)."""


class UnknownModelError(ValueError):
    """A model the memory table does not list (one line: which, and where the table is)."""


class UnknownDeviceKindError(ValueError):
    """A device kind with no memory budget (one line: which, and the known kinds)."""


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """One model's memory on a device: weights, always resident; activations, only while its batch
    runs (a device runs one batch at a time, so only the largest dynamic memory adds up)."""

    name: str
    static_bytes: int
    dynamic_bytes: int


def largest_batch(alpha_ms: float, beta_ms: float, slo_ms: float,
                  cap: int = DEFAULT_MAX_BATCH) -> int:
    """The largest b with ``alpha_ms * b + beta_ms <= slo_ms`` (at least 1, at most ``cap``)."""
    if alpha_ms <= 0:
        return cap
    return max(1, min(cap, math.floor((slo_ms - beta_ms) / alpha_ms + 1e-9)))


def activation_bytes_per_sample(name: str) -> int:
    """The estimated peak activation bytes of one sample of zoo model ``name``."""
    _, side = _zoo_entry(name)
    if name == "BERT":
        return BERT_ACTIVATION_BYTES
    per_pixel = VGG_ACTIVATION_BYTES_PER_PIXEL if name.startswith("VGG") else \
        CNN_ACTIVATION_BYTES_PER_PIXEL
    return per_pixel * side * side


def zoo_model_memory(name: str, alpha_ms: float, beta_ms: float, slo_ms: float) -> ModelMemory:
    """Static and dynamic memory of zoo model ``name`` with profile (alpha, beta) and SLO."""
    params_m, _ = _zoo_entry(name)
    static = round(params_m * 1e6) * FP32_BYTES
    dynamic = activation_bytes_per_sample(name) * largest_batch(alpha_ms, beta_ms, slo_ms)
    return ModelMemory(name, static, dynamic)


def zoo_name(name: str) -> str | None:
    """The zoo model ``name`` denotes (case aside: ``resnet50`` is ResNet50), or None."""
    return _ZOO_BY_LOWER.get(name.lower())


def configured_memory(config: ModelConfig, file_bytes: int | None) -> ModelMemory | None:
    """A cluster file model's memory, each part from the first source that knows it: weights
    from its ``memory_mib``, else the zoo's parameter count (a model named as a zoo model), else
    ``file_bytes`` (its ONNX file's size); activations from its ``activation_mib``, else the
    zoo's estimate per sample times its largest batch (an emulated model's from its profile and
    SLO, else its ``max_batch``), else 0. None when no source knows its weights."""
    zoo = zoo_name(config.name)
    static: int | None = None
    if config.memory_mib is not None:
        static = round(config.memory_mib * MIB_BYTES)
    elif zoo is not None:
        static = round(_zoo_entry(zoo)[0] * 1e6) * FP32_BYTES
    elif file_bytes is not None:
        static = file_bytes
    if static is None:
        return None
    dynamic = 0
    if config.activation_mib is not None:
        dynamic = round(config.activation_mib * MIB_BYTES)
    elif zoo is not None:
        batch = config.max_batch
        if config.alpha_ms is not None and config.beta_ms is not None:
            batch = largest_batch(config.alpha_ms, config.beta_ms, config.slo_ms, batch)
        dynamic = activation_bytes_per_sample(zoo) * batch
    return ModelMemory(config.name, static, dynamic)


def _zoo_entry(name: str) -> tuple[float, int]:
    entry = ZOO_PARAMETERS_M.get(name)
    if entry is None:
        raise UnknownModelError(f"model {name!r} has no memory entry in "
                                "zserve.orchestrator.memory.ZOO_PARAMETERS_M; declare its memory")
    return entry


def device_budget_bytes(kind: str) -> int:
    """The memory budget of a device of ``kind``; an unknown kind is a one-line error."""
    budget = DEVICE_MEMORY_BUDGET_BYTES.get(kind)
    if budget is None:
        raise UnknownDeviceKindError(
            f"device kind {kind!r} has no memory budget (known: "
            f"{', '.join(sorted(DEVICE_MEMORY_BUDGET_BYTES))})")
    return budget


def placement_bytes(models: Sequence[ModelMemory]) -> int:
    """Peak memory of a set of models resident on one device: all weights plus the largest
    activations (one batch runs at a time: Symphony section 3.2)."""
    return sum(m.static_bytes for m in models) + max((m.dynamic_bytes for m in models), default=0)


def overcommit_error(device: str, budget_bytes: int, models: Sequence[ModelMemory]) -> str | None:
    """None if ``models`` fit on ``device`` within ``budget_bytes``, else the one-line refusal."""
    need = placement_bytes(models)
    if need <= budget_bytes:
        return None
    static = sum(m.static_bytes for m in models)
    peak = max(models, key=lambda m: m.dynamic_bytes)
    return (f"device {device} overcommitted: {len(models)} models need "
            f"{need / GIB_BYTES:.2f} GiB (weights {static / GIB_BYTES:.2f} GiB + the largest "
            f"activations {peak.dynamic_bytes / GIB_BYTES:.2f} GiB, {peak.name}), budget "
            f"{budget_bytes / GIB_BYTES:.2f} GiB; place fewer models on it")


__all__ = [
    "DEVICE_MEMORY_BUDGET_BYTES",
    "ZOO_PARAMETERS_M",
    "ModelMemory",
    "UnknownDeviceKindError",
    "UnknownModelError",
    "activation_bytes_per_sample",
    "configured_memory",
    "device_budget_bytes",
    "largest_batch",
    "overcommit_error",
    "placement_bytes",
    "zoo_model_memory",
    "zoo_name",
]
