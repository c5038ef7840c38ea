"""Benchmark: a backend's fetch, assembly and run one after another, or overlapped.

``python -m zserve.backends.bench.pipeline [--executor cnn|emulated] [--batch 16] [--batches 60]``

A frontend process answers every ``InputFetch`` over ipc with ``--batch`` requests' tensors from
memory (the real codec and sockets). In the benchmark's own event loop (the backend's side:
``SocketReactor``, ``BatchRunner``, ``StagingSlots``, the executor's worker thread) it runs
``--batches`` batches in each of three modes and reports batches per second and the median time
per batch of each step:

- ``serial``: fetch batch k, assemble it (one copy per request), run it, then fetch k+1. What an
  H200 backend did with ResNet50 (fetch 6.9, assembly 3.1, run 9.3 ms one after another).
- ``prefetch``: batch k+1's fetch goes out when batch k starts, so its inputs arrive while k
  runs; the batch is still assembled by copy when it starts.
- ``staged``: as prefetch, and each request's tensor is copied into its row of a staging slot as
  its reply is decoded (``zserve.backends.staging``), so a batch starts with no assembly at all.

``fetch`` is InputFetch sent -> InputReply decoded and staged; in the overlapped modes ``wait``
is how long a batch, its device free, still waited for its inputs; ``gap`` is the device's idle
time between one run's end and the next one's start (what fetch and assembly leave on the
critical path), ``device_busy`` the runs' share of the wall time and ``cpu_ms_per_batch`` the
process's CPU time (the loop and the executor's thread) per batch. Executors: ``cnn`` (the
built-in CNN, ONNX Runtime on the CPU, one intra-op thread) or ``emulated`` (a ResNet50-shaped
request, 3x224x224 float32 = 602 KB, and the H200's l(b) = 0.230 b + 1.55 ms, by timer). Each
mode runs ``--repeats`` times (default 3); the medians are reported with the load average, since
the figures depend on what else the host runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from zserve.backends.batch_runner import BatchRunner
from zserve.backends.executor import Executor
from zserve.backends.follower import PlanFollower
from zserve.runtime.clock import ClusterClock
from zserve.transport import socket_io
from zserve.transport.messages import BatchPlan, InputFetch, InputReply
from zserve.transport.reactor import Chunk, SocketReactor
from zserve.transport.sockets import make_dealer

MODES = ("serial", "prefetch", "staged")
FRONTEND = "bench-frontend"
# The H200's ResNet50 l(b) (docs/performance.md, "On a GPU") and its input.
R50_ALPHA_MS = 0.230
R50_BETA_MS = 1.55
R50_SAMPLE_SHAPE = (3, 224, 224)


def _frontend(address: str, name: str, sample_shape: tuple[int, ...], dtype: str) -> None:
    """The frontend process: answer each InputFetch with one tensor per request."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal((1, *sample_shape)).astype(dtype) for _ in range(64)]
    while True:
        identity, msg = socket_io.sync_recv(sock, router=True)
        if not isinstance(msg, InputFetch):
            break
        inputs = [{name: pool[rid % len(pool)]} for rid in msg.request_ids]
        socket_io.sync_send(sock, InputReply(msg.plan_id, msg.request_ids, inputs, []),
                            identity=identity)
    sock.close(linger=0)
    ctx.term()


@dataclass
class Timings:
    fetch: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)  # device idle: run k's end -> run k+1's start
    assemble: list[float] = field(default_factory=list)
    run: list[float] = field(default_factory=list)

    def medians_ms(self) -> dict[str, float]:
        return {k: round(statistics.median(v) * 1e3, 3) if v else 0.0
                for k, v in vars(self).items()}


class PipelineBench:
    """The backend's side: one DEALER to the frontend, the runner and its staging slots."""

    def __init__(self, executor: Executor, model: str, sock: zmq.Socket[Any], batch: int) -> None:
        self.executor, self.model, self.sock, self.batch = executor, model, sock, batch
        self.runner = BatchRunner(executor, ClusterClock(), PlanFollower("bench").stats)
        self.runner.allocate(model)
        self.reactor = SocketReactor(asyncio.get_running_loop())
        self.reactor.watch(sock, router=False, on_chunk=self._on_chunk)
        self.replies: dict[int, asyncio.Future[InputReply]] = {}
        self.sent_at: dict[int, float] = {}
        self.staging_on = False
        self.timings = Timings()
        self._next_plan = 1
        self._last_run_end: float | None = None  # the bench resets it per run

    def _on_chunk(self, messages: Chunk) -> None:
        for _, msg in messages:
            if isinstance(msg, InputReply):
                if self.staging_on:
                    self.runner.staging.stage(FRONTEND, msg, self.replies.__contains__)
                self.timings.fetch.append(time.monotonic() - self.sent_at.pop(msg.plan_id))
                self.replies.pop(msg.plan_id).set_result(msg)

    def fetch(self) -> asyncio.Future[InputReply]:
        """Send one plan's InputFetch (claiming a staging slot when staging is on)."""
        plan_id, self._next_plan = self._next_plan, self._next_plan + 1
        ids = list(range(plan_id * 1000, plan_id * 1000 + self.batch))
        if self.staging_on:
            plan = BatchPlan(plan_id, self.model, 0, 0.0, 0.0, [FRONTEND], [0] * len(ids), ids)
            self.runner.staging.claim(plan, lambda _: False)
        future: asyncio.Future[InputReply] = asyncio.get_running_loop().create_future()
        self.replies[plan_id] = future
        self.sent_at[plan_id] = time.monotonic()
        self.reactor.send_nowait(self.sock, InputFetch(plan_id, ids))
        return future

    async def run_one(self, reply: InputReply) -> None:
        t0 = time.monotonic()
        batch = self.runner.assemble(self.model, reply.inputs)
        t1 = time.monotonic()
        await self.executor.run_async(self.model, batch)
        t2 = time.monotonic()
        self.timings.assemble.append(t1 - t0)
        self.timings.run.append(t2 - t1)
        if self._last_run_end is not None:
            self.timings.gap.append(t1 - self._last_run_end)
        self._last_run_end = t2
        self.runner.staging.release(reply.plan_id)

    async def serial(self, batches: int) -> None:
        for _ in range(batches):
            await self.run_one(await self.fetch())

    async def overlapped(self, batches: int) -> None:
        ahead = self.fetch()
        for k in range(batches):
            t0 = time.monotonic()
            reply = await ahead
            self.timings.wait.append(time.monotonic() - t0)
            if k + 1 < batches:
                ahead = self.fetch()  # batch k+1's inputs come while batch k runs
            await self.run_one(reply)


