"""zserve.apps on hand-checked cases: the DAG model, the worst-case latency estimators, the
module planners (the Harpagon paper's Table I/II values), the splitters, the planners, the
brute-force optima (the plan family's, and the best split for Harpagon's own module scheduler)
and the TC dispatcher."""

from __future__ import annotations

import itertools

import pytest

from zserve.apps.configs import Config, Group, ModulePlan, by_ratio, group_wcl_s, plan_wcl_s
from zserve.apps.dag import App, AppError, Edge, Stage, chain, critical_path_s, stage_rates
from zserve.apps.harpagon import (
    BASELINES,
    HARPAGON,
    brute_force,
    module_frontier,
    plan_app,
    scheduler_frontier,
    split_optimum,
)
from zserve.apps.module_plan import (
    exact_module,
    generate_config,
    harpagon_module,
    one_tuple,
    two_tuple,
)
from zserve.apps.split import dp_split, even_split, greedy_split, latency_cost_efficiency
from zserve.apps.tc_dispatch import simulate_group, simulate_stage, simulate_stage_poisson

M1 = by_ratio([Config("x", 2, 0.160, 1.0), Config("x", 4, 0.200, 1.0),
               Config("x", 8, 0.320, 1.0)])
M3 = by_ratio([Config("x", 2, 0.100, 1.0), Config("x", 8, 0.250, 1.0),
               Config("x", 32, 0.800, 1.0)])
M4 = (Group(Config("A", 6, 2.0, 1.0), 2), Group(Config("C", 2, 1.0, 1.0), 1))


def _fork() -> App:
    """det -> {cls (x2), ocr}: a fan-out with two siblings."""
    return App("fork", (Stage("det", "d"), Stage("cls", "c"), Stage("ocr", "o")),
               (Edge("det", "cls", 2.0), Edge("det", "ocr")), 0.25)


def _linear(kind: str, alpha_s: float, beta_s: float, price: float) -> list[Config]:
    return [Config(kind, b, alpha_s * b + beta_s, price) for b in (1, 2, 4, 8, 16, 32)]


def test_stage_rates_multiply_fanouts_and_the_critical_path_takes_the_longest_branch() -> None:
    app = _fork()
    assert stage_rates(app, 100.0) == {"det": 100.0, "cls": 200.0, "ocr": 100.0}
    assert critical_path_s(app, {"det": 0.1, "cls": 0.05, "ocr": 0.08}) == pytest.approx(0.18)


@pytest.mark.parametrize(("edges", "message"), [
    ((Edge("a", "b"), Edge("b", "a")), "cycle"),
    ((Edge("a", "zz"),), "unknown stage"),
    ((Edge("a", "b", 0.0),), "fan-out"),
])
def test_a_bad_app_is_a_typed_one_line_error(edges: tuple[Edge, ...], message: str) -> None:
    with pytest.raises(AppError, match=message):
        App("bad", (Stage("a", "m"), Stage("b", "m")), edges, 1.0)


def test_worst_case_latency_estimators_on_the_papers_m1_and_m4() -> None:
    by_batch = {c.batch: c for c in M1}
    assert [round(by_batch[b].single_wcl_s(100), 9) for b in (2, 4, 8)] == [0.18, 0.24, 0.40]
    assert plan_wcl_s(M4, "tc") == pytest.approx(2.75)
    assert plan_wcl_s(M4, "dt") == pytest.approx(3.0)
    assert plan_wcl_s(M4, "rr") == pytest.approx(4.0)
    for dispatch in ("dt", "rr"):  # TC collects fastest
        assert plan_wcl_s(M4, "tc") <= plan_wcl_s(M4, dispatch)


@pytest.mark.parametrize(("batch", "duration_s", "machines"), [(8, 0.32, 4), (32, 0.8, 5),
                                                                (3, 0.05, 1)])
def test_tc_on_identical_machines_is_symphonys_staggered_bound(
        batch: int, duration_s: float, machines: int) -> None:
    group = Group(Config("x", batch, duration_s, 1.0), machines)
    assert plan_wcl_s((group,), "tc") == pytest.approx((1 + 1 / machines) * duration_s)


