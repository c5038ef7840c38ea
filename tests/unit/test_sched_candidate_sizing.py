"""CandidateSizing alone: the target and keep_min, the drop policies' head and batch over a
queue it is handed, the aim by schedule policy, and what the deferred policies learn.

No ModelThread here: each test builds the part with a profile and a policy and hands it plain
lists, as the ModelThread hands it its queue.
"""

from __future__ import annotations

import math

import pytest

from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.scheduler.candidate_sizing import CandidateSizing
from zserve.scheduler.common import TIMER_SLACK_S
from zserve.scheduler.policy import (
    DEFER_LOSS_DECAY,
    DEFER_LOSS_MAX,
    DEFER_LOSS_RECENT,
    DEFER_LOSS_WEIGHT,
    DEFER_MISS_MAX_S,
    DEFER_MISS_RELAX_S,
    DEFER_MISS_WIDEN_S,
    RpsMeter,
    target_batch_size,
)

MS = 1e-3
# l(b) = b + 5 ms, b <= 32
PROFILE = LatencyProfile.linear(1.0, 5.0, 32)
NEVER = -math.inf  # gpu_free_at when not granting


def _sizing(policy: str = "frontrun", drop: str = "window", *, slo_s: float = 100 * MS,
            keep_tolerance: float = 0.0, jitter_s: float = 0.0,
            d_ctrl_s: float = 0.0, d_data_s: float = 0.0) -> CandidateSizing:
    return CandidateSizing(PROFILE, SchedulePolicy.parse(policy, drop), slo_s=slo_s,
                           keep_tolerance=keep_tolerance, jitter_s=jitter_s, d_ctrl_s=d_ctrl_s,
                           d_data_s=d_data_s)


def _meter_at(rate_per_bucket: int, buckets: int = 20, bucket_s: float = 0.05) -> RpsMeter:
    meter = RpsMeter(bucket_s, 100)
    for step in range(buckets + 1):
        meter.add(step * bucket_s, rate_per_bucket)
    return meter


# ---------------------------------------------------------------------- the target


def test_the_target_follows_the_metered_rate_and_keep_min_its_tolerance() -> None:
    strict = _sizing(keep_tolerance=0.0)
    assert strict.target == target_batch_size(PROFILE, strict.budget_s, None, 0.0)
    assert strict.keep_min == strict.target
    # 100 rows every 50 ms (about 2000 r/s): a bucket sealed by an arrival moves the target
    for step in range(21):
        strict.note_arrivals(step * 0.05, 100, 100)
    rate = strict.meter.rate()
    assert rate is not None and rate == pytest.approx(2000.0, rel=0.1)
    assert strict.target == target_batch_size(PROFILE, strict.budget_s, rate, 0.0) > 1
    loose = _sizing(keep_tolerance=0.1)
    loose.set_target(8)
    # l(b)/b within 10% of l(8)/8 = 13/8: l(7)/7 = 12/7 is 5.5% above it, l(6)/6 = 11/6 is 13%
    assert (loose.target, loose.keep_min) == (8, 7)


def test_a_new_profile_re_derives_the_target_at_the_current_rate() -> None:
    sizing = _sizing()
    sizing.set_meter(_meter_at(100))
    slow = LatencyProfile.linear(4.0, 5.0, 32)
    sizing.set_profile(slow)
    assert sizing.table == slow.table_s and sizing.max_batch == 32
    assert sizing.target == target_batch_size(slow, sizing.budget_s, 2000.0, 0.0)


# ---------------------------------------------------------------------- the batch


def test_window_drop_bisects_past_heads_that_would_force_a_batch_below_keep_min() -> None:
    sizing = _sizing(drop="window")
    sizing.target = sizing.keep_min = 4
    # at 2 ms a batch of 4 must start by d - l(4) = d - 9 ms: heads due before 11 ms go
    deadlines = [5 * MS, 10 * MS, 10.5 * MS, 30 * MS, 30 * MS, 30 * MS, 30 * MS, 40 * MS]
    head, bs = sizing.size_batch(deadlines, 0, 2 * MS, NEVER)
    assert head == 3
    assert bs == 5  # grown while it finishes by 30 ms: l(5) = 10 <= 28, all five
    # the same queue handed from a later head: nothing before it is looked at
    assert sizing.size_batch(deadlines, 3, 2 * MS, NEVER) == (3, 5)
    alone = _sizing(drop="alone")
    # alone drops only what cannot finish even alone (5 ms - l(1) = -1 ms < 2 ms), and the
    # head at 10 ms bounds the batch: l(3) = 8 ms fits in 10 - 2
    assert alone.size_batch(deadlines, 0, 2 * MS, NEVER) == (1, 3)


