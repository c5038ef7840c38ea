"""``fleet``: the zoo's 35 models profiled on two device kinds (A100 and GTX 1080 Ti), at one
offered rate: the cheapest fleet of each single kind that serves it within 1% bad, against the
mixed fleet the kind planner chooses (``zserve.orchestrator.kind_plan.plan_kinds``: each model's
kind, priced at whole GPUs per kind's pool by the ``gpus_for_rate`` estimate, improved by a greedy
search, the all-one-kind plans its floor). Cost per hour at equal goodput and bad rate; the goal
is a mixed fleet at least 20% cheaper than the best single-kind one.

Prices are an assumption (on-demand list prices per GPU-hour, as read from the providers' public
price pages in 2024, not re-checked here): an A100 40 GB is Google Cloud's a2-highgpu-1g (one A100,
12 vCPUs, 85 GB), $3.673/h in us-central1; no large cloud rents GTX 1080 Tis, so the kind is
priced as AWS's g4dn.xlarge (one T4, 4 vCPUs, 16 GiB), $0.526/h in us-east-1, a card of the same
class (8.1 fp32 TFLOPS against the 1080 Ti's 11.3).

Each model keeps one SLO, the A100 zoo's (the tighter of the two files' for all but BERT, 59 ms
against 56); a kind whose batch of one misses it cannot serve the model (none of the 35 on either
kind). The papers set each kind's SLO so that the model runs batches of at least 4 there (both
files: max(20 ms, 2 l(4) rounded down to the ms) on that kind): the A100's SLO is the workload's,
and the looser reading, each model's batch of 4 fitting on both kinds (the larger of the two
files' SLOs), is costed by the floor beside it (``slo_readings``). Every fleet's size is searched
in the simulator: its GPU count is the smallest at which the offered rate passes (worst model's
bad rate <= 1%). The simulator validates the planner's cheapest mixed plans (the first, and up to
``VALIDATED_MIXES`` in all that the estimate prices no dearer than one kind alone): each plan's
two pools sized apart (they share no model), then run together in one simulation, each GPU with
its kind's profiles and each model on its kind's GPUs. The planner's pick is the cheapest fleet
the simulator passed, the single-kind fleets among them, so it is never dearer than one kind;
the check that can fail is on the estimate: the planner's cheapest plan by the estimate, as the
simulator sizes it, against the single-kind fleets sized apart.

The cost floor (``cost_floor``) bounds what any placement can reach: each model on the kind where
its requests cost least, every batch at the largest size its own rate fills within its SLO
(``busy_gpus_floor``), GPUs shared with no loss (fractional), 1% of the requests dropped for free.
No mixed fleet costs less than that floor, so the saving any mix can reach over the best
single-kind fleet found is at most one minus their ratio; the goal's check says so when the floor
puts the goal out of reach, and another checks that the floor is below every fleet simulated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zserve.config.profiles import LatencyProfile
from zserve.loadgen.experiments.common import EXAMPLES_DIR, Check, Options, Outcome, Say, Table
from zserve.loadgen.experiments.simulated import (
    MAX_BAD_RATE,
    QUICK_WINDOWS_S,
    sim_probe,
    with_windows,
)
from zserve.loadgen.experiments.zoo import ZOO_WORKLOAD
from zserve.loadgen.sim.simulator import SimConfig
from zserve.loadgen.workload import ModelSpec, Workload, load_workload
from zserve.loadgen.zoo import load_zoo_csv
from zserve.orchestrator.kind_plan import KindPlan, per_model_choice, plan_kinds
from zserve.orchestrator.placement import busy_gpus_floor, cheapest_kind, gpus_for_rate

A100, GTX1080TI = "a100", "gtx1080ti"
PRICE_PER_HOUR = {A100: 3.673, GTX1080TI: 0.526}
"""USD per GPU-hour, on demand (the module docstring says where from: an assumption)."""
ZOO_CSVS = {A100: EXAMPLES_DIR / "profiles" / "model_zoo_a100.csv",
            GTX1080TI: EXAMPLES_DIR / "profiles" / "model_zoo_gtx1080ti.csv"}
FLEET_RATE_RPS = 10_000.0  # offered, equal popularity over the 35 models
FLEET_QUICK = {"first": 3, "stride": 4, "rate_rps": 2_500.0}  # 8 models (2 choose the A100)
SAVING_GOAL = 0.20  # the mixed fleet at least this much cheaper an hour than the best single kind
MAX_FLEET_GPUS = 1024  # a pool that needs more is reported as not sized
BRACKET_STEP = 1.2  # a pool's size search moves from its estimate by this factor to a bracket
FLEET_WINDOWS_S = (2.0, 5.0, 0.5)  # warmup, measure, cooldown: 50,000 measured requests
VALIDATED_MIXES = 2  # mixed plans the simulator sizes at most (each costs a pool search)
LISTED_MODELS = 6  # the plans table names a pool's models up to this many
PAPER_MIN_BATCH = 4  # the zoo's SLOs let every model batch at least this many on its own kind


def a100_slo(a100_ms: float, _gtx1080ti_ms: float) -> float:
    """The A100 zoo's SLO: the workload's (the tighter for 34 of the 35 models; BERT's two
    SLOs are 59 and 56 ms, each 2 l(4) on its own kind)."""
    return a100_ms


SLO_READINGS: dict[str, Callable[[float, float], float]] = {
    "the A100 zoo's (the workload's)": a100_slo,
    "the looser of the two files' (a batch of 4 fits on both kinds)": max}
"""How one SLO per model can be read from the two files (each file sets a model's SLO on its
kind to max(20 ms, 2 l(4))): the experiment runs the first; the floor costs both."""


def kind_profiles(pick: Callable[[float, float], float] = a100_slo
                  ) -> tuple[dict[str, float], dict[str, dict[str, LatencyProfile]]]:
    """The models profiled on both kinds: each model's SLO (``pick`` of the A100 and GTX 1080
    Ti files' SLOs) and its profile on each kind (batches capped where l(b) <= SLO, as a zoo
    workload caps them)."""
    rows = {kind: {r.name: r for r in load_zoo_csv(path)} for kind, path in ZOO_CSVS.items()}
    names = [n for n in rows[A100] if n in rows[GTX1080TI]]
    slo = {n: pick(rows[A100][n].slo_ms, rows[GTX1080TI][n].slo_ms) for n in names}
    profiles = {kind: {n: LatencyProfile.linear_for_slo(rows[kind][n].alpha_ms,
                                                        rows[kind][n].beta_ms, slo[n])
                       for n in names} for kind in rows}
    return slo, profiles


def meets_slo(profile: LatencyProfile, slo_ms: float) -> bool:
    return profile.latency(1) * 1e3 <= slo_ms


def pool_workload(base: Workload, names: list[str], kind: str, *, slo: dict[str, float],
                  profiles: dict[str, dict[str, LatencyProfile]], rate_rps: float) -> Workload:
    """``names`` on GPUs of ``kind`` at ``rate_rps`` (its GPU count is the search's)."""
    models = [ModelSpec(n, slo[n], profiles[kind][n]) for n in names]
    return base.with_overrides(models=models, rate=rate_rps)


def passes(w: Workload, cluster: SimConfig | None = None) -> tuple[bool, dict[str, Any]]:
    report = sim_probe(w, w.rate, cluster=cluster)
    return report["bad_rate"] <= MAX_BAD_RATE and not report.get("bailed"), report


def smallest_pool(w: Workload, start: int, say: Say, label: str) -> tuple[int, dict[str, Any]]:
    """The fewest GPUs at which ``w`` passes at its rate (``smallest_count``)."""
    return smallest_count(lambda gpus: passes(w.with_overrides(gpus=gpus)), start, say, label)


class NotSized(RuntimeError):
    """No GPU count up to the search's limit passes."""


def smallest_count(run: Callable[[int], tuple[bool, dict[str, Any]]], start: int, say: Say,
                   label: str, limit: int = MAX_FLEET_GPUS) -> tuple[int, dict[str, Any]]:
    """The fewest GPUs at which ``run(gpus)`` passes: steps of BRACKET_STEP from ``start`` (the
    estimate) up or down to a bracket, then bisection. Returns the count and its passing report.
    (A bad rate need not fall monotonically with GPUs: this is the bracket's count.)"""
    probes: dict[int, tuple[bool, dict[str, Any]]] = {}

    def probe(gpus: int) -> bool:
        if gpus not in probes:
            probes[gpus] = run(gpus)
            say(f"  {label}: {gpus} GPUs: worst bad rate "
                f"{probes[gpus][1]['bad_rate']:.3%}")
        return probes[gpus][0]

    hi = max(1, start)
    while not probe(hi):
        if hi >= limit:
            raise NotSized(f"{label}: fails up to {hi} GPUs (worst bad rate "
                           f"{probes[hi][1]['bad_rate']:.3%})")
        hi = min(limit, math.ceil(hi * BRACKET_STEP))
    lo = min(hi - 1, math.floor(hi / BRACKET_STEP))
    while lo >= 1 and probe(lo):
        hi, lo = lo, min(lo - 1, math.floor(lo / BRACKET_STEP))
    while hi - lo > 1:  # lo fails (or is 0), hi passes
        mid = (lo + hi) // 2
        if probe(mid):
            hi = mid
        else:
            lo = mid
    return hi, probes[hi][1]


def run_fleet(opts: Options) -> Outcome:
    say = opts.say
    slo, profiles = kind_profiles()
    names = list(slo)
    rate = FLEET_RATE_RPS
    base = load_workload(ZOO_WORKLOAD)  # its arrivals (Poisson) and popularity (equal)
    base = with_windows(base, QUICK_WINDOWS_S if opts.quick else FLEET_WINDOWS_S)
    if opts.quick:
        names = names[int(FLEET_QUICK["first"])::int(FLEET_QUICK["stride"])]
        rate = FLEET_QUICK["rate_rps"]
    per_model = rate / len(names)
    gpus_by_kind = {n: {k: gpus_for_rate(profiles[k][n].alpha_s * 1e3,
                                         profiles[k][n].beta_s * 1e3, slo[n], per_model)
                        for k in profiles} for n in names}
    plans = plan_kinds(gpus_by_kind, PRICE_PER_HOUR)
    fleets: dict[str, dict[str, Any]] = {}
    for kind in profiles:
        fleets[f"{kind} only"] = single_kind_fleet(base, kind, names, slo, profiles, rate,
                                                   gpus_by_kind, say)
    # a pool's search starts at its estimate scaled as the simulator scaled its kind's fleet
    scale = {k: f["kind_gpus"][k] / math.ceil(sum(gpus_by_kind[n][k] for n in names))
             for k in profiles if (f := fleets[f"{k} only"])["kind_gpus"]}
    sizing = PoolSizing(base, slo, profiles, per_model, gpus_by_kind, scale, say)
    for i, plan in enumerate(validated_mixes(plans)):
        fleets.update(mixed_fleet(sizing, plan, MIXED if i == 0 else f"{MIXED}, plan {i + 1}"))
    floors = cost_floor(names, slo, profiles, per_model)
    outcome = _outcome(names, rate, slo, plans, gpus_by_kind, fleets, floors)
    readings = slo_readings(names, per_model)
    outcome.tables.append(readings)
    outcome.points["slo_readings"] = readings.rows
    return outcome


def validated_mixes(plans: list[KindPlan]) -> list[KindPlan]:
    """The mixed plans the simulator sizes: the cheapest at whole GPUs by the estimate, and up
    to VALIDATED_MIXES in all of those the estimate prices no dearer than its cheapest
    all-one-kind plan (the others the estimate already rules out)."""
    mixed = [p for p in plans if p.is_mixed()]
    single = min((p.cost_per_hour for p in plans if not p.is_mixed()), default=math.inf)
    return mixed[:1] + [p for p in mixed[1:VALIDATED_MIXES] if p.cost_per_hour <= single]


MIXED = "mixed"
MIXED_FLOOR = "mixed, each model on its cheapest kind"


def slo_readings(names: list[str], per_model: float) -> Table:
    """The cost floors under each reading of one SLO per model (``SLO_READINGS``): how many
    models a kind cannot serve at all, how many a GTX 1080 Ti cannot batch 4 of, and how far
    below the cheaper single kind's floor the mix's floor lies."""
    rows: list[list[Any]] = []
    for label, pick in SLO_READINGS.items():
        slo, profiles = kind_profiles(pick)
        floors = cost_floor(names, slo, profiles, per_model)
        single = min(floors[f"{kind} only"]["cost"] for kind in profiles)
        mixed = floors[MIXED_FLOOR]["cost"]
        unserved = sum(1 for n in names for k in profiles if not meets_slo(profiles[k][n], slo[n]))
        small = sum(1 for n in names if profiles[GTX1080TI][n].max_batch < PAPER_MIN_BATCH)
        rows.append([label, unserved, small, round(floors[f"{A100} only"]["cost"], 2),
                     round(floors[f"{GTX1080TI} only"]["cost"], 2), round(mixed, 2),
                     f"{1 - mixed / single:.1%}"])
    return Table("cost floors by how one SLO per model is read from the two zoo files (each "
                 "sets a model's SLO on its kind to max(20 ms, 2 l(4)))",
                 ["SLO", "models a kind cannot serve", "models a GTX 1080 Ti cannot batch 4 of",
                  "A100 only floor $/h", "GTX 1080 Ti only floor $/h", "mixed floor $/h",
                  "mixed below the cheaper single kind's floor"], rows)


def cost_floor(names: list[str], slo: dict[str, float],
               profiles: dict[str, dict[str, LatencyProfile]],
               per_model: float) -> dict[str, dict[str, float]]:
    """The floors of each single kind and of the mix (see the module docstring): fleet ->
    {kind: fractional GPUs} with its ``"cost"`` ($/h), each model's GPUs ``busy_gpus_floor``
    less the 1% of its requests a fleet may drop."""
    kept = 1 - MAX_BAD_RATE
    need = {n: {k: kept * busy_gpus_floor(profiles[k][n].alpha_s * 1e3,
                                          profiles[k][n].beta_s * 1e3, slo[n], per_model,
                                          profiles[k][n].max_batch)
                for k in profiles} for n in names}
    floors: dict[str, dict[str, float]] = {}
    for kind in profiles:
        floors[f"{kind} only"] = {kind: sum(need[n][kind] for n in names)}
    mixed: dict[str, float] = {k: 0.0 for k in profiles}
    for n in names:
        cheapest = cheapest_kind(need[n], PRICE_PER_HOUR)
        assert cheapest is not None, n  # the A100 meets every A100-zoo SLO
        mixed[cheapest] += need[n][cheapest]
    floors[MIXED_FLOOR] = mixed
    for gpus in floors.values():
        gpus["cost"] = sum(PRICE_PER_HOUR[k] * g for k, g in gpus.items())  # inf: misses
    return floors


def single_kind_fleet(base: Workload, kind: str, names: list[str],  # noqa: PLR0917
                      slo: dict[str, float], profiles: dict[str, dict[str, LatencyProfile]],
                      rate: float, gpus_by_kind: dict[str, dict[str, float]],
                      say: Say) -> dict[str, Any]:
    """The smallest fleet of ``kind`` alone serving every model at ``rate``."""
    served = [n for n in names if meets_slo(profiles[kind][n], slo[n])]
    if len(served) < len(names):
        return {"kind_gpus": {}, "note": f"{len(names) - len(served)} of {len(names)} models "
                "miss their SLO on this kind"}
    w = pool_workload(base, names, kind, slo=slo, profiles=profiles, rate_rps=rate)
    need = math.ceil(sum(gpus_by_kind[n][kind] for n in names))
    gpus, report = smallest_pool(w, need, say, f"{kind} only")
    return {"kind_gpus": {kind: gpus}, "report": report}


@dataclass
class PoolSizing:
    """Sizes one kind's pool of models in the simulator (``smallest_pool``), its search started
    at the pool's summed estimate times ``scale[kind]`` (how the simulator sized that kind's
    whole fleet against its estimate); each pool sized once."""

    base: Workload
    slo: dict[str, float]
    profiles: dict[str, dict[str, LatencyProfile]]
    per_model: float
    gpus_by_kind: dict[str, dict[str, float]]
    scale: dict[str, float]
    say: Say
    sized: dict[tuple[str, tuple[str, ...]], int] = field(default_factory=dict)

    def gpus(self, kind: str, members: list[str], label: str) -> int:
        key = (kind, tuple(members))
        if key not in self.sized:
            w = pool_workload(self.base, members, kind, slo=self.slo, profiles=self.profiles,
                              rate_rps=self.per_model * len(members))
            estimate = sum(self.gpus_by_kind[n][kind] for n in members)
            start = max(1, round(estimate * self.scale.get(kind, 1.0)))
            self.sized[key], _ = smallest_pool(w, start, self.say, f"{label}, {kind} pool")
        return self.sized[key]


def mixed_fleet(sizing: PoolSizing, plan: KindPlan, label: str) -> dict[str, dict[str, Any]]:
    """A mixed plan's fleet: each kind's pool sized apart, then run together (``label``); then
    (``label``, shared) the pricier kind's GPUs serve every model too (each batch sized and
    timed by the granted GPU's profile; a GPU that frees goes first to the models at home on
    its kind, ``RankThread.set_home``), its count kept, the cheaper kind's searched again at
    most up to the pools' count (more would cost more than the pools apart)."""
    pools = plan.pools()
    gpus = {kind: sizing.gpus(kind, members, label) for kind, members in pools.items()}
    mix = MixedFleet(sizing.base, pools, sizing.slo, sizing.profiles,
                     sizing.per_model * len(plan.kind_of))
    ok, report = mix.run(gpus)
    sizing.say(f"fleet {label}, together: worst bad rate {report['bad_rate']:.3%}")
    fleets = {label: {"kind_gpus": gpus, "report": report, "together_passes": ok, "plan": plan}}
    shared = max(pools, key=lambda k: PRICE_PER_HOUR[k])
    cheap = min(pools, key=lambda k: PRICE_PER_HOUR[k])
    try:
        count, report = smallest_count(
            lambda n: mix.run({shared: gpus[shared], cheap: n}, shared=shared, home=True),
            gpus[cheap], sizing.say, f"{label}, shared {shared}: {cheap}", limit=gpus[cheap])
    except NotSized as exc:
        fleets[f"{label}, shared"] = {"kind_gpus": {}, "together_passes": False,
                                      "note": f"not sized: {exc}"}
    else:
        fleets[f"{label}, shared"] = {"kind_gpus": {shared: gpus[shared], cheap: count},
                                      "report": report, "together_passes": True}
    return fleets


@dataclass(frozen=True)
class MixedFleet:
    """Every model on one simulated fleet of several kinds (``pools``: kind -> its models)."""

    base: Workload
    pools: dict[str, list[str]]
    slo: dict[str, float]
    profiles: dict[str, dict[str, LatencyProfile]]
    rate: float

    def run(self, gpus: dict[str, int], shared: str | None = None, *, home: bool = False
            ) -> tuple[bool, dict[str, Any]]:
        """GPUs 0.. of the cheapest kind, then the next; each model on its pool's GPUs
        (``shared``: and on that kind's GPUs, where it meets its SLO), each GPU timing batches
        by its kind's profile; ``home``: a GPU that frees goes first to the models of its own
        pool (``RankThread.set_home``). Returns whether the rate passes, and the report."""
        names = [n for members in self.pools.values() for n in members]
        own = {n: kind for kind, members in self.pools.items() for n in members}
        # the cheapest kind's GPUs take the lowest ids (the rank prefers the idle GPU of lowest
        # id); a freeing GPU still goes to the most urgent waiting candidate, whatever its kind
        gpu_kind = [k for k in sorted(self.pools, key=lambda k: PRICE_PER_HOUR[k])
                    for _ in range(gpus[k])]
        model_gpus = {n: [g for g, k in enumerate(gpu_kind) if k == own[n] or (
            k == shared and meets_slo(self.profiles[k][n], self.slo[n]))] for n in names}
        # a model's workload profile is its own kind's; other kinds' GPUs get theirs
        w = self.base.with_overrides(
            models=[ModelSpec(n, self.slo[n], self.profiles[own[n]][n]) for n in names],
            gpus=len(gpu_kind), rate=self.rate)
        gpu_profiles = [{n: self.profiles[k][n] for n in names if own[n] != k}
                        for k in gpu_kind]
        model_home = {n: [g for g, k in enumerate(gpu_kind) if k == own[n]] for n in names}
        return passes(w, SimConfig(gpu_profiles=gpu_profiles, model_gpus=model_gpus,
                                   model_home_gpus=model_home if home else None))


def fleet_cost(kind_gpus: dict[str, int]) -> float:
    return sum(PRICE_PER_HOUR[k] * n for k, n in kind_gpus.items())


def _outcome(names: list[str], rate: float, slo: dict[str, float],  # noqa: PLR0917
             plans: list[KindPlan], gpus_by_kind: dict[str, dict[str, float]],
             fleets: dict[str, dict[str, Any]], floors: dict[str, dict[str, float]]) -> Outcome:
    rows = _fleet_rows(rate, fleets)
    single_names = [n for n, f in fleets.items()
                    if not n.startswith(MIXED) and f["cost"] is not None]
    best_single = min(fleets[n]["cost"] for n in single_names)
    mixed = min((f["cost"] for n, f in fleets.items()
                 if n.startswith(MIXED) and f["together_passes"]), default=math.inf)
    saving = 1 - mixed / best_single
    mixed_floor = floors[MIXED_FLOOR]["cost"]
    floor_holds = mixed_floor <= mixed and all(
        floors[n]["cost"] <= fleets[n]["cost"] for n in single_names)
    chosen_name, chosen_cost = _estimate_choice(plans[0], fleets)
    planned = min((n for n, f in fleets.items() if _passing_cost(f) < math.inf),
                  key=lambda n: _passing_cost(fleets[n]))
    order = list(fleets)
    for name, note in ((chosen_name, "the estimate's pick"),
                       (planned, "the planner's pick (simulated)")):
        row = rows[order.index(name)]
        row[-1] = "; ".join(filter(None, [row[-1], note]))
    table = Table(
        f"{len(names)} zoo models at {rate:,.0f} r/s (equal popularity, Poisson), each at the "
        f"A100 zoo's SLO: the smallest fleet that serves it with every model <= 1% bad "
        f"(prices: A100 ${PRICE_PER_HOUR[A100]}/h, GTX 1080 Ti ${PRICE_PER_HOUR[GTX1080TI]}/h)",
        ["fleet", "A100", "GTX 1080 Ti", "cost $/h", "goodput r/s", "worst bad %",
         "$ per million requests", "note"], rows)
    checks = [Check("the estimate-planned fleet no dearer than the best single kind",
                    chosen_cost <= best_single,
                    f"the planner's cheapest plan at whole GPUs by the estimate ({chosen_name}, "
                    f"estimated ${plans[0].cost_per_hour:.2f}/h), simulated: "
                    f"${chosen_cost:.2f}/h vs ${best_single:.2f}/h; after the simulator's "
                    f"validation the planner picks {planned} "
                    f"(${_passing_cost(fleets[planned]):.2f}/h)"),
              Check(f"the best mixed fleet >= {SAVING_GOAL:.0%} cheaper than the best single "
                    "kind", saving >= SAVING_GOAL,
                    _goal_detail(mixed, best_single, floors)),
              Check("the cost floor is below every fleet simulated", floor_holds,
                    f"floors ${floors[MIXED_FLOOR]['cost']:.2f}/h (mixed) and "
                    + ", ".join(f"${floors[n]['cost']:.2f}/h ({n})" for n in single_names)),
              Check("the mixed fleet serves the rate in one simulation",
                    bool(fleets[MIXED]["together_passes"]),
                    f"worst bad rate {fleets[MIXED]['report']['bad_rate']:.3%}")]
    points: dict[str, Any] = {
        name: {"kind_gpus": f["kind_gpus"], "cost_per_hour": f["cost"],
               "bad_rate": None if f.get("report") is None else f["report"]["bad_rate"]}
        for name, f in fleets.items()}
    points.update(saving=saving, cost_floor=floors, saving_bound=1 - mixed_floor / best_single,
                  estimate_choice=chosen_name, estimate_choice_cost=chosen_cost,
                  planned=planned, plans=[_plan_point(p) for p in plans])
    config = {"models": names, "rate_rps": rate, "prices_per_hour": PRICE_PER_HOUR,
              "slo_ms": slo, "max_bad_rate": MAX_BAD_RATE}
    tables = [table, _kinds_table(names, slo, gpus_by_kind, fleets[MIXED]["plan"]),
              _plans_table(plans, fleets), _floor_table(floors, best_single)]
    return Outcome(config, tables, checks, points)


def _fleet_rows(rate: float, fleets: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """The fleets table's rows; sets each fleet's ``cost`` ($/h, None: not sized)."""
    rows: list[list[Any]] = []
    for name, fleet in fleets.items():
        kind_gpus = fleet["kind_gpus"]
        report = fleet.get("report")
        cost = fleet_cost(kind_gpus) if kind_gpus else None
        fleet["cost"] = cost
        rows.append([name, kind_gpus.get(A100, 0) if kind_gpus else "-",
                     kind_gpus.get(GTX1080TI, 0) if kind_gpus else "-", cost,
                     rate if report else None,
                     None if report is None else round(100 * report["bad_rate"], 3),
                     None if cost is None else round(cost / (rate * 3600) * 1e6, 3),
                     fleet.get("note", "")])
    return rows


def _passing_cost(fleet: dict[str, Any]) -> float:
    """A fleet's $/h where it served the rate (a mix: run together), else ``inf``."""
    if fleet["cost"] is None or not fleet.get("together_passes", True):
        return math.inf
    return float(fleet["cost"])


def _estimate_choice(plan: KindPlan, fleets: dict[str, dict[str, Any]]) -> tuple[str, float]:
    """The simulated fleet of the planner's cheapest plan by the estimate, and its $/h
    (``inf`` where it failed): the mixed plan sized apart and run together, or a single kind's
    fleet."""
    if plan.is_mixed():
        name = next(n for n, f in fleets.items() if f.get("plan") is plan)
    else:
        name = f"{next(iter(plan.pool_gpus))} only"
    return name, _passing_cost(fleets[name])


def _plan_point(plan: KindPlan) -> dict[str, Any]:
    return {"pool_gpus": dict(plan.pool_gpus), "cost_per_hour": plan.cost_per_hour,
            "load_cost_per_hour": plan.load_cost_per_hour,
            "a100_models": [n for n, k in plan.kind_of.items() if k == A100]}


def _plans_table(plans: list[KindPlan], fleets: dict[str, dict[str, Any]]) -> Table:
    """The planner's plans at whole GPUs by the estimate, beside what the simulator sized."""
    simulated = {id(f["plan"]): n for n, f in fleets.items() if "plan" in f}
    rows: list[list[Any]] = []
    for plan in plans:
        name = (simulated.get(id(plan)) if plan.is_mixed()
                else f"{next(iter(plan.pool_gpus))} only")
        a100 = [n for n, k in plan.kind_of.items() if k == A100]
        rows.append([plan.pool_gpus.get(A100, 0), plan.pool_gpus.get(GTX1080TI, 0),
                     round(plan.cost_per_hour, 2), round(plan.load_cost_per_hour, 2),
                     _listed(a100, len(plan.kind_of)),
                     name or "not simulated (the estimate rules it out)",
                     None if name is None else _passing_cost(fleets[name])])
    return Table("the planner's plans (greedy search from each model's own cheapest kind and "
                 "from each single kind, priced at whole GPUs per pool by the estimate), "
                 "cheapest first",
                 ["A100 GPUs", "GTX 1080 Ti GPUs", "estimate $/h", "at fractional GPUs $/h",
                  "models on A100s", "simulated as", "simulated $/h"], rows)


def _listed(models: list[str], of: int) -> str:
    """A pool's models by name, or how many where that says more ("all", "none", "18 of 35")."""
    if not models or len(models) == of:
        return "all" if models else "none"
    return ", ".join(models) if len(models) <= LISTED_MODELS else f"{len(models)} of {of}"


def _kinds_table(names: list[str], slo: dict[str, float],
                 gpus_by_kind: dict[str, dict[str, float]], plan: KindPlan) -> Table:
    own = per_model_choice(gpus_by_kind, PRICE_PER_HOUR)
    return Table("each model's kind: on its own (its load costs least, fractional GPUs) and in "
                 "the cheapest mixed plan (GPUs its load needs on each kind, estimated)",
                 ["model", "SLO ms", "A100 GPUs", "GTX 1080 Ti GPUs", "on its own",
                  "in the mixed plan"],
                 [[n, slo[n], round(gpus_by_kind[n][A100], 3),
                   round(gpus_by_kind[n][GTX1080TI], 3) if math.isfinite(
                       gpus_by_kind[n][GTX1080TI]) else "misses SLO", own[n], plan.kind_of[n]]
                  for n in names])


def _goal_detail(mixed: float, best_single: float, floors: dict[str, dict[str, float]]) -> str:
    """The goal's figures, and where the cost floor puts the goal out of reach, that it does:
    no mix costs less than its floor, so none can save more than the floor allows."""
    floor = floors[MIXED_FLOOR]["cost"]
    single_floor = min(f["cost"] for n, f in floors.items() if n != MIXED_FLOOR)
    detail = (f"${mixed:.2f}/h vs ${best_single:.2f}/h: {1 - mixed / best_single:.1%} lower; "
              f"no mix costs less than its floor, ${floor:.2f}/h: at most "
              f"{1 - floor / best_single:.1%} below the best single-kind fleet found, "
              f"{1 - floor / single_floor:.1%} below the cheaper single kind's own floor")
    if 1 - floor / best_single < SAVING_GOAL:
        detail += (f"; out of reach on this workload at these prices "
                   f"({SAVING_GOAL:.0%} would need ${(1 - SAVING_GOAL) * best_single:.2f}/h)")
    return detail


def _floor_table(floors: dict[str, dict[str, float]], best_single: float) -> Table:
    rows = [[name] + [round(f.get(k, 0.0), 2) if math.isfinite(f.get(k, 0.0)) else
                      "misses an SLO" for k in (A100, GTX1080TI)]
            + [round(f["cost"], 2), f"{1 - f['cost'] / best_single:.1%}"]
            for name, f in floors.items()]
    return Table("cost floor: every batch at the largest size its model's rate fills within "
                 "its SLO, GPUs shared with no loss, 1% dropped free (no fleet costs less)",
                 ["fleet", "A100 GPUs", "GTX 1080 Ti GPUs", "floor $/h",
                  "below the best single-kind fleet found"], rows)
