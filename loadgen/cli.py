"""``zserve bench``: open-loop load on a live cluster, goodput search, closed-loop clients, and the
generator's ceiling.

::

    zserve bench CLUSTER.toml|ADDRESS WORKLOAD.toml [--rate R | --search goodput [--repeat N]
                 | --closed-loop N]
                 [--steps 10:2000,10:4000 | --trace RATES.txt] [--workers N|auto]
                 [--json OUT] [--plots DIR] [--records OUT.npz] [--max-lateness-ms 5]
                 [--protocol native|http-json|http-binary|grpc]
    zserve bench --max-rate-check [--workers N] [--json OUT]

The first argument is a ``cluster.toml`` (the cluster is started in-process for the run and
stopped after it) or the ``client`` address of a frontend already running (``tcp://...``,
``ipc://...``); with an address, ``--cluster CLUSTER.toml`` names its config so that requests get
the right input tensors and the backends can be asked for statistics, and ``--stats
NAME=ADDRESS`` adds any process that answers ``StatsRequest`` as a backend's plan socket does.
The rank's counters and the queueing delay of a cluster at an address come from its frontend:
``ClusterStatsRequest`` on its client socket answers with the frontend's stats and those
of the scheduler processes and backends it talks to (``frontend_stats_reader``).

The load is the workload file's (models, SLOs, popularity, arrival process, warmup / measure /
cooldown, seed); ``--rate`` replaces its rate, ``--steps`` or ``--trace`` its constant rate over
the measure window (warmup and cooldown run at the first and last rate). ``--search goodput``
bisects the total rate (``zserve.loadgen.search``) for the highest one whose worst per-model bad
rate is <= ``--max-bad-rate`` (1%), to ``--precision`` (1%), starting from the analytic bound;
a probe certain to fail stops early (``BailRule``), and a probe the generator could not
keep up with is retried once, then ends the search (exit 3). ``--repeat N`` runs N searches on
the same cluster and reports the median one, with every search's goodput under ``repeats``: on
a shared host one search can differ from the next by a third, so one search is an anecdote.
``--closed-loop N`` runs N clients instead, each sending its next request once its last one is
answered, for the workload's warm-up and measure windows (``zserve.loadgen.closed_loop``): the
report has answers and good answers per second, latency percentiles and errors, per model.

Statistics come over the wire, never from guesses in the client: every backend is asked
``StatsRequest(reset=True)`` once a second (batch sizes and run times of its batches: the batch
size distribution, overall and per model, GPU busy fraction and GPUs in use per second); the
rank's counters and the frontends' queueing delay (batch start on the backend - admission,
overall and per model) are read at the measure window's start and end: over the supervisor's
control link for a cluster started here, from the frontend's client socket for one at an
address. What could not be had is listed under ``stats.missing`` in the report.

Workload models are matched to the cluster's by name (exactly, else case-insensitively, else by
``--model-map WORKLOAD_NAME=CLUSTER_NAME``). The report (``--json``) has the schema of
``zserve.loadgen.report``, the same keys as ``zserve sim`` on the same workload file, plus a
``generator`` section (its lateness, workers), a ``timeline`` of per-second figures and
``latency_cdf_ms`` per model. ``--max-rate-check`` finds the highest rate this machine's generator
sustains within the lateness bound against a zero-delay echo server (``zserve.loadgen.bench.echo``).

Exit status: 0 on success; 2 on a usage, workload or config error; 3 when the generator fell
behind its schedule (the run is refused: the figure would describe the generator).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zserve.loadgen import breakdown, schedules
from zserve.loadgen.bench.max_rate import MAX_RATE_CHECK_S, max_rate_check
from zserve.loadgen.closed_loop import run_closed_loop
from zserve.loadgen.live_report import bound_rps
from zserve.loadgen.live_run import (
    AUTO_GRPC_WORKER_RATE_RPS,
    AUTO_HTTP_WORKER_RATE_RPS,
    AUTO_WORKER_RATE_RPS,
    MIN_MEASURED_REQUESTS,
    BenchOptions,
    run_once,
)
from zserve.loadgen.load_plan import (
    DEFAULT_LATENESS_BOUND_MS,
    BailRule,
    GeneratorBehindError,
    GeneratorError,
)
from zserve.loadgen.report import set_fraction_of_bound, summary_text
from zserve.loadgen.search import search_goodput
from zserve.loadgen.sender import PROTOCOLS
from zserve.loadgen.target import Target, open_target
from zserve.loadgen.workload import ArrivalSpec, Workload, load_workload

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_BEHIND = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zserve bench", description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", help="cluster.toml to start, or a frontend client address")
    p.add_argument("workload", nargs="?", help="workload TOML file")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, help="total offered rate (r/s)")
    mode.add_argument("--search", choices=["goodput"], help="binary-search the goodput")
    mode.add_argument("--closed-loop", type=int, metavar="N",
                      help="N clients, each sending its next request once its last is answered "
                      "(throughput and latency; the workload's warm-up and measure windows)")
    mode.add_argument(
        "--max-rate-check", action="store_true",
        help="find the highest rate the generator itself sustains (echo server, no cluster)",
    )
    p.add_argument("--cluster", help="cluster.toml of the cluster at ADDRESS (inputs, stats)")
    p.add_argument("--stats", action="append", default=[], metavar="NAME=ADDRESS",
                   help="a process that answers StatsRequest like a backend's plan socket "
                   "(added to those the cluster names)")
    p.add_argument("--model-map", action="append", default=[], metavar="WORKLOAD=CLUSTER",
                   help="serve workload model WORKLOAD with cluster model CLUSTER")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--steps", help="rate steps of the measured part: DUR_S:RATE,DUR_S:RATE,...")
    shape.add_argument("--trace", help="file of per-second rates (the measured part)")
    p.add_argument("--trace-scale", type=float, default=1.0, help="multiply the trace's rates")
    p.add_argument("--arrival", help="constant | poisson | gamma:K")
    p.add_argument("--seed", type=int)
    p.add_argument("--measure", type=float, help="measure window seconds")
    p.add_argument("--warmup", type=float, help="warmup seconds")
    p.add_argument("--cooldown", type=float, help="cooldown seconds")
    p.add_argument("--workers", default="auto",
                   help="generator processes, or 'auto' (default): one per "
                   f"{AUTO_WORKER_RATE_RPS:.0f} r/s of peak planned rate (native; "
                   f"{AUTO_HTTP_WORKER_RATE_RPS:.0f} over HTTP, "
                   f"{AUTO_GRPC_WORKER_RATE_RPS:.0f} over gRPC), at most one per CPU")
    p.add_argument("--protocol", default="native", choices=PROTOCOLS,
                   help="send through zserve's client socket (native, default) or the cluster's "
                   "Open Inference Protocol servers ([frontends] http_addresses / "
                   "grpc_addresses)")
    p.add_argument("--max-lateness-ms", type=float, default=DEFAULT_LATENESS_BOUND_MS,
                   help="refuse a run whose p99 send lateness exceeds this")
    p.add_argument("--start-rate", type=float, help="first probe of --search (default: bound)")
    p.add_argument("--max-bad-rate", type=float, default=0.01)
    p.add_argument("--precision", type=float, default=0.01, help="relative search precision")
    p.add_argument("--no-early-stop", action="store_true", help="run every probe to its end")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="with --search: run N searches on the same cluster and report the "
                   "median one (every goodput is listed); live goodputs vary from search to "
                   "search with the host, so quote the median of several")
    p.add_argument("--json", dest="json_out", help="write the report here")
    p.add_argument("--plots", help="write plots (PNG) into this folder (needs matplotlib)")
    p.add_argument("--records", help="write per-request records (.npz) of the run (with "
                   "--search, one file per probe: NAME-<rate>rps.npz)")
    p.add_argument("--compare", metavar="REPORT.json",
                   help="print this report (e.g. `zserve sim ... --json`) side by side")
    p.add_argument("--quiet", action="store_true", help="no text summary")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None)
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _parse_steps(text: str) -> schedules.RateSchedule:
    pairs = []
    for item in text.split(","):
        duration, sep, rate = item.strip().partition(":")
        if not sep:
            raise ValueError(f"--steps: expected DUR_S:RATE, got {item!r}")
        pairs.append((float(duration), float(rate)))
    return schedules.steps(pairs)


def _load(args: argparse.Namespace) -> tuple[Workload, schedules.RateSchedule | None]:
    workload = load_workload(args.workload)
    overrides: dict[str, Any] = {}
    for key, value in (("rate", args.rate), ("seed", args.seed), ("measure_s", args.measure),
                       ("warmup_s", args.warmup), ("cooldown_s", args.cooldown)):
        if value is not None:
            overrides[key] = value
    if args.arrival is not None:
        overrides["arrival"] = ArrivalSpec.parse(args.arrival)
    schedule = None
    if args.steps:
        schedule = _parse_steps(args.steps)
    elif args.trace:
        schedule = schedules.from_trace(args.trace, scale=args.trace_scale)
    if schedule is not None:
        overrides["measure_s"] = schedule.duration_s
        if args.rate is not None:
            schedule = schedule.with_mean_rate(args.rate)
        overrides["rate"] = schedule.mean_rate_rps
    if overrides:
        workload = workload.with_overrides(**overrides)
    return workload, schedule


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{flag}: expected NAME=VALUE, got {item!r}")
        out[key] = value
    return out


def _say(quiet: bool) -> Callable[[str], None]:
    def say(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    return say


def _usage_error(message: str) -> int:
    print(f"zserve bench: {message}", file=sys.stderr)
    return EXIT_USAGE


def _workers(text: str) -> int:
    """``--workers``: a count, or 0 for 'auto'; ValueError otherwise."""
    workers = 0 if text == "auto" else int(text)
    if workers < 0:
        raise ValueError(text)
    return workers


def _check_max_rate(args: argparse.Namespace, workers: int, say: Callable[[str], None]) -> int:
    report = max_rate_check(
        workers=max(1, workers or (os.cpu_count() or 1)),
        lateness_bound_ms=args.max_lateness_ms,
        arrival=args.arrival or "poisson",
        seconds=args.measure or MAX_RATE_CHECK_S,
        precision=max(args.precision, 0.05),
        progress=say,
    )
    _write_json(args.json_out, report)
    if not args.quiet:
        print(
            f"generator sustains {report['max_rate_rps']:.0f} r/s with {report['workers']} "
            f"worker(s) (p99 send lateness <= {args.max_lateness_ms:g} ms, {report['arrival']}"
            f" arrivals, {os.cpu_count()} CPUs, load average {report['load_average'][0]:.2f})"
        )
    return EXIT_OK


def _print_closed_loop(report: dict[str, Any]) -> None:
    latency = report["latency_ms"]
    print(f"closed loop, {report['clients']} clients: {report['answers_per_s']:.1f} answers/s, "
          f"{report['good_rps']:.1f} good/s; latency p50 {latency['p50']} ms, p90 "
          f"{latency['p90']} ms, p99 {latency['p99']} ms; errors {report['errors'] or 0}")


def _print_summary(report: dict[str, Any]) -> None:
    if report.get("mode") == "closed-loop":
        _print_closed_loop(report)
        return
    print(summary_text(report))
    repeats = report.get("repeats")
    if repeats:
        listed = ", ".join(f"{g:.1f}" for g in repeats["goodput_rps"])
        print(f"goodput over {len(repeats['goodput_rps'])} searches: {listed} r/s; median "
              f"{repeats['median_rps']:.1f} (the report above is the median search's)")
    gen = report["generator"]
    lat = gen["lateness_ms"]
    print(f"generator: {gen['workers']} worker(s), send lateness p50 {lat['p50_ms']:.2f} ms "
          f"p99 {lat['p99_ms']:.2f} ms max {lat['max_ms']:.2f} ms (bound "
          f"{lat['bound_ms']:g} ms)")
    cpu = report.get("cpu")
    if cpu:
        costs = "  ".join(f"{name} {us:.0f}" for name, us in cpu["per_request_us"].items())
        print(f"cpu us/request (measure window, {cpu['total_cores']:.2f} of {cpu['cpus']} "
              f"cores busy): {costs}")
    hops = report.get("hops")
    if hops and hops["rows"]:
        print(breakdown.format_table(
            [breakdown.HopRow(**row) for row in hops["rows"]],
            hops["scheduler_cpu_ms_per_1000_requests"]))
    for name, kinds in report.get("allowances", {}).items():
        values = "  ".join(f"{kind} {entry['value_ms']:.2f} ms"
                           + (f" (p99 {entry['p99_ms']:.2f})" if entry.get("p99_ms") else "")
                           for kind, entry in kinds.items() if isinstance(entry, dict))
        print(f"allowances at the end, {name}: {values}")
    for line in report["stats"]["missing"]:
        print(f"missing: {line}")


def _print_compared(path: str, report: dict[str, Any]) -> None:
    try:
        other = json.loads(Path(path).read_text())
        print(side_by_side(report, other))
    except (OSError, ValueError, KeyError) as exc:
        print(f"zserve bench: --compare {path}: {exc}", file=sys.stderr)


def _drive(args: argparse.Namespace, workers: int, say: Callable[[str], None]) -> int:
    """Open the target, run the load (or the search) and write and print the report."""
    try:
        workload, schedule = _load(args)
        model_map = _pairs(args.model_map, "--model-map")
        extra_stats = _pairs(args.stats, "--stats")
    except (OSError, ValueError) as exc:
        return _usage_error(str(exc))
    options = BenchOptions(
        workers=workers,
        lateness_bound_ms=args.max_lateness_ms,
        bail=None if args.no_early_stop or not args.search else BailRule(args.max_bad_rate),
        progress=args.progress,
        schedule=schedule,
        records=args.records,
        protocol=args.protocol,
    )
    try:
        with open_target(args.target, workload, cluster_config=args.cluster,
                         model_map=model_map) as target:
            target.stats_addresses.update(extra_stats)
            report = _bench(args, workload, target, options, say)
    except GeneratorBehindError as exc:
        print(f"zserve bench: {exc}", file=sys.stderr)
        _write_json(args.json_out, {"refused": str(exc),
                                    "lateness_ms": exc.result.lateness.to_dict(),
                                    "search_probes": exc.search_probes})
        return EXIT_BEHIND
    except (OSError, ValueError, GeneratorError) as exc:
        return _usage_error(str(exc))
    _write_json(args.json_out, report)
    if args.plots and report.get("mode") != "closed-loop":
        from zserve.loadgen import plots

        written = plots.write_all(report, args.plots)
        say(f"plots: {', '.join(str(p) for p in written)}")
    if not args.quiet:
        _print_summary(report)
    if args.compare and report.get("mode") != "closed-loop":
        _print_compared(args.compare, report)
    return EXIT_OK


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    say = _say(args.quiet)
    try:
        workers = _workers(args.workers)
    except ValueError:
        return _usage_error("--workers must be a positive integer or 'auto'")
    if args.max_rate_check:
        return _check_max_rate(args, workers, say)
    if not args.target or not args.workload:
        return _usage_error("need CLUSTER_OR_ADDRESS and WORKLOAD (or --max-rate-check)")
    if args.repeat < 1 or (args.repeat > 1 and not args.search):
        return _usage_error("--repeat N needs N >= 1, and N > 1 needs --search goodput")
    return _drive(args, workers, say)


class _BelowFloor(Exception):
    """A search probe would measure too few requests to judge a 1% bad rate."""


def repeat_summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """N goodput searches as one report: the median search's report (for an even N the lower of
    the two middle ones, so that it is a search that ran) with ``repeats``: every search's
    goodput in the order run, their median, min and max."""
    goodputs = [float(r["goodput_rps"]) for r in reports]
    chosen = sorted(reports, key=lambda r: float(r["goodput_rps"]))[(len(reports) - 1) // 2]
    return {**chosen, "repeats": {"goodput_rps": goodputs,
                                  "median_rps": float(statistics.median(goodputs)),
                                  "min_rps": min(goodputs), "max_rps": max(goodputs)}}


def _bench(
    args: argparse.Namespace, workload: Workload, target: Target, options: BenchOptions,
    say: Callable[[str], None],
) -> dict[str, Any]:
    if args.closed_loop is not None:
        return run_closed_loop(target, workload, clients=args.closed_loop,
                               warmup_s=workload.warmup_s, measure_s=workload.measure_s,
                               seed=workload.seed)
    if not args.search:
        report: dict[str, Any] = run_once(
            workload, target, None if options.schedule else workload.rate, options)
        return report
    if args.repeat == 1:
        return _search(args, workload, target, options, say)
    reports = []
    for k in range(args.repeat):
        say(f"search {k + 1} of {args.repeat}")
        # one set of record files per search
        reports.append(_search(args, workload, target,
                               _records_suffixed(options, f"search{k + 1}"), say))
    return repeat_summary(reports)


def _records_suffixed(options: BenchOptions, suffix: str) -> BenchOptions:
    """``options`` writing its per-request records to ``NAME-<suffix>.npz`` instead of
    ``NAME.npz`` (unchanged when it writes none)."""
    if not options.records:
        return options
    path = Path(options.records)
    return dataclasses.replace(options, records=str(path.with_name(f"{path.stem}-{suffix}.npz")))


def _search(
    args: argparse.Namespace, workload: Workload, target: Target, options: BenchOptions,
    say: Callable[[str], None],
) -> dict[str, Any]:
    last: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    floor_rps = MIN_MEASURED_REQUESTS / workload.measure_s

    def probe(rate: float) -> dict[str, Any]:
        if rate < floor_rps:
            raise _BelowFloor
        probe_options = _records_suffixed(options, f"{rate:.0f}rps")
        report: dict[str, Any]
        try:
            report = run_once(workload, target, rate, probe_options)
        except GeneratorBehindError as exc:
            # One retry: on a shared machine a burst of other work can starve the generator
            # for a moment; twice in a row means this rate is beyond it (the search stops).
            say(f"  probe {rate:10.1f} r/s: {exc}; retrying once")
            try:
                report = run_once(workload, target, rate, probe_options)
            except GeneratorBehindError as again:
                again.search_probes = list(probes)
                raise
        last[:] = [report]
        probes.append({"rate": round(rate, 3), "bad_rate": report["bad_rate"],
                       "pass": report["bad_rate"] <= args.max_bad_rate and not report["bailed"]})
        say(
            f"  probe {rate:10.1f} r/s: worst bad rate {report['bad_rate']:.3%}"
            f"{' (stopped early)' if report['bailed'] else ''}"
        )
        return report

    start = args.start_rate or bound_rps(workload, target.gpus or workload.gpus) or workload.rate
    report: dict[str, Any]
    try:
        report = search_goodput(
            probe, start, max_bad_rate=args.max_bad_rate, rel_precision=args.precision
        )
    except _BelowFloor:
        say(f"  no probe passed above {floor_rps:.1f} r/s (fewer than {MIN_MEASURED_REQUESTS} "
            f"requests in the measure window below it): goodput 0")
        report = {
            "goodput_rps": 0.0,
            "search": {"max_bad_rate": args.max_bad_rate, "rel_precision": args.precision,
                       "lo_rps": None, "hi_rps": probes[-1]["rate"] if probes else None,
                       "probes": probes, "floor_rps": floor_rps},
        }
    if "per_model" not in report and last:
        # No probe passed: report the last (lowest) probe's measurements with goodput 0.
        report = {**last[0], "goodput_rps": report["goodput_rps"], "search": report["search"]}
    set_fraction_of_bound(report)
    return report


def side_by_side(left: dict[str, Any], right: dict[str, Any]) -> str:
    """Two reports of the schema (a live run and a simulated one, say) in two columns."""

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows: list[tuple[str, str, str]] = []

    def row(label: str, get: Callable[[dict[str, Any]], Any], spec: str = ".1f") -> None:
        values = []
        for report in (left, right):
            try:
                values.append(fmt(get(report), spec))
            except (KeyError, TypeError):
                values.append("-")
        rows.append((label, values[0], values[1]))

    row("source", lambda r: r["source"], "")
    row("goodput r/s", lambda r: r.get("goodput_rps"))
    row("offered r/s", lambda r: r["offered_rps"])
    row("good r/s", lambda r: r["good_rps"])
    row("worst bad rate", lambda r: r["bad_rate"], ".3%")
    row("fraction of bound", lambda r: r["fraction_of_bound"], ".3f")
    def latency(q: str) -> Callable[[dict[str, Any]], Any]:
        return lambda r: r["latency_ms"][q]

    for q in ("p50", "p90", "p99", "p99.9"):
        row(f"latency {q} ms", latency(q), ".2f")
    row("queueing p50 ms", lambda r: r["queueing_ms"]["p50"], ".2f")
    row("queueing p99 ms", lambda r: r["queueing_ms"]["p99"], ".2f")
    row("median batch", lambda r: r["batch_size"]["median"], "g")
    row("mean batch", lambda r: r["batch_size"]["mean"], ".2f")
    row("GPU busy fraction", lambda r: r["gpu_busy_fraction"], ".3f")
    width = max(len(label) for label, _, _ in rows)
    lines = [f"{'':<{width}}  {'left':>14}  {'right':>14}"]
    lines += [f"{label:<{width}}  {a:>14}  {b:>14}" for label, a, b in rows]
    return "\n".join(lines)


def _write_json(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
