"""Module configurations, machine groups and plans, and the worst-case latency estimators.

A configuration is a batch size on a device kind: one batch takes ``duration_s``, so a machine
running it serves ``throughput_rps = batch / duration_s``, and the kind costs ``price`` an hour
per machine. A module's plan is an ordered list of groups: ``count`` machines of one
configuration, each loaded to ``load`` (1 for full machines; the last group may be one machine
with a fraction of its throughput). Cost is frame-rate proportional (Harpagon's cost model): a
machine loaded to 0.3 costs 0.3 of its price, and dummy requests are paid for.

Worst-case latency of a group is ``duration + batch / w``, where ``w`` is the rate at which its
next batch collects requests, and depends on how requests are dispatched:

- ``tc`` (Harpagon, Theorem 1): runs of ``batch`` consecutive requests go to the groups in plan
  order, so a group collects at the rate of itself and every group after it;
- ``dt`` (Scrooge-like): batches rotate among the machines of one configuration, which collect
  at their aggregate rate;
- ``rr`` (Nexus, Clipper, InferLine): requests go one by one round-robin and each machine
  collects its own batch at its own rate (``2 d`` when full).
- ``deferred`` (zserve's central scheduler, the live split of ``zserve.frontend.app_split``): as
  ``tc``, but a batch is sent when its last request has arrived, so its first request waits
  for ``batch - 1`` more (a batch of one runs at once): ``duration + (batch - 1) / w``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Dispatch = Literal["tc", "dt", "rr", "deferred"]
DISPATCHES: tuple[Dispatch, ...] = ("tc", "dt", "rr")  # the planners' (the papers')
EPSILON = 1e-9  # rates and machine counts closer than this are equal (4.999999 machines is 5)


@dataclass(frozen=True)
class Config:
    """A batch size on a device kind: ``duration_s`` per batch, ``price`` per machine-hour."""

    kind: str
    batch: int
    duration_s: float
    price: float

    @property
    def throughput_rps(self) -> float:
        return self.batch / self.duration_s

    @property
    def ratio(self) -> float:
        """Throughput per unit price: Harpagon orders configurations by it, highest first."""
        return self.throughput_rps / self.price

    def single_wcl_s(self, rate_rps: float) -> float:
        """Worst-case latency when this configuration alone serves ``rate_rps`` under TC."""
        return self.duration_s + self.batch / rate_rps

    def cost(self, rate_rps: float) -> float:
        """Cost of serving ``rate_rps`` at this configuration (fractional machines)."""
        return self.price * rate_rps / self.throughput_rps


def linear_configs(kind: str, alpha_s: float, beta_s: float, price: float,
                   batches: Iterable[int]) -> list[Config]:
    """Configurations of a linear profile ``d(b) = alpha b + beta`` on one kind."""
    return [Config(kind, b, alpha_s * b + beta_s, price) for b in batches]


def by_ratio(configs: Iterable[Config]) -> list[Config]:
    """Highest throughput per price first (ties: the larger batch first)."""
    return sorted(configs, key=lambda c: (-c.ratio, -c.batch))


@dataclass(frozen=True)
class Group:
    """``count`` machines at ``config``, each loaded to ``load`` of its throughput."""

    config: Config
    count: int
    load: float = 1.0

    @property
    def rate_rps(self) -> float:
        return self.count * self.load * self.config.throughput_rps

    @property
    def machines(self) -> float:
        return self.count * self.load

    @property
    def cost(self) -> float:
        return self.machines * self.config.price


@dataclass(frozen=True)
class ModulePlan:
    """One module's groups in dispatch order, and the dummy rate added to its real rate."""

    groups: tuple[Group, ...]
    dummy_rps: float = 0.0

    @property
    def cost(self) -> float:
        return sum(g.cost for g in self.groups)

    @property
    def rate_rps(self) -> float:
        return sum(g.rate_rps for g in self.groups)

    def machines_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for g in self.groups:
            out[g.config.kind] = out.get(g.config.kind, 0.0) + g.machines
        return out

    def describe(self) -> str:
        """``4x b32@a100 + 0.3x b2@gtx1080ti`` (machines x batch @ kind)."""
        parts = [f"{g.machines:.3g}x b{g.config.batch}@{g.config.kind}" for g in self.groups]
        extra = f" (+{self.dummy_rps:.3g} dummy r/s)" if self.dummy_rps > EPSILON else ""
        return " + ".join(parts) + extra


def group_wcl_s(groups: Sequence[Group], index: int, dispatch: Dispatch) -> float:
    """Worst-case latency of ``groups[index]`` under ``dispatch`` (module docstring)."""
    group = groups[index]
    if dispatch in ("tc", "deferred"):
        collect_rps = sum(g.rate_rps for g in groups[index:])
    elif dispatch == "dt":
        collect_rps = sum(g.rate_rps for g in groups if g.config == group.config)
    else:
        collect_rps = group.load * group.config.throughput_rps
    if collect_rps <= EPSILON:
        return math.inf
    return group.config.duration_s + _waited_for(group.config.batch, dispatch) / collect_rps


def plan_wcl_s(groups: Sequence[Group], dispatch: Dispatch) -> float:
    """A module's worst-case latency: the largest of its groups'."""
    return max((group_wcl_s(groups, i, dispatch) for i in range(len(groups))), default=0.0)


def single_wcl_s(config: Config, rate_rps: float, dispatch: Dispatch) -> float:
    """A splitter's estimate: ``config`` alone serves ``rate_rps``. Under TC (and per-config
    dispatch, one group) the stream collects at ``rate_rps``; under RR each machine collects at
    its own rate, at most its throughput (``2 d`` once the module fills a machine)."""
    collect = rate_rps if dispatch != "rr" else min(rate_rps, config.throughput_rps)
    return config.duration_s + _waited_for(config.batch, dispatch) / collect


def _waited_for(batch: int, dispatch: Dispatch) -> int:
    """Requests a batch's first request waits for (module docstring)."""
    return batch - 1 if dispatch == "deferred" else batch


def full_and_partial(config: Config, rate_rps: float) -> list[Group]:
    """``rate_rps`` at one configuration: whole machines, then one partly loaded machine."""
    machines = rate_rps / config.throughput_rps
    full = math.floor(machines + EPSILON)
    groups = [Group(config, full)] if full else []
    rest = machines - full
    if rest > EPSILON:
        groups.append(Group(config, 1, rest))
    return groups


def machines_for(config: Config, rate_rps: float, dispatch: Dispatch) -> list[Group]:
    """``rate_rps`` on machines of one configuration as the dispatch spreads it: round-robin
    gives each of the ``ceil(rate / throughput)`` machines an equal share; batch dispatch fills
    whole machines and leaves one partly loaded (:func:`full_and_partial`)."""
    if dispatch != "rr":
        return full_and_partial(config, rate_rps)
    count = math.ceil(rate_rps / config.throughput_rps - EPSILON)
    return [Group(config, count, rate_rps / (count * config.throughput_rps))] if count else []


__all__ = ["DISPATCHES", "EPSILON", "Config", "Dispatch", "Group", "ModulePlan", "by_ratio",
           "full_and_partial", "group_wcl_s", "linear_configs", "machines_for", "plan_wcl_s",
           "single_wcl_s"]
