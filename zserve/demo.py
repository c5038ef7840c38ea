"""``zserve demo``: start a local cluster, check its answers, measure its goodput, stop it.

::

    zserve demo                                  # examples/clusters/demo.toml: `cnn` on 2 CPUs
    zserve demo --requests 2000 --concurrency 32 --stats
    zserve demo --config examples/clusters/emulated-8gpu-resnet50.toml --rate 2000 --duration 3
    zserve demo --goodput-s 0                    # no goodput search

Three parts, on one cluster:

1. Lone requests (``LONE_REQUESTS``, one every ``LONE_GAP_S``: light load). The first waits for a
   second request no later than its model's rate meter's first sample, 50 ms (a cold model has no
   rate yet; a second request would make it a cold burst, which defers as frontrun does and
   batches). From then on the meter reads about 2 r/s, nothing is expected
   to join a lone request before its latest start, and the default policy starts it at once:
   it is answered in about l(1) plus the allowances (``scheduler/policy.py``, the joiner rule).
2. A burst: closed loop by default (``--concurrency`` requests in flight, ``--requests`` in all);
   with ``--rate`` it is open loop (requests sent on a fixed schedule with
   ``AsyncClient.submit``, whatever the replies do). Prints throughput and latency.
3. Goodput (``--goodput-s`` seconds, default 20; 0 skips it): the load generator's open-loop
   Poisson load (``zserve.loadgen``, as ``zserve bench`` runs it) in short probes (0.5 s warm-up,
   2 s measured), binary-searched to 10% for the highest rate at which at most 1% of the requests
   miss their SLO; it starts from the burst's throughput and stops when the time is up.

Every output of parts 1 and 2 is checked against the model run in this process (ONNX Runtime on
the CPU, or the emulated model's formula). ``--stats`` adds each process's CPU time per request,
counters and timings, and the frontend's per-hop latencies. The last line is ``PASS`` or ``FAIL``
with what failed; exit status 0 on PASS: every lone request answered correctly, no wrong output,
and at most ``GOODPUT_MAX_BAD_RATE`` of the burst answered with an error.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from zserve.client.async_client import AsyncClient
from zserve.cluster.preflight import check_cluster
from zserve.config.cluster import ClusterConfig, ConfigError, ModelConfig, load_config, parse_config
from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ZServeError

DEMO_TOML = Path(__file__).resolve().parent.parent / "examples" / "clusters" / "demo.toml"
# The same cluster as examples/clusters/demo.toml, for installs without the examples folder.
DEMO_CONFIG: dict[str, Any] = {
    "cluster": {"name": "demo", "drain_s": 5.0},
    "scheduler": {"shards": 0, "policy": "deferred", "jitter_ms": 1.0, "d_ctrl_ms": 2.0,
                  "d_data_ms": 0.15},
    "frontends": {"count": 1, "reply_allowance_ms": 10.0,
                  "http_addresses": ["127.0.0.1:8000"], "grpc_addresses": ["127.0.0.1:8001"],
                  "metrics_addresses": ["127.0.0.1:8002"]},
    "backends": {"count": 2, "device": "cpu"},
    "models": [{"name": "cnn", "builtin": "cnn", "slo_ms": 200.0, "max_batch": 16,
                "max_queue": 256}],
}
LONE_REQUESTS = 4
LONE_GAP_S = 0.4  # between one lone request's answer and the next: ~2 r/s, light load
# Goodput search: probe shape and precision (a short search, not a benchmark: see zserve bench).
GOODPUT_WARMUP_S = 0.5
GOODPUT_MEASURE_S = 2.0
GOODPUT_COOLDOWN_S = 0.2
GOODPUT_PRECISION = 0.10
GOODPUT_MAX_BAD_RATE = 0.01
DISTINCT_INPUTS = 64
# Answers are checked against the model run here on the CPU provider: within 1e-4 when the cluster
# runs it on CPUs, within the CUDA tolerance (TF32 convolutions) when any backend is a GPU.
RTOL = 1e-4
ATOL = 1e-4


class Reference:
    """The model run in this process, to check the cluster's answers."""

    def __init__(self, cluster: ClusterConfig, model: ModelConfig) -> None:
        from zserve.backends.host import build_executor

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


OutputCheck = Callable[[Any, Any], bool]  # (got tensor, expected tensor) -> close enough


def _close_on_cpu(got: Any, expected: Any) -> bool:
    return bool(np.allclose(got, expected, RTOL, ATOL))


