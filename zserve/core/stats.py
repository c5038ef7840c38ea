"""Counters and latency histograms with one schema, for every role's statistics.

A role keeps one :class:`Stats`: integer counters by name and a :class:`Histogram` per latency
metric. Histograms have *fixed* bucket bounds chosen per metric from :data:`BOUNDS` (log-spaced,
``BUCKETS_PER_DECADE`` per decade, so a quantile read from them is within ~6% of the exact one),
which makes them

- cheap on the hot path: ``observe`` is one C bisection and a few additions, no allocation;
- mergeable: two histograms of one metric add bucket by bucket, across processes (the load
  generator pools every backend) and across windows (a poller adding up reset snapshots);
- exportable: a Prometheus exporter reads the bounds, cumulative bucket counts, sum and count as
  they are (``le`` labels are the bounds).

``Stats.snapshot()`` is the one schema every role puts in its ``StatsReply``::

    {"counters": {name: int},
     "latency": {metric: {"count", "mean_ms", "min_ms", "p1_ms", "p50_ms", "p90_ms", "p99_ms",
                          "max_ms"}},
     "histograms": {metric: {"bounds", "buckets", "counts", "count", "sum_s", "min_s", "max_s"}}}

Every role's ``counters`` also carry ``auth_failed``: failed CURVE handshakes on its server
sockets in the window (``zserve.runtime.keys.count_auth_failed``; 0 without ``[security]``).

``latency`` is the human summary (milliseconds); ``histograms`` the mergeable data (seconds;
``bounds`` names an entry of :data:`BOUNDS`, ``buckets``/``counts`` list the non-empty buckets
sparsely). :func:`merge_snapshots` adds snapshots of several processes or windows.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from typing import Any

MS_PER_S = 1e3
BUCKETS_PER_DECADE = 20
SMALLEST_BOUND_S = 1e-6  # below a microsecond, latencies are not resolved
LARGEST_BOUND_S = 100.0
QUANTILES = (("p1_ms", 0.01), ("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99))


def _log_bounds(smallest: float, largest: float, per_decade: int) -> tuple[float, ...]:
    decades = round(math.log10(largest / smallest))
    return tuple(smallest * 10 ** (i / per_decade) for i in range(decades * per_decade + 1))


_POSITIVE = _log_bounds(SMALLEST_BOUND_S, LARGEST_BOUND_S, BUCKETS_PER_DECADE)

BOUNDS: dict[str, tuple[float, ...]] = {
    # Delays (never negative): 1 us .. 100 s.
    "delay": _POSITIVE,
    # Margins and cross-process differences, which may be negative: -100 s .. 100 s, with 0 a
    # bound so that "how many were late" is exact.
    "signed": (*(-b for b in reversed(_POSITIVE)), 0.0, *_POSITIVE),
}
"""Bucket upper bounds in seconds by scheme name. Bucket ``i`` holds values in
``[bounds[i-1], bounds[i])``; bucket 0 is everything below ``bounds[0]`` and the last bucket
everything from ``bounds[-1]`` on."""


class Histogram:
    """One latency metric: counts per fixed bucket, plus exact count, sum, min and max."""

    __slots__ = ("_bounds", "count", "counts", "max", "min", "scheme", "total")

    def __init__(self, scheme: str = "delay") -> None:
        self.scheme = scheme
        self._bounds = BOUNDS[scheme]
        self.counts = [0] * (len(self._bounds) + 1)
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    def observe(self, value_s: float) -> None:
        """Record one value in seconds."""
        self.counts[bisect_right(self._bounds, value_s)] += 1
        self.count += 1
        self.total += value_s
        # conditional expressions, not min()/max() calls: this is the hot path
        self.min = value_s if value_s < self.min else self.min
        self.max = value_s if value_s > self.max else self.max

    def merge(self, other: Histogram) -> None:
        """Add ``other`` (same scheme) into this histogram."""
        if other.scheme != self.scheme:
            raise ValueError(f"cannot merge a {other.scheme!r} histogram into {self.scheme!r}")
        counts = self.counts
        for index, n in enumerate(other.counts):
            if n:
                counts[index] += n
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def reset(self) -> None:
        self.counts = [0] * len(self.counts)
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    def count_below(self, bound_s: float) -> int:
        """How many values were below ``bound_s``, which must be one of the bounds."""
        index = self._bounds.index(bound_s)
        return sum(self.counts[: index + 1])

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1) in seconds, interpolated linearly inside its bucket and
        clamped to the observed min and max (so q = 0 and q = 1 are exact); nan when empty."""
        if not self.count:
            return math.nan
        target = q * self.count
        seen = 0
        bounds = self._bounds
        for index, n in enumerate(self.counts):
            if n and seen + n >= target:
                low = bounds[index - 1] if index else -math.inf
                high = bounds[index] if index < len(bounds) else math.inf
                low = max(low, self.min)
                high = min(high, self.max)
                return low + (high - low) * max(0.0, target - seen) / n
            seen += n
        return self.max

    def summary(self) -> dict[str, float | int]:
        """The human summary in milliseconds (see the module docstring); ``{"count": 0}`` when
        empty."""
        if not self.count:
            return {"count": 0}
        out: dict[str, float | int] = {
            "count": self.count,
            "mean_ms": self.total / self.count * MS_PER_S,
            "min_ms": self.min * MS_PER_S,
        }
        for key, q in QUANTILES:
            out[key] = self.quantile(q) * MS_PER_S
        out["max_ms"] = self.max * MS_PER_S
        return out

    def to_wire(self) -> dict[str, Any]:
        """The mergeable form (msgpack- and JSON-safe), non-empty buckets only."""
        buckets = [i for i, n in enumerate(self.counts) if n]
        return {
            "bounds": self.scheme,
            "buckets": buckets,
            "counts": [self.counts[i] for i in buckets],
            "count": self.count,
            "sum_s": self.total,
            "min_s": self.min if self.count else None,
            "max_s": self.max if self.count else None,
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Histogram:
        hist = cls(str(wire["bounds"]))
        for index, n in zip(wire["buckets"], wire["counts"], strict=True):
            hist.counts[int(index)] += int(n)
        hist.count = int(wire["count"])
        hist.total = float(wire["sum_s"])
        if hist.count:
            hist.min = float(wire["min_s"])
            hist.max = float(wire["max_s"])
        return hist


class Stats:
    """A role's counters and histograms. Hot paths may bump ``counters[name]`` directly and
    call ``histograms[name].observe(value_s)``."""

    __slots__ = ("counters", "histograms")

    def __init__(self, counters: Iterable[str] = (),
                 histograms: Mapping[str, str] | None = None) -> None:
        """``counters``: the counter names (all start at 0); ``histograms``: metric name ->
        bounds scheme (a key of :data:`BOUNDS`)."""
        self.counters: dict[str, int] = dict.fromkeys(counters, 0)
        self.histograms: dict[str, Histogram] = {
            name: Histogram(scheme) for name, scheme in (histograms or {}).items()
        }

    def observe(self, metric: str, value_s: float) -> None:
        self.histograms[metric].observe(value_s)

    def snapshot(self, reset: bool = False) -> dict[str, Any]:
        """The schema of the module docstring; ``reset`` zeroes everything afterwards (the
        next snapshot covers a new window)."""
        out = {
            "counters": dict(self.counters),
            "latency": {name: h.summary() for name, h in self.histograms.items()},
            "histograms": {name: h.to_wire() for name, h in self.histograms.items()},
        }
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        for key in self.counters:
            self.counters[key] = 0
        for hist in self.histograms.values():
            hist.reset()


def merge_snapshots(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One snapshot from several (processes of one role, or successive windows): counters
    add, histograms merge, summaries are recomputed from the merged histograms."""
    counters: dict[str, int] = {}
    merged: dict[str, Histogram] = {}
    for snap in snapshots:
        for name, value in snap.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + int(value)
        for name, wire in snap.get("histograms", {}).items():
            hist = Histogram.from_wire(wire)
            if name in merged:
                merged[name].merge(hist)
            else:
                merged[name] = hist
    return {
        "counters": counters,
        "latency": {name: h.summary() for name, h in merged.items()},
        "histograms": {name: h.to_wire() for name, h in merged.items()},
    }


__all__ = ["BOUNDS", "Histogram", "Stats", "merge_snapshots"]
