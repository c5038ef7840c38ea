"""The one report schema (simulator and live load generator), and its one-screen text summary.

A report is a JSON-able dict::

    {"schema": "zserve-report/1", "source": "sim" | "live", "workload": NAME, "policy": P,
     "drop": D, "seed": S, "gpus": G,
     "offered_rps": total requests arriving in the measure window / measure_s,
     "good_rps": good requests in the window / measure_s,
     "goodput_rps": highest passing rate (only when searching; else absent),
     "bad_rate": worst per-model bad rate (0..1), "bad_rate_all": over all requests,
     "bound_rps": analytic staggered bound (when computable), "fraction_of_bound": ...,
     "gpu_busy_fraction": busy GPU-time / (G * measure_s),
     "latency_ms": {"p50", "p90", "p99", "p99.9"}   over served requests of every model,
     "queueing_ms": {"p50", "p99", "max", "histogram": {ms: requests}}   exec start - arrival,
                    (served requests; the histogram in QUEUE_BIN_MS bins named by their start),
     "batch_size": {"median", "mean", "histogram": {bs: batches}},
     "per_model": {NAME: {"slo_ms", "offered_rps", "total", "good", "late", "dropped", "bad_rate",
                          "p50_ms", "p90_ms", "p99_ms", "p99.9_ms", "queueing_p50_ms",
                          "queueing_p99_ms", "median_batch", "mean_batch", "batches",
                          "batch_histogram": {bs: batches}}},
     "measure_s", "wall_s", ...}

A request is good iff its reply is due no later than arrival + SLO; bad = late + dropped (+ no
reply, live). Latency percentiles cover served requests (good or late); drops show only in the bad
rate. ``median_batch`` is the median over batches that started in the measure window (unweighted).
Percentiles are ``null`` when there is no sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zserve.core.errors import ErrorKind

REPORT_SCHEMA = "zserve-report/1"
Floats = np.ndarray[Any, np.dtype[np.float64]]


@dataclass
class ModelOutcome:
    """Raw outcomes of one model's requests that arrived in the measure window."""

    name: str
    slo_ms: float
    total: int
    good: int
    late: int
    dropped: int
    latencies_ms: Floats  # served requests
    queueing_ms: Floats | None = None  # exec start - arrival, served requests
    batch_sizes: np.ndarray[Any, Any] | None = None  # one entry per batch in the window
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def bad(self) -> int:
        return self.total - self.good

    @property
    def bad_rate(self) -> float:
        return self.bad / self.total if self.total else 0.0


def _histogram(sizes: np.ndarray[Any, Any] | None) -> dict[str, int]:
    """{batch size: batches}, sizes as strings (JSON keys)."""
    if sizes is None or len(sizes) == 0:
        return {}
    values, counts = np.unique(sizes, return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)}


QUEUE_BIN_MS = 1.0  # the queueing-delay histogram's bin width


def _queue_histogram(values: Floats | None) -> dict[str, int]:
    """{bin start ms: served requests} of the queueing delays (NX-09: every policy's)."""
    if values is None or len(values) == 0:
        return {}
    bins, counts = np.unique(np.floor(np.asarray(values) / QUEUE_BIN_MS), return_counts=True)
    return {f"{b * QUEUE_BIN_MS:g}": int(c) for b, c in zip(bins, counts, strict=True)}


def _pct(values: Floats | None, q: float) -> float | None:
    if values is None or len(values) == 0:
        return None
    return round(float(np.percentile(values, q)), 4)


def _percentiles(values: Floats | None, qs: tuple[tuple[str, float], ...]) -> dict[str, Any]:
    return {name: _pct(values, q) for name, q in qs}


_LAT_QS = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))


def _model_entry(o: ModelOutcome, measure_s: float) -> dict[str, Any]:
    """One model's entry under ``per_model``."""
    bs = o.batch_sizes
    return {
        "slo_ms": o.slo_ms,
        "offered_rps": round(o.total / measure_s, 3),
        "total": o.total,
        "good": o.good,
        "late": o.late,
        "dropped": o.dropped,
        "bad_rate": round(o.bad_rate, 6),
        "p50_ms": _pct(o.latencies_ms, 50),
        "p90_ms": _pct(o.latencies_ms, 90),
        "p99_ms": _pct(o.latencies_ms, 99),
        "p99.9_ms": _pct(o.latencies_ms, 99.9),
        "queueing_p50_ms": _pct(o.queueing_ms, 50),
        "queueing_p99_ms": _pct(o.queueing_ms, 99),
        "median_batch": float(np.median(bs)) if bs is not None and len(bs) else None,
        "mean_batch": round(float(np.mean(bs)), 3) if bs is not None and len(bs) else None,
        "batches": len(bs) if bs is not None else None,
        "batch_histogram": _histogram(bs) if bs is not None else None,
        **o.extra,
        "admitted_attainment": _admitted_attainment(o),
    }


def _admitted_attainment(o: ModelOutcome) -> float | None:
    """Of the requests admitted (not refused ``OVERLOADED``), the fraction answered good: what
    admission control promises under overload (simulated and live alike)."""
    refused = o.extra.get("error_kinds", {}).get(ErrorKind.OVERLOADED.value, 0)
    admitted = o.total - refused
    return round(o.good / admitted, 6) if admitted else None


