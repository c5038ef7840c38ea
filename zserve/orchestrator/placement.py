"""Memory-aware placement: which GPUs hold which models, so that every model has enough GPUs for
its load and no GPU's memory is overcommitted (its models' weights plus the largest activations
among them, :func:`zserve.orchestrator.memory.placement_bytes`).

Three ways to place, each returning a :class:`Placement` (device name -> the models it holds):

- :func:`partitioned_placement`: Symphony's sub-clusters. The partitioner
  (:func:`zserve.orchestrator.partition.plan`) splits the models into groups whose GPU loads and
  weights balance, with the device budget as its memory cap; each group gets an equal share of
  the GPUs (a rank schedules a fixed set of backends; optionally a share in proportion to its
  load), and every GPU of a group holds all of the group's models.
- :func:`random_placement`: the same, from A.2's random search (the best random assignment by the
  partitioner's objective within a time budget).
- :func:`round_robin_placement`: load-blind. Each GPU in turn takes ``per_device`` models, the
  least replicated so far first, so each model lands on about the same number of GPUs.

:func:`check_placement` refuses a placement before anything loads: a GPU over its budget is
memory's one-line :func:`~zserve.orchestrator.memory.overcommit_error`, a model on no GPU or a GPU
of unknown name one line too (:class:`PlacementError`).

With several device kinds, :func:`cheapest_kind` picks each model's kind: the cheapest an hour
among those that meet its SLO. A model's load is in GPUs (:func:`gpus_for_rate`: the GPUs its
rate keeps busy at the batch size its SLO allows at that rate). It is a sizing estimate for
shares, not a goodput: the scheduler batches across the GPUs a model shares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from zserve.config.profiles import DEFAULT_MAX_BATCH
from zserve.orchestrator.memory import ModelMemory, overcommit_error
from zserve.orchestrator.partition import PartitionProblem, plan, random_search

MS_PER_S = 1e3


class PlacementError(ValueError):
    """A placement that cannot be made or kept (one line: which device or model, and why)."""


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """A model to place: its memory and its load, in GPUs of the kind being placed on."""

    memory: ModelMemory
    load_gpus: float

    @property
    def name(self) -> str:
        return self.memory.name


@dataclass(frozen=True, slots=True)
class Device:
    """A GPU to place on: its name (a backend's, or ``gpu-N``) and its memory budget."""

    name: str
    budget_bytes: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Each device's models (in placement order); a device with none holds nothing."""

    models_on: Mapping[str, tuple[str, ...]]

    def devices_of(self, model: str) -> list[str]:
        return [d for d, models in self.models_on.items() if model in models]

    def replicas(self) -> dict[str, int]:
        """How many devices hold each placed model."""
        count: dict[str, int] = {}
        for models in self.models_on.values():
            for m in models:
                count[m] = count.get(m, 0) + 1
        return count

    def gpu_ids(self, devices: Sequence[Device]) -> dict[str, list[int]]:
        """Each model's devices as indexes into ``devices`` (the simulator's GPU ids)."""
        index = {d.name: i for i, d in enumerate(devices)}
        out: dict[str, list[int]] = {}
        for name, models in self.models_on.items():
            for m in models:
                out.setdefault(m, []).append(index[name])
        return out


def gpus_for_rate(alpha_ms: float, beta_ms: float, slo_ms: float, rate_rps: float,
                  max_batch: int = DEFAULT_MAX_BATCH) -> float:
    """GPUs a model's rate keeps busy on a device kind with profile l(b) = alpha b + beta: at
    the largest batch b with l(b) + b / rate <= SLO (gathered at the rate, then run: the
    scheduler's target batch size, zserve.scheduler.policy), at least 1, rate l(b) / b.
    ``inf`` when l(1) > SLO: the kind cannot meet the SLO at all."""
    return _busy_gpus(alpha_ms, beta_ms, slo_ms, rate_rps, max_batch, gathered=0)


def busy_gpus_floor(alpha_ms: float, beta_ms: float, slo_ms: float, rate_rps: float,
                    max_batch: int = DEFAULT_MAX_BATCH) -> float:
    """A floor on the GPUs a model's rate keeps busy on a device kind, whatever the placement
    or packing: every batch at the largest b with l(b) + (b - 1) / rate <= SLO (the batch's
    first request waits, on average, for the b - 1 after it at the model's whole rate, then
    the batch runs), rate l(b) / b. l(b) / b falls with b, so no batch the rate fills in time
    costs less per request; splitting a model's rate over kinds only shrinks its batches.
    (Poisson bursts fill a larger batch now and then: a floor for the mean, not for luck.)"""
    return _busy_gpus(alpha_ms, beta_ms, slo_ms, rate_rps, max_batch, gathered=-1)


def _busy_gpus(alpha_ms: float, beta_ms: float, slo_ms: float, rate_rps: float,
               max_batch: int, *, gathered: int) -> float:
    """rate l(b) / b at the largest b <= ``max_batch`` with l(b) + (b + ``gathered``) / rate
    <= SLO (b >= 1); ``inf`` when l(1) > SLO."""
    if alpha_ms + beta_ms > slo_ms:
        return math.inf
    if rate_rps <= 0:
        return 0.0
    per_request_ms = MS_PER_S / rate_rps
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if alpha_ms * mid + beta_ms + (mid + gathered) * per_request_ms <= slo_ms:
            lo = mid
        else:
            hi = mid - 1
    return rate_rps * (alpha_ms * lo + beta_ms) / lo / MS_PER_S


def load_imbalance(placement: Placement, demands: Sequence[ModelDemand]) -> float:
    """(max - min) / mean of the devices' loads, each model's load split evenly over the
    devices that hold it: 0 when every device carries the same."""
    load = {d.name: d.load_gpus for d in demands}
    replicas = placement.replicas()
    per_device = [sum(load[m] / replicas[m] for m in models)
                  for models in placement.models_on.values()]
    mean = sum(per_device) / len(per_device)
    return (max(per_device) - min(per_device)) / mean if mean > 0 else 0.0


def cheapest_kind(gpus_by_kind: Mapping[str, float],
                  price_per_hour: Mapping[str, float]) -> str | None:
    """The device kind on which a model's load costs least an hour (its GPUs there, from
    :func:`gpus_for_rate`, times the kind's price), among the kinds that meet its SLO (finite
    GPUs); None when none does. A tie goes to the kind listed first."""
    best: str | None = None
    best_cost = math.inf
    for kind, gpus in gpus_by_kind.items():
        cost = gpus * price_per_hour[kind]
        if math.isfinite(cost) and cost < best_cost:
            best, best_cost = kind, cost
    return best


def check_placement(placement: Placement, demands: Sequence[ModelDemand],
                    devices: Sequence[Device]) -> None:
    """Raise :class:`PlacementError` (one line) if a device is unknown or overcommitted, or a
    model is unknown or on no device."""
    budget = {d.name: d.budget_bytes for d in devices}
    memory = {m.name: m.memory for m in demands}
    for device, models in placement.models_on.items():
        if device not in budget:
            raise PlacementError(f"placement names device {device!r}, which is not one of the "
                                 f"{len(devices)} devices")
        unknown = [m for m in models if m not in memory]
        if unknown:
            raise PlacementError(f"device {device} holds unknown model {unknown[0]!r}")
        error = overcommit_error(device, budget[device], [memory[m] for m in models])
        if error is not None:
            raise PlacementError(error)
    placed = placement.replicas()
    missing = [m.name for m in demands if m.name not in placed]
    if missing:
        raise PlacementError(f"model {missing[0]} is on no device ({len(missing)} models "
                             "unplaced); add devices or memory")


def share_devices(loads: Sequence[float], devices: int) -> list[int]:
    """``devices`` shared out in proportion to ``loads``, at least one each (largest
    remainders); a one-line error when there are fewer devices than loads."""
    groups = len(loads)
    if devices < groups:
        raise PlacementError(f"{groups} sub-clusters need at least {groups} devices, "
                             f"got {devices}")
    total = sum(loads)
    exact = [devices * load / total if total > 0 else devices / groups for load in loads]
    shares = [max(1, math.floor(e)) for e in exact]
    while sum(shares) > devices:  # the minimum of one each overshot: take from the largest
        above_one = [j for j in range(groups) if shares[j] > 1]
        shares[max(above_one, key=lambda j: shares[j] - exact[j])] -= 1
    order = sorted(range(groups), key=lambda j: exact[j] - shares[j], reverse=True)
    for j in order[: devices - sum(shares)]:
        shares[j] += 1
    return shares


def grouped_placement(demands: Sequence[ModelDemand], devices: Sequence[Device],
                      assignment: Sequence[int], groups: int, *,
                      proportional: bool = False) -> Placement:
    """Sub-cluster ``j`` (``assignment[i]`` is model i's) gets an equal share of ``devices``
    (``proportional``: a share in proportion to its load), and each of its devices holds all
    of its models."""
    loads = [1.0] * groups
    if proportional:
        loads = [0.0] * groups
        for demand, group in zip(demands, assignment, strict=True):
            loads[group] += demand.load_gpus
    shares = share_devices(loads, len(devices))
    models_on: dict[str, tuple[str, ...]] = {}
    start = 0
    for j, share in enumerate(shares):
        held = tuple(d.name for d, g in zip(demands, assignment, strict=True) if g == j)
        for device in devices[start:start + share]:
            models_on[device.name] = held
        start += share
    placement = Placement(models_on)
    check_placement(placement, demands, devices)
    return placement


def partition_problem(demands: Sequence[ModelDemand], devices: Sequence[Device],
                      groups: int) -> PartitionProblem:
    """The partitioner's problem: loads in GPUs as its rates, the smallest device budget as its
    memory cap (every device of a sub-cluster holds all of its models)."""
    return PartitionProblem(
        rates_rps=np.array([d.load_gpus for d in demands], dtype=np.float64),
        static_bytes=np.array([d.memory.static_bytes for d in demands], dtype=np.float64),
        dynamic_bytes=np.array([d.memory.dynamic_bytes for d in demands], dtype=np.float64),
        groups=groups, memory_cap_bytes=float(min(d.budget_bytes for d in devices)))


def partitioned_placement(demands: Sequence[ModelDemand], devices: Sequence[Device],
                          groups: int, time_limit_s: float, *,
                          proportional: bool = False) -> Placement:
    """Symphony's sub-clusters: the partitioner's plan, each group on its share of devices
    (``grouped_placement``)."""
    problem = partition_problem(demands, devices, groups)
    result = plan(problem, time_limit_s)
    if result.violations:
        raise PlacementError(f"no partition into {groups} sub-clusters fits: "
                             f"{result.violations[0]}")
    return grouped_placement(demands, devices, result.assignment.tolist(), groups,
                             proportional=proportional)


def random_placement(demands: Sequence[ModelDemand], devices: Sequence[Device],
                     groups: int, rng: np.random.Generator, should_stop: Callable[[], bool], *,
                     proportional: bool = False) -> Placement:
    """A.2's baseline: the best random sub-cluster assignment found until ``should_stop()``."""
    problem = partition_problem(demands, devices, groups)
    best, _, tried = random_search(problem, rng, should_stop)
    if best is None:
        raise PlacementError(f"random search found no partition into {groups} sub-clusters "
                             f"that fits in {tried} tries")
    return grouped_placement(demands, devices, best.tolist(), groups,
                             proportional=proportional)


def round_robin_placement(demands: Sequence[ModelDemand], devices: Sequence[Device],
                          per_device: int) -> Placement:
    """Load-blind: each device in turn takes ``per_device`` models, those with the fewest
    replicas so far first (ties in a ring that starts after the previous device's last), and
    skips any that would overcommit it, so the replicas stay even."""
    if per_device < 1:
        raise PlacementError(f"per_device must be at least 1, got {per_device}")
    n = len(demands)
    replicas = [0] * n
    models_on: dict[str, tuple[str, ...]] = {}
    cursor = 0
    for device in devices:
        order = sorted(range(n), key=lambda i: (replicas[i], (i - cursor) % n))
        held: list[int] = []
        for i in order:
            if len(held) == min(per_device, n):
                break
            memories = [demands[j].memory for j in (*held, i)]
            if overcommit_error(device.name, device.budget_bytes, memories) is None:
                held.append(i)
        for i in held:
            replicas[i] += 1
        cursor = (held[-1] + 1) % n if held else cursor
        models_on[device.name] = tuple(demands[i].name for i in held)
    placement = Placement(models_on)
    check_placement(placement, demands, devices)
    return placement


__all__ = [
    "Device",
    "ModelDemand",
    "Placement",
    "PlacementError",
    "busy_gpus_floor",
    "cheapest_kind",
    "check_placement",
    "gpus_for_rate",
    "grouped_placement",
    "load_imbalance",
    "partition_problem",
    "partitioned_placement",
    "random_placement",
    "round_robin_placement",
    "share_devices",
]
