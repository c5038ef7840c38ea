"""One measured run of a workload against a live target (``run_once``), with its options.

It plans the load, starts the stats poller with the run, drives the generator's workers and
returns the live report; the goodput search of ``zserve bench`` and of the experiments calls it
once per probe.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from zserve.loadgen import schedules
from zserve.loadgen.generator import run_load
from zserve.loadgen.live_report import live_report
from zserve.loadgen.load_plan import BailRule, LoadPlan, RunResult, plan_for_workload
from zserve.loadgen.stats_poller import HOPS_MARK, HOPS_MARK_MARGIN_S, StatsPoller
from zserve.loadgen.target import Target
from zserve.loadgen.workload import Workload

# Rate a single worker is assumed to sustain when --workers auto picks a count (see
# --max-rate-check for this machine's figure). A worker sends the requests due at once in one
# InferRequests, so its sends (and the frontend's receives) follow its loop's ~1 ms timer steps,
# not its rate: one worker at 3,600 r/s costs about half the CPU per request of two (each of
# which wakes, sends and is answered separately), and is no later (docs/performance.md, "CPU
# per request").
AUTO_WORKER_RATE_RPS = 4000.0
# An HTTP worker sends one request per call, so it keeps the rule a native worker had before.
AUTO_HTTP_WORKER_RATE_RPS = 2000.0
# The same for a gRPC worker (grpcio's client costs about four times the native one per request;
# the HTTP client costs about what the native one does: docs/performance.md, "Protocols").
AUTO_GRPC_WORKER_RATE_RPS = 500.0
# A search probe must plan at least this many measured requests (a 1% bad rate needs 100).
MIN_MEASURED_REQUESTS = 100





@dataclass
class BenchOptions:
    workers: int
    lateness_bound_ms: float
    bail: BailRule | None
    progress: bool | None
    schedule: schedules.RateSchedule | None
    records: str | None = None  # write each run's per-request records here (.npz)
    protocol: str = "native"  # or an OIP transport (zserve.loadgen.sender.PROTOCOLS)


def _stats_poller(target: Target, plan: LoadPlan) -> StatsPoller:
    """The poller of one run: backends every interval; marks at the window's start and end (the
    rank only) and one just after the last measured deadline (every process)."""
    control_names = list(dict.fromkeys(
        n for n in [target.rank_process, *target.shards, *target.frontends] if n
    ))
    # Asking a process for its stats costs it a millisecond or more of its event loop (the
    # frontend's hop quantiles: 2-5 ms), and a stall of that size inside the measure window is a
    # burst of bad requests under a 25 ms SLO. So the window's start and end ask only the rank,
    # whose counters are all that is needed there (the RankThread's counters over the window);
    # the hop statistics (the latest samples, not differences) are taken from every process a
    # little after the window, when a stall no longer touches a measured request.
    rank_only = [target.rank_process] if target.rank_process else []
    last_answer_s = plan.measure_end_s + max(plan.slo_ms, default=0.0) / 1e3 + HOPS_MARK_MARGIN_S
    hops_at = min(last_answer_s, plan.duration_s)
    return StatsPoller(
        target.stats_addresses,
        control_stats=target.control_stats,
        control_names=control_names,
        marks=[(plan.measure_start_s, "start", rank_only), (plan.measure_end_s, "end", rank_only),
               (hops_at, HOPS_MARK, None)],
        cpu_pids=target.pids,
    )


def _missing_sources(target: Target) -> list[str]:
    """What this target cannot tell: listed under ``stats.missing`` in the report."""
    missing: list[str] = []
    if not target.stats_addresses:
        missing.append(
            "no process to ask for statistics (start the cluster from cluster.toml, or pass "
            "--cluster with an address): batch sizes and GPU busy fraction are unknown"
        )
    if target.control_stats is None:
        missing.append("no control link and no frontend to ask: queueing delay and rank "
                       "counters are unknown")
    return missing


def run_once(
    workload: Workload,
    target: Target,
    rate_rps: float | None,
    options: BenchOptions,
) -> dict[str, Any]:
    """One live run at ``rate_rps`` (None: the workload's rate or the schedule as given)."""
    plan = plan_for_workload(workload, rate_rps=rate_rps, schedule=options.schedule)
    plan = _rename(plan, target.model_names)
    inputs = {target.model_names[w]: t for w, t in target.inputs.items()}
    poller = _stats_poller(target, plan)
    missing = _missing_sources(target)
    addresses = target.addresses_for(options.protocol)
    try:
        result = run_load(
            plan,
            addresses,
            inputs=inputs,
            protocol=options.protocol,
            workers=_workers_for(options.workers, plan, len(addresses),
                                 _auto_worker_rate_rps(options.protocol)),
            lateness_bound_ms=options.lateness_bound_ms,
            bail=options.bail,
            progress=options.progress,
            on_start=poller.start,
        )
    finally:
        poller.stop()
    if poller.silent:
        missing.append(f"no StatsReply from {sorted(poller.silent)}")
    result = _rename_result(result, workload)
    if options.records:
        result.save(options.records)
    report: dict[str, Any] = live_report(
        result, workload, target=target, samples=poller.samples, at_marks=poller.at_marks,
        stats_missing=missing, cpu_at_marks=poller.cpu_at_marks)
    return report


def _auto_worker_rate_rps(protocol: str) -> float:
    """The rate one worker of ``protocol`` is assumed to sustain (``--workers auto``)."""
    if protocol == "native":
        return AUTO_WORKER_RATE_RPS
    return AUTO_GRPC_WORKER_RATE_RPS if protocol == "grpc" else AUTO_HTTP_WORKER_RATE_RPS


def _workers_for(requested: int, plan: LoadPlan, frontends: int = 1,
                 worker_rate_rps: float = AUTO_WORKER_RATE_RPS) -> int:
    """``requested``, or (0: auto) one worker per ``worker_rate_rps`` of the peak per-second
    planned rate, at most one per CPU, and at least one per frontend (each worker feeds one)."""
    if requested > 0:
        return requested
    peak = float(np.histogram(plan.times_s, bins=max(1, math.ceil(plan.duration_s)))[0].max())
    by_rate = min(os.cpu_count() or 1, math.ceil(peak / worker_rate_rps))
    return max(1, frontends, by_rate)


def _rename(plan: LoadPlan, names: dict[str, str]) -> LoadPlan:
    return dataclasses.replace(plan, models=tuple(names.get(m, m) for m in plan.models))


def _rename_result(result: RunResult, workload: Workload) -> RunResult:
    """Report under the workload's model names, as the simulator does."""
    plan = dataclasses.replace(result.plan, models=tuple(m.name for m in workload.models))
    return dataclasses.replace(result, plan=plan)
