"""perf_analyzer against a cluster under its own policy and under ``eager``, paired per step.

``zserve bench-perf-analyzer CLUSTER.toml [--model M] [--protocol http|grpc] [--range 1:16]``
starts the cluster twice side by side (its policy, and ``policy = "eager"``; each frontend's
Open Inference Protocol servers on a port the kernel picks), then, for each concurrency C of
the range, runs ``perf_analyzer --concurrency-range C:C`` four times, alternating the clusters
(the policy, eager, eager, the policy; the next step the other way round), so that a host whose
speed drifts through the sweep weighs on both alike. Each cluster still climbs the range as one
``--concurrency-range 1:16`` run climbs it. It prints, per step, both throughputs (the mean of
two runs), their ratio, and how far eager's two runs lie apart (what one sweep can tell on this
host), then why the policy's batches started when they did (the scheduler's decision counters:
a closed loop's batches should start at once, ``echoes``). A run perf_analyzer cannot settle
("Failed to obtain stable measurement") is tried once more, then left out and named in its
step's row; the command then exits 1.

One sweep on a 2-vCPU host moves each step by about 10%, so comparing two sweeps run one after
the other reads the host, not the policy (docs/performance.md, "Closed-loop clients").
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, ConfigError, load_config

EAGER = "eager"
# every OIP server on a port the kernel picks: no guessed ports, two clusters side by side
ANY_PORT = "127.0.0.1:0"
RUN_TIMEOUT_S = 600.0
# perf_analyzer gives up on a step whose windows do not settle ("Failed to obtain stable
# measurement", a noisy host): such a run is tried this many more times, then left out
UNSTABLE_RETRIES = 1


@dataclass
class Step:
    """One concurrency step: each policy's runs (inferences/s, p50 ms), in run order, and the
    runs perf_analyzer could not measure (its policy, why)."""

    concurrency: int
    runs: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    failed: list[tuple[str, str]] = field(default_factory=list)

    def mean_rate(self, policy: str) -> float:
        rates = [rate for rate, _ in self.runs[policy]]
        return sum(rates) / len(rates) if rates else math.nan

    def mean_p50_ms(self, policy: str) -> float:
        p50s = [p50 for _, p50 in self.runs[policy]]
        return sum(p50s) / len(p50s) if p50s else math.nan

    def ratio(self, policy: str) -> float:
        """The policy's throughput over eager's (nan where either has no measured run)."""
        return self.mean_rate(policy) / self.mean_rate(EAGER)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zserve bench-perf-analyzer", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("config", help="cluster.toml (its policy is compared with eager)")
    parser.add_argument("--model", help="the model perf_analyzer asks for (default: the first)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--range", default="1:16", help="concurrencies START:END (default 1:16)")
    parser.add_argument("--measurement-interval", type=int, default=3000,
                        help="perf_analyzer's --measurement-interval in ms (default 3000)")
    parser.add_argument("--perf-analyzer", default="perf_analyzer",
                        help="the perf_analyzer binary (default: found on PATH; README, "
                        "\"Standard clients\", says where it comes from)")
    return parser


def _concurrencies(spec: str) -> list[int]:
    """``START:END`` (or one number) as the concurrencies from START to END."""
    start, _, end = spec.partition(":")
    try:
        first, last = int(start), int(end or start)
    except ValueError:
        raise ValueError(f"--range: START:END in whole numbers, not {spec!r}") from None
    if not 1 <= first <= last:
        raise ValueError(f"--range: 1 <= START <= END, not {spec!r}")
    return list(range(first, last + 1))


def _with_policy(config: ClusterConfig, policy: str) -> ClusterConfig:
    """``config`` under ``policy``, named for it, its OIP servers on kernel-picked ports."""
    frontends = msgspec.structs.replace(
        config.frontends,
        http_addresses=(ANY_PORT,) * config.frontends.count,
        grpc_addresses=(ANY_PORT,) * config.frontends.count,
        metrics_addresses=())
    return msgspec.structs.replace(
        config,
        name=f"{config.name}-{policy}",
        scheduler=msgspec.structs.replace(config.scheduler, policy=policy),
        frontends=frontends)


class PerfAnalyzerError(RuntimeError):
    """A perf_analyzer run that measured nothing (its exit status and last lines)."""


@dataclass(frozen=True)
class PerfAnalyzer:
    """How each run is called: the binary, the model, the protocol, the measurement interval."""

    binary: str
    model: str
    protocol: str
    interval_ms: int

    def run(self, address: str, concurrency: int, csv_path: Path) -> tuple[float, float]:
        """One ``--concurrency-range C:C`` run: (inferences/s, p50 latency in ms)."""
        command = [self.binary, "-m", self.model, "-u", address, "--concurrency-range",
                   f"{concurrency}:{concurrency}", "--measurement-interval",
                   str(self.interval_ms), "-f", str(csv_path)]
        if self.protocol == "grpc":
            command[1:1] = ["-i", "grpc"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              check=False)
        if done.returncode != 0 or not csv_path.exists():
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            raise PerfAnalyzerError(f"perf_analyzer failed at concurrency {concurrency} "
                                    f"(exit {done.returncode}): {' | '.join(tail)}")
        with csv_path.open() as handle:
            row = next(csv.DictReader(handle))
        return float(row["Inferences/Second"]), float(row["p50 latency"]) / 1e3


def _decisions(cluster: Cluster, config: ClusterConfig, model: str) -> dict[str, int]:
    """The scheduler's decision counters for ``model`` (why each batch started when it did),
    from the shard that schedules it; empty if none lists it."""
    for role, name, _ in config.process_names():
        if role == "shard":
            models: dict[str, Any] = cluster.stats(name).get("models", {})
            if model in models:
                return dict(models[model]["decisions"])
    return {}


def _print_header(policy: str) -> None:
    print(f"{'clients':>7}  {policy + ' infer/s':>16}  {'eager infer/s':>13}  "
          f"{policy + ' / eager':>16}  {'eager run / run':>15}  {'p50 ms (both)':>13}",
          flush=True)


def _print_step(policy: str, step: Step) -> None:
    eager_rates = [rate for rate, _ in step.runs[EAGER]]
    spread = min(eager_rates) / max(eager_rates) if len(eager_rates) > 1 else math.nan
    failed = "; ".join(f"{name}: {why}" for name, why in step.failed)
    print(f"{step.concurrency:>7}  {step.mean_rate(policy):>16.1f}  "
          f"{step.mean_rate(EAGER):>13.1f}  {step.ratio(policy):>16.3f}  {spread:>15.2f}  "
          f"{step.mean_p50_ms(policy):>6.1f}/{step.mean_p50_ms(EAGER):<6.1f}"
          + (f"  not measured: {failed}" if failed else ""), flush=True)


def _print_summary(policy: str, steps: list[Step]) -> None:
    ratios = [step.ratio(policy) for step in steps if not math.isnan(step.ratio(policy))]
    if ratios:
        print(f"{policy} / eager: {min(ratios):.3f} to {max(ratios):.3f}; steps under 0.95: "
              f"{sum(ratio < 0.95 for ratio in ratios)} of {len(ratios)} measured")
    failed = sum(len(step.failed) for step in steps)
    if failed:
        print(f"{failed} runs not measured (perf_analyzer gave up, after {UNSTABLE_RETRIES} "
              "retry each)")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
        concurrencies = _concurrencies(args.range)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"zserve bench-perf-analyzer: {exc}", file=sys.stderr)
        return 2
    binary = shutil.which(args.perf_analyzer)
    if binary is None:
        print(f"zserve bench-perf-analyzer: no perf_analyzer at {args.perf_analyzer!r} "
              "(--perf-analyzer PATH)", file=sys.stderr)
        return 2
    policy = config.scheduler.policy
    if policy == EAGER:
        print("zserve bench-perf-analyzer: the cluster already runs eager", file=sys.stderr)
        return 2
    model = args.model or config.models[0].name
    try:
        measured = _sweep(config, args, binary, model, concurrencies=concurrencies)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"zserve bench-perf-analyzer: {exc}", file=sys.stderr)
        return 1
    return 0 if measured else 1


def _sweep(config: ClusterConfig, args: argparse.Namespace, binary: str, model: str, *,
           concurrencies: list[int]) -> bool:
    """Both clusters up, the paired runs, the table and the decision counters printed. True
    when every run measured."""
    policy = config.scheduler.policy
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zserve-pa-")))
        clusters = {name: stack.enter_context(Cluster(_with_policy(config, name)))
                    for name in (policy, EAGER)}
        address = {name: (cluster.http_addresses if args.protocol == "http"
                          else cluster.grpc_addresses)[0]
                   for name, cluster in clusters.items()}
        print(f"perf_analyzer -m {model} over {args.protocol}: {policy} at {address[policy]}, "
              f"eager at {address[EAGER]}; concurrency {concurrencies[0]} to "
              f"{concurrencies[-1]}, --measurement-interval {args.measurement_interval}",
              flush=True)
        runner = PerfAnalyzer(binary, model, args.protocol, args.measurement_interval)
        _print_header(policy)
        steps: list[Step] = []
        for concurrency in concurrencies:
            order = [policy, EAGER, EAGER, policy]
            if concurrency % 2 == 0:
                order.reverse()
            step = Step(concurrency, {policy: [], EAGER: []})
            for index, name in enumerate(order):
                _measure(runner, step, name, address[name], tmp / f"{concurrency}-{index}.csv")
            steps.append(step)
            _print_step(policy, step)
        _print_summary(policy, steps)
        print(f"{policy}'s decisions for {model}: "
              f"{_decisions(clusters[policy], config, model)}")
    return not any(step.failed for step in steps)


def _measure(runner: PerfAnalyzer, step: Step, policy: str, address: str,
             csv_path: Path) -> None:
    """One run of ``step`` against ``policy``'s cluster into ``step`` (retried on failure up to
    UNSTABLE_RETRIES times, then noted in ``step.failed``)."""
    for attempt in range(UNSTABLE_RETRIES + 1):
        try:
            step.runs[policy].append(runner.run(address, step.concurrency, csv_path))
            return
        except PerfAnalyzerError as exc:
            if attempt == UNSTABLE_RETRIES:
                step.failed.append((policy, str(exc).rpartition("): ")[2]))
