"""Where a request's time goes in a live run: one row per hop, p50 and p99 in milliseconds.

``zserve bench CLUSTER.toml WORKLOAD.toml --rate R`` adds ``report["hops"]`` (and prints the
table) when it started the cluster itself, so that every process's statistics are at hand:

- the load generator's own end-to-end latency (send -> reply, per request);
- the frontend's hops (``admit_to_answer``, ``queueing`` = batch start - admission, ``overhead`` =
  answer - admission - execution, ``finish_to_answer`` = the frontend's answer - the backend's
  batch end), as the frontends reported them just after the measure window (their histograms
  since they started);
- the shard's ``meta_delay`` (request admitted -> its metadata handled by the shard: the
  frontend's per-tick coalescing plus the hop) and ``grant_slack`` (margin left when a grant
  reached the shard);
- the rank's ``candidate_slack`` (margin left when a candidate reached the rank) and batch-start
  ``lateness`` (backend start - planned ``exec_at``);
- every backend's per-batch histograms over the measure window, pooled (merged, so the
  quantiles are over all backends' batches): ``slack`` (plan arrival -> exec_at), ``fetch``
  (input-fetch round trip), ``lateness``, ``assemble``, ``run`` (execution) and ``push``
  (sending the outputs).

Every process's figures are read from the one ``zserve.core.stats`` schema:
``stats["latency"][metric]``
summaries (p50_ms, p99_ms, p1_ms, count), and ``zserve.core.stats.merge_snapshots`` pools backends.

Different processes share CLOCK_MONOTONIC on one host, so the cross-process hops (meta delay,
lateness, finish -> answer) are direct differences of timestamps. The client <-> frontend row is
the difference of two medians (the client's end-to-end p50 minus the frontend's
``admit_to_answer`` p50; likewise p99), an approximation stated in its source column.

Rows marked "margin" are slacks (larger is safer; their p99 column holds the 1st percentile, the
bad tail); all others are delays. The scheduler's CPU cost per
1,000 requests comes from the run's CPU accounting (shard and rank processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from zserve.core.stats import merge_snapshots

# Backend per-batch histograms (``zserve.backends.follower.BACKEND_HISTOGRAMS``), by hop row.
BACKEND_METRICS = (
    ("plan arrives before exec_at (slack, margin)", "slack"),
    ("input fetch round trip", "fetch"),
    ("batch start lateness (start - exec_at)", "lateness"),
    ("assemble the batch", "assemble"),
    ("execution (backend run)", "run"),
    ("push the outputs", "push"),
)


@dataclass(frozen=True)
class HopRow:
    hop: str
    p50_ms: float | None
    p99_ms: float | None
    samples: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "hop": self.hop,
            "p50_ms": None if self.p50_ms is None else round(self.p50_ms, 4),
            "p99_ms": None if self.p99_ms is None else round(self.p99_ms, 4),
            "samples": self.samples,
            "source": self.source,
        }


def _latency(stats: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A latency summary of the ``zserve.core.stats`` schema (any role), if it has samples."""
    summary = stats.get("latency", {}).get(name)
    return summary if isinstance(summary, dict) and summary.get("count") else None


