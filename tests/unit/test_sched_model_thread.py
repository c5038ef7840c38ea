"""ModelThread rules: candidate formula, policies, drop policies, grants, chunks, timers."""

from __future__ import annotations

import itertools
import math
import zlib
from typing import Any

import numpy as np
import pytest

from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.core.hosting import TO_RANK, Outbox
from zserve.scheduler.candidate_sizing import DEFAULT_RATE_BUCKET_S
from zserve.scheduler.common import TIMER_SLACK_S, split_meta_by_model
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.policy import (
    DEFER_LOSS_DECAY,
    DEFER_LOSS_MAX,
    DEFER_LOSS_RECENT,
    DEFER_LOSS_WEIGHT,
    DEFER_MIN_JOINERS,
    DEFER_MISS_MAX_S,
    DEFER_MISS_RELAX_S,
    DEFER_MISS_WIDEN_S,
    DEFER_ROOM_LOSS_MAX,
    DEFER_YIELD_DECAY,
    DEFER_YIELD_KEPT_RESET,
    DEFER_YIELD_MIN_EXPECTED,
    DEFER_YIELD_RETRY_BATCHES,
    DeferralYield,
    RpsMeter,
)
from zserve.transport.messages import (
    BatchPlan,
    CandidateUpdate,
    DropNotice,
    GrantAnswer,
    GrantGpu,
    RequestMetaBatch,
)

MS = 1e-3
# l(b) = b + 5 ms
PROFILE = LatencyProfile.linear(1.0, 5.0, 32)


# _taught_meter's requests end at this time; a ModelThread given its meter carries on from it.
TAUGHT_UNTIL_S = 2.0


def _taught_meter(rate_per_10ms: int) -> RpsMeter:
    """A rate meter that has seen ``rate_per_10ms`` requests every 10 ms until TAUGHT_UNTIL_S."""
    teacher = _mt()
    rid = 10
    for step in range(1, 201):
        now = step * 0.01
        ids = list(range(rid, rid + rate_per_10ms))
        teacher.on_arrivals(now, "fe", ids, [now] * len(ids), [now + 1.0] * len(ids), [])
        rid += rate_per_10ms
    return teacher.meter


def _mt(policy: str = "deferred", drop: str = "window", **kw: Any) -> ModelThread:
    # publish every change at once (publish-ahead has its own test)
    return ModelThread("m", PROFILE, 12 * MS, SchedulePolicy.parse(policy, drop),
                       publish_lead_s=None, **kw)


def _arrive(  # noqa: PLR0917
    mt: ModelThread, now: float, ids: list[int], slo: float = 12 * MS,
            frontend: str = "fe", outbox: Outbox | None = None) -> Outbox:
    out: Outbox = [] if outbox is None else outbox
    arrivals = [now] * len(ids)
    mt.on_arrivals(now, frontend, ids, arrivals, [a + slo for a in arrivals], out)
    return out


def _cands(out: Outbox) -> list[CandidateUpdate]:
    return [m for _, m in out if isinstance(m, CandidateUpdate)]


def test_deferred_candidate_is_frontrun_clamped_by_now_plus_delay() -> None:
    mt = _mt(d_ctrl_s=0.1 * MS, d_data_s=0.05 * MS)
    out = _arrive(mt, 0.0, [1, 2, 3])
    (cand,) = _cands(out)
    d = 12 * MS
    assert cand.batch_size == 3
    assert cand.exec_at == pytest.approx(d - PROFILE.latency(4))  # frontrun d - l(bs + 1)
    assert cand.latest == pytest.approx(d - PROFILE.latency(3))
    assert cand.send_delay == pytest.approx(0.1 * MS + 3 * 0.05 * MS)
    # at a late moment the frontrun is in the past: exec = now + delay(bs)
    mt2 = _mt(d_ctrl_s=0.1 * MS, d_data_s=0.05 * MS)
    mt2.on_arrivals(5.5 * MS, "fe", [1], [0.0], [d], out := [])
    (late,) = _cands(out)
    assert late.exec_at == pytest.approx(5.5 * MS + 0.15 * MS)  # frontrun d - l(2) = 5 ms


@pytest.mark.parametrize(
    ("policy", "expected_exec_ms"),
    [
        ("eager", 0.0),  # schedulable at once
        ("latest", 12 - 7),  # d - l(2)
        ("deferred", 12 - 8),  # d - l(3)
        ("timeout:0.25", 3.0),  # first arrival + 0.25 * SLO
    ],
)
def test_schedule_policies(policy: str, expected_exec_ms: float) -> None:
    mt = _mt(policy)
    (cand,) = _cands(_arrive(mt, 0.0, [1, 2]))
    assert cand.batch_size == 2
    assert cand.exec_at == pytest.approx(expected_exec_ms * MS)
    assert cand.latest == pytest.approx((12 - 7) * MS)


def test_timeout_is_clamped_to_latest() -> None:
    mt = _mt("timeout:1.0")
    (cand,) = _cands(_arrive(mt, 0.0, [1, 2]))
    assert cand.exec_at == pytest.approx(cand.latest)


def test_beta_lambda_schedules_at_once_only_when_bs_reaches_beta_times_rate() -> None:
    mt = _mt("deferred-bl")
    # no rate sample yet: frontrun
    (cand,) = _cands(_arrive(mt, 0.0, [1]))
    assert cand.exec_at == pytest.approx((12 - 7) * MS)
    # a meter taught 1000 r/s: beta * lambda = 5 ms * 1000/s = 5 requests
    meter, now = _taught_meter(10), TAUGHT_UNTIL_S
    assert meter.rate() == pytest.approx(1000.0, rel=0.1)
    small = _mt("deferred-bl")
    small.sizing.set_meter(meter)
    (c3,) = _cands(_arrive(small, now, [1, 2, 3], slo=30 * MS))
    assert c3.exec_at > now  # 3 < ~5: frontrun
    (c8,) = _cands(_arrive(small, now, [4, 5, 6, 7, 8], slo=30 * MS))
    assert c8.batch_size == 8
    assert c8.exec_at == pytest.approx(now)  # 8 >= ~5: at once


