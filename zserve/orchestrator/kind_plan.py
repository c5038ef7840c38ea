"""Which device kind each model runs on, priced as a fleet pays for it: whole GPUs per kind.

Each model's load on each kind is an estimate in fractional GPUs
(:func:`zserve.orchestrator.placement.gpus_for_rate`); the models sent to one kind share that
kind's pool, which costs ``ceil(sum of their loads)`` GPUs at the kind's price. Choosing each
model's kind alone (:func:`zserve.orchestrator.placement.cheapest_kind`) ignores that rounding:
a few models sent to a dear kind open a pool whose last GPU is mostly idle, and the mix can cost
more than one kind alone. :func:`plan_kinds` plans the fleet instead:

- it prices an assignment at whole GPUs per pool (:func:`price_plan`), the fractional cost
  breaking ties (at equal whole-GPU cost, the plan that leaves more paid headroom: the estimate
  understates small pools, which multiplex poorly);
- from each start (every model on its own cheapest kind, and every model on one kind, for each
  kind that meets every SLO) a greedy local search moves one model at a time to another kind,
  taking the move that lowers that price most, until no move does (:func:`improve`);
- it returns the distinct plans found, the all-one-kind ones among them unimproved, cheapest
  first: a floor the search beats or equals, and a short list a simulator can validate.

Pure: numbers in, plans out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

WHOLE_GPU_SLACK = 1e-9  # a pool's summed load within this of an integer rounds down to it
COST_EPSILON = 1e-9  # $/h: a move must lower the price by more than this to be taken


@dataclass(frozen=True)
class KindPlan:
    """Each model's kind (``kind_of``), each kind's pool in whole GPUs (``pool_gpus``, kinds
    with no model left out), its price an hour at whole GPUs (``cost_per_hour``) and at the
    pools' fractional loads (``load_cost_per_hour``)."""

    kind_of: Mapping[str, str]
    pool_gpus: Mapping[str, int]
    cost_per_hour: float
    load_cost_per_hour: float

    def pools(self) -> dict[str, list[str]]:
        """kind -> its models, in ``kind_of``'s order."""
        pools: dict[str, list[str]] = {}
        for model, kind in self.kind_of.items():
            pools.setdefault(kind, []).append(model)
        return pools

    def is_mixed(self) -> bool:
        return len(self.pool_gpus) > 1

    def key(self) -> tuple[float, float]:
        """Cheaper first: whole-GPU cost, then the fractional one."""
        return self.cost_per_hour, self.load_cost_per_hour


def whole_gpus(load_gpus: float) -> int:
    """The GPUs a pool of ``load_gpus`` summed load pays for."""
    return max(0, math.ceil(load_gpus - WHOLE_GPU_SLACK))


def price_plan(kind_of: Mapping[str, str], gpus_by_kind: Mapping[str, Mapping[str, float]],
               price_per_hour: Mapping[str, float]) -> KindPlan:
    """``kind_of`` priced at whole GPUs per pool (``inf`` when a model is on a kind that
    cannot meet its SLO: an infinite load)."""
    load: dict[str, float] = {}
    for model, kind in kind_of.items():
        load[kind] = load.get(kind, 0.0) + gpus_by_kind[model][kind]
    pool_gpus = {k: whole_gpus(g) if math.isfinite(g) else 0 for k, g in load.items()}
    if not all(math.isfinite(g) for g in load.values()):
        return KindPlan(dict(kind_of), pool_gpus, math.inf, math.inf)
    return KindPlan(dict(kind_of), pool_gpus,
                    sum(price_per_hour[k] * n for k, n in pool_gpus.items()),
                    sum(price_per_hour[k] * g for k, g in load.items()))


def per_model_choice(gpus_by_kind: Mapping[str, Mapping[str, float]],
                     price_per_hour: Mapping[str, float]) -> dict[str, str]:
    """Each model on the kind where its own load costs least (fractional GPUs, a tie to the
    kind listed first), the choice that ignores whole GPUs; a model no kind serves raises
    ValueError."""
    choice: dict[str, str] = {}
    for model, loads in gpus_by_kind.items():
        costs = {k: g * price_per_hour[k] for k, g in loads.items() if math.isfinite(g)}
        if not costs:
            raise ValueError(f"model {model!r} meets its SLO on no device kind")
        choice[model] = min(costs, key=lambda k: costs[k])
    return choice


def single_kind_plans(gpus_by_kind: Mapping[str, Mapping[str, float]],
                      price_per_hour: Mapping[str, float]) -> list[KindPlan]:
    """Every model on one kind, for each kind that meets every model's SLO."""
    kinds = list(price_per_hour)
    plans = [price_plan({m: kind for m in gpus_by_kind}, gpus_by_kind, price_per_hour)
             for kind in kinds]
    return [p for p in plans if math.isfinite(p.cost_per_hour)]


def improve(plan: KindPlan, gpus_by_kind: Mapping[str, Mapping[str, float]],
            price_per_hour: Mapping[str, float]) -> KindPlan:
    """Greedy local search from ``plan``: repeatedly move the one model to the one other kind
    that lowers the plan's price (:meth:`KindPlan.key`) most, until no move lowers it. Each
    move lowers the key, so it ends (within models x kinds moves a step)."""
    current = plan
    while True:
        best = current
        for model, kind in current.kind_of.items():
            for other, load in gpus_by_kind[model].items():
                if other == kind or not math.isfinite(load):
                    continue
                moved = price_plan({**current.kind_of, model: other}, gpus_by_kind,
                                   price_per_hour)
                if _lower(moved.key(), best.key()):
                    best = moved
        if best is current:
            return current
        current = best


def plan_kinds(gpus_by_kind: Mapping[str, Mapping[str, float]],
               price_per_hour: Mapping[str, float]) -> list[KindPlan]:
    """The distinct plans the search finds (module docstring), cheapest first: each start's
    local optimum, and the all-one-kind plans as they are (the floor the search beats or
    equals). ``gpus_by_kind``: model -> kind -> its load in GPUs there (``inf``: the kind
    misses its SLO); every kind must have a price."""
    singles = single_kind_plans(gpus_by_kind, price_per_hour)
    starts = [price_plan(per_model_choice(gpus_by_kind, price_per_hour), gpus_by_kind,
                         price_per_hour), *singles]
    found = [*singles, *(improve(s, gpus_by_kind, price_per_hour) for s in starts)]
    distinct: dict[tuple[tuple[str, str], ...], KindPlan] = {}
    for p in found:
        distinct.setdefault(tuple(sorted(p.kind_of.items())), p)
    return sorted(distinct.values(), key=KindPlan.key)


def _lower(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether price key ``a`` is below ``b`` by more than rounding noise."""
    if a[0] < b[0] - COST_EPSILON:
        return True
    return abs(a[0] - b[0]) <= COST_EPSILON and a[1] < b[1] - COST_EPSILON
