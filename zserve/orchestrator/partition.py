"""Sub-cluster partitioning (Symphony, Appendix A.1): assign models to sub-clusters so that each
sub-cluster's request rate and static memory stay close to the averages, within a rank's rate
capacity, a backend's memory and, when re-planning, a budget on the bytes that move.

Each model i has a rate r_i, static bytes s_i and dynamic bytes d_i; x_ij = 1 puts it in
sub-cluster j. Rates and static bytes are normalised by their per-sub-cluster averages (sum / l),
so that both deviations are fractions of the average and the weight w is unitless::

    minimise   dR + w dS
    subject to sum_j x_ij = 1                                    every model in one sub-cluster
               sum_i r_i x_ij <= R_max                           a rank's capacity
               sum_i s_i x_ij + max_i d_i x_ij <= S_max          a backend's memory
               |sum_i r_i x_ij / Rbar - 1| <= dR,  |sum_i s_i x_ij / Sbar - 1| <= dS
               sum_ij c_ij |x_ij - x'_ij| <= C_max              re-plan against x' only

The max is linearised with one variable D_j >= d_i x_ij per sub-cluster; with x' known the
disruption is linear: |x_ij - x'_ij| = x_ij (1 - 2 x'_ij) + x'_ij. c_ij = c_i (the model's bytes,
loaded into or unloaded from a sub-cluster), so a move costs 2 c_i.

:func:`plan` solves it with HiGHS (highspy) under a time limit, warm-started from
:func:`greedy_plan` (a fresh plan: vector-balancing greedy, then :func:`improve`) or from
:func:`improve` applied to the current assignment within the budget (a re-plan). HiGHS is given the
warm start as its incumbent (``setSolution``), so the answer is never worse than the greedy's;
scipy's ``milp`` (the same HiGHS) takes no start, and from a cold start it found plans 50-160x worse
than the greedy within 2-5 s on A.2's 800 x 20 instance. :func:`random_search` is A.2's baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import highspy
import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

DEFAULT_WEIGHT = 1.0
"""w: rate and memory balance count the same (both are fractions of their averages)."""
IMPROVE_MAX_STEPS = 5000
"""Bound on :func:`improve`'s moves and swaps (each strictly lowers the squared deviations)."""
IMPROVE_EXTREME_GROUPS = 4
"""Sub-clusters whose models :func:`improve` considers per step: the most over and under loaded."""
RANDOM_BATCH = 256
"""Random assignments drawn and judged together by :func:`random_search`."""
_TOLERANCE = 1e-9


class PartitionInputError(ValueError):
    """Inputs that describe no partitioning problem (one line: which field, and why)."""


@dataclass(frozen=True, slots=True)
class PartitionProblem:
    """The models (rates, static and dynamic bytes) and the sub-clusters' limits.

    ``current`` (one sub-cluster per model) and ``disruption_budget`` (C_max, in the units of
    ``move_cost``, which defaults to ``static_bytes``) make it a re-plan.
    """

    rates_rps: FloatArray
    static_bytes: FloatArray
    dynamic_bytes: FloatArray
    groups: int
    rate_cap_rps: float = math.inf
    memory_cap_bytes: float = math.inf
    weight: float = DEFAULT_WEIGHT
    current: IntArray | None = None
    move_cost: FloatArray | None = None
    disruption_budget: float = math.inf

    def __post_init__(self) -> None:
        n = len(self.rates_rps)
        if self.groups < 1 or n < self.groups:
            raise PartitionInputError(f"groups must be 1..models ({n}), got {self.groups}")
        for name in ("static_bytes", "dynamic_bytes"):
            if len(getattr(self, name)) != n:
                raise PartitionInputError(f"{name} has {len(getattr(self, name))} entries, "
                                          f"rates_rps has {n}")
        if (self.rates_rps < 0).any() or (self.static_bytes < 0).any() or \
                (self.dynamic_bytes < 0).any() or self.rates_rps.sum() <= 0 or \
                self.static_bytes.sum() <= 0:
            raise PartitionInputError("rates and bytes must be >= 0, with positive totals")
        if self.weight < 0 or self.disruption_budget < 0:
            raise PartitionInputError("weight and disruption_budget must be >= 0")
        if self.current is not None and (len(self.current) != n or (self.current < 0).any()
                                         or (self.current >= self.groups).any()):
            raise PartitionInputError(f"current must give each of the {n} models a sub-cluster "
                                      f"in 0..{self.groups - 1}")
        if self.move_cost is not None and len(self.move_cost) != n:
            raise PartitionInputError(f"move_cost has {len(self.move_cost)} entries, not {n}")

    @property
    def models(self) -> int:
        return len(self.rates_rps)

    @property
    def costs(self) -> FloatArray:
        """c_i: what loading or unloading model i costs (its bytes unless told)."""
        return self.static_bytes if self.move_cost is None else self.move_cost

    def normalised(self) -> tuple[FloatArray, FloatArray]:
        """Rates and static bytes as fractions of their per-sub-cluster averages."""
        return (self.rates_rps * self.groups / self.rates_rps.sum(),
                self.static_bytes * self.groups / self.static_bytes.sum())


