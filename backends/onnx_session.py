"""ONNX Runtime session settings: ``SessionConfig``, the device parse, the batch sizes a CUDA
model gets sessions for, and the CUDA library preload. ``zserve.backends.onnx_executor`` runs
sessions built from them; its docstring says why each default is what it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

_GRAPH_OPT_LEVELS = ("disable", "basic", "extended", "all")
# Where the TensorRT provider keeps the engines it built (SessionConfig.tensorrt).
TENSORRT_CACHE_DIR = "/tmp/zserve-tensorrt"
# How far a CUDA run's outputs may sit from the CPU provider's (``cuda_output_error``): cuDNN runs
# FP32 convolutions in TF32 (10-bit mantissa) by default and picks different kernels per batch
# size. TF32's error scales with the tensor, not with each element: on an H200 a random-weight
# ResNet50's logits (largest magnitude 83) were up to 0.06 off (relative L2 error 6e-4), so an
# elementwise allclose failed every row at its near-zero logits. With TF32 off the error was 5e-5,
# but a batch of 8 took 4.80 ms against 2.53, so TF32 stays on (PyTorch's default for cuDNN too).
CUDA_OUTPUT_RTOL = 2e-2  # of the reference tensor's largest magnitude
CUDA_OUTPUT_ATOL = 2e-3


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """ONNX Runtime session options (see the ONNX Runtime docs of SessionOptions and of the
    CUDA execution provider for each one's exact effect).

    intra_op_threads: threads one operator may use. Default 1: a CPU backend is one "device" of
        one core; raise it to run one fast backend on a many-core host.
    inter_op_threads: threads running independent operators in parallel (parallel mode only).
    parallel_execution: run independent branches of the graph in parallel.
    graph_optimization: "disable" | "basic" | "extended" | "all".
    cpu_mem_arena: keep freed CPU buffers for reuse instead of returning them to the OS.
    mem_pattern: plan activation memory once per input shape and reuse the plan.
    allow_spinning: let idle intra-op threads spin (lower latency, burns CPU while idle).
    gpu_mem_limit_bytes: cap of the CUDA arena (None: no cap).
    cuda_arena_extend_strategy: "kNextPowerOfTwo" | "kSameAsRequested".
    cudnn_conv_algo_search: "HEURISTIC" (default) | "EXHAUSTIVE" | "DEFAULT". On an H200
        (docs/performance.md, "On a GPU") HEURISTIC ran ResNet50 as fast as EXHAUSTIVE at a
        fixed size (1.42 against 1.48 ms at b1, 6.84 against 7.77 at b32) and builds a new
        shape's plan faster; DEFAULT was 2.6-5x slower.
    bound_buffers: run each fixed-size session through IOBinding with inputs and outputs
        bound once to preallocated buffers (``zserve.backends.onnx_binding``; on CUDA device
        buffers filled on a copy stream). Needs fixed-size sessions (``session_batch_sizes``,
        the default on a GPU); others run as before.
    cuda_graph: the CUDA provider's ``enable_cuda_graph``: each fixed-size session captures its
        graph on the first run and replays it. Needs ``bound_buffers`` (fixed addresses).
    tensorrt: put ONNX Runtime's TensorRT provider (fp16 engines, cached under
        ``TENSORRT_CACHE_DIR``) before the CUDA one; a model load fails when this onnxruntime
        has no TensorRT provider. Engines build at the first run of each shape (minutes).
    log_severity: ONNX Runtime log level, 0 (verbose) .. 4 (fatal); default 3 (errors).
    session_batch_sizes: the batch sizes that get a session of their own, each batch padded to
        the smallest of them that holds it (module docstring). Empty (default): on a GPU
        ``default_cuda_batch_sizes(max_batch)``, on a CPU one session for every size. Sizes past
        a model's max_batch are dropped and max_batch is always added.
    """

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    parallel_execution: bool = False
    graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    cpu_mem_arena: bool = True
    mem_pattern: bool = True
    allow_spinning: bool = True
    gpu_mem_limit_bytes: int | None = None
    cuda_arena_extend_strategy: Literal["kNextPowerOfTwo", "kSameAsRequested"] = "kNextPowerOfTwo"
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = "HEURISTIC"
    log_severity: int = 3
    session_batch_sizes: tuple[int, ...] = ()
    bound_buffers: bool = False
    cuda_graph: bool = False
    tensorrt: bool = False

    def __post_init__(self) -> None:
        if self.cuda_graph and not self.bound_buffers:
            raise ValueError("cuda_graph needs bound_buffers (a CUDA graph replays fixed "
                             "addresses)")
        if any(size < 1 for size in self.session_batch_sizes):
            raise ValueError(f"session_batch_sizes must be >= 1, got {self.session_batch_sizes}")
        if self.graph_optimization not in _GRAPH_OPT_LEVELS:
            raise ValueError(
                f"graph_optimization {self.graph_optimization!r} not in {_GRAPH_OPT_LEVELS}"
            )
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            raise ValueError("thread counts must be >= 0 (0: ONNX Runtime's default)")

    def session_options(self) -> Any:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_threads
        options.inter_op_num_threads = self.inter_op_threads
        options.execution_mode = (
            ort.ExecutionMode.ORT_PARALLEL
            if self.parallel_execution
            else ort.ExecutionMode.ORT_SEQUENTIAL
        )
        options.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[self.graph_optimization]
        options.enable_cpu_mem_arena = self.cpu_mem_arena
        options.enable_mem_pattern = self.mem_pattern
        options.log_severity_level = self.log_severity
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if self.allow_spinning else "0"
        )
        return options

    def cuda_provider_options(self, device_id: int) -> dict[str, str]:
        options = {
            "device_id": str(device_id),
            "arena_extend_strategy": self.cuda_arena_extend_strategy,
            "cudnn_conv_algo_search": self.cudnn_conv_algo_search,
            "do_copy_in_default_stream": "1",
        }
        if self.gpu_mem_limit_bytes is not None:
            options["gpu_mem_limit"] = str(self.gpu_mem_limit_bytes)
        if self.cuda_graph:
            options["enable_cuda_graph"] = "1"
        return options


def tensorrt_provider_options(device_id: int) -> dict[str, str]:
    """The TensorRT provider's options: fp16 engines, cached across sessions and processes."""
    return {"device_id": str(device_id), "trt_fp16_enable": "1",
            "trt_engine_cache_enable": "1", "trt_engine_cache_path": TENSORRT_CACHE_DIR}


