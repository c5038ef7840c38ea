"""Discrete-event simulator: the real FrontendCore, ModelThread, RankThread and followers.

The simulator hosts one :class:`~zserve.frontend.core.FrontendCore` per frontend (``SimFrontend``,
one by default), one :class:`~zserve.scheduler.core.SchedulerCore` (a :class:`ModelThread` per
model and the :class:`RankThread`, embedded as in a cluster of ``shards = 0``) and one
:class:`~zserve.backends.follower.PlanFollower` per GPU exactly as the process runtime does (same
calls, same messages). Arrivals reach a frontend's core, which admits them (or answers them at
once: OVERLOADED, BAD_REQUEST ...); at the end of each tick (every event at one instant, or
``sim_tick_ms`` after the tick's first admission) its metadata reaches the scheduler core.
Messages between the ModelThreads and the RankThread are delivered at once, in order, by the
core; a BatchPlan reaches its GPU's follower ``d_ctrl`` after the grant, where it is acknowledged
at once (the shard's ``ShardPlanAcks`` holds each plan as a live shard does and checks the
acknowledgement against its allowance, d_ctrl + ``PLAN_ACK_MARGIN_S``; a simulated backend
never hangs, so none is ever suspected), the follower fetches the inputs from the frontend's
core, and they come back ``d_data`` per request later (the allowances the ModelThreads plan
with). The follower decides the start, sheds rows that would finish late (answered through the
frontend's core, like the live backend) and reports the device-free time, which the rank's
drift correction reads. Each batch runs for
exactly l(bs) (the emulated executor) and its outputs go to the core, which answers the client;
drops, backend failures and deadlines (the core's ``wake_at`` timer) are answered by the core
too. The report counts outcomes by those answers. With ``SimConfig.hops`` the plan delivery and
input fetch, the scheduler timer's lateness and the reply take drawn latencies instead of their
allowances (``loadgen/sim/hops.py``; a request is then good when answered within its whole SLO),
and with ``learned_allowances`` the core and the frontends learn their allowances from them.

Invariants, checked on every run (an :class:`InvariantError` stops the run loudly):

- no GPU is planned or runs two batches at once, and no plan is granted after its ``exec_at``;
- every request is planned at most once, runs at most once and is answered exactly once (good,
  late, dropped or refused), and none is left unanswered at the end;
- no batch is planned or starts after its latest moment (it finishes by its earliest deadline);
- a request counts as good only if its outputs are answered by its deadline.

A run covers warmup + measure + cooldown of arrivals and then drains; only requests that arrive in
the measure window are counted.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zserve.backends.follower import DEST_DEVICE, SHED_GRACE_FRACTION, PlanFollower, RunBatch
from zserve.config.cluster import ClusterConfig
from zserve.config.policy_names import SchedulePolicy, sim_baseline_frontends
from zserve.config.profiles import LatencyProfile
from zserve.core.hosting import DEST_BACKEND, DEST_FRONTEND, Outbox
from zserve.loadgen.arrivals import arrival_times, model_rng
from zserve.loadgen.sim.baselines import simulate_baseline
from zserve.loadgen.sim.elastic import ElasticConfig, ElasticGpus
from zserve.loadgen.sim.frontends import (
    PENDING,
    AnswerLog,
    InvariantError,
    SimFrontend,
    frontend_address,
    frontend_cluster,
)
from zserve.loadgen.sim.hops import HopLatencies
from zserve.loadgen.sim.report import simulation_report, workload_bound_rps
from zserve.loadgen.workload import Workload, draw_request_rows
from zserve.scheduler.common import FEASIBILITY_EPS_S
from zserve.scheduler.core import SchedulerCore
from zserve.scheduler.learned_allowances import ShardAllowances
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.rank_thread import RankThread
from zserve.scheduler.sent_plans import PLAN_ACK_MARGIN_S
from zserve.scheduler.shard_acks import ShardPlanAcks
from zserve.transport.messages import (
    BatchFailed,
    BatchOutputs,
    BatchPlan,
    BatchStats,
    DropNotice,
    InputFetch,
    RequestMetaBatch,
)

__all__ = ["InvariantError", "SimConfig", "Simulator", "simulate", "workload_bound_rps"]

FRONTEND = frontend_address(0)
# An arrival instant; the scheduler core's timer (its wake_at).
_EV_ARRIVAL, _EV_SCHEDULER = 0, 1
# GPU events (idx = gpu id): a plan or inputs reach its follower, its timer, its batch ends.
_EV_PLAN, _EV_INPUTS, _EV_GPU_TIMER, _EV_DONE = 2, 3, 4, 5
# Frontend events (idx = frontend): its core's timer; the end of its tick (sim_tick_ms > 0).
_EV_FRONTEND_TIMER, _EV_TICK = 6, 7
# The autoscaler's control tick; a started GPU joins the rank (idx = gpu id).
_EV_AUTOSCALE, _EV_JOIN = 8, 9
# A batch's outputs reach their frontend (with drawn hops: the reply's draw after its end).
_EV_OUTPUTS = 10
HOP_SEED_SALT = 0x40B5  # the hop draws' stream, apart from the arrivals'
BAIL_CHECK_INTERVAL_S = 0.25
BAIL_MIN_BAD = 200
"""A bailing run stops once a model has at least this many bad requests in the measure window
and its bad rate so far exceeds the bail threshold."""


@dataclass
class SimConfig:
    """Knobs for one simulator run beyond the workload file."""

    check: bool = True
    # stop early once a model's bad requests exceed this fraction of its whole measure window
    # (its bad rate can then only end above it)
    bail_bad_rate: float | None = None
    record_plans: bool = False
    keep_tolerance: float | None = None  # None: the workload's
    # The cluster whose [frontends] (count, max_request_bytes) and models' max_queue/max_wait_ms
    # the simulated frontends admit by; None: a default cluster's (zserve.config.cluster).
    frontend: ClusterConfig | None = None
    # The autoscaler (loadgen/sim/elastic.py): the workload's ``gpus`` are the pool, of which
    # ``autoscale.backends`` serve at the start. None: every GPU serves throughout.
    autoscale: ElasticConfig | None = None
    # Mixed device kinds: per GPU, the models whose profile there is not the workload's (that
    # kind's profile of each); None: every GPU runs every model's workload profile.
    gpu_profiles: Sequence[Mapping[str, LatencyProfile]] | None = None
    # A placement: the GPU ids serving each model (the embedded rank matches a model's candidates
    # to them only: SchedulerCore.set_members); None: every GPU serves every model.
    model_gpus: Mapping[str, Sequence[int]] | None = None
    # Mixed kinds: the GPUs where each model is at home (its cheap kind); its other GPUs take
    # it only when no candidate at home there waits (RankThread.set_home). None: no preference.
    model_home_gpus: Mapping[str, Sequence[int]] | None = None
    # Hop latencies drawn per event (loadgen/sim/hops.py; None: each hop takes its allowance),
    # and whether the scheduler core and the frontends learn their allowances from them.
    hops: HopLatencies | None = None
    learned_allowances: bool = False


def _check_some_gpu_as_fast(model: str, own: LatencyProfile,
                            listed: list[LatencyProfile | None]) -> None:
    """A model's ModelThread gives a grant back where the GPU's profile would drop requests its
    own profile could still serve: were every GPU serving it slower than its own profile at some
    batch size (``listed``: each GPU's profile, None where it runs the model's own), every grant
    would come back and the rank would grant it again at the same instant, forever. Refused in
    one line (a live shard's own profile is the slowest of its GPUs', so it never is)."""
    if not listed or any(p is None for p in listed):
        return
    for profile in listed:
        assert profile is not None
        if all(profile.latency(b) <= own.latency(b) for b in range(1, own.max_batch + 1)):
            return
    raise ValueError(f"gpu_profiles: every GPU serving {model!r} runs it slower than its own "
                     "profile at some batch size, so each grant would be given back; give the "
                     "model the slowest of its GPUs' profiles as its own")


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
        d_ctrl_s, d_data_s = w.d_ctrl_ms / 1e3, w.d_data_ms / 1e3
        scaling = self.config.autoscale
        self.elastic = None if scaling is None else ElasticGpus(scaling, w.gpus)
        self.busy_started_s = 0.0  # GPU-seconds of the batches started so far
        self._gpu_profiles = self._profiles_by_gpu()
        self.models, self.rank, self.core, self.followers = self._build_roles(d_ctrl_s)
        self._init_hops(d_ctrl_s)
        self.index = {m.name: i for i, m in enumerate(w.models)}
        self.d_ctrl_s, self.d_data_s = d_ctrl_s, d_data_s
        self._build_requests(_arrivals_of(w, arrivals))
        self.window = (w.warmup_s, w.warmup_s + w.measure_s)
        # each model's requests in the measure window (the early stop's bar, _should_bail)
        self._window_totals = [
            int(np.searchsorted(t, self.window[1], side="left"))
            - int(np.searchsorted(t, self.window[0], side="left")) for t in self.arrivals]
        self.answers = AnswerLog(self.deadline_all, self.model_of, self.arrival_all, self.window,
                                 len(w.models))
        self.status = self.answers.status  # each request's outcome (sim_frontend's codes)
        self.planned = np.zeros(self.n_requests, dtype=np.bool_)
        self.finish = np.full(self.n_requests, np.nan)
        self.exec = np.full(self.n_requests, np.nan)
        self.index_of_rid: dict[int, int] = {}  # the cores' request ids -> request index
        self.frontends = self._build_frontends()
        self.frontend_at = {f.address: f for f in self.frontends}
        self.gpu_planned_until = [0.0] * w.gpus  # the grants' view
        self.gpu_busy_until = [0.0] * w.gpus  # the batches the followers ran
        self.backend_failed: dict[str, int] = {}  # requests a follower answered, by error
        self.late_starts = 0  # batches a follower started after their exec_at
        self.batches: list[tuple[int, int, float, float, int]] = []  # model, gpu, exec, end, bs
        self.plans: list[BatchPlan] = []  # with SimConfig.record_plans
        # the shard's record of the plans sent, and their acknowledgements
        self.plan_acks = ShardPlanAcks(d_ctrl_s + PLAN_ACK_MARGIN_S)
        self.bailed, self.bailed_at = False, math.inf  # (when a bailing run stopped)
        self._events: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._scheduler_wake = math.inf
        self._gpu_wake = [math.inf] * w.gpus
        self._frontend_wake = [math.inf] * len(self.frontends)
        self._tick_due = [False] * len(self.frontends)
        self._payloads: dict[int, Any] = {}  # event seq -> the plan, inputs or batch it carries
        self._inputs_due: dict[int, float] = {}  # plan id -> when its inputs are in
        self._next_arrival = 0
        self._meta_unsent = False  # an admission this instant: end the tick before time moves
        self._now = 0.0

    def _build_frontends(self) -> list[SimFrontend]:
        """The frontends' cores, admitting by ``SimConfig.frontend`` (learning their reply
        allowance with ``learned_allowances``)."""
        self.frontend_cluster = frontend_cluster(self.w, self.config.frontend,
                                                 learned=self.config.learned_allowances)
        return [SimFrontend(i, self.frontend_cluster, self.w, self.answers, self.index_of_rid)
                for i in range(self.frontend_cluster.frontends.count)]

    def _init_hops(self, d_ctrl_s: float) -> None:
        """Drawn hops (``SimConfig.hops``) and the core's learned allowances."""
        self._ready_plans: dict[int, BatchPlan] = {}  # learned: plans whose inputs are awaited
        self.hops = self.config.hops
        self._hop_rng = np.random.default_rng((self.w.seed, HOP_SEED_SALT))
        if self.config.learned_allowances:
            self.core.allowances = ShardAllowances(0.0, d_ctrl_s, self.w.jitter_ms / 1e3,
                                                   self.w.reply_ms / 1e3)

    def _build_requests(self, arrivals: list[np.ndarray[Any, Any]]) -> None:
        """Request ``i``'s arrival, model and deadline (indexes run model by model), and the
        order in which they reach the frontends."""
        w = self.w
        self.arrivals = arrivals
        self.offsets = [0, *np.cumsum([len(a) for a in arrivals])[:-1].tolist()]
        total = sum(len(a) for a in arrivals)
        self.n_requests = total
        self.arrival_all = np.concatenate(arrivals) if total else np.empty(0)
        self.model_of = np.concatenate(
            [np.full(len(a), i, dtype=np.int32) for i, a in enumerate(arrivals)]
        ) if total else np.empty(0, dtype=np.int32)
        slo_by_model = np.array([m.slo_s for m in w.models])
        # with drawn hops the reply takes its draw: a request is good when answered in its SLO
        reply_s = 0.0 if self.config.hops is not None else w.reply_ms / 1e3
        self.deadline_all = self.arrival_all + slo_by_model[self.model_of] - reply_s
        order = np.argsort(self.arrival_all, kind="stable")
        names = [m.name for m in w.models]
        self._arrival_order: list[int] = order.tolist()
        self._arrival_times: list[float] = self.arrival_all[order].tolist()
        self._arrival_models = [names[i] for i in self.model_of[order].tolist()]
        # each request's rows (None: one each); the rows of request k of the arrival order
        self.rows_all = draw_request_rows(w.request_rows, w.seed, total)
        self._arrival_rows = None if self.rows_all is None else self.rows_all[order].tolist()

    def _profiles_by_gpu(self) -> list[list[LatencyProfile]] | None:
        """Each GPU's profile of each model (``SimConfig.gpu_profiles`` over the workload's);
        None with one kind."""
        kinds = self.config.gpu_profiles
        if kinds is None:
            return None
        if len(kinds) != self.w.gpus:
            raise ValueError(f"gpu_profiles lists {len(kinds)} GPUs, the workload has "
                             f"{self.w.gpus}")
        for m in self.w.models:
            _check_some_gpu_as_fast(m.name, m.profile, [
                own.get(m.name) for gpu, own in enumerate(kinds)
                if self.config.model_gpus is None or gpu in self.config.model_gpus.get(
                    m.name, range(len(kinds)))])
        return [[own.get(m.name, m.profile) for m in self.w.models] for own in kinds]

    def profile_on(self, model: int, gpu: int) -> LatencyProfile:
        """Model ``model``'s profile on GPU ``gpu`` (its device kind's)."""
        if self._gpu_profiles is None:
            return self.w.models[model].profile
        return self._gpu_profiles[gpu][model]

    def _build_roles(self, d_ctrl_s: float,
                     ) -> tuple[list[ModelThread], RankThread, SchedulerCore, list[PlanFollower]]:
        """One ModelThread per model and the RankThread in the scheduler core (the rank
        embedded, as in a cluster of ``shards = 0``), and one PlanFollower per GPU, configured
        as the live processes configure theirs."""
        w = self.w
        reply_s = w.reply_ms / 1e3
        # One id space for every model's plans, as a shard hands its ModelThreads one: a
        # follower holds plans of every model and matches input replies by plan id.
        plan_ids = itertools.count(1)
        models = [
            ModelThread(
                m.name, m.profile, m.slo_s, self.policy, d_ctrl_s=d_ctrl_s,
                d_data_s=w.d_data_ms_of(m) / 1e3,
                jitter_s=w.jitter_ms / 1e3, plan_ids=plan_ids,
                budget_s=m.slo_s - reply_s - d_ctrl_s,
                keep_tolerance=self.keep_tolerance,
            )
            for m in w.models
        ]
        followers = [
            PlanFollower(f"gpu-{gpu}", shed_grace_s=SHED_GRACE_FRACTION * reply_s)
            for gpu in range(w.gpus)
        ]
        for gpu, follower in enumerate(followers):
            for i, m in enumerate(w.models):
                profile = self.profile_on(i, gpu)
                follower.add_model(m.name, profile.table_s, profile.max_batch)
        if self._gpu_profiles is not None:
            for i, thread in enumerate(models):
                thread.set_gpu_profiles({
                    gpu: own[i] for gpu, own in enumerate(self._gpu_profiles)
                    if own[i] is not w.models[i].profile})
        serving = list(range(w.gpus)) if self.elastic is None else self.elastic.serving
        rank = RankThread(list(serving), 0.0, grant_order=self.policy.grant_order)
        core = SchedulerCore("sim", rank=rank)
        for thread in models:
            core.add_thread(0.0, thread, [])
        if self.config.model_gpus is not None:
            unknown = sorted(set(self.config.model_gpus) - {m.name for m in w.models})
            if unknown:
                raise ValueError(f"model_gpus names {unknown[0]!r}, not a workload model")
            core.set_members(0.0, self.config.model_gpus, [])
        if self.config.model_home_gpus is not None:
            core.set_home(self.config.model_home_gpus)
        return models, rank, core, followers

    def request_indexes(self, rids: list[int]) -> np.ndarray[Any, Any]:
        """The request indexes of the cores' request ids ``rids``."""
        index_of = self.index_of_rid
        return np.fromiter((index_of[rid] for rid in rids), dtype=np.int64, count=len(rids))

    # ------------------------------------------------------------------ event plumbing

    def _push(self, t: float, kind: int, idx: int, payload: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, idx))
        if payload is not None:
            self._payloads[self._seq] = payload

    def _resched_scheduler(self) -> None:
        wake = self.core.wake_at
        if wake != self._scheduler_wake:
            self._scheduler_wake = wake
            if wake < math.inf:  # (the payload: the moment, when the timer fires late)
                late = 0.0 if self.hops is None else self.hops.late.draw(self._hop_rng)
                self._push(wake + late, _EV_SCHEDULER, -1, wake if late else None)

    def _resched_gpu(self, gpu: int) -> None:
        wake = self.followers[gpu].wake_at
        if wake != self._gpu_wake[gpu]:
            self._gpu_wake[gpu] = wake
            if wake < math.inf:
                self._push(wake, _EV_GPU_TIMER, gpu)

    def _resched_frontend(self, f: int) -> None:
        wake = self.frontends[f].core.wake_at
        if wake != self._frontend_wake[f]:
            self._frontend_wake[f] = wake
            if wake < math.inf:
                self._push(wake, _EV_FRONTEND_TIMER, f)

    def _deliver_scheduler(self, now: float, outbox: Outbox) -> None:
        """What the scheduler core left in ``outbox``: plans for the GPUs, drops for the
        frontends (the rank is in the core); then its timer."""
        for (kind, target), msg in outbox:
            if kind == DEST_BACKEND:
                assert isinstance(msg, BatchPlan)
                self._on_plan(now, msg)
            else:
                assert kind == DEST_FRONTEND and isinstance(msg, DropNotice)
                self._on_drop(now, str(target), msg)
        outbox.clear()
        self._resched_scheduler()

    def _fail(self, message: str) -> None:
        raise InvariantError(f"t={self._now:.6f}: {message}")

    # ------------------------------------------------------------------ the frontends

    def _on_arrivals(self, now: float) -> None:
        """Every request arriving at ``now`` reaches its frontend's core (request ``k`` of the
        arrival order goes to frontend ``k % count``); schedules the next arrival instant."""
        times = self._arrival_times
        order = self._arrival_order
        names = self._arrival_models
        frontends = self.frontends
        count = len(frontends)
        pos = self._next_arrival
        rows = self._arrival_rows
        while pos < len(times) and times[pos] == now:
            f = pos % count
            frontend = frontends[f]
            frontend.admit(now, order[pos], names[pos], 1 if rows is None else rows[pos])
            self._resched_frontend(f)
            if frontend.meta_unsent:
                self._tick_started(now, f)
            pos += 1
        self._next_arrival = pos
        if pos < len(times):
            self._push(times[pos], _EV_ARRIVAL, -1)

    def _tick_started(self, now: float, f: int) -> None:
        """Frontend ``f`` has metadata to send at the end of its tick: once time moves on, or
        ``sim_tick_ms`` from now."""
        tick_s = self.w.sim_tick_ms / 1e3
        if not tick_s:
            self._meta_unsent = True
        elif not self._tick_due[f]:
            self._tick_due[f] = True
            self._push(now + tick_s, _EV_TICK, f)

    def _end_ticks(self, now: float) -> None:
        """The end of the instant's tick: every frontend with admissions sends its metadata."""
        self._meta_unsent = False
        for f, frontend in enumerate(self.frontends):
            if frontend.meta_unsent:
                self._end_tick(now, f)

    def _end_tick(self, now: float, f: int) -> None:
        frontend = self.frontends[f]
        self._tick_due[f] = False
        frontend.end_tick(now)
        sent, frontend.to_scheduler = frontend.to_scheduler, []
        for meta in sent:
            self._on_meta(now, meta)
        self._resched_frontend(f)

    def _on_meta(self, now: float, meta: RequestMetaBatch) -> None:
        """A frontend's RequestMetaBatch reaches the scheduler core."""
        outbox: Outbox = []
        self.core.on_meta(now, meta, outbox)
        self._deliver_scheduler(now, outbox)

    def _on_drop(self, now: float, address: str, notice: DropNotice) -> None:
        frontend = self.frontend_at[address]
        outbox = frontend.outbox()
        frontend.core.on_drop(now, notice, outbox)
        frontend.route(now, outbox)
        self._resched_frontend(self.frontends.index(frontend))

    def _on_frontend_timer(self, now: float, f: int) -> None:
        frontend = self.frontends[f]
        if frontend.core.wake_at != now or self._frontend_wake[f] != now:
            return
        self._frontend_wake[f] = math.inf
        frontend.timer(now)
        self._resched_frontend(f)

    def _fetch(self, now: float, gpu: int, address: str, fetch: InputFetch) -> None:
        """A follower's InputFetch: the core hands over the inputs, which reach the follower
        ``d_data`` per request after the plan's grant (as the ModelThread sums it, so an
        on-time plan's inputs are never an ulp late)."""
        frontend = self.frontend_at[address]
        outbox = frontend.outbox()
        frontend.core.on_fetch(now, self.followers[gpu].name, fetch, outbox)
        frontend.route(now, outbox)
        for _, reply in frontend.fetch_replies():
            due = self._inputs_due.get(reply.plan_id, now + self.d_data_s * len(fetch.request_ids))
            self._push(max(now, due), _EV_INPUTS, gpu, (address, reply))

    def _answer_failed(self, now: float, address: str, failed: BatchFailed) -> None:
        """Requests a follower answered itself (late shedding, inputs that did not come)."""
        self.backend_failed[failed.error] = (
            self.backend_failed.get(failed.error, 0) + len(failed.request_ids))
        frontend = self.frontend_at[address]
        outbox = frontend.outbox()
        frontend.core.on_batch_failed(now, failed, outbox)
        frontend.route(now, outbox)

    def _answer_outputs(self, now: float, address: str, outputs: BatchOutputs) -> None:
        """A batch's rows for one frontend (the follower groups them, as a live backend's does):
        the frontend answers them."""
        frontend = self.frontend_at[address]
        outbox = frontend.outbox()
        frontend.core.on_outputs(now, outputs, outbox)
        frontend.route(now, outbox)

    # ------------------------------------------------------------------ the GPUs' followers

    def _on_plan(self, now: float, plan: BatchPlan) -> None:
        """A grant's plan: check it, then send it to its GPU's follower (``d_ctrl`` away)."""
        ids = self.request_indexes(plan.request_ids)
        if self.config.check:
            self._check_plan(now, plan, ids)
        self.planned[ids] = True
        self.gpu_planned_until[plan.gpu_id] = plan.expected_finish_at
        if self.config.record_plans:
            self.plans.append(plan)
        slo_s = self.w.models[self.index[plan.model]].slo_s
        self.plan_acks.remember(now, plan.gpu_id, plan, slo_s)
        # drawn: the plan arrives after half of the ready delay, the inputs after all of it
        ready_s = self.d_ctrl_s if self.hops is None else self.hops.ready.draw(self._hop_rng)
        self._push(now + (self.d_ctrl_s if self.hops is None else ready_s / 2), _EV_PLAN,
                   plan.gpu_id, plan)
        # The inputs are in at grant + delay(bs), summed as the ModelThread sums it (so an
        # on-time plan's inputs are never an ulp late).
        rows = sum(plan.rows) if plan.rows else len(ids)
        d_data_s = self.models[self.index[plan.model]].d_data_s  # the model's own allowance
        self._inputs_due[plan.plan_id] = now + (ready_s + d_data_s * rows)
        if self.core.allowances is not None:
            self._ready_plans[plan.plan_id] = plan

    def _check_plan(self, now: float, plan: BatchPlan, ids: np.ndarray[Any, Any]) -> None:
        eps = FEASIBILITY_EPS_S
        i = self.index[plan.model]
        bs = sum(plan.rows) if plan.rows else len(ids)  # in rows
        profile = self.profile_on(i, plan.gpu_id)
        finish = plan.exec_at + profile.latency(bs)
        if plan.exec_at < now - eps:
            self._fail(f"plan {plan.model}#{plan.plan_id} reached GPU {plan.gpu_id} after its "
                       f"exec_at {plan.exec_at:.6f}")
        if plan.exec_at < self.gpu_planned_until[plan.gpu_id] - eps:
            self._fail(f"GPU {plan.gpu_id} runs two batches at once: {plan.model} starts "
                       f"{plan.exec_at:.6f} before {self.gpu_planned_until[plan.gpu_id]:.6f}")
        if abs(finish - plan.expected_finish_at) > eps:
            self._fail(f"plan {plan.model}#{plan.plan_id}: expected_finish_at mismatch")
        if bs == 0 or bs > profile.max_batch:
            self._fail(f"plan {plan.model}#{plan.plan_id}: infeasible batch size {bs}")
        if np.any(self.planned[ids]):
            self._fail(f"plan {plan.model}#{plan.plan_id}: a request is planned twice")
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
            follower.on_plan(now, plan, outbox)
            # at once: a live backend's comes within ACK_HOLD_S (30 ms), far inside the margin
            self.plan_acks.acknowledge((plan.plan_id,))
            if self.plan_acks.wake_at <= now:
                self._fail("a plan went unacknowledged past its allowance")
        elif kind == _EV_INPUTS:
            address, reply = self._payloads.pop(seq)
            follower.on_input_reply(now, address, reply, outbox)
            if self.core.allowances is not None:
                self._note_ready(now, self._ready_plans.pop(reply.plan_id, None))
        elif kind == _EV_OUTPUTS:
            address, outputs = self._payloads.pop(seq)
            self._answer_outputs(now, address, outputs)
        elif kind == _EV_DONE:
            run = self._payloads.pop(seq)
            follower.on_batch_finished(now, run, [{}] * len(run.rows), "", finished_at=now,
                                       outbox=outbox)
            self._inputs_due.pop(run.plan.plan_id, None)
            follower.on_batch_done(now, ok=True, finished_at=now, outbox=outbox)
        else:
            if follower.wake_at != now or self._gpu_wake[gpu] != now:
                return
            self._gpu_wake[gpu] = math.inf
            follower.on_timer(now, outbox)
        self._deliver_follower(now, gpu, outbox)

    def _deliver_follower(self, now: float, gpu: int, outbox: Outbox) -> None:
        """A follower's outbox: fetches go to the cores, requests it answered end through
        them, batches run, device-free reports reach the rank and batch ends the shard."""
        rank_outbox: Outbox = []
        for (kind, target), msg in outbox:
            if kind == DEST_DEVICE:
                assert isinstance(msg, RunBatch)
                self._run_batch(now, gpu, msg)
            elif type(msg) is InputFetch:
                self._fetch(now, gpu, str(target), msg)
            elif type(msg) is BatchOutputs and self.hops is not None:
                self._push(now + self.hops.reply.draw(self._hop_rng), _EV_OUTPUTS, gpu,
                           (str(target), msg))
            elif type(msg) is BatchOutputs:
                self._answer_outputs(now, str(target), msg)
            elif type(msg) is BatchFailed:
                self._answer_failed(now, str(target), msg)
            elif type(msg) is BatchStats:  # to the rank and the shard, as a live backend
                self.core.on_batch_stats(now, msg, rank_outbox)
                if msg.device_free_at > 0.0:
                    self.core.on_device_free_at(now, gpu, msg.device_free_at, rank_outbox)
        self._resched_gpu(gpu)
        self._deliver_scheduler(now, rank_outbox)

    def _note_ready(self, now: float, plan: BatchPlan | None) -> None:
        """A plan's inputs are in: its ready delay to the learned d_ctrl (as a live backend
        reports it on its next acknowledgement)."""
        if plan is None:
            return
        outbox: Outbox = []
        rows = sum(plan.rows) if plan.rows else len(plan.request_ids)
        self.core.note_ready(now, plan.model, now - plan.sent_at, rows, outbox)
        self._deliver_scheduler(now, outbox)

    def _run_batch(self, now: float, gpu: int, run: RunBatch) -> None:
        """The emulated executor: the batch runs for exactly l(bs) from its start; its outputs
        reach the frontends when it ends."""
        plan = run.plan
        ids = self.request_indexes([plan.request_ids[row] for row in run.rows])
        bs = sum(plan.rows[row] for row in run.rows) if plan.rows else len(ids)  # in rows
        i = self.index[plan.model]
        finish = now + self.profile_on(i, gpu).latency(bs)
        if self.config.check:
            deadlines = self.deadline_all[ids]
            eps = FEASIBILITY_EPS_S
            if now < self.gpu_busy_until[gpu] - eps:
                self._fail(f"GPU {gpu} runs two batches at once: {plan.model} starts "
                           f"{now:.6f} before {self.gpu_busy_until[gpu]:.6f}")
            if not np.all(np.isnan(self.exec[ids])):
                self._fail(f"batch {plan.model} on GPU {gpu}: a request runs twice")
            if finish > float(deadlines.min()) + eps:
                self._fail(f"batch {plan.model} on GPU {gpu} starts after its latest moment "
                           f"(finishes {finish:.6f} > earliest deadline {deadlines.min():.6f})")
        if now > plan.exec_at + FEASIBILITY_EPS_S:
            self.late_starts += 1
        self.finish[ids] = finish
        self.exec[ids] = now
        self.gpu_busy_until[gpu] = finish
        self.batches.append((i, gpu, now, finish, bs))
        self.busy_started_s += finish - now
        self._push(finish, _EV_DONE, gpu, run)

    # ------------------------------------------------------------------ main loop

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        if self._arrival_times:
            self._push(self._arrival_times[0], _EV_ARRIVAL, -1)
        if self.elastic is not None:
            self._push(self.elastic.config.tick_s, _EV_AUTOSCALE, -1)
        events = self._events
        bail = self.config.bail_bad_rate
        next_bail_check = self.window[0] + BAIL_CHECK_INTERVAL_S
        while events:
            now, seq, kind, idx = heapq.heappop(events)
            self._now = now
            if kind == _EV_ARRIVAL:
                self._on_arrivals(now)
                if bail is not None and now >= next_bail_check:
                    next_bail_check = now + BAIL_CHECK_INTERVAL_S
                    if self._should_bail(bail, now):
                        self.bailed = True
                        self.bailed_at = now
                        break
            else:
                self._on_event(now, kind, idx, seq)
            if self._meta_unsent and (not events or events[0][0] != now):
                self._end_ticks(now)
        wall = time.perf_counter() - started
        if not self.bailed and self.config.check:
            self._check_all_answered()
        report: dict[str, Any] = simulation_report(self, wall)
        if self.core.allowances is not None:
            report["learned_allowances"] = {
                **self.core.allowances.summary(self._now),
                "reply": [f.core.stats()["reply_allowance"] for f in self.frontends]}
        if self.elastic is not None:
            report["autoscale"] = {
                "timeline": self.elastic.timeline,
                "allocated_gpu_s": self.elastic.allocated_gpu_s(self.elastic.config.tick_s),
                "changes": self.elastic.autoscaler.changes}
        return report

    def _on_event(self, now: float, kind: int, idx: int, seq: int) -> None:
        """Any event but an arrival."""
        if kind == _EV_SCHEDULER:
            due = self._payloads.pop(seq, now)
            if self.core.wake_at != due or self._scheduler_wake != due:
                return
            self._scheduler_wake = math.inf
            outbox: Outbox = []
            self.core.on_timer(now, outbox)
            self._deliver_scheduler(now, outbox)
        elif kind == _EV_FRONTEND_TIMER:
            self._on_frontend_timer(now, idx)
        elif kind == _EV_TICK:
            self._end_tick(now, idx)
        elif kind in (_EV_AUTOSCALE, _EV_JOIN):
            self._on_autoscale(now, kind, idx)
        else:
            self._on_gpu_event(now, kind, idx, seq)

    def _on_autoscale(self, now: float, kind: int, gpu: int) -> None:
        """The autoscaler's tick (start and drain GPUs; the next tick while arrivals remain), or
        a started GPU that joins the rank."""
        elastic = self.elastic
        assert elastic is not None
        outbox: Outbox = []
        if kind == _EV_JOIN:
            if elastic.on_joined(gpu):
                self.core.rank_add_gpu(now, gpu, outbox, self.gpu_planned_until[gpu])
        else:
            counters = (self.answers.n_answered, self.answers.n_bad, self.busy_started_s)
            starts, stops = elastic.on_tick(now, counters, self.gpu_busy_until)
            for started, ready in starts:
                self._push(ready, _EV_JOIN, started)
            for stopped in stops:  # its follower runs the plans it holds: the drain
                self.core.rank_remove_gpu(now, stopped, outbox)
            if self._next_arrival < len(self._arrival_times):
                self._push(now + elastic.config.tick_s, _EV_AUTOSCALE, -1)
        self._deliver_scheduler(now, outbox)

    def _check_all_answered(self) -> None:
        left = int(np.count_nonzero(self.status == PENDING))
        if left:
            self._fail(f"{left} requests never answered")
        pending = sum(len(f.core.pending) for f in self.frontends)
        if pending:
            self._fail(f"{pending} requests left pending in a frontend core")

    def _should_bail(self, bail: float, now: float) -> bool:
        """Whether some model's measured bad requests already exceed ``bail`` times all of its
        requests in the measure window: its bad rate can only end above ``bail`` then, so the
        verdict against that bar is the full run's. (A bar on the requests arrived so far
        failed runs whose early bursts a quiet rest of the window would have made up for: the
        10-model Zipf mix at 11,644 r/s bailed, and ran to 0.87% in full.)"""
        totals = self._window_totals
        for i, bad in enumerate(self.answers.measured_bad):
            if bad >= BAIL_MIN_BAD and bad > bail * totals[i]:
                return True
        return False

def simulate(workload: Workload, config: SimConfig | None = None) -> dict[str, Any]:
    """Run one simulation and return its report. The papers' baselines (``nexus``,
    ``shepherd-flex``) replace the scheduler, and run in their own host (``sim.baselines``)."""
    if sim_baseline_frontends(workload.policy) is not None:
        return simulate_baseline(workload, (config or SimConfig()).bail_bad_rate)
    return Simulator(workload, config).run()
