"""What the load generator sends and what it records: the plan, the outcomes, the early stop.

- :class:`LoadPlan`: every request of a run planned ahead, as parallel arrays (send time relative
  to the run start, model index), plus each model's SLO and the measure window. Built with
  :func:`plan_for_workload` from a workload file, or :func:`build_plan` from a rate schedule,
  per-model shares and an arrival process.
- :class:`RunResult`: per request the send time, reply time, :class:`Outcome` and error kind,
  plus the generator's own :class:`Lateness` (actual send time minus planned send time).
- :class:`BailRule`: the early stop of a run whose verdict is already a failure, judged on the
  per-model ``COUNTERS`` the workers publish.

``zserve.loadgen.generator`` runs a plan; ``zserve.loadgen.sender`` is one worker's loop.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from zserve.core.errors import ErrorKind
from zserve.loadgen import arrivals, schedules
from zserve.loadgen.schedules import RateSchedule
from zserve.loadgen.workload import ArrivalSpec, Workload, draw_request_rows

FloatArray = np.ndarray[Any, np.dtype[np.float64]]
IntArray = np.ndarray[Any, np.dtype[np.int64]]

# The generator's lateness is judged at this quantile of the measured requests' send lateness:
# a single scheduling hiccup of the host must not void a run, a systematic lag must.
LATENESS_QUANTILE = 0.99
DEFAULT_LATENESS_BOUND_MS = 5.0


class Outcome(enum.IntEnum):
    """What happened to one request (stored as int8)."""

    GOOD = 0  # reply by send time + SLO
    LATE = 1  # reply after send time + SLO
    DROPPED = 2  # DEADLINE error (the scheduler dropped it, or the frontend timed it out)
    ERROR = 3  # any other error; see error_kind
    TIMEOUT = 4  # no answer by the end of the run
    UNSENT = 5  # not sent: the run stopped early


# Error kinds recorded per request, by index (int8); -1 = no error. The last two are the
# generator's own: its send queue was full, or a reply it could not decode.
ERROR_KINDS: tuple[str, ...] = (*(k.value for k in ErrorKind), "SEND_BLOCKED", "BAD_REPLY")
ERROR_INDEX = {kind: i for i, kind in enumerate(ERROR_KINDS)}
DEADLINE_ERROR = ERROR_INDEX[ErrorKind.DEADLINE.value]
NO_ERROR = -1

# Per-model counters a worker publishes (measure window only), in this order.
# "decided": measured requests whose fate is known (answered, or past their SLO unanswered).
COUNTERS = ("planned", "sent", "decided", "bad")
PLANNED, SENT, DECIDED, BAD = range(len(COUNTERS))


class GeneratorError(RuntimeError):
    """The generator could not run (a worker died, the address is wrong, ...)."""


class GeneratorBehindError(GeneratorError):
    """The generator fell behind its schedule by more than the stated bound: no verdict."""

    def __init__(self, result: RunResult) -> None:
        lat = result.lateness
        gave_up = (
            f", gave up {lat.abandoned_lag_ms:.0f} ms behind" if lat.abandoned_lag_ms else ""
        )
        super().__init__(
            f"refusing to report: the generator fell behind its schedule "
            f"(p{LATENESS_QUANTILE * 100:g} lateness {lat.quantile_ms:.2f} ms, max "
            f"{lat.max_ms:.2f} ms, bound {lat.bound_ms:.2f} ms{gave_up}) at "
            f"{result.plan.offered_rate_rps:.0f} r/s with {result.workers} worker(s): the run "
            f"would measure the generator, not the system"
        )
        self.result = result
        # Set by a goodput search that this refusal ended: the probes it had run.
        self.search_probes: list[dict[str, Any]] | None = None

# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class LoadPlan:
    """Every request of a run: ``times_s[i]`` (seconds from the run start, sorted) and
    ``model_index[i]`` into ``models``. Requests planned in ``[measure_start_s, measure_end_s)``
    are measured; the rest are warmup and cooldown. ``rows[i]``: how many rows request i's
    inputs hold (None: one each; the workload's ``request_rows``)."""

    models: tuple[str, ...]
    slo_ms: tuple[float, ...]
    times_s: FloatArray
    model_index: IntArray
    measure_start_s: float
    measure_end_s: float
    duration_s: float
    seed: int = 0
    description: dict[str, Any] = field(default_factory=dict)
    rows: IntArray | None = None

    def __post_init__(self) -> None:
        if len(self.models) != len(self.slo_ms):
            raise ValueError("one SLO per model")
        if self.times_s.shape != self.model_index.shape:
            raise ValueError("times_s and model_index must have the same length")
        if self.rows is not None and self.rows.shape != self.times_s.shape:
            raise ValueError("rows and times_s must have the same length")
        if len(self.times_s) and np.any(np.diff(self.times_s) < 0):
            raise ValueError("times_s must be sorted")

    def __len__(self) -> int:
        return len(self.times_s)

    @property
    def measured(self) -> np.ndarray[Any, np.dtype[np.bool_]]:
        return (self.times_s >= self.measure_start_s) & (self.times_s < self.measure_end_s)

    @property
    def measure_s(self) -> float:
        return self.measure_end_s - self.measure_start_s

    @property
    def offered_rate_rps(self) -> float:
        """Planned requests per second in the measure window (all models)."""
        return float(np.count_nonzero(self.measured)) / self.measure_s if self.measure_s else 0.0

    def planned_per_model(self) -> IntArray:
        return np.bincount(self.model_index[self.measured], minlength=len(self.models))

    def subset(self, indices: IntArray) -> LoadPlan:
        rows = None if self.rows is None else self.rows[indices]
        return replace(self, times_s=self.times_s[indices], model_index=self.model_index[indices],
                       rows=rows)


def build_plan(
    *,
    models: Sequence[str],
    slo_ms: Sequence[float],
    shares: Sequence[float],
    schedule: RateSchedule,
    arrival: ArrivalSpec | Sequence[ArrivalSpec],
    warmup_s: float = 0.0,
    cooldown_s: float = 0.0,
    seed: int = 0,
    description: dict[str, Any] | None = None,
) -> LoadPlan:
    """Plan a run: ``schedule`` is the *measured* part; warmup and cooldown extend it at its first
    and last rate. Model m gets ``shares[m]`` (normalised) of the total rate, and its own
    arrival process when ``arrival`` is a sequence (one per model).

    Each model's arrivals come from ``zserve.loadgen.arrivals`` (its own generator, the m-th
    child of ``SeedSequence(seed)``) run at unit rate in operational time and mapped to wall
    time by the schedule (time rescaling, see ``zserve.loadgen.schedules``). numpy scales the
    standard exponential/gamma/uniform draws by the mean gap, so for a constant schedule the
    times are the ones the simulator draws at the model's rate from the same seed.
    """
    n_models = len(models)
    if not (len(slo_ms) == len(shares) == n_models) or n_models == 0:
        raise ValueError("models, slo_ms and shares must have the same, non-zero length")
    share = np.asarray(shares, dtype=np.float64)
    if np.any(share < 0) or share.sum() <= 0:
        raise ValueError("shares must be >= 0 with a positive sum")
    share = share / share.sum()
    processes = [arrival] * n_models if isinstance(arrival, ArrivalSpec) else list(arrival)
    if len(processes) != n_models:
        raise ValueError("one arrival process per model")
    full = schedule.padded(warmup_s, cooldown_s)
    times: list[FloatArray] = []
    index: list[IntArray] = []
    for m in range(n_models):
        expected = full.expected_requests * share[m]
        if expected <= 0:
            continue
        # Unit rate for `expected` seconds of operational time = `expected` arrivals on average.
        operational = arrivals.arrival_times(
            processes[m].kind, processes[m].shape, 1.0, expected, arrivals.model_rng(seed, m)
        )
        wall = full.warp(operational / share[m])
        times.append(wall)
        index.append(np.full(len(wall), m, dtype=np.int64))
    all_times = np.concatenate(times) if times else np.empty(0)
    all_index = np.concatenate(index) if index else np.empty(0, dtype=np.int64)
    order = np.argsort(all_times, kind="stable")
    return LoadPlan(
        models=tuple(models),
        slo_ms=tuple(float(s) for s in slo_ms),
        times_s=np.asarray(all_times[order], dtype=np.float64),
        model_index=np.asarray(all_index[order], dtype=np.int64),
        measure_start_s=float(warmup_s),
        measure_end_s=float(warmup_s + schedule.duration_s),
        duration_s=full.duration_s,
        seed=seed,
        description=dict(description or {}),
    )


def plan_for_workload(
    workload: Workload, *, rate_rps: float | None = None, schedule: RateSchedule | None = None
) -> LoadPlan:
    """The plan of a workload file: its models, SLOs, shares, arrival process, windows and seed.
    ``schedule`` (steps, a trace) replaces the constant ``rate`` for the measured part; with
    ``rate_rps`` it is rescaled to that mean (what a goodput search varies)."""
    if schedule is None:
        schedule = schedules.constant(workload.rate, workload.measure_s)
    if rate_rps is not None:
        schedule = schedule.with_mean_rate(rate_rps)
    plan = build_plan(
        models=[m.name for m in workload.models],
        slo_ms=[m.slo_ms for m in workload.models],
        shares=workload.shares(),
        schedule=schedule,
        arrival=workload.arrival,
        warmup_s=workload.warmup_s,
        cooldown_s=workload.cooldown_s,
        seed=workload.seed,
        description={
            "workload": workload.name,
            "arrival": str(workload.arrival),
            "schedule": {"durations_s": list(schedule.durations_s),
                         "rates_rps": list(schedule.rates_rps)},
            "request_rows": str(workload.request_rows),
        },
    )
    rows = draw_request_rows(workload.request_rows, workload.seed, len(plan))
    return plan if rows is None else replace(plan, rows=rows)


# --------------------------------------------------------------------------- early stop


@dataclass(frozen=True)
class BailRule:
    """Stop a run whose verdict is already known to be a failure: a model whose bad count
    exceeds ``bad_budget`` (0.01) times its planned measured requests cannot pass any more.

    There is deliberately no "clearly failing" rule on a bad fraction of the first requests
    decided: losses on a live cluster come in bursts (a host stall of a few ms costs every
    request in flight), and such a rule (10% bad of the first 200) stopped probes of ResNet50
    (25 ms SLO, 1,500-2,200 r/s) that ended at 0.3-0.5% bad when run to the end. A probe that
    fails throughout still stops early: at 10% bad, after a tenth of its window.
    """

    bad_budget: float = 0.01

    def verdict(self, counters: IntArray, models: Sequence[str]) -> str | None:
        """``counters``: shape (models, len(COUNTERS)) summed over workers."""
        for m, name in enumerate(models):
            planned, _, _, bad = (int(v) for v in counters[m])
            if planned and bad > self.bad_budget * planned:
                return (
                    f"{name}: {bad} bad of {planned} planned exceeds the "
                    f"{self.bad_budget:.2%} budget"
                )
        return None


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Lateness:
    """The generator's send lateness over the measured requests, in milliseconds."""

    p50_ms: float
    quantile_ms: float  # at LATENESS_QUANTILE
    p999_ms: float
    max_ms: float
    bound_ms: float
    behind: bool
    # When the run was abandoned because the generator fell hopelessly behind: its lag then.
    abandoned_lag_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "abandoned_lag_ms": self.abandoned_lag_ms,
            "p50_ms": self.p50_ms,
            f"p{LATENESS_QUANTILE * 100:g}_ms": self.quantile_ms,
            "p99.9_ms": self.p999_ms,
            "max_ms": self.max_ms,
            "bound_ms": self.bound_ms,
            "quantile": LATENESS_QUANTILE,
            "behind": self.behind,
        }


