"""Analytic batch-size and throughput bounds (DESIGN section 3; Symphony section 3.3, Table 2).

One model on N GPUs with uniform arrivals:

- staggered (coordinated) execution: worst queueing delay l(b)/N, so ``(1 + 1/N) l(b) <= SLO``:
  ``b = floor((SLO/(1 + 1/N) - beta)/alpha)``, throughput ``N*b/l(b)``;
- uncoordinated (Nexus-like): worst queueing delay l(b), so ``2 l(b) <= SLO``:
  ``b = floor((SLO/2 - beta)/alpha)``.

For a mix of models (:func:`staggered_bound_rps`) each model i with rate r_i needs
``n_i = r_i l(b_i)/b_i`` GPUs, with b_i the largest batch satisfying the staggered rule
``l(b) + b/r_i <= budget_i`` (the same inequality: with n_i GPUs the worst queueing delay
l(b)/n_i equals b/r_i). The bound is the largest total rate with ``sum n_i <= N``, found by
bisection. For one model it reproduces the closed form above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zserve.config.profiles import LatencyProfile
from zserve.scheduler.policy import largest_batch_at_rate


def staggered_batch(alpha_ms: float, beta_ms: float, slo_ms: float, gpus: int) -> int:
    return max(0, math.floor((slo_ms / (1 + 1 / gpus) - beta_ms) / alpha_ms))


def uncoordinated_batch(alpha_ms: float, beta_ms: float, slo_ms: float) -> int:
    return max(0, math.floor((slo_ms / 2 - beta_ms) / alpha_ms))


def throughput_rps(alpha_ms: float, beta_ms: float, batch: int, gpus: int) -> float:
    if batch <= 0:
        return 0.0
    return gpus * batch / ((alpha_ms * batch + beta_ms) / 1e3)


def staggered_throughput_rps(alpha_ms: float, beta_ms: float, slo_ms: float, gpus: int) -> float:
    return throughput_rps(alpha_ms, beta_ms, staggered_batch(alpha_ms, beta_ms, slo_ms, gpus), gpus)


def uncoordinated_throughput_rps(
    alpha_ms: float, beta_ms: float, slo_ms: float, gpus: int
) -> float:
    return throughput_rps(alpha_ms, beta_ms, uncoordinated_batch(alpha_ms, beta_ms, slo_ms), gpus)


def gpus_needed(profile: LatencyProfile, budget_s: float, rate_rps: float, d_data_s: float = 0.0
                ) -> float:
    """Fractional GPUs one model needs at ``rate_rps`` in staggered execution (inf if even a batch
    of one cannot meet the budget)."""
    if rate_rps <= 0:
        return 0.0
    table = profile.table_s
    lo = largest_batch_at_rate(profile, budget_s, rate_rps, d_data_s)
    if lo == 0:
        # too slow a rate to wait for even one more request: batches of one, if they fit
        return rate_rps * table[1] if table[1] + d_data_s <= budget_s else math.inf
    return rate_rps * table[lo] / lo


def staggered_bound_rps(
    models: Sequence[tuple[LatencyProfile, float, float]],
    gpus: int,
    d_data_s: float | Sequence[float] = 0.0,
    rel_precision: float = 1e-4,
) -> float:
    """Largest total rate whose staggered GPU need fits ``gpus``.

    ``models`` holds ``(profile, budget_s, share)`` with shares summing to 1 (budget: SLO minus the
    reply allowance and d_ctrl); ``d_data_s`` is one allowance per row for all, or one per model.
    """
    per_model = ([float(x) for x in d_data_s] if isinstance(d_data_s, Sequence)
                 else [float(d_data_s)] * len(models))
    if len(per_model) != len(models):
        raise ValueError("staggered_bound_rps: one d_data_s per model, or one for all")

    def need(total: float) -> float:
        return sum(gpus_needed(p, budget, total * share, d)
                   for (p, budget, share), d in zip(models, per_model, strict=True))

    lo, hi = 0.0, 1.0
    while need(hi) <= gpus:
        lo, hi = hi, hi * 2
        if hi > 1e12:
            return math.inf
    while hi - lo > rel_precision * max(lo, 1.0):
        mid = (lo + hi) / 2
        if need(mid) <= gpus:
            lo = mid
        else:
            hi = mid
    return lo
