"""The live report: one run's outcomes and polled statistics in ``zserve.loadgen.report``'s schema.

``live_report`` adds to the simulator's keys what only a live run has: the generator's lateness,
a per-second ``timeline``, per-model latency CDFs, the RankThread's counters and the frontends'
queueing delay over the measure window, the per-hop breakdown and each process's CPU per request.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zserve.frontend.core import QUEUEING_OF_MODEL
from zserve.loadgen import breakdown
from zserve.loadgen.cpu import cpu_per_request
from zserve.loadgen.load_plan import LoadPlan, Outcome, RunResult
from zserve.loadgen.report import ModelOutcome, build_report
from zserve.loadgen.stats_poller import (
    HOPS_MARK,
    STATS_INTERVAL_S,
    StatsSample,
    StatsWindow,
    polled_busy_s,
    stats_window,
)
from zserve.loadgen.target import Target
from zserve.loadgen.workload import Workload


def _model_outcomes(
    result: RunResult, window: StatsWindow | None, cluster_names: dict[str, str],
) -> tuple[list[ModelOutcome], dict[str, list[list[float]]]]:
    """Each model's outcomes over the measure window, and its latency CDF."""
    plan = result.plan
    measured = plan.measured
    latency_ms = result.latency_s * 1e3
    single_model = len(plan.models) == 1
    outcomes: list[ModelOutcome] = []
    cdfs: dict[str, list[list[float]]] = {}
    # A run stopped early counts what it sent: its unsent requests are neither good nor bad.
    sent = result.outcome != Outcome.UNSENT
    for m, name in enumerate(plan.models):
        mask = measured & (plan.model_index == m) & sent
        oc = result.outcome[mask]
        served = (oc == Outcome.GOOD) | (oc == Outcome.LATE)
        cdfs[name] = latency_cdf(latency_ms[mask][served])
        outcomes.append(
            ModelOutcome(
                name=name,
                slo_ms=plan.slo_ms[m],
                total=int(mask.sum()),
                good=int(np.count_nonzero(oc == Outcome.GOOD)),
                late=int(np.count_nonzero(oc == Outcome.LATE)),
                dropped=int(np.count_nonzero(oc == Outcome.DROPPED)),
                latencies_ms=latency_ms[mask][served],
                batch_sizes=(
                    None if window is None
                    else window.batch_sizes if single_model
                    else window.sizes_of(cluster_names.get(name, name))
                ),
                extra={
                    "errors": int(np.count_nonzero(oc == Outcome.ERROR)),
                    "timeouts": int(np.count_nonzero(oc == Outcome.TIMEOUT)),
                    "unsent": int(
                        np.count_nonzero(measured & (plan.model_index == m) & ~sent)
                    ),
                    "error_kinds": result.error_counts(m),
                },
            )
        )
    return outcomes, cdfs


def _live_extra(
    result: RunResult, workload: Workload, *, target: Target | None,
    samples: list[StatsSample], stats_missing: list[str], cdfs: dict[str, list[list[float]]],
) -> dict[str, Any]:
    """The keys only a live report has (generator, timeline, CDFs, allowances, stats)."""
    plan = result.plan
    extra: dict[str, Any] = {
        "rate_rps": round(plan.offered_rate_rps, 3),
        "arrival": plan.description.get("arrival", str(workload.arrival)),
        "bailed": result.stopped_early is not None,
        "stopped_early": result.stopped_early,
        "wall_s": round(plan.duration_s, 3),
        "generator": {
            "workers": result.workers,
            "lateness_ms": result.lateness.to_dict(),
            "planned_requests": len(plan),
        },
        "schedule": plan.description.get("schedule"),
        "timeline": timeline(result, samples),
        "latency_cdf_ms": cdfs,
        # The live scheduler's, when its config is known (cluster.toml has no such key yet:
        # then the ModelThread default).
        "keep_tolerance": target.keep_tolerance if target is not None else None,
        "allowances_ms": (
            target.allowances_ms
            if target is not None and target.allowances_ms is not None
            else {"d_ctrl": workload.d_ctrl_ms, "d_data": workload.d_data_ms,
                  "reply": workload.reply_ms}
        ),
        "stats": {
            "source": "backend StatsReply (plan socket), polled every "
            f"{STATS_INTERVAL_S:g} s with reset",
            "processes": sorted({s.name for s in samples}),
            "missing": stats_missing,
        },
    }
    extra.update(rows_summary(result, workload))
    if target is not None:
        extra["target"] = {"address": target.client_address, "models": target.model_names}
        if target.notes:
            extra["notes"] = list(target.notes)
    return extra


