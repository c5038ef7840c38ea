"""zserve.core.stats: one schema for counters and latency histograms, mergeable, exact at the
ends."""

from __future__ import annotations

import itertools
import json
import math

import msgpack
import numpy as np
import pytest

from zserve.core.stats import BOUNDS, Histogram, Stats, merge_snapshots


def _relative_error(estimate: float, exact: float) -> float:
    return abs(estimate - exact) / abs(exact)


def test_quantiles_track_numpy_within_a_bucket() -> None:
    rng = np.random.default_rng(1)
    values = rng.lognormal(mean=math.log(2e-3), sigma=0.8, size=20_000)
    hist = Histogram("delay")
    for v in values:
        hist.observe(float(v))
    for q in (0.01, 0.5, 0.9, 0.99):
        # 20 buckets a decade: a bucket spans 12%; interpolation stays well inside it
        assert _relative_error(hist.quantile(q), float(np.quantile(values, q))) < 0.06
    assert hist.quantile(0.0) == values.min() and hist.quantile(1.0) == values.max()
    summary = hist.summary()
    assert summary["count"] == values.size
    assert summary["max_ms"] == pytest.approx(values.max() * 1e3)
    assert summary["mean_ms"] == pytest.approx(values.mean() * 1e3)


def test_signed_histogram_counts_the_late_exactly() -> None:
    hist = Histogram("signed")
    for v in (-2e-3, -1e-7, 0.0, 5e-4, 3e-3):
        hist.observe(v)
    assert hist.count_below(0.0) == 2
    assert hist.quantile(0.0) == -2e-3
    assert hist.summary()["p1_ms"] < 0


def test_merge_equals_one_histogram_of_everything() -> None:
    rng = np.random.default_rng(2)
    a_values, b_values = rng.exponential(1e-3, 500), rng.exponential(5e-3, 700)
    a, b, both = Histogram(), Histogram(), Histogram()
    for v in a_values:
        a.observe(float(v))
        both.observe(float(v))
    for v in b_values:
        b.observe(float(v))
        both.observe(float(v))
    a.merge(b)
    assert a.counts == both.counts and a.count == both.count
    assert a.min == both.min and a.max == both.max
    assert a.total == pytest.approx(both.total)
    with pytest.raises(ValueError, match="cannot merge"):
        a.merge(Histogram("signed"))


def test_snapshot_survives_the_wire_and_merges_across_processes_and_windows() -> None:
    first, second = Stats(["sent"], {"hop": "delay"}), Stats(["sent"], {"hop": "delay"})
    first.counters["sent"] += 3
    first.observe("hop", 1e-3)
    second.counters["sent"] += 2
    second.observe("hop", 4e-3)
    window_one = first.snapshot(reset=True)
    assert first.counters["sent"] == 0 and first.histograms["hop"].count == 0
    first.observe("hop", 2e-3)
    window_two = first.snapshot()
    # what a StatsReply carries: msgpack on the wire, JSON in reports
    wires = [msgpack.unpackb(msgpack.packb(s)) for s in (window_one, window_two)]
    wires.append(json.loads(json.dumps(second.snapshot())))
    merged = merge_snapshots(wires)
    assert merged["counters"] == {"sent": 5}
    assert merged["latency"]["hop"]["count"] == 3
    assert merged["latency"]["hop"]["min_ms"] == pytest.approx(1.0)
    assert merged["latency"]["hop"]["max_ms"] == pytest.approx(4.0)
    assert merged["latency"]["hop"]["p50_ms"] == pytest.approx(2.0, rel=0.06)


def test_empty_histograms_summarize_as_count_zero() -> None:
    snap = Stats([], {"hop": "signed"}).snapshot()
    assert snap["latency"]["hop"] == {"count": 0}
    assert Histogram.from_wire(snap["histograms"]["hop"]).count == 0
    assert math.isnan(Histogram().quantile(0.5))


def test_bounds_are_sorted_and_fine_enough() -> None:
    for bounds in BOUNDS.values():
        assert list(bounds) == sorted(bounds)
        positive = [b for b in bounds if b > 0]
        assert max(hi / lo for lo, hi in itertools.pairwise(positive)) < 1.13