def test_deferred_rescue_waits_only_while_a_request_is_likely_to_join() -> None:
    # no rate sample yet: frontrun
    (cand,) = _cands(_arrive(_mt("deferred"), 0.0, [1]))
    assert cand.exec_at == pytest.approx((12 - 7) * MS)
    # 1000 r/s, a model that shares its GPUs: a batch of 8 still waits (about 14 requests are
    # expected before its aim d - l(9)), where the old beta*lambda - 1 rule started it at once
    meter, now = _taught_meter(10), TAUGHT_UNTIL_S
    busy = _mt30("deferred")  # SLO 30 ms: the load needs under 2 GPUs
    busy.sizing.set_meter(meter)
    (c8,) = _cands(_arrive(busy, now, list(range(8)), slo=30 * MS))
    assert c8.batch_size == 8 and c8.exec_at == pytest.approx(now + 30 * MS - PROFILE.latency(9))
    # ... and one whose aim is 0.5 ms away (0.5 requests expected, under ln 2) starts at once
    late = _mt30("deferred")
    late.sizing.set_meter(_taught_meter(10))
    (c1,) = _cands(_arrive(late, now, [1], slo=PROFILE.latency(2) + 0.5 * MS))
    assert DEFER_MIN_JOINERS > 0.5 and c1.exec_at == pytest.approx(now)
    # light load, 100 r/s and SLO 12 ms: a lone request would wait 5 ms for 0.5 expected
    # arrivals, so it starts at once (frontrun waits for its moment regardless)
    for policy, expected in (("deferred", now), ("frontrun", now + 5 * MS)):
        lone = _mt(policy)
        lone.sizing.set_meter(_taught_meter(1))
        (c,) = _cands(_arrive(lone, now, [1]))
        assert c.exec_at == pytest.approx(expected), policy


def test_deferred_rescue_sharing_gpus_is_early_ok_and_an_early_grant_starts_at_once() -> None:
    # 1000 r/s, SLO 30 ms: the load needs under 2 GPUs, so the model shares its GPUs; its
    # deferring candidate is early_ok and carries its duration l(bs) for the rank's rescue
    now = TAUGHT_UNTIL_S
    shared = _mt30("deferred")
    shared.sizing.set_meter(_taught_meter(10))
    (cand,) = _cands(_arrive(shared, now, [1, 2, 3], slo=30 * MS))
    assert cand.early_ok and cand.exec_at > now + 10 * MS
    # the duration is l(b) of the batch expected by its aim: 3 plus ~1 request per ms until then
    rate = shared.meter.rate()
    assert rate is not None
    grow = int((cand.exec_at - now) * rate)
    assert grow > 10 and cand.duration == pytest.approx(PROFILE.latency(3 + grow))
    out: Outbox = []
    shared.on_grant(now + 1 * MS, GrantGpu("m", 0, 1, now + 1 * MS, early=True), out)
    (plan,) = [m for _, m in out if isinstance(m, BatchPlan)]
    assert plan.exec_at == pytest.approx(now + 1 * MS) and len(plan.request_ids) == 3
    # the same grant, not early, starts the batch at its aim
    aimed = _mt30("deferred")
    aimed.sizing.set_meter(_taught_meter(10))
    (cand2,) = _cands(_arrive(aimed, now, [1, 2, 3], slo=30 * MS))
    aimed.on_grant(now + 1 * MS, GrantGpu("m", 0, 1, now + 1 * MS), out := [])
    (plan2,) = [m for _, m in out if isinstance(m, BatchPlan)]
    assert plan2.exec_at == pytest.approx(cand2.exec_at)
    # 10,000 r/s: about 15 GPUs of load, staggered over GPUs of its own: never early_ok
    staggered = _mt30("deferred")
    staggered.sizing.set_meter(_taught_meter(100))
    (cand3,) = _cands(_arrive(staggered, now, [1], slo=30 * MS))
    assert cand3.exec_at > now and not cand3.early_ok


def test_chunk_gives_one_candidate_update_and_unchanged_candidate_is_not_resent() -> None:
    mt = _mt()
    out = _arrive(mt, 0.0, list(range(5)))
    assert len(_cands(out)) == 1
    out.clear()
    mt.on_timer(0.0, out)  # not due: no-op
    assert out == []


def test_get_batch_is_largest_feasible_set_by_earliest_deadline() -> None:
    mt = _mt(drop="alone")
    out: Outbox = []
    # deadlines 12 ms (one request) and 30 ms (many): l(b) <= 12 -> b <= 7
    mt.on_arrivals(0.0, "fe", [1], [0.0], [12 * MS], out)
    mt.on_arrivals(0.0, "fe", list(range(2, 20)), [0.0] * 18, [30 * MS] * 18, out)
    assert mt.cand_bs == 7
    assert mt.cand_latest == pytest.approx(12 * MS - PROFILE.latency(7))


def test_out_of_order_chunks_are_merged_by_deadline() -> None:
    mt = _mt(drop="alone")
    out: Outbox = []
    mt.on_arrivals(0.0, "a", [1, 2], [0.0, 0.0], [20 * MS, 30 * MS], out)
    mt.on_arrivals(0.0, "b", [3, 4], [0.0, 0.0], [10 * MS, 25 * MS], out)  # earlier than tail
    assert mt._deadlines[mt._head :] == [10 * MS, 20 * MS, 25 * MS, 30 * MS]
    assert mt._ids[mt._head :] == [3, 1, 4, 2]
    # the earliest deadline (10 ms) bounds the batch: l(b) <= 10 -> b <= 4 (all of them)
    assert mt.cand_bs == 4
    assert mt.cand_latest == pytest.approx(10 * MS - PROFILE.latency(4))


