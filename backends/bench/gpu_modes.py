"""Benchmark for a GPU machine: l(b) of one ONNX model in each way the CUDA executor can run it,
every answer checked against ONNX Runtime's CPU provider.

``python -m zserve.backends.bench.gpu_modes MODEL.onnx [--reference REF.onnx] [--sizes 1,8,16,32]``

Modes: ``iobinding`` (the default CUDA path: host inputs bound per run), ``bound`` (inputs and
outputs in device buffers bound once, filled on a copy stream: ``SessionConfig.bound_buffers``),
``graph`` (``bound`` plus the CUDA provider's ``enable_cuda_graph``) and, where ONNX Runtime
offers the provider, ``tensorrt`` (fp16 engines, built at first run; slow to build). For each
mode and batch size: the median of ``--repeats`` runs in ms and ``error``, the largest deviation
from the CPU provider's answer as a fraction of its allowance (``cuda_output_error``: at most 1
passes). ``--reference`` is the model the CPU provider runs (an fp16 model is checked against its
fp32 original; the allowance is then the one TF32 gets, so read the figure rather than the
verdict). Prints one JSON object. Written for ``backends/bench/gpu_check.sh``; needs
onnxruntime-gpu.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from zserve.backends.builtin import ModelSpec
from zserve.backends.onnx_executor import OnnxExecutor
from zserve.backends.onnx_session import SessionConfig, cuda_output_error

MODES = ("iobinding", "bound", "graph")


def _config(mode: str, sizes: tuple[int, ...]) -> SessionConfig:
    return SessionConfig(session_batch_sizes=sizes, bound_buffers=mode in ("bound", "graph"),
                         cuda_graph=mode == "graph", tensorrt=mode == "tensorrt")


def _inputs(executor: OnnxExecutor, model: str, batch: int, dtype: str) -> list[dict[str, Any]]:
    requests = executor.synthetic_requests(model, batch, seed=batch)
    return [{k: v.astype(dtype) for k, v in r.items()} for r in requests]


def _time_runs(executor: OnnxExecutor, model: str, requests: list[dict[str, Any]],
               repeats: int) -> tuple[float, list[dict[str, Any]]]:
    outputs = executor.run(model, requests)  # the first run (a graph's capture) is not timed
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = executor.run(model, requests)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, outputs


def measure(path: Path, reference: Path, sizes: tuple[int, ...], *, repeats: int,
            modes: tuple[str, ...], device: str = "cuda:0") -> dict[str, Any]:
    """Every mode at every size, checked against the CPU provider running ``reference``."""
    cpu = OnnxExecutor([ModelSpec("ref", reference)], max_batch=max(sizes),
                       config=SessionConfig(intra_op_threads=0))
    cpu.load()
    results: dict[str, Any] = {"model": str(path), "reference": str(reference)}
    wanted: dict[int, list[dict[str, Any]]] = {}
    for mode in modes:
        row: dict[str, Any] = {}
        try:
            executor = _executor(path, mode, sizes, device)
        except Exception as exc:  # a provider that is missing or fails to build: say so
            results[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        dtype = executor.signature("m").inputs[0].dtype
        for batch in sizes:
            requests = _inputs(cpu, "ref", batch, dtype)
            if batch not in wanted:
                wanted[batch] = cpu.run("ref", [{k: v.astype(np.float32) if v.dtype.kind == "f"
                                                 else v for k, v in r.items()}
                                                for r in requests])
            ms, got = _time_runs(executor, "m", requests, repeats)
            error = max(cuda_output_error(np.asarray(g[name], np.float32), w[name])
                        for g, w in zip(got, wanted[batch], strict=True) for name in w)
            row[str(batch)] = {"ms": round(ms, 3), "error": round(error, 4)}
        executor.close()
        results[mode] = row
    cpu.close()
    return results


def _executor(path: Path, mode: str, sizes: tuple[int, ...], device: str) -> OnnxExecutor:
    config = _config(mode, sizes)
    if not device.startswith("cuda"):  # a CPU smoke run: no CUDA graph there
        config = _config("bound" if mode == "graph" else mode, sizes)
    executor = OnnxExecutor([ModelSpec("m", path)], device=device, max_batch=max(sizes),
                            config=config)
    executor.load()
    return executor


def main(argv: list[str]) -> int:
    """``python -m zserve.backends.bench.gpu_modes``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="zserve.backends.bench.gpu_modes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--reference", type=Path, help="the model the CPU provider runs")
    parser.add_argument("--sizes", default="1,8,16,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda:0", help="cuda:N (cpu: a smoke run)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"of {', '.join(MODES)}, tensorrt")
    args = parser.parse_args(argv)
    sizes = tuple(sorted({int(s) for s in args.sizes.split(",")}))
    modes = tuple(m for m in args.modes.split(",") if m)
    results = measure(args.model, args.reference or args.model, sizes, repeats=args.repeats,
                      modes=modes, device=args.device)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
