"""The day experiment's parts: the generated day of per-model rates, the per-step (fluid) cluster
model whose goodput and busy curves come from request-level runs, and the scaling rules it
replays (zserve's advice, Ray Serve's default policy, Knative's KPA, an offline oracle).

**The day** (:func:`generate_day`): 24 models of the GTX 1080 Ti zoo with their own SLOs. Each
model gets a base share (log-normal, sigma 1, seeded), a diurnal curve (a raised cosine with its
trough at 04:00 and its peak at 16:00, the trough at 20-35% of the peak, each model's phase
shifted by up to +-90 minutes), slow noise (an AR(1) factor per minute, 5% standard deviation,
0.9 correlation) and bursts: a Poisson number per model (mean ``BURSTS_PER_MODEL``), each at a
uniform time, multiplying the model's rate by 1.5-3x for 2-10 minutes with a one-minute ramp up
and down. The total is scaled so the busiest step needs ``peak_gpus`` GPUs at the knee.

**The fluid model** (:func:`run_fluid`): the cluster's state every ``step_s``: the load in GPU
units L = sum over models of rate / the model's one-GPU capacity (its staggered bound), the
serving GPUs N, and from the calibration curves (request-level runs of the 24-model mix at load
ratios x = L / N) the step's bad share b(x) and busy fraction u(x). What it does not model, and
so what it costs in fidelity: queues carry nothing from one step to the next (deferred scheduling
drops what misses its SLO, so a backlog lives at most one SLO), the mix's batching efficiency is
the calibration mix's (a model whose share moves changes its batch sizes), and Poisson noise
within a step is averaged away. The compressed hour (``run_day``'s request-level check) measures
the sum of these.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zserve.orchestrator.autoscale import AutoscalePolicy, Autoscaler, Signals

DAY_S = 86_400.0
DAY_MINUTES = 1440
BURSTS_PER_MODEL = 0.5
TROUGH_HOUR, PEAK_HOUR = 4.0, 16.0
PHASE_SPREAD_MIN = 90.0
NOISE_SIGMA, NOISE_RHO = 0.05, 0.9


def generate_day(seed: int, capacities: list[float], *, peak_gpus: float, step_s: float,
                 knee: float) -> np.ndarray[Any, Any]:
    """Per-model rates (requests/s), one row per step of ``step_s`` over a day (module
    docstring); scaled so that the busiest step's load is ``peak_gpus x knee`` GPU units."""
    rng = np.random.default_rng(seed)
    models = len(capacities)
    steps = int(DAY_S / step_s)
    t_min = np.arange(steps) * step_s / 60.0
    share = rng.lognormal(0.0, 1.0, models)
    trough = rng.uniform(0.2, 0.35, models)
    phase = rng.uniform(-PHASE_SPREAD_MIN, PHASE_SPREAD_MIN, models)
    rates = np.empty((steps, models))
    for m in range(models):
        minutes = (t_min - phase[m] - TROUGH_HOUR * 60.0) % DAY_MINUTES
        # a raised cosine: 0 at the trough hour, 1 at the peak hour (12 h later)
        daily = trough[m] + (1 - trough[m]) * 0.5 * (1 - np.cos(2 * np.pi * minutes / 1440.0))
        noise = _ar1(rng, DAY_MINUTES)[np.minimum(t_min.astype(int), DAY_MINUTES - 1)]
        rates[:, m] = share[m] * daily * noise * _bursts(rng, t_min)
    load = rates @ (1.0 / np.asarray(capacities))
    return rates * (peak_gpus * knee / float(load.max()))


def _ar1(rng: np.random.Generator, n: int) -> np.ndarray[Any, Any]:
    """A multiplicative AR(1) noise factor per minute (mean 1)."""
    z = np.empty(n)
    z[0] = rng.normal()
    innovations = rng.normal(size=n) * math.sqrt(1 - NOISE_RHO ** 2)
    for i in range(1, n):
        z[i] = NOISE_RHO * z[i - 1] + innovations[i]
    return np.exp(NOISE_SIGMA * z - NOISE_SIGMA ** 2 / 2)


