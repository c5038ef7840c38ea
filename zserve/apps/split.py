"""SLO splitters: per-stage latency budgets whose every source-to-sink path sums to at most the
app's SLO. Pure functions of the app, its stage rates and the stages' configurations.

- :func:`greedy_split`: Harpagon's Algorithm 2 (latency-cost efficiency, LC). Every stage starts
  at its fastest configuration (batch 1 on the dearest kind); each round applies the one switch
  that saves the most cost per second of latency it adds while the critical path stays within the
  SLO. Node merging lets siblings with the same parents and children move to one common budget
  as a whole; cost-direct undoes the last few moves and redoes them by the largest saving.
  ``score="throughput"`` is the Scrooge / InferLine throughput-greedy split instead.
- :func:`even_split`: Clipper's: the SLO divided evenly over the longest chain of stages.
- :func:`dp_split`: Nexus's dynamic program over a tree, on budgets quantised to SLO/segments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from zserve.apps.configs import EPSILON, Config, Dispatch, single_wcl_s
from zserve.apps.dag import App, AppError, is_tree, topological_order

Score = Literal["lc", "throughput"]
COST_DIRECT_UNDO_MAX = 3  # cost-direct tries undoing the last 1..3 moves (the paper's R)
Assignment = dict[str, Config]


@dataclass(frozen=True)
class Split:
    """Per-stage budgets (seconds), the rounds the splitter took, and (greedy splitters) the
    single configuration each stage ended at."""

    budgets_s: dict[str, float]
    iterations: int = 0
    configs: Mapping[str, Config] | None = None


class _Dag:
    """The app's order and parents once, for fast critical paths."""

    def __init__(self, app: App, dispatch: Dispatch) -> None:
        self.dispatch = dispatch
        self.order = topological_order(app)
        self.parents = {n: app.parents(n) for n in self.order}
        self.slo_s = app.slo_s

    def critical_path_s(self, latency_s: Mapping[str, float]) -> float:
        finish: dict[str, float] = {}
        for node in self.order:
            start = max((finish[p] for p in self.parents[node]), default=0.0)
            finish[node] = start + latency_s[node]
        return max(finish.values())


@dataclass(frozen=True)
class _Move:
    saving: float  # cost saved per the single-configuration estimate
    added_s: float  # latency the move adds (largest over the stages it moves)
    gain: float  # throughput gain ratio (the throughput-greedy score)
    new: Assignment


def _single_cost(state: Assignment, rates: Mapping[str, float]) -> float:
    return sum(c.cost(rates[s]) for s, c in state.items())


def _latencies(state: Assignment, rates: Mapping[str, float], dag: _Dag) -> dict[str, float]:
    return {s: single_wcl_s(c, rates[s], dag.dispatch) for s, c in state.items()}


def _sibling_sets(app: App) -> list[tuple[str, ...]]:
    """Stages with the same (non-empty) parent set and child set: node merging's groups."""
    keyed: dict[tuple[frozenset[str], frozenset[str]], list[str]] = {}
    for n in app.names:
        parents = frozenset(app.parents(n))
        if parents:
            keyed.setdefault((parents, frozenset(app.children(n))), []).append(n)
    return [tuple(v) for v in keyed.values() if len(v) > 1]


def _moves(state: Assignment, rates: Mapping[str, float], configs: Mapping[str, Sequence[Config]],
           siblings: Sequence[tuple[str, ...]], dag: _Dag) -> list[_Move]:
    """Every cost-saving switch: one stage to another configuration, and each sibling set to a
    common budget (each member at its cheapest configuration within it)."""
    moves: list[_Move] = []
    for stage, prev in state.items():
        rate = rates[stage]
        for c in configs[stage]:
            saving = prev.cost(rate) - c.cost(rate)
            if saving > EPSILON:
                added = (single_wcl_s(c, rate, dag.dispatch)
                         - single_wcl_s(prev, rate, dag.dispatch))
                gain = c.throughput_rps / prev.throughput_rps
                moves.append(_Move(saving, added, gain, {**state, stage: c}))
    for members in siblings:
        wcl = {(m, c): single_wcl_s(c, rates[m], dag.dispatch) for m in members
               for c in configs[m]}
        before = max(wcl[m, state[m]] for m in members)
        levels = sorted(set(wcl.values()))
        for level in levels:
            new = dict(state)
            for m in members:
                costs = {c: c.cost(rates[m]) for c in configs[m]
                         if wcl[m, c] <= level + EPSILON}
                if costs:
                    new[m] = min(costs, key=costs.__getitem__)
            saving = sum(state[m].cost(rates[m]) - new[m].cost(rates[m]) for m in members)
            if saving > EPSILON and any(new[m] != state[m] for m in members):
                moves.append(_Move(saving, level - before, 1.0, new))
    return moves


def _best_move(moves: Sequence[_Move], dag: _Dag, rates: Mapping[str, float],
               key: Callable[[_Move], float]) -> _Move | None:
    feasible = [m for m in moves
                if dag.critical_path_s(_latencies(m.new, rates, dag)) <= dag.slo_s + EPSILON]
    return max(feasible, key=key, default=None)


