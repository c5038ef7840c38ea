"""The live SLO split of each app: its splitter, re-run every ``resplit_every_s`` from the
per-stage rates measured at this frontend.

Pure (no I/O; the clock is passed in): ``FrontendCore`` composes one ``AppSplits``, counts each
admitted request of an app's models into it (``note``), and calls ``on_timer`` when ``next_at``
is due (its host's timer, as for deadlines). A split is each stage's weight; the ``AppDriver``
gives a stage instance submitted at ``now`` the share ``(answer_by - now) * w / W`` of what is
left (``W``: the heaviest weighted path from it to the last stage), so weights that are budgets
summing to at most the SLO on every path give each stage at least its budget, and a stage that
finishes early passes its slack on.

Splitters (``[[apps]] splitter``):

- ``proportional``: each stage weighs its model's l(1); rates are not used (the default).
- ``nexus``: Nexus's dynamic program (``zserve.apps.split.dp_split``, a tree, budgets on a grid
  of ``NEXUS_SEGMENTS``), the cost of a stage at a budget the GPU time a second its rate needs
  at the largest batch the budget allows.
- ``harpagon``: Harpagon's latency splitting, Algorithm 2 with node merging and cost-direct
  (``zserve.apps.split.greedy_split``), over the stage's batch sizes on one device kind.

Both cost models use zserve's deferred scheduler (``dispatch="deferred"``): a batch of b at
rate r collects for ``(b - 1) / r`` and takes ``l(b)`` plus the scheduler's allowance for it
(``d_ctrl + d_data * b``). What is split is the time the stages use: the SLO less the stage
overhead (the reply allowance and the scheduler's jitter, which the ``AppDriver`` adds to every
stage's share), and each weight is a stage's budget of it.

Rates: a stage's rate is its model's (every request of the model at this frontend, the app's
stage requests and any other client's, since they batch together) over the last period, times
the number of frontends. Clients spread over the frontends (the assumption admission makes with
its 1/count share of each bound), so one frontend's count scaled up is the cluster's without a
round of messages between frontends, and each frontend decides only its own app requests'
deadlines. A period with no request of some stage's model keeps the split; a split the splitter
finds infeasible (no budget fits l(1)) falls back to ``proportional``. Each rate is rounded to the
nearest power of ``RATE_STEP`` before it is split, and the splits are remembered. A model's
profile as its backends measured it replaces the configured one from the next re-split on
(``learn``; the core hands it over before each).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from zserve.apps.configs import Config
from zserve.apps.dag import App, Edge, Stage
from zserve.apps.split import dp_split, greedy_split
from zserve.config.apps import AppGraph, SplitterName
from zserve.config.cluster import ClusterConfig
from zserve.config.profiles import LatencyProfile, configured_profile

NEXUS_SEGMENTS = 50  # Nexus's grid: budgets are multiples of SLO / this (its planner's)
# Rates are split at the nearest power of this (within 5%): a period's count of Poisson arrivals
# does not make the split flap, and a steady load re-splits from the memo, not the splitter (a
# split of a six-stage app takes a few ms of the frontend's loop).
RATE_STEP = 1.1
SPLIT_MEMO_MAX = 256  # splits remembered per app (then forgotten all at once)
DEVICE_KIND = "gpu"  # one device kind at price 1: a stage's cost is its GPU time a second
SplitFn = Callable[[AppGraph, Mapping[str, Sequence[float]], Mapping[str, float], float],
                   Mapping[str, float] | None]
"""(app, each stage's l(1..max_batch) in s, each stage's rate in r/s, the SLO to split in s)
-> each stage's budget in s (every path within the SLO), or None when none fits."""


def proportional_split(plan: AppGraph, latency_s: Mapping[str, Sequence[float]],
                       rates_rps: Mapping[str, float], slo_s: float) -> Mapping[str, float]:
    """Each stage weighs its l(1): on the critical path the SLO is split in proportion to it."""
    return {stage: latency_s[stage][0] for stage in plan.order}


def batch_cost(latency_s: Sequence[float], rate_rps: float, budget_s: float) -> float:
    """GPU seconds a second that ``rate_rps`` takes at the largest batch whose deferred
    worst case (``l(b) + (b - 1) / rate``) fits ``budget_s``; inf when not even one does."""
    best = math.inf
    for batch, duration_s in enumerate(latency_s, start=1):
        if duration_s + (batch - 1) / rate_rps <= budget_s:
            best = min(best, rate_rps * duration_s / batch)
    return best


