"""Discrete-event simulator: the real ModelThread/RankThread objects on a virtual clock.

The simulator hosts one :class:`ModelThread` per model, one :class:`RankThread` and one
:class:`~zserve.backends.follower.PlanFollower` per GPU exactly as the process runtime does (same
calls, same messages). Scheduler messages are delivered at once, in order; a BatchPlan reaches its
GPU's follower ``d_ctrl`` after the grant, and the inputs it fetches come back ``d_data`` per
request later (the allowances the ModelThreads plan with). The follower decides the start, sheds
rows that would finish late (answered like the live backend: they count as dropped) and reports
the device-free time, which the rank's drift correction reads. Each batch then runs for exactly
l(bs) (the emulated executor). Arrivals come from ``zserve.loadgen.arrivals`` with one frontend
(``sim``); with ``sim_tick_ms > 0`` each model's arrivals are coalesced per tick (as a frontend
coalesces them per event-loop tick), else each arrival instant is its own chunk.

Invariants, checked on every run (an :class:`InvariantError` stops the run loudly):

- no GPU is planned or runs two batches at once, and no plan is granted after its ``exec_at``;
- every request is planned at most once and ends exactly once (good, late, or dropped), and none
  is left at the end;
- no batch is planned or starts after its latest moment (it finishes by its earliest deadline);
- a request counts as good only if it finishes by its deadline.

A run covers warmup + measure + cooldown of arrivals and then drains; only requests that arrive in
the measure window are counted.
"""

from __future__ import annotations

import heapq
import math
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from zserve.backends.follower import DEST_DEVICE, SHED_GRACE_FRACTION, PlanFollower, RunBatch
from zserve.hosting import Outbox
from zserve.loadgen.arrivals import arrival_times, model_rng
from zserve.loadgen.report import ModelOutcome, build_report
from zserve.loadgen.workload import Workload
from zserve.policies import SchedulePolicy
from zserve.scheduler.bounds import staggered_bound_rps
from zserve.scheduler.common import FEASIBILITY_EPS_S
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import (
    BatchFailed,
    BatchPlan,
    BatchStats,
    CandidateUpdate,
    DropNotice,
    GrantAnswer,
    InputFetch,
    InputReply,
    Message,
)

FRONTEND = "sim"
_PENDING, _GOOD, _LATE, _DROPPED = 0, 1, 2, 3
_EV_ARRIVAL, _EV_MODEL, _EV_RANK = 0, 1, 2
# GPU events (idx = gpu id): a plan or inputs reach its follower, its timer, its batch ends.
_EV_PLAN, _EV_INPUTS, _EV_GPU_TIMER, _EV_DONE = 3, 4, 5, 6
BAIL_CHECK_INTERVAL_S = 0.25
BAIL_MIN_BAD = 200
"""A bailing run stops once a model has at least this many bad requests in the measure window
and its bad rate so far exceeds the bail threshold."""


class InvariantError(AssertionError):
    """The schedule broke an invariant: a bug in the scheduler (or the simulator)."""


@dataclass
class SimConfig:
    """Knobs for one simulator run beyond the workload file."""

    check: bool = True
    bail_bad_rate: float | None = None  # stop early once the worst bad rate clearly exceeds it
    record_plans: bool = False
    keep_tolerance: float | None = None  # None: the workload's


def workload_bound_rps(w: Workload) -> float:
    """The staggered bound of a workload (DESIGN section 3) under its allowances."""
    shares = w.shares()
    models = [
        (m.profile, (m.slo_ms - w.reply_ms - w.d_ctrl_ms) / 1e3, share)
        for m, share in zip(w.models, shares, strict=True)
    ]
    bound_rps: float = staggered_bound_rps(models, w.gpus, w.d_data_ms / 1e3)
    return bound_rps


def _arrivals_of(w: Workload, replayed: list[np.ndarray[Any, Any]] | None,
                 ) -> list[np.ndarray[Any, Any]]:
    """One sorted array of arrival times per model: ``replayed``, else drawn from the workload's
    arrival process with each model's own seed."""
    if replayed is not None:
        return [np.asarray(replayed[i], dtype=np.float64) for i in range(len(w.models))]
    return [
        arrival_times(w.arrival.kind, w.arrival.shape, rate, w.duration_s, model_rng(w.seed, i))
        for i, rate in enumerate(w.model_rates())
    ]