def _close_on_cuda(got: Any, expected: Any) -> bool:
    from zserve.backends.onnx_session import cuda_output_error

    return cuda_output_error(got, expected) <= 1.0


def output_check(config: ClusterConfig) -> OutputCheck:
    """The answer check for this cluster's backends: elementwise on CPUs, scale-relative (TF32)
    when any backend is a GPU."""
    backends = config.backends
    if any(backends.device_of(i).startswith("cuda") for i in range(backends.total)):
        return _close_on_cuda
    return _close_on_cpu


def _matches(got: dict[str, Any], expected: dict[str, Any], close: OutputCheck) -> bool:
    if got.keys() != expected.keys():
        return False
    return all(got[k].shape == expected[k].shape and close(got[k], expected[k]) for k in got)


class Tally:
    def __init__(self, close: OutputCheck = _close_on_cpu) -> None:
        self.close = close
        self.latencies_s: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.first_message: dict[str, str] = {}  # of each error kind: what the verdict quotes
        self.wrong = 0
        self.ok = 0

    def record(self, index: int, started: float, outcome: Any, expected: list[Any]) -> None:
        if isinstance(outcome, BaseException):
            kind = (outcome.kind.value if isinstance(outcome, ZServeError)
                    else type(outcome).__name__)
            self.errors[kind] += 1
            self.first_message.setdefault(kind, f"{str(outcome)[:200]} (after "
                                                f"{(time.monotonic() - started) * 1e3:.0f} ms)")
            return
        self.latencies_s.append(time.monotonic() - started)
        if _matches(outcome, expected[index % len(expected)], self.close):
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
    """User + system CPU time of each process so far."""
    from zserve.loadgen.cpu import cpu_seconds

    out: dict[str, float] = {}
    for name, pid in pids.items():
        seconds = cpu_seconds(pid) if pid is not None else None
        if seconds is not None:
            out[name] = seconds
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


def _fmt_summary(summary: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in summary.items())


def _print_stats(cluster: Any) -> None:
    for name in cluster.pids():
        try:
            stats = cluster.stats(name)
        except Exception as exc:
            print(f"  {name}: no stats ({exc})")
            continue
        # Every role's counters and latency summaries (the zserve.core.stats schema); a shard with
        # the rank embedded carries the rank's under "rank".
        for source in (stats, stats.get("rank") or {}):
            if "counters" in source:
                nonzero = {k: v for k, v in source["counters"].items() if v}
                print(f"  {source.get('name', name)} counters: {nonzero}")
            for key, summary in (source.get("latency") or {}).items():
                if summary.get("count"):
                    print(f"    {key:20s} {_fmt_summary(summary)}")


def startup_profile(cluster: Any, config: ClusterConfig, model: ModelConfig) -> LatencyProfile:
    """The l(b) the scheduler schedules ``model`` with: the slowest, batch size by batch size, of
    the profiles its backends fixed at start-up (measured there unless cluster.toml gives one),
    read from their stats. The goodput search's analytic bound comes from it, so the bound is
    this machine's, not one measured elsewhere."""
    tables: list[list[float]] = []
    for role, name, _ in config.process_names():
        if role != "backend":
            continue
        table = cluster.stats(name).get("profiles_ms", {}).get(model.name)
        if table:
            tables.append([float(ms) for ms in table])
    if not tables:
        raise RuntimeError(f"no backend of {config.name!r} reports a profile of {model.name!r}")
    size = min(len(t) for t in tables)
    return LatencyProfile.from_table_ms([max(t[b] for t in tables) for b in range(size)])


def demo_workload(config: ClusterConfig, model: ModelConfig, rate: float,
                  profile: LatencyProfile) -> Any:
    """The goodput search's load: the model's SLO, Poisson arrivals, the cluster's GPUs and
    allowances, and ``profile`` (the one measured at start-up: ``startup_profile``)."""
    from zserve.loadgen.workload import parse_workload

    sched = config.scheduler
    workload = parse_workload({
        "workload": {
            "name": f"{config.name}-demo", "gpus": config.backends.total, "seed": 1,
            "rate": rate, "arrival": "poisson", "warmup_s": GOODPUT_WARMUP_S,
            "measure_s": GOODPUT_MEASURE_S, "cooldown_s": GOODPUT_COOLDOWN_S,
            "policy": sched.policy, "drop": sched.drop, "jitter_ms": sched.jitter_ms,
            "d_ctrl_ms": sched.d_ctrl_ms, "d_data_ms": config.d_data_ms_of(model),
            "reply_ms": config.frontends.reply_allowance_ms,
        },
        # alpha/beta only to pass the parser; the measured table replaces them below.
        "models": [{"name": model.name, "slo_ms": model.slo_ms,
                    "alpha_ms": profile.alpha_s * 1e3, "beta_ms": profile.beta_s * 1e3,
                    "max_batch": profile.max_batch}],
    }, source="zserve demo")
    spec = dataclasses.replace(workload.models[0], profile=profile)
    return workload.with_overrides(models=[spec])