def _as_app(plan: AppGraph, slo_s: float) -> App:
    stages = tuple(Stage(name, plan.stages[name].model) for name in plan.order)
    edges = tuple(Edge(up, name, float(fan)) for name in plan.order
                  for up, fan in plan.stages[name].after.items())
    return App(plan.name, stages, edges, slo_s)


def nexus_split(plan: AppGraph, latency_s: Mapping[str, Sequence[float]],
                rates_rps: Mapping[str, float], slo_s: float) -> Mapping[str, float] | None:
    """Nexus's dynamic program (module docstring); the config check keeps it to trees."""
    found = dp_split(_as_app(plan, slo_s),
                     lambda stage, budget_s: batch_cost(latency_s[stage], rates_rps[stage],
                                                        budget_s), NEXUS_SEGMENTS)
    return None if found is None else found.budgets_s


def candidate_batches(max_batch: int) -> list[int]:
    """The batch sizes Algorithm 2 moves between: powers of two and ``max_batch`` (each round
    tries every stage's every size, so a profile of 256 sizes would stall the frontend)."""
    return sorted({min(2 ** k, max_batch) for k in range(max_batch.bit_length() + 1)})


def harpagon_split(plan: AppGraph, latency_s: Mapping[str, Sequence[float]],
                   rates_rps: Mapping[str, float], slo_s: float) -> Mapping[str, float] | None:
    """Harpagon's Algorithm 2 on one device kind (module docstring)."""
    configs = {stage: [Config(DEVICE_KIND, b, latency_s[stage][b - 1], 1.0)
                       for b in candidate_batches(len(latency_s[stage]))]
               for stage in plan.order}
    found = greedy_split(_as_app(plan, slo_s), rates_rps, configs, dispatch="deferred")
    return None if found is None else found.budgets_s


SPLIT_FNS: dict[SplitterName, SplitFn] = {
    "proportional": proportional_split, "nexus": nexus_split, "harpagon": harpagon_split}


def with_allowances(latency_s: Sequence[float], delay_s: tuple[float, float]
                    ) -> list[float]:
    """l(b) plus what the scheduler sets aside for a batch of b: ``delay_s`` is (``d_ctrl``,
    ``d_data``) of the model, in seconds."""
    fixed_s, per_row_s = delay_s
    return [duration_s + fixed_s + per_row_s * b for b, duration_s in enumerate(latency_s, 1)]


def split_weights(plan: AppGraph, latency_s: Mapping[str, Sequence[float]],
                  rates_rps: Mapping[str, float], overhead_s: float,
                  delay_s: Mapping[str, tuple[float, float]] | None = None,
                  ) -> tuple[dict[str, float], bool]:
    """Each stage's weight by ``plan``'s splitter, and whether it was that splitter's (False:
    the ``proportional`` fallback, when it finds no split). ``latency_s``: each stage's l(b);
    ``overhead_s``: the stage overhead (module docstring); ``delay_s``: each stage's
    scheduling allowances (``with_allowances``; none if omitted)."""
    name = plan.config.splitter
    usable_s = plan.stages_slo_s - overhead_s
    if name != "proportional" and usable_s > 0:
        scheduled = {s: with_allowances(latency_s[s], (delay_s or {}).get(s, (0.0, 0.0)))
                     for s in plan.order}
        budgets = SPLIT_FNS[name](plan, scheduled, rates_rps, usable_s)
        if budgets is not None:
            return share_spare(plan, budgets, usable_s), True
    return (dict(proportional_split(plan, latency_s, rates_rps, plan.stages_slo_s)),
            name == "proportional")


def share_spare(plan: AppGraph, budgets_s: Mapping[str, float], usable_s: float
                ) -> dict[str, float]:
    """``budgets_s`` with the time no stage's cost needs (``usable_s`` less the heaviest path)
    shared equally over the stages of the longest chain: a stage whose batch cannot grow keeps
    a margin for the hops to its scheduler, instead of the bare time its batch takes while the
    stages that batch get the rest in proportion to their budgets."""
    budgets = {s: float(budgets_s[s]) for s in plan.order}
    spare_s = usable_s - max(heaviest_paths(plan, budgets).values())
    if spare_s <= 0:
        return budgets
    depth: dict[str, int] = {}
    for stage in plan.order:
        depth[stage] = 1 + max((depth[up] for up in plan.stages[stage].after), default=0)
    share_s = spare_s / max(depth.values())
    return {s: b + share_s for s, b in budgets.items()}


