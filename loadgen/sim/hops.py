"""Hop latencies the simulator draws, so that it can replay the learned-allowance rule.

By default the simulator's hops take exactly their allowances (a plan's inputs are in at grant +
``d_ctrl + d_data*b``, a timer fires on time, the reply takes ``reply``). ``zserve sim --hops
SPEC`` draws them instead, each from a log-normal distribution given by its median and p99 in
milliseconds, as a live cluster measures them (the shard's and the frontend's ``allowances``
stats, ``zserve status``):

- ``ready``: plan delivery + input fetch, the part that does not grow with the batch (the inputs
  are in ``ready + d_data*b`` after the grant; the plan reaches its GPU after half of it);
- ``late``: how late the scheduler's timer fires;
- ``reply``: a batch's end -> the client's answer (a request is good when that is within its SLO).

``SPEC`` is ``ready=P50/P99,late=P50/P99,reply=P50/P99`` (each optional: a hop not named takes 0).
With ``--learned-allowances`` the scheduler core and the frontends learn their allowances from
the drawn hops (``zserve.core.allowances``), as ``[scheduler] allowances = "learned"`` does live.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HOP_NAMES = ("ready", "late", "reply")
Z_99 = 2.3263478740408408  # the standard normal's 0.99 quantile


@dataclass(frozen=True, slots=True)
class LogNormalHop:
    """One hop's latency: log-normal with median ``p50_s`` and 0.99 quantile ``p99_s``."""

    p50_s: float
    p99_s: float

    def draw(self, rng: np.random.Generator) -> float:
        if self.p50_s <= 0.0:
            return 0.0
        sigma = math.log(self.p99_s / self.p50_s) / Z_99
        return float(self.p50_s * math.exp(sigma * rng.standard_normal()))


@dataclass(frozen=True, slots=True)
class HopLatencies:
    """The drawn hops (see the module docstring)."""

    ready: LogNormalHop
    late: LogNormalHop
    reply: LogNormalHop

    @classmethod
    def parse(cls, spec: str) -> HopLatencies:
        """``ready=P50/P99,late=P50/P99,reply=P50/P99`` in milliseconds; ValueError otherwise."""
        hops = {name: LogNormalHop(0.0, 0.0) for name in HOP_NAMES}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, value = part.partition("=")
            p50, _, p99 = value.partition("/")
            try:
                p50_ms, p99_ms = float(p50), float(p99)
            except ValueError:
                raise ValueError(f"--hops: {part!r} is not NAME=P50/P99 (milliseconds)") from None
            if name not in hops:
                raise ValueError(f"--hops: unknown hop {name!r} (one of {', '.join(HOP_NAMES)})")
            if not 0.0 < p50_ms <= p99_ms or not math.isfinite(p99_ms):
                raise ValueError(f"--hops: {name} needs 0 < p50 <= p99, got {value!r}")
            hops[name] = LogNormalHop(p50_ms / 1e3, p99_ms / 1e3)
        return cls(**hops)


__all__ = ["HOP_NAMES", "HopLatencies", "LogNormalHop"]