def test_generate_config_reproduces_table_two_and_section_two() -> None:
    s3 = generate_config(198, 1.0, M3)
    assert s3 is not None and s3.cost == pytest.approx(5.3)
    assert [(g.config.batch, g.count, round(g.load, 9)) for g in s3.groups] == [
        (32, 4, 1.0), (8, 1, 1.0), (2, 1, 0.3)]
    m1 = generate_config(110, 0.4, M1)
    assert m1 is not None and m1.cost == pytest.approx(4.8)
    assert generate_config(198, 0.05, M3) is None


def test_dummy_requests_and_the_two_and_one_tuple_baselines() -> None:
    s4 = harpagon_module(198, 1.0, M3)
    assert s4 is not None and s4.cost == pytest.approx(5.0) and s4.dummy_rps == pytest.approx(2)
    naive = generate_config(208, 1.0, M3)  # +10 r/s of dummies only adds load
    assert naive is not None and naive.cost == pytest.approx(5.4)
    s1, s2 = two_tuple(198, 1.0, M3, "rr"), two_tuple(198, 1.0, M3, "tc")
    assert s1 is not None and s1.cost == pytest.approx(6.3)
    assert s2 is not None and s2.cost == pytest.approx(5.9)
    rr = one_tuple(100, 0.4, M1, "rr")
    assert rr is not None and rr.cost == pytest.approx(5.0) and rr.groups[0].config.batch == 4


def test_the_exact_module_search_is_never_dearer_than_algorithm_one() -> None:
    for rate in (37.0, 110.0, 198.0, 251.0):
        for budget in (0.3, 0.45, 1.0):
            greedy = generate_config(rate, budget, M3)
            exact = exact_module(rate, budget, M3)
            if greedy is not None:
                assert exact is not None and exact.cost <= greedy.cost + 1e-9
                assert plan_wcl_s(exact.groups, "tc") <= budget + 1e-9


def test_latency_cost_efficiency_of_the_papers_example() -> None:
    by_batch = {c.batch: c for c in M1}
    assert latency_cost_efficiency(by_batch[2], by_batch[4], 100) == pytest.approx(50.0)
    assert latency_cost_efficiency(by_batch[2], by_batch[8], 100) == pytest.approx(4 / 0.22)


def test_the_dp_split_finds_the_grid_optimum_of_a_chain() -> None:
    # cost 1/a + 2/b with a + b <= 1: the optimum a = 1/(1 + sqrt 2) = 0.414, on a 0.1 grid 0.4
    app = chain("xy", ["x", "y"], 1.0)
    split = dp_split(app, lambda s, b: (1.0 if s == "x" else 2.0) / b, 10)
    assert split is not None
    assert split.budgets_s == pytest.approx({"x": 0.4, "y": 0.6})
    diamond = App("d", tuple(Stage(n, n) for n in "abcd"),
                  (Edge("a", "b"), Edge("a", "c"), Edge("b", "d"), Edge("c", "d")), 1.0)
    with pytest.raises(AppError, match="tree"):
        dp_split(diamond, lambda s, b: 1.0, 10)


def test_even_split_divides_the_slo_over_the_longest_chain() -> None:
    assert even_split(_fork()).budgets_s == {"det": 0.125, "cls": 0.125, "ocr": 0.125}


def _fork_configs() -> dict[str, list[Config]]:
    fast, cheap = ("fast", 8.0), ("cheap", 1.0)
    return {
        "det": by_ratio(_linear(fast[0], 0.002, 0.010, fast[1])
                        + _linear(cheap[0], 0.008, 0.020, cheap[1])),
        "cls": by_ratio(_linear(fast[0], 0.001, 0.005, fast[1])
                        + _linear(cheap[0], 0.004, 0.010, cheap[1])),
        "ocr": by_ratio(_linear(fast[0], 0.0015, 0.008, fast[1])
                        + _linear(cheap[0], 0.006, 0.015, cheap[1])),
    }


def test_greedy_split_meets_the_slo_and_every_move_lowers_cost() -> None:
    app, configs = _fork(), _fork_configs()
    rates = stage_rates(app, 300.0)
    split = greedy_split(app, rates, configs)
    assert split is not None and split.configs is not None and split.iterations > 0
    assert critical_path_s(app, split.budgets_s) <= app.slo_s + 1e-9
    start_cost = sum(min(cs, key=lambda c: (-c.price, c.batch)).cost(rates[s])
                     for s, cs in configs.items())
    assert sum(c.cost(rates[s]) for s, c in split.configs.items()) < start_cost


