"""The open-loop load generator: send on schedule, whatever the replies do.

A run has three parts:

1. A :class:`LoadPlan`: every request of the run planned ahead, as parallel arrays (send time
   relative to the run start, model index), plus each model's SLO and the measure window. Build it
   with :func:`plan_for_workload` from a workload file (``zserve.loadgen.workload``), or with
   :func:`build_plan` from a rate schedule (``zserve.loadgen.schedules``), per-model shares and an
   arrival process (``zserve.loadgen.arrivals``).
2. :func:`run_load`: one or more *workers* send the plan to a frontend's ``client`` socket.
   Worker ``w`` of ``W`` sends requests ``w, w+W, w+2W, ...`` so each worker carries an equal,
   interleaved share and the union is exactly the plan. One worker runs in the calling process;
   more are spawned processes that start together at an agreed ``time.monotonic()`` instant
   (CLOCK_MONOTONIC is shared by every process on a host). A worker never waits for a reply to
   send: between sends it only reads the replies that have already arrived.
3. A :class:`RunResult`: per request the send time, reply time, outcome (:class:`Outcome`) and
   error kind, plus the generator's own *lateness* (actual send time minus planned send time).

Honesty rule: if the generator fell behind its schedule by more than ``lateness_bound_ms`` at
the ``LATENESS_QUANTILE`` of the measured requests, :func:`run_load` raises
:class:`GeneratorBehindError` (carrying the figure) instead of returning a result, because the
run would then describe the generator rather than the system under test.

Outcome rules (``shared/DESIGN.md`` section 6, ``notes/anchors.md`` section 3): a request is
GOOD iff its reply arrived by send time + SLO. A reply after that is LATE; a ``DEADLINE`` error is
DROPPED; any other error is ERROR (its kind recorded); no answer by the end of the run is TIMEOUT.
Only requests planned inside the measure window count. All but GOOD are bad.

Early stop: with a :class:`BailRule`, the run stops as soon as one model's measured requests are
certain to fail (more bad requests than its whole bad budget), so a goodput search does not
spend a full probe on a rate that fails.
"""

from __future__ import annotations

import contextlib
import enum
import math
import multiprocessing
import multiprocessing.connection
import os
import select
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import numpy as np
import zmq

from zserve.errors import ErrorKind
from zserve.loadgen import arrivals, schedules
from zserve.loadgen.schedules import RateSchedule
from zserve.loadgen.workload import ArrivalSpec, Workload
from zserve.transport import codec
from zserve.transport.messages import (
    ClientHello,
    InferAnswers,
    InferError,
    InferReply,
    InferRequest,
    TensorMap,
)
from zserve.transport.sockets import make_dealer

FloatArray = np.ndarray[Any, np.dtype[np.float64]]
IntArray = np.ndarray[Any, np.dtype[np.int64]]

# The generator's lateness is judged at this quantile of the measured requests' send lateness:
# a single scheduling hiccup of the host must not void a run, a systematic lag must.
LATENESS_QUANTILE = 0.99
DEFAULT_LATENESS_BOUND_MS = 5.0
# A worker that is this far behind its schedule stops at once: the run will be refused anyway.
ABANDON_LAG_S = 0.5
# How often a worker publishes its counters, checks the early-stop rule and the stop flag.
MONITOR_INTERVAL_S = 0.05
# After the last send, how long to wait for outstanding replies beyond the largest SLO. The
# frontend answers every admitted request by deadline + reply allowance, so this is generous.
DEFAULT_REPLY_GRACE_S = 1.0
# After an early stop, how long to wait for outstanding replies (they no longer change the verdict).
STOP_GRACE_S = 0.2
# Workers start together this long after the last one reports ready.
START_DELAY_S = 0.1
# Queue depth of a worker's DEALER toward the frontend: large, because an open-loop generator
# must not stall on its own socket; a send that still finds it full is recorded as an error.
GENERATOR_SEND_HWM = 200_000
WORKER_START_TIMEOUT_S = 60.0
# Most requests sent in one pass of the loop before the replies that arrived are read.
SEND_BURST = 64
# Runs shorter than this get no progress bar (and none unless stderr is a terminal).
PROGRESS_MIN_S = 5.0
# Plain ints: pyzmq's constants are enum members, whose operators run Python code.
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_INT_ONLY = {int}
_STR_ONLY = {str}


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
_ERROR_INDEX = {kind: i for i, kind in enumerate(ERROR_KINDS)}
_DEADLINE_ERROR = _ERROR_INDEX[ErrorKind.DEADLINE.value]
NO_ERROR = -1

