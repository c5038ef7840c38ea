"""ONNX Runtime executor on the CPU, with real sessions on the built-in models."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from zserve.backends.builtin import ModelSpec, ensure_builtin
from zserve.backends.executor import ModelLoadError
from zserve.backends.onnx_executor import OnnxExecutor, read_signature
from zserve.backends.onnx_session import SessionConfig, cuda_output_error, default_cuda_batch_sizes
from zserve.core.errors import BadRequestError, InternalError

MAX_BATCH = 8
# Batched and one-by-one runs take different kernels (GEMM vs GEMV blocking), so float32 sums are
# accumulated in a different order; differences are a few ULPs of the logits.
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def executor() -> Iterator[OnnxExecutor]:
    with OnnxExecutor(["cnn", "mlp"], max_batch=MAX_BATCH) as executor:
        yield executor


def _write_model(path: Path, input_shape: list[int | str | None],
                 output_shape: list[int | str | None]) -> Path:
    """y = x * 2 over a float32 input of the given (raw ONNX) shape."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, input_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)],
        initializer=[two],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_batched_outputs_equal_one_by_one(executor: OnnxExecutor, model: str) -> None:
    requests = executor.synthetic_requests(model, MAX_BATCH, seed=7)
    batched = executor.run(model, requests)
    assert len(batched) == MAX_BATCH
    for request, outputs in zip(requests, batched, strict=True):
        (alone,) = executor.run(model, [request])
        assert outputs.keys() == alone.keys() == {"logits"}
        assert outputs["logits"].shape == (1, 10)
        np.testing.assert_allclose(outputs["logits"], alone["logits"], rtol=RTOL, atol=ATOL)
    # Different inputs give different answers (the model is not degenerate).
    assert not np.allclose(batched[0]["logits"], batched[1]["logits"])


def test_stacked_batch_equals_request_list(executor: OnnxExecutor) -> None:
    requests = executor.synthetic_requests("mlp", 5, seed=3)
    stacked = {"features": np.concatenate([r["features"] for r in requests])}
    from_list = executor.run("mlp", requests)
    from_stack = executor.run("mlp", stacked)
    for a, b in zip(from_list, from_stack, strict=True):
        np.testing.assert_array_equal(a["logits"], b["logits"])


def test_outputs_survive_later_runs(executor: OnnxExecutor) -> None:
    # Callers (ZeroMQ sends with copy=False) may hold outputs while the next batch runs.
    first = executor.run("mlp", executor.synthetic_requests("mlp", 4, seed=1))
    kept = [o["logits"].copy() for o in first]
    executor.run("mlp", executor.synthetic_requests("mlp", 4, seed=2))
    for held, copy in zip(first, kept, strict=True):
        np.testing.assert_array_equal(held["logits"], copy)


def test_sized_sessions_pad_each_batch_to_its_session(executor: OnnxExecutor) -> None:
    # What a CUDA model does by default (one session per size, module docstring), run here on
    # the CPU provider: every batch size, as a request list, a stacked batch and one request,
    # gives the one-session executor's answers, and the padding rows never leak into them.
    config = SessionConfig(session_batch_sizes=(1, 3, 5, 99))
    with OnnxExecutor(["mlp"], max_batch=MAX_BATCH, config=config) as sized:
        for size in range(1, MAX_BATCH + 1):
            requests = executor.synthetic_requests("mlp", size, seed=40 + size)
            want = executor.run("mlp", requests)
            stacked = {"features": np.concatenate([r["features"] for r in requests])}
            for got in (sized.run("mlp", requests), sized.run("mlp", stacked)):
                assert len(got) == size
                for g, w in zip(got, want, strict=True):
                    assert g["logits"].shape == (1, 10)
                    np.testing.assert_allclose(g["logits"], w["logits"], rtol=RTOL, atol=ATOL)
        # Sizes past max_batch are dropped and max_batch is added: sessions of 1, 3, 5 and 8
        # rows, each holding the weights.
        weights = ensure_builtin("mlp").stat().st_size
        assert sized.memory_bytes("mlp") - executor.memory_bytes("mlp") == 3 * weights


def test_per_model_session_sizes_override_the_config(executor: OnnxExecutor) -> None:
    # cluster.toml's [[models]] session_batch_sizes (build_executor passes them per model):
    # mlp gets sessions of 2 and 8 rows, cnn keeps one; a batch of 1 runs padded to 2.
    weights = ensure_builtin("mlp").stat().st_size
    with OnnxExecutor(["cnn", "mlp"], max_batch=MAX_BATCH,
                      session_batch_sizes={"mlp": (2,)}) as sized:
        assert sized.memory_bytes("mlp") - executor.memory_bytes("mlp") == weights
        assert sized.memory_bytes("cnn") == executor.memory_bytes("cnn")
        (request,) = executor.synthetic_requests("mlp", 1, seed=9)
        (got,) = sized.run("mlp", [request])
        (want,) = executor.run("mlp", [request])
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=RTOL, atol=ATOL)


