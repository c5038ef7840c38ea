"""The autoscaling advice's pure core (zserve.orchestrator.autoscale): Symphony's add and release
rules, the dead band, the hold after a change, the settle window and the bounds."""

from __future__ import annotations

import pytest

from zserve.orchestrator.autoscale import (
    ADD_BAD,
    BOUND,
    HOLD,
    RELEASE_IDLE,
    AutoscalePolicy,
    AutoscalePolicyError,
    Autoscaler,
    Signals,
    direction_changes,
    most_turns_within,
)

POLICY = AutoscalePolicy(min_backends=1, max_backends=64, up_window_s=10.0, down_window_s=30.0,
                         add_bad_rate=0.01, idle_floor=0.0, release_margin=0.05, settle_s=5.0,
                         down_hold_s=60.0, max_release_fraction=1.0)


def feed(scaler: Autoscaler, start: float, end: float, *, busy_gpus: float, bad_rate: float,
         rate_rps: float = 1000.0, tick_s: float = 1.0) -> float:
    """One signal per ``tick_s`` from ``start`` to ``end``: ``busy_gpus`` busy on average, the
    given share of ``rate_rps`` bad. Returns ``end``."""
    now = start
    while now < end - 1e-9:
        now += tick_s
        offered = int(rate_rps * tick_s)
        scaler.observe(now, Signals(tick_s, offered, round(offered * bad_rate),
                                    busy_gpus * tick_s, scaler.backends))
    return now


def test_overload_adds_n_r_over_one_minus_r_at_once() -> None:
    scaler = Autoscaler(POLICY, 24, 0.0)
    now = feed(scaler, 0.0, 10.0, busy_gpus=24.0, bad_rate=0.5)
    advice = scaler.advise(now)
    assert (advice.backends, advice.change, advice.reason) == (48, 24, ADD_BAD)
    assert advice.bad_rate == pytest.approx(0.5)
    assert scaler.backends == 48 and scaler.changes == [(now, 24)]


def test_an_added_burst_is_not_answered_twice_before_the_change_settles() -> None:
    scaler = Autoscaler(POLICY, 24, 0.0)
    now = feed(scaler, 0.0, 10.0, busy_gpus=24.0, bad_rate=0.5)
    assert scaler.advise(now).change == 24
    # the same bad seconds are still in the 10 s window, but were measured before the change
    now = feed(scaler, now, now + 3.0, busy_gpus=24.0, bad_rate=0.5)
    assert scaler.advise(now).reason == HOLD and scaler.backends == 48


def test_underload_releases_to_the_busy_gpus_after_the_down_window() -> None:
    scaler = Autoscaler(POLICY, 24, 0.0)
    now = feed(scaler, 0.0, 20.0, busy_gpus=12.0, bad_rate=0.0)
    assert scaler.advise(now).reason == HOLD  # the 30 s down window is not full yet
    now = feed(scaler, now, 30.0, busy_gpus=12.0, bad_rate=0.0)
    advice = scaler.advise(now)
    assert (advice.backends, advice.reason) == (12, RELEASE_IDLE)
    assert advice.idle_fraction == pytest.approx(0.5)


def test_a_live_hosts_jittered_intervals_still_fill_the_down_window() -> None:
    """A frontend's stats rounds take time: 1.07 s intervals never sum to exactly the 30 s
    window inside it, yet the window is measured once 30 s have passed, and releases."""
    scaler = Autoscaler(POLICY, 24, 0.0)
    now = feed(scaler, 0.0, 29.0, busy_gpus=12.0, bad_rate=0.0, tick_s=1.07)
    assert scaler.advise(now).reason == HOLD  # 28.89 s measured
    now = feed(scaler, now, 31.0, busy_gpus=12.0, bad_rate=0.0, tick_s=1.07)
    assert (scaler.advise(now).backends, scaler.last.reason) == (12, RELEASE_IDLE)