def test_harpagon_is_no_dearer_than_the_baselines_and_not_below_the_optimum() -> None:
    app, configs = _fork(), _fork_configs()
    rates = stage_rates(app, 60.0)
    ours = plan_app(app, rates, configs, HARPAGON)
    assert ours is not None and ours.e2e_wcl_s <= app.slo_s + 1e-9
    for spec in BASELINES:
        theirs = plan_app(app, rates, configs, spec)
        assert theirs is not None and theirs.cost >= ours.cost - 1e-9, spec.name
    best = brute_force(app, rates, configs)
    assert best is not None and best.e2e_wcl_s <= app.slo_s + 1e-9
    assert best.cost <= ours.cost + 1e-9
    # the paper's optimum (the best split for Algorithm 1 and dummies) lies between
    split = split_optimum(app, rates, configs)
    assert split is not None and split.e2e_wcl_s <= app.slo_s + 1e-9
    assert best.cost - 1e-9 <= split.cost <= ours.cost + 1e-9


def test_the_split_optimum_beats_a_greedy_split_that_misjudges_a_partial_machine() -> None:
    """Two stages in a chain at 150 r/s, SLO 40 ms. Algorithm 2 judges each switch by one
    configuration's fractional cost; the sweep over each stage's actual plans finds a split at
    least as cheap, and every split it returns fits the SLO."""
    configs = {s: by_ratio(_linear("fast", 0.0009, 0.0085, 7.0)
                           + _linear("cheap", 0.004, 0.012, 1.0)) for s in ("a", "b")}
    app = chain("two", ["a", "b"], 0.040)
    rates = {"a": 150.0, "b": 150.0}
    ours, best = plan_app(app, rates, configs), split_optimum(app, rates, configs)
    assert ours is not None and best is not None
    assert best.cost <= ours.cost + 1e-9 and best.e2e_wcl_s <= app.slo_s + 1e-9


def test_the_scheduler_frontier_bounds_algorithm_one_at_every_budget() -> None:
    points = scheduler_frontier(198, 1.0, M3)
    assert points[-1][1].cost == pytest.approx(5.0)  # S4 at the loosest budget
    assert all(a[0] < b[0] and a[1].cost > b[1].cost for a, b in itertools.pairwise(points))
    # whatever Algorithm 1 and dummies give at any budget, a point as fast is as cheap
    for budget in (0.05 + 0.005 * i for i in range(191)):
        plan = harpagon_module(198, budget, M3)
        if plan is not None:
            wcl = plan_wcl_s(plan.groups, "tc")
            assert plan.cost >= min(p.cost for w, p in points if w <= wcl + 1e-9) - 1e-9


def test_the_planner_picks_the_cheaper_kind_when_the_slo_allows_and_the_faster_when_not() -> None:
    configs = {"m": by_ratio(_linear("fast", 0.001, 0.005, 8.0)
                             + _linear("cheap", 0.004, 0.010, 1.0))}
    loose = plan_app(chain("one", ["m"], 0.5), {"m": 500.0}, configs)
    tight = plan_app(chain("one", ["m"], 0.012), {"m": 500.0}, configs)
    assert loose is not None and set(loose.machines_by_kind()) == {"cheap"}
    assert tight is not None and set(tight.machines_by_kind()) == {"fast"}


def test_module_frontier_is_a_falling_staircase() -> None:
    points = module_frontier(198, 1.0, M3)
    assert points[-1][1].cost == pytest.approx(5.0)  # S4 at the loosest budget
    assert all(a[0] < b[0] and a[1].cost > b[1].cost for a, b in itertools.pairwise(points))


def test_the_tc_dispatcher_stays_within_theorem_one_on_the_papers_plans() -> None:
    m1 = ModulePlan((Group(by_ratio(M1)[0], 4),))
    assert simulate_stage(m1, 100.0) == pytest.approx(0.39)
    assert simulate_stage(ModulePlan(M4), 8.0) <= 2.75
    s4 = harpagon_module(198, 1.0, M3)
    assert s4 is not None and simulate_stage(s4, 198.0) <= 0.96 + 1e-9


