"""One module's plan at a latency budget: Harpagon's multi-tuple generator, dummy requests, the
one- and two-tuple baselines, and the exact search the brute-force optimum uses.

Every function takes the module's real rate, its latency budget (seconds) and its candidate
configurations in ratio order (:func:`zserve.apps.configs.by_ratio`), and returns a
:class:`~zserve.apps.configs.ModulePlan` whose worst-case latency under the given dispatch is
within the budget, or None when no plan of its family is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

from zserve.apps.configs import (
    EPSILON,
    Config,
    Dispatch,
    Group,
    ModulePlan,
    machines_for,
    plan_wcl_s,
)

MEMO_DIGITS = 9  # rates rounded to this many decimals key the exact search's memo
EXACT_STATES_MAX = 20_000  # the exact search gives up (SearchTooLarge) past this many states


class SearchTooLarge(RuntimeError):
    """The exact search met more states than its limit (large rates over many configs)."""


def _step_wcl_s(group: Group, remaining_rps: float, dispatch: Dispatch) -> float:
    """The new group's worst-case latency when it and the ``remaining_rps`` after it are what
    is left to place (the groups after it carry the rest)."""
    collect = {"tc": remaining_rps, "dt": group.rate_rps,
               "rr": group.load * group.config.throughput_rps}[dispatch]
    return group.config.duration_s + group.config.batch / collect


def generate_config(rate_rps: float, budget_s: float, configs: Sequence[Config],
                    dispatch: Dispatch = "tc",
                    rejected_s: list[float] | None = None) -> ModulePlan | None:
    """Harpagon's Algorithm 1 (GenerateConfig): walk the configurations from the highest ratio;
    while the current one meets the budget at the rate still unplaced, give it as many whole
    machines as that rate fills, then one partly loaded machine; else move to the next.
    ``rejected_s`` collects the worst cases of the steps the budget rejected: the plan is the
    same for every budget below the smallest of them (the split optimum sweeps budgets so)."""
    remaining = rate_rps
    groups: list[Group] = []
    k = 0
    while remaining > EPSILON * max(1.0, rate_rps):
        if k >= len(configs):
            return None
        config = configs[k]
        machines = remaining / config.throughput_rps
        whole = math.floor(machines + EPSILON)
        step = Group(config, whole) if whole >= 1 else Group(config, 1, machines)
        step_s = _step_wcl_s(step, remaining, dispatch)
        if step_s <= budget_s + EPSILON:
            groups.append(step)
            remaining = max(0.0, remaining - step.rate_rps)
        else:
            if rejected_s is not None:
                rejected_s.append(step_s)
            k += 1
    return ModulePlan(tuple(groups))


def dummy_candidates_rps(plan: ModulePlan) -> list[float]:
    """Harpagon's dummy rates for a plan: for each configuration whose lower-ratio leftover
    ``u`` is below its machine's throughput ``t``, ``t - u`` requests a second (Theorem 2: a
    cost-minimal plan never leaves ``u >= t``; topping ``u`` up fills one more machine)."""
    out: list[float] = []
    groups = plan.groups
    for i, g in enumerate(groups):
        if i + 1 < len(groups) and groups[i + 1].config == g.config:
            continue  # the config's last group decides its leftover
        leftover = sum(h.rate_rps for h in groups[i + 1:])
        top = g.config.throughput_rps
        if EPSILON < leftover < top - EPSILON:
            out.append(top - leftover)
    return out


def harpagon_module(rate_rps: float, budget_s: float, configs: Sequence[Config],
                    dispatch: Dispatch = "tc", dummies: bool = True, *,
                    rejected_s: list[float] | None = None) -> ModulePlan | None:
    """Algorithm 1 and then (``dummies``) each dummy candidate re-planned, the cheapest kept
    (the dummy load is paid for). When Algorithm 1 finds nothing (its last, partly loaded
    machine collects too slowly), the rate topped up to whole machines of each configuration
    is tried instead. ``rejected_s``: as :func:`generate_config`'s, over every run."""
    best = generate_config(rate_rps, budget_s, configs, dispatch, rejected_s)
    if not dummies:
        return best
    if best is None:
        # the last machine's own rate is too slow to collect its batch in time: top the
        # stream up to whole machines of one configuration (the dummies' other use)
        for config in configs:
            whole = math.ceil(rate_rps / config.throughput_rps - EPSILON)
            trial = generate_config(whole * config.throughput_rps, budget_s, configs, dispatch,
                                    rejected_s)
            if trial is not None and (best is None or trial.cost < best.cost - EPSILON):
                best = ModulePlan(trial.groups, whole * config.throughput_rps - rate_rps)
        return best
    for extra in dummy_candidates_rps(best):
        trial = generate_config(rate_rps + extra, budget_s, configs, dispatch, rejected_s)
        if trial is not None and trial.cost < best.cost - EPSILON:
            best = ModulePlan(trial.groups, extra)
    return best