def test_default_cuda_batch_sizes() -> None:
    assert default_cuda_batch_sizes(32) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    assert default_cuda_batch_sizes(20) == (1, 2, 3, 4, 6, 8, 12, 16, 20)
    assert default_cuda_batch_sizes(1) == (1,)
    with pytest.raises(ValueError, match="session_batch_sizes"):
        SessionConfig(session_batch_sizes=(0, 4))


def test_cuda_output_error_is_relative_to_the_tensors_scale() -> None:
    # The H200's TF32 ResNet50 logits: largest magnitude 83, up to 0.06 off, near-zero ones too.
    rng = np.random.default_rng(0)
    want = rng.normal(0.0, 25.0, size=(1, 1000))
    want[0, 0] = 83.0
    tf32_like = want + rng.uniform(-0.06, 0.06, size=want.shape)
    assert cuda_output_error(tf32_like, want) <= 1.0
    assert not np.allclose(tf32_like, want, rtol=2e-2, atol=2e-3)  # elementwise would refuse it
    other_row = rng.normal(0.0, 25.0, size=(1, 1000))  # another request's answer
    assert cuda_output_error(other_row, want) > 1.0
    assert cuda_output_error(want[:, :999], want) == float("inf")


def test_read_only_wire_buffers_are_accepted(executor: OnnxExecutor) -> None:
    # Inputs received from ZeroMQ are np.frombuffer views: read-only.
    requests = executor.synthetic_requests("mlp", 3)
    frozen = []
    for request in requests:
        array = np.frombuffer(request["features"].tobytes(), np.float32).reshape(1, 64)
        assert not array.flags.writeable
        frozen.append({"features": array})
    got = executor.run("mlp", frozen)
    want = executor.run("mlp", requests)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a["logits"], b["logits"])


def test_signature_of_builtins(executor: OnnxExecutor) -> None:
    cnn = executor.signature("cnn")
    assert [(s.name, s.dtype, s.shape) for s in cnn.inputs] == [("image", "float32", (3, 64, 64))]
    assert [(s.name, s.dtype, s.shape) for s in cnn.outputs] == [("logits", "float32", (10,))]
    # The ONNX-only reader (what a frontend can use without ONNX Runtime) agrees.
    assert read_signature(ensure_builtin("cnn"), "cnn") == cnn
    assert read_signature(ensure_builtin("mlp"), "mlp") == executor.signature("mlp")


def test_signature_mismatches_are_bad_requests(executor: OnnxExecutor) -> None:
    good = executor.synthetic_requests("cnn", 1)[0]
    with pytest.raises(BadRequestError, match="dtype float64, expected float32"):
        executor.validate_request("cnn", {"image": good["image"].astype(np.float64)})
    with pytest.raises(BadRequestError, match="missing input"):
        executor.validate_request("cnn", {"pixels": good["image"]})
    with pytest.raises(BadRequestError, match=r"expected \(1, 3, 64, 64\)"):
        executor.validate_request("cnn", {"image": np.zeros((1, 3, 32, 32), np.float32)})
    with pytest.raises(BadRequestError, match="unknown model 'nope'"):
        executor.validate_request("nope", good)
    # run() names the offending request of the batch.
    batch = [good, {"image": np.zeros((1, 3, 64, 63), np.float32)}]
    with pytest.raises(BadRequestError, match="request 1 of the batch"):
        executor.run("cnn", batch)


def test_batch_size_outside_limits_is_internal_error(executor: OnnxExecutor) -> None:
    with pytest.raises(InternalError, match=r"outside 1\.\.8"):
        executor.run("mlp", executor.synthetic_requests("mlp", MAX_BATCH + 1))
    with pytest.raises(InternalError, match="batch of 0"):
        executor.run("mlp", [])


def test_memory_bytes_counts_weights_and_buffers(executor: OnnxExecutor) -> None:
    file_bytes = ensure_builtin("cnn").stat().st_size
    buffer_bytes = MAX_BATCH * 3 * 64 * 64 * 4
    assert executor.memory_bytes("cnn") == file_bytes + buffer_bytes


async def test_run_async_serializes_batches(executor: OnnxExecutor) -> None:
    requests = [executor.synthetic_requests("mlp", b, seed=b) for b in (1, 2, 3, 4)]
    results = await asyncio.gather(*(executor.run_async("mlp", r) for r in requests))
    for request, result in zip(requests, results, strict=True):
        expected = executor.run("mlp", request)
        assert [o["logits"].tolist() for o in result] == [o["logits"].tolist() for o in expected]


