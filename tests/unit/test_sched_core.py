"""SchedulerCore: the ModelThreads and the RankThread of a shard behind one pure core (the
dispatch loop between them, the per-model metadata split, refusals, one wake_at)."""

from __future__ import annotations

import math
import random

import pytest

from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.core.hosting import DEST_BACKEND, DEST_FRONTEND, DEST_MODEL, TO_RANK, Outbox
from zserve.scheduler.core import SCAN_THREADS_MAX, SchedulerCore
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import (
    BatchPlan,
    CandidateUpdate,
    DropNotice,
    GrantAnswer,
    GrantGpu,
    RequestMetaBatch,
)

MS = 1e-3
PROFILE = LatencyProfile.linear(alpha_ms=1.0, beta_ms=5.0, max_batch=8)
FRONTEND = "fe/data"


def _thread(model: str, slo_s: float = 50 * MS) -> ModelThread:
    return ModelThread(model, PROFILE, slo_s, "deferred")


def _embedded(*models: str, gpus: int = 1, scan_threads_max: int = SCAN_THREADS_MAX
              ) -> SchedulerCore:
    core = SchedulerCore("shard-t", rank=RankThread(list(range(gpus)), 0.0),
                         scan_threads_max=scan_threads_max)
    for model in models:
        core.add_thread(0.0, _thread(model), [])
    return core


def _meta(model: str | list[str], ids: list[int], at: float, slo_s: float = 50 * MS,
          frontend: str = FRONTEND) -> RequestMetaBatch:
    models = model if isinstance(model, list) else [model] * len(ids)
    return RequestMetaBatch(frontend, ids, models, [at] * len(ids), [at + slo_s] * len(ids))


def _run_until_plan(core: SchedulerCore, outbox: Outbox, limit_s: float = 1.0) -> list[BatchPlan]:
    """Fire the core's timer at each wake_at until a plan is in the outbox."""
    plans: list[BatchPlan] = []
    while not plans and core.wake_at < limit_s:
        now = core.wake_at
        core.on_timer(now, outbox)
        assert core.wake_at > now  # the hosting contract, for the core as a whole
        plans = [msg for (kind, _), msg in outbox if kind == DEST_BACKEND
                 and isinstance(msg, BatchPlan)]
    return plans


def test_a_request_is_planned_onto_the_gpu_and_only_the_plan_is_left_for_the_host() -> None:
    core = _embedded("m")
    outbox: Outbox = []
    core.on_meta(0.0, _meta("m", [1, 2, 3], at=0.0), outbox)
    assert core.wake_at < math.inf  # the deferred candidate waits for its moment
    plans = _run_until_plan(core, outbox)
    assert len(plans) == 1
    plan = plans[0]
    assert (plan.model, plan.gpu_id, plan.request_ids) == ("m", 0, [1, 2, 3])
    assert plan.frontends == [FRONTEND]
    assert plan.expected_finish_at <= 50 * MS  # it finishes by the requests' deadline
    # the candidate, the grant and its answer went between the threads inside the core
    assert [dest for dest, _ in outbox] == [(DEST_BACKEND, 0)]
    assert core.rank is not None and core.rank.n_grants == 1
    assert core.threads["m"].n_planned == 3 and core.queued() == 0


def test_wake_at_is_the_earliest_of_the_threads_and_the_rank() -> None:
    core = SchedulerCore("shard-t", rank=RankThread([0, 1], 0.0))
    outbox: Outbox = []
    for model, slo_s in (("slow", 200 * MS), ("fast", 30 * MS)):
        core.add_thread(0.0, _thread(model, slo_s), outbox)
    assert core.wake_at == math.inf
    core.on_meta(0.0, _meta("slow", [1], at=0.0, slo_s=200 * MS), outbox)
    slow_wake = core.threads["slow"].wake_at
    assert core.wake_at == slow_wake < math.inf
    core.on_meta(0.001, _meta("fast", [2], at=0.001, slo_s=30 * MS), outbox)
    assert core.rank is not None
    wakes = [t.wake_at for t in core.threads.values()] + [core.rank.wake_at]
    assert core.wake_at == min(wakes) < slow_wake
    # a call before wake_at fires nothing
    fired = core.n_timer_fires
    core.on_timer(core.wake_at - 1e-6, outbox)
    assert core.n_timer_fires == fired
    # at wake_at the due thread fires, and wake_at moves on to the next moment
    due = core.wake_at
    core.on_timer(due, outbox)
    assert core.n_timer_fires > fired
    wakes = [t.wake_at for t in core.threads.values()] + [core.rank.wake_at]
    assert core.wake_at == min(wakes) > due


