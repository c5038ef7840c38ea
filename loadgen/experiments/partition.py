"""``partition``: Symphony Appendix A.2, sub-cluster partitioning (a greedy-started HiGHS MILP)
against random search with the same time budget, and a re-plan under a disruption budget."""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from zserve.loadgen.experiments.common import (
    ZOO_CSV,
    Check,
    Options,
    Outcome,
    Table,
    pyplot,
    save_figure,
)
from zserve.loadgen.zoo import load_zoo_csv
from zserve.orchestrator.memory import ModelMemory, device_budget_bytes, zoo_model_memory
from zserve.orchestrator.partition import (
    DEFAULT_WEIGHT,
    PartitionProblem,
    disruption,
    imbalance,
    objective,
    plan,
    random_search,
)

PARTITION_MODELS = 800
PARTITION_GROUPS = 20
PARTITION_INSTANCES = 100
PARTITION_REPLANS = 10  # the first instances, re-planned after a drift
PARTITION_TIME_LIMIT_S = 1.5  # HiGHS per plan; random search gets the plan's whole wall time
PARTITION_QUICK = {"models": 400, "groups": 10, "instances": 4, "replans": 2,
                   "time_limit_s": 0.3}
MEAN_RATE_RPS = 1000.0  # exponential per-model rates (A.2 gives no scale)
RANK_CAPACITY_RPS = 3.1e6  # R_max: bench-scheduler --models 20 --gpus 64 --clock cpu, this machine
DEVICE_KIND = "a100"  # S_max: the zoo's profiles are A100 ones
DRIFT_FRACTION = 0.25  # a re-plan follows a drift: this share of the models draw new rates
DISRUPTION_BUDGET_FRACTION = 0.05  # C_max: 5% of all models' bytes (a move costs 2 c_i)
IMBALANCE_GOAL = 0.05
RANDOM_FACTOR_GOAL = 5.0
RECOVERY_GOAL = 0.9


def zoo_memory() -> list[ModelMemory]:
    return [zoo_model_memory(row.name, row.alpha_ms, row.beta_ms, row.slo_ms)
            for row in load_zoo_csv(ZOO_CSV)]


def make_problem(seed: int, models: int, groups: int, zoo: list[ModelMemory]
                 ) -> PartitionProblem:
    """A.2's instance: ``models`` variants drawn from the zoo, exponential rates."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(zoo), size=models)
    return PartitionProblem(
        rates_rps=rng.exponential(MEAN_RATE_RPS, size=models),
        static_bytes=np.array([zoo[k].static_bytes for k in picks], dtype=np.float64),
        dynamic_bytes=np.array([zoo[k].dynamic_bytes for k in picks], dtype=np.float64),
        groups=groups, rate_cap_rps=RANK_CAPACITY_RPS,
        memory_cap_bytes=float(device_budget_bytes(DEVICE_KIND)), weight=DEFAULT_WEIGHT)


def _instance(seed: int, problem: PartitionProblem, time_limit_s: float) -> dict[str, Any]:
    """One instance: the plan (timed), then random search for the same wall time."""
    started = time.perf_counter()
    result = plan(problem, time_limit_s)
    budget_s = time.perf_counter() - started
    deadline = time.perf_counter() + budget_s
    rng = np.random.default_rng(1_000_000 + seed)
    found, found_objective, tried = random_search(problem, rng,
                                                  lambda: time.perf_counter() >= deadline)
    groups = problem.groups
    row: dict[str, Any] = {
        "seed": seed, "wall_s": round(budget_s, 2), "status": result.solver_status,
        "objective": result.objective, "warm_objective": result.warm_objective,
        "lower_bound": result.lower_bound, "violations": result.violations,
        "rate_imbalance": imbalance(problem.rates_rps, result.assignment, groups),
        "memory_imbalance": imbalance(problem.static_bytes, result.assignment, groups),
        "random_tried": tried, "random_objective": found_objective,
        "random_rate_imbalance": None, "random_memory_imbalance": None,
        "assignment": result.assignment}
    if found is not None:
        row["random_rate_imbalance"] = imbalance(problem.rates_rps, found, groups)
        row["random_memory_imbalance"] = imbalance(problem.static_bytes, found, groups)
    return row


def _replan(seed: int, problem: PartitionProblem, current: np.ndarray[Any, Any],
            time_limit_s: float) -> dict[str, Any]:
    """A drift (a share of the rates redrawn), then an unconstrained and a budgeted re-plan."""
    rng = np.random.default_rng(2_000_000 + seed)
    rates = problem.rates_rps.copy()
    drifted = rng.random(problem.models) < DRIFT_FRACTION
    rates[drifted] = rng.exponential(MEAN_RATE_RPS, size=int(drifted.sum()))
    moved = dataclasses.replace(problem, rates_rps=rates)
    before = objective(moved, current)
    free = plan(moved, time_limit_s)
    budget = DISRUPTION_BUDGET_FRACTION * float(problem.static_bytes.sum())
    budgeted_problem = dataclasses.replace(moved, current=current, disruption_budget=budget)
    budgeted = plan(budgeted_problem, time_limit_s)
    gain_free = before - free.objective
    recovery = (before - budgeted.objective) / gain_free if gain_free > 0 else 1.0
    total = float(problem.static_bytes.sum())
    return {"seed": seed, "before": before, "free": free.objective,
            "budgeted": budgeted.objective, "recovery": recovery,
            "free_moved_share": disruption(budgeted_problem, free.assignment) / 2 / total,
            "budgeted_moved_share": disruption(budgeted_problem, budgeted.assignment) / 2 / total,
            "violations": budgeted.violations}


def _quantiles(values: list[float]) -> list[float]:
    """p50, p90 and max, in percent (the plans' imbalances are hundredths of a percent)."""
    ordered = sorted(100.0 * v for v in values)
    return [statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))], ordered[-1]]


