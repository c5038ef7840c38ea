"""Planners: for an app, its stages' rates and each stage's configurations (device kinds with
prices), how many machines of which kind at which batch sizes serve it within its SLO, and the
cost. Harpagon and four baselines as the Harpagon paper models them (its Table III), and two
brute-force optima: the best latency split for Harpagon's own module scheduler (the paper's
"optimal"), and the optimum of Harpagon's whole plan family for small apps.

=========  ========  =======  =======================  ==============================
planner    dispatch  configs  split                    residual
=========  ========  =======  =======================  ==============================
harpagon   tc        any      latency-cost greedy      dummy requests, reassigned slack
nexus      rr        2        quantised DP (tree)      none
scrooge    dt        2        throughput greedy        none
inferline  rr        1        throughput greedy        none
clipper    rr        1        even                     none
=========  ========  =======  =======================  ==============================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from zserve.apps.configs import EPSILON, Config, Dispatch, ModulePlan, plan_wcl_s
from zserve.apps.dag import App, critical_path_s, is_tree, longest_path_through_s
from zserve.apps.module_plan import (
    SearchTooLarge,
    exact_frontier,
    harpagon_module,
    one_tuple,
    two_tuple,
)
from zserve.apps.split import Split, dp_split, even_split, greedy_split

SplitName = Literal["lc", "throughput", "even", "dp"]
REASSIGN_ROUNDS_MAX = 20  # the latency reassigner stops after this many accepted re-plans
ModulePlanner = Callable[[float, float, Sequence[Config]], ModulePlan | None]


@dataclass(frozen=True)
class PlannerSpec:
    """What a planner does (module docstring's table); ``tuples`` 0 means any number."""

    name: str
    dispatch: Dispatch
    tuples: int
    split: SplitName
    dummies: bool = False
    reassign: bool = False
    merge_nodes: bool = False
    cost_direct: bool = False
    dp_segments: int = 50  # Nexus: budgets are multiples of SLO / this


HARPAGON = PlannerSpec("harpagon", "tc", 0, "lc", dummies=True, reassign=True,
                       merge_nodes=True, cost_direct=True)
NEXUS = PlannerSpec("nexus", "rr", 2, "dp")
SCROOGE = PlannerSpec("scrooge", "dt", 2, "throughput")
INFERLINE = PlannerSpec("inferline", "rr", 1, "throughput")
CLIPPER = PlannerSpec("clipper", "rr", 1, "even")
BASELINES = (NEXUS, SCROOGE, INFERLINE, CLIPPER)


@dataclass(frozen=True)
class AppPlan:
    """A planner's answer: each stage's plan, its budget and worst-case latency (under the
    planner's dispatch), the end-to-end worst case, and the splitter's rounds."""

    planner: str
    modules: dict[str, ModulePlan]
    budgets_s: dict[str, float]
    wcl_s: dict[str, float]
    e2e_wcl_s: float
    split_iterations: int = 0
    notes: dict[str, float] = field(default_factory=dict)

    @property
    def cost(self) -> float:
        return sum(m.cost for m in self.modules.values())

    def machines_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self.modules.values():
            for kind, n in m.machines_by_kind().items():
                out[kind] = out.get(kind, 0.0) + n
        return out


def module_planner(spec: PlannerSpec) -> ModulePlanner:
    """The per-module plan a spec uses at a budget."""
    if spec.tuples == 1:
        return lambda r, budget, cs: one_tuple(r, budget, cs, spec.dispatch)
    if spec.tuples == 2:
        return lambda r, budget, cs: two_tuple(r, budget, cs, spec.dispatch)
    return lambda r, budget, cs: harpagon_module(r, budget, cs, spec.dispatch, spec.dummies)


def split_for(spec: PlannerSpec, app: App, rates: Mapping[str, float],
              configs: Mapping[str, Sequence[Config]]) -> Split | None:
    """The spec's splitter on this workload."""
    if spec.split == "even":
        return even_split(app)
    if spec.split == "dp":
        plan = module_planner(spec)

        def stage_cost(stage: str, budget_s: float) -> float:
            found = plan(rates[stage], budget_s, configs[stage])
            return math.inf if found is None else found.cost

        return dp_split(app, stage_cost, spec.dp_segments)
    return greedy_split(app, rates, configs, score="lc" if spec.split == "lc" else "throughput",
                        dispatch=spec.dispatch, merge_nodes=spec.merge_nodes,
                        cost_direct=spec.cost_direct)


def plan_app(app: App, rates: Mapping[str, float], configs: Mapping[str, Sequence[Config]],
             spec: PlannerSpec = HARPAGON) -> AppPlan | None:
    """Split the SLO, plan each stage at its budget (a stage with no plan there gets its
    path's unused SLO once more), then (``reassign``) hand each stage the slack its longest
    path leaves and re-plan it while that lowers the cost. None when the
    spec finds no plan within the SLO. ``configs`` per stage in ratio order."""
    split = split_for(spec, app, rates, configs)
    if split is None:
        return None
    plan = module_planner(spec)
    modules: dict[str, ModulePlan] = {}
    budgets = dict(split.budgets_s)
    for stage in app.names:
        found = plan(rates[stage], budgets[stage], configs[stage])
        if found is None:
            # the split's estimate was optimistic (its one-configuration latency hides the
            # partly loaded machine): give the stage its path's unused SLO and try again
            budgets[stage] += app.slo_s - longest_path_through_s(app, budgets)[stage]
            found = plan(rates[stage], budgets[stage], configs[stage])
        if found is None:
            return None
        modules[stage] = found
    reassigned = _reassign(app, rates, configs, modules, spec) if spec.reassign else 0
    wcl = {s: plan_wcl_s(m.groups, spec.dispatch) for s, m in modules.items()}
    return AppPlan(spec.name, modules, budgets, wcl, critical_path_s(app, wcl),
                   split.iterations, {"reassigned": reassigned})


def _reassign(app: App, rates: Mapping[str, float], configs: Mapping[str, Sequence[Config]],
              modules: dict[str, ModulePlan], spec: PlannerSpec) -> int:
    """Harpagon's latency reassigner: re-plan the stage whose slack (SLO minus its longest
    path) buys the largest saving, until none does. Returns the re-plans accepted."""
    plan = module_planner(spec)
    for rounds in range(REASSIGN_ROUNDS_MAX):
        wcl = {s: plan_wcl_s(m.groups, spec.dispatch) for s, m in modules.items()}
        through = longest_path_through_s(app, wcl)
        best: tuple[float, str, ModulePlan] | None = None
        for stage, module in modules.items():
            gap = app.slo_s - through[stage]
            if gap <= EPSILON:
                continue
            trial = plan(rates[stage], wcl[stage] + gap, configs[stage])
            if trial is not None and trial.cost < module.cost - EPSILON and (
                    best is None or module.cost - trial.cost > best[0]):
                best = (module.cost - trial.cost, stage, trial)
        if best is None:
            return rounds
        modules[best[1]] = best[2]
    return REASSIGN_ROUNDS_MAX


def ablation(name: str, **changes: object) -> PlannerSpec:
    """Harpagon with some parts changed (``ablation("harp-2c", tuples=2)``)."""
    return replace(HARPAGON, name=name, **changes)  # type: ignore[arg-type]


# --- the brute-force optimum -----------------------------------------------------------------

def module_frontier(rate_rps: float, max_budget_s: float,
                    configs: Sequence[Config]) -> list[tuple[float, ModulePlan]]:
    """Every (worst-case latency, cheapest plan) step of a module's cost-vs-budget curve over
    Harpagon's plan family (TC, any tuples; dummies: a topped-up last machine, or the rate
    topped up to whole machines of one configuration), up to ``max_budget_s``."""
    extras = {0.0} | {round(math.ceil(rate_rps / c.throughput_rps - EPSILON) * c.throughput_rps
                            - rate_rps, 9) for c in configs}
    plans = [ModulePlan(p.groups, p.dummy_rps + extra) for extra in sorted(extras)
             for p in exact_frontier(rate_rps + extra, max_budget_s, configs)]
    return _pareto_points(plans)


def brute_force(app: App, rates: Mapping[str, float],
                configs: Mapping[str, Sequence[Config]]) -> AppPlan | None:
    """The cheapest combination of the stages' frontier points whose critical path meets the
    SLO: exact over the family (a recursion over remaining budget on a tree, every combination
    otherwise). None when none does; :class:`SearchTooLarge` when a stage's search is too
    large (a large case)."""
    frontiers = {s: module_frontier(rates[s], app.slo_s, configs[s]) for s in app.names}
    return _optimum_plan(app, frontiers, "optimum")


Frontiers = Mapping[str, Sequence[tuple[float, ModulePlan]]]


def scheduler_frontier(rate_rps: float, max_budget_s: float,
                       configs: Sequence[Config]) -> list[tuple[float, ModulePlan]]:
    """Every (worst-case latency, plan) step of Harpagon's own module scheduler (Algorithm 1
    and dummies, :func:`harpagon_module`) as its budget grows to ``max_budget_s``, cheaper at
    each step: its plan changes only where the budget reaches a step it rejected, so the
    sweep visits exactly those budgets. The plans no other beats on both, fastest first."""
    plans: list[ModulePlan] = []
    budget_s = 0.0
    while budget_s <= max_budget_s + EPSILON:
        rejected: list[float] = []
        plan = harpagon_module(rate_rps, budget_s, configs, rejected_s=rejected)
        if plan is not None:
            plans.append(plan)
        above = [r for r in rejected if r > budget_s + EPSILON]
        if not above:
            break
        budget_s = min(above)
    return _pareto_points(plans)


def _pareto_points(plans: Sequence[ModulePlan]) -> list[tuple[float, ModulePlan]]:
    points: list[tuple[float, ModulePlan]] = []
    for wcl, plan in sorted(((plan_wcl_s(p.groups, "tc"), p) for p in plans),
                            key=lambda x: (x[0], x[1].cost)):
        if not points or plan.cost < points[-1][1].cost - EPSILON:
            points.append((wcl, plan))
    return points


def split_optimum(app: App, rates: Mapping[str, float],
                  configs: Mapping[str, Sequence[Config]]) -> AppPlan | None:
    """The best latency split for Harpagon's own module scheduler, found exhaustively: the
    cheapest combination of each stage's :func:`scheduler_frontier` points whose critical path
    meets the SLO. The Harpagon paper's "optimal" (its brute force searches the split, the
    NP-complete part; its Harp-q0.01 is "another kind of brute force search"), and a lower
    bound on every plan :func:`plan_app` can return."""
    frontiers = {s: scheduler_frontier(rates[s], app.slo_s, configs[s]) for s in app.names}
    return _optimum_plan(app, frontiers, "split-optimum")


def _optimum_plan(app: App, frontiers: Frontiers, name: str) -> AppPlan | None:
    choice = _tree_optimum(app, frontiers) if is_tree(app) else _product_optimum(app, frontiers)
    if choice is None:
        return None
    modules = {s: frontiers[s][i][1] for s, i in choice.items()}
    wcl = {s: frontiers[s][i][0] for s, i in choice.items()}
    return AppPlan(name, modules, dict(wcl), wcl, critical_path_s(app, wcl))


def _tree_optimum(app: App, frontiers: Frontiers) -> dict[str, int] | None:
    memo: dict[tuple[str, float], tuple[float, dict[str, int]]] = {}

    def subtree(node: str, left_s: float) -> tuple[float, dict[str, int]]:
        key = (node, round(left_s, 9))
        if key not in memo:
            best: tuple[float, dict[str, int]] = (math.inf, {})
            for i, (wcl, plan) in enumerate(frontiers[node]):
                if wcl > left_s + EPSILON:
                    continue
                total, picks = plan.cost, {node: i}
                for child in app.children(node):
                    cost, sub = subtree(child, left_s - wcl)
                    total += cost
                    picks.update(sub)
                if total < best[0]:
                    best = (total, picks)
            memo[key] = best
        return memo[key]

    total, picks = 0.0, {}
    for source in app.sources():
        cost, sub = subtree(source, app.slo_s)
        total += cost
        picks.update(sub)
    return None if math.isinf(total) else picks


def _product_optimum(app: App, frontiers: Frontiers) -> dict[str, int] | None:
    import itertools

    names = list(app.names)
    best: tuple[float, dict[str, int]] | None = None
    for combo in itertools.product(*(range(len(frontiers[n])) for n in names)):
        picks = dict(zip(names, combo, strict=True))
        wcl = {n: frontiers[n][i][0] for n, i in picks.items()}
        if critical_path_s(app, wcl) > app.slo_s + EPSILON:
            continue
        cost = sum(frontiers[n][i][1].cost for n, i in picks.items())
        if best is None or cost < best[0]:
            best = (cost, picks)
    return None if best is None else best[1]


__all__ = [
    "BASELINES",
    "CLIPPER",
    "HARPAGON",
    "INFERLINE",
    "NEXUS",
    "SCROOGE",
    "AppPlan",
    "PlannerSpec",
    "SearchTooLarge",
    "ablation",
    "brute_force",
    "module_frontier",
    "module_planner",
    "plan_app",
    "scheduler_frontier",
    "split_for",
    "split_optimum",
]