def one_tuple(rate_rps: float, budget_s: float, configs: Sequence[Config],
              dispatch: Dispatch = "rr") -> ModulePlan | None:
    """One configuration for the whole module (Clipper, InferLine): the cheapest that meets
    the budget with all its machines."""
    best: ModulePlan | None = None
    for config in configs:
        groups = tuple(machines_for(config, rate_rps, dispatch))
        if plan_wcl_s(groups, dispatch) <= budget_s + EPSILON:
            plan = ModulePlan(groups)
            if best is None or plan.cost < best.cost - EPSILON:
                best = plan
    return best


def two_tuple(rate_rps: float, budget_s: float, configs: Sequence[Config],
              dispatch: Dispatch = "rr") -> ModulePlan | None:
    """The two-round greedy of Nexus and Scrooge: the highest-ratio configuration that meets the
    budget takes the whole machines the rate fills (the majority), then the cheapest single
    configuration that meets it serves the residual. Falls back to :func:`one_tuple`."""
    for config in configs:
        whole = math.floor(rate_rps / config.throughput_rps + EPSILON)
        if whole < 1:
            continue
        majority = Group(config, whole)
        if _step_wcl_s(majority, rate_rps, dispatch) > budget_s + EPSILON:
            continue
        residual = rate_rps - majority.rate_rps
        if residual <= EPSILON * max(1.0, rate_rps):
            return ModulePlan((majority,))
        best: ModulePlan | None = None
        for other in configs:
            groups = (majority, *machines_for(other, residual, dispatch))
            if plan_wcl_s(groups, dispatch) <= budget_s + EPSILON:
                plan = ModulePlan(groups)
                if best is None or plan.cost < best.cost - EPSILON:
                    best = plan
        if best is not None:
            return best
        break
    return one_tuple(rate_rps, budget_s, configs, dispatch)


def exact_module(rate_rps: float, budget_s: float, configs: Sequence[Config],
                 max_states: int = EXACT_STATES_MAX) -> ModulePlan | None:
    """The cheapest TC plan of Harpagon's family (ratio-ordered runs of whole machines, a partly
    loaded machine last, or a last machine topped up with dummies) by memoised search over
    (rate left, next configuration): the brute-force optimum's per-module step. Raises
    :class:`SearchTooLarge` past ``max_states`` memoised states."""
    config_list = tuple(configs)
    states = [0]

    @cache
    def best(left: float, k: int) -> tuple[float, tuple[Group, ...], float]:
        """Cheapest (cost, groups, dummy rate) for ``left`` r/s from configuration ``k`` on."""
        if left <= EPSILON * max(1.0, rate_rps):
            return 0.0, (), 0.0
        if k >= len(config_list):
            return math.inf, (), 0.0
        states[0] += 1
        if states[0] > max_states:
            raise SearchTooLarge(f"exact search: more than {max_states} states")
        c = config_list[k]
        options = [best(left, k + 1), *last_machine(left, c)]
        if c.duration_s + c.batch / left <= budget_s + EPSILON:
            # a run of m whole machines collects at the rate it and everything after carry
            for m in range(1, math.floor(left / c.throughput_rps + EPSILON) + 1):
                rest = round(max(0.0, left - m * c.throughput_rps), MEMO_DIGITS)
                after = [best(rest, k + 1), *last_machine(rest, c)]
                cost, groups, pad = min(after, key=lambda o: o[0])
                options.append((m * c.price + cost, (Group(c, m), *groups), pad))
        return min(options, key=lambda o: o[0])

    def last_machine(left: float, c: Config) -> list[tuple[float, tuple[Group, ...], float]]:
        """``left`` (below one machine's throughput) on one last machine at ``c``: partly
        loaded, or topped up to full with dummy requests."""
        t = c.throughput_rps
        if not EPSILON < left < t - EPSILON:
            return []
        out: list[tuple[float, tuple[Group, ...], float]] = []
        if c.duration_s + c.batch / left <= budget_s + EPSILON:
            out.append((c.price * left / t, (Group(c, 1, left / t),), 0.0))
        if 2 * c.duration_s <= budget_s + EPSILON:
            out.append((c.price, (Group(c, 1),), t - left))
        return out

    cost, groups, pad = best(round(rate_rps, MEMO_DIGITS), 0)
    if math.isinf(cost):
        return None
    return ModulePlan(groups, pad)