def test_truncated_model_fails_to_load_clearly(tmp_path: Path) -> None:
    data = ensure_builtin("mlp").read_bytes()
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as info:
        OnnxExecutor([ModelSpec("broken", broken)]).load()
    message = info.value.message
    assert "model 'broken'" in message and str(broken) in message
    assert "not a valid ONNX model (truncated or corrupt?)" in message
    assert "Traceback" not in message
    assert info.value.__suppress_context__  # no chained ORT traceback
    with pytest.raises(ModelLoadError, match="not a valid ONNX model"):
        read_signature(broken)


def test_missing_and_empty_files_fail_to_load(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such model file"):
        OnnxExecutor([ModelSpec("gone", tmp_path / "gone.onnx")]).load()
    empty = tmp_path / "empty.onnx"
    empty.touch()
    with pytest.raises(ModelLoadError, match="is empty"):
        OnnxExecutor([ModelSpec("empty", empty)]).load()


def test_fixed_batch_dimension_is_refused(tmp_path: Path) -> None:
    path = _write_model(tmp_path / "fixed.onnx", [1, 16], [1, 16])
    with pytest.raises(ModelLoadError) as info:
        OnnxExecutor([ModelSpec("fixed", path)]).load()
    assert "input 'x' has a fixed batch dimension: shape [1, 16]" in info.value.message
    with pytest.raises(ModelLoadError, match="input 'x' has a fixed batch dimension"):
        read_signature(path)


def test_dynamic_non_batch_dimension_is_refused(tmp_path: Path) -> None:
    path = _write_model(tmp_path / "ragged.onnx", ["N", "T"], ["N", "T"])
    with pytest.raises(ModelLoadError, match="dynamic dimension 'T' at axis 1"):
        OnnxExecutor([ModelSpec("ragged", path)]).load()


def test_any_onnx_file_by_model_spec(tmp_path: Path) -> None:
    path = _write_model(tmp_path / "double.onnx", ["batch", 3], ["batch", 3])
    with OnnxExecutor([f"twice={path}", str(path)], max_batch=4) as executor:
        assert executor.models == ["twice", "double"]
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        out = executor.run("twice", [{"x": x[:1]}, {"x": x[1:]}])
        np.testing.assert_array_equal(np.concatenate([o["y"] for o in out]), x * 2)


class _ThreadRecordingExecutor(OnnxExecutor):
    """The real executor, noting the thread each batch ran on."""

    threads: set[int]

    def run(self, model: str, inputs: Any, request_rows: Any = None) -> Any:
        self.threads.add(threading.get_ident())
        return super().run(model, inputs, request_rows)


def test_warm_and_profile_run_on_the_thread_that_serves_batches() -> None:
    # A runtime's per-thread state (the CUDA provider's cuBLAS/cuDNN handles) is built while
    # warming only if warming runs where the served batches will.
    with _ThreadRecordingExecutor(["mlp"], max_batch=2) as executor:
        executor.threads = set()
        executor.warm()
        executor.profile("mlp", [1, 2], repeats=1, warmup=0)
        warmed = set(executor.threads)
        request = executor.synthetic_requests("mlp", 1)
        asyncio.run(executor.run_async("mlp", request))
        assert len(warmed) == 1 and warmed != {threading.get_ident()}
        assert executor.threads == warmed


def test_an_interrupted_caller_stops_the_work_it_waits_for_on_the_worker() -> None:
    # Ctrl-C while warming or profiling: the worker stops after its current batch instead of
    # running the rest while the executor's shutdown waits for it.
    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    stopped = threading.Event()
    try:
        with OnnxExecutor(["mlp"], max_batch=2) as executor:
            def work(stop: threading.Event) -> None:
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
                stop.wait(60.0)  # set by the interrupted caller
                if stop.is_set():
                    stopped.set()

            with pytest.raises(Interrupted):
                executor._on_worker(work)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert stopped.wait(30.0)  # the work saw its stop (not its 60 s timeout)


def test_warm_and_session_config(tmp_path: Path) -> None:
    config = SessionConfig(intra_op_threads=1, graph_optimization="basic", cpu_mem_arena=False,
                           allow_spinning=False)
    with OnnxExecutor(["mlp"], max_batch=3, config=config) as executor:
        executor.warm()
        executor.warm([1, 3])
        assert executor.providers == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
        OnnxExecutor(["mlp"], device="tpu")
    with pytest.raises(ValueError, match="graph_optimization"):
        SessionConfig(graph_optimization="max")  # type: ignore[arg-type]