def rows_summary(result: RunResult, workload: Workload) -> dict[str, Any]:
    """Rows per request and the measure window's rows/s, offered and answered in time, as
    ``zserve sim`` reports them (goodput itself counts requests)."""
    plan = result.plan
    measured = plan.measured
    rows = plan.rows if plan.rows is not None else np.ones(len(plan), np.int64)
    good = measured & (result.outcome == Outcome.GOOD)
    measure_s = plan.measure_s or 1.0
    return {
        "request_rows": str(workload.request_rows),
        "mean_rows": round(float(rows[measured].mean()), 3) if measured.any() else None,
        "offered_rows_per_s": round(float(rows[measured].sum()) / measure_s, 3),
        "good_rows_per_s": round(float(rows[good].sum()) / measure_s, 3),
    }


def _add_batch_histogram(report: dict[str, Any], window: StatsWindow | None,
                         single_model: bool) -> None:
    if window is not None and not single_model and len(window.batch_sizes):
        values, counts = np.unique(window.batch_sizes, return_counts=True)
        report["batch_size"] = {
            "median": float(np.median(window.batch_sizes)),
            "mean": round(float(np.mean(window.batch_sizes)), 3),
            "histogram": {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)},
        }


def live_report(
    result: RunResult,
    workload: Workload,
    *,
    target: Target | None,
    samples: list[StatsSample],
    at_marks: dict[str, dict[str, dict[str, Any]]] | None = None,
    stats_missing: list[str],
    cpu_at_marks: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """The report of one live run in ``zserve.loadgen.report``'s schema."""
    plan = result.plan
    measured = plan.measured
    sent = result.outcome != Outcome.UNSENT
    window = stats_window(samples, plan.measure_start_s, plan.measure_end_s)
    # Workload model name -> the cluster's, which the backends' stats use.
    cluster_names = target.model_names if target is not None else {}
    outcomes, cdfs = _model_outcomes(result, window, cluster_names)
    gpus = (target.gpus if target is not None else None) or workload.gpus
    report: dict[str, Any] = build_report(
        outcomes,
        source="live",
        workload=workload.name,
        policy=(target.policy if target is not None and target.policy else workload.policy),
        drop=(target.drop if target is not None and target.drop else workload.drop),
        seed=workload.seed,
        gpus=gpus,
        measure_s=plan.measure_s,
        gpu_busy_fraction=window.busy_fraction if window is not None else None,
        bound_rps=bound_rps(workload, gpus),
        extra=_live_extra(result, workload, target=target, samples=samples,
                          stats_missing=stats_missing, cdfs=cdfs),
    )
    _add_control_stats(report, target, at_marks or {}, stats_missing)
    cpu_marks = cpu_at_marks or {}
    if "start" in cpu_marks and "end" in cpu_marks:
        sent_in_window = int(np.count_nonzero(measured & sent))
        cpu = cpu_per_request(cpu_marks["start"], cpu_marks["end"], sent_in_window,
                              plan.measure_s)
        if cpu is not None:
            report["cpu"] = cpu
    if target is not None and at_marks and "end" in at_marks:
        served = measured & sent & ((result.outcome == Outcome.GOOD)
                                    | (result.outcome == Outcome.LATE))
        report["hops"] = _hops(target, latest=_latest_stats(at_marks), samples=samples, plan=plan,
                               client_latency_ms=result.latency_s[served] * 1e3,
                               cpu=report.get("cpu"))
    if at_marks and "end" in at_marks:
        in_use = allowances_in_use(_latest_stats(at_marks))
        if in_use:
            report["allowances"] = in_use
    _add_batch_histogram(report, window, len(plan.models) == 1)
    return report


def allowances_in_use(stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The allowances each shard and frontend planned with just after the window (ms; learned
    ones with their window's p99 and sample count): ``[scheduler] allowances``."""
    out: dict[str, Any] = {}
    for name, peer in sorted(stats.items()):
        if isinstance(peer.get("allowances"), dict):
            out[name] = peer["allowances"]
        elif isinstance(peer.get("reply_allowance"), dict):
            out[name] = {"reply": peer["reply_allowance"]}
    return out


# Levels of the latency CDF kept in a live report (fraction, latency ms): every percent, then the
# tail in finer steps, so that the plot shows p99.9 without storing every sample.
CDF_LEVELS = (*(i / 100 for i in range(100)), 0.995, 0.999, 0.9995, 1.0)


def _hops(
    target: Target,
    *,
    latest: dict[str, dict[str, Any]],
    samples: list[StatsSample],
    plan: LoadPlan,
    client_latency_ms: np.ndarray[Any, Any],
    cpu: dict[str, Any] | None,
) -> dict[str, Any]:
    """The per-hop breakdown (``zserve.loadgen.breakdown``) of one run."""
    rank = latest.get(target.rank_process or "")
    if rank is not None and isinstance(rank.get("rank"), dict):
        rank = rank["rank"]  # shards = 0: the shard process hosts the rank
    in_window = [s for s in samples
                 if plan.measure_start_s + 1e-6 < s.t_s <= plan.measure_end_s + 1e-6]
    rows = breakdown.hop_breakdown(
        client_latency_ms=client_latency_ms,
        frontends=[latest[n] for n in target.frontends if n in latest],
        shards=[latest[n] for n in target.shards if n in latest],
        rank=rank,
        backends=[s.stats for s in in_window],
    )
    return {"rows": [r.to_dict() for r in rows],
            "scheduler_cpu_ms_per_1000_requests": breakdown.scheduler_cpu_ms_per_1000(cpu)}


def latency_cdf(values_ms: np.ndarray[Any, Any]) -> list[list[float]]:
    if len(values_ms) == 0:
        return []
    quantiles = np.quantile(values_ms, CDF_LEVELS)
    return [[level, round(float(q), 4)] for level, q in zip(CDF_LEVELS, quantiles, strict=True)]


def _rank_counters(stats: dict[str, Any]) -> dict[str, Any] | None:
    """The RankThread counters in a rank's stats, or in a shard's that embeds the rank."""
    if isinstance(stats.get("rank_thread"), dict):
        return dict(stats["rank_thread"])
    embedded = stats.get("rank")
    if isinstance(embedded, dict):
        return _rank_counters(embedded)
    return None


def _latest_stats(
    at_marks: dict[str, dict[str, dict[str, Any]]],
) -> dict[str, dict[str, Any]]:
    """Every process's stats as of just after the window (the hops mark, which asked them all),
    or the window's end mark when the run ended before the hops mark could be taken."""
    return at_marks.get(HOPS_MARK) or at_marks["end"]


def _add_rank_counters(
    report: dict[str, Any], rank_name: str, start: dict[str, dict[str, Any]],
    end: dict[str, dict[str, Any]], missing: list[str],
) -> None:
    """The RankThread's counters over the window (the simulator's ``rank`` key)."""
    before = _rank_counters(start.get(rank_name, {}))
    after = _rank_counters(end.get(rank_name, {}))
    if before is not None and after is not None:
        report["rank"] = {
            key: after[key] - before.get(key, 0)
            for key in after
            if isinstance(after[key], int | float)
        }
    else:
        missing.append(f"no RankThread counters from {rank_name!r} at the window's start and end")


def _busiest(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Several frontends: the figures of the one with the most samples (None: no samples)."""
    entries = [e for e in entries if e.get("count")]
    return max(entries, key=lambda e: e["count"]) if entries else None


def _add_queueing(report: dict[str, Any], target: Target,
                  latest: dict[str, dict[str, Any]], missing: list[str]) -> None:
    """The queueing delay the frontends measured, overall and per model."""
    frontends = [latest[name] for name in target.frontends if name in latest]
    for hop_name, source in (
        ("queueing", "frontend queueing (backend batch start - admission), its histogram since "
                     "it started, taken just after the window"),
        ("admit_to_fetch", "frontend admit_to_fetch hop (an approximation: the frontends did not "
                           "report batch starts), its histogram since it started, taken just "
                           "after the window"),
    ):
        hop = _busiest([stats.get("latency", {}).get(hop_name, {}) for stats in frontends])
        if hop is not None:
            report["queueing_ms"] = {
                "p50": round(float(hop["p50_ms"]), 4),
                "p99": round(float(hop["p99_ms"]), 4),
                "source": source,
                "samples": int(hop["count"]),
            }
            break
    else:
        missing.append("no queueing samples from the frontends: queueing delay unknown")
    for model, entry in report.get("per_model", {}).items():
        cluster_model = target.model_names.get(model, model)
        metric = QUEUEING_OF_MODEL.format(cluster_model)
        hop = _busiest([stats.get("latency", {}).get(metric, {}) for stats in frontends])
        if hop is not None:
            entry["queueing_p50_ms"] = round(float(hop["p50_ms"]), 4)
            entry["queueing_p99_ms"] = round(float(hop["p99_ms"]), 4)


def _add_control_stats(
    report: dict[str, Any],
    target: Target | None,
    at_marks: dict[str, dict[str, dict[str, Any]]],
    missing: list[str],
) -> None:
    """From the stats taken over the control link at the measure window's start and end: the
    RankThread's counters over the window (the simulator's ``rank`` key), and the queueing delay
    the frontends measured: batch start on the backend (``BatchOutputs.started_at``) minus
    admission, overall and per model (``queueing/<model>``; histograms since the frontend
    started, taken just after the window).
    Frontends that do not report it leave the older approximation: admission -> the backend's
    input fetch, which happens when the batch plan reaches the backend, just before exec_at.
    """
    if target is None or target.control_stats is None:
        return
    if "end" not in at_marks:
        missing.append("the run stopped before the measure window's end: no rank counters or "
                       "queueing delay over the window")
        return
    latest = _latest_stats(at_marks)
    _add_rank_counters(report, target.rank_process or "", at_marks.get("start", {}),
                       at_marks["end"], missing)
    # Every hop the frontends time, as they reported it at the window's end (to compare the
    # frontend's view of latency, admit_to_answer, with the client's).
    report["frontend_hops_ms"] = {
        name: latest[name].get("latency", {}) for name in target.frontends if name in latest
    }
    _add_queueing(report, target, latest, missing)


def bound_rps(workload: Workload, gpus: int) -> float | None:
    try:
        from zserve.loadgen.sim.simulator import workload_bound_rps

        bound = workload_bound_rps(workload.with_overrides(gpus=gpus))
    except Exception:
        return None
    return bound if 0 < bound < math.inf else None


def timeline(result: RunResult, samples: list[StatsSample]) -> dict[str, Any]:
    """Per-second series over the whole run (by planned send time): offered, good and bad rate;
    from the backends' stats, the GPU busy time and the GPUs that ran any batch."""
    plan = result.plan
    seconds = max(1, math.ceil(plan.duration_s))
    edges = np.arange(seconds + 1, dtype=np.float64)
    offered = np.histogram(plan.times_s, bins=edges)[0]
    good = np.histogram(plan.times_s[result.outcome == Outcome.GOOD], bins=edges)[0]
    decided = (result.outcome != Outcome.UNSENT)
    total = np.histogram(plan.times_s[decided], bins=edges)[0]
    bad_rate = [
        round(1.0 - g / t, 6) if t else None for g, t in zip(good, total, strict=True)
    ]
    gpus_busy: list[float | None] = [None] * seconds
    gpus_active: list[int | None] = [None] * seconds
    if samples:
        busy = np.zeros(seconds)
        active: list[set[str]] = [set() for _ in range(seconds)]
        for s in samples:
            # A poll at t covers (t - interval, t]: the second that ends at ceil(t).
            k = min(seconds - 1, max(0, math.ceil(s.t_s - 1e-6) - 1))
            recorded = s.stats.get("samples", {})
            busy_s = polled_busy_s(recorded)
            busy[k] += busy_s
            if recorded.get("batch_size") or recorded.get("run_s") or busy_s > 0:
                active[k].add(s.name)
        gpus_busy = [round(float(b), 4) for b in busy]
        gpus_active = [len(a) for a in active]
    return {
        "t_s": [float(t) for t in edges[:-1]],
        "offered_rps": [int(x) for x in offered],
        "good_rps": [int(x) for x in good],
        "bad_rate": bad_rate,
        "gpus_busy": gpus_busy,
        "gpus_active": gpus_active,
        "measure_start_s": plan.measure_start_s,
        "measure_end_s": plan.measure_end_s,
    }