@dataclass(frozen=True, slots=True)
class PlanResult:
    """A plan: one sub-cluster per model, its objective, and how it was found."""

    assignment: IntArray
    objective: float
    warm_objective: float
    solver_status: str
    lower_bound: float
    violations: list[str] = field(default_factory=list)


def group_totals(values: FloatArray, assignment: IntArray, groups: int) -> FloatArray:
    return np.bincount(assignment, weights=values, minlength=groups).astype(np.float64)


def imbalance(values: FloatArray, assignment: IntArray, groups: int) -> float:
    """A.2's imbalance factor: (max - min) / average over the sub-clusters' totals."""
    totals = group_totals(values, assignment, groups)
    return float((totals.max() - totals.min()) / totals.mean())


def objective(problem: PartitionProblem, assignment: IntArray) -> float:
    """dR + w dS of ``assignment`` (normalised: both are fractions of the average)."""
    rates, static = problem.normalised()
    rate_dev = np.abs(group_totals(rates, assignment, problem.groups) - 1.0).max()
    static_dev = np.abs(group_totals(static, assignment, problem.groups) - 1.0).max()
    return float(rate_dev + problem.weight * static_dev)


def disruption(problem: PartitionProblem, assignment: IntArray) -> float:
    """sum_ij c_ij |x_ij - x'_ij|: 2 c_i per model not in its current sub-cluster."""
    if problem.current is None:
        return 0.0
    return float(2.0 * problem.costs[assignment != problem.current].sum())


def peak_bytes(problem: PartitionProblem, assignment: IntArray) -> FloatArray:
    """Per sub-cluster: its models' static bytes plus their largest dynamic bytes."""
    largest = np.zeros(problem.groups)
    np.maximum.at(largest, assignment, problem.dynamic_bytes)
    return group_totals(problem.static_bytes, assignment, problem.groups) + largest


def violations(problem: PartitionProblem, assignment: IntArray) -> list[str]:
    """The constraints ``assignment`` breaks, one line each (empty: feasible)."""
    found: list[str] = []
    rate = group_totals(problem.rates_rps, assignment, problem.groups)
    for j in np.flatnonzero(rate > problem.rate_cap_rps * (1 + 1e-7)):
        found.append(f"sub-cluster {j}: rate {rate[j]:.6g} r/s above R_max "
                      f"{problem.rate_cap_rps:.6g}")
    peak = peak_bytes(problem, assignment)
    for j in np.flatnonzero(peak > problem.memory_cap_bytes * (1 + 1e-7)):
        found.append(f"sub-cluster {j}: memory {peak[j]:.6g} B above S_max "
                      f"{problem.memory_cap_bytes:.6g}")
    cost = disruption(problem, assignment)
    if cost > problem.disruption_budget * (1 + 1e-7) + _TOLERANCE:
        found.append(f"disruption {cost:.6g} above C_max {problem.disruption_budget:.6g}")
    return found


def greedy_plan(problem: PartitionProblem) -> IntArray:
    """A fresh plan: models by decreasing r + w s, each to the sub-cluster where it adds least to
    the squared loads (argmin r_i R_j + w s_i S_j) among those it fits in, then :func:`improve`."""
    rates, static = problem.normalised()
    assignment = np.zeros(problem.models, dtype=np.int64)
    load_r = np.zeros(problem.groups)
    load_s = np.zeros(problem.groups)
    raw_rate = np.zeros(problem.groups)
    raw_static = np.zeros(problem.groups)
    largest = np.zeros(problem.groups)
    for i in np.argsort(-(rates + problem.weight * static), kind="stable"):
        score = rates[i] * load_r + problem.weight * static[i] * load_s
        peak = raw_static + problem.static_bytes[i] + np.maximum(largest, problem.dynamic_bytes[i])
        fits = ((raw_rate + problem.rates_rps[i] <= problem.rate_cap_rps)
                & (peak <= problem.memory_cap_bytes))
        # where it fits nowhere, the least loaded place: the plan then reports the violation
        j = int(np.argmin(np.where(fits, score, np.inf)) if fits.any() else np.argmin(score))
        assignment[i] = j
        load_r[j] += rates[i]
        load_s[j] += static[i]
        raw_rate[j] += problem.rates_rps[i]
        raw_static[j] += problem.static_bytes[i]
        largest[j] = max(largest[j], problem.dynamic_bytes[i])
    return improve(problem, assignment)