def test_alone_drops_only_what_cannot_finish_alone_and_groups_drops_by_frontend() -> None:
    mt = _mt(drop="alone")
    out: Outbox = []
    mt.on_arrivals(0.0, "a", [1], [0.0], [12 * MS], out)
    mt.on_arrivals(0.0, "b", [2], [0.0], [12.5 * MS], out)
    mt.on_arrivals(0.0, "a", [3], [0.0], [40 * MS], out)
    out.clear()
    mt.on_timer(7.0 * MS, out)  # now + l(1) = 13 ms > 12 and 12.5: both heads go
    drops = [(dest, m) for dest, m in out if isinstance(m, DropNotice)]
    assert sorted((dest[1], m.request_ids) for dest, m in drops) == [("a", [1]), ("b", [2])]
    assert all(m.error == "DEADLINE" for _, m in drops)
    assert mt.cand_bs == 1 and mt.n_dropped == 2


def test_window_drops_head_that_would_force_a_batch_below_target() -> None:
    window = _mt(drop="window")
    alone = _mt(drop="alone")
    for mt in (window, alone):
        mt.sizing.target = mt.sizing.keep_min = 4  # as if the rate meter asked for batches of 4
        out: Outbox = []
        mt.on_arrivals(0.0, "fe", [1], [0.0], [10 * MS], out)  # head: 10 - l(4) = 1 ms
        mt.on_arrivals(0.0, "fe", [2, 3, 4, 5], [0.0] * 4, [30 * MS] * 4, out)
        mt.on_timer(2 * MS, out)  # not due; now go past the head's 4-batch moment
        out.clear()
        mt._update(2.0 * MS, -math.inf, out)
        mt._publish(2.0 * MS, out)
    # window: keeping request 1 would force a batch < 4 (10 - 2 = 8 < l(4) = 9): dropped
    assert window.n_dropped == 1
    assert window.cand_bs == 4
    # alone: request 1 can still finish alone, so it stays and bounds the batch: l(b) <= 8
    assert alone.n_dropped == 0
    assert alone.cand_bs == 3


def test_eager_edf_keeps_a_head_that_eager_drops_and_starts_at_once() -> None:
    # Clockwork-style eager-edf: no target batch size, so the head that the window drop of
    # eager drops (it would force a batch below 4) stays and runs now, in the largest batch
    # that meets its deadline
    runs: dict[str, ModelThread] = {}
    for policy in ("eager", "eager-edf"):
        mt = runs[policy] = _mt(policy)
        mt.sizing.target = mt.sizing.keep_min = 4
        out: Outbox = []
        mt.on_arrivals(0.0, "fe", [1], [0.0], [10 * MS], out)
        mt.on_arrivals(0.0, "fe", [2, 3, 4, 5], [0.0] * 4, [30 * MS] * 4, out)
        mt._update(2.0 * MS, -math.inf, out)
    assert (runs["eager"].n_dropped, runs["eager"].cand_bs) == (1, 4)
    edf = runs["eager-edf"]
    assert (edf.n_dropped, edf.cand_bs, edf.cand_exec) == (0, 3, 2.0 * MS)


def test_window_grows_past_target_while_earliest_deadline_holds() -> None:
    mt = _mt(drop="window")
    mt.sizing.target = mt.sizing.keep_min = 2
    _arrive(mt, 0.0, list(range(10)), slo=30 * MS)
    assert mt.cand_bs == 10  # free lunch: l(10) = 15 <= 30


def test_fcfs_caps_batch_at_target() -> None:
    mt = _mt(drop="fcfs")
    mt.sizing.target = mt.sizing.keep_min = 2
    _arrive(mt, 0.0, list(range(10)), slo=30 * MS)
    assert mt.cand_bs == 2


def test_unprofiled_batch_sizes_are_infeasible() -> None:
    profile = LatencyProfile.linear(1.0, 5.0, 3)
    mt = ModelThread("m", profile, 100 * MS, "deferred", publish_lead_s=None)
    (cand,) = _cands(_arrive(mt, 0.0, list(range(10)), slo=100 * MS))
    assert cand.batch_size == 3
    # l(max_batch + 1) is infinite: no request can join, so the candidate is due at once
    assert cand.exec_at == pytest.approx(0.0)


def test_grant_emits_plan_answer_and_next_candidate() -> None:
    mt = _mt(d_ctrl_s=0.1 * MS)
    mt.sizing.target = mt.sizing.keep_min = 1
    out: Outbox = []
    _arrive(mt, 0.0, [1, 2], frontend="fa", outbox=out)
    _arrive(mt, 0.0, [3], frontend="fb", outbox=out)
    out.clear()
    mt.on_grant(0.0, GrantGpu("m", 7, 99, free_at=6 * MS), out)
    plans = [(d, m) for d, m in out if isinstance(m, BatchPlan)]
    answers = [(d, m) for d, m in out if isinstance(m, GrantAnswer)]
    (dest, plan), ((adest, answer),) = plans[0], answers
    assert dest == ("backend", 7) and adest == TO_RANK
    # GPU frees at 6 ms: a 3-batch finishing by 12 ms must start by 12 - 8 = 4 ms; with the
    # GPU free only at 6 ms the window policy keeps 1 (6 + l(1) = 12)
    assert plan.exec_at == pytest.approx(6 * MS)
    assert len(plan.request_ids) == 1
    assert plan.expected_finish_at == pytest.approx(12 * MS)
    assert answer.used and answer.grant_id == 99 and answer.free_at == pytest.approx(12 * MS)
    assert [plan.frontends[i] for i in plan.request_frontend] == ["fa"]
    # the other two stay (another GPU could still run them) and form the next candidate,
    # published after the answer
    assert mt.queue_length == 2
    assert out.index(answers[0]) > out.index(plans[0])
    assert isinstance(out[-1][1], CandidateUpdate) and out[-1][1].batch_size == 2


def test_grant_plan_names_each_requests_frontend() -> None:
    mt = _mt(drop="alone")
    out: Outbox = []
    _arrive(mt, 0.0, [1, 2], frontend="fa", outbox=out)
    _arrive(mt, 0.0, [3], frontend="fb", outbox=out)
    out.clear()
    mt.on_grant(0.0, GrantGpu("m", 0, 1, free_at=0.0), out)
    plan = next(m for _, m in out if isinstance(m, BatchPlan))
    assert plan.request_ids == [1, 2, 3]
    assert [plan.frontends[i] for i in plan.request_frontend] == ["fa", "fa", "fb"]
    # the answer is followed by the next candidate (a withdrawal needs none: the rank has none)
    assert isinstance(out[-1][1], GrantAnswer)