def _bursts(rng: np.random.Generator, t_min: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """One model's burst factor per step: 1, or 1.5-3x for 2-10 minutes with 1-minute ramps."""
    factor = np.ones_like(t_min)
    for _ in range(rng.poisson(BURSTS_PER_MODEL)):
        start = rng.uniform(0, DAY_MINUTES - 12)
        length = rng.uniform(2, 10)
        height = rng.uniform(1.5, 3.0)
        up = np.clip(t_min - start + 1.0, 0.0, 1.0)
        down = np.clip(start + length + 1.0 - t_min, 0.0, 1.0)
        factor *= 1.0 + (height - 1.0) * np.minimum(up, down)
    return factor


@dataclass(frozen=True)
class Curves:
    """The mix's bad share and busy fraction against the load ratio x = L / N, from
    request-level runs (points sorted by x)."""

    x: tuple[float, ...]
    bad: tuple[float, ...]
    busy: tuple[float, ...]

    def bad_at(self, x: float) -> float:
        """Interpolated; past the last point the good rate stays flat (the flat top)."""
        if x <= self.x[-1]:
            return float(np.interp(x, self.x, self.bad))
        good_top = (1.0 - self.bad[-1]) * self.x[-1]
        return 1.0 - good_top / x

    def busy_at(self, x: float) -> float:
        return float(np.interp(x, self.x, self.busy))

    def knee(self, bad: float = 0.01) -> float:
        """The largest calibrated x whose bad share is at most ``bad`` (interpolated)."""
        best = self.x[0]
        for (x0, b0), (x1, b1) in zip(zip(self.x, self.bad, strict=True),
                                      zip(self.x[1:], self.bad[1:], strict=True), strict=False):
            if b0 <= bad:
                best = x0
                if b1 > bad:
                    return x0 + (x1 - x0) * (bad - b0) / (b1 - b0)
                best = x1
        return best


@dataclass(frozen=True)
class Step:
    """What a scaler sees at the end of one step: requests offered and bad in it, busy
    GPU-seconds, the load ratio x (offered load over serving GPUs), the GPUs serving."""

    now: float
    offered: float
    bad: float
    busy_s: float
    x: float
    serving: int
    step_s: float


Scaler = Callable[[Step], int]
"""A scaling rule: the backends it wants after a step."""


def ours(policy: AutoscalePolicy, start: int) -> tuple[Scaler, Autoscaler]:
    scaler = Autoscaler(policy, start, 0.0)

    def decide(step: Step) -> int:
        scaler.observe(step.now, Signals(step.step_s, round(step.offered), round(step.bad),
                                         step.busy_s, step.serving))
        return scaler.advise(step.now).backends

    return decide, scaler


@dataclass
class RayServe:
    """Ray Serve's default autoscaling policy: desired = ceil(ongoing / target) from the
    ongoing requests averaged over ``look_back_s`` (30 s); an upscale decision must hold for
    ``upscale_delay_s`` (30 s), a downscale one for ``downscale_delay_s`` (600 s). Ongoing
    requests per replica are proportional to its load ratio (Little's law at a latency set by
    the SLO), so the target is a load ratio: ``target_x``."""

    target_x: float
    bounds: tuple[int, int]
    current: int
    look_back_s: float = 30.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    _seen: list[tuple[float, float]] = field(default_factory=list)  # (time, L)
    _since: float | None = None
    _direction: int = 0

    def __call__(self, step: Step) -> int:
        now = step.now
        self._seen = [(t, v) for t, v in self._seen if t > now - self.look_back_s]
        self._seen.append((now, step.x * step.serving))
        mean_load = sum(v for _, v in self._seen) / len(self._seen)
        desired = min(max(math.ceil(mean_load / self.target_x), self.bounds[0]), self.bounds[1])
        direction = (desired > self.current) - (desired < self.current)
        if direction != self._direction:
            self._direction, self._since = direction, now
        delay = self.upscale_delay_s if direction > 0 else self.downscale_delay_s
        if direction and self._since is not None and now - self._since >= delay - 1e-9:
            self.current, self._direction = desired, 0
        return self.current


@dataclass
class Kpa:
    """Knative's KPA: desired = ceil(concurrency / (target x 70%)) over the 60 s stable
    window; the 6 s panic window (10%) takes over when it asks for twice the current pods, and
    while panicking (until a stable window without panic) the pods never go down; a step down
    is at most half (max scale-down rate 2). Concurrency is proportional to the load ratio, so
    the target is a load ratio: ``target_x`` (times the 70% utilization)."""

    target_x: float
    bounds: tuple[int, int]
    current: int
    stable_s: float = 60.0
    panic_s: float = 6.0
    utilization: float = 0.7
    _seen: list[tuple[float, float]] = field(default_factory=list)
    _panic_until: float = -math.inf

    def __call__(self, step: Step) -> int:
        now = step.now
        self._seen = [(t, v) for t, v in self._seen if t > now - self.stable_s]
        self._seen.append((now, step.x * step.serving))
        per_pod = self.target_x * self.utilization
        stable = sum(v for _, v in self._seen) / len(self._seen)
        recent = [v for t, v in self._seen if t > now - max(self.panic_s, step.step_s)]
        panic = sum(recent) / len(recent)
        want_stable, want_panic = math.ceil(stable / per_pod), math.ceil(panic / per_pod)
        if want_panic >= 2 * self.current:
            self._panic_until = now + self.stable_s
        if now < self._panic_until:
            desired = max(self.current, want_panic)
        else:
            desired = max(want_stable, math.ceil(self.current / 2))
        self.current = min(max(desired, self.bounds[0]), self.bounds[1])
        return self.current


@dataclass
class FluidRun:
    """One replay: per step the GPUs serving and allocated, the load, offered and bad."""

    serving: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    offered: list[float] = field(default_factory=list)
    bad: list[float] = field(default_factory=list)
    changes: list[tuple[float, int]] = field(default_factory=list)

    def minute_bad(self, steps_per_minute: int) -> np.ndarray[Any, Any]:
        offered = np.add.reduceat(np.asarray(self.offered), np.arange(0, len(self.offered),
                                                                      steps_per_minute))
        bad = np.add.reduceat(np.asarray(self.bad), np.arange(0, len(self.bad),
                                                              steps_per_minute))
        return np.divide(bad, offered, out=np.zeros_like(bad), where=offered > 0)


def run_fluid(load: np.ndarray[Any, Any], rps: np.ndarray[Any, Any], curves: Curves,
              scaler: Scaler, *, start: int, step_s: float, start_delay_s: float) -> FluidRun:
    """Replay a load trace (GPU units and requests/s per step) under ``scaler``: started GPUs
    serve ``start_delay_s`` later, released ones stop at once."""
    run = FluidRun()
    serving = start
    starting: list[float] = []  # the times at which the started GPUs serve
    target = start
    for i, (units, rate) in enumerate(zip(load.tolist(), rps.tolist(), strict=True)):
        now = (i + 1) * step_s
        serving += len([t for t in starting if t <= now])
        starting = [t for t in starting if t > now]
        x = units / max(serving, 1)
        offered = rate * step_s
        bad = curves.bad_at(x) * offered
        busy_s = min(curves.busy_at(x), 1.0) * serving * step_s
        run.serving.append(serving)
        run.allocated.append(serving + len(starting))
        run.offered.append(offered)
        run.bad.append(bad)
        wanted = scaler(Step(now, offered, bad, busy_s, x, serving, step_s))
        if wanted != target:
            run.changes.append((now, wanted - target))
        if wanted > target:
            starting += [now + start_delay_s] * (wanted - target)
        elif wanted < target:
            drop = target - wanted
            cancelled = min(drop, len(starting))
            starting = sorted(starting)[:len(starting) - cancelled]
            serving -= drop - cancelled
        target = wanted
    return run


def oracle_gpus(load: np.ndarray[Any, Any], knee: float, steps_per_minute: int,
                bounds: tuple[int, int]) -> np.ndarray[Any, Any]:
    """The offline oracle: each minute, the fewest GPUs that keep its busiest step at the
    knee, there from the minute's start (it knows the future; no start-up time)."""
    minutes = len(load) // steps_per_minute
    busiest = load[:minutes * steps_per_minute].reshape(minutes, steps_per_minute).max(axis=1)
    gpus: np.ndarray[Any, Any] = np.clip(np.ceil(busiest / knee - 1e-9), bounds[0], bounds[1])
    return gpus


__all__ = ["Curves", "FluidRun", "Kpa", "RayServe", "Scaler", "Step", "generate_day",
           "oracle_gpus", "ours", "run_fluid"]