def improve(problem: PartitionProblem, assignment: IntArray,
            max_steps: int = IMPROVE_MAX_STEPS) -> IntArray:
    """Local search from ``assignment``: single moves and pairwise swaps that lower the squared
    deviations sum_j (R_j - 1)^2 + w (S_j - 1)^2, best gain per unit of disruption first (free
    steps first), keeping every cap and the disruption budget (C_max) it starts within."""
    improver = _Improver(problem, assignment)
    for _ in range(max_steps):
        if not improver.step():
            break
    return improver.assignment


@dataclass(frozen=True, slots=True)
class _Step:
    score: float
    cost: float
    models: tuple[int, ...]
    targets: tuple[int, ...]


class _Improver:
    """The state :func:`improve` walks: the assignment and its per-sub-cluster totals."""

    def __init__(self, problem: PartitionProblem, assignment: IntArray) -> None:
        self.problem = problem
        self.rates, self.static = problem.normalised()
        self.assignment = assignment.astype(np.int64, copy=True)
        groups = problem.groups
        self.load_r = group_totals(self.rates, self.assignment, groups)
        self.load_s = group_totals(self.static, self.assignment, groups)
        self.raw_rate = group_totals(problem.rates_rps, self.assignment, groups)
        self.raw_static = group_totals(problem.static_bytes, self.assignment, groups)
        self.spent = disruption(problem, self.assignment)
        costs = problem.costs
        self.cost_floor = 1e-6 * float(costs.mean()) + _TOLERANCE  # free steps score highest
        self.capped = math.isfinite(problem.rate_cap_rps) or \
            math.isfinite(problem.memory_cap_bytes)

    def cost_at(self, models: IntArray, groups: IntArray) -> FloatArray:
        """Disruption of having ``models`` in ``groups``: 2 c_i away from home, else 0."""
        home = self.problem.current
        if home is None:
            return np.zeros(np.broadcast_shapes(models.shape, groups.shape))
        away = groups != home[models]
        return np.where(away, 2.0 * self.problem.costs[models], 0.0)

    def candidates(self) -> IntArray:
        """Models in the sub-clusters furthest over and under the average, in rate and memory."""
        extremes = {int(np.argmax(self.load_r)), int(np.argmin(self.load_r)),
                    int(np.argmax(self.load_s)), int(np.argmin(self.load_s))}
        return np.flatnonzero(np.isin(self.assignment, sorted(extremes)))

    def largest(self) -> FloatArray:
        found = np.zeros(self.problem.groups)
        np.maximum.at(found, self.assignment, self.problem.dynamic_bytes)
        return found

    def _pick(self, gain: FloatArray, cost: FloatArray, ok: npt.NDArray[np.bool_]
              ) -> tuple[float, float, tuple[int, ...]] | None:
        ok = ok & (gain > _TOLERANCE) & (self.spent + cost <= self.problem.disruption_budget
                                         + _TOLERANCE)
        if not ok.any():
            return None
        score = np.where(ok, gain / (np.maximum(cost, 0.0) + self.cost_floor), -np.inf)
        flat = int(np.argmax(score))
        where = tuple(int(k) for k in np.unravel_index(flat, score.shape))
        return float(score.flat[flat]), float(cost.flat[flat]), where

    def best_move(self, cand: IntArray) -> _Step | None:
        p, w = self.problem, self.problem.weight
        home = self.assignment[cand]
        r, s = self.rates[cand][:, None], self.static[cand][:, None]
        gain = -(2 * r * (self.load_r[None, :] - self.load_r[home][:, None]) + 2 * r * r
                 + w * (2 * s * (self.load_s[None, :] - self.load_s[home][:, None]) + 2 * s * s))
        targets = np.arange(p.groups)[None, :]
        ok = targets != home[:, None]
        if self.capped:
            largest = self.largest()
            ok &= self.raw_rate[None, :] + p.rates_rps[cand][:, None] <= p.rate_cap_rps
            ok &= (self.raw_static[None, :] + p.static_bytes[cand][:, None]
                   + np.maximum(largest[None, :], p.dynamic_bytes[cand][:, None])
                   <= p.memory_cap_bytes)
        cost = self.cost_at(cand[:, None], targets) - self.cost_at(cand, home)[:, None]
        picked = self._pick(gain, cost, ok)
        if picked is None:
            return None
        score, step_cost, (k, h) = picked
        return _Step(score, step_cost, (int(cand[k]),), (h,))

    def best_swap(self, cand: IntArray) -> _Step | None:
        p, w = self.problem, self.problem.weight
        g, h = self.assignment[cand][:, None], self.assignment[None, :]
        d_r = self.rates[cand][:, None] - self.rates[None, :]
        d_s = self.static[cand][:, None] - self.static[None, :]
        gain = -(2 * d_r * (self.load_r[h] - self.load_r[g]) + 2 * d_r * d_r
                 + w * (2 * d_s * (self.load_s[h] - self.load_s[g]) + 2 * d_s * d_s))
        ok = g != h
        if self.capped:
            raw_r = p.rates_rps[cand][:, None] - p.rates_rps[None, :]
            raw_s = p.static_bytes[cand][:, None] - p.static_bytes[None, :]
            largest = self.largest()
            ok &= (self.raw_rate[h] + raw_r <= p.rate_cap_rps) & \
                (self.raw_rate[g] - raw_r <= p.rate_cap_rps)
            incoming = np.maximum(largest[h], p.dynamic_bytes[cand][:, None])
            ok &= self.raw_static[h] + raw_s + incoming <= p.memory_cap_bytes
            ok &= (self.raw_static[g] - raw_s + np.maximum(largest[g], p.dynamic_bytes[None, :])
                   <= p.memory_cap_bytes)
        others = np.arange(p.models)[None, :]
        cost = (self.cost_at(cand[:, None], h) - self.cost_at(cand[:, None], g)
                + self.cost_at(others, g) - self.cost_at(others, h))
        picked = self._pick(gain, cost, ok)
        if picked is None:
            return None
        score, step_cost, (k, t) = picked
        i = int(cand[k])
        return _Step(score, step_cost, (i, t), (int(self.assignment[t]), int(self.assignment[i])))

    def step(self) -> bool:
        """Take the best move or swap; False when none lowers the deviations."""
        cand = self.candidates()
        steps = [s for s in (self.best_move(cand), self.best_swap(cand)) if s is not None]
        if not steps:
            return False
        best = max(steps, key=lambda s: s.score)
        for model, target in zip(best.models, best.targets, strict=True):
            self._move(model, target)
        self.spent += best.cost
        return True

    def _move(self, model: int, target: int) -> None:
        p, source = self.problem, int(self.assignment[model])
        for totals, values in ((self.load_r, self.rates), (self.load_s, self.static),
                               (self.raw_rate, p.rates_rps), (self.raw_static, p.static_bytes)):
            totals[source] -= values[model]
            totals[target] += values[model]
        self.assignment[model] = target