def build_report(
    outcomes: list[ModelOutcome],
    *,
    source: str,
    workload: str,
    policy: str,
    drop: str,
    seed: int,
    gpus: int,
    measure_s: float,
    gpu_busy_fraction: float | None,
    bound_rps: float | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    total = sum(o.total for o in outcomes)
    good = sum(o.good for o in outcomes)
    offered = total / measure_s
    all_lat = np.concatenate([o.latencies_ms for o in outcomes]) if outcomes else np.empty(0)
    queues = [o.queueing_ms for o in outcomes if o.queueing_ms is not None]
    all_q = np.concatenate(queues) if queues else None
    sizes = [o.batch_sizes for o in outcomes if o.batch_sizes is not None]
    all_bs = np.concatenate(sizes) if sizes else np.empty(0, dtype=np.int64)
    histogram = _histogram(all_bs)
    per_model = {o.name: _model_entry(o, measure_s) for o in outcomes}
    worst = max((o.bad_rate for o in outcomes), default=0.0)
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "source": source,
        "workload": workload,
        "policy": policy,
        "drop": drop,
        "seed": seed,
        "gpus": gpus,
        "measure_s": measure_s,
        "offered_rps": round(offered, 3),
        "good_rps": round(good / measure_s, 3),
        "bad_rate": round(worst, 6),
        "bad_rate_all": round((total - good) / total, 6) if total else 0.0,
        "gpu_busy_fraction": None if gpu_busy_fraction is None else round(gpu_busy_fraction, 5),
        "bound_rps": None if bound_rps is None else round(bound_rps, 1),
        "fraction_of_bound": None,
        "latency_ms": _percentiles(all_lat, _LAT_QS),
        "queueing_ms": {**_percentiles(all_q, (("p50", 50.0), ("p99", 99.0), ("max", 100.0))),
                        "histogram": _queue_histogram(all_q)},
        "batch_size": {
            "median": float(np.median(all_bs)) if len(all_bs) else None,
            "mean": round(float(np.mean(all_bs)), 3) if len(all_bs) else None,
            "histogram": histogram,
        },
        "per_model": per_model,
    }
    if extra:
        report.update(extra)
    set_fraction_of_bound(report)
    return report


def set_fraction_of_bound(report: dict[str, Any]) -> None:
    """fraction_of_bound = goodput_rps (or good_rps when not searching) / bound_rps."""
    bound = report.get("bound_rps")
    rate = report.get("goodput_rps", report.get("good_rps"))
    if bound and rate is not None:
        report["fraction_of_bound"] = round(rate / bound, 4)


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def summary_text(report: dict[str, Any], max_models: int = 12) -> str:
    """A one-screen text summary of a report."""
    lines = []
    head = f"{report['workload']}  policy={report['policy']} drop={report['drop']}  " \
           f"gpus={report['gpus']} seed={report['seed']}  source={report['source']}"
    lines.append(head)
    if "goodput_rps" in report:
        lines.append(
            f"goodput {report['goodput_rps']:.1f} r/s (bad rate <= "
            f"{report.get('search', {}).get('max_bad_rate', 0.01):.2%}, precision "
            f"{report.get('search', {}).get('rel_precision', 0):.1%})"
        )
    bound = report.get("bound_rps")
    frac = report.get("fraction_of_bound")
    lines.append(
        f"offered {report['offered_rps']:.1f} r/s  good {report['good_rps']:.1f} r/s  "
        f"worst bad rate {report['bad_rate']:.3%}  "
        f"bound {_fmt(bound, '.1f')} r/s  fraction {_fmt(frac, '.3f')}"
    )
    lat = report["latency_ms"]
    qd = report["queueing_ms"]
    bs = report["batch_size"]
    lines.append(
        f"latency ms p50 {_fmt(lat['p50'])} p90 {_fmt(lat['p90'])} p99 {_fmt(lat['p99'])} "
        f"p99.9 {_fmt(lat['p99.9'])}  queueing p50 {_fmt(qd['p50'])} p99 {_fmt(qd['p99'])}"
    )
    lines.append(
        f"batch median {_fmt(bs['median'])} mean {_fmt(bs['mean'])}  "
        f"gpu busy {_fmt(report['gpu_busy_fraction'], '.3f')}"
    )
    if report.get("request_rows", "constant:1") != "constant:1":  # requests of several rows
        lines.append(
            f"rows per request {report['request_rows']} (mean {_fmt(report.get('mean_rows'))}):"
            f"  offered {_fmt(report.get('offered_rows_per_s'), '.1f')} rows/s  good "
            f"{_fmt(report.get('good_rows_per_s'), '.1f')} rows/s (batch sizes count rows)"
        )
    if "sim_rps_wall" in report:
        lines.append(
            f"simulated {report.get('sim_requests', 0)} requests in {report.get('wall_s', 0):.2f} "
            f"s wall ({report['sim_rps_wall']:.0f} simulated r/s)"
        )
    lines.append(f"{'model':<22}{'rps':>9}{'bad':>9}{'p50':>8}{'p99':>8}{'med bs':>8}")
    items = sorted(report["per_model"].items(), key=lambda kv: -kv[1]["bad_rate"])
    for name, m in items[:max_models]:
        lines.append(
            f"{name[:21]:<22}{m['offered_rps']:>9.1f}{m['bad_rate']:>9.2%}"
            f"{_fmt(m['p50_ms'], '.1f'):>8}{_fmt(m['p99_ms'], '.1f'):>8}"
            f"{_fmt(m['median_batch']):>8}"
        )
    if len(items) > max_models:
        lines.append(f"... {len(items) - max_models} more models (sorted by bad rate)")
    return "\n".join(lines)