def test_fcfs_caps_the_batch_at_the_target_and_a_busy_gpu_moves_the_bar() -> None:
    sizing = _sizing(drop="fcfs")
    sizing.set_target(3)
    deadlines = [50 * MS] * 10
    assert sizing.size_batch(deadlines, 0, 0.0, NEVER) == (0, 3)
    # a GPU free only at 44 ms leaves room for one request (44 + l(1) = 50), none before it
    assert sizing.size_batch(deadlines, 0, 0.0, 44 * MS) == (0, 1)
    assert sizing.size_batch(deadlines, 0, 0.0, 45 * MS) == (10, 0)


def test_rows_make_the_batch_a_prefix_of_whole_requests() -> None:
    sizing = _sizing(drop="alone")
    deadlines = [40 * MS, 40 * MS, 40 * MS]
    rows = [20, 10, 5]
    # 20 + 10 = 30 rows: l(30) = 35 <= 40; the third would make 35 > max_batch 32
    assert sizing.size_rows(deadlines, rows, 0, 0.0, NEVER) == (0, 2, 30)
    # a head of more rows than max_batch never fits: it is dropped, the rest go
    assert sizing.size_rows([40 * MS] * 2, [33, 4], 0, 0.0, NEVER) == (1, 1, 4)


# ---------------------------------------------------------------------- the aim


@pytest.mark.parametrize(("policy", "expected_exec_s"), [
    ("frontrun", 30 * MS - 0.5 * MS - PROFILE.latency(5)),  # d - jitter - l(bs + 1)
    ("latest", 30 * MS - PROFILE.latency(4) - 0.5 * MS),  # latest - jitter
    ("eager", 1 * MS),  # earliest: now + delay
    ("timeout:0.1", 2 * MS + 0.1 * 100 * MS),  # arrival + fraction x SLO
])
def test_the_aim_by_schedule_policy(policy: str, expected_exec_s: float) -> None:
    sizing = _sizing(policy, jitter_s=0.5 * MS, d_ctrl_s=0.5 * MS, d_data_s=0.125 * MS)
    now = 0.5 * MS  # delay(4) = 0.5 + 4 x 0.125 = 1 ms: earliest 1.5 ms
    exec_at, latest, wake_at, deferred, early_ok = sizing.aim(
        now, NEVER, 4, 1, 30 * MS, 2 * MS, 7, False)
    expected = min(max(expected_exec_s + (0.5 * MS if policy == "eager" else 0.0), 1.5 * MS),
                   latest)
    assert exec_at == pytest.approx(expected)
    assert latest == pytest.approx(30 * MS - PROFILE.latency(4))
    assert wake_at == pytest.approx(latest - 1 * MS + TIMER_SLACK_S)
    assert (deferred, early_ok) == (False, False)


def test_an_early_grant_starts_at_once_and_the_aim_is_clamped_to_the_latest_start() -> None:
    sizing = _sizing("latest")
    exec_at, latest, *_ = sizing.aim(0.0, 3 * MS, 4, 1, 30 * MS, 0.0, 1, True)
    assert exec_at == 3 * MS  # start_now: the granted GPU's free time, not the aim
    # a queue already late: exec = latest, and the wake-up never before now
    exec_at, latest, wake_at, *_ = sizing.aim(29 * MS, NEVER, 4, 1, 30 * MS, 0.0, 1, False)
    assert exec_at == latest == pytest.approx(30 * MS - PROFILE.latency(4))
    assert wake_at == pytest.approx(29 * MS + TIMER_SLACK_S)