class _Rows:
    """Constraint rows gathered as (row, column, value) triplets, handed to HiGHS as CSR."""

    def __init__(self) -> None:
        self.rows: list[IntArray] = []
        self.cols: list[IntArray] = []
        self.vals: list[FloatArray] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, rows: IntArray, cols: IntArray, vals: FloatArray, *,
            bounds: tuple[float, float], count: int) -> None:
        """``count`` rows whose entries are given relative to this block (row 0 = its first)."""
        base = len(self.lower)
        self.rows.append(np.asarray(rows, dtype=np.int64) + base)
        self.cols.append(np.asarray(cols, dtype=np.int64))
        self.vals.append(np.asarray(vals, dtype=np.float64))
        self.lower += [bounds[0]] * count
        self.upper += [bounds[1]] * count

    def pass_to(self, highs: highspy.Highs) -> None:
        rows, cols = np.concatenate(self.rows), np.concatenate(self.cols)
        vals: FloatArray = np.concatenate(self.vals).astype(np.float64)
        order = np.argsort(rows, kind="stable")
        starts = np.zeros(len(self.lower), dtype=np.int32)
        starts[1:] = np.cumsum(np.bincount(rows, minlength=len(self.lower)))[:-1]
        highs.addRows(len(self.lower), np.array(self.lower), np.array(self.upper), len(order),
                      starts, cols[order].astype(np.int32), vals[order])


