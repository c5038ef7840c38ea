"""The per-hop breakdown of a live run (zserve.loadgen.breakdown), from processes' stats."""

from __future__ import annotations

import numpy as np
import pytest

from zserve.backends.follower import BACKEND_HISTOGRAMS
from zserve.core.stats import Stats
from zserve.loadgen import breakdown


def _frontend(**hops: tuple[float, float, int]) -> dict[str, object]:
    return {"latency": {name: {"p50_ms": p50, "p99_ms": p99, "count": n}
                        for name, (p50, p99, n) in hops.items()}}


def _backend(**values_s: list[float]) -> dict[str, object]:
    """A backend's StatsReply payload (its ``zserve.core.stats`` snapshot) after these batches."""
    stats = Stats(histograms=BACKEND_HISTOGRAMS)
    for metric, values in values_s.items():
        for value in values:
            stats.observe(metric, value)
    return stats.snapshot()


def test_rows_follow_the_request_and_pool_backends() -> None:
    frontends = [_frontend(admit_to_answer=(20.0, 24.0, 100), queueing=(8.0, 12.0, 90),
                           overhead=(9.0, 13.0, 90)),
                 _frontend(admit_to_answer=(30.0, 40.0, 5))]  # fewer samples: not chosen
    shards = [{"latency": {"meta_delay": {"count": 10, "p50_ms": 0.2, "p99_ms": 0.9},
                           "grant_slack": {"count": 10, "p1_ms": -0.5, "p50_ms": 1.0}}}]
    rank = {"latency": {"candidate_slack": {"count": 10, "p1_ms": -1.0, "p50_ms": 1.5,
                                            "min_ms": -2.0}}}
    # Two backends' windows: the quantiles are over all batches together, not per backend
    # (the slower backend's own median would be 3 ms; the faster's own p99 1 ms).
    backends = [_backend(fetch=[0.001] * 90, slack=[0.002] * 50),
                _backend(fetch=[0.003] * 10, slack=[0.0001] * 2 + [0.002] * 48)]
    client = np.full(100, 21.5)
    rows = breakdown.hop_breakdown(client_latency_ms=client, frontends=frontends,
                                   shards=shards, rank=rank, backends=backends)
    by_hop = {r.hop: r for r in rows}
    first = rows[0]
    assert first.hop.startswith("client <-> frontend")
    assert first.p50_ms == pytest.approx(1.5) and first.p99_ms == pytest.approx(-2.5)
    assert by_hop["frontend tick + hop -> shard"].p99_ms == pytest.approx(0.9)
    fetch = by_hop["input fetch round trip"]
    assert fetch.samples == 100
    # within a histogram bucket (12% wide) of the pooled quantiles
    assert fetch.p50_ms == pytest.approx(1.0, rel=0.13)
    assert fetch.p99_ms == pytest.approx(3.0, rel=0.06)
    slack = by_hop["plan arrives before exec_at (slack, margin)"]
    assert slack.p99_ms == pytest.approx(0.1, abs=0.05)  # the margin's low tail (p1)
    assert by_hop["overhead: answer - admission - execution"].p50_ms == 9.0
    order = [r.hop for r in rows]
    assert order.index("input fetch round trip") > order.index(
        "admission -> batch start (deferral by design + control hops)")


def test_missing_sources_leave_rows_out_and_cpu_sums_scheduler() -> None:
    rows = breakdown.hop_breakdown(client_latency_ms=np.array([]), frontends=[], shards=[],
                                   rank=None, backends=[])
    assert rows == []
    cpu = {"per_request_us": {"frontend-0": 300.0, "rank": 120.5, "shard-0": 80.0,
                              "shard-1": 10.0, "loadgen": 99.0}}
    assert breakdown.scheduler_cpu_ms_per_1000(cpu) == pytest.approx(210.5)
    assert breakdown.scheduler_cpu_ms_per_1000(None) is None
    table = breakdown.format_table(
        [breakdown.HopRow("x", 1.0, None, 1, "s")], scheduler_cpu=210.5)
    assert "210.5 ms" in table and "-" in table.splitlines()[1]