def test_grant_with_empty_queue_returns_gpu_unused() -> None:
    mt = _mt()
    out: Outbox = []
    mt.on_grant(1.0, GrantGpu("m", 3, 5, free_at=0.5), out)
    ((dest, answer),) = out
    assert dest == TO_RANK and isinstance(answer, GrantAnswer)
    assert not answer.used and answer.free_at == 0.5


def test_grant_for_unknown_gpu_is_returned() -> None:
    mt = _mt()
    mt.set_gpus(0.0, [0, 1], [])
    out = _arrive(mt, 0.0, [1])
    out.clear()
    mt.on_grant(0.0, GrantGpu("m", 9, 1, free_at=0.0), out)
    answer = next(m for _, m in out if isinstance(m, GrantAnswer))
    assert not answer.used
    assert isinstance(out[-1][1], CandidateUpdate)  # the rank gets the candidate back


def test_a_gpu_of_another_kind_runs_the_batch_its_own_profile_sizes() -> None:
    fast = LatencyProfile.linear(0.5, 2.0, 32)  # l(b) = b/2 + 2 ms
    too_slow = LatencyProfile.linear(4.0, 9.0, 32)  # l(1) = 13 ms: past the 12 ms deadline
    mt = _mt(drop="alone")
    mt.set_gpu_profiles({1: fast, 2: too_slow, 3: fast})
    out = _arrive(mt, 0.0, [1, 2, 3, 4])
    out.clear()
    # the slow kind could run none of them: the GPU goes back unused, nothing is dropped
    mt.on_grant(0.0, GrantGpu("m", 2, 1, free_at=0.0), out)
    answer = next(m for _, m in out if isinstance(m, GrantAnswer))
    assert not answer.used and mt.queue_length == 4
    assert not [m for _, m in out if isinstance(m, (DropNotice, BatchPlan))]
    assert isinstance(out[-1][1], CandidateUpdate)  # the rank gets the candidate back
    out.clear()
    # the fast kind: its batch takes fast.latency(bs), not the thread's own l(bs)
    mt.on_grant(0.0, GrantGpu("m", 1, 2, free_at=0.0), out)
    plan = next(m for _, m in out if isinstance(m, BatchPlan))
    answer = next(m for _, m in out if isinstance(m, GrantAnswer))
    bs = len(plan.request_ids)
    assert bs == 4 and plan.gpu_id == 1
    assert plan.expected_finish_at - plan.exec_at == pytest.approx(fast.latency(bs))
    assert fast.latency(bs) < PROFILE.latency(bs)
    assert answer.used and answer.free_at == plan.expected_finish_at
    # a GPU not listed runs the thread's own profile
    out = _arrive(mt, 0.001, [5, 6])
    out.clear()
    mt.on_grant(0.001, GrantGpu("m", 0, 3, free_at=0.0), out)
    plan = next(m for _, m in out if isinstance(m, BatchPlan))
    bs = len(plan.request_ids)
    assert plan.expected_finish_at - plan.exec_at == pytest.approx(PROFILE.latency(bs))


def test_no_other_kind_keeps_the_threads_own_sizing() -> None:
    mt = _mt()
    mt.set_gpu_profiles({})
    assert mt._kind_sizing is None
    mt.set_gpu_profiles({4: PROFILE})
    assert mt._kind_sizing is not None and mt._kind_sizing[4].meter is mt.meter


def test_wake_at_is_last_grantable_moment_and_timer_reevaluates() -> None:
    mt = _mt(drop="alone")
    _arrive(mt, 0.0, [1, 2])
    assert mt.wake_at == pytest.approx(mt.cand_latest + TIMER_SLACK_S)
    out: Outbox = []
    mt.on_timer(mt.wake_at, out)  # the 2-batch can no longer start in time: shrink to 1
    (cand,) = _cands(out)
    assert cand.batch_size == 1
    assert mt.wake_at > 5 * MS
    mt.on_timer(mt.wake_at, out)  # even alone it is too late now: both dropped
    assert mt.n_dropped == 2
    assert mt.wake_at == math.inf
    assert _cands(out)[-1].batch_size == 0  # withdrawn


def test_split_meta_by_model() -> None:
    meta = RequestMetaBatch("fe", [1, 2, 3], ["a", "b", "a"], [0.0, 0.1, 0.2], [1.0, 1.1, 1.2])
    split = split_meta_by_model(meta)
    assert split == {"a": ([1, 3], [0.0, 0.2], [1.0, 1.2], []), "b": ([2], [0.1], [1.1], [])}
    same = RequestMetaBatch("fe", [1, 2], ["a", "a"], [0.0, 0.1], [1.0, 1.1])
    assert split_meta_by_model(same) == {"a": ([1, 2], [0.0, 0.1], [1.0, 1.1], [])}


def test_jitter_allowance_moves_frontrun_and_latest_policy_earlier() -> None:
    deferred = ModelThread("m", PROFILE, 12 * MS, "deferred", jitter_s=0.5 * MS,
                           publish_lead_s=None)
    (cand,) = _cands(_arrive(deferred, 0.0, [1, 2]))
    assert cand.exec_at == pytest.approx((12 - 0.5 - 8) * MS)
    assert cand.latest == pytest.approx((12 - 7) * MS)  # feasibility is unchanged
    latest = ModelThread("m", PROFILE, 12 * MS, "latest", jitter_s=0.5 * MS,
                         publish_lead_s=None)
    (cand,) = _cands(_arrive(latest, 0.0, [1, 2]))
    assert cand.exec_at == pytest.approx((12 - 0.5 - 7) * MS)


