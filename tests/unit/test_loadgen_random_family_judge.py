"""The random family's judge reads a policy's goodput on its bad-rate curve made monotone, so
that a single probe's noise near 1% does not decide a member (``curve_goodput``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from zserve.loadgen.experiments import random_family
from zserve.loadgen.experiments.random_family import curve_goodput, monotone_bad_rates
from zserve.loadgen.experiments.simulated import sim_probe

# r10 (3 GTX 1080 Ti models on 2 GPUs, Gamma(0.6)): the worst model's bad rate (%) at the common
# rates, as measured for the default and eager. Their curves are within 0.07 point everywhere.
R10_RATES = (102.4, 107.9, 113.4, 118.9, 124.3, 129.8, 135.3, 140.8)
R10_DEFERRED = (1.14, 1.05, 1.29, 1.47, 1.80, 1.66, 1.89, 2.12)
R10_EAGER = (1.14, 0.99, 1.29, 1.39, 1.80, 1.73, 1.89, 2.19)
SEARCHED_RPS = 128.0


def _curve(rates: tuple[float, ...], bad_percent: tuple[float, ...]) -> list[dict[str, Any]]:
    return [{"rate_rps": r, "bad_rate": b / 100, "bailed": False, "passes": b <= 1.0}
            for r, b in zip(rates, bad_percent, strict=True)]


def _read(bad_percent: tuple[float, ...]) -> tuple[float, str]:
    # no probe was stopped early, so the judge probes nothing more on r10's workload
    r10 = random_family.draw_member(random_family.FAMILY_SEED, 10)
    assert r10.describe().startswith("GTX1080Ti 3m/2g")
    workload = r10.workload("eager", random_family.QUICK_CURVE_WINDOWS_S)
    rps, how, _ = curve_goodput(_curve(R10_RATES, bad_percent), workload, SEARCHED_RPS)
    return rps, how


def test_one_passing_probe_above_a_failing_one_does_not_decide_the_member() -> None:
    # eager's 0.99% at 107.9 r/s sits above its 1.14% at 102.4: pooled, 1.06%, failing
    assert _read(R10_EAGER) == _read(R10_DEFERRED) == (102.4, "below the common rates")


def test_a_monotone_curve_reads_as_the_plain_interpolation() -> None:
    bad = (0.2, 0.5, 0.8, 1.4, 2.0, 2.5, 3.0, 4.0)
    assert monotone_bad_rates(_curve(R10_RATES, bad)) == pytest.approx([b / 100 for b in bad])
    rps, how = _read(bad)
    assert how == "interpolated"
    assert rps == pytest.approx(113.4 + (1.0 - 0.8) / (1.4 - 0.8) * (118.9 - 113.4), abs=0.05)


def test_a_dip_is_pooled_with_the_probes_before_it_weighted_by_rate() -> None:
    fitted = monotone_bad_rates(_curve((100.0, 200.0, 300.0), (1.2, 0.6, 2.0)))
    assert fitted == pytest.approx([0.008, 0.008, 0.02])  # (1.2 x 100 + 0.6 x 200) / 300


def test_a_members_common_rates_are_stored_with_it_not_searched() -> None:
    """Every code version probes a member at the same rates: r24's are those of the run its
    reference rate was read from (454.0 to 624.2 r/s), whatever the searches would read now;
    a member of another family has none stored and is searched."""
    r24 = random_family.draw_member(random_family.FAMILY_SEED, 24)
    assert r24.reference_rps == 567.461
    rates = random_family.common_rates(r24.reference_rps, random_family.CURVE_RATES)
    assert rates[0] == 454.0 and rates[-1] == 624.2 and len(rates) == 8
    quick = random_family.random_family(random_family.FAMILY_SEED,
                                        random_family.FAMILY_QUICK_MEMBERS,
                                        max_models=random_family.QUICK_MAX_MODELS)
    assert all(m.reference_rps is not None for m in quick)
    assert random_family.draw_member(random_family.FAMILY_SEED + 1, 0).reference_rps is None


def test_a_near_bar_member_is_judged_on_its_probes_pooled_over_arrival_seeds() -> None:
    """Near the bar a member is judged on several arrival seeds: each rate's point is the mean
    of the probes of every seed (each in full), measured here again one by one, and the
    verdict is read on those means; the member's own seed comes first."""
    member = random_family.random_family(random_family.FAMILY_SEED,
                                         random_family.FAMILY_QUICK_MEMBERS,
                                         max_models=random_family.QUICK_MAX_MODELS)[3]
    budget = random_family.Budget(random_family.QUICK_SEARCH_WINDOWS_S,
                                  random_family.QUICK_CURVE_WINDOWS_S, 3, 100, 2)
    one = random_family._judged(member, budget)
    pooled = random_family._pooled(member, budget, one)
    assert pooled["seeds"] == [member.seed, member.seed + random_family.NEAR_BAR_SEED_STEP]
    assert pooled["one_seed_ratio"] == one["ratio"]
    point = pooled["curves"]["deferred"][0]
    rate = point["rate_rps"]
    windows_s = budget.curve_windows(
        member.workload("deferred", random_family.CURVE_WINDOWS_S), rate)
    bad = [random_family._point(sim_probe(
        replace(member, seed=seed).workload("deferred", windows_s), rate,
        bail=False), rate)["bad_rate"] for seed in pooled["seeds"]]
    assert point["bad_rate"] == pytest.approx(sum(bad) / 2)
    assert point["seeds"] == 2 and not point["bailed"]
    assert pooled["passes"] == (pooled["goodput"]["deferred"] >= (
        1 - random_family.FAMILY_MARGIN) * max(pooled["goodput"]["frontrun"],
                                               pooled["goodput"]["eager"]))
