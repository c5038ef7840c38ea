"""The autoscaling advice (Symphony v2 section 4.4) as a pure core: from a cluster's (or a
sub-cluster's) bad rate and GPU idle fraction over a window, the number of backends it should
have. No I/O and no clock: the host passes ``now`` in, feeds :meth:`Autoscaler.observe` one
:class:`Signals` per interval, and reads :meth:`Autoscaler.advise`'s :class:`Advice` back (the
simulator and ``zserve up`` act on it; the frontends export it as Prometheus gauges).

Deferred scheduling gives the two signals Symphony names: under overload the bad rate r is about
(o - p) / o, under underload the idle fraction f is about (p - o) / p (o offered, p the peak
goodput). One estimate covers both sides. The busy GPUs N (1 - f) carry the good share 1 - r of
the offered load, so the offered load needs N (1 - f) / (1 - r) busy GPUs, and at the busy
fraction the cluster has at its peak (1 - ``idle_floor``; measured, the idle fraction left at
the 1%-bad goodput) it needs

    needed = N (1 - f) / ((1 - r) (1 - idle_floor) (1 - headroom))

backends, which is Symphony's N + N r / (1 - r) when the GPUs are saturated (f = idle_floor,
headroom 0) and N - N f' (f' the idle fraction beyond the floor) when nothing is bad. The busy
GPU-seconds per second do not depend on N, so the estimate holds across changes of N. A busy
fraction above the peak's counts as the peak's: on scarce GPUs the rank's rescue fills them with
smaller batches that still meet their SLOs (10 ResNet50s at 0.5x of the 24-GPU peak on 12-13
GPUs: 100% busy), which is not load.

Hysteresis (docs/performance.md, "Autoscaling", says how the values were chosen):

- **Add** when the bad rate over the last ``up_window_s`` exceeds ``add_bad_rate``: to
  ``ceil(needed)`` at once (``headroom`` asks for that much more). A busy fraction alone never
  adds: on scarce GPUs the rank's rescue fills them with smaller batches that still meet their
  SLOs, so the GPUs run near 100% busy while nothing is bad (10 ResNet50s at 0.48x of the
  24-GPU peak: 13 GPUs 100% busy, 0 bad); it would add without end. The window counts only
  what was measured after the last change settled (``settle_s``: a new backend starts and
  warms), so a burst is not answered twice.
- **Release** only when the idle fraction over the last ``down_window_s`` exceeds ``idle_floor
  + release_margin`` (a dead band between the two thresholds) and ``ceil(needed)`` is below N
  in every up-window-long stretch of that window (the release goes to the busiest one's need),
  and no change came within ``down_hold_s`` (the time a release waits after any change: a release
  right after an add is how autoscalers oscillate), at most ``max_release_fraction`` of N at a
  time.
- Never outside ``[min_backends, max_backends]``.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

# Advice reasons (the gauge's label and `zserve status`'s column).
HOLD = "hold"
ADD_BAD = "add: bad rate"
RELEASE_IDLE = "release: idle"
BOUND = "bound"
# The estimate rounds up from this fraction of a backend: ceil(needed - slack) keeps a needed
# 12.02 at 12 (sampling noise), not 13.
NEEDED_ROUNDING_SLACK = 0.05


class AutoscalePolicyError(ValueError):
    """An autoscale policy whose values contradict each other (one line, naming the value)."""


@dataclass(frozen=True)
class AutoscalePolicy:
    """The thresholds and windows of :class:`Autoscaler` (module docstring)."""

    min_backends: int = 1
    max_backends: int = 64
    up_window_s: float = 10.0
    down_window_s: float = 60.0
    add_bad_rate: float = 0.01
    idle_floor: float = 0.03
    release_margin: float = 0.05
    headroom: float = 0.0
    settle_s: float = 5.0
    down_hold_s: float = 60.0
    max_release_fraction: float = 0.5
    min_requests: int = 200  # a window with fewer requests says nothing about its bad rate

    def __post_init__(self) -> None:
        if not 1 <= self.min_backends <= self.max_backends:
            raise AutoscalePolicyError(
                f"min_backends {self.min_backends} must be >= 1 and <= max_backends "
                f"{self.max_backends}")
        for name in ("add_bad_rate", "idle_floor", "release_margin", "headroom"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise AutoscalePolicyError(f"{name} {value} must be in [0, 1)")
        if not 0.0 < self.max_release_fraction <= 1.0:
            raise AutoscalePolicyError(
                f"max_release_fraction {self.max_release_fraction} must be in (0, 1]")
        for name in ("up_window_s", "down_window_s"):
            if getattr(self, name) <= 0:
                raise AutoscalePolicyError(f"{name} must be > 0")
        if self.settle_s < 0 or self.down_hold_s < 0:
            raise AutoscalePolicyError("settle_s and down_hold_s must be >= 0")

    def scaled(self, factor: float) -> AutoscalePolicy:
        """The same policy with every duration times ``factor`` (a compressed day)."""
        return AutoscalePolicy(
            self.min_backends, self.max_backends, self.up_window_s * factor,
            self.down_window_s * factor, self.add_bad_rate, self.idle_floor,
            self.release_margin, self.headroom, self.settle_s * factor,
            self.down_hold_s * factor, self.max_release_fraction, self.min_requests)


@dataclass(frozen=True)
class Signals:
    """One interval's measurements: its length, the requests that ended in it (offered: every
    terminal answer, bad: those not answered with outputs within their SLO), the GPU-seconds the
    backends ran batches and the backends serving (their GPU-seconds of capacity: ``backends x
    duration_s``)."""

    duration_s: float
    offered: int
    bad: int
    busy_s: float
    backends: int


@dataclass(frozen=True)
class Advice:
    """What the cluster should have: ``backends`` (the target) and ``change`` (target minus the
    current count); the signals it came from over the up window (``bad_rate``) and the down
    window (``idle_fraction``), the estimate ``needed``, and the rule that fired."""

    backends: int
    change: int
    bad_rate: float
    idle_fraction: float
    needed: float
    reason: str


@dataclass
class _Window:
    """Sums over the samples since ``start``."""

    duration_s: float = 0.0
    offered: int = 0
    bad: int = 0
    busy_s: float = 0.0
    capacity_s: float = 0.0

    def add(self, s: Signals) -> None:
        self.duration_s += s.duration_s
        self.offered += s.offered
        self.bad += s.bad
        self.busy_s += s.busy_s
        self.capacity_s += s.backends * s.duration_s

    @property
    def bad_rate(self) -> float:
        return self.bad / self.offered if self.offered else 0.0

    @property
    def idle_fraction(self) -> float:
        return max(0.0, 1.0 - self.busy_s / self.capacity_s) if self.capacity_s > 0 else 0.0


class Autoscaler:
    """Advice for one (sub-)cluster; see the module docstring. ``backends`` is the current
    target (the count the host is to have, starting ones included)."""

    def __init__(self, policy: AutoscalePolicy, backends: int, now: float) -> None:
        self.policy = policy
        self.backends = min(max(backends, policy.min_backends), policy.max_backends)
        self.last_change_at = -math.inf  # none yet: the first release needs one full window
        self.changes: list[tuple[float, int]] = []  # (when, change) of every advised change
        self._samples: deque[tuple[float, Signals]] = deque()  # (end time, signals)
        self._first_start: float | None = None  # the first sample's start: measured since
        self.last = Advice(self.backends, 0, 0.0, 0.0, float(self.backends), HOLD)
        self.last_change: Advice | None = None  # the newest advice that changed the target

    def observe(self, now: float, signals: Signals) -> None:
        """One interval ending at ``now``."""
        self._samples.append((now, signals))
        if self._first_start is None:
            self._first_start = now - signals.duration_s
        horizon = now - max(self.policy.up_window_s, self.policy.down_window_s)
        while self._samples and self._samples[0][0] - self._samples[0][1].duration_s < horizon:
            self._samples.popleft()

    def _window(self, now: float, span_s: float) -> _Window:
        """The samples of the last ``span_s`` measured after the last change settled."""
        start = max(now - span_s, self.last_change_at + self.policy.settle_s)
        window = _Window()
        for end, s in self._samples:
            if end - s.duration_s >= start - 1e-9:
                window.add(s)
        return window

    def _peak_needed(self, now: float) -> float:
        """The most backends any up-window-long stretch of the down window needed: a release
        goes only as low as the busiest part of its window allows (Kubernetes' HPA takes the
        highest recommendation of its scale-down stabilization window alike)."""
        p = self.policy
        start = max(now - p.down_window_s, self.last_change_at + p.settle_s)
        chunks: dict[int, _Window] = {}
        for end, s in self._samples:
            if end - s.duration_s >= start - 1e-9:
                key = int((end - start - 1e-9) // p.up_window_s)
                chunks.setdefault(key, _Window()).add(s)
        return max((self._needed(w) for w in chunks.values() if w.duration_s > 0), default=0.0)

    def _needed(self, w: _Window) -> float:
        """Backends the window's load needs at the peak's busy fraction (with headroom)."""
        p = self.policy
        # Busier than the peak's busy fraction is the rescue filling scarce GPUs with smaller
        # batches, not load: capped there, an add is Symphony's N / (1 - r).
        busy_gpus = min(w.busy_s, w.capacity_s * (1.0 - p.idle_floor)) / w.duration_s
        return busy_gpus / ((1.0 - min(w.bad_rate, 0.99)) * (1.0 - p.idle_floor)
                            * (1.0 - p.headroom))

    def _down_window_full(self, now: float) -> bool:
        """Measured (and settled) for the whole down window. Not the samples' summed duration:
        a live host's intervals jitter (a stats round takes time), so the samples that start
        within the window fall short of it by up to one interval, every time."""
        p = self.policy
        if self._first_start is None:
            return False
        measured_from = max(self._first_start, self.last_change_at + p.settle_s)
        return now - measured_from >= p.down_window_s * 0.999

    def advise(self, now: float) -> Advice:
        """The advice now; a change is recorded as made (``backends`` moves to the target)."""
        p = self.policy
        up, down = self._window(now, p.up_window_s), self._window(now, p.down_window_s)
        n = self.backends
        target, reason, needed = n, HOLD, float(n)
        if up.duration_s >= 0.5 * p.up_window_s:
            needed = self._needed(up)
            want = math.ceil(needed - NEEDED_ROUNDING_SLACK)
            bad = up.offered >= p.min_requests and up.bad_rate > p.add_bad_rate
            if want > n and bad:
                target, reason = want, ADD_BAD
        if target == n and self._down_window_full(now):
            needed = self._peak_needed(now)
            want = max(math.ceil(needed - NEEDED_ROUNDING_SLACK),
                       n - math.floor(p.max_release_fraction * n))
            if (down.idle_fraction > p.idle_floor + p.release_margin and want < n
                    and now - self.last_change_at >= p.down_hold_s
                    and up.bad_rate <= p.add_bad_rate):
                target, reason = want, RELEASE_IDLE
        bounded = min(max(target, p.min_backends), p.max_backends)
        if bounded != target and reason != HOLD:
            reason = BOUND
        change = bounded - n
        idle = down.idle_fraction if down.duration_s > 0 else up.idle_fraction
        self.last = Advice(bounded, change, up.bad_rate, idle, needed, reason)
        if change:
            self.last_change = self.last
            self.backends = bounded
            self.last_change_at = now
            self.changes.append((now, change))
        return self.last


def direction_changes(changes: list[tuple[float, int]]) -> list[float]:
    """When the advised changes turned around (an add after a release or the reverse)."""
    turns = []
    for (_, before), (when, after) in itertools.pairwise(changes):
        if (before > 0) != (after > 0):
            turns.append(when)
    return turns


def most_turns_within(turns: list[float], span_s: float) -> int:
    """The most direction changes within any ``span_s`` (a sliding window over ``turns``)."""
    most, lo = 0, 0
    for hi, when in enumerate(turns):
        while turns[lo] <= when - span_s:
            lo += 1
        most = max(most, hi - lo + 1)
    return most


__all__ = ["ADD_BAD", "BOUND", "HOLD", "RELEASE_IDLE", "Advice", "AutoscalePolicy",
           "AutoscalePolicyError", "Autoscaler", "Signals", "direction_changes",
           "most_turns_within"]