def _milp_rows(problem: PartitionProblem) -> tuple[_Rows, int]:
    """Every constraint of the module docstring over the columns x_ij (i * l + j), dR, dS and,
    with a memory cap, D_j; returns the rows and the column count."""
    m, groups = problem.models, problem.groups
    n_x = m * groups
    rates, static = problem.normalised()
    model_of, group_of = np.repeat(np.arange(m), groups), np.tile(np.arange(groups), m)
    x_cols, per_group = np.arange(n_x), np.arange(groups)
    rows = _Rows()
    rows.add(model_of, x_cols, np.ones(n_x), bounds=(1.0, 1.0), count=m)  # one sub-cluster each
    for norm, dev in ((rates, n_x), (static, n_x + 1)):
        # total_j - dev <= 1 and total_j + dev >= 1
        for sign, bounds in ((-1.0, (-math.inf, 1.0)), (1.0, (1.0, math.inf))):
            rows.add(np.r_[group_of, per_group], np.r_[x_cols, np.full(groups, dev)],
                     np.r_[norm[model_of], np.full(groups, sign)], bounds=bounds, count=groups)
    if math.isfinite(problem.rate_cap_rps):
        rows.add(group_of, x_cols, problem.rates_rps[model_of],
                 bounds=(-math.inf, problem.rate_cap_rps), count=groups)
    columns = n_x + 2
    if math.isfinite(problem.memory_cap_bytes):
        cap = problem.memory_cap_bytes  # bytes in units of S_max keep the coefficients near 1
        largest = n_x + 2 + group_of  # D_j's column, per x_ij
        rows.add(np.r_[group_of, per_group], np.r_[x_cols, n_x + 2 + per_group],
                 np.r_[problem.static_bytes[model_of] / cap, np.ones(groups)],
                 bounds=(-math.inf, 1.0), count=groups)
        rows.add(np.r_[x_cols, x_cols], np.r_[x_cols, largest],  # d_i x_ij - D_j <= 0
                 np.r_[problem.dynamic_bytes[model_of] / cap, -np.ones(n_x)],
                 bounds=(-math.inf, 0.0), count=n_x)
        columns += groups
    if problem.current is not None and math.isfinite(problem.disruption_budget):
        total = float(problem.costs.sum())
        home = (problem.current[model_of] == group_of).astype(np.float64)
        rows.add(np.zeros(n_x, dtype=np.int64), x_cols,
                 problem.costs[model_of] * (1 - 2 * home) / total,
                 bounds=(-math.inf, (problem.disruption_budget - total) / total), count=1)
    return rows, columns


def _warm_columns(problem: PartitionProblem, warm: IntArray, columns: int) -> FloatArray:
    m, groups = problem.models, problem.groups
    values = np.zeros(columns)
    values[np.arange(m) * groups + warm] = 1.0
    rates, static = problem.normalised()
    values[m * groups] = np.abs(group_totals(rates, warm, groups) - 1.0).max()
    values[m * groups + 1] = np.abs(group_totals(static, warm, groups) - 1.0).max()
    if columns > m * groups + 2:
        largest = np.zeros(groups)
        np.maximum.at(largest, warm, problem.dynamic_bytes)
        values[m * groups + 2:] = largest / problem.memory_cap_bytes
    return values


def solve_milp(problem: PartitionProblem, warm: IntArray | None, time_limit_s: float
               ) -> tuple[IntArray | None, str, float]:
    """HiGHS on the MILP, started from ``warm`` (its incumbent) and stopped at ``time_limit_s``:
    the best assignment found (None if none), the model status and the proven lower bound."""
    rows, columns = _milp_rows(problem)
    n_x = problem.models * problem.groups
    highs = highspy.Highs()  # type: ignore[no-untyped-call]  # its __init__ is unannotated
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("threads", 1)
    highs.setOptionValue("random_seed", 0)
    cost = np.zeros(columns)
    cost[n_x], cost[n_x + 1] = 1.0, problem.weight
    upper = np.full(columns, highspy.kHighsInf)
    upper[:n_x] = 1.0
    empty = np.zeros(0, dtype=np.int32)
    highs.addCols(columns, cost, np.zeros(columns), upper, 0, empty, empty, np.zeros(0))
    highs.changeColsIntegrality(n_x, np.arange(n_x, dtype=np.int32),
                                np.full(n_x, highspy.HighsVarType.kInteger))
    rows.pass_to(highs)
    if warm is not None:
        start = highspy.HighsSolution()
        start.col_value = list(_warm_columns(problem, warm, columns))
        start.value_valid = True
        highs.setSolution(start)
    highs.run()
    status = highs.modelStatusToString(highs.getModelStatus())
    bound = float(highs.getInfo().mip_dual_bound)
    values = np.asarray(highs.getSolution().col_value)
    if len(values) < n_x or not highs.getSolution().value_valid:
        return None, status, bound
    return values[:n_x].reshape(problem.models, problem.groups).argmax(axis=1), status, bound