@dataclass(frozen=True)
class RunResult:
    """Per-request records (parallel to ``plan``) and the run's facts. Times are seconds from the
    run start (``t0``, a ``time.monotonic()`` value), NaN where absent."""

    plan: LoadPlan
    t0: float
    sent_s: FloatArray
    replied_s: FloatArray
    outcome: np.ndarray[Any, np.dtype[np.int8]]
    error_kind: np.ndarray[Any, np.dtype[np.int8]]
    workers: int
    lateness: Lateness
    stopped_early: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def latency_s(self) -> FloatArray:
        return np.asarray(self.replied_s - self.sent_s, dtype=np.float64)

    def outcome_counts(self, model: int | None = None, *, measured: bool = True) -> dict[str, int]:
        mask = self.plan.measured if measured else np.ones(len(self.plan), dtype=bool)
        if model is not None:
            mask = mask & (self.plan.model_index == model)
        counts = np.bincount(self.outcome[mask], minlength=len(Outcome))
        return {o.name.lower(): int(counts[o]) for o in Outcome}

    def error_counts(self, model: int | None = None) -> dict[str, int]:
        mask = self.plan.measured & (self.error_kind >= 0)
        if model is not None:
            mask = mask & (self.plan.model_index == model)
        counts = np.bincount(self.error_kind[mask], minlength=len(ERROR_KINDS))
        return {ERROR_KINDS[i]: int(c) for i, c in enumerate(counts) if c}

    def bad_rates(self) -> list[float]:
        """Per model: bad fraction of the measured requests (1.0 for a model with none sent)."""
        rates = []
        for m in range(len(self.plan.models)):
            counts = self.outcome_counts(m)
            total = sum(counts.values())
            rates.append(1.0 - counts["good"] / total if total else 0.0)
        return rates

    @property
    def goodput_rps(self) -> float:
        """Good measured requests per second of the measure window."""
        good = np.count_nonzero(self.plan.measured & (self.outcome == Outcome.GOOD))
        return float(good) / self.plan.measure_s if self.plan.measure_s else 0.0

    def save(self, path: str | os.PathLike[str]) -> None:
        """Per-request records as a ``.npz``: model (index into ``models``), planned, sent and
        reply times (s from the run start), outcome (``Outcome`` values) and error kind (index
        into ``error_kinds``, -1 none), whether measured, each request's rows, and the run's
        constants."""
        np.savez_compressed(
            path,
            models=np.asarray(self.plan.models),
            slo_ms=np.asarray(self.plan.slo_ms),
            model=self.plan.model_index.astype(np.int32),
            planned_s=self.plan.times_s,
            sent_s=self.sent_s,
            replied_s=self.replied_s,
            outcome=self.outcome,
            outcome_names=np.asarray([o.name.lower() for o in Outcome]),
            error_kind=self.error_kind,
            error_kinds=np.asarray(ERROR_KINDS),
            measured=self.plan.measured,
            t0_monotonic=np.float64(self.t0),
            rows=(self.plan.rows if self.plan.rows is not None
                  else np.ones(len(self.plan), np.int64)).astype(np.int32),
        )



def lateness_of(plan: LoadPlan, sent_s: FloatArray, bound_ms: float) -> Lateness:
    """Send lateness of the measured requests that were sent (of every sent request when none of
    the measured ones was: a run abandoned during its warmup)."""
    mask = plan.measured & ~np.isnan(sent_s)
    if not np.any(mask):
        mask = ~np.isnan(sent_s)
    late_ms = (sent_s[mask] - plan.times_s[mask]) * 1e3
    if late_ms.size == 0:
        return Lateness(0.0, 0.0, 0.0, 0.0, bound_ms, False)
    p50, q, p999 = np.quantile(late_ms, [0.5, LATENESS_QUANTILE, 0.999])
    worst = float(late_ms.max())
    return Lateness(float(p50), float(q), float(p999), worst, bound_ms, bool(q > bound_ms))