def test_suffix_drop_keeps_a_head_the_queue_could_not_fill_a_target_batch_behind() -> None:
    # l(b) = b + 5 ms, target 4, at 2 ms: the head (deadline 10.1 ms) and four requests (10.3 ms)
    # each fit a batch of 3 (done at 10 ms), none of 4 (11 ms). The window rule (the 2021 rule)
    # asks the head for a batch of min(target, queued) = 4 and drops heads until 3 are left;
    # the suffix rule (nexuslb 2022) asks for min(target, longest feasible suffix) = 3 and keeps
    # the head, which goes in a batch of 3.
    window = _mt(keep_tolerance=0.0)
    suffix = _mt(drop="suffix", keep_tolerance=0.0)
    for mt in (window, suffix):
        mt.sizing.set_target(4)
        out: Outbox = []
        mt.on_arrivals(0.0, "fe", [1], [0.0], [10.1 * MS], out)
        mt.on_arrivals(0.0, "fe", [2, 3, 4, 5], [0.0] * 4, [10.3 * MS] * 4, out)
        mt._update(2.0 * MS, -math.inf, out)
    assert (window.n_dropped, window.cand_bs) == (2, 3)
    assert (suffix.n_dropped, suffix.cand_bs) == (0, 3)
    # with nothing able to finish even alone, the suffix rule drops everything
    late = _mt(drop="suffix")
    late.on_arrivals(0.0, "fe", [1, 2], [0.0] * 2, [5.5 * MS] * 2, out := [])
    late._update(0.5 * MS, -math.inf, out)
    assert (late.n_dropped, late.cand_bs) == (2, 0)


def test_keep_tolerance_keeps_head_for_a_nearly_as_efficient_batch() -> None:
    # l(b) = b + 5: per-request cost l(b)/b is 9/4 = 2.25 at 4 and 8/3 = 2.67 (+19%) at 3
    strict = _mt(keep_tolerance=0.0)
    loose = _mt(keep_tolerance=0.2)
    for mt in (strict, loose):
        mt.sizing.set_target(4)
        out: Outbox = []
        mt.on_arrivals(0.0, "fe", [1], [0.0], [10 * MS], out)
        mt.on_arrivals(0.0, "fe", [2, 3, 4, 5], [0.0] * 4, [30 * MS] * 4, out)
        mt._update(2.0 * MS, -math.inf, out)  # the head can still go in a batch of 3, not 4
    assert (strict.sizing.keep_min, loose.sizing.keep_min) == (4, 3)
    assert strict.n_dropped == 1
    assert loose.n_dropped == 0 and loose.cand_bs == 3


def test_publish_ahead_holds_candidate_until_lead_before_its_rank_timer() -> None:
    mt = ModelThread("m", PROFILE, 12 * MS, "deferred", publish_lead_s=1 * MS)
    out = _arrive(mt, 0.0, [1, 2])  # frontrun 12 - l(3) = 4 ms: rank timer at 4 ms
    assert _cands(out) == []
    assert mt.wake_at == pytest.approx(3 * MS)
    _arrive(mt, 0.5 * MS, [3], outbox=out)  # frontrun moves to 12 - l(4) = 3 ms
    assert _cands(out) == [] and mt.wake_at == pytest.approx(2 * MS)
    mt.on_timer(2 * MS, out)
    (cand,) = _cands(out)
    assert cand.batch_size == 3 and cand.exec_at == pytest.approx(3 * MS)
    out.clear()
    _arrive(mt, 2.5 * MS, [4], outbox=out)  # the rank holds one now: changes go out at once
    assert _cands(out)[0].batch_size == 4


def _mt30(policy: str = "deferred") -> ModelThread:
    # SLO 30 ms: target batch 10, so at 1000 r/s the load needs under 2 GPUs (l(10)/10 = 1.5 ms
    # per request) and at 10,000 r/s about 15
    return ModelThread("m", PROFILE, 30 * MS, SchedulePolicy.parse(policy, "window"),
                       publish_lead_s=None)


def test_deferred_bl_model_sharing_gpus_aims_earlier_after_a_missed_grant_window() -> None:
    # 1000 r/s: beta * lambda = 5 requests, and the load needs under 2 GPUs, so the model
    # shares its GPUs and defers while its batch is below beta * lambda - 1 = 4.
    meter = _taught_meter(10)
    now = TAUGHT_UNTIL_S
    mt = _mt30("deferred-bl")
    mt.sizing.set_meter(meter)
    (cand,) = _cands(_arrive(mt, now, [1], slo=30 * MS))
    d = now + 30 * MS
    assert cand.exec_at == pytest.approx(d - PROFILE.latency(2))  # frontrun: waiting pays
    assert not cand.early_ok  # deferred-bl is never started early
    assert mt.n_window_misses == 0 and mt.miss_margin_s == 0.0
    # No grant came before the window closed: a miss, and the aim moves earlier.
    mt.on_timer(mt.wake_at, [])
    assert mt.n_window_misses == 1
    assert mt.miss_margin_s == pytest.approx(DEFER_MISS_WIDEN_S)
    later = mt.wake_at + 1 * MS
    (cand2,) = _cands(_arrive(mt, later, [2], slo=30 * MS))
    assert cand2.exec_at == pytest.approx(later + 30 * MS - DEFER_MISS_WIDEN_S - PROFILE.latency(2))
    # Each granted batch gives a little of the margin back.
    out: Outbox = []
    mt.on_grant(later, GrantGpu("m", 0, 1, free_at=later), out)
    assert any(isinstance(m, BatchPlan) for _, m in out)
    assert mt.miss_margin_s == pytest.approx(DEFER_MISS_WIDEN_S - DEFER_MISS_RELAX_S)


def test_missed_windows_widen_the_aim_at_most_by_the_cap() -> None:
    meter = _taught_meter(10)
    mt = _mt30("deferred-bl")
    mt.sizing.set_meter(meter)
    now = TAUGHT_UNTIL_S
    for rid in range(40):  # 40 misses of 0.5 ms would be 20 ms
        _arrive(mt, now, [rid], slo=30 * MS)
        mt.on_timer(mt.wake_at, [])
        now = mt.wake_at + 1 * MS if math.isfinite(mt.wake_at) else now + 1 * MS
    assert mt.n_window_misses == 40
    assert mt.miss_margin_s == pytest.approx(DEFER_MISS_MAX_S)