# Per-model counters a worker publishes (measure window only), in this order.
# "decided": measured requests whose fate is known (answered, or past their SLO unanswered).
COUNTERS = ("planned", "sent", "decided", "bad")
_PLANNED, _SENT, _DECIDED, _BAD = range(len(COUNTERS))


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
    are measured; the rest are warmup and cooldown."""

    models: tuple[str, ...]
    slo_ms: tuple[float, ...]
    times_s: FloatArray
    model_index: IntArray
    measure_start_s: float
    measure_end_s: float
    duration_s: float
    seed: int = 0
    description: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.models) != len(self.slo_ms):
            raise ValueError("one SLO per model")
        if self.times_s.shape != self.model_index.shape:
            raise ValueError("times_s and model_index must have the same length")
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
        return replace(self, times_s=self.times_s[indices], model_index=self.model_index[indices])


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

    Each model's arrivals come from ``zserve.loadgen.arrivals`` (its own generator, seeded
    ``seed + 31 * m``) run at unit rate in operational time and mapped to wall time by the
    schedule (time rescaling, see ``zserve.loadgen.schedules``). numpy scales the standard
    exponential/gamma/uniform draws by the mean gap, so for a constant schedule the times are the
    ones the simulator draws at the model's rate from the same seed.
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
    return build_plan(
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
        },
    )


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
        into ``error_kinds``, -1 none), whether measured, and the run's constants."""
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
        )


# --------------------------------------------------------------------------- worker


def peek_answers(frames: Sequence[Any]) -> list[tuple[int, str | None]]:
    """``(request_id, error kind or None)`` of each answer in an ``InferReply``, ``InferError``
    or ``InferAnswers`` message; empty for anything else or anything malformed.

    The generator reads only the header's id and error fields (the codec's layout: ``[KIND,
    field0, ...]``): a full ``codec.decode`` validates and rebuilds every output array, which
    costs several times more and would cap the rate one worker can sustain. Outputs are not
    looked at.
    """
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        return []
    if type(header) is not list or len(header) < 2:
        return []
    kind = header[0]
    if kind == InferAnswers.KIND and len(header) == 6:
        return _batch_answers(header)
    if type(header[1]) is int:
        if kind == InferReply.KIND:
            return [(header[1], None)]
        if kind == InferError.KIND and len(header) >= 3 and type(header[2]) is str:
            return [(header[1], header[2])]
    return []


def _batch_answers(header: list[Any]) -> list[tuple[int, str | None]]:
    """The answers of an ``InferAnswers`` header (one message per batch); empty if malformed."""
    _, request_ids, outputs, error_ids, errors, messages = header
    if not (
        type(request_ids) is type(outputs) is type(error_ids) is type(errors) is list
        and type(messages) is list
        and len(request_ids) == len(outputs)
        and len(error_ids) == len(errors) == len(messages)
        and (not request_ids or set(map(type, request_ids)) == _INT_ONLY)
        and (not error_ids or set(map(type, error_ids)) == _INT_ONLY)
        and (not errors or set(map(type, errors)) == _STR_ONLY)
    ):
        return []
    answers: list[tuple[int, str | None]] = [(rid, None) for rid in request_ids]
    answers.extend(zip(error_ids, errors, strict=True))
    return answers



@dataclass
class WorkerSpec:
    """What one worker needs (picklable for spawned processes)."""

    address: str
    plan: LoadPlan  # this worker's share (request ids are positions in it)
    inputs: dict[str, TensorMap]
    identity: bytes
    reply_grace_s: float = DEFAULT_REPLY_GRACE_S
    bail: BailRule | None = None


@dataclass
class WorkerOutput:
    sent_s: FloatArray
    replied_s: FloatArray
    outcome: np.ndarray[Any, np.dtype[np.int8]]
    error_kind: np.ndarray[Any, np.dtype[np.int8]]
    stopped_early: str | None