Option = tuple[float, float, tuple[Group, ...], float]  # (worst-case s, cost, groups, dummy r/s)


def _pareto(options: Sequence[Option], max_budget_s: float) -> tuple[Option, ...]:
    """The options no other beats on both worst-case latency and cost, fastest first."""
    kept: list[Option] = []
    for o in sorted((o for o in options if o[0] <= max_budget_s + EPSILON),
                    key=lambda o: (o[0], o[1])):
        if not kept or o[1] < kept[-1][1] - EPSILON:
            kept.append(o)
    return tuple(kept)


def exact_frontier(rate_rps: float, max_budget_s: float, configs: Sequence[Config],
                   max_states: int = EXACT_STATES_MAX) -> list[ModulePlan]:
    """Every plan of :func:`exact_module`'s family that no other beats on both worst-case
    latency and cost (fastest first), up to ``max_budget_s``: one memoised search over (rate
    left, next configuration) that keeps each state's Pareto set, instead of one search per
    budget. Raises :class:`SearchTooLarge` past ``max_states`` states."""
    config_list = tuple(configs)
    states = [0]

    def last_machine(left: float, c: Config) -> list[Option]:
        t = c.throughput_rps
        if not EPSILON < left < t - EPSILON:
            return []
        return [(c.duration_s + c.batch / left, c.price * left / t, (Group(c, 1, left / t),),
                 0.0), (2 * c.duration_s, c.price, (Group(c, 1),), t - left)]

    @cache
    def front(left: float, k: int) -> tuple[Option, ...]:
        if left <= EPSILON * max(1.0, rate_rps):
            return ((0.0, 0.0, (), 0.0),)
        if k >= len(config_list):
            return ()
        states[0] += 1
        if states[0] > max_states:
            raise SearchTooLarge(f"exact frontier: more than {max_states} states")
        c = config_list[k]
        options = [*front(left, k + 1), *last_machine(left, c)]
        run_wcl = c.duration_s + c.batch / left
        if run_wcl <= max_budget_s + EPSILON:
            for m in range(1, math.floor(left / c.throughput_rps + EPSILON) + 1):
                rest = round(max(0.0, left - m * c.throughput_rps), MEMO_DIGITS)
                for wcl, cost, groups, pad in (*front(rest, k + 1), *last_machine(rest, c)):
                    options.append((max(run_wcl, wcl), m * c.price + cost,
                                    (Group(c, m), *groups), pad))
        return _pareto(options, max_budget_s)

    return [ModulePlan(groups, pad)
            for _, _, groups, pad in front(round(rate_rps, MEMO_DIGITS), 0)]


__all__ = ["EXACT_STATES_MAX", "SearchTooLarge", "dummy_candidates_rps", "exact_frontier",
           "exact_module", "generate_config", "harpagon_module",
           "one_tuple", "two_tuple"]