def test_the_idle_floor_and_the_release_cap_shape_a_release() -> None:
    policy = AutoscalePolicy(up_window_s=10.0, down_window_s=30.0, idle_floor=0.2,
                             release_margin=0.05, down_hold_s=0.0, max_release_fraction=0.25)
    scaler = Autoscaler(policy, 40, 0.0)
    now = feed(scaler, 0.0, 30.0, busy_gpus=16.0, bad_rate=0.0)
    assert scaler.advise(now).backends == 30  # 40 - 25% (16 / 0.8 = 20 wanted)
    now = feed(scaler, now, now + 35.0, busy_gpus=16.0, bad_rate=0.0)
    assert scaler.advise(now).backends == 23  # 30 - floor(7.5)
    now = feed(scaler, now, now + 35.0, busy_gpus=16.0, bad_rate=0.0)
    assert scaler.advise(now).backends == 20


def test_the_dead_band_holds_between_the_thresholds() -> None:
    scaler = Autoscaler(POLICY, 20, 0.0)
    # 4% idle: above the floor (0), below floor + margin (5%); bad below its threshold
    now = feed(scaler, 0.0, 40.0, busy_gpus=19.2, bad_rate=0.005)
    assert scaler.advise(now).reason == HOLD and scaler.backends == 20


def test_no_release_within_the_hold_after_an_add() -> None:
    scaler = Autoscaler(POLICY, 10, 0.0)
    now = feed(scaler, 0.0, 10.0, busy_gpus=10.0, bad_rate=0.2)
    assert scaler.advise(now).backends == 13  # 10 / 0.8 = 12.5
    added_at = now
    now = feed(scaler, now, added_at + 50.0, busy_gpus=5.0, bad_rate=0.0)
    assert scaler.advise(now).reason == HOLD
    now = feed(scaler, now, added_at + 60.0, busy_gpus=5.0, bad_rate=0.0)
    advice = scaler.advise(now)
    assert (advice.backends, advice.reason) == (5, RELEASE_IDLE)
    assert direction_changes(scaler.changes) == [now]


def test_the_bounds_cap_the_advice() -> None:
    policy = AutoscalePolicy(min_backends=4, max_backends=30, up_window_s=10.0,
                             down_window_s=10.0, idle_floor=0.0, down_hold_s=0.0,
                             max_release_fraction=1.0)
    scaler = Autoscaler(policy, 24, 0.0)
    now = feed(scaler, 0.0, 10.0, busy_gpus=24.0, bad_rate=0.5)
    assert (scaler.advise(now).backends, scaler.last.reason) == (30, BOUND)
    now = feed(scaler, now, now + 20.0, busy_gpus=1.0, bad_rate=0.0)
    assert (scaler.advise(now).backends, scaler.last.reason) == (4, BOUND)
    assert Autoscaler(policy, 100, 0.0).backends == 30


def test_few_requests_decide_no_bad_rate() -> None:
    scaler = Autoscaler(POLICY, 4, 0.0)
    now = feed(scaler, 0.0, 10.0, busy_gpus=4.0, bad_rate=0.5, rate_rps=10.0)  # 100 requests
    assert scaler.advise(now).reason == HOLD


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"min_backends": 0}, "min_backends"), ({"min_backends": 5, "max_backends": 4}, "min_backends"),
    ({"add_bad_rate": 1.0}, "add_bad_rate"), ({"headroom": -0.1}, "headroom"),
    ({"down_window_s": 0.0}, "down_window_s"), ({"settle_s": -1.0}, "settle_s"),
])
def test_contradictory_policies_are_refused_in_one_line(kwargs: dict[str, float],
                                                        named: str) -> None:
    with pytest.raises(AutoscalePolicyError, match=named) as caught:
        AutoscalePolicy(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)


def test_turns_are_counted_in_a_sliding_window() -> None:
    changes = [(0.0, 2), (100.0, 1), (700.0, -3), (900.0, 2), (2000.0, -1)]
    turns = direction_changes(changes)
    assert turns == [700.0, 900.0, 2000.0]
    assert most_turns_within(turns, 600.0) == 2
    assert most_turns_within(turns, 100.0) == 1
    assert most_turns_within([], 600.0) == 0