def test_deferred_defers_a_shared_model_and_lets_the_rank_start_it_early() -> None:
    sizing = _sizing("deferred")
    sizing.set_meter(_meter_at(20))  # 400 r/s: beta*lambda = 2, n = 400 x l(b)/b < 2 GPUs
    assert sizing.defer_shared
    exec_at, _, _, deferred, early_ok = sizing.aim(0.0, NEVER, 4, 1, 50 * MS, 0.0, 1, False)
    assert exec_at == pytest.approx(50 * MS - PROFILE.latency(5))  # the frontrun moment
    assert deferred and early_ok  # bs 4 >= RESCUE_SHARED_FLOOR x (beta*lambda - 1)
    # the duration a CandidateUpdate carries: l(b) of the batch the rate brings by exec_at
    grown = 4 + int(exec_at * 400.0)
    assert sizing.published_duration(0.0, 4, exec_at) == PROFILE.table_s[grown]
    edf = _sizing("eager-edf")
    assert edf.published_duration(0.0, 4, 10 * MS) == PROFILE.table_s[4]
    assert _sizing("eager").published_duration(0.0, 4, 10 * MS) == 0.0


def test_a_model_alone_on_its_gpus_runs_staggered_from_one_gpus_worth_of_load() -> None:
    # about 1,260 r/s: n = lambda x l(32)/32 = 1.46 GPUs, beta*lambda = 6.3
    shared, alone = _sizing("deferred"), _sizing("deferred")
    alone.set_alone(True)
    for sizing in (shared, alone):
        sizing.set_meter(_meter_at(60))
    aims = [s.aim(0.0, NEVER, 4, 1, 50 * MS, 0.0, 1, False) for s in (shared, alone)]
    frontrun_moment = 50 * MS - PROFILE.latency(5)
    # shared with other models: rescued from half of beta*lambda - 1 rows, its misses a loss
    assert shared.defer_shared and aims[0][0] == pytest.approx(frontrun_moment)
    assert aims[0][3] and aims[0][4]
    # alone: its own batches are the only ones it meets; staggered, rescued only from
    # beta*lambda - 1 rows, a missed window the stagger at work
    assert not alone.defer_shared and aims[1][0] == pytest.approx(frontrun_moment)
    assert not aims[1][3] and not aims[1][4]
    # at one GPU's worth or less a lone model's batches run one after another: shared, rescued
    light = _sizing("deferred")
    light.set_alone(True)
    light.set_meter(_meter_at(40))  # n = 0.97
    assert light.defer_shared
    # a sibling for another device kind keeps the flag
    assert alone.for_profile(LatencyProfile.linear(2.0, 5.0, 32)).alone
    alone.set_alone(False)
    assert alone.defer_shared


def test_deferred_starts_a_lone_request_at_once_and_tells_the_rank_where_it_would_aim() -> None:
    sizing = _sizing("deferred", d_ctrl_s=1 * MS, d_data_s=0.5 * MS)
    sizing.set_meter(_meter_at(1))  # about 20 r/s: 0.5 joiners expected in the 23 ms to the aim
    assert sizing.defer_shared
    exec_at, _, _, deferred, early_ok = sizing.aim(0.0, NEVER, 1, 1, 30 * MS, 0.0, 1, False)
    assert exec_at == pytest.approx(1.5 * MS)  # earliest: now + delay(1)
    assert not deferred and not early_ok
    # the frontrun moment it did not wait for: the rank may hold it back to there
    assert sizing.early_aim == pytest.approx(30 * MS - PROFILE.latency(2))
    # how long a lone request can wait for a GPU: SLO - d_ctrl - d_data - l(1)
    assert sizing.lone_wait_s == pytest.approx((100 - 1 - 0.5 - 6) * MS)
    # a deferring candidate (busier: joiners expected) carries none
    sizing.set_meter(_meter_at(20))
    exec_at, *_ = sizing.aim(0.0, NEVER, 4, 1, 50 * MS, 0.0, 2, False)
    assert exec_at == pytest.approx(50 * MS - PROFILE.latency(5)) and sizing.early_aim == 0.0
    # nor does any other policy
    eager = _sizing("eager")
    eager.aim(0.0, NEVER, 1, 1, 30 * MS, 0.0, 1, False)
    assert eager.early_aim == 0.0


# ---------------------------------------------------------------------- learning


