"""Rate schedules: the total offered rate of a run as a function of time.

A schedule is piecewise constant: a list of ``(duration_s, rate_rps)`` segments. Three builders:
``constant(rate, duration_s)``, ``steps([(duration_s, rate), ...])`` and ``from_trace(path)``
(a file of per-second rates, one per line; ``#`` comments; a line ``second,rate`` is accepted
too and only its last field is read).

Arrival processes live in ``zserve.loadgen.arrivals``: they generate gaps for a *constant* rate.
A schedule turns them into arrivals for a time-varying rate by time rescaling: generate the
arrivals of a unit-rate process in *operational time* and map each operational time ``u`` back to
the wall-clock ``t`` with ``Lambda(t) = u``, where ``Lambda(t)`` is the expected number of
arrivals by ``t``. For a Poisson process this is exact (a non-homogeneous Poisson process); for
constant and Gamma(k) gaps it keeps the dispersion of each segment while following its rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FloatArray = np.ndarray[Any, np.dtype[np.float64]]


@dataclass(frozen=True, slots=True)
class RateSchedule:
    """Piecewise-constant total rate: ``durations_s[i]`` seconds at ``rates_rps[i]``."""

    durations_s: tuple[float, ...]
    rates_rps: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.durations_s) != len(self.rates_rps) or not self.durations_s:
            raise ValueError("a schedule needs one rate per segment and at least one segment")
        for duration, rate in zip(self.durations_s, self.rates_rps, strict=True):
            if not (duration > 0 and math.isfinite(duration)):
                raise ValueError(f"segment duration must be positive and finite, got {duration}")
            if not (rate >= 0 and math.isfinite(rate)):
                raise ValueError(f"segment rate must be >= 0 and finite, got {rate}")

    # ------------------------------------------------------------------ shape

    @property
    def duration_s(self) -> float:
        return float(sum(self.durations_s))

    @property
    def expected_requests(self) -> float:
        return float(sum(d * r for d, r in zip(self.durations_s, self.rates_rps, strict=True)))

    @property
    def mean_rate_rps(self) -> float:
        return self.expected_requests / self.duration_s

    @property
    def peak_rate_rps(self) -> float:
        return max(self.rates_rps)

    @property
    def is_constant(self) -> bool:
        return len(set(self.rates_rps)) == 1

    @property
    def boundaries_s(self) -> FloatArray:
        """Segment start times and the end: ``len(segments) + 1`` values from 0."""
        return np.concatenate(([0.0], np.cumsum(self.durations_s)))

    def rate_at(self, t_s: float) -> float:
        """The rate in force at ``t_s`` (0 outside the schedule)."""
        if t_s < 0 or t_s >= self.duration_s:
            return 0.0
        index = int(np.searchsorted(self.boundaries_s, t_s, side="right")) - 1
        return self.rates_rps[index]

    # ------------------------------------------------------------------ transforms

    def scaled(self, factor: float) -> RateSchedule:
        """Every rate multiplied by ``factor`` (the shape is kept)."""
        if not (factor >= 0 and math.isfinite(factor)):
            raise ValueError(f"scale factor must be >= 0, got {factor}")
        return RateSchedule(self.durations_s, tuple(r * factor for r in self.rates_rps))

    def with_mean_rate(self, rate_rps: float) -> RateSchedule:
        """The same shape scaled so that its mean rate is ``rate_rps``."""
        mean = self.mean_rate_rps
        if mean <= 0:
            raise ValueError("cannot rescale a schedule whose rate is zero everywhere")
        return self.scaled(rate_rps / mean)

    def padded(self, before_s: float, after_s: float) -> RateSchedule:
        """Warmup and cooldown: ``before_s`` at the first rate, ``after_s`` at the last."""
        durations = list(self.durations_s)
        rates = list(self.rates_rps)
        if before_s > 0:
            durations.insert(0, before_s)
            rates.insert(0, self.rates_rps[0])
        if after_s > 0:
            durations.append(after_s)
            rates.append(self.rates_rps[-1])
        return RateSchedule(tuple(durations), tuple(rates))

    # ------------------------------------------------------------------ time rescaling

    def cumulative(self, t_s: FloatArray | float) -> FloatArray:
        """Lambda(t): the expected number of arrivals in [0, t] (clamped to the schedule)."""
        bounds = self.boundaries_s
        rates = np.asarray(self.rates_rps, dtype=np.float64)
        at_bounds = np.concatenate(([0.0], np.cumsum(rates * np.diff(bounds))))
        t = np.clip(np.asarray(t_s, dtype=np.float64), 0.0, bounds[-1])
        seg = np.clip(np.searchsorted(bounds, t, side="right") - 1, 0, len(rates) - 1)
        return np.asarray(at_bounds[seg] + rates[seg] * (t - bounds[seg]), dtype=np.float64)

    def warp(self, operational: FloatArray) -> FloatArray:
        """Map unit-rate operational times ``u`` to wall times ``t`` with ``Lambda(t) = u``.

        Times past the schedule's total expected count are dropped (the run is over); zero-rate
        segments are skipped (no arrival lands inside one).
        """
        u = np.asarray(operational, dtype=np.float64)
        bounds = self.boundaries_s
        rates = np.asarray(self.rates_rps, dtype=np.float64)
        at_bounds = np.concatenate(([0.0], np.cumsum(rates * np.diff(bounds))))
        u = u[(u >= 0) & (u < at_bounds[-1])]
        # The segment of u: the last one whose start count is <= u among segments with rate > 0
        # (a zero-rate segment has equal start and end counts, so side="right" skips it).
        seg = np.searchsorted(at_bounds, u, side="right") - 1
        seg = np.clip(seg, 0, len(rates) - 1)
        return np.asarray(bounds[seg] + (u - at_bounds[seg]) / rates[seg], dtype=np.float64)


# ---------------------------------------------------------------------- builders


def constant(rate_rps: float, duration_s: float) -> RateSchedule:
    return RateSchedule((float(duration_s),), (float(rate_rps),))


def steps(segments: Iterable[tuple[float, float]]) -> RateSchedule:
    """``[(duration_s, rate_rps), ...]`` in order."""
    pairs = [(float(d), float(r)) for d, r in segments]
    if not pairs:
        raise ValueError("a step schedule needs at least one (duration_s, rate_rps) step")
    return RateSchedule(tuple(d for d, _ in pairs), tuple(r for _, r in pairs))


def from_rates_per_second(rates_rps: Sequence[float], *, scale: float = 1.0) -> RateSchedule:
    """One-second segments, ``scale`` times the given rates."""
    if not rates_rps:
        raise ValueError("a trace needs at least one per-second rate")
    return RateSchedule(tuple(1.0 for _ in rates_rps), tuple(float(r) * scale for r in rates_rps))


def parse_trace(text: str) -> list[float]:
    """Per-second rates from a trace file's text (see the module docstring for the format)."""
    rates: list[float] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [f for f in line.replace(",", " ").split() if f]
        if not any(_is_number(f) for f in fields):
            continue  # a CSV header line such as "second,rate"
        if not _is_number(fields[-1]):
            raise ValueError(f"trace line {lineno}: not a rate: {raw!r}")
        rate = float(fields[-1])
        if not (rate >= 0 and math.isfinite(rate)):
            raise ValueError(f"trace line {lineno}: rate must be >= 0, got {rate}")
        rates.append(rate)
    return rates


def from_trace(path: str | Path, *, scale: float = 1.0) -> RateSchedule:
    """A schedule from a file of per-second rates."""
    return from_rates_per_second(parse_trace(Path(path).read_text()), scale=scale)


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True
