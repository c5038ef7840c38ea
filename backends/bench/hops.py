"""Benchmarks of the process runtime: the latency of each hop, and what the backend adds to a batch.

``python -m zserve.backends.bench.hops hops [--repeats N]``
    One-way latency of each wire hop of the request path, with the real codec, sockets (ipc) and
    event loop (uvloop): a receiver process decodes each message, stamps ``time.monotonic()``
    (CLOCK_MONOTONIC is shared by the processes of one host) and echoes the stamp; the sender
    paces one message at a time, so nothing queues. Reports medians and p99 in microseconds.

``python -m zserve.backends.bench.hops backend [--model cnn] [--batch-sizes 1,8,32]``
    A real backend process (ONNX Runtime, CPU) follows plans that start at once; the benchmark
    plays the shard (plans), the rank and the frontend (it answers each InputFetch from memory).
    From the backend's own per-batch timings it reports: fetch (plan received -> all inputs in),
    assemble (the one copy into the batch buffer), run (the executor), push (encoding and queueing
    the outputs) and, measured by the benchmark, plan sent -> outputs received; "overhead" is that
    end-to-end time minus run.

Numbers on a shared machine are noisy: quote the medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from zserve.runtime.clock import reply_to_probe
from zserve.transport import codec, socket_io
from zserve.transport.messages import (
    BackendRegister,
    BatchOutputs,
    BatchPlan,
    CandidateUpdate,
    ClockProbe,
    GrantGpu,
    Heartbeat,
    InputFetch,
    InputReply,
    Message,
    Ready,
    RequestMetaBatch,
    StatsReply,
    StatsRequest,
)
from zserve.transport.sockets import make_dealer, make_router

WAIT_MS = 30_000
CNN_INPUT_SHAPE = (1, 3, 64, 64)
CNN_OUTPUT_SHAPE = (1, 10)


# --------------------------------------------------------------------------- hops


def _echo_server(endpoint: str) -> None:
    """Receiver: decode each message, stamp it, echo the stamp (a tiny Heartbeat)."""
    import asyncio

    import zmq.asyncio

    from zserve.runtime.runner import install_uvloop

    async def serve() -> None:
        ctx = zmq.asyncio.Context()
        sock, _ = make_router(ctx, endpoint, name="echo")
        seq = 0
        while True:
            frames = await sock.recv_multipart(copy=False)
            msg = codec.decode(frames[1:])
            now = time.monotonic()
            if isinstance(msg, Ready):
                break
            seq += 1
            await socket_io.async_send(sock, Heartbeat("echo", seq, now), identity=frames[0].bytes)
        sock.close(linger=0)
        ctx.term()

    install_uvloop()
    asyncio.run(serve())


def _hop_messages() -> dict[str, Callable[[], Message]]:
    now = time.monotonic
    rng = np.random.default_rng(0)

    def meta(n: int) -> Callable[[], Message]:
        t = now()
        return lambda: RequestMetaBatch("ipc:///tmp/x/frontend-0.data", list(range(n)),
                                        ["cnn"] * n, [t] * n, [t + 0.1] * n)

    def plan(n: int) -> Callable[[], Message]:
        return lambda: BatchPlan(1, "cnn", 0, now(), now() + 0.01,
                                 ["ipc:///tmp/x/frontend-0.data"], [0] * n, list(range(n)))

    def inputs(n: int) -> Callable[[], Message]:
        arrays = [{"input": rng.standard_normal(CNN_INPUT_SHAPE).astype(np.float32)}
                  for _ in range(n)]
        return lambda: InputReply(1, list(range(n)), arrays, [])

    def outputs(n: int) -> Callable[[], Message]:
        batch = rng.standard_normal((n, CNN_OUTPUT_SHAPE[1])).astype(np.float32)
        rows = [{"output": batch[i : i + 1]} for i in range(n)]
        return lambda: BatchOutputs(1, list(range(n)), rows)

    return {
        "frontend->shard RequestMetaBatch (1 request)": meta(1),
        "frontend->shard RequestMetaBatch (32 requests)": meta(32),
        "shard->rank CandidateUpdate": lambda: CandidateUpdate("cnn", 8, now(), now(), 0.001),
        "rank->shard GrantGpu": lambda: GrantGpu("cnn", 0, 1, now()),
        "shard->backend BatchPlan (1 request)": plan(1),
        "shard->backend BatchPlan (32 requests)": plan(32),
        "backend->frontend InputFetch (8 requests)": lambda: InputFetch(1, list(range(8))),
        "frontend->backend InputReply (1 x 3x64x64 f32)": inputs(1),
        "frontend->backend InputReply (8 x 3x64x64 f32)": inputs(8),
        "frontend->backend InputReply (32 x 3x64x64 f32)": inputs(32),
        "backend->frontend BatchOutputs (1 x 10 f32)": outputs(1),
        "backend->frontend BatchOutputs (32 x 10 f32)": outputs(32),
    }


def bench_hops(repeats: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="zs-hops-") as tmp:
        endpoint = f"ipc://{tmp}/echo"
        proc = multiprocessing.get_context("spawn").Process(target=_echo_server, args=(endpoint,))
        proc.start()
        ctx: zmq.Context[Any] = zmq.Context()
        sock = make_dealer(ctx, endpoint, identity=b"bench")
        results: dict[str, dict[str, float]] = {}
        try:
            for label, make in _hop_messages().items():
                samples = []
                for i in range(repeats + repeats // 10):
                    msg = make()
                    sent = time.monotonic()
                    socket_io.sync_send(sock, msg)
                    if not sock.poll(WAIT_MS):
                        raise TimeoutError("echo server does not answer")
                    _, echo = socket_io.sync_recv(sock, router=False)
                    assert isinstance(echo, Heartbeat)
                    if i >= repeats // 10:  # the first tenth warms caches and connections
                        samples.append(echo.sent_at - sent)
                values = np.asarray(samples) * 1e6
                results[label] = {"p50_us": float(np.median(values)),
                                  "p99_us": float(np.percentile(values, 99))}
            socket_io.sync_send(sock, Ready("bench", "bench", os.getpid(), {}))
        finally:
            sock.close(linger=100)
            ctx.term()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return results


# --------------------------------------------------------------------------- backend


def bench_backend(model: str, batch_sizes: list[int], repeats: int) -> dict[str, Any]:
    from zserve.backends.host import run_backend
    from zserve.config.cluster import parse_config, role_config

    cluster = parse_config({"models": [{"name": model, "builtin": model,
                                        "max_batch": max(batch_sizes)}],
                            "backends": {"device": "cpu"}})
    with tempfile.TemporaryDirectory(prefix="zs-bb-") as tmp:
        ctx: zmq.Context[Any] = zmq.Context()
        control, control_ep = make_router(ctx, f"ipc://{tmp}/control", name="control")
        rank, rank_ep = make_router(ctx, f"ipc://{tmp}/rank", name="rank")
        data, data_ep = make_router(ctx, f"ipc://{tmp}/data", name="data")
        config = role_config(cluster, "backend", 0, ipc_dir=tmp)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_backend, args=(config, control_ep)
        )
        proc.start()
        socks = [control, rank, data]
        try:
            identity, _ = _expect(control, Ready, router=True)
            socket_io.sync_send(control, Ready("bench", "bench", os.getpid(),
                                           {"rank/rank": rank_ep}), identity=identity)
            _, register = _expect(rank, BackendRegister, router=True)
            shard = make_dealer(ctx, register.plan_address, identity=b"shard-0")
            socks.append(shard)
            bench = _BackendBench(model, max(batch_sizes), shard, data, data_ep)
            results: dict[str, Any] = {"model": model, "device": "cpu", "batch_sizes": {}}
            for bs in batch_sizes:
                results["batch_sizes"][str(bs)] = bench.measure(bs, repeats)
            return results
        finally:
            proc.terminate()
            proc.join(timeout=15)
            if proc.is_alive():
                proc.kill()
                proc.join()
            for sock in socks:
                sock.close(linger=0)
            ctx.term()


class _BackendBench:
    """Plays the shard (plans that start at once) and the frontend (inputs from memory) for a
    backend process, and reads the backend's own per-batch timings back."""

    WARMUP_BATCHES = 5

    def __init__(self, model: str, max_batch: int, shard: zmq.Socket[Any],
                 data: zmq.Socket[Any], data_ep: str) -> None:
        from zserve.backends.builtin import ensure_builtin
        from zserve.backends.onnx_executor import read_signature

        self.model = model
        self.shard, self.data, self.data_ep = shard, data, data_ep
        self.plan_id = 0
        signature = read_signature(ensure_builtin(model), model)
        rng = np.random.default_rng(0)
        self.store = {
            rid: {s.name: rng.standard_normal((1, *(int(d or 1) for d in s.shape)))
                  .astype(s.dtype) for s in signature.inputs}
            for rid in range(max_batch)
        }

    def one_batch(self, bs: int) -> float:
        """Plan sent -> outputs received for one batch of ``bs``, in seconds."""
        self.plan_id += 1
        sent = time.monotonic()
        socket_io.sync_send(self.shard, BatchPlan(self.plan_id, self.model, 0, sent, sent + 0.05,
                                              [self.data_ep], [0] * bs, list(range(bs))))
        identity, fetch = _expect(self.data, InputFetch, router=True)
        socket_io.sync_send(self.data, InputReply(fetch.plan_id, fetch.request_ids,
                                              [self.store[r] for r in fetch.request_ids], []),
                        identity=identity)
        _expect(self.data, BatchOutputs, router=True)
        return time.monotonic() - sent

    def measure(self, bs: int, repeats: int) -> dict[str, float]:
        """Median fetch/assemble/run/push (the backend's timings) and end to end of ``bs``."""
        for _ in range(self.WARMUP_BATCHES):
            self.one_batch(bs)
        socket_io.sync_send(self.shard, StatsRequest(reset=True))  # discard the warm-up timings
        _expect(self.shard, StatsReply, router=False)
        e2e = [self.one_batch(bs) for _ in range(repeats)]
        socket_io.sync_send(self.shard, StatsRequest(reset=True))
        _, reply = _expect(self.shard, StatsReply, router=False)
        latency = reply.stats["latency"]  # the zserve.core.stats schema: medians of the histograms
        row: dict[str, float] = {}
        for key in ("fetch", "assemble", "run", "push"):
            row[f"{key}_ms"] = float(latency[key]["p50_ms"])
        row["end_to_end_ms"] = float(np.median(e2e)) * 1e3
        # median end to end - median run (per-batch run times are no longer kept one by one)
        row["overhead_ms"] = row["end_to_end_ms"] - row["run_ms"]
        return row