@pytest.mark.parametrize("policy", ["frontrun", "eager"])
def test_other_policies_learn_no_margin(policy: str) -> None:
    meter = _taught_meter(10)
    mt = _mt30(policy)
    mt.sizing.set_meter(meter)
    _arrive(mt, TAUGHT_UNTIL_S, [1], slo=30 * MS)
    mt.on_timer(mt.wake_at, [])
    assert mt.n_window_misses == 0 and mt.miss_margin_s == 0.0


def test_deferred_model_stops_deferring_while_its_windows_are_lost() -> None:
    # 1000 r/s, SLO 30 ms: the model shares its GPUs, defers, and is early_ok
    now = TAUGHT_UNTIL_S
    mt = _mt30()
    mt.sizing.set_meter(_taught_meter(10))
    (cand,) = _cands(_arrive(mt, now, [1, 2, 3], slo=30 * MS))
    assert cand.exec_at > now and cand.early_ok and cand.shared
    # its window closes with no grant: one lost window lifts the estimate over DEFER_LOSS_MAX
    mt.on_timer(mt.wake_at, [])
    assert mt.n_window_misses == 1 and mt.defer_loss == pytest.approx(DEFER_LOSS_WEIGHT)
    assert DEFER_LOSS_WEIGHT > DEFER_LOSS_MAX and mt.miss_margin_s == 0.0
    # so its next candidates start at once (not early_ok: there is nothing to start early) ...
    now = mt.wake_at + 1 * MS
    expected_grants = math.ceil(math.log(DEFER_LOSS_MAX / DEFER_LOSS_WEIGHT)
                                / math.log(1 - DEFER_LOSS_DECAY))
    for rid in range(10, 10 + expected_grants):
        (c,) = _cands(_arrive(mt, now, [rid], slo=30 * MS))
        assert c.exec_at == pytest.approx(now) and not c.early_ok
        mt.on_grant(now, GrantGpu("m", 0, rid, free_at=now), [])
        now += 2 * MS
    # ... until the grants since have decayed the estimate under the bar: it defers again
    assert mt.defer_loss <= DEFER_LOSS_MAX
    (again,) = _cands(_arrive(mt, now, [1000], slo=30 * MS))
    # (one request is below half of beta*lambda - 1 = 4: deferred, but not early_ok)
    assert again.exec_at > now and not again.early_ok
    # a deferred candidate granted in its window lowers the estimate by the full weight
    before = mt.defer_loss
    mt.on_grant(now, GrantGpu("m", 0, 1000, free_at=now), [])
    assert mt.defer_loss == pytest.approx(before * (1 - DEFER_LOSS_WEIGHT))


def test_with_room_two_lost_windows_do_not_stop_deferral_and_three_do() -> None:
    # as above, but the cluster has room (DEFER_ROOM_ALL_BUSY): a lost window there is a rare
    # event, so one or two leave the estimate under DEFER_ROOM_LOSS_MAX and the model defers
    # on; a third soon after lifts it over, and the model starts at once
    now = TAUGHT_UNTIL_S
    mt = _mt30()
    mt.sizing.set_meter(_taught_meter(10))
    mt.set_cluster_load(light=False, room=True)
    for lost in (1, 2, 3):
        (cand,) = _cands(_arrive(mt, now, [lost], slo=30 * MS))
        assert cand.exec_at > now, lost  # deferred
        closes = mt.wake_at
        mt.on_timer(closes, [])  # its window closes with no grant
        assert mt.n_window_misses == lost
        now = closes + 1 * MS
    assert 2 * DEFER_LOSS_WEIGHT < DEFER_ROOM_LOSS_MAX < mt.defer_loss
    (cand,) = _cands(_arrive(mt, now, [10], slo=30 * MS))
    assert cand.exec_at == pytest.approx(now)


def test_deferred_backs_off_while_its_retries_keep_losing_windows() -> None:
    now = TAUGHT_UNTIL_S
    mt = _mt30()
    mt.sizing.set_meter(_taught_meter(10))
    ids = itertools.count(10)

    def defers() -> bool:  # a new candidate waits for its aim
        (cand,) = _cands(_arrive(mt, now, [next(ids)], slo=30 * MS))
        return cand.exec_at > now

    def lose_window() -> None:  # the candidate's window closes with no grant
        nonlocal now
        closes = mt.wake_at
        mt.on_timer(closes, [])
        now = closes + 1 * MS

    def batches_until_it_defers() -> int:
        nonlocal now
        count = 0
        while not defers():
            mt.on_grant(now, GrantGpu("m", 0, count, free_at=now), [])
            count += 1
            now += 2 * MS
        return count

    assert defers()
    lose_window()
    first = batches_until_it_defers()
    assert mt.sizing.defer_backoff == 1
    lose_window()  # the retry loses its window at once: a loss soon after the last
    assert mt.sizing.defer_backoff == 2
    second = batches_until_it_defers()
    assert second > first  # a longer wait before the next try
    # kept windows that bring the estimate well under the bar reset the backoff
    kept = 0
    while mt.sizing.defer_backoff > 1:
        mt.on_grant(now, GrantGpu("m", 0, kept, free_at=now), [])
        kept += 1
        now += 2 * MS
        assert defers()
    assert mt.defer_loss < DEFER_LOSS_RECENT * DEFER_LOSS_MAX and kept > 10


def test_staggered_model_learns_no_margin() -> None:
    # 10,000 r/s needs about 15 GPUs at the target batch: the model runs staggered over GPUs of
    # its own, where a missed window is the stagger at work, and keeps the authors' aim.
    meter = _taught_meter(100)
    mt = _mt30()
    mt.sizing.set_meter(meter)
    _arrive(mt, TAUGHT_UNTIL_S, [1], slo=30 * MS)
    assert mt.cand_exec > TAUGHT_UNTIL_S  # it defers
    mt.on_timer(mt.wake_at, [])
    assert mt.n_window_misses == 0 and mt.miss_margin_s == 0.0