class AppSplits:
    """Every app's current split, its request counts this period and when it is re-split."""

    def __init__(self, plans: Mapping[str, AppGraph],
                 latency_s: Mapping[str, Sequence[float] | None], *, frontends: int,
                 overhead_s: float,
                 delay_s: Mapping[str, tuple[float, float]] | None = None) -> None:
        """``latency_s``: each model's l(1..max_batch) in seconds (None: no profile known; its
        stages weigh 1 and only ``proportional`` splits its apps); ``overhead_s``: the stage
        overhead (module docstring); ``delay_s``: each model's scheduling allowances
        (``with_allowances``). The periods count from ``start``."""
        self.plans = dict(plans)
        self.frontends = frontends
        self.overhead_s = overhead_s
        self._delay_s: dict[str, dict[str, tuple[float, float]]] = {
            plan.name: {s: (delay_s or {}).get(plan.stages[s].model, (0.0, 0.0))
                        for s in plan.order} for plan in self.plans.values()}
        self._latency_s: dict[str, dict[str, Sequence[float]]] = {}
        self.weights: dict[str, dict[str, float]] = {}
        self.rates_rps: dict[str, dict[str, float]] = {}  # each app's, at its latest re-split
        self.splitter_used: dict[str, bool] = {}  # False: its splitter fell back
        self._counts: dict[str, dict[str, int]] = {}  # app -> model -> requests this period
        self._apps_of: dict[str, list[dict[str, int]]] = {}  # model -> its apps' counts
        self._measured: dict[str, bool] = {}  # every stage's model has a profile
        self._memo: dict[str, dict[tuple[int, ...], tuple[dict[str, float], bool]]] = {
            name: {} for name in self.plans}
        self._since: dict[str, float] = {}
        self._due: dict[str, float] = {}
        self._model_latency_s = {m: t for m, t in latency_s.items() if t}
        for plan in self.plans.values():
            self._set_tables(plan)
            self.weights[plan.name] = dict(proportional_split(
                plan, self._latency_s[plan.name], {}, plan.stages_slo_s))
            self.splitter_used[plan.name] = plan.config.splitter == "proportional"
            counts = {plan.stages[s].model: 0 for s in plan.order}
            self._counts[plan.name] = counts
            for model in counts:
                self._apps_of.setdefault(model, []).append(counts)
        self.started = False
        self.next_at = math.inf

    def _set_tables(self, plan: AppGraph) -> None:
        """``plan``'s stages' l(b) tables; an app with a stage of no known profile has nothing
        to weigh rates against: its stages weigh 1 and it is not re-split."""
        tables = {s: self._model_latency_s.get(plan.stages[s].model) for s in plan.order}
        profiled = all(t is not None for t in tables.values())
        self._latency_s[plan.name] = {s: (t if profiled and t is not None else (1.0,))
                                      for s, t in tables.items()}
        self._measured[plan.name] = profiled
        self._memo[plan.name].clear()

    @property
    def models(self) -> tuple[str, ...]:
        """The models some app's stage runs."""
        return tuple(self._apps_of)

    def learn(self, model: str, latency_s: Sequence[float]) -> None:
        """``model``'s l(1..max_batch) as its backends measured it (used from the next
        re-split on)."""
        if not latency_s or self._model_latency_s.get(model) == latency_s:
            return
        self._model_latency_s[model] = list(latency_s)
        for plan in self.plans.values():
            if any(plan.stages[s].model == model for s in plan.order):
                self._set_tables(plan)

    def start(self, now: float) -> None:
        """The first period of every app starts at ``now``."""
        self.started = True
        for name, plan in self.plans.items():
            self._since[name] = now
            self._due[name] = now + plan.config.resplit_every_s
        self.next_at = min(self._due.values(), default=math.inf)

    def note(self, model: str) -> None:
        """One request of ``model`` admitted at this frontend."""
        for counts in self._apps_of.get(model, ()):
            counts[model] += 1

    def on_timer(self, now: float) -> list[str]:
        """Re-split every app whose period has ended (from its period's rates); the apps whose
        weights were recomputed."""
        changed: list[str] = []
        for name, due in self._due.items():
            if due > now:
                continue
            if self._resplit(now, self.plans[name]):
                changed.append(name)
            self._since[name] = now
            self._due[name] = now + self.plans[name].config.resplit_every_s
        self.next_at = min(self._due.values(), default=math.inf)
        return changed

    def _resplit(self, now: float, plan: AppGraph) -> bool:
        counts = self._counts[plan.name]
        elapsed_s = now - self._since[plan.name]
        seen = dict(counts)
        for model in counts:
            counts[model] = 0
        if elapsed_s <= 0 or not all(seen.values()) or not self._measured[plan.name]:
            return False  # no profile, or some stage's model had no request: keep the split
        rates = {s: seen[plan.stages[s].model] / elapsed_s * self.frontends for s in plan.order}
        steps = tuple(round(math.log(rates[s], RATE_STEP)) for s in plan.order)
        memo = self._memo[plan.name]
        if steps not in memo:
            if len(memo) >= SPLIT_MEMO_MAX:
                memo.clear()
            memo[steps] = split_weights(
                plan, self._latency_s[plan.name],
                {s: RATE_STEP ** k for s, k in zip(plan.order, steps, strict=True)},
                self.overhead_s, self._delay_s[plan.name])
        weights, used = memo[steps]
        self.rates_rps[plan.name] = rates
        self.splitter_used[plan.name] = used
        self.weights[plan.name] = weights
        return True

    def budgets_ms(self, app: str) -> dict[str, float]:
        """Each stage's part of the time the stages use (the SLO less the overhead) on its
        heaviest path, in ms (the stats'; a stage's deadline adds the overhead to it)."""
        plan, weight = self.plans[app], self.weights[app]
        path = heaviest_paths(plan, weight)
        usable_ms = max(1e3 * (plan.stages_slo_s - self.overhead_s), 0.0)
        return {s: round(usable_ms * weight[s] / path[s], 3) for s in plan.order}


