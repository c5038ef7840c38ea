"""How the load generator plans a run from arrival processes, popularity and rate schedules.

The arrival processes themselves belong to zserve.loadgen.arrivals; these tests check the
generator's use of them: per-model rates and shares, dispersion preserved under time rescaling,
step schedules followed, seeds honoured, and the same arrivals as the simulator draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from zserve.loadgen import arrivals, schedules
from zserve.loadgen.load_plan import LoadPlan, build_plan
from zserve.loadgen.workload import ArrivalSpec


def _gaps_cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def _plan(
    arrival: str,
    rate: float = 2000.0,
    duration_s: float = 20.0,
    shares: Sequence[float] = (1.0, 1.0),
) -> LoadPlan:
    return build_plan(
        models=[f"m{i}" for i in range(len(shares))],
        slo_ms=[25.0] * len(shares),
        shares=list(shares),
        schedule=schedules.constant(rate, duration_s),
        arrival=ArrivalSpec.parse(arrival),
        seed=7,
    )


@pytest.mark.parametrize(
    ("arrival", "cv"), [("constant", 0.0), ("poisson", 1.0), ("gamma:0.25", 2.0), ("gamma:4", 0.5)]
)
def test_per_model_rate_and_dispersion(arrival: str, cv: float) -> None:
    plan = _plan(arrival)
    expected = 1000.0 * 20.0
    for m in range(2):
        times = plan.times_s[plan.model_index == m]
        # Mean: within 5 standard deviations of a renewal count (var ~ n * cv^2).
        assert abs(len(times) - expected) <= 5 * np.sqrt(expected) * max(cv, 0.05) + 2
        assert _gaps_cv(times) == pytest.approx(cv, abs=0.06 * max(cv, 1.0))


def test_poisson_counts_have_unit_index_of_dispersion() -> None:
    plan = _plan("poisson", duration_s=20.0)
    counts = np.histogram(plan.times_s, bins=np.arange(0.0, 20.0001, 0.05))[0]
    assert counts.mean() == pytest.approx(100.0, rel=0.02)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.2)


def test_zipf_shares_are_followed() -> None:
    shares = [1.0 / (i + 1) for i in range(4)]  # zipf:1 over 4 models
    plan = _plan("poisson", rate=4000.0, duration_s=10.0, shares=shares)
    counts = np.bincount(plan.model_index, minlength=4)
    expected = np.asarray(shares) / sum(shares) * 40_000
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))


def test_step_schedule_is_followed_and_warmup_excluded() -> None:
    schedule = schedules.steps([(2.0, 500.0), (2.0, 2000.0), (2.0, 0.0), (2.0, 1000.0)])
    plan = build_plan(
        models=["a"], slo_ms=[25.0], shares=[1.0], schedule=schedule,
        arrival=ArrivalSpec.parse("gamma:0.5"), warmup_s=1.0, cooldown_s=1.0, seed=3,
    )
    assert plan.measure_start_s == 1.0 and plan.measure_end_s == 9.0 and plan.duration_s == 10.0
    edges = [0.0, 1.0, 3.0, 5.0, 7.0, 9.0, 10.0]
    counts = np.histogram(plan.times_s, bins=edges)[0]
    expected = np.array([500.0, 1000.0, 4000.0, 0.0, 2000.0, 1000.0])
    # Gamma(0.5) counts have variance ~ 2 * mean.
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(2 * expected) + 1)
    assert plan.offered_rate_rps == pytest.approx(7000.0 / 8.0, rel=0.05)


def test_seeded_plans_repeat_and_differ_by_seed() -> None:
    a = _plan("poisson", duration_s=2.0)
    b = _plan("poisson", duration_s=2.0)
    np.testing.assert_array_equal(a.times_s, b.times_s)
    c = build_plan(
        models=["m0", "m1"], slo_ms=[25.0, 25.0], shares=[1.0, 1.0],
        schedule=schedules.constant(2000.0, 2.0), arrival=ArrivalSpec.parse("poisson"), seed=8,
    )
    assert len(c) != len(a) or not np.array_equal(c.times_s, a.times_s)


@pytest.mark.parametrize("arrival", ["constant", "poisson", "gamma:0.5"])
def test_constant_schedule_matches_the_simulators_draws(arrival: str) -> None:
    """At a constant rate, the live plan is the arrivals module's draw at the model's rate."""
    spec = ArrivalSpec.parse(arrival)
    plan = _plan(arrival, rate=1000.0, duration_s=3.0, shares=(3.0, 1.0))
    for m, rate in enumerate((750.0, 250.0)):
        direct = arrivals.arrival_times(spec.kind, spec.shape, rate, 3.0, arrivals.model_rng(7, m))
        mine = plan.times_s[plan.model_index == m]
        assert len(mine) == len(direct)
        np.testing.assert_allclose(mine, direct, rtol=0, atol=1e-9)


def test_each_model_may_have_its_own_arrival_process() -> None:
    plan = build_plan(
        models=["steady", "bursty"], slo_ms=[25.0, 25.0], shares=[1.0, 1.0],
        schedule=schedules.constant(2000.0, 10.0),
        arrival=[ArrivalSpec.parse("constant"), ArrivalSpec.parse("gamma:0.25")], seed=1,
    )
    assert _gaps_cv(plan.times_s[plan.model_index == 0]) < 0.01
    assert _gaps_cv(plan.times_s[plan.model_index == 1]) == pytest.approx(2.0, rel=0.1)