def test_a_full_machine_is_not_held_up_by_a_lower_groups_run() -> None:
    """One full b8 machine (Theorem 1: 21.8 + 8/618.7 = 34.7 ms, the module's worst case) and
    a partly loaded b4 one. A dispatcher that lets the b4 run finish before the due b8 batch
    starts it up to 3 arrivals late, and a full machine never catches up (39.2 ms); the due
    group takes the stream over instead."""
    full, partial = Config("k", 8, 0.0218, 1.0), Config("k", 4, 0.0136, 1.0)
    plan = ModulePlan((Group(full, 1), Group(partial, 1, 0.853)))
    rate = plan.rate_rps
    bound = plan_wcl_s(plan.groups, "tc")
    assert bound == pytest.approx(0.0218 + 8 / rate)
    assert simulate_stage(plan, rate) <= bound * 1.01 + 1 / rate


# pose-89's `activity` stage of the experiment's suite: three full GTX 1080 Ti machines at b32
# and a partly loaded b16 (docs/performance.md, "Harpagon")
POSE_89 = ModulePlan((Group(Config("gtx", 32, 0.034678, 0.526), 3),
                      Group(Config("gtx", 16, 0.018534, 0.526), 1, 0.738421866541769)))


def test_each_group_fed_theorem_ones_stream_meets_its_bound() -> None:
    """Theorem 1 takes a group's w as its batch collection rate: fed an evenly spaced stream at
    its w (shared with the groups after it), every group stays within d + b / w."""
    for plan in (POSE_89, ModulePlan(M4), harpagon_module(198, 1.0, M3)):
        assert plan is not None
        for i in range(len(plan.groups)):
            w = sum(g.rate_rps for g in plan.groups[i:])
            assert simulate_group(plan, i) <= group_wcl_s(plan.groups, i, "tc") + 1 / w, (plan, i)


def test_one_stream_reaches_a_later_group_in_lumps() -> None:
    """One evenly spaced stream through the whole plan: the b16 batch collects between the b32
    runs, which leave 7.4 arrivals at a time, and sometimes spans three of them, beyond the
    theorem's steady stream at w (the measure the experiment reports beside the check)."""
    rate = POSE_89.rate_rps
    bound = plan_wcl_s(POSE_89.groups, "tc")
    assert simulate_stage(POSE_89, rate) > bound * 1.1
    assert max(simulate_group(POSE_89, i) for i in range(2)) <= bound + 1 / rate


def test_held_to_the_modules_bound_a_first_group_lends_its_slack_and_misses_its_own() -> None:
    """actdet-81's `act` stage: a full b8 machine and a partly loaded one of the same kind. Held
    to its own bound (Theorem 1's statement is per machine), the first group meets it; held to
    the module's (the serving target), it lets the later group interrupt its runs and misses."""
    config = Config("gtx", 8, 0.021778, 0.526)
    plan = ModulePlan((Group(config, 1), Group(config, 1, 0.9210012437496259)))
    bound = group_wcl_s(plan.groups, 0, "tc")
    assert simulate_group(plan, 0) <= bound + 1 / plan.rate_rps
    assert simulate_group(plan, 0, target="module") > bound * 1.5


def test_the_theorem_check_fails_a_group_without_the_machines_for_its_rate() -> None:
    """A group loaded past its machines (load 1.5 of one b8 machine) queues behind itself:
    the check sees it (it is not a check that cannot fail)."""
    plan = ModulePlan((Group(by_ratio(M1)[0], 1, 1.5),))
    assert simulate_group(plan, 0) > plan_wcl_s(plan.groups, "tc") * 1.5


def test_poisson_arrivals_are_seeded_and_exceed_the_bound_on_a_full_machine() -> None:
    plan = ModulePlan((Group(by_ratio(M1)[0], 4),))
    first = simulate_stage_poisson(plan, 100.0, seed=1)
    assert first == simulate_stage_poisson(plan, 100.0, seed=1)
    assert first != simulate_stage_poisson(plan, 100.0, seed=2)
    assert max(first) > plan_wcl_s(plan.groups, "tc")