Monitor = Callable[[IntArray, float], str | None]
"""Called every MONITOR_INTERVAL_S with the worker's counters (models x COUNTERS) and its
current lag behind schedule in seconds; returns a reason to stop, or None."""


class _Sender:
    """One worker's open-loop run: the per-request records and the steps of its loop.

    The per-request records live in Python lists while the loop runs and become arrays at the
    end: indexing a list costs a fraction of indexing a numpy array element, and the loop does
    it a dozen times per request. The hot steps (``send_due``, ``read_replies``) bind what they
    use to locals once per call, not once per request. The monitor works on arrays of the recent
    window only."""

    def __init__(self, spec: WorkerSpec, t0: float) -> None:
        plan = spec.plan
        n = len(plan)
        self.spec = spec
        self.t0 = t0
        self.n = n
        self.times = plan.times_s.tolist()
        self.model_index = plan.model_index.tolist()
        self.measured = plan.measured.tolist()
        slo_s = np.asarray(plan.slo_ms, dtype=np.float64) / 1e3
        self.request_slo_s = slo_s[plan.model_index].tolist()
        self.max_slo_s = float(slo_s.max()) if len(slo_s) else 0.0
        # One request template per model: each request is its template with its own id,
        # encoded for the cost of packing that id (the inputs are the same arrays every time).
        self.encoders = [
            codec.encoder_for_ids(InferRequest(0, name, spec.inputs.get(name, {}),
                                               plan.slo_ms[m]))
            for m, name in enumerate(plan.models)
        ]
        self.sent = [math.nan] * n
        self.replied = [math.nan] * n
        self.outcome = [int(Outcome.UNSENT)] * n
        self.error_kind = [NO_ERROR] * n
        self.answered = [False] * n
        # Requests resolved-as-bad only by being overdue are counted once, at the monitor.
        self.overdue_counted = [False] * n
        self.overdue_scan_from = 0
        planned = np.bincount(plan.model_index[plan.measured], minlength=len(plan.models))
        self.counters = [[0] * len(COUNTERS) for _ in plan.models]
        for m, count in enumerate(planned.tolist()):
            self.counters[m][_PLANNED] = count
        self.i = 0  # the next request to send
        self.outstanding = 0
        self.stopped: str | None = None
        self.next_monitor = t0 + MONITOR_INTERVAL_S
        self.end_at = math.inf

    # 1. Send what is due (at most SEND_BURST, so that reply times stay accurate while
    #    catching up). Never wait for a reply to send.
    def send_due(self, sock: zmq.Socket[Any], now: float) -> None:
        if self.stopped is not None:
            return
        t0, times, n, i = self.t0, self.times, self.n, self.i
        model_index, measured, counters = self.model_index, self.measured, self.counters
        sent, encoders, send_frames = self.sent, self.encoders, codec.send_frames_nowait
        monotonic = time.monotonic
        burst_end = i + SEND_BURST
        while i < n and i < burst_end and t0 + times[i] <= now:
            m = model_index[i]
            sent[i] = monotonic() - t0
            try:
                send_frames(sock, encoders[m](i))
                self.outstanding += 1
            except zmq.Again:
                self._refused(i, m)
            if measured[i]:
                counters[m][_SENT] += 1
            i += 1
            if i == n:
                self.end_at = monotonic() + self.max_slo_s + self.spec.reply_grace_s
        self.i = i

    def _refused(self, i: int, m: int) -> None:
        """The socket's queue is full: the request ends at once as an error."""
        self.answered[i] = True
        self.replied[i] = self.sent[i]
        self.outcome[i] = int(Outcome.ERROR)
        self.error_kind[i] = _ERROR_INDEX["SEND_BLOCKED"]
        if self.measured[i]:
            self.counters[m][_DECIDED] += 1
            self.counters[m][_BAD] += 1

    # 2. Read every reply that has arrived. A poll before each receive: cheaper than a receive
    #    failing with EAGAIN (and than getsockopt(EVENTS), which builds an enum), and the last
    #    one (nothing queued) rearms the socket's edge-triggered FD for the sleep in 5.
    def read_replies(self, sock: zmq.Socket[Any], poll_items: list[Any]) -> None:
        bad_reply_error = _ERROR_INDEX["BAD_REPLY"]
        monotonic, settle = time.monotonic, self._settle
        while zmq.zmq_poll(poll_items, 0):
            try:
                # One whole message; each Frame says whether more follow (no RCVMORE call).
                frame = sock.recv(_NOBLOCK, copy=False)
                reply_frames = [frame]
                while frame.more:
                    frame = sock.recv(_NOBLOCK, copy=False)
                    reply_frames.append(frame)
            except zmq.Again:
                break
            t_reply = monotonic()
            sent_so_far = self.i
            # Undecodable answers yield nothing: their requests will end as TIMEOUT.
            for k, error in peek_answers(reply_frames):
                kind = NO_ERROR if error is None else _ERROR_INDEX.get(error, bad_reply_error)
                if 0 <= k < sent_so_far:
                    settle(k, kind, t_reply)

    def _settle(self, k: int, kind: int, t: float) -> None:
        if self.answered[k]:
            return
        self.answered[k] = True
        self.outstanding -= 1
        self.replied[k] = t - self.t0
        if kind == NO_ERROR:
            good = (t - self.t0) - self.sent[k] <= self.request_slo_s[k]
            self.outcome[k] = int(Outcome.GOOD) if good else int(Outcome.LATE)
        else:
            good = False
            self.outcome[k] = (int(Outcome.DROPPED) if kind == _DEADLINE_ERROR
                               else int(Outcome.ERROR))
            self.error_kind[k] = kind
        if self.measured[k] and not self.overdue_counted[k]:
            counts = self.counters[self.model_index[k]]
            counts[_DECIDED] += 1
            if not good:
                counts[_BAD] += 1

    # 3. Publish counters, apply the early-stop rule, watch our own lag.
    def monitor(self, now: float, monitor: Monitor) -> None:
        self.next_monitor = now + MONITOR_INTERVAL_S
        self._count_overdue(now)
        i, n = self.i, self.n
        lag = now - (self.t0 + self.times[i]) if i < n else 0.0
        reason = monitor(np.array(self.counters, dtype=np.int64), lag)
        if reason is not None and self.stopped is None:
            self.stopped = reason
            self.end_at = min(self.end_at, now + self.max_slo_s + STOP_GRACE_S)

    def _count_overdue(self, now: float) -> None:
        """Count measured requests already past their SLO without an answer as bad now."""
        answered, overdue_counted, measured = self.answered, self.overdue_counted, self.measured
        lo, hi = self.overdue_scan_from, self.i
        if lo < hi:
            late_now = (
                ~np.array(answered[lo:hi], dtype=bool)
                & ~np.array(overdue_counted[lo:hi], dtype=bool)
                & np.array(measured[lo:hi], dtype=bool)
                & (
                    np.array(self.sent[lo:hi]) + np.array(self.request_slo_s[lo:hi])
                    < now - self.t0
                )
            )
            for k in (np.nonzero(late_now)[0] + lo).tolist():
                overdue_counted[k] = True
                counts = self.counters[self.model_index[k]]
                counts[_BAD] += 1
                counts[_DECIDED] += 1
        scan = self.overdue_scan_from
        while scan < hi and (answered[scan] or overdue_counted[scan] or not measured[scan]):
            scan += 1
        self.overdue_scan_from = scan

    # 4. Done when everything is sent and answered, or the grace period is over.
    def done(self, now: float) -> bool:
        return (self.i == self.n or self.stopped is not None) and (
            self.outstanding == 0 or now >= self.end_at)

    # 5. Sleep until the next send, a reply or the next monitor tick.
    def wake_at(self) -> float:
        sending = self.i < self.n and self.stopped is None
        return min(self.t0 + self.times[self.i] if sending else self.end_at, self.next_monitor)

    def output(self) -> WorkerOutput:
        outcomes = np.array(self.outcome, dtype=np.int8)
        sent_s = np.array(self.sent, dtype=np.float64)
        unanswered = ~np.array(self.answered, dtype=bool) & ~np.isnan(sent_s)
        outcomes[unanswered] = Outcome.TIMEOUT
        return WorkerOutput(
            sent_s,
            np.array(self.replied, dtype=np.float64),
            outcomes,
            np.array(self.error_kind, dtype=np.int8),
            self.stopped,
        )


