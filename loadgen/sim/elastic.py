"""The autoscaler hosted in the simulator: a pool of GPUs of which some serve, fed by the
:class:`~zserve.orchestrator.autoscale.Autoscaler` core every tick.

Every ``tick_s`` the simulator hands :meth:`ElasticGpus.on_tick` its running counters (requests
answered, bad answers, GPU-seconds of batches started); the tick's differences are one
:class:`Signals` sample. The advice acts as ``zserve up`` acts: an added backend joins the rank
``start_delay_s`` later (it starts, registers and warms first), lowest free id first; a release
removes the highest-numbered serving GPUs from the rank at once, and their followers run the
plans they hold (the drain: nothing is lost). A GPU counts as allocated from its start until it
leaves the rank and its last batch ends (``gpu_busy_until``), which is what GPU-hours bill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zserve.orchestrator.autoscale import AutoscalePolicy, Autoscaler, Signals


@dataclass(frozen=True)
class ElasticConfig:
    """The autoscaler's policy, the backends at the start, a new backend's start-up time and
    the control tick."""

    policy: AutoscalePolicy
    backends: int
    start_delay_s: float = 1.0
    tick_s: float = 0.5


@dataclass
class ElasticGpus:
    """The GPU pool's state (module docstring); ``timeline`` holds one row per tick."""

    config: ElasticConfig
    pool: int
    serving: list[int] = field(default_factory=list)
    starting: dict[int, float] = field(default_factory=dict)  # gpu -> when it joins
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.config.policy.max_backends > self.pool:
            raise ValueError(f"max_backends {self.config.policy.max_backends} exceeds the "
                             f"simulated pool of {self.pool} GPUs")
        self.autoscaler = Autoscaler(self.config.policy, self.config.backends, 0.0)
        self.serving = list(range(self.autoscaler.backends))
        self._last = (0, 0, 0.0)
        self._last_at = 0.0

    def on_tick(self, now: float, counters: tuple[int, int, float],
                busy_until: list[float]) -> tuple[list[tuple[int, float]], list[int]]:
        """One control tick: ``counters`` are (answered, bad, busy GPU-seconds) so far. Returns
        the GPUs to start (with the time each joins) and those to drain now."""
        answered, bad, busy_s = counters
        last_answered, last_bad, last_busy = self._last
        self._last = counters
        duration = now - self._last_at
        self._last_at = now
        self.autoscaler.observe(now, Signals(duration, answered - last_answered,
                                             bad - last_bad, busy_s - last_busy,
                                             len(self.serving)))
        advice = self.autoscaler.advise(now)
        starts: list[tuple[int, float]] = []
        stops: list[int] = []
        if advice.change > 0:
            taken = set(self.serving) | set(self.starting)
            free = [g for g in range(self.pool) if g not in taken]
            for gpu in free[:advice.change]:
                ready = now + self.config.start_delay_s
                self.starting[gpu] = ready
                starts.append((gpu, ready))
        elif advice.change < 0:
            stops = self._release(-advice.change)
        draining = sum(1 for g in range(self.pool) if g not in self.serving
                       and g not in self.starting and busy_until[g] > now)
        self.timeline.append({
            "t": round(now, 4), "serving": len(self.serving), "starting": len(self.starting),
            "draining": draining, "advice": advice.backends, "change": advice.change,
            "bad_rate": round(advice.bad_rate, 5), "idle": round(advice.idle_fraction, 4),
            "needed": round(advice.needed, 3), "reason": advice.reason,
            "answered": answered - last_answered, "bad": bad - last_bad,
            "busy_s": round(busy_s - last_busy, 5)})
        return starts, stops

    def _release(self, count: int) -> list[int]:
        """Cancel starting backends first (newest first), then drain the highest-numbered."""
        stops: list[int] = []
        for gpu in sorted(self.starting, reverse=True)[:count]:
            del self.starting[gpu]
            count -= 1
        for gpu in sorted(self.serving, reverse=True)[:count]:
            self.serving.remove(gpu)
            stops.append(gpu)
        return stops

    def on_joined(self, gpu: int) -> bool:
        """A started backend is warm: True when it is still wanted (it joins the rank)."""
        if self.starting.pop(gpu, None) is None:
            return False
        self.serving.append(gpu)
        self.serving.sort()
        return True

    def allocated_gpu_s(self, tick_s: float) -> float:
        """GPU-seconds allocated: serving, starting and draining GPUs, tick by tick."""
        return float(sum((r["serving"] + r["starting"] + r["draining"]) * tick_s
                         for r in self.timeline))


__all__ = ["ElasticConfig", "ElasticGpus"]
