"""Sessions bound to preallocated buffers (zserve.backends.onnx_binding) in real ONNX Runtime
sessions: the CPU path against ``session.run``; the CUDA path (device buffers, the copy stream,
CUDA graphs) against the CPU provider, skipped without a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest

from zserve.backends.executor import ModelLoadError
from zserve.backends.host import build_executor
from zserve.backends.onnx_executor import OnnxExecutor
from zserve.backends.onnx_session import SessionConfig, cuda_output_error
from zserve.config.cluster import ConfigError, parse_config

SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def plain() -> Iterator[OnnxExecutor]:
    with OnnxExecutor(["cnn", "mlp"], max_batch=8,
                      config=SessionConfig(session_batch_sizes=SIZES)) as executor:
        yield executor


@pytest.fixture(scope="module")
def bound() -> Iterator[OnnxExecutor]:
    config = SessionConfig(session_batch_sizes=SIZES, bound_buffers=True)
    with OnnxExecutor(["cnn", "mlp"], max_batch=8, config=config) as executor:
        yield executor


@pytest.mark.parametrize("batch_size", [1, 3, 5, 8])
def test_bound_buffers_give_session_run_outputs(plain: OnnxExecutor, bound: OnnxExecutor,
                                                batch_size: int) -> None:
    for model in ("cnn", "mlp"):
        requests = plain.synthetic_requests(model, batch_size, seed=batch_size)
        want = plain.run(model, requests)
        got = bound.run(model, requests)
        assert len(got) == batch_size
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g["logits"], w["logits"], rtol=1e-6, atol=1e-6)
    assert bound._loaded["cnn"].bound_sessions.keys() == set(SIZES)


def test_bound_outputs_are_fresh_arrays_a_later_run_leaves_alone(bound: OnnxExecutor) -> None:
    first = bound.run("mlp", bound.synthetic_requests("mlp", 4, seed=1))
    kept = [o["logits"].copy() for o in first]
    bound.run("mlp", bound.synthetic_requests("mlp", 4, seed=2))
    for output, copy in zip(first, kept, strict=True):
        np.testing.assert_array_equal(output["logits"], copy)


def test_cuda_graph_needs_bound_buffers() -> None:
    with pytest.raises(ValueError, match="bound_buffers"):
        SessionConfig(cuda_graph=True)
    assert SessionConfig(bound_buffers=True, cuda_graph=True).cuda_provider_options(0)[
        "enable_cuda_graph"] == "1"


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_cuda_bound_buffers_match_the_cpu_provider(plain: OnnxExecutor, cuda_graph: bool) -> None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu (CUDAExecutionProvider) is not installed")
    config = SessionConfig(session_batch_sizes=SIZES, bound_buffers=True, cuda_graph=cuda_graph)
    executor = OnnxExecutor(["cnn"], device="cuda:0", max_batch=8, config=config)
    try:
        executor.load()
    except ModelLoadError as exc:
        pytest.skip(f"no usable CUDA device: {exc.message}")
    try:
        for batch_size in (1, 3, 8, 5, 1):  # replays after capture, padded sizes too
            requests = plain.synthetic_requests("cnn", batch_size, seed=10 + batch_size)
            want = plain.run("cnn", requests)
            got = executor.run("cnn", requests)
            for g, w in zip(got, want, strict=True):
                assert cuda_output_error(g["logits"], w["logits"]) <= 1.0
    finally:
        executor.close()


@pytest.mark.parametrize("config", [SessionConfig(session_batch_sizes=SIZES),
                                    SessionConfig(session_batch_sizes=SIZES, bound_buffers=True)])
def test_a_staged_slice_grows_into_its_padding_in_place(plain: OnnxExecutor,
                                                        config: SessionConfig) -> None:
    """A batch of 3 that is a slice of a staging slot runs in the session of 4 with the slot's
    next row as padding: no copy into the executor's own batch buffer, the same answers."""
    with OnnxExecutor(["mlp"], max_batch=8, config=config) as executor:
        slot = np.full((8, 64), np.nan, np.float32)  # padding rows hold whatever was there
        requests = executor.synthetic_requests("mlp", 3, seed=4)
        slot[2:5] = np.concatenate([r["features"] for r in requests])
        got = executor.run("mlp", {"features": slot[2:5]})
        assert not executor._loaded["mlp"].host_buffers["features"].any()  # never copied in
        for g, w in zip(got, plain.run("mlp", requests), strict=True):
            np.testing.assert_allclose(g["logits"], w["logits"], rtol=1e-6, atol=1e-6)


def test_the_cluster_file_chooses_how_onnx_models_run(plain: OnnxExecutor) -> None:
    """``[backends] onnx_io`` reaches the executor a backend builds; a bad value is one line."""
    config = parse_config({"backends": {"onnx_io": "bound"},
                           "models": [{"name": "mlp", "builtin": "mlp", "slo_ms": 100,
                                       "max_batch": 8, "session_batch_sizes": [2, 8]}]})
    executor = build_executor("cpu", config.models, config.backends.onnx_io)
    assert isinstance(executor, OnnxExecutor)
    with executor:
        assert executor._loaded["mlp"].bound_sessions.keys() == {2, 8}
        requests = plain.synthetic_requests("mlp", 5, seed=3)
        for g, w in zip(executor.run("mlp", requests), plain.run("mlp", requests), strict=True):
            np.testing.assert_allclose(g["logits"], w["logits"], rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="onnx_io"):
        parse_config({"backends": {"onnx_io": "fast"}})