@pytest.mark.parametrize("scan_threads_max", [SCAN_THREADS_MAX, 0, 6])
def test_wake_at_stays_the_earliest_moment_through_a_busy_run(scan_threads_max: int) -> None:
    """Many models sharing few GPUs, arrivals and timers interleaved: after every call the
    core's wake_at is exactly the earliest moment of its threads and rank, and lies ahead;
    alike when the core scans its threads, keeps them in its heap, or switches half-way
    through the threads' set-up."""
    models = [f"m{i}" for i in range(12)]
    core = _embedded(*models, gpus=3, scan_threads_max=scan_threads_max)
    rng = random.Random(7)
    outbox: Outbox = []
    now, rid, planned, dropped = 0.0, 0, 0, 0
    for _ in range(3000):
        step = rng.expovariate(1000.0)
        while core.wake_at <= now + step:  # the timers due before the next arrival
            now = core.wake_at
            core.on_timer(now, outbox)
            _assert_earliest(core, now)
        now += step
        model = rng.choice(models)
        core.on_meta(now, _meta(model, [rid], at=now, slo_s=rng.choice((30, 50, 80)) * MS),
                     outbox)
        rid += 1
        _assert_earliest(core, now)
        planned += sum(len(msg.request_ids) for _, msg in outbox if isinstance(msg, BatchPlan))
        dropped += sum(len(msg.request_ids) for _, msg in outbox if isinstance(msg, DropNotice))
        outbox.clear()
    assert planned + dropped + core.queued() == rid  # every request planned, dropped or queued
    assert planned > 0.9 * rid


def test_scanned_and_heaped_threads_plan_the_same_schedule() -> None:
    """The scan (few threads) and the heap (many) are two ways to find the same earliest
    moment: the same arrivals give the same plans, request for request."""
    schedules = []
    for scan_threads_max in (SCAN_THREADS_MAX, 0):
        models = [f"m{i}" for i in range(8)]
        core = _embedded(*models, gpus=2, scan_threads_max=scan_threads_max)
        rng = random.Random(11)
        outbox: Outbox = []
        now, plans = 0.0, []
        for rid in range(2000):
            step = rng.expovariate(800.0)
            while core.wake_at <= now + step:
                now = core.wake_at
                core.on_timer(now, outbox)
            now += step
            core.on_meta(now, _meta(rng.choice(models), [rid], at=now,
                                    slo_s=rng.choice((30, 50)) * MS), outbox)
            plans += [(msg.model, msg.gpu_id, msg.exec_at, tuple(msg.request_ids))
                      for _, msg in outbox if isinstance(msg, BatchPlan)]
            outbox.clear()
        schedules.append(plans)
    assert len(schedules[0]) > 100
    assert schedules[0] == schedules[1]


def _assert_earliest(core: SchedulerCore, now: float) -> None:
    assert core.rank is not None
    earliest = min([t.wake_at for t in core.threads.values()] + [core.rank.wake_at])
    assert core.wake_at == earliest and core.wake_at > now


def test_requests_of_an_unknown_model_are_refused_and_the_others_scheduled() -> None:
    core = _embedded("m")
    outbox: Outbox = []
    core.on_meta(0.0, _meta(["m", "nope", "m"], [1, 2, 3], at=0.0), outbox)
    drops = [(dest, msg) for dest, msg in outbox if isinstance(msg, DropNotice)]
    assert drops == [((DEST_FRONTEND, FRONTEND), DropNotice(
        [2], ErrorKind.BAD_REQUEST.value, "model 'nope' is not scheduled by shard-t"))]
    assert core.counters["unknown_model"] == 1
    assert core.threads["m"].n_arrived == 2 and core.queued() == 2


def test_metadata_of_several_frontends_is_cut_per_model_and_merged_per_frontend() -> None:
    core = _embedded("a", "b")
    outbox: Outbox = []
    metas = [_meta(["a", "b"], [1, 2], at=0.0), _meta(["a"], [3], at=0.0),
             _meta(["a"], [4], at=0.0, frontend="other/data")]
    core.on_metas(0.0, metas, outbox)
    assert core.threads["a"].n_arrived == 3 and core.threads["b"].n_arrived == 1
    plans = _run_until_plan(core, outbox)
    by_model = {plan.model: plan for plan in plans}
    assert sorted(by_model["a"].request_ids) == [1, 3, 4]
    assert sorted(by_model["a"].frontends) == [FRONTEND, "other/data"]