def _analytic_bound_rps(workload: Any) -> float | None:
    from zserve.loadgen.sim.simulator import workload_bound_rps

    bound = workload_bound_rps(workload)
    return round(bound, 1) if 0 < bound < math.inf else None


def search_should_stop(rate: float, now: float, *, ends_at: float, floor_rps: float) -> bool:
    """The demo's search stops when its time is up, or once it has probed a rate below the
    floor (too few requests in a probe to judge a 1% bad rate): halving further decides nothing
    and only fills the headline with probes of no verdict."""
    return now >= ends_at or rate < floor_rps


def measure_goodput(cluster: Any, config: ClusterConfig, model: ModelConfig, start_rps: float,
                    budget_s: float) -> dict[str, Any]:
    """A short goodput search on the running cluster (see the module docstring)."""
    from zserve.loadgen.live_run import MIN_MEASURED_REQUESTS, BenchOptions, run_once
    from zserve.loadgen.load_plan import DEFAULT_LATENESS_BOUND_MS, BailRule, GeneratorBehindError
    from zserve.loadgen.report import set_fraction_of_bound
    from zserve.loadgen.search import search_goodput
    from zserve.loadgen.target import target_for_cluster

    workload = demo_workload(config, model, start_rps, startup_profile(cluster, config, model))
    target = target_for_cluster(cluster, config, workload, {})
    options = BenchOptions(workers=0, lateness_bound_ms=DEFAULT_LATENESS_BOUND_MS,
                           bail=BailRule(GOODPUT_MAX_BAD_RATE), progress=False, schedule=None)
    floor_rps = MIN_MEASURED_REQUESTS / GOODPUT_MEASURE_S
    ends_at = time.monotonic() + budget_s
    behind: list[float] = []

    def probe(rate: float) -> dict[str, Any]:
        if rate < floor_rps:
            return {"bad_rate": 1.0, "bailed": True}
        try:
            report: dict[str, Any] = run_once(workload, target, rate, options)
        except GeneratorBehindError as exc:
            # This machine's load generator cannot send this rate on time: no verdict on the
            # cluster; the search treats the rate as too high and says so.
            behind.append(rate)
            lateness = exc.result.lateness
            print(f"  probe {rate:8.1f} r/s: the load generator fell behind its schedule (p99 "
                  f"{lateness.quantile_ms:.1f} ms late): no verdict, treated as too high",
                  flush=True)
            return {"bad_rate": 1.0, "bailed": True}
        verdict = "pass" if report["bad_rate"] <= GOODPUT_MAX_BAD_RATE else "fail"
        print(f"  probe {rate:8.1f} r/s: bad rate {report['bad_rate']:7.2%}  {verdict}",
              flush=True)
        return report

    def stop(rate: float, report: dict[str, Any]) -> bool:
        return search_should_stop(rate, time.monotonic(), ends_at=ends_at, floor_rps=floor_rps)

    found: dict[str, Any] = search_goodput(probe, start_rps, max_bad_rate=GOODPUT_MAX_BAD_RATE,
                                           rel_precision=GOODPUT_PRECISION, on_probe=stop)
    if found.get("bound_rps") is None:  # no probe passed: the bound is the workload's anyway
        found["bound_rps"] = _analytic_bound_rps(workload)
    set_fraction_of_bound(found)
    found["generator_behind_rps"] = sorted(behind)
    return found