def test_deferred_bl_widens_its_margin_on_missed_windows_and_relaxes_on_plans() -> None:
    sizing = _sizing("deferred-bl")
    for _ in range(10):
        sizing.on_window_missed()
    assert sizing.miss_margin_s == DEFER_MISS_MAX_S  # capped
    assert DEFER_MISS_WIDEN_S < DEFER_MISS_MAX_S
    sizing.on_planned(1.0, 1.0, deadlines=[1.1], ids=[1], arrivals=[0.9], rows=None, head=0,
                      stop=1)
    assert sizing.miss_margin_s == pytest.approx(DEFER_MISS_MAX_S - DEFER_MISS_RELAX_S)
    assert sizing.defer_loss == 0.0  # deferred-bl keeps no loss estimate


def test_deferred_raises_its_loss_estimate_backs_off_and_recovers_on_kept_windows() -> None:
    sizing = _sizing("deferred")
    sizing.on_window_missed()
    assert sizing.defer_loss == pytest.approx(DEFER_LOSS_WEIGHT)
    assert sizing.defer_backoff == 1  # the first loss: no back-off yet
    sizing.on_window_missed()  # soon after: above DEFER_LOSS_RECENT x DEFER_LOSS_MAX
    assert DEFER_LOSS_WEIGHT > DEFER_LOSS_RECENT * DEFER_LOSS_MAX
    assert sizing.defer_backoff == 2
    assert sizing.miss_margin_s == 0.0  # deferred learns no margin
    while sizing.defer_loss >= DEFER_LOSS_RECENT * DEFER_LOSS_MAX:
        sizing.on_grant(True)  # a deferred candidate kept its window
    assert sizing.defer_backoff == 1
    frontrun = _sizing("frontrun")
    frontrun.on_grant(True)
    frontrun.on_window_missed()
    assert (frontrun.defer_loss, frontrun.defer_backoff) == (0.0, 1)


def test_deferred_retries_deferral_only_on_batches_that_found_a_gpu_free() -> None:
    sizing = _sizing("deferred")
    sizing.on_window_missed()
    lost = sizing.defer_loss
    for _ in range(50):  # batches started at once that waited for a GPU: no room to defer in
        sizing.on_grant(False, waited=True)
    assert sizing.defer_loss == lost
    sizing.on_grant(False)  # one that found a GPU free decays the estimate
    assert sizing.defer_loss == pytest.approx(lost * (1 - DEFER_LOSS_DECAY))
    frontrun = _sizing("frontrun")
    frontrun.on_grant(False, waited=True)
    assert frontrun.defer_loss == 0.0


def test_a_deferred_plan_weighs_the_rows_that_joined_in_the_second_half_of_its_wait() -> None:
    sizing = _sizing("deferred")
    sizing.set_meter(_meter_at(20))  # 400 r/s, shared
    exec_at, *_ = sizing.aim(0.0, NEVER, 2, 1, 50 * MS, 0.0, 5, False)  # request 5 defers
    mid = 0.5 * exec_at  # it could have started at 0: its wait is [0, exec_at]
    arrivals = [0.0, 0.1 * mid, 1.1 * mid, 1.5 * mid]  # two joined in the second half
    deadlines = [50 * MS] * 4
    sizing.on_planned(exec_at, exec_at, deadlines=deadlines, ids=[5, 6, 7, 8],
                      arrivals=arrivals, rows=None, head=0, stop=4)
    # promised: the rate over the half (400 x 21 ms), at most the room its batch had beyond the
    # rows in by the mid: exec_at = 50 - l(3), so l(b) <= l(3) leaves 3 - 2 = 1
    assert exec_at == pytest.approx(50 * MS - PROFILE.latency(3))
    assert (sizing.deferral_yield.joined, sizing.deferral_yield.expected) == (2.0, 1.0)
    # a batch that did not defer (another head than the one that deferred) counts as at once
    sizing.deferral_yield.paused_for = 3
    sizing.on_planned(exec_at, exec_at, deadlines=deadlines, ids=[9, 6, 7, 8],
                      arrivals=arrivals, rows=None, head=0, stop=4)
    assert sizing.deferral_yield.paused_for == 2
