"""CUDA paths of the ONNX Runtime executor: CUDA execution provider, IOBinding, CuPy inputs.

Marked ``gpu``; each test skips (with its reason) unless onnxruntime-gpu, a CUDA device and,
where needed, CuPy are present. The CPU executor's outputs are the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from zserve.backends.executor import ModelLoadError
from zserve.backends.onnx_executor import OnnxExecutor
from zserve.backends.onnx_session import cuda_output_error

MAX_BATCH = 4


def _has_cuda_provider() -> bool:
    return "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.fixture(scope="module")
def cuda_executor() -> Iterator[OnnxExecutor]:
    if not _has_cuda_provider():
        pytest.skip("onnxruntime-gpu (CUDAExecutionProvider) is not installed")
    executor = OnnxExecutor(["cnn", "mlp"], device="cuda:0", max_batch=MAX_BATCH)
    try:
        executor.load()
    except ModelLoadError as exc:
        pytest.skip(f"no usable CUDA device: {exc.message}")
    yield executor
    executor.close()


@pytest.fixture(scope="module")
def cpu_executor() -> Iterator[OnnxExecutor]:
    with OnnxExecutor(["cnn", "mlp"], max_batch=MAX_BATCH) as executor:
        yield executor


@pytest.fixture(scope="module")
def cupy() -> Any:
    module = pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        if module.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("CuPy sees no CUDA device")
    except module.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"CuPy cannot reach a CUDA device: {exc}")
    return module


def test_cuda_device_without_onnxruntime_gpu_is_a_clear_error() -> None:
    # Runs everywhere: on a CPU-only onnxruntime, asking for CUDA fails at load with advice.
    if _has_cuda_provider():
        pytest.skip("onnxruntime-gpu is installed; the CPU-only error path does not apply")
    with pytest.raises(ModelLoadError, match="needs onnxruntime-gpu"):
        OnnxExecutor(["mlp"], device="cuda:0").load()


@pytest.mark.gpu
def test_cuda_provider_is_used(cuda_executor: OnnxExecutor) -> None:
    assert cuda_executor.providers[0] == "CUDAExecutionProvider"
    cuda_executor.warm()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_host_inputs_through_iobinding_match_cpu(
    cuda_executor: OnnxExecutor, cpu_executor: OnnxExecutor, model: str
) -> None:
    requests = cpu_executor.synthetic_requests(model, MAX_BATCH, seed=5)
    got = cuda_executor.run(model, requests)
    want = cpu_executor.run(model, requests)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g["logits"], np.ndarray)  # host inputs -> host outputs
        assert cuda_output_error(g["logits"], w["logits"]) <= 1.0


@pytest.mark.gpu
def test_cupy_inputs_stay_on_device(
    cuda_executor: OnnxExecutor, cpu_executor: OnnxExecutor, cupy: Any
) -> None:
    requests = cpu_executor.synthetic_requests("cnn", MAX_BATCH, seed=6)
    want = cpu_executor.run("cnn", requests)
    on_device = [{"image": cupy.asarray(r["image"])} for r in requests]
    from_list = cuda_executor.run("cnn", on_device)
    stacked = {"image": cupy.concatenate([r["image"] for r in on_device])}
    from_stack = cuda_executor.run("cnn", stacked)
    for a, b, w in zip(from_list, from_stack, want, strict=True):
        assert isinstance(a["logits"], cupy.ndarray)  # CuPy inputs -> CuPy outputs
        assert cuda_output_error(cupy.asnumpy(a["logits"]), w["logits"]) <= 1.0
        assert cuda_output_error(cupy.asnumpy(b["logits"]), w["logits"]) <= 1.0


@pytest.mark.gpu
def test_cupy_input_on_cpu_executor_is_bad_request(cupy: Any, cpu_executor: OnnxExecutor) -> None:
    from zserve.core.errors import BadRequestError

    request = {"features": cupy.zeros((1, 64), cupy.float32)}
    with pytest.raises(BadRequestError, match="CuPy array but this executor runs on cpu"):
        cpu_executor.run("mlp", [request])