def _tables(rows: list[dict[str, Any]], replans: list[dict[str, Any]], shape: str
            ) -> tuple[list[Table], dict[str, float]]:
    series = {key: [r[key] for r in rows if r[key] is not None]
              for key in ("rate_imbalance", "memory_imbalance", "random_rate_imbalance",
                          "random_memory_imbalance")}
    med = {key: statistics.median(values) if values else float("inf")
           for key, values in series.items()}
    summary = Table(
        f"Imbalance (max - min) / avg over {len(rows)} instances ({shape}): plan vs random "
        "search with the same wall time",
        ["method", "measure", "p50 %", "p90 %", "max %", "random p50 / plan p50"],
        [["plan", "rate", *_quantiles(series["rate_imbalance"]),
          med["random_rate_imbalance"] / max(med["rate_imbalance"], 1e-12)],
         ["plan", "memory", *_quantiles(series["memory_imbalance"]),
          med["random_memory_imbalance"] / max(med["memory_imbalance"], 1e-12)],
         ["random", "rate", *_quantiles(series["random_rate_imbalance"]), 1.0],
         ["random", "memory", *_quantiles(series["random_memory_imbalance"]), 1.0]])
    solver = Table(
        "Plans: wall time, HiGHS status, the warm start's objective and the plan's (dR + w dS, "
        "in % of the averages)",
        ["p50 wall s", "statuses", "p50 warm objective %", "p50 plan objective %",
         "plans better than the warm start", "p50 random trials"],
        [[statistics.median(r["wall_s"] for r in rows),
          ", ".join(sorted({r["status"] for r in rows})),
          100 * statistics.median(r["warm_objective"] for r in rows),
          100 * statistics.median(r["objective"] for r in rows),
          sum(1 for r in rows if r["objective"] < r["warm_objective"]),
          statistics.median(r["random_tried"] for r in rows)]])
    replan = Table(
        f"Re-plan after {DRIFT_FRACTION:.0%} of the rates drift: objective (%) before, "
        f"unconstrained, with C_max = {DISRUPTION_BUDGET_FRACTION:.0%} of the model bytes",
        ["seed", "before %", "unconstrained %", "budgeted %", "recovery",
         "bytes moved % (free)", "bytes moved % (budgeted)"],
        [[r["seed"], 100 * r["before"], 100 * r["free"], 100 * r["budgeted"], r["recovery"],
          100 * r["free_moved_share"], 100 * r["budgeted_moved_share"]] for r in replans])
    return [summary, solver, replan], med


