"""Allowances that follow what is measured: a hop's latency kept live, planned with at its tail.

The scheduler plans every batch with allowances for what happens outside its own clock: plan
delivery and the input fetch (``d_ctrl``), its timer's and the grant hop's lateness (``jitter``),
and the frontend keeps one for the reply path (``reply``). Hand-set, they must cover the worst
host a cluster file may meet; a quiet host then pays for a noisy one (on ResNet50, 9 ms of
allowances leave 0.81 of the paper's bound, 2 ms 0.968). :class:`LearnedAllowance` replaces one
such constant by the high quantile of what its hop took lately:

- **Samples** (seconds, clipped at 0) go into one :class:`zserve.core.stats.Histogram` per
  ``SLICE_S``; the window is the last ``SLICES`` slices (``WINDOW_S``), so one burst of slow
  samples counts for at most ``WINDOW_S`` and old quiet samples cannot hide a new noisy period
  for longer either.
- **Target** = the window's quantile (the rule's: ``QUANTILE``, p95, unless it says
  ``TAIL_QUANTILE``, p99) + the rule's ``margin_s``, clamped to
  ``[floor_s, cap_s]``. Recomputed at most every ``RECOMPUTE_S``, and only once the window holds
  ``MIN_SAMPLES``: until then the allowance keeps its start value.
- **Fast increase, slow decrease.** A target above the allowance is taken at once; one below it
  is approached by at most ``DECREASE_FRACTION_PER_S`` of the allowance per second (3 ms -> 1
  ms takes about 11 s). A transient stall brings slow samples, so it can only raise the
  allowance; a quiet stretch lowers it slowly, and the next noisy stretch raises it in
  ``RECOMPUTE_S``.

The start value and the cap are the configured value (``[scheduler] d_ctrl_ms`` ...): learning
only ever narrows an allowance the cluster file already deemed safe (docs/design-notes.md,
"Learned allowances"). Pure logic: the clock is passed in, nothing here does I/O, so the
scheduler, the frontend and the simulator host the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zserve.core.stats import Histogram

# The quantile a hop's allowance plans with. The three allowances add up on a request's path
# (plan + fetch, timer, reply), and the tails of independent hops rarely meet: on this VM's quiet
# hops the sum of the per-hop p95s (+ margins) is exceeded by 0.35% of draws, the sum of the
# p99s by 0.03%, while every 0.5 ms of allowance costs the ResNet50 twin about 1.5% of its
# goodput (docs/performance.md, "Learned allowances"). The inputs' overrun of d_ctrl, which the
# jitter's slack absorbs, keeps the p99 (``TAIL_QUANTILE``), so d_ctrl + jitter still cover the
# fetch's p99 together.
QUANTILE = 0.95
TAIL_QUANTILE = 0.99
SLICE_S = 2.0
SLICES = 5
WINDOW_S = SLICE_S * SLICES
MIN_SAMPLES = 50
RECOMPUTE_S = 0.25
DECREASE_FRACTION_PER_S = 0.1
DECREASE_STEP_MAX_S = 1.0
# Floors: a scheduler timer is precise to ~0.1 ms and a quiet hop's p99 is 0.2-1 ms; below these
# the allowance would cover nothing but the measurement's own noise.
FLOOR_D_CTRL_S = 0.3e-3
FLOOR_JITTER_S = 0.3e-3
FLOOR_REPLY_S = 0.5e-3
# Margins added to the quantile: the reply's covers the frontend -> client hop, which the
# frontend cannot time (it sees the batch's end and its own answer, not the client's receipt).
MARGIN_D_CTRL_S = 0.1e-3
MARGIN_JITTER_S = 0.1e-3
MARGIN_REPLY_S = 0.3e-3

LEARNED = "learned"
FIXED = "fixed"
ALLOWANCE_MODES = (LEARNED, FIXED)


@dataclass(frozen=True, slots=True)
class AllowanceRule:
    """One allowance's bounds: it starts at ``start_s``, stays in ``[floor_s, cap_s]`` and plans
    with the window's quantile plus ``margin_s``."""

    start_s: float
    floor_s: float
    cap_s: float
    margin_s: float = 0.0
    quantile: float = QUANTILE

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor_s <= self.cap_s or not math.isfinite(self.cap_s):
            raise ValueError(f"allowance rule: need 0 <= floor <= cap < inf, got "
                             f"floor {self.floor_s} cap {self.cap_s}")
        if not 0.5 <= self.quantile < 1.0:
            raise ValueError(f"allowance rule: need 0.5 <= quantile < 1, got {self.quantile}")

    @classmethod
    def from_configured(cls, configured_s: float, floor_s: float, margin_s: float = 0.0,
                        quantile: float = QUANTILE) -> AllowanceRule:
        """The configured value as the start and the cap; a configured value under the floor
        is kept as it is (the floor never raises what the file asked for)."""
        return cls(start_s=configured_s, floor_s=min(floor_s, configured_s), cap_s=configured_s,
                   margin_s=margin_s, quantile=quantile)