def plan(problem: PartitionProblem, time_limit_s: float) -> PlanResult:
    """The partition: the warm start (:func:`greedy_plan`, or :func:`improve` from ``current``
    within the budget for a re-plan), then HiGHS for ``time_limit_s``; the better of the two."""
    warm = greedy_plan(problem) if problem.current is None else \
        improve(problem, problem.current)
    warm_objective = objective(problem, warm)
    solved, status, bound = solve_milp(problem, warm, time_limit_s)
    best = warm
    # a feasible plan beats an infeasible one (the greedy may break a tight cap), then the lower
    # objective; the solver never returns an infeasible plan as its own
    if solved is not None and not violations(problem, solved) and (
            violations(problem, warm) or objective(problem, solved) < warm_objective - _TOLERANCE):
        best = solved
    return PlanResult(best, objective(problem, best), warm_objective, status, bound,
                      violations(problem, best))


def random_search(problem: PartitionProblem, rng: np.random.Generator,
                  should_stop: Callable[[], bool]) -> tuple[IntArray | None, float, int]:
    """A.2's baseline: uniformly random assignments, the best feasible one by the objective,
    until ``should_stop()``; returns it (None if none was feasible), its objective and the
    number of assignments tried."""
    rates, static = problem.normalised()
    m, groups = problem.models, problem.groups
    offsets = (np.arange(RANDOM_BATCH) * groups)[:, None]
    best, best_objective, tried = None, math.inf, 0
    while not should_stop():
        batch = rng.integers(0, groups, size=(RANDOM_BATCH, m))
        flat = (batch + offsets).ravel()

        def totals(values: FloatArray, flat: IntArray = flat) -> FloatArray:
            found = np.bincount(flat, weights=np.tile(values, RANDOM_BATCH),
                                minlength=RANDOM_BATCH * groups)
            return found.astype(np.float64).reshape(RANDOM_BATCH, groups)

        scores = (np.abs(totals(rates) - 1).max(axis=1)
                  + problem.weight * np.abs(totals(static) - 1).max(axis=1))
        scores[~_random_feasible(problem, batch, flat, totals)] = math.inf
        tried += RANDOM_BATCH
        k = int(np.argmin(scores))
        if scores[k] < best_objective:
            best, best_objective = batch[k].astype(np.int64), float(scores[k])
    return best, best_objective, tried


def _random_feasible(problem: PartitionProblem, batch: IntArray, flat: IntArray,
                     totals: Callable[[FloatArray], FloatArray]) -> npt.NDArray[np.bool_]:
    ok = np.ones(len(batch), dtype=bool)
    if math.isfinite(problem.rate_cap_rps):
        ok &= (totals(problem.rates_rps) <= problem.rate_cap_rps).all(axis=1)
    if math.isfinite(problem.memory_cap_bytes):
        largest = np.zeros(batch.size // problem.models * problem.groups)
        np.maximum.at(largest, flat, np.tile(problem.dynamic_bytes, len(batch)))
        peak = totals(problem.static_bytes) + largest.reshape(len(batch), problem.groups)
        ok &= (peak <= problem.memory_cap_bytes).all(axis=1)
    if problem.current is not None and math.isfinite(problem.disruption_budget):
        moved = batch != problem.current[None, :]
        ok &= 2 * (moved * problem.costs[None, :]).sum(axis=1) <= problem.disruption_budget
    return ok


__all__ = [
    "DEFAULT_WEIGHT",
    "PartitionInputError",
    "PartitionProblem",
    "PlanResult",
    "disruption",
    "greedy_plan",
    "group_totals",
    "imbalance",
    "improve",
    "objective",
    "peak_bytes",
    "plan",
    "random_search",
    "solve_milp",
    "violations",
]