def build_executor(kind: str, batch: int) -> tuple[Executor, str]:
    """The executor and its model: ``emulated`` (ResNet50's input and H200 l(b)) or a built-in
    ONNX model on the CPU."""
    if kind == "emulated":
        from zserve.backends.emulated import EmulatedExecutor, EmulatedModel

        model = EmulatedModel("r50", R50_ALPHA_MS, R50_BETA_MS, max_batch=max(batch, 32),
                              input_shape=R50_SAMPLE_SHAPE)
        return EmulatedExecutor([model]), "r50"
    from zserve.backends.onnx_executor import OnnxExecutor

    executor = OnnxExecutor([kind], max_batch=max(batch, 32))
    executor.load()
    executor.warm([batch])
    return executor, kind


def request_spec(kind: str) -> tuple[str, tuple[int, ...], str]:
    """The input name, per-request sample shape and dtype of ``kind``'s model."""
    if kind == "emulated":
        return "x", R50_SAMPLE_SHAPE, "float32"
    from zserve.backends.builtin import ensure_builtin
    from zserve.backends.onnx_executor import read_signature

    spec = read_signature(ensure_builtin(kind)).inputs[0]
    return spec.name, tuple(int(d or 0) for d in spec.shape), spec.dtype


async def _one_run(bench: PipelineBench, mode: str, batches: int) -> dict[str, float]:
    """``batches`` batches in ``mode``: the rate, the device's busy share, the CPU per batch and
    the median of each step."""
    bench.timings, bench._last_run_end = Timings(), None
    bench.staging_on = mode == "staged"
    staged_before = bench.runner.staged_batches
    started, cpu_started = time.monotonic(), time.process_time()
    await (bench.serial(batches) if mode == "serial" else bench.overlapped(batches))
    wall = time.monotonic() - started
    return {"batches_per_s": batches / wall, "device_busy": sum(bench.timings.run) / wall,
            "cpu_ms_per_batch": (time.process_time() - cpu_started) / batches * 1e3,
            "staged_share": (bench.runner.staged_batches - staged_before) / batches,
            **bench.timings.medians_ms()}


async def _measure(args: argparse.Namespace, address: str) -> dict[str, Any]:
    executor, model = build_executor(args.executor, args.batch)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = make_dealer(ctx, address, identity=b"bench-backend")
    results: dict[str, Any] = {}
    try:
        bench = PipelineBench(executor, model, sock, args.batch)
        await bench.serial(3)  # connect and warm the path
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):  # the modes interleaved: a slow spell hits each alike
            for mode in MODES:
                runs[mode].append(await _one_run(bench, mode, args.batches))
        for mode, measured in runs.items():
            results[mode] = {key: round(statistics.median(m[key] for m in measured), 3)
                             for key in measured[0]}
            results[mode]["rates"] = [round(m["batches_per_s"], 1) for m in measured]
        bench.reactor.send_nowait(sock, InputReply(0, [], [], []))  # the frontend stops
        bench.reactor.close()
    finally:
        sock.close(linger=1000)
        ctx.term()
        executor.close()
    return results


def main(argv: list[str]) -> int:
    """``python -m zserve.backends.bench.pipeline``: see the module docstring. Prints one JSON
    object: per mode the medians (``staged_share``: the batches run as a slice of a slot)."""
    parser = argparse.ArgumentParser(prog="zserve.backends.bench.pipeline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--executor", default="emulated", help="emulated, cnn or mlp")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    name, shape, dtype = request_spec(args.executor)
    with tempfile.TemporaryDirectory(prefix="zserve-pipeline-") as tmp:
        address = f"ipc://{tmp}/frontend"
        frontend = multiprocessing.get_context("spawn").Process(
            target=_frontend, args=(address, name, shape, dtype), daemon=True)
        frontend.start()
        try:
            results = asyncio.run(_measure(args, address))
        finally:
            frontend.join(timeout=5)
            if frontend.is_alive():
                frontend.kill()
    print(json.dumps({"executor": args.executor, "batch": args.batch, "batches": args.batches,
                      "repeats": args.repeats, "loadavg": os.getloadavg(), **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