def test_plan_ids_come_from_the_hosts_source_in_grant_order() -> None:
    shared = itertools.count(1024 + 3, 1024)  # a shard's: seq * MAX_SHARDS + index 3
    first = ModelThread("a", PROFILE, 12 * MS, "eager", plan_ids=shared, publish_lead_s=None)
    second = ModelThread("b", PROFILE, 12 * MS, "eager", plan_ids=shared, publish_lead_s=None)
    ids: list[int] = []
    for mt in (first, second, first):
        out = _arrive(mt, 0.0, [len(ids)])
        mt.on_grant(0.0, GrantGpu(mt.model, 0, 1, free_at=0.0), out)
        ids.append(next(m.plan_id for _, m in out if isinstance(m, BatchPlan)))
    assert ids == [1024 + 3, 2 * 1024 + 3, 3 * 1024 + 3]
    # without a source: crc32(model) << 32, + 1, + 2, ...
    alone = _mt("eager")
    out = _arrive(alone, 0.0, [1])
    alone.on_grant(0.0, GrantGpu("m", 0, 1, free_at=0.0), out)
    plan = next(m for _, m in out if isinstance(m, BatchPlan))
    assert plan.plan_id == (zlib.crc32(b"m") << 32) + 1


def test_take_queued_empties_the_queue_by_frontend_and_withdraws_the_candidate() -> None:
    mt = _mt("deferred", "alone")
    _arrive(mt, 0.0, [1, 2], frontend="fa")
    _arrive(mt, 0.0, [3], frontend="fb")
    _arrive(mt, 0.0, [4], frontend="fa")
    assert mt.cand_bs and mt.wake_at < math.inf
    out: Outbox = []
    assert mt.take_queued(0.0, out) == {"fa": [1, 2, 4], "fb": [3]}
    assert mt.queue_length == 0 and mt.cand_bs == 0 and mt.wake_at == math.inf
    assert [m.batch_size for m in _cands(out)] == [0]  # the rank held a candidate: withdrawn
    out.clear()
    assert mt.take_queued(0.0, out) == {} and out == []


def test_grant_window_left_is_the_margin_to_the_last_grantable_moment() -> None:
    mt = _mt("deferred", "alone", d_ctrl_s=0.5 * MS)
    assert mt.grant_window_left(0.0) is None
    _arrive(mt, 0.0, [1, 2])  # deadline 12 ms, l(2) = 7 ms: latest 5 ms, delay 0.5 ms
    assert mt.grant_window_left(1 * MS) == pytest.approx(3.5 * MS)
    assert mt.grant_window_left(5 * MS) == pytest.approx(-0.5 * MS)


def test_set_profile_rederives_the_target_and_keep_min() -> None:
    mt = _mt(budget_s=12 * MS)
    slower = LatencyProfile.linear(3.0, 5.0, 32)
    expected = ModelThread("m", slower, 12 * MS, "deferred", budget_s=12 * MS)
    mt.set_profile(slower)
    assert mt.profile is slower
    assert (mt.target, mt.sizing.keep_min) == (expected.target, expected.sizing.keep_min)


def test_replanned_requests_rejoin_the_queue_in_deadline_order_or_are_dropped() -> None:
    """on_replan: a plan's requests come back into the queue ahead of later deadlines and are
    batched again; they are not new load (n_arrived and the rate meter do not count them);
    one whose deadline no longer allows a batch is dropped DEADLINE, as any queued request."""
    mt = _mt(drop="alone")
    outbox: Outbox = []
    mt.on_arrivals(0.0, "fe", [5], [0.0], [40 * MS], outbox)
    mt.on_replan(10 * MS, "fe", [1, 2, 3], [11 * MS, 30 * MS, 35 * MS], outbox)
    assert mt.n_arrived == 1 and mt.n_replanned == 3 and mt.meter.rate() is None
    # request 1 (due at 11 ms) cannot finish: l(1) = 6 ms after 10 ms
    drops = [m for _, m in outbox if isinstance(m, DropNotice)]
    assert [d.request_ids for d in drops] == [[1]] and drops[0].error == "DEADLINE"
    assert mt.queue_length == 3
    outbox.clear()
    mt.on_grant(10 * MS, GrantGpu("m", 0, 1, 10 * MS), outbox)
    plan = next(m for _, m in outbox if isinstance(m, BatchPlan))
    assert plan.request_ids == [2, 3, 5] and plan.finish_by == [30 * MS, 35 * MS, 40 * MS]


def test_replanned_requests_keep_their_rows_and_are_not_counted_again() -> None:
    """A re-planned request of several rows comes back with its rows (a batch sums them), and
    neither n_arrived nor n_extra_rows counts it a second time."""
    mt = _mt(drop="alone")
    outbox: Outbox = []
    mt.on_replan(0.0, "fe", [1, 2], [30 * MS, 31 * MS], outbox, [3, 1])
    assert mt.n_arrived == 0 and mt.n_extra_rows == 0 and mt.n_replanned == 2
    outbox.clear()
    mt.on_grant(0.0, GrantGpu("m", 0, 1, 0.0), outbox)
    plan = next(m for _, m in outbox if isinstance(m, BatchPlan))
    assert plan.request_ids == [1, 2] and plan.rows == [3, 1]


# --------------------------------------------------------------------------- deferral's yield


def test_deferral_yield_stops_deferring_where_nothing_joins_and_retries_with_backoff() -> None:
    closed = DeferralYield()
    closed.note_deferred(joined_rows=0.0, expected_rows=15.0)  # a closed loop: none joins
    assert not closed.pays and closed.paused_for == DEFER_YIELD_RETRY_BATCHES
    for _ in range(DEFER_YIELD_RETRY_BATCHES):
        closed.note_at_once()
    assert closed.pays  # the retry
    closed.note_deferred(joined_rows=1.0, expected_rows=15.0)
    assert closed.paused_for == 2 * DEFER_YIELD_RETRY_BATCHES  # found none again: backs off
    for _ in range(2 * DEFER_YIELD_RETRY_BATCHES):
        closed.note_at_once()
    for _ in range(DEFER_YIELD_KEPT_RESET):  # joiners now come as promised: backoff resets
        closed.note_deferred(joined_rows=2.0, expected_rows=2.0)
    assert closed.pays and closed.backoff == 1