def test_with_a_remote_rank_its_messages_stay_in_the_outbox_and_grants_come_in() -> None:
    core = SchedulerCore("shard-t", ["m"])
    outbox: Outbox = []
    core.add_thread(0.0, _thread("m"), outbox)
    # no GPU serves the model yet: refused UNAVAILABLE
    core.on_meta(0.0, _meta("m", [1], at=0.0), outbox)
    assert [msg.error for _, msg in outbox if isinstance(msg, DropNotice)] == [
        ErrorKind.UNAVAILABLE.value]
    assert core.counters["unavailable"] == 1
    outbox.clear()
    core.set_served(0.0, {"m": [7]}, outbox)
    core.on_meta(0.0, _meta("m", [2, 3], at=0.0), outbox)
    while not outbox:  # the candidate is published ahead of its moment
        core.on_timer(core.wake_at, outbox)
    (dest, update), = outbox
    assert dest == TO_RANK and isinstance(update, CandidateUpdate) and update.batch_size == 2
    outbox.clear()
    now = update.exec_at - update.send_delay
    assert core.on_grant(now, GrantGpu("m", 7, grant_id=1, free_at=0.0, epoch=4), outbox)
    kinds = [(dest[0], type(msg)) for dest, msg in outbox]
    assert kinds[:2] == [(DEST_BACKEND, BatchPlan), (TO_RANK[0], GrantAnswer)]
    plan = outbox[0][1]
    assert isinstance(plan, BatchPlan) and plan.epoch == 4 and plan.request_ids == [2, 3]
    assert not any(dest[0] == DEST_MODEL for dest, _ in outbox)
    assert not core.on_grant(now, GrantGpu("other", 7, grant_id=2, free_at=0.0), outbox)


def test_a_plan_put_back_is_planned_again_or_refused_without_a_gpu() -> None:
    core = SchedulerCore("shard-t", ["m"])
    outbox: Outbox = []
    core.add_thread(0.0, _thread("m"), outbox)
    core.set_served(0.0, {"m": [0, 1]}, outbox)
    plan = BatchPlan(plan_id=5, model="m", gpu_id=0, exec_at=0.01, expected_finish_at=0.017,
                     frontends=[FRONTEND], request_frontend=[0, 0], request_ids=[1, 2],
                     finish_by=[0.05, 0.05])
    core.remove_gpu(0.0, 0, outbox)
    assert core.served == {"m": [1]}
    core.replan(0.0, plan, "GPU 0 left", outbox)
    assert core.queued() == 2 and core.counters["replanned"] == 2
    assert core.threads["m"].gpu_ids == {1}
    core.remove_gpu(0.0, 1, outbox)
    outbox.clear()
    core.replan(0.0, plan, "GPU 1 left", outbox)
    (dest, drop), = outbox
    assert dest == (DEST_FRONTEND, FRONTEND) and isinstance(drop, DropNotice)
    assert drop.error == ErrorKind.UNAVAILABLE.value and drop.request_ids == [1, 2]


def test_draining_refuses_new_requests_and_sheds_the_queued_ones() -> None:
    core = _embedded("m")
    outbox: Outbox = []
    core.on_meta(0.0, _meta("m", [1, 2], at=0.0), outbox)
    core.draining = True
    core.on_meta(0.001, _meta("m", [3], at=0.001), outbox)
    core.shed_queued(0.002, outbox)
    drops = {tuple(msg.request_ids): msg.error for _, msg in outbox if isinstance(msg, DropNotice)}
    assert drops == {(3,): ErrorKind.SHUTTING_DOWN.value, (1, 2): ErrorKind.SHUTTING_DOWN.value}
    assert core.queued() == 0 and core.wake_at == math.inf
    assert core.counters["shutting_down"] == 1 + 2  # one refused chunk, two shed requests


def test_the_embedded_rank_hears_a_later_device_free_time() -> None:
    core = _embedded("m")
    outbox: Outbox = []
    assert core.on_device_free_at(0.0, 0, 0.004, outbox)
    assert core.rank is not None and core.rank.gpu_free_at(0) == pytest.approx(0.004)
    assert not core.on_device_free_at(0.0, 0, 0.001, outbox)  # never earlier


