"""Sub-cluster partitioning (zserve.orchestrator.partition): the MILP keeps every constraint (the
rank's rate cap, a backend's memory with its largest activations, the disruption budget), the
greedy warm start against the solver's optimum, the imbalance metric, and random search."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from zserve.orchestrator import partition
from zserve.orchestrator.partition import PartitionInputError, PartitionProblem

SOLVE_S = 10.0  # small instances: HiGHS proves optimality in milliseconds; the limit is a guard
REPLAN_SOLVE_S = 0.5  # 24 x 3 with a budget: not proven within seconds; the test checks the limits


def _problem(rates: list[float], static: list[float], groups: int,
             dynamic: list[float] | None = None, *, rate_cap_rps: float = math.inf,
             weight: float = partition.DEFAULT_WEIGHT) -> PartitionProblem:
    return PartitionProblem(np.array(rates, dtype=np.float64), np.array(static, dtype=np.float64),
                            np.array(dynamic or [0.0] * len(rates), dtype=np.float64), groups,
                            rate_cap_rps=rate_cap_rps, weight=weight)


def _assignment(groups: list[int]) -> np.ndarray[tuple[int], np.dtype[np.int64]]:
    return np.array(groups, dtype=np.int64)


def test_imbalance_is_max_minus_min_over_the_average() -> None:
    values = np.array([1.0, 2.0, 3.0, 6.0])
    # sub-cluster totals 3 (models 0, 1) and 9 (models 2, 3): (9 - 3) / 6
    assert partition.imbalance(values, _assignment([0, 0, 1, 1]), 2) == pytest.approx(1.0)
    assert partition.imbalance(values, _assignment([0, 1, 1, 0]), 2) == pytest.approx(2 / 6)


def test_the_objective_is_normalised_so_the_weight_is_unitless() -> None:
    # rates 3 vs 1 around an average of 2 (dR = 0.5); bytes 1 vs 1 (dS = 0)
    problem = _problem([2.0, 1.0, 1.0], [0.5, 0.5, 1.0], 2, weight=7.0)
    assert partition.objective(problem, _assignment([0, 0, 1])) == pytest.approx(0.5)
    scaled = dataclasses.replace(problem, rates_rps=problem.rates_rps * 1e6,
                                 static_bytes=problem.static_bytes * 1e9)
    assert partition.objective(scaled, _assignment([0, 0, 1])) == pytest.approx(0.5)


def test_the_milp_beats_the_greedy_and_proves_its_optimum() -> None:
    # a 9-model, 3-sub-cluster instance where the greedy's moves and swaps stop at 0.188
    problem = _problem([8, 3, 1, 3, 4, 8, 5, 1, 4], [6, 8, 7, 9, 2, 8, 1, 6, 3], 3)
    greedy = partition.objective(problem, partition.greedy_plan(problem))
    result = partition.plan(problem, SOLVE_S)
    assert result.warm_objective == pytest.approx(greedy)
    assert result.solver_status == "Optimal"
    assert result.objective == pytest.approx(result.lower_bound, abs=1e-6)
    assert result.objective < greedy - 0.03
    assert not result.violations


def test_the_plan_keeps_the_rank_rate_cap_the_greedy_breaks() -> None:
    # 24 r/s over two ranks of 12: only {9, 3} | {6, 2, 2, 2} fits, and neither the greedy's
    # order nor its single moves and pairwise swaps reach it
    problem = _problem([2, 6, 2, 2, 9, 3], [1] * 6, 2, rate_cap_rps=12.0, weight=0.0)
    greedy = partition.greedy_plan(problem)
    assert partition.violations(problem, greedy)[0].endswith("above R_max 12")
    result = partition.plan(problem, SOLVE_S)
    totals = partition.group_totals(problem.rates_rps, result.assignment, 2)
    assert sorted(totals) == [12.0, 12.0]
    assert not result.violations


def test_the_plan_keeps_weights_plus_the_largest_activations_within_memory() -> None:
    # model 1's activations (6) do not fit next to model 0's weights (4): 4 + 1 + 6 > 8. The
    # balanced plan without the cap, {0} | {1, 2, 3}, needs 3 + 6 = 9 > 8 as well.
    base = _problem([3, 1, 1, 1], [4, 1, 1, 1], 2, dynamic=[0, 6, 0, 0], weight=10.0)
    free = partition.plan(base, SOLVE_S)
    assert free.assignment[0] != free.assignment[1]
    capped = dataclasses.replace(base, memory_cap_bytes=8.0)
    assert partition.violations(capped, free.assignment)
    result = partition.plan(capped, SOLVE_S)
    assert not result.violations
    for group in range(2):
        members = np.flatnonzero(result.assignment == group)
        need = capped.static_bytes[members].sum() + capped.dynamic_bytes[members].max()
        assert need <= 8.0


def test_a_replan_moves_no_more_bytes_than_the_budget_and_still_improves() -> None:
    rng = np.random.default_rng(3)
    rates, static = rng.exponential(10.0, 24), rng.uniform(1.0, 10.0, 24)
    current = _assignment([i % 3 for i in range(24)])
    moved = _problem(list(rates), list(static), 3)
    before = partition.objective(moved, current)
    for share in (0.0, 0.05, 0.2):
        budget = share * float(static.sum())
        problem = dataclasses.replace(moved, current=current, disruption_budget=budget)
        result = partition.plan(problem, REPLAN_SOLVE_S)
        away = result.assignment != current
        assert 2 * static[away].sum() <= budget + 1e-9  # loading + unloading: 2 c_i a move
        assert partition.disruption(problem, result.assignment) <= budget + 1e-9
        assert not result.violations
        if share == 0.0:
            assert not away.any()
        else:
            assert result.objective < before


def test_improve_spends_free_moves_back_home_first() -> None:
    # model 0 sits away from home; moving it back costs nothing and balances both sub-clusters
    problem = dataclasses.replace(_problem([2, 1, 1], [2, 1, 1], 2),
                                  current=_assignment([0, 1, 1]), disruption_budget=4.0)
    away = _assignment([1, 1, 1])
    assert partition.disruption(problem, away) == pytest.approx(4.0)  # 2 c_0, c_0 = 2 bytes
    improved = partition.improve(problem, away)
    assert list(improved) == [0, 1, 1]


def test_random_search_stops_when_told_and_returns_a_feasible_plan() -> None:
    problem = _problem([5, 5, 4, 3, 3], [1, 1, 1, 1, 1], 2, rate_cap_rps=10.0, weight=0.0)
    rounds = iter(range(4))
    found, found_objective, tried = partition.random_search(
        problem, np.random.default_rng(0), lambda: next(rounds) >= 3)
    assert tried == 3 * partition.RANDOM_BATCH
    assert found is not None and not partition.violations(problem, found)
    assert found_objective == pytest.approx(partition.objective(problem, found))
    nothing = partition.random_search(problem, np.random.default_rng(0), lambda: True)
    assert nothing == (None, math.inf, 0)


@pytest.mark.parametrize(("change", "message"), [
    ({"groups": 0}, "groups must be 1..models"),
    ({"static_bytes": np.ones(2)}, "static_bytes has 2 entries"),
    ({"rates_rps": -np.ones(3)}, "rates and bytes must be >= 0"),
    ({"current": np.array([0, 1, 5])}, "current must give each of the 3 models"),
    ({"disruption_budget": -1.0}, "weight and disruption_budget must be >= 0"),
])
def test_bad_inputs_are_one_line_errors(change: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"rates_rps": np.ones(3), "static_bytes": np.ones(3),
                                 "dynamic_bytes": np.zeros(3), "groups": 2}
    with pytest.raises(PartitionInputError, match=message) as caught:
        PartitionProblem(**{**fields, **change})  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)