def _print_goodput(report: dict[str, Any]) -> None:
    search = report.get("search", {})
    hi = search.get("hi_rps")
    print(f"zserve demo: goodput {report['goodput_rps']:.0f} r/s (at most "
          f"{GOODPUT_MAX_BAD_RATE:.0%} of requests late or dropped; "
          f"{len(search.get('probes', []))} probes"
          f"{f', first failing rate {hi:.0f} r/s' if hi else ''})")
    if report.get("generator_behind_rps"):
        rates = ", ".join(f"{r:.0f}" for r in report["generator_behind_rps"])
        print(f"  (at {rates} r/s the load generator fell behind its schedule on this machine: "
              "those probes say nothing about the cluster)")
    if "per_model" not in report:
        return
    lat = report["latency_ms"]
    bs = report.get("batch_size", {})
    busy = report.get("gpu_busy_fraction") or 0.0
    print(f"  at that rate: latency p50 {lat['p50']:.1f} ms p99 {lat['p99']:.1f} ms, "
          f"median batch {bs.get('median', '-')}, GPU busy {busy:.2f}; analytic bound "
          f"{report.get('bound_rps') or 0:.0f} r/s")
    cpu = report.get("cpu")
    if cpu:
        costs = ", ".join(f"{name} {us:.0f}" for name, us in cpu["per_request_us"].items())
        print(f"  CPU per request (us): {costs}; {cpu['total_cores']:.2f} of {cpu['cpus']} "
              "cores busy")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zserve demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="cluster.toml (default: examples/clusters/demo.toml)")
    parser.add_argument("--model", help="model to send to (default: the first)")
    parser.add_argument("--requests", type=int, default=400, help="closed loop: requests")
    parser.add_argument("--concurrency", type=int, default=16, help="closed loop: in flight")
    parser.add_argument("--rate", type=float, help="open loop: requests per second")
    parser.add_argument("--duration", type=float, default=2.0, help="open loop: seconds")
    parser.add_argument("--goodput-s", type=float, default=20.0,
                        help="time budget of the goodput search in seconds (0: skip it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats", action="store_true", help="print per-process counters "
                        "and the frontend's per-hop latencies")
    return parser


def _load_config(path: str | None) -> ClusterConfig:
    if path:
        return load_config(path)
    if DEMO_TOML.exists():
        return load_config(DEMO_TOML)
    return parse_config(DEMO_CONFIG)


class _Burst:
    """Parts 1 and 2 on a running cluster: the lone requests, then the burst."""

    def __init__(self, args: argparse.Namespace, model: str, inputs: list[Any],
                 expected: list[Any], close: OutputCheck) -> None:
        self.args, self.model, self.inputs, self.expected = args, model, inputs, expected
        self.lone = Tally(close)
        self.tally = Tally(close)
        self.elapsed_s = 0.0

    async def drive(self, address: str) -> None:
        args = self.args
        async with AsyncClient(address, timeout=30.0) as client:
            for index in range(LONE_REQUESTS):
                if index:
                    await asyncio.sleep(LONE_GAP_S)
                inputs = self.inputs[index:] + self.inputs[:index]
                expected = self.expected[index:] + self.expected[:index]
                alone = Work(self.model, inputs, expected, self.lone)
                await _closed_loop(client, alone, requests=1, concurrency=1)
            work = Work(self.model, self.inputs, self.expected, self.tally)
            begin = time.monotonic()
            if args.rate:
                await _open_loop(client, work, rate=args.rate, duration_s=args.duration)
            else:
                await _closed_loop(client, work, requests=args.requests,
                                   concurrency=args.concurrency)
            self.elapsed_s = time.monotonic() - begin

    @property
    def total(self) -> int:
        return self.tally.ok + self.tally.wrong + sum(self.tally.errors.values())

    def failures(self) -> list[str]:
        """What failed, one phrase each (empty: the demo passes): a wrong answer anywhere, a lone
        request not answered correctly, a burst with no correct answer or with more errors than
        the goodput's bad-rate bar allows."""
        lone, tally = self.lone, self.tally
        failed = []
        if lone.ok < LONE_REQUESTS:
            failed.append(f"{LONE_REQUESTS - lone.ok} of {LONE_REQUESTS} lone requests not "
                          f"answered correctly ({_outcomes(lone)})")
        burst_errors = sum(tally.errors.values())
        if tally.wrong or tally.ok == 0 or burst_errors > GOODPUT_MAX_BAD_RATE * self.total:
            failed.append(f"burst: {tally.ok} of {self.total} answered correctly "
                          f"({_outcomes(tally)})")
        return failed

    def verdict(self) -> str:
        """The demo's last line: PASS, or FAIL and what failed."""
        failed = self.failures()
        if failed:
            return "zserve demo: FAIL: " + "; ".join(failed)
        return (f"zserve demo: PASS: {LONE_REQUESTS} of {LONE_REQUESTS} lone requests and "
                f"{self.tally.ok} of {self.total} burst requests answered correctly")

    def print(self, policy: str) -> None:
        lone, tally, args = self.lone, self.tally, self.args
        print(f"zserve demo: {LONE_REQUESTS} lone requests, one every {LONE_GAP_S:g} s: "
              f"correct {lone.ok}, "
              f"wrong {lone.wrong}, errors {dict(lone.errors) or 0}; latency "
              f"{_percentiles(lone.latencies_s)}")
        if policy in {"frontrun", "deferred-bl"}:
            print(f"  ({policy} holds a lone request until one more could no longer join its "
                  "batch: it is answered close to its SLO, by design)")
        elif policy == "deferred":
            print("  (the first waits up to 50 ms for company: no rate sample yet; the others "
                  "start at once: nothing is expected to join them)")
        mode = (f"open loop at {args.rate:g} req/s for {args.duration:g} s" if args.rate
                else f"closed loop, {args.concurrency} in flight")
        print(f"zserve demo: burst of {self.total} requests ({mode}) in {self.elapsed_s:.2f} s: "
              f"{tally.ok / self.elapsed_s:.0f} correct answers/s")
        print(f"  correct {tally.ok}, wrong {tally.wrong}, errors {dict(tally.errors) or 0}")
        print(f"  latency (client): {_percentiles(tally.latencies_s)}")