class Simulator:
    """One simulated run of a workload; :meth:`run` returns a report dict."""

    def __init__(
        self,
        workload: Workload,
        config: SimConfig | None = None,
        arrivals: list[np.ndarray[Any, Any]] | None = None,
    ) -> None:
        """``arrivals`` (one sorted array of times per model) replaces the workload's arrival
        process (tests replay exact traces with it)."""
        self.w = workload
        self.config = config or SimConfig()
        w = workload
        self.policy = SchedulePolicy.parse(w.policy, w.drop)
        tol = self.config.keep_tolerance
        self.keep_tolerance = w.keep_tolerance if tol is None else tol
        reply_s = w.reply_ms / 1e3
        d_ctrl_s, d_data_s = w.d_ctrl_ms / 1e3, w.d_data_ms / 1e3
        self.models, self.rank, self.followers = self._build_roles(d_ctrl_s, d_data_s)
        self.index = {m.name: i for i, m in enumerate(w.models)}
        self.d_ctrl_s, self.d_data_s = d_ctrl_s, d_data_s
        self.arrivals = _arrivals_of(w, arrivals)
        self.offsets = [0, *np.cumsum([len(a) for a in self.arrivals])[:-1].tolist()]
        total = sum(len(a) for a in self.arrivals)
        self.n_requests = total
        self.arrival_all = np.concatenate(self.arrivals) if total else np.empty(0)
        self.model_of = np.concatenate(
            [np.full(len(a), i, dtype=np.int32) for i, a in enumerate(self.arrivals)]
        ) if total else np.empty(0, dtype=np.int32)
        slo_by_model = np.array([m.slo_s for m in w.models])
        self.deadline_all = self.arrival_all + slo_by_model[self.model_of] - reply_s
        self.status = np.zeros(total, dtype=np.int8)
        self.planned = np.zeros(total, dtype=np.bool_)
        self.finish = np.full(total, np.nan)
        self.exec = np.full(total, np.nan)
        self.gpu_planned_until = [0.0] * w.gpus  # the grants' view
        self.gpu_busy_until = [0.0] * w.gpus  # the batches the followers ran
        self.backend_failed: dict[str, int] = {}  # requests a follower answered, by error
        self.late_starts = 0  # batches a follower started after their exec_at
        self.batches: list[tuple[int, int, float, float, int]] = []  # model, gpu, exec, end, bs
        self.plans: list[BatchPlan] = []  # with SimConfig.record_plans
        self.window = (w.warmup_s, w.warmup_s + w.measure_s)
        self.bailed = False
        self._events: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._model_wake = [math.inf] * len(self.models)
        self._rank_wake = math.inf
        self._gpu_wake = [math.inf] * w.gpus
        self._payloads: dict[int, Message] = {}  # event seq -> the plan or inputs it delivers
        self._plan_seq = 0
        self._inputs_due: dict[int, float] = {}  # plan id -> when its inputs are in
        self._ptr = [0] * len(self.models)
        self._now = 0.0
        self._measured_dropped = [0] * len(self.models)

    def _build_roles(self, d_ctrl_s: float, d_data_s: float,
                     ) -> tuple[list[ModelThread], RankThread, list[PlanFollower]]:
        """One ModelThread per model, the RankThread, and one PlanFollower per GPU, configured
        as the live processes configure theirs."""
        w = self.w
        reply_s = w.reply_ms / 1e3
        models = [
            ModelThread(
                m.name, m.profile, m.slo_s, self.policy, d_ctrl_s=d_ctrl_s, d_data_s=d_data_s,
                jitter_s=w.jitter_ms / 1e3,
                budget_s=m.slo_s - reply_s - d_ctrl_s,
                keep_tolerance=self.keep_tolerance,
            )
            for m in w.models
        ]
        followers = [
            PlanFollower(f"gpu-{gpu}", shed_grace_s=SHED_GRACE_FRACTION * reply_s)
            for gpu in range(w.gpus)
        ]
        for follower in followers:
            for m in w.models:
                follower.add_model(m.name, m.profile.table_s, m.profile.max_batch)
        return models, RankThread(list(range(w.gpus)), 0.0), followers

    # ------------------------------------------------------------------ event plumbing

    def _push(self, t: float, kind: int, idx: int, payload: Message | None = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, idx))
        if payload is not None:
            self._payloads[self._seq] = payload

    def _resched_model(self, i: int) -> None:
        wake = self.models[i].wake_at
        if wake != self._model_wake[i]:
            self._model_wake[i] = wake
            if wake < math.inf:
                self._push(wake, _EV_MODEL, i)

    def _resched_rank(self) -> None:
        wake = self.rank.wake_at
        if wake != self._rank_wake:
            self._rank_wake = wake
            if wake < math.inf:
                self._push(wake, _EV_RANK, -1)

    def _resched_gpu(self, gpu: int) -> None:
        wake = self.followers[gpu].wake_at
        if wake != self._gpu_wake[gpu]:
            self._gpu_wake[gpu] = wake
            if wake < math.inf:
                self._push(wake, _EV_GPU_TIMER, gpu)

    def _dispatch(self, now: float, outbox: Outbox) -> None:
        rank = self.rank
        models = self.models
        index = self.index
        touched: set[int] = set()
        pos = 0
        while pos < len(outbox):
            dest, msg = outbox[pos]
            pos += 1
            kind = dest[0]
            if kind == "rank":
                if type(msg) is CandidateUpdate:
                    rank.on_candidate(now, msg, outbox)
                else:
                    assert isinstance(msg, GrantAnswer)
                    rank.on_grant_answer(now, msg, outbox)
            elif kind == "model":
                i = index[str(dest[1])]
                models[i].on_grant(now, msg, outbox)
                touched.add(i)
            elif kind == "backend":
                assert isinstance(msg, BatchPlan)
                self._on_plan(now, msg)
            elif kind == "frontend":
                assert isinstance(msg, DropNotice)
                self._on_drop(now, msg)
        outbox.clear()
        for i in touched:
            self._resched_model(i)
        self._resched_rank()

    # ------------------------------------------------------------------ the GPUs' followers

    def _fail(self, message: str) -> None:
        raise InvariantError(f"t={self._now:.6f}: {message}")

    def _on_plan(self, now: float, plan: BatchPlan) -> None:
        """A grant's plan: check it, then send it to its GPU's follower (``d_ctrl`` away)."""
        ids = np.array(plan.request_ids, dtype=np.int64)
        if self.config.check:
            self._check_plan(now, plan, ids)
        self.planned[ids] = True
        self.gpu_planned_until[plan.gpu_id] = plan.expected_finish_at
        if self.config.record_plans:
            self.plans.append(plan)
        # Plan ids are per ModelThread; one follower holds plans of every model: renumber them
        # (as a shard does).
        self._plan_seq += 1
        plan = msgspec.structs.replace(plan, plan_id=self._plan_seq)
        self._push(now + self.d_ctrl_s, _EV_PLAN, plan.gpu_id, plan)
        # The inputs are in at grant + delay(bs), summed as the ModelThread sums it (so an
        # on-time plan's inputs are never an ulp late).
        self._inputs_due[plan.plan_id] = now + (self.d_ctrl_s + self.d_data_s * len(ids))

    def _check_plan(self, now: float, plan: BatchPlan, ids: np.ndarray[Any, Any]) -> None:
        eps = FEASIBILITY_EPS_S
        i = self.index[plan.model]
        bs = len(ids)
        finish = plan.exec_at + self.w.models[i].profile.latency(bs)
        if plan.exec_at < now - eps:
            self._fail(f"plan {plan.model}#{plan.plan_id} reached GPU {plan.gpu_id} after its "
                       f"exec_at {plan.exec_at:.6f}")
        if plan.exec_at < self.gpu_planned_until[plan.gpu_id] - eps:
            self._fail(f"GPU {plan.gpu_id} runs two batches at once: {plan.model} starts "
                       f"{plan.exec_at:.6f} before {self.gpu_planned_until[plan.gpu_id]:.6f}")
        if abs(finish - plan.expected_finish_at) > eps:
            self._fail(f"plan {plan.model}#{plan.plan_id}: expected_finish_at mismatch")
        if bs == 0 or bs > self.w.models[i].profile.max_batch:
            self._fail(f"plan {plan.model}#{plan.plan_id}: infeasible batch size {bs}")
        if np.any(self.planned[ids]) or np.any(self.status[ids] != _PENDING):
            self._fail(f"plan {plan.model}#{plan.plan_id}: a request ends twice")
        if np.any(self.model_of[ids] != i):
            self._fail(f"plan {plan.model}#{plan.plan_id}: request of another model")
        if finish > float(self.deadline_all[ids].min()) + eps:
            self._fail(f"plan {plan.model}#{plan.plan_id} starts after its latest moment "
                       f"(finishes {finish:.6f} > earliest deadline "
                       f"{self.deadline_all[ids].min():.6f})")

    def _on_gpu_event(self, now: float, kind: int, gpu: int, seq: int) -> None:
        follower = self.followers[gpu]
        outbox: Outbox = []
        if kind == _EV_PLAN:
            plan = self._payloads.pop(seq)
            assert isinstance(plan, BatchPlan)
            follower.on_plan(now, plan, outbox)
        elif kind == _EV_INPUTS:
            reply = self._payloads.pop(seq)
            assert isinstance(reply, InputReply)
            follower.on_input_reply(now, FRONTEND, reply, outbox)
        elif kind == _EV_DONE:
            follower.on_batch_done(now, ok=True, finished_at=now, outbox=outbox)
        else:
            if follower.wake_at != now or self._gpu_wake[gpu] != now:
                return
            self._gpu_wake[gpu] = math.inf
            follower.on_timer(now, outbox)
        self._deliver_follower(now, gpu, outbox)

    def _deliver_follower(self, now: float, gpu: int, outbox: Outbox) -> None:
        """A follower's outbox: fetches are answered ``d_data`` per request later, answered
        requests end as dropped, batches run, and device-free reports reach the rank."""
        rank_outbox: Outbox = []
        for (kind, _), msg in outbox:
            if kind == DEST_DEVICE:
                assert isinstance(msg, RunBatch)
                self._run_batch(now, gpu, msg)
            elif type(msg) is InputFetch:
                ids = msg.request_ids
                reply = InputReply(msg.plan_id, ids, [{}] * len(ids), [])
                due = self._inputs_due.pop(msg.plan_id, now + self.d_data_s * len(ids))
                self._push(max(now, due), _EV_INPUTS, gpu, reply)
            elif type(msg) is BatchFailed:
                self._on_backend_failed(msg)
            elif type(msg) is BatchStats and msg.device_free_at > 0.0:
                self.rank.on_device_free_at(now, gpu, msg.device_free_at, rank_outbox)
        self._resched_gpu(gpu)
        if rank_outbox:
            self._dispatch(now, rank_outbox)
        self._resched_rank()

    def _run_batch(self, now: float, gpu: int, run: RunBatch) -> None:
        """The emulated executor: the batch runs for exactly l(bs) from its start."""
        plan = run.plan
        ids = np.array([plan.request_ids[row] for row in run.rows], dtype=np.int64)
        bs = len(ids)
        i = self.index[plan.model]
        finish = now + self.w.models[i].profile.latency(bs)
        deadlines = self.deadline_all[ids]
        if self.config.check:
            eps = FEASIBILITY_EPS_S
            if now < self.gpu_busy_until[gpu] - eps:
                self._fail(f"GPU {gpu} runs two batches at once: {plan.model} starts "
                           f"{now:.6f} before {self.gpu_busy_until[gpu]:.6f}")
            if np.any(self.status[ids] != _PENDING):
                self._fail(f"batch {plan.model} on GPU {gpu}: a request ends twice")
            if finish > float(deadlines.min()) + eps:
                self._fail(f"batch {plan.model} on GPU {gpu} starts after its latest moment "
                           f"(finishes {finish:.6f} > earliest deadline {deadlines.min():.6f})")
        if now > plan.exec_at + FEASIBILITY_EPS_S:
            self.late_starts += 1
        good = finish <= deadlines + FEASIBILITY_EPS_S
        self.status[ids] = np.where(good, _GOOD, _LATE)
        self.finish[ids] = finish
        self.exec[ids] = now
        self.gpu_busy_until[gpu] = finish
        self.batches.append((i, gpu, now, finish, bs))
        self._push(finish, _EV_DONE, gpu)

    def _on_backend_failed(self, failed: BatchFailed) -> None:
        """Requests a follower answered itself (late shedding, inputs that did not come)."""
        self.backend_failed[failed.error] = (
            self.backend_failed.get(failed.error, 0) + len(failed.request_ids))
        self._end_dropped(np.array(failed.request_ids, dtype=np.int64))

    def _on_drop(self, now: float, notice: DropNotice) -> None:
        self._end_dropped(np.array(notice.request_ids, dtype=np.int64))

    def _end_dropped(self, ids: np.ndarray[Any, Any]) -> None:
        if self.config.check and np.any(self.status[ids] != _PENDING):
            self._fail("a dropped request had already ended")
        self.status[ids] = _DROPPED
        arr = self.arrival_all[ids]
        lo, hi = self.window
        counted = int(np.count_nonzero((arr >= lo) & (arr < hi)))
        if counted:
            i = int(self.model_of[ids[0]])
            self._measured_dropped[i] += counted

    # ------------------------------------------------------------------ main loop

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        tick = self.w.sim_tick_ms / 1e3
        for i, times in enumerate(self.arrivals):
            if len(times):
                self._push(float(times[0]) + tick, _EV_ARRIVAL, i)
        events = self._events
        models = self.models
        outbox: Outbox = []
        arrivals = _ArrivalFeed(self, tick)
        bail = self.config.bail_bad_rate
        next_bail_check = self.window[0] + BAIL_CHECK_INTERVAL_S
        while events:
            now, seq, kind, idx = heapq.heappop(events)
            self._now = now
            if kind == _EV_ARRIVAL:
                arrivals.deliver(now, idx, outbox)
                self._dispatch(now, outbox)
                self._resched_model(idx)
                if bail is not None and now >= next_bail_check:
                    next_bail_check = now + BAIL_CHECK_INTERVAL_S
                    if self._should_bail(bail, now):
                        self.bailed = True
                        break
            elif kind == _EV_MODEL:
                if models[idx].wake_at != now or self._model_wake[idx] != now:
                    continue
                self._model_wake[idx] = math.inf
                models[idx].on_timer(now, outbox)
                self._dispatch(now, outbox)
                self._resched_model(idx)
            elif kind == _EV_RANK:
                if self.rank.wake_at != now or self._rank_wake != now:
                    continue
                self._rank_wake = math.inf
                self.rank.on_timer(now, outbox)
                self._dispatch(now, outbox)
            else:
                self._on_gpu_event(now, kind, idx, seq)
        wall = time.perf_counter() - started
        if not self.bailed and self.config.check and np.any(self.status == _PENDING):
            left = int(np.count_nonzero(self.status == _PENDING))
            self._fail(f"{left} requests never ended")
        return self._report(wall)

    def _should_bail(self, bail: float, now: float) -> bool:
        lo_w = self.window[0]
        for i, dropped in enumerate(self._measured_dropped):
            if dropped < BAIL_MIN_BAD:
                continue
            times = self.arrivals[i]
            arrived = int(np.searchsorted(times, now, side="right")) - int(
                np.searchsorted(times, lo_w, side="left"))
            if dropped > bail * arrived:
                return True
        return False

    # ------------------------------------------------------------------ results

    def _report(self, wall_s: float) -> dict[str, Any]:
        w = self.w
        lo_w, hi_w = self.window
        in_window = (self.arrival_all >= lo_w) & (self.arrival_all < hi_w)
        batches = np.array(self.batches, dtype=np.float64).reshape(-1, 5)
        outcomes = [self._outcome(i, in_window, batches) for i in range(len(w.models))]
        busy = 0.0
        if len(batches):
            starts = np.clip(batches[:, 2], lo_w, hi_w)
            ends = np.clip(batches[:, 3], lo_w, hi_w)
            busy = float(np.sum(ends - starts)) / (w.gpus * w.measure_s)
        try:
            bound = workload_bound_rps(w)
        except (ValueError, ZeroDivisionError):
            bound = None
        report: dict[str, Any] = build_report(
            outcomes, source="sim", workload=w.name, policy=self.policy.name,
            drop=self.policy.drop_name, seed=w.seed, gpus=w.gpus, measure_s=w.measure_s,
            gpu_busy_fraction=busy, bound_rps=bound, extra=self._extra(wall_s),
        )
        return report

    def _outcome(self, i: int, in_window: np.ndarray[Any, Any],
                 batches: np.ndarray[Any, Any]) -> ModelOutcome:
        """Model ``i``'s requests that arrived in the measure window (after a bailed run,
        pending requests count as bad) and its batches that started in it."""
        spec = self.w.models[i]
        lo_w, hi_w = self.window
        base = self.offsets[i]
        sl = slice(base, base + len(self.arrivals[i]))
        mask = in_window[sl]
        status = self.status[sl][mask]
        a = self.arrival_all[sl][mask]
        served = (status == _GOOD) | (status == _LATE)
        reply_s = self.w.reply_ms / 1e3
        latencies = (self.finish[sl][mask][served] + reply_s - a[served]) * 1e3
        queueing = (self.exec[sl][mask][served] - a[served]) * 1e3
        mine = batches[(batches[:, 0] == i) & (batches[:, 2] >= lo_w) & (batches[:, 2] < hi_w)]
        return ModelOutcome(
            name=spec.name,
            slo_ms=spec.slo_ms,
            total=int(mask.sum()),
            good=int(np.count_nonzero(status == _GOOD)),
            late=int(np.count_nonzero(status == _LATE)),
            dropped=int(np.count_nonzero(status == _DROPPED)),
            latencies_ms=latencies,
            queueing_ms=queueing,
            batch_sizes=mine[:, 4].astype(np.int64),
        )

    def _extra(self, wall_s: float) -> dict[str, Any]:
        """The simulator's own report keys."""
        w = self.w
        rank = self.rank
        return {
            "rate_rps": w.rate,
            "arrival": str(w.arrival),
            "bailed": self.bailed,
            "wall_s": round(wall_s, 3),
            "sim_requests": self.n_requests,
            "sim_rps_wall": round(self.n_requests / wall_s, 1) if wall_s > 0 else None,
            "rank": {
                "grants": rank.n_grants,
                "model_matches": rank.n_model_matches,
                "gpu_matches": rank.n_gpu_matches,
                "stale": rank.n_stale,
                "purged": rank.n_purged,
            },
            "keep_tolerance": self.keep_tolerance,
            "backends": {
                "late_starts": self.late_starts,
                "answered": dict(self.backend_failed),
                "drift_corrections": rank.n_drift_corrections,
            },
            "allowances_ms": {"d_ctrl": w.d_ctrl_ms, "d_data": w.d_data_ms, "reply": w.reply_ms,
                              "jitter": w.jitter_ms},
        }