def heaviest_paths(plan: AppGraph, weight: Mapping[str, float]) -> dict[str, float]:
    """The heaviest sum of weights on a source-to-last-stage path through each stage."""
    down: dict[str, float] = {}
    for stage in reversed(plan.order):
        down[stage] = weight[stage] + max((down[d] for d in plan.next[stage]), default=0.0)
    up: dict[str, float] = {}
    for stage in plan.order:
        up[stage] = max((up[u] for u in plan.stages[stage].after), default=0.0) + weight[stage]
    return {s: up[s] + down[s] - weight[s] for s in plan.order}


def latency_tables_s(cluster: ClusterConfig, profiles: dict[str, LatencyProfile | None]
                     ) -> dict[str, list[float] | None]:
    """Each model's l(1..max_batch) in seconds where a profile is known (the apps' SLO
    split)."""
    out: dict[str, list[float] | None] = {}
    for model in cluster.models:
        profile = profiles.get(model.name) or configured_profile(model)
        out[model.name] = None if profile is None else profile.table_s[1:profile.max_batch + 1]
    return out


def scheduling_allowances_s(cluster: ClusterConfig) -> dict[str, tuple[float, float]]:
    """Each model's (``d_ctrl``, ``d_data``) in seconds: what the scheduler sets aside for a
    batch besides l(b) (the apps' SLO split counts it in a stage's budget)."""
    sched = cluster.scheduler
    return {m.name: (sched.d_ctrl_ms / 1e3,
                     (sched.d_data_ms if m.d_data_ms is None else m.d_data_ms) / 1e3)
            for m in cluster.models}


def stage_overhead_s(cluster: ClusterConfig) -> float:
    """What every stage's share adds to its part of the split (``AppDriver``): the reply
    allowance and the scheduler's jitter."""
    return (cluster.frontends.reply_allowance_ms + cluster.scheduler.jitter_ms) / 1e3


__all__ = ["NEXUS_SEGMENTS", "RATE_STEP", "SPLIT_FNS", "SPLIT_MEMO_MAX", "AppSplits", "SplitFn",
           "batch_cost", "candidate_batches", "harpagon_split", "heaviest_paths",
           "latency_tables_s", "nexus_split", "proportional_split", "scheduling_allowances_s",
           "share_spare", "split_weights", "stage_overhead_s", "with_allowances"]