def _best_frontend(frontends: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The frontend with the most samples of hop ``name`` (several frontends: one of them)."""
    hops = [h for h in (_latency(s, name) for s in frontends) if h is not None]
    return max(hops, key=lambda h: h["count"]) if hops else None


def hop_breakdown(
    *,
    client_latency_ms: np.ndarray[Any, Any],
    frontends: list[dict[str, Any]],
    shards: list[dict[str, Any]],
    rank: dict[str, Any] | None,
    backends: list[dict[str, Any]],
) -> list[HopRow]:
    """The rows of the breakdown, in the order a request meets them.

    ``frontends``/``shards``/``rank``: those processes' StatsReply payloads at the measure
    window's end; ``backends``: the StatsReply payloads the backends sent inside the measure
    window (polled with reset: each covers one interval), merged here."""
    rows: list[HopRow] = []
    client = np.asarray(client_latency_ms, dtype=np.float64)
    answer = _best_frontend(frontends, "admit_to_answer")
    if client.size and answer is not None:
        c50, c99 = (float(v) for v in np.percentile(client, [50, 99]))
        rows.append(HopRow("client <-> frontend, both ways (approx.)",
                           c50 - float(answer["p50_ms"]), c99 - float(answer["p99_ms"]),
                           int(client.size),
                           "client end-to-end quantile - frontend admit_to_answer quantile"))
    meta = [m for m in (_latency(s, "meta_delay") for s in shards) if m is not None]
    if meta:
        rows.append(HopRow("frontend tick + hop -> shard", max(m["p50_ms"] for m in meta),
                           max(m["p99_ms"] for m in meta), sum(m["count"] for m in meta),
                           "shard meta_delay: shard receipt - admission (worst shard)"))
    queueing = _best_frontend(frontends, "queueing")
    if queueing is not None:
        rows.append(HopRow("admission -> batch start (deferral by design + control hops)",
                           float(queueing["p50_ms"]), float(queueing["p99_ms"]),
                           int(queueing["count"]), "frontend queueing hop"))
    grant = [g for g in (_latency(s, "grant_slack") for s in shards) if g is not None]
    if grant:
        rows.append(HopRow("grant reaches shard before its last moment (margin)",
                           min(g["p50_ms"] for g in grant), min(g["p1_ms"] for g in grant),
                           sum(g["count"] for g in grant),
                           "shard grant_slack; the p99 column is the 1st percentile"))
    slack = _latency(rank, "candidate_slack") if rank is not None else None
    if slack is not None:
        rows.append(HopRow("candidate reaches rank before its timer (margin)",
                           float(slack["p50_ms"]), float(slack["p1_ms"]), int(slack["count"]),
                           "rank candidate_slack; the p99 column is the 1st percentile"))
    rows.extend(_backend_rows(backends))
    for name, label in (("finish_to_answer", "batch end -> frontend answers (outputs hop)"),
                        ("overhead", "overhead: answer - admission - execution")):
        hop = _best_frontend(frontends, name)
        if hop is not None:
            rows.append(HopRow(label, float(hop["p50_ms"]), float(hop["p99_ms"]),
                               int(hop["count"]), f"frontend {name} hop"))
    return rows


def _backend_rows(backends: list[dict[str, Any]]) -> list[HopRow]:
    """One row per backend histogram, merged over every backend and poll."""
    pooled = merge_snapshots(backends)
    rows: list[HopRow] = []
    for label, metric in BACKEND_METRICS:
        summary = _latency(pooled, metric)
        if summary is None:
            continue
        margin = metric == "slack"  # a margin's bad tail is its low end
        rows.append(HopRow(label, float(summary["p50_ms"]),
                           float(summary["p1_ms" if margin else "p99_ms"]), int(summary["count"]),
                           "backends' per-batch histograms in the measure window, pooled"
                           + ("; the p99 column is the 1st percentile" if margin else "")))
    return rows


def scheduler_cpu_ms_per_1000(cpu: dict[str, Any] | None) -> float | None:
    """CPU milliseconds the scheduler processes (shards and rank) spent per 1,000 requests."""
    if not cpu:
        return None
    per_request = cpu.get("per_request_us", {})
    used = [us for name, us in per_request.items()
            if name == "rank" or name.startswith("shard")]
    return round(sum(used), 1) if used else None  # us per request == ms per 1,000 requests


def format_table(rows: list[HopRow], scheduler_cpu: float | None = None) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:8.3f}"

    width = max((len(r.hop) for r in rows), default=10)
    lines = [f"{'hop (margins: p1 in the p99 column)':<{width}}  {'p50 ms':>8}  {'p99 ms':>8}"]
    lines.extend(f"{r.hop:<{width}}  {cell(r.p50_ms)}  {cell(r.p99_ms)}" for r in rows)
    if scheduler_cpu is not None:
        lines.append(f"scheduler CPU per 1,000 requests: {scheduler_cpu:.1f} ms")
    return "\n".join(lines)