def _checks(rows: list[dict[str, Any]], replans: list[dict[str, Any]],
            med: dict[str, float]) -> list[Check]:
    checks = []
    for measure in ("rate", "memory"):
        plan_med, random_med = med[f"{measure}_imbalance"], med[f"random_{measure}_imbalance"]
        checks.append(Check(f"median {measure} imbalance <= {IMBALANCE_GOAL}",
                            plan_med <= IMBALANCE_GOAL, f"p50 {plan_med:.4f}"))
        checks.append(Check(f"median {measure} imbalance >= {RANDOM_FACTOR_GOAL:g}x lower than "
                            "random search's", random_med >= RANDOM_FACTOR_GOAL * plan_med,
                            f"random p50 {random_med:.4f} / plan p50 {plan_med:.4f}"))
    worst = min(r["recovery"] for r in replans)
    checks.append(Check(f"every budgeted re-plan recovers >= {RECOVERY_GOAL:.0%} of the "
                        "unconstrained one's improvement", worst >= RECOVERY_GOAL,
                        f"min recovery {worst:.3f} over {len(replans)} re-plans"))
    broken = [f"seed {r['seed']}: {v}" for r in rows + replans for v in r["violations"]]
    checks.append(Check("every plan keeps R_max, S_max and C_max", not broken,
                        "; ".join(broken[:3]) or "none broken"))
    return checks


def run_partition(opts: Options) -> Outcome:
    shape = PARTITION_QUICK if opts.quick else {
        "models": PARTITION_MODELS, "groups": PARTITION_GROUPS,
        "instances": PARTITION_INSTANCES, "replans": PARTITION_REPLANS,
        "time_limit_s": PARTITION_TIME_LIMIT_S}
    zoo = zoo_memory()
    rows, replans = [], []
    for seed in range(int(shape["instances"])):
        problem = make_problem(seed, int(shape["models"]), int(shape["groups"]), zoo)
        row = _instance(seed, problem, float(shape["time_limit_s"]))
        if seed < shape["replans"]:
            replans.append(_replan(seed, problem, row["assignment"], float(shape["time_limit_s"])))
        del row["assignment"]
        rows.append(row)
        opts.say(f"  instance {seed}: plan rate {row['rate_imbalance']:.4f} memory "
                 f"{row['memory_imbalance']:.4f} ({row['status']}, {row['wall_s']} s); random "
                 f"rate {row['random_rate_imbalance']} memory {row['random_memory_imbalance']}")
    shape_text = f"{shape['models']} models, {shape['groups']} sub-clusters"
    tables, med = _tables(rows, replans, shape_text)
    config = {**shape, "mean_rate_rps": MEAN_RATE_RPS, "rank_capacity_rps": RANK_CAPACITY_RPS,
              "device_kind": DEVICE_KIND, "memory_cap_bytes": device_budget_bytes(DEVICE_KIND),
              "weight": DEFAULT_WEIGHT, "drift_fraction": DRIFT_FRACTION,
              "disruption_budget_fraction": DISRUPTION_BUDGET_FRACTION, "zoo_csv": ZOO_CSV.name}
    outcome = Outcome(config, tables, _checks(rows, replans, med),
                      {"instances": rows, "replans": replans})
    if opts.plots:
        outcome.plots.append(_plot_cdf(rows, opts.out_dir / "partition.png"))
    return outcome


def _plot_cdf(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    styles = {"rate_imbalance": ("plan, rate", "tab:blue", "-"),
              "memory_imbalance": ("plan, memory", "tab:orange", "-"),
              "random_rate_imbalance": ("random, rate", "tab:blue", ":"),
              "random_memory_imbalance": ("random, memory", "tab:orange", ":")}
    for key, (label, color, line) in styles.items():
        values = sorted(max(r[key], 1e-6) for r in rows if r[key] is not None)
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label,
                color=color, linestyle=line)
    ax.axvline(IMBALANCE_GOAL, color="black", linestyle="--", linewidth=0.8, label="goal 0.05")
    ax.set_xscale("log")
    ax.set_xlabel("imbalance (max - min) / avg")
    ax.set_ylabel("CDF over instances")
    ax.set_title("Sub-cluster partitioning (Symphony A.2): plan vs random search")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return Path(save_figure(fig, path))