def _send_loop(spec: WorkerSpec, t0: float, monitor: Monitor) -> WorkerOutput:
    """Send ``spec.plan`` open-loop from ``t0`` on; record every reply. The hot loop
    (``_Sender`` holds the records and the steps)."""
    sender = _Sender(spec, t0)
    ctx = zmq.Context()
    sock = make_dealer(
        ctx, spec.address, identity=spec.identity, send_hwm_messages=GENERATOR_SEND_HWM
    )
    fd = sock.getsockopt(zmq.FD)
    poll_items = [(sock, _POLLIN)]
    # First on the connection: answers may come coalesced (InferAnswers), one message per batch.
    codec.send_frames_nowait(sock, codec.encode(ClientHello(accepts=[InferAnswers.KIND])))
    monotonic = time.monotonic
    try:
        while True:
            sender.send_due(sock, monotonic())
            sender.read_replies(sock, poll_items)
            now = monotonic()
            if now >= sender.next_monitor:
                sender.monitor(now, monitor)
            if sender.done(now):
                break
            timeout = sender.wake_at() - monotonic()
            if timeout > 0:
                # Step 2 was the last operation on the socket and found nothing queued, so the FD
                # becomes readable when the next message arrives.
                select.select([fd], [], [], timeout)
    finally:
        sock.close(linger=0)
        ctx.term()
    return sender.output()