def _expect(sock: zmq.Socket[Any], kind: type[Any], *, router: bool) -> tuple[Any, Any]:
    """The next ``kind`` message; a ``ClockProbe`` (to the bench's stand-in rank) is answered."""
    while True:
        if not sock.poll(WAIT_MS):
            raise TimeoutError(f"no {kind.__name__} within {WAIT_MS} ms")
        identity, msg = socket_io.sync_recv(sock, router=router)
        if router and isinstance(msg, ClockProbe):
            socket_io.sync_send(sock, reply_to_probe(msg), identity=identity)
        elif isinstance(msg, kind):
            return identity, msg


# --------------------------------------------------------------------------- CLI


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m zserve.backends.bench.hops",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    hops = sub.add_parser("hops", help="one-way latency of each wire hop")
    hops.add_argument("--repeats", type=int, default=500)
    backend = sub.add_parser("backend", help="what the backend adds to a batch")
    backend.add_argument("--model", default="cnn")
    backend.add_argument("--batch-sizes", default="1,8,32")
    backend.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.what == "hops":
        hop_results = bench_hops(args.repeats)
        width = max(len(k) for k in hop_results)
        print(f"{'hop'.ljust(width)}  p50_us   p99_us")
        for label, row in hop_results.items():
            print(f"{label.ljust(width)}  {row['p50_us']:6.1f}  {row['p99_us']:7.1f}")
        out: Any = hop_results
    else:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
        out = bench_backend(args.model, sizes, args.repeats)
        keys = ("fetch_ms", "assemble_ms", "run_ms", "push_ms", "end_to_end_ms", "overhead_ms")
        print("bs  " + "  ".join(k.rjust(13) for k in keys))
        for bs, row in out["batch_sizes"].items():
            print(f"{bs:>2}  " + "  ".join(f"{row[k]:13.3f}" for k in keys))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
