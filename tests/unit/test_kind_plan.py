"""The kind planner (zserve.orchestrator.kind_plan): each model's device kind, priced at whole
GPUs per kind's pool, chosen by a greedy search that never ends dearer than one kind alone."""

from __future__ import annotations

import math

import pytest

from zserve.orchestrator.kind_plan import (
    improve,
    per_model_choice,
    plan_kinds,
    price_plan,
    single_kind_plans,
)

INF = math.inf
PRICES = {"big": 7.0, "small": 1.0}  # $/h per GPU: the big kind is 7x dearer

# model -> kind -> its load in GPUs there. "slow" costs 0.3 x 7 = $2.1/h of a big GPU against
# $2.5/h of small ones, so on its own it picks the big kind; the rest are cheaper on small GPUs.
ONE_DEAR_POOL = {
    "slow": {"big": 0.3, "small": 2.5},
    "a": {"big": 1.0, "small": 1.0},
    "b": {"big": 1.0, "small": 1.0},
    "c": {"big": 1.0, "small": 1.0},
}


def test_the_per_model_choice_opens_a_pool_that_costs_more_than_one_kind() -> None:
    own = per_model_choice(ONE_DEAR_POOL, PRICES)
    assert own == {"slow": "big", "a": "small", "b": "small", "c": "small"}
    mixed = price_plan(own, ONE_DEAR_POOL, PRICES)
    # one whole big GPU ($7) for 0.3 of load, 3 small ones ($3): $10 against 6 small GPUs ($6)
    assert dict(mixed.pool_gpus) == {"big": 1, "small": 3}
    assert mixed.cost_per_hour == pytest.approx(10.0)
    assert mixed.load_cost_per_hour == pytest.approx(5.1)
    singles = {next(iter(p.pool_gpus)): p.cost_per_hour
               for p in single_kind_plans(ONE_DEAR_POOL, PRICES)}
    assert singles == {"big": pytest.approx(28.0), "small": pytest.approx(6.0)}


def test_the_planner_never_picks_a_mix_dearer_than_one_kind() -> None:
    plans = plan_kinds(ONE_DEAR_POOL, PRICES)
    best = plans[0]
    assert set(best.kind_of.values()) == {"small"}
    assert dict(best.pool_gpus) == {"small": 6}
    assert best.cost_per_hour == pytest.approx(6.0)
    # the search from the per-model choice moves "slow" back: the big pool empties
    own = price_plan(per_model_choice(ONE_DEAR_POOL, PRICES), ONE_DEAR_POOL, PRICES)
    assert improve(own, ONE_DEAR_POOL, PRICES).kind_of == best.kind_of
    assert [p.cost_per_hour for p in plans] == sorted(p.cost_per_hour for p in plans)
    assert {p.cost_per_hour for p in plans} == {6.0, 28.0}  # the all-big floor is listed too


def test_the_search_fills_a_paid_gpu_and_beats_every_single_kind() -> None:
    prices = {"big": 4.0, "small": 1.0}
    loads = {"slow": {"big": 0.5, "small": 3.0},   # on its own: big ($2 against $3)
             "mid": {"big": 0.5, "small": 1.5},    # on its own: small ($1.5 against $2)
             "light": {"big": 1.0, "small": 1.0}}  # small
    own = price_plan(per_model_choice(loads, prices), loads, prices)
    assert own.cost_per_hour == pytest.approx(4.0 + 3.0)  # 1 big GPU half idle, 3 small
    best = plan_kinds(loads, prices)[0]
    # "mid" fills the big GPU already paid for, and the small pool drops to one GPU
    assert dict(best.kind_of) == {"slow": "big", "mid": "big", "light": "small"}
    assert dict(best.pool_gpus) == {"big": 1, "small": 1}
    assert best.cost_per_hour == pytest.approx(5.0)
    assert best.is_mixed()
    assert best.pools() == {"big": ["slow", "mid"], "small": ["light"]}
    assert min(p.cost_per_hour for p in single_kind_plans(loads, prices)) == pytest.approx(6.0)


def test_a_kind_that_misses_a_models_slo_never_gets_it() -> None:
    loads = {"tight": {"big": 0.4, "small": INF}, "easy": {"big": 0.2, "small": 0.9}}
    assert [next(iter(p.pool_gpus)) for p in single_kind_plans(loads, PRICES)] == ["big"]
    assert math.isinf(price_plan({"tight": "small", "easy": "small"}, loads,
                                 PRICES).cost_per_hour)
    plans = plan_kinds(loads, PRICES)
    assert all(p.kind_of["tight"] == "big" for p in plans)
    # one big GPU holds both (0.6 of load): no small pool is worth opening for "easy"
    assert dict(plans[0].kind_of) == {"tight": "big", "easy": "big"}
    assert plans[0].cost_per_hour == pytest.approx(7.0)


def test_a_model_no_kind_serves_is_refused_with_one_line() -> None:
    with pytest.raises(ValueError, match="model 'x' meets its SLO on no device kind"):
        plan_kinds({"x": {"big": INF, "small": INF}}, PRICES)


def test_a_pool_a_hair_over_a_whole_gpu_count_is_not_rounded_up() -> None:
    loads = {"m": {"big": 1.0 + 1e-12, "small": INF}}
    assert dict(price_plan({"m": "big"}, loads, PRICES).pool_gpus) == {"big": 1}