@dataclass
class _Channels:
    """Shared-memory and synchronisation objects between the coordinator and its workers."""

    counters: Any  # RawArray int64 (workers x models x COUNTERS)
    lag_s: Any  # RawArray float64 (workers)
    ready: Any  # Semaphore: released once by each worker when it is ready to start
    go: Any  # Event: start_at is set, start
    start_at: Any  # RawValue float64: t0
    stop: Any  # Event: stop sending now


def _worker_main(spec: WorkerSpec, slot: int, channels: _Channels, out_path: str) -> None:
    """Entry point of a spawned worker process."""
    width = len(spec.plan.models) * len(COUNTERS)
    base = slot * width
    view = np.frombuffer(channels.counters, dtype=np.int64)

    def publish(counters: IntArray, lag_s: float) -> str | None:
        view[base : base + width] = counters.reshape(-1)
        channels.lag_s[slot] = lag_s
        return "stopped by the coordinator" if channels.stop.is_set() else None

    channels.ready.release()
    if not channels.go.wait(WORKER_START_TIMEOUT_S) or channels.stop.is_set():
        return
    out = _send_loop(spec, float(channels.start_at.value), publish)
    np.savez(
        out_path,
        sent_s=out.sent_s,
        replied_s=out.replied_s,
        outcome=out.outcome,
        error_kind=out.error_kind,
    )


# --------------------------------------------------------------------------- the run


class _Coordinator:
    """Sums every worker's counters, applies the early-stop rule and the lag watch, and draws the
    progress bar."""

    def __init__(self, plan: LoadPlan, bail: BailRule | None, progress: _Progress | None) -> None:
        self.plan = plan
        self.bail = bail
        self.progress = progress
        self.reason: str | None = None
        self.abandoned_lag_s: float | None = None  # stopped: the generator fell behind

    def check(self, counters: IntArray, lag_s: float, t0: float) -> str | None:
        if self.reason is None:
            if lag_s > ABANDON_LAG_S:
                self.reason = f"generator {lag_s:.2f} s behind schedule"
                self.abandoned_lag_s = lag_s
            elif self.bail is not None:
                verdict = self.bail.verdict(counters, self.plan.models)
                if verdict is not None:
                    self.reason = f"early stop: {verdict}"
        if self.progress is not None:
            self.progress.draw(time.monotonic() - t0, counters)
        return self.reason


