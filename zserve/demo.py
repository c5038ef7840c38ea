"""``zserve demo``: start a local cluster, send it a bounded burst, check and measure the answers.

::

    zserve demo                                  # examples/clusters/demo.toml: `cnn` on 2 CPUs
    zserve demo --requests 2000 --concurrency 32 --stats
    zserve demo --config examples/clusters/emulated-8gpu-resnet50.toml --rate 2000 --duration 3

Closed loop by default (``--concurrency`` requests in flight, ``--requests`` in all); with
``--rate`` it is open loop (requests sent on a fixed schedule with ``AsyncClient.submit``,
whatever the replies do). Every output is checked against the model run in this process (ONNX
Runtime on the CPU, or the emulated model's formula). Prints throughput and latency; ``--stats``
adds each process's counters and the frontend's per-hop latencies. Exit status 0 when every
request was answered and every output was right.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from zserve.client import AsyncClient
from zserve.config import ClusterConfig, ModelConfig, load_config, parse_config
from zserve.errors import ZServeError

DEMO_TOML = Path(__file__).resolve().parent.parent / "examples" / "clusters" / "demo.toml"
# The same cluster as examples/clusters/demo.toml, for installs without the examples folder.
DEMO_CONFIG: dict[str, Any] = {
    "cluster": {"name": "demo", "drain_s": 5.0},
    "scheduler": {"shards": 0, "policy": "eager", "d_ctrl_ms": 5.0, "d_data_ms": 0.05},
    "frontends": {"count": 1, "reply_allowance_ms": 10.0},
    "backends": {"count": 2, "device": "cpu"},
    "models": [{"name": "cnn", "builtin": "cnn", "slo_ms": 200.0, "max_batch": 16,
                "max_queue": 256}],
}
WARMUP_REQUESTS = 8
DISTINCT_INPUTS = 64
RTOL = 1e-4
ATOL = 1e-4


class Reference:
    """The model run in this process, to check the cluster's answers."""

    def __init__(self, cluster: ClusterConfig, model: ModelConfig) -> None:
        from zserve.backends.process import build_executor

        device = "emulated" if model.kind == "emulated" else "cpu"
        self.model = model.name
        self.executor: Any = build_executor(device, [model])
        self.executor.load()
        self.emulated = device == "emulated"

    def requests(self, count: int, seed: int) -> list[dict[str, Any]]:
        return list(self.executor.synthetic_requests(self.model, count, seed=seed))

    def outputs(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.emulated:
            return dict(self.executor.expected_outputs(self.model, request))
        return dict(self.executor.run(self.model, [request])[0])

    def close(self) -> None:
        self.executor.close()


def _matches(got: dict[str, Any], expected: dict[str, Any]) -> bool:
    if got.keys() != expected.keys():
        return False
    return all(
        got[k].shape == expected[k].shape and np.allclose(got[k], expected[k], RTOL, ATOL)
        for k in got
    )


class Tally:
    def __init__(self) -> None:
        self.latencies_s: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.wrong = 0
        self.ok = 0

    def record(self, index: int, started: float, outcome: Any, expected: list[Any]) -> None:
        if isinstance(outcome, ZServeError):
            self.errors[outcome.kind.value] += 1
            return
        if isinstance(outcome, BaseException):
            self.errors[type(outcome).__name__] += 1
            return
        self.latencies_s.append(time.monotonic() - started)
        if _matches(outcome, expected[index % len(expected)]):
            self.ok += 1
        else:
            self.wrong += 1


class Work:
    """What to send and what to expect back."""

    def __init__(self, model: str, inputs: list[Any], expected: list[Any], tally: Tally) -> None:
        self.model, self.inputs, self.expected, self.tally = model, inputs, expected, tally


async def _closed_loop(client: AsyncClient, work: Work, *, requests: int, concurrency: int) -> None:
    model, inputs, expected, tally = work.model, work.inputs, work.expected, work.tally
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < requests:
            index = next_index
            next_index += 1
            started = time.monotonic()
            try:
                outcome: Any = await client.infer(model, inputs[index % len(inputs)])
            except Exception as exc:
                outcome = exc
            tally.record(index, started, outcome, expected)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open_loop(client: AsyncClient, work: Work, *, rate: float, duration_s: float) -> None:
    model, inputs, expected, tally = work.model, work.inputs, work.expected, work.tally
    count = int(rate * duration_s)
    start = time.monotonic()
    pending: list[asyncio.Future[Any]] = []
    for index in range(count):
        send_at = start + index / rate
        delay = send_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        future = client.submit(model, inputs[index % len(inputs)])
        sent = time.monotonic()

        def done(fut: asyncio.Future[Any], index: int = index, sent: float = sent) -> None:
            outcome = fut.exception() or fut.result()
            tally.record(index, sent, outcome, expected)

        future.add_done_callback(done)
        pending.append(future)
    if pending:
        await asyncio.wait(pending)


def _percentiles(values_s: list[float]) -> str:
    if not values_s:
        return "no successful requests"
    ms = np.array(values_s) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"p50 {p50:.1f} ms  p90 {p90:.1f} ms  p99 {p99:.1f} ms  max {ms.max():.1f} ms"


def _cpu_seconds(pids: dict[str, int | None]) -> dict[str, float]:
    """User + system CPU time of each process so far (Linux /proc; empty elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def _print_cpu(before: dict[str, float], after: dict[str, float], requests: int) -> None:
    """CPU cost per request of each process: on a shared machine a steadier figure than wall
    throughput. A process's sustainable rate on one core of its own is about 1 / cost."""
    if not requests:
        return
    print("  CPU per request (user + system, this run):")
    for name in sorted(after):
        if name in before:
            cost_us = (after[name] - before[name]) / requests * 1e6
            rate = f"  -> ~{1e6 / cost_us:,.0f} req/s on one core" if cost_us > 0 else ""
            print(f"    {name:12s} {cost_us:8.1f} us{rate}")


def _print_stats(cluster: Any) -> None:
    for name in cluster.pids():
        try:
            stats = cluster.stats(name)
        except Exception as exc:
            print(f"  {name}: no stats ({exc})")
            continue
        if "hops" in stats:
            print(f"  {name} hops:")
            for hop, summary in stats["hops"].items():
                if summary.get("count"):
                    print(f"    {hop:18s} n={summary['count']:6d}  p50 {summary['p50_ms']:7.2f} ms"
                          f"  p90 {summary['p90_ms']:7.2f} ms  p99 {summary['p99_ms']:7.2f} ms")
        counters = stats.get("counters", {k: v for k, v in stats.items()
                                          if isinstance(v, int | float)})
        print(f"  {name} counters: {counters}")


def main(argv: list[str]) -> int:
    """Start a local cluster, send a bounded burst, check outputs, print throughput/latency."""
    from zserve.supervisor import Cluster

    parser = argparse.ArgumentParser(prog="zserve demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="cluster.toml (default: examples/clusters/demo.toml)")
    parser.add_argument("--model", help="model to send to (default: the first)")
    parser.add_argument("--requests", type=int, default=400, help="closed loop: requests")
    parser.add_argument("--concurrency", type=int, default=16, help="closed loop: in flight")
    parser.add_argument("--rate", type=float, help="open loop: requests per second")
    parser.add_argument("--duration", type=float, default=2.0, help="open loop: seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats", action="store_true", help="print per-process counters "
                        "and the frontend's per-hop latencies")
    args = parser.parse_args(argv)
    if args.config:
        config = load_config(args.config)
    elif DEMO_TOML.exists():
        config = load_config(DEMO_TOML)
    else:
        config = parse_config(DEMO_CONFIG)
    model = config.model(args.model) if args.model else config.models[0]
    reference = Reference(config, model)
    inputs = reference.requests(DISTINCT_INPUTS, args.seed)
    expected = [reference.outputs(r) for r in inputs]
    reference.close()
    print(f"zserve demo: starting {config.name!r} ({config.backends.total} {config.backends.device}"
          f" backends, model {model.name!r}, SLO {model.slo_ms:g} ms)", flush=True)
    started = time.monotonic()
    with Cluster(config) as cluster:
        print(f"zserve demo: up in {time.monotonic() - started:.1f} s; clients connect to "
              f"{cluster.client_address}", flush=True)
        tally = Tally()

        async def drive() -> float:
            async with AsyncClient(cluster.client_address, timeout=30.0) as client:
                warm = Work(model.name, inputs, expected, Tally())
                await _closed_loop(client, warm, requests=WARMUP_REQUESTS, concurrency=1)
                work = Work(model.name, inputs, expected, tally)
                begin = time.monotonic()
                if args.rate:
                    await _open_loop(client, work, rate=args.rate, duration_s=args.duration)
                else:
                    await _closed_loop(client, work, requests=args.requests,
                                       concurrency=args.concurrency)
                return time.monotonic() - begin

        pids = cluster.pids()
        cpu_before = {**_cpu_seconds(pids), "demo client": time.process_time()}
        elapsed = asyncio.run(drive())
        cpu_after = {**_cpu_seconds(pids), "demo client": time.process_time()}
        total = tally.ok + tally.wrong + sum(tally.errors.values())
        mode = (f"open loop at {args.rate:g} req/s for {args.duration:g} s" if args.rate
                else f"closed loop, {args.concurrency} in flight")
        print(f"zserve demo: {total} requests ({mode}) in {elapsed:.2f} s: "
              f"{tally.ok / elapsed:.0f} correct answers/s")
        print(f"  correct {tally.ok}, wrong {tally.wrong}, errors {dict(tally.errors) or 0}")
        print(f"  latency (client): {_percentiles(tally.latencies_s)}")
        if args.stats:
            _print_cpu(cpu_before, cpu_after, total + WARMUP_REQUESTS)
            _print_stats(cluster)
    print("zserve demo: cluster stopped", flush=True)
    return 0 if tally.wrong == 0 and tally.ok > 0 else 1