def test_deferral_yield_keeps_deferring_under_poisson_joiners() -> None:
    """Poisson joiners: as many as the rate promises, on average. Thousands of candidates that
    each expect 0.7 joiners (the joiner rule's bar) never stop deferral."""
    rng = np.random.default_rng(1)
    poisson = DeferralYield()
    for _ in range(5000):
        poisson.note_deferred(float(rng.poisson(0.7)), 0.7)
        assert poisson.pays
    # Too little seen to judge: a few unlucky candidates do not stop it either.
    early = DeferralYield()
    for _ in range(4):
        early.note_deferred(0.0, 0.7)
    assert early.pays


def test_a_model_whose_deferred_batches_get_no_joiners_starts_at_once() -> None:
    """Closed-loop clients: each request comes only after the last answer, so a deferred batch
    waits to its aim with nobody joining. Each such batch had room for one more row (the frontrun
    aim is the last moment one more could join): after DEFER_YIELD_MIN_EXPECTED of them the
    model starts at once (the demo's sync client: 190 ms a request before, l(1) plus the
    allowances after)."""
    now = TAUGHT_UNTIL_S
    mt = _mt30()
    mt.sizing.set_meter(_taught_meter(10))  # 1000 r/s: 23 joiners promised before the aim
    deferred = 0
    for rid in range(1, 10):
        (cand,) = _cands(_arrive(mt, now, [rid], slo=30 * MS))
        if cand.exec_at == pytest.approx(now):
            break
        assert cand.exec_at > now + 20 * MS  # defers to its aim
        deferred += 1
        now = cand.exec_at
        mt.on_grant(now, GrantGpu("m", 0, rid, free_at=now), [])
        now += MS
    assert not mt.sizing.deferral_yield.pays
    # one promised row each, in decayed sums: the first count that adds up to the minimum
    needed, promised = 0, 0.0
    while promised < DEFER_YIELD_MIN_EXPECTED:
        promised = (1.0 - DEFER_YIELD_DECAY) * promised + 1.0
        needed += 1
    assert deferred == needed


def test_eager_edf_candidates_carry_their_deadline_to_the_rank() -> None:
    """The rank orders eager-edf's waiting candidates by deadline: latest + duration, which the
    candidate must make its head's deadline (the other policies send no duration)."""
    for policy, carries in (("eager-edf", True), ("eager-lsf", False), ("eager", False)):
        mt = ModelThread("m", PROFILE, 30 * MS, SchedulePolicy.parse(policy))
        (cand,) = _cands(_arrive(mt, 1.0, [1, 2], slo=30 * MS))
        deadline = 1.0 + 30 * MS
        assert (cand.latest + cand.duration == pytest.approx(deadline)) is carries, policy


def test_a_cold_models_lone_first_request_waits_for_a_second_no_later_than_the_first_sample(
) -> None:
    """Before its rate meter's first sample a model's lone first request is no evidence that
    another will join it (DEFER_COLD_MIN_REQUESTS): with the demo's SLO of 200 ms it is planned
    no later than the sample (its arrival + 50 ms), about 140 ms before its last moment, where a
    host stall made it a DEADLINE. A second request is a stream: the batch defers as frontrun
    does (a cold burst batches there; Symphony's section 3.3 example), and frontrun and
    deferred-bl keep their aims."""
    slo = 200 * MS
    mt = ModelThread("m", PROFILE, slo, SchedulePolicy.parse("deferred"), publish_lead_s=None,
                     jitter_s=1 * MS)
    (cand,) = _cands(_arrive(mt, 1.0, [1], slo=slo))
    assert mt.meter.rate() is None
    assert cand.exec_at == pytest.approx(1.0 + DEFAULT_RATE_BUCKET_S)  # the first sample
    assert mt.meter.first_sample_at() == pytest.approx(cand.exec_at)
    assert cand.latest - cand.exec_at > 140 * MS  # its last moment is 1.0 + 200 ms - l(1)
    # a second request 10 ms later, still before the sample: the pair aims at d - jitter - l(3)
    (pair,) = _cands(_arrive(mt, 1.01, [2], slo=slo))
    assert pair.batch_size == 2
    assert pair.exec_at == pytest.approx(1.0 + slo - 1 * MS - PROFILE.latency(3))
    for policy in ("frontrun", "deferred-bl"):
        other = ModelThread("m", PROFILE, slo, SchedulePolicy.parse(policy),
                            publish_lead_s=None, jitter_s=1 * MS)
        (c,) = _cands(_arrive(other, 1.0, [1], slo=slo))
        assert c.exec_at == pytest.approx(1.0 + slo - 1 * MS - PROFILE.latency(2)), policy


def test_a_cold_models_lone_first_request_learns_nothing_from_its_wait() -> None:
    """The lone first request's early start is not a deferral that lost or kept a window: no
    window-loss estimate, no yield, and its grant at the capped aim plans it there."""
    slo = 200 * MS
    mt = ModelThread("m", PROFILE, slo, SchedulePolicy.parse("deferred"), publish_lead_s=None)
    (cand,) = _cands(_arrive(mt, 1.0, [1], slo=slo))
    grant_at = cand.exec_at - cand.send_delay
    out: Outbox = []
    mt.on_grant(grant_at, GrantGpu("m", 0, 1, free_at=grant_at), out)
    (plan,) = [m for _, m in out if isinstance(m, BatchPlan)]
    assert plan.request_ids == [1] and plan.exec_at == pytest.approx(1.0 + DEFAULT_RATE_BUCKET_S)
    assert mt.defer_loss == 0.0 and mt.n_window_misses == 0
    yield_ = mt.sizing.deferral_yield
    assert yield_.pays and yield_.expected == 0.0 and yield_.joined == 0.0