def _outcomes(tally: Tally) -> str:
    errors = ", ".join(f"{count} {kind}" + (f": {tally.first_message[kind]}"
                                             if kind in tally.first_message else "")
                       for kind, count in sorted(tally.errors.items()))
    return f"{tally.wrong} wrong" + (f", {errors}" if errors else "")


def _expected_outputs(config: ClusterConfig, model: ModelConfig,
                      seed: int) -> tuple[list[Any], list[Any]]:
    reference = Reference(config, model)
    inputs = reference.requests(DISTINCT_INPUTS, seed)
    expected = [reference.outputs(r) for r in inputs]
    reference.close()
    return inputs, expected


def main(argv: list[str]) -> int:
    """Start a local cluster, check lone requests and a burst, measure goodput, stop."""
    from zserve.cluster.cli import endpoint_lines
    from zserve.cluster.supervisor import Cluster

    args = _parser().parse_args(argv)
    try:
        config = _load_config(args.config)
    except (ConfigError, OSError) as exc:
        print(f"zserve demo: {exc}", file=sys.stderr)
        return 2
    # Before the model is loaded here or anything is spawned: one line per problem, exit 2.
    problems = check_cluster(config)
    if problems:
        for problem in problems:
            print(f"zserve demo: {problem}", file=sys.stderr)
        return 2
    model = config.model(args.model) if args.model else config.models[0]
    inputs, expected = _expected_outputs(config, model, args.seed)
    print(f"zserve demo: starting {config.name!r} ({config.backends.total} {config.backends.device}"
          f" backends, model {model.name!r}, SLO {model.slo_ms:g} ms, policy "
          f"{config.scheduler.policy})", flush=True)
    started = time.monotonic()
    burst = _Burst(args, model.name, inputs, expected, output_check(config))
    with Cluster(config) as cluster:
        print(f"zserve demo: up in {time.monotonic() - started:.1f} s; clients connect to "
              f"{cluster.client_address}; it serves at:", flush=True)
        print("\n".join(endpoint_lines(cluster.endpoints())), flush=True)
        pids = cluster.pids()
        cpu_before = {**_cpu_seconds(pids), "demo client": time.process_time()}
        asyncio.run(burst.drive(cluster.client_address))
        cpu_after = {**_cpu_seconds(pids), "demo client": time.process_time()}
        burst.print(config.scheduler.policy)
        if args.stats:
            _print_cpu(cpu_before, cpu_after, burst.total + LONE_REQUESTS)
            _print_stats(cluster)
        if args.goodput_s > 0 and burst.tally.ok:
            print(f"zserve demo: measuring goodput (open-loop Poisson load, probes of "
                  f"{GOODPUT_MEASURE_S:g} s, up to {args.goodput_s:g} s)", flush=True)
            start_rps = max(burst.tally.ok / burst.elapsed_s, 60.0)
            _print_goodput(measure_goodput(cluster, config, model, start_rps, args.goodput_s))
    print("zserve demo: cluster stopped", flush=True)
    print(burst.verdict(), flush=True)
    return 1 if burst.failures() else 0
