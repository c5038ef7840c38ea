"""The simulator of the papers' baseline systems: it hosts Nexus's pure cores (the epoch
planner, one ``NexusGpuCore`` per GPU and a deficit-round-robin router per frontend and model)
or Shepherd's ``FlexCore`` on a virtual clock, with the same arrivals, windows, bail rule and
report schema as :mod:`zserve.loadgen.sim.simulator`, so ``zserve sim --policy nexus --search
goodput`` and the experiments search them as they search Symphony.

Nexus's data path has no central scheduler: a request goes from its frontend (chosen at random,
so each of F frontends sees a Poisson share) straight to the GPU its router picks, and waits in
that GPU's queue (with ``-backup``, a GPU whose queue of the model already holds its batch
relays the request to its least utilized backup: ``nexus_gpu.BackupRelay``). Every BEACON_S the
frontends' counts reach the epoch controller, whose new plan
(if an epoch runs) is loaded into every GPU and router. The workload's ``d_ctrl_ms`` and
``d_data_ms`` are not modelled (Nexus plans with its own 2 ms network reserve); a request's
deadline is arrival + SLO - ``reply_ms`` as in the main simulator.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Any

import numpy as np

from zserve.config.policy_names import sim_baseline_frontends
from zserve.loadgen.arrivals import arrival_times, model_rng
from zserve.loadgen.report import ModelOutcome, build_report
from zserve.loadgen.sim.frontends import InvariantError
from zserve.loadgen.sim.report import workload_bound_rps
from zserve.loadgen.workload import Workload
from zserve.scheduler.baselines.flex import DropFlex, FlexCore, PreemptFlexBatch, StartFlexBatch
from zserve.scheduler.baselines.nexus_gpu import (
    BackupRelay,
    DropNexus,
    DrrRouter,
    NexusGpuCore,
    RunNexusBatch,
    backup_gpus,
)
from zserve.scheduler.baselines.nexus_plan import BEACON_S, NexusEpochs, NexusPlan, Session

__all__ = ["BaselineSimulator", "simulate_baseline"]

PENDING, GOOD, LATE, DROPPED = 0, 1, 2, 3
FINISH_EPS_S = 1e-9
BAIL_CHECK_INTERVAL_S = 0.25
BAIL_MIN_BAD = 200
_EV_ARRIVAL, _EV_BATCH_END, _EV_BEACON = 0, 1, 2


class BaselineSimulator:
    """One run of a workload under ``nexus``/``nexus:F`` or ``shepherd-flex``."""

    def __init__(self, workload: Workload, bail_bad_rate: float | None = None) -> None:
        frontends = sim_baseline_frontends(workload.policy)
        if frontends is None:
            raise ValueError(f"policy {workload.policy!r} is not a simulator baseline")
        self.w, self.bail = workload, bail_bad_rate
        self.names = [m.name for m in workload.models]
        self.profiles = {m.name: m.profile for m in workload.models}
        self._build_requests()
        self.is_nexus = workload.policy.startswith("nexus")
        self.status = np.zeros(self.n, dtype=np.int8)
        self.exec = np.full(self.n, np.nan)
        self.finish = np.full(self.n, np.nan)
        self.batches: list[tuple[int, int, float, float, int]] = []  # model, gpu, start, end, bs
        self.wasted_gpu_s = 0.0  # preempted batches' GPU time
        self._running: dict[int, tuple[int, list[int], float]] = {}  # gpu -> token, ids, start
        self._ends: dict[int, float] = {}  # token -> the batch's end
        self._events: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self.frontend_of = np.random.default_rng(workload.seed).integers(0, frontends, self.n)
        self.frontends = frontends
        self.flex = None if self.is_nexus else FlexCore(self.profiles, workload.gpus)
        if self.is_nexus:
            self._build_nexus()
        self.bailed, self.bailed_at = False, math.inf

    def _build_requests(self) -> None:
        w = self.w
        arrivals = [arrival_times(w.arrival.kind, w.arrival.shape, rate, w.duration_s,
                                  model_rng(w.seed, i)) for i, rate in enumerate(w.model_rates())]
        self.arrival = np.concatenate(arrivals) if arrivals else np.empty(0)
        self.model_of = np.concatenate(
            [np.full(len(a), i, dtype=np.int32) for i, a in enumerate(arrivals)])
        slo = np.array([m.slo_s for m in w.models])
        self.deadline = self.arrival + slo[self.model_of] - w.reply_ms / 1e3
        self.n = len(self.arrival)
        self.order = np.argsort(self.arrival, kind="stable").tolist()
        self.window = (w.warmup_s, w.warmup_s + w.measure_s)
        counts = [np.count_nonzero((a >= self.window[0]) & (a < self.window[1]))
                  for a in arrivals]
        self._window_totals = [int(c) for c in counts]
        self._bad = [0] * len(w.models)

    # ------------------------------------------------------------------ Nexus

    def _build_nexus(self) -> None:
        sessions = [Session(m.name, m.profile, m.slo_s, rate)
                    for m, rate in zip(self.w.models, self.w.model_rates(), strict=True)]
        self.epochs = NexusEpochs(sessions, self.w.gpus,
                                  fill=self.w.policy.startswith("nexus-fill"))
        self.gpus = [NexusGpuCore(self.profiles) for _ in range(self.w.gpus)]
        self.with_backups = self.w.policy.partition(":")[0].endswith("-backup")
        self.relay: BackupRelay | None = None
        self._beacon_counts = dict.fromkeys(self.names, 0)
        self._load_plan(0.0, self.epochs.plan)

    def _load_plan(self, now: float, plan: NexusPlan) -> None:
        weights: dict[str, dict[int, float]] = {name: {} for name in self.names}
        lists, runs = backup_gpus(plan) if self.with_backups else ({}, {})
        self.relay = BackupRelay(lists) if self.with_backups else None
        for gpu, core in enumerate(self.gpus):
            held = plan.gpus[gpu] if gpu < len(plan.gpus) else None
            slots = held.slots if held else []
            for slot in slots:
                weights[slot.name][gpu] = weights[slot.name].get(gpu, 0.0) + slot.rate_rps
            outbox: list[object] = []
            core.load_table(now, slots, outbox, duty_cycle_s=held.duty_cycle_s if held else 0.0,
                            backups=runs.get(gpu, []))
            self._apply(now, gpu, outbox)
        self.routers = [{name: DrrRouter(w) if w else None for name, w in weights.items()}
                        for _ in range(self.frontends)]

    def _nexus_arrival(self, now: float, rid: int) -> None:
        model = self.names[int(self.model_of[rid])]
        self._beacon_counts[model] += 1
        router = self.routers[int(self.frontend_of[rid])][model]
        if router is None:  # no GPU holds the session this epoch
            self._answer_dropped([rid])
            return
        gpu = router.pick()
        if self.relay is not None:
            gpu = self.relay.place(model, gpu, self.gpus, now)
        outbox: list[object] = []
        self.gpus[gpu].on_request(now, model, rid, float(self.deadline[rid]), outbox)
        self._apply(now, gpu, outbox)

    def _beacon(self, now: float) -> None:
        plan = self.epochs.on_beacon(now, self._beacon_counts)
        self._beacon_counts = dict.fromkeys(self.names, 0)
        if plan is not None:
            self._load_plan(now, plan)
        if now + BEACON_S < self.w.duration_s:
            self._push(now + BEACON_S, _EV_BEACON, -1)

    # ------------------------------------------------------------------ both

    def _push(self, t: float, kind: int, idx: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, idx))

    def _apply(self, now: float, gpu: int, outbox: list[object]) -> None:
        """What a core decided: batches start (their end becomes an event), drops are answered,
        a preempted batch's GPU time is lost."""
        for msg in outbox:
            if isinstance(msg, (RunNexusBatch, StartFlexBatch)):
                where = msg.gpu if isinstance(msg, StartFlexBatch) else gpu
                self._start(now, where, msg.model, msg.request_ids, msg.finish_at)
            elif isinstance(msg, (DropNexus, DropFlex)):
                self._answer_dropped(msg.request_ids)
            elif isinstance(msg, PreemptFlexBatch):
                token, ids, started = self._running.pop(msg.gpu)
                del self._ends[token]
                self.wasted_gpu_s += now - started
                self.exec[ids] = np.nan

    def _start(self, now: float, gpu: int, model: str, ids: list[int], finish: float) -> None:
        if gpu in self._running:  # a batch that ends at this instant, its event not yet popped
            token = self._running[gpu][0]
            if self._ends[token] > now:
                raise InvariantError(f"GPU {gpu} runs two batches at once ({model} at {now})")
            self._finish_batch(gpu)
        self._seq += 1
        token = self._seq
        self._running[gpu] = (token, ids, now)
        self._ends[token] = finish
        self.exec[ids] = now
        heapq.heappush(self._events, (finish, token, _EV_BATCH_END, gpu))

    def _batch_end(self, now: float, gpu: int, token: int) -> None:
        running = self._running.get(gpu)
        if running is None or running[0] != token:
            return  # preempted, or finished when its GPU's next batch started
        self._finish_batch(gpu)
        outbox: list[object] = []
        if self.is_nexus:
            self.gpus[gpu].on_timer(now, outbox)
        else:
            assert self.flex is not None
            self.flex.on_timer(now, outbox)
        self._apply(now, gpu, outbox)

    def _finish_batch(self, gpu: int) -> None:
        """The batch on ``gpu`` ends (at its own end time): its requests are answered."""
        token, ids, started = self._running.pop(gpu)
        now = self._ends.pop(token)
        good = now <= self.deadline[ids] + FINISH_EPS_S
        self.status[ids] = np.where(good, GOOD, LATE)
        self.finish[ids] = now
        model = int(self.model_of[ids[0]])
        self.batches.append((model, gpu, started, now, len(ids)))
        self._count_bad([i for i, g in zip(ids, good, strict=True) if not g])

    def _answer_dropped(self, ids: list[int]) -> None:
        self.status[ids] = DROPPED
        self._count_bad(ids)

    def _count_bad(self, ids: list[int]) -> None:
        lo, hi = self.window
        for i in ids:
            if lo <= self.arrival[i] < hi:
                self._bad[int(self.model_of[i])] += 1

    def _should_bail(self) -> bool:
        return self.bail is not None and any(
            bad >= BAIL_MIN_BAD and bad > self.bail * total
            for bad, total in zip(self._bad, self._window_totals, strict=True))

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        if self.is_nexus:
            self._push(BEACON_S, _EV_BEACON, -1)
        pos, next_check = 0, self.window[0] + BAIL_CHECK_INTERVAL_S
        times = self.arrival
        while True:
            next_arrival = float(times[self.order[pos]]) if pos < self.n else math.inf
            if self._events and self._events[0][0] < next_arrival:
                now, seq, kind, idx = heapq.heappop(self._events)
                if kind == _EV_BATCH_END:
                    self._batch_end(now, idx, seq)
                else:
                    self._beacon(now)
                continue
            if pos >= self.n:
                break
            self._arrive(next_arrival, self.order[pos])
            pos += 1
            if next_arrival >= next_check:
                next_check = next_arrival + BAIL_CHECK_INTERVAL_S
                if self._should_bail():
                    self.bailed, self.bailed_at = True, next_arrival
                    break
        return self._report(time.perf_counter() - started)

    def _arrive(self, now: float, rid: int) -> None:
        if self.is_nexus:
            self._nexus_arrival(now, rid)
            return
        assert self.flex is not None
        outbox: list[object] = []
        model = self.names[int(self.model_of[rid])]
        self.flex.on_request(now, model, rid, float(self.deadline[rid]), outbox)
        self._apply(now, -1, outbox)

    # ------------------------------------------------------------------ report

    def _report(self, wall_s: float) -> dict[str, Any]:
        w = self.w
        lo, hi = self.window[0], min(self.window[1], self.bailed_at)
        hi = max(lo, hi)
        in_window = (self.arrival >= lo) & (self.arrival < hi)
        if self.bailed:
            in_window &= self.status != PENDING
        elif np.any(self.status == PENDING):
            raise InvariantError(f"{int(np.count_nonzero(self.status == PENDING))} requests "
                                 "never answered")
        batches = np.array(self.batches, dtype=np.float64).reshape(-1, 5)
        outcomes = [self._outcome(i, in_window, batches, lo, hi) for i in range(len(w.models))]
        busy = 0.0
        if len(batches) and hi > lo:
            spans = np.clip(batches[:, 3], lo, hi) - np.clip(batches[:, 2], lo, hi)
            busy = float(spans.sum()) / (w.gpus * (hi - lo))
        return build_report(
            outcomes, source="sim", workload=w.name, policy=w.policy,
            drop="nexus-early-drop" if self.is_nexus else "flex-alone", seed=w.seed,
            gpus=w.gpus, measure_s=hi - lo if hi > lo else w.measure_s,
            gpu_busy_fraction=busy, bound_rps=workload_bound_rps(w),
            extra=self._extra(wall_s))

    def _outcome(self, i: int, in_window: np.ndarray[Any, Any], batches: np.ndarray[Any, Any],
                 lo: float, hi: float) -> ModelOutcome:
        mask = in_window & (self.model_of == i)
        status = self.status[mask]
        served = (status == GOOD) | (status == LATE)
        arrival = self.arrival[mask][served]
        mine = batches[(batches[:, 0] == i) & (batches[:, 2] >= lo) & (batches[:, 2] < hi)]
        spec = self.w.models[i]
        return ModelOutcome(
            name=spec.name, slo_ms=spec.slo_ms, total=int(mask.sum()),
            good=int(np.count_nonzero(status == GOOD)),
            late=int(np.count_nonzero(status == LATE)),
            dropped=int(np.count_nonzero(status == DROPPED)),
            latencies_ms=(self.finish[mask][served] + self.w.reply_ms / 1e3 - arrival) * 1e3,
            queueing_ms=(self.exec[mask][served] - arrival) * 1e3,
            batch_sizes=mine[:, 4].astype(np.int64))

    def _extra(self, wall_s: float) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "rate_rps": self.w.rate, "arrival": str(self.w.arrival), "bailed": self.bailed,
            "wall_s": round(wall_s, 3), "sim_requests": self.n,
            "frontends": {"count": self.frontends}}
        if self.is_nexus:
            plan = self.epochs.plan
            extra["nexus"] = {
                "epochs": [[round(t, 3), reason] for t, reason in self.epochs.epochs],
                "gpus_planned": len(plan.gpus),
                "plan": [[[s.name, s.batch, round(s.rate_rps, 1)] for s in g.slots]
                         for g in plan.gpus],
                "unassigned_rps": {k: round(v, 1) for k, v in plan.unassigned_rps.items()},
                "relayed": self.relay.relayed if self.relay is not None else None}
        else:
            assert self.flex is not None
            extra["flex"] = {"preemptions": self.flex.preemptions,
                             "wasted_gpu_s": round(self.wasted_gpu_s, 4)}
        return extra


def simulate_baseline(workload: Workload, bail_bad_rate: float | None = None) -> dict[str, Any]:
    """Run one simulation of a baseline policy and return its report."""
    return BaselineSimulator(workload, bail_bad_rate).run()