class _ArrivalFeed:
    """Each model's arrivals cut into the chunks a frontend sends (per tick, or per arrival
    instant) and fed to its ModelThread."""

    def __init__(self, sim: Simulator, tick_s: float) -> None:
        self.sim = sim
        self.tick_s = tick_s
        self.times = [a.tolist() for a in sim.arrivals]
        self.deadlines = [
            sim.deadline_all[base : base + len(a)].tolist()
            for base, a in zip(sim.offsets, sim.arrivals, strict=True)
        ]

    def deliver(self, now: float, idx: int, outbox: Outbox) -> None:
        """The chunk of model ``idx`` due at ``now``; schedules the next one."""
        sim = self.sim
        times = self.times[idx]
        start = sim._ptr[idx]
        stop = start + 1
        if self.tick_s:
            stop = bisect_right(times, now, start)
        else:
            while stop < len(times) and times[stop] == now:
                stop += 1
        sim._ptr[idx] = stop
        base = sim.offsets[idx]
        sim.models[idx].on_arrivals(
            now, FRONTEND, list(range(base + start, base + stop)), times[start:stop],
            self.deadlines[idx][start:stop], outbox,
        )
        if stop < len(times):
            sim._push(times[stop] + self.tick_s, _EV_ARRIVAL, idx)


def simulate(workload: Workload, config: SimConfig | None = None) -> dict[str, Any]:
    """Run one simulation and return its report."""
    return Simulator(workload, config).run()