def run_load(
    plan: LoadPlan,
    address: str | Sequence[str],
    *,
    inputs: dict[str, TensorMap] | None = None,
    workers: int = 1,
    lateness_bound_ms: float = DEFAULT_LATENESS_BOUND_MS,
    bail: BailRule | None = None,
    reply_grace_s: float = DEFAULT_REPLY_GRACE_S,
    progress: bool | None = None,
    refuse_if_behind: bool = True,
    on_start: Callable[[float], None] | None = None,
) -> RunResult:
    """Run ``plan`` against the frontend ``client`` socket at ``address`` (or several frontends:
    worker w sends to ``address[w % len(address)]``).

    ``inputs`` maps each model to the tensors every one of its requests carries (the same arrays,
    sent zero-copy). ``workers`` > 1 spreads the plan over spawned processes. ``progress`` draws a
    bar on stderr (default: only when stderr is a terminal and the run lasts PROGRESS_MIN_S).
    Raises :class:`GeneratorBehindError` when the lateness bound is exceeded (unless
    ``refuse_if_behind`` is False, then the result says ``lateness.behind``). ``on_start(t0)`` is
    called once the start instant is fixed, before the first send (e.g. to align a statistics
    poller with the run).
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if progress is None:
        progress = sys.stderr.isatty() and plan.duration_s >= PROGRESS_MIN_S
    bar = _Progress(plan) if progress else None
    coordinator = _Coordinator(plan, bail, bar)
    spec = WorkerSpec(
        address=address if isinstance(address, str) else address[0],
        plan=plan,
        inputs=dict(inputs or {}),
        identity=_identity(0),
        reply_grace_s=reply_grace_s,
        bail=bail,
    )
    if workers == 1:
        t0 = time.monotonic() + START_DELAY_S
        if on_start is not None:
            on_start(t0)
        out = _send_loop(spec, t0, lambda c, lag: coordinator.check(c, lag, t0))
        outputs = [(np.arange(len(plan)), out)]
    else:
        addresses = [address] if isinstance(address, str) else list(address)
        t0, outputs = _run_processes(spec, workers, coordinator, on_start, addresses)
    if bar is not None:
        bar.close()
    return _assemble(
        plan,
        t0,
        outputs,
        workers=workers,
        lateness_bound_ms=lateness_bound_ms,
        stopped=coordinator.reason,
        abandoned_lag_s=coordinator.abandoned_lag_s,
        refuse_if_behind=refuse_if_behind,
    )


def _identity(worker: int) -> bytes:
    return f"loadgen-{os.getpid()}-{worker}-{os.urandom(4).hex()}".encode()


def _start_workers(
    ctx: Any, spec: WorkerSpec, *, workers: int, channels: _Channels, tmp: str,
    addresses: list[str], procs: list[Any],
) -> list[IntArray]:
    """Spawn one worker per share of the plan (worker w sends requests w, w + workers, ...);
    appends each process to ``procs`` as it starts (so the caller can stop them whatever
    happens) and returns the shares."""
    shares: list[IntArray] = []
    for w in range(workers):
        indices = np.arange(w, len(spec.plan), workers, dtype=np.int64)
        shares.append(indices)
        worker_spec = replace(
            spec,
            plan=spec.plan.subset(indices),
            identity=_identity(w),
            address=addresses[w % len(addresses)],
        )
        proc = ctx.Process(
            target=_worker_main,
            args=(worker_spec, w, channels, os.path.join(tmp, f"worker-{w}.npz")),
            name=f"loadgen-worker-{w}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return shares


def _await_ready(channels: _Channels, procs: list[Any]) -> None:
    """Wait for every worker's ready release; a worker that died first is an error."""
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    for _ in procs:
        while not channels.ready.acquire(timeout=0.1):
            dead = [p.name for p in procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise GeneratorError(f"load generator workers failed to start: {dead}")


def _watch_workers(procs: list[Any], channels: _Channels, coordinator: _Coordinator,
                   n_models: int, t0: float) -> None:
    """Until every worker has exited: sum their counters every MONITOR_INTERVAL_S, and tell
    them all to stop when the coordinator says so."""
    view = np.frombuffer(channels.counters, dtype=np.int64).reshape(len(procs), n_models, -1)
    pending = {p.sentinel for p in procs}
    while pending:
        ready_now = multiprocessing.connection.wait(list(pending), timeout=MONITOR_INTERVAL_S)
        pending.difference_update(ready_now)
        lag = max(channels.lag_s[:])
        if coordinator.check(view.sum(axis=0), lag, t0) is not None:
            channels.stop.set()


def _collect_outputs(procs: list[Any], shares: list[IntArray],
                     tmp: str) -> list[tuple[IntArray, WorkerOutput]]:
    outputs = []
    for w, proc in enumerate(procs):
        proc.join()
        path = os.path.join(tmp, f"worker-{w}.npz")
        if proc.exitcode != 0 or not os.path.exists(path):
            raise GeneratorError(f"load generator worker {w} exited with {proc.exitcode}")
        with np.load(path) as data:
            outputs.append(
                (
                    shares[w],
                    WorkerOutput(
                        data["sent_s"], data["replied_s"], data["outcome"],
                        data["error_kind"], None,
                    ),
                )
            )
    return outputs


def _run_processes(
    spec: WorkerSpec,
    workers: int,
    coordinator: _Coordinator,
    on_start: Callable[[float], None] | None,
    addresses: list[str],
) -> tuple[float, list[tuple[IntArray, WorkerOutput]]]:
    ctx = multiprocessing.get_context("spawn")
    n_models = len(spec.plan.models)
    width = n_models * len(COUNTERS)
    channels = _Channels(
        counters=ctx.RawArray("q", workers * width),
        lag_s=ctx.RawArray("d", workers),
        ready=ctx.Semaphore(0),
        go=ctx.Event(),
        start_at=ctx.RawValue("d", 0.0),
        stop=ctx.Event(),
    )
    tmp = tempfile.mkdtemp(prefix="zserve-loadgen-")
    procs: list[Any] = []
    try:
        shares = _start_workers(ctx, spec, workers=workers, channels=channels, tmp=tmp,
                                addresses=addresses, procs=procs)
        _await_ready(channels, procs)
        t0 = time.monotonic() + START_DELAY_S
        channels.start_at.value = t0
        channels.go.set()
        if on_start is not None:
            on_start(t0)
        _watch_workers(procs, channels, coordinator, n_models, t0)
        return t0, _collect_outputs(procs, shares, tmp)
    finally:
        channels.stop.set()
        channels.go.set()
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
        shutil.rmtree(tmp, ignore_errors=True)


def _assemble(
    plan: LoadPlan,
    t0: float,
    outputs: list[tuple[IntArray, WorkerOutput]],
    *,
    workers: int,
    lateness_bound_ms: float,
    stopped: str | None,
    abandoned_lag_s: float | None,
    refuse_if_behind: bool,
) -> RunResult:
    n = len(plan)
    sent = np.full(n, np.nan)
    replied = np.full(n, np.nan)
    outcome = np.full(n, Outcome.UNSENT, dtype=np.int8)
    error_kind = np.full(n, NO_ERROR, dtype=np.int8)
    for indices, out in outputs:
        sent[indices] = out.sent_s
        replied[indices] = out.replied_s
        outcome[indices] = out.outcome
        error_kind[indices] = out.error_kind
    lateness = lateness_of(plan, sent, lateness_bound_ms)
    if abandoned_lag_s is not None:
        lateness = replace(lateness, behind=True, abandoned_lag_ms=abandoned_lag_s * 1e3)
    result = RunResult(
        plan=plan,
        t0=t0,
        sent_s=sent,
        replied_s=replied,
        outcome=outcome,
        error_kind=error_kind,
        workers=workers,
        lateness=lateness,
        stopped_early=stopped,
    )
    if lateness.behind and refuse_if_behind:
        raise GeneratorBehindError(result)
    return result


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


# --------------------------------------------------------------------------- progress bar


class _Progress:
    """A one-line progress bar on stderr (only drawn when asked: a terminal)."""

    WIDTH = 30

    def __init__(self, plan: LoadPlan) -> None:
        self.plan = plan
        self._last = 0.0

    def draw(self, elapsed_s: float, counters: IntArray) -> None:
        now = time.monotonic()
        if now - self._last < 0.2:
            return
        self._last = now
        total = self.plan.duration_s
        frac = min(1.0, max(0.0, elapsed_s / total)) if total else 1.0
        filled = int(frac * self.WIDTH)
        sent = int(counters[:, _SENT].sum())
        answered = int(counters[:, _DECIDED].sum())
        bad = int(counters[:, _BAD].sum())
        bad_pct = 100.0 * bad / answered if answered else 0.0
        line = (
            f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {elapsed_s:6.1f}/{total:.1f} s "
            f"sent {sent} bad {bad_pct:.2f}%"
        )
        with contextlib.suppress(OSError):
            sys.stderr.write(line)
            sys.stderr.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            sys.stderr.write("\n")
            sys.stderr.flush()