class LearnedAllowance:
    """One hop's allowance, learned from its samples; see the module docstring."""

    __slots__ = ("_recomputed_at", "_slice_start", "_slices", "_updated_at", "rule", "tail_s",
                 "target_s", "value_s")

    def __init__(self, rule: AllowanceRule, now: float) -> None:
        self.rule = rule
        self.value_s = rule.start_s
        self.target_s = math.nan  # the last target computed (nan: too few samples yet)
        self.tail_s = math.nan  # the window's TAIL_QUANTILE + margin at that recompute
        self._slices = [Histogram("delay") for _ in range(SLICES)]
        self._slice_start = now  # when the newest slice (index 0) began
        self._recomputed_at = -math.inf
        self._updated_at = now

    def observe(self, now: float, sample_s: float) -> None:
        """One hop's latency (negative samples count as 0: the hop took no allowance)."""
        self._roll(now)
        self._slices[0].observe(sample_s if sample_s > 0.0 else 0.0)

    def value(self, now: float) -> float:
        """The allowance to plan with at ``now``."""
        if now - self._recomputed_at >= RECOMPUTE_S:
            self._recompute(now)
        return self.value_s

    def samples(self, now: float) -> int:
        """Samples in the window at ``now``."""
        self._roll(now)
        return sum(h.count for h in self._slices)

    def quantile_s(self, now: float, q: float = TAIL_QUANTILE) -> float:
        """The window's ``q`` quantile (nan when empty)."""
        self._roll(now)
        return self._merged().quantile(q)

    def _merged(self) -> Histogram:
        """The window's slices as one histogram."""
        merged = Histogram("delay")
        for h in self._slices:
            if h.count:
                merged.merge(h)
        return merged

    def _roll(self, now: float) -> None:
        """Start new slices for the time past since the newest began (oldest fall out)."""
        passed = int((now - self._slice_start) // SLICE_S)
        if passed <= 0:
            return
        for _ in range(min(passed, SLICES)):
            self._slices.pop()
            self._slices.insert(0, Histogram("delay"))
        self._slice_start += passed * SLICE_S

    def _recompute(self, now: float) -> None:
        # an allowance read rarely (an idle model) decreases as if read every second at most
        elapsed = min(max(0.0, now - self._updated_at), DECREASE_STEP_MAX_S)
        self._recomputed_at = self._updated_at = now
        if self.samples(now) < MIN_SAMPLES:
            return
        rule = self.rule
        merged = self._merged()
        self.tail_s = merged.quantile(TAIL_QUANTILE) + rule.margin_s
        target = min(rule.cap_s, max(rule.floor_s, merged.quantile(rule.quantile) + rule.margin_s))
        self.target_s = target
        if target >= self.value_s:
            self.value_s = target  # fast increase
        else:  # slow decrease
            step = self.value_s * min(1.0, DECREASE_FRACTION_PER_S * elapsed)
            self.value_s = max(target, self.value_s - step)

    def summary(self, now: float) -> dict[str, Any]:
        """Milliseconds, for a role's stats: the value planned with, the target, the window's
        median, p99 and the quantile planned with, its sample count, and the bounds."""
        q, median = self.quantile_s(now, TAIL_QUANTILE), self.quantile_s(now, 0.5)
        planned = self.quantile_s(now, self.rule.quantile)
        return {"value_ms": round(self.value_s * 1e3, 4),
                "target_ms": None if math.isnan(self.target_s) else round(self.target_s * 1e3, 4),
                "p50_ms": None if math.isnan(median) else round(median * 1e3, 4),
                "p99_ms": None if math.isnan(q) else round(q * 1e3, 4),
                "quantile": self.rule.quantile,
                "quantile_ms": None if math.isnan(planned) else round(planned * 1e3, 4),
                "samples": self.samples(now), "floor_ms": self.rule.floor_s * 1e3,
                "cap_ms": self.rule.cap_s * 1e3}


__all__ = [
    "ALLOWANCE_MODES", "FIXED", "FLOOR_D_CTRL_S", "FLOOR_JITTER_S", "FLOOR_REPLY_S", "LEARNED",
    "MARGIN_D_CTRL_S", "MARGIN_JITTER_S", "MARGIN_REPLY_S", "QUANTILE", "SLICE_S", "TAIL_QUANTILE",
    "WINDOW_S", "AllowanceRule", "LearnedAllowance",
]