def test_the_queue_of_a_model_no_gpu_serves_any_more_is_answered_unavailable() -> None:
    """A model unloaded from its last backend (the rank's table lists it nowhere): its queued
    requests are answered UNAVAILABLE at once, never left to their deadlines; another model's
    queue is untouched."""
    core = SchedulerCore("shard-t", ["m", "n"])
    outbox: Outbox = []
    core.add_thread(0.0, _thread("m"), outbox)
    core.add_thread(0.0, _thread("n"), outbox)
    core.set_served(0.0, {"m": [0], "n": [0]}, outbox)
    core.on_meta(0.0, _meta(["m", "m", "n"], [1, 2, 3], at=0.0), outbox)
    assert core.queued() == 3
    outbox.clear()
    core.set_served(0.001, {"n": [0]}, outbox)
    drops = [msg for _, msg in outbox if isinstance(msg, DropNotice)]
    assert [(d.request_ids, d.error, d.message) for d in drops] == [
        ([1, 2], ErrorKind.UNAVAILABLE.value, "no backend serves 'm'")]
    assert core.queued() == 1 and core.counters["unavailable"] == 2


def test_every_thread_learns_whether_another_model_is_served_on_its_gpus() -> None:
    """A model alone on its GPUs runs staggered from one GPU's worth of load (policy.py,
    DEFER_STAGGER_ALONE_MIN_GPUS): the core tells each thread from the table it has."""
    def alone(core: SchedulerCore) -> dict[str, bool]:
        return {name: t.sizing.alone for name, t in core.threads.items()}

    outbox: Outbox = []
    core = _embedded("a", gpus=2)  # every GPU serves every model, and there is one
    assert alone(core) == {"a": True}
    core.add_thread(0.0, _thread("b"), outbox)
    assert alone(core) == {"a": False, "b": False}
    core.set_members(0.0, {"a": [0], "b": [1]}, outbox)
    assert alone(core) == {"a": True, "b": True}
    core.set_members(0.0, {"a": [0, 1], "b": [1]}, outbox)
    assert alone(core) == {"a": False, "b": False}
    # a remote rank's table lists every model, this shard's or another's
    remote = SchedulerCore("shard-t", ["m"])
    remote.add_thread(0.0, _thread("m"), outbox)
    assert alone(remote) == {"m": False}  # no GPU serves it yet
    remote.set_served(0.0, {"m": [0, 1], "elsewhere": [2]}, outbox)
    assert alone(remote) == {"m": True}
    remote.set_served(0.0, {"m": [0, 1], "elsewhere": [1, 2]}, outbox)
    assert alone(remote) == {"m": False}


def test_a_cold_models_first_lone_request_is_planned_well_before_its_last_moment() -> None:
    """The demo cluster's shape (one scheduler core, 2 backends, ``cnn`` at about 5 ms a batch,
    SLO 200 ms, 10 ms reply allowance, 1 ms jitter allowance), on a virtual clock: a fresh
    model's first request, alone, is planned by its rate meter's first sample (50 ms after it
    came), not 1 ms before its last moment, where a host stall made it a DEADLINE."""
    profile = LatencyProfile.linear(alpha_ms=0.3, beta_ms=4.7, max_batch=8)
    slo_s, reply_allowance_s = 200 * MS, 10 * MS
    core = SchedulerCore("shard-t", rank=RankThread([0, 1], 0.0))
    core.add_thread(0.0, ModelThread("cnn", profile, slo_s, "deferred", d_ctrl_s=2 * MS,
                                     d_data_s=0.15 * MS, jitter_s=1 * MS), [])
    outbox: Outbox = []
    arrival = 1.0
    deadline = arrival + slo_s - reply_allowance_s
    core.on_meta(arrival, RequestMetaBatch(FRONTEND, [7], ["cnn"], [arrival], [deadline]),
                 outbox)
    plans = _run_until_plan(core, outbox, limit_s=arrival + slo_s)
    assert [plan.request_ids for plan in plans] == [[7]]
    (plan,) = plans
    assert plan.exec_at <= arrival + 50 * MS + 1e-9
    last_moment = deadline - profile.latency(1)
    assert last_moment - plan.exec_at > 130 * MS  # slack a stall would have had to eat
    assert not [msg for _, msg in outbox if isinstance(msg, DropNotice)]