def latency_cost_efficiency(prev: Config, new: Config, rate_rps: float,
                            dispatch: Dispatch = "tc") -> float:
    """Cost saved per second of latency added by switching a stage at ``rate_rps`` from
    ``prev`` to ``new`` (single-configuration estimates; +inf when no latency is added)."""
    added = single_wcl_s(new, rate_rps, dispatch) - single_wcl_s(prev, rate_rps, dispatch)
    saving = prev.cost(rate_rps) - new.cost(rate_rps)
    return math.inf if added <= EPSILON else saving / added


def _lc(move: _Move) -> float:
    """Latency-cost efficiency; a move that adds no latency is taken first."""
    return math.inf if move.added_s <= EPSILON else move.saving / move.added_s


def start_state(configs: Mapping[str, Sequence[Config]]) -> Assignment:
    """Algorithm 2's start: each stage at its smallest batch on its dearest kind."""
    return {s: min(cs, key=lambda c: (-c.price, c.batch, c.duration_s))
            for s, cs in configs.items()}


def greedy_split(app: App, rates: Mapping[str, float], configs: Mapping[str, Sequence[Config]],
                 *, score: Score = "lc", dispatch: Dispatch = "tc", merge_nodes: bool = True,
                 cost_direct: bool = True) -> Split | None:
    """Harpagon's SplitLatency (module docstring); None when even the start misses the SLO."""
    dag = _Dag(app, dispatch)
    siblings = _sibling_sets(app) if merge_nodes else []
    state = start_state(configs)
    if dag.critical_path_s(_latencies(state, rates, dag)) > app.slo_s + EPSILON:
        return None
    key: Callable[[_Move], float] = _lc if score == "lc" else (lambda m: m.gain)
    history = [state]
    while (move := _best_move(_moves(state, rates, configs, siblings, dag), dag, rates, key)):
        state = move.new
        history.append(state)
    rounds = len(history) - 1
    if cost_direct and score == "lc":
        state = _cost_direct(history, dag, rates, configs, siblings)
    return Split(_latencies(state, rates, dag), rounds, state)


def _cost_direct(history: Sequence[Assignment], dag: _Dag, rates: Mapping[str, float],
                 configs: Mapping[str, Sequence[Config]],
                 siblings: Sequence[tuple[str, ...]]) -> Assignment:
    """Undo the last R moves (R = 1..COST_DIRECT_UNDO_MAX) and redo greedily by the largest
    saving; the cheapest end state wins (the greedy one on a tie)."""
    best = history[-1]
    for undo in range(1, min(COST_DIRECT_UNDO_MAX, len(history) - 1) + 1):
        state = history[-1 - undo]
        while (move := _best_move(_moves(state, rates, configs, siblings, dag), dag, rates,
                                  lambda m: m.saving)):
            state = move.new
        if _single_cost(state, rates) < _single_cost(best, rates) - EPSILON:
            best = state
    return best


def even_split(app: App) -> Split:
    """Clipper's split: SLO / (stages on the longest chain) for every stage."""
    depth: dict[str, int] = {}
    for node in topological_order(app):
        depth[node] = 1 + max((depth[p] for p in app.parents(node)), default=0)
    share = app.slo_s / max(depth.values())
    return Split({n: share for n in app.names})


def dp_split(app: App, stage_cost: Callable[[str, float], float], segments: int) -> Split | None:
    """Nexus's split: budgets are multiples of SLO/segments; on a tree, the cheapest total is
    ``f(v, r) = min_k cost_v(k) + sum_children f(c, r - k)`` over remaining segments ``r``.
    None when no grid split is feasible; :class:`AppError` when a stage has two parents."""
    if not is_tree(app):
        raise AppError(f"app {app.name!r}: the dynamic-program split needs a tree")
    step_s = app.slo_s / segments
    table = {n: [math.inf] + [stage_cost(n, k * step_s) for k in range(1, segments + 1)]
             for n in app.names}
    memo: dict[tuple[str, int], tuple[float, int]] = {}

    def subtree(node: str, left: int) -> tuple[float, int]:
        if (node, left) not in memo:
            options = [(table[node][k] + sum(subtree(c, left - k)[0] for c in app.children(node)),
                        k) for k in range(1, left + 1)]
            memo[node, left] = min(options, default=(math.inf, 0))
        return memo[node, left]

    budgets: dict[str, float] = {}

    def assign(node: str, left: int) -> None:
        _, k = subtree(node, left)
        budgets[node] = k * step_s
        for c in app.children(node):
            assign(c, left - k)

    if sum(subtree(s, segments)[0] for s in app.sources()) == math.inf:
        return None
    for s in app.sources():
        assign(s, segments)
    return Split(budgets, segments)


__all__ = ["COST_DIRECT_UNDO_MAX", "Score", "Split", "dp_split", "even_split", "greedy_split",
           "latency_cost_efficiency", "start_state"]