def default_cuda_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 times them) up to max_batch, and
    max_batch: each size within 1.5x of the next smaller one, so padding wastes at most a third of
    a batch, with a session count that grows as log(max_batch)."""
    sizes = {1, max_batch}
    power = 2
    while power <= max_batch:
        sizes.add(power)
        if power + power // 2 <= max_batch:
            sizes.add(power + power // 2)
        power *= 2
    return tuple(sorted(sizes))


def parse_device(device: str) -> tuple[str, int]:
    """``"cpu"`` -> ("cpu", 0); ``"cuda"`` / ``"cuda:N"`` -> ("cuda", N)."""
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return "cpu", 0
    if kind == "cuda" and (not index or index.isdigit()):
        return "cuda", int(index or 0)
    raise ValueError(f"device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")


_cuda_libraries_preloaded = False


def preload_cuda_libraries(ort: Any) -> None:
    """Load the CUDA/cuDNN libraries that ``onnxruntime-gpu[cuda,cudnn]`` installs as
    ``nvidia-*`` wheels, once per process (``zserve.backends.onnx_executor``'s docstring)."""
    global _cuda_libraries_preloaded
    if _cuda_libraries_preloaded:
        return
    _cuda_libraries_preloaded = True
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime-gpu >= 1.21
    if preload is not None:
        preload()


def cuda_output_error(got: Any, expected: Any) -> float:
    """How far a CUDA output is from the CPU provider's, as a fraction of its allowance: the
    largest elementwise difference over ``CUDA_OUTPUT_ATOL + CUDA_OUTPUT_RTOL * max|expected|``.
    At most 1 passes. Scale-relative, because TF32's error is (see the constants)."""
    got_array = np.asarray(got, dtype=np.float64)
    want = np.asarray(expected, dtype=np.float64)
    if got_array.shape != want.shape:
        return float("inf")
    if want.size == 0:
        return 0.0
    allowance = CUDA_OUTPUT_ATOL + CUDA_OUTPUT_RTOL * float(np.max(np.abs(want)))
    return float(np.max(np.abs(got_array - want))) / allowance
