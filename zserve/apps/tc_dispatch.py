"""The throughput-cost (TC) batch dispatcher, and per-stage discrete-event runs of a plan.

Harpagon sends runs of ``batch`` consecutive requests to one machine, visiting groups in plan
order (highest throughput per price first, a partly loaded machine after the full ones of its
configuration). The paper gives no steady-state rule; this realisation keeps its priority
meaning, that a group collects from the stream the groups before it leave (Theorem 1's ``w``).
Each group is held to a *target* latency: the module's worst case (the stage's budget) when it
serves a stage, its own Theorem 1 bound when the theorem is checked; its *slack* is the target
less its own bound, how long its batch may lose to other groups:

- each group is due a batch every ``batch / group rate`` seconds (its stride); when it is due it
  opens a batch, which takes the next arrivals until full, round-robin over its machines;
- a group that falls due while a later group is collecting takes the stream over at once
  (preemption: the later group's batch resumes afterwards), unless the later run ends within
  the due group's slack (then the run finishes first);
- a later group that falls due while an earlier one collects takes over only if it cannot wait
  for the run within its own slack and the earlier batch's slack covers the interruption;
- an arrival no open batch wants opens the batch of the group due soonest.

Theorem 1's proof takes a group's ``w`` as "its equivalent batch collection rate": the group
collects from a steady stream at ``w``. :func:`simulate_group` checks exactly that: the groups
from one on, fed an evenly spaced stream at that group's ``w``, each held to its own bound; the
first of them has no slack, so nothing delays it, and it meets the bound to within one arrival.
:func:`simulate_stage` plays one evenly spaced stream at the plan's rate (dummy requests
included) through the whole plan, and :func:`simulate_stage_poisson` Poisson arrivals: there a
later group collects between the earlier groups' runs, a stream in lumps rather than the
theorem's steady one, and may exceed the bound (docs/performance.md, "Harpagon", works a case).
Machines take ``duration_s`` per batch and run one batch at a time. Each checks one stage: the
DAG's end-to-end figure is the critical path of the stages' figures, not a simulation of
requests flowing through it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

from zserve.apps.configs import ModulePlan, group_wcl_s

SIMULATED_BATCHES_PER_GROUP = 60  # the check runs until the slowest group has had this many
SIMULATED_REQUESTS_MAX = 50_000  # ... or this many requests have arrived, if sooner
DUE_EPSILON_S = 1e-12  # a due time this close to an arrival counts as reached
Target = Literal["module", "group"]  # what a group is held to: the module's bound, or its own


@dataclass
class _GroupState:
    batch: int
    duration_s: float
    period_s: float
    bound_s: float  # Theorem 1's worst case of this group: duration + batch / w
    target_s: float  # the latency its batches are held to: its bound, or the module's
    due_s: float = 0.0
    next_machine: int = 0
    machine_free_s: list[float] = field(default_factory=list)
    collected: int = 0  # requests in the open batch
    first_s: float | None = None  # arrival of the open batch's first request (None: closed)
    opened: bool = False
    interrupted_s: float = 0.0  # time other groups took the stream while this batch was open

    @property
    def slack_s(self) -> float:
        """How long its batch may lose to other groups: its target less its own bound."""
        return max(0.0, self.target_s - self.bound_s)


class TcDispatcher:
    """Decides which group's batch the next arrivals join (module docstring)."""

    def __init__(self, plan: ModulePlan, target: Target = "module") -> None:
        live = [g for g in plan.groups if g.rate_rps > 0]
        bounds = [group_wcl_s(live, i, "tc") for i in range(len(live))]
        self.groups = [
            _GroupState(g.config.batch, g.config.duration_s, g.config.batch / g.rate_rps,
                        bound, max(bounds) if target == "module" else bound,
                        machine_free_s=[0.0] * g.count)
            for g, bound in zip(live, bounds, strict=True)]
        self._active: int | None = None

    def _open(self, index: int) -> None:
        group = self.groups[index]
        group.opened = True
        group.due_s += group.period_s
        self._active = index

    def _takes_over(self, due: int, gap_s: float) -> bool:
        """Whether group ``due`` (due now) opens its batch while the active one collects: a
        group before it takes over unless the active run ends within the due group's slack; a
        group after it does when it cannot wait that long and the active batch's slack still
        covers the interruption."""
        active = self._active
        if active is None:
            return True
        run = self.groups[active]
        left_s = (run.batch - run.collected) * gap_s
        if left_s <= self.groups[due].slack_s:
            return False
        if due < active:
            return True
        return run.interrupted_s + self.groups[due].batch * gap_s <= run.slack_s

    def next_run(self, now_s: float, gap_s: float, most: int | None = None) -> tuple[int, int]:
        """(group, n): the next ``n`` arrivals (at most ``most``), the first at ``now_s`` and
        then about one every ``gap_s``, join that group's open batch (n stops at the batch's end
        or at the next due time of a group not collecting)."""
        for i, group in enumerate(self.groups):
            if not group.opened and group.due_s <= now_s + DUE_EPSILON_S \
                    and self._takes_over(i, gap_s):
                self._open(i)
        if self._active is None:
            self._open(min(range(len(self.groups)), key=lambda i: self.groups[i].due_s))
        index = self._active
        assert index is not None
        group = self.groups[index]
        count = group.batch - group.collected if most is None else most
        for other in self.groups:
            if not other.opened:
                count = min(count, max(1, math.ceil((other.due_s - now_s) / gap_s - 1e-9)))
        if group.first_s is None:
            group.first_s = now_s
        group.collected += count
        for other in self.groups:
            if other.opened and other is not group:
                other.interrupted_s += count * gap_s
        return index, count

    def close(self, index: int) -> tuple[int, float]:
        """The group's batch is full: (its machine, the first request's arrival); the stream
        goes back to the first group in plan order with an open batch."""
        group = self.groups[index]
        machine = group.next_machine
        group.next_machine = (machine + 1) % len(group.machine_free_s)
        first = group.first_s if group.first_s is not None else 0.0
        group.collected, group.first_s, group.opened = 0, None, False
        group.interrupted_s = 0.0
        self._active = next((i for i, g in enumerate(self.groups) if g.opened), None)
        return machine, first


def _horizon_requests(dispatcher: TcDispatcher, gap_s: float) -> int:
    longest_period = max(g.period_s for g in dispatcher.groups)
    return math.ceil(min(SIMULATED_BATCHES_PER_GROUP * longest_period / gap_s,
                         SIMULATED_REQUESTS_MAX))


def _batch_latencies(plan: ModulePlan, rate_rps: float, arrivals_s: list[float] | None = None,
                     target: Target = "module") -> list[list[float]]:
    """Per group (plan order, groups with a rate), each batch's largest latency (its first
    request's): ``rate_rps`` arrives evenly spaced, or at ``arrivals_s`` if given."""
    gap_s = 1.0 / rate_rps
    dispatcher = TcDispatcher(plan, target)
    total = len(arrivals_s) if arrivals_s is not None else _horizon_requests(dispatcher, gap_s)
    out: list[list[float]] = [[] for _ in dispatcher.groups]
    arrival = 0  # index of the next request
    while arrival < total:
        now_s = arrival * gap_s if arrivals_s is None else arrivals_s[arrival]
        index, count = dispatcher.next_run(now_s, gap_s, None if arrivals_s is None else 1)
        arrival += count
        group = dispatcher.groups[index]
        if group.collected < group.batch:
            continue
        machine, first_s = dispatcher.close(index)
        last_s = (arrival - 1) * gap_s if arrivals_s is None else arrivals_s[arrival - 1]
        start_s = max(last_s, group.machine_free_s[machine])
        group.machine_free_s[machine] = start_s + group.duration_s
        out[index].append(start_s + group.duration_s - first_s)
    return out


def simulate_stage(plan: ModulePlan, rate_rps: float) -> float:
    """Largest request latency (seconds) when requests arrive every ``1 / (rate + dummies)``
    seconds through the whole plan."""
    latencies = _batch_latencies(plan, rate_rps + plan.dummy_rps)
    return max((max(g, default=0.0) for g in latencies), default=0.0)


def simulate_group(plan: ModulePlan, index: int, target: Target = "group") -> float:
    """Theorem 1's case for ``plan.groups[index]``: it and the groups after it fed an evenly
    spaced stream at its ``w`` (their rates, dummies included), each held to ``target``; its
    largest latency."""
    rest = ModulePlan(tuple(g for g in plan.groups[index:] if g.rate_rps > 0))
    return max(_batch_latencies(rest, rest.rate_rps, target=target)[0], default=0.0)


def simulate_stage_poisson(plan: ModulePlan, rate_rps: float, seed: int) -> list[float]:
    """Each batch's largest latency (seconds, all groups) when ``rate + dummies`` arrive as a
    Poisson stream (seeded), as many requests as the evenly spaced check plays."""
    stream_rps = rate_rps + plan.dummy_rps
    rng = random.Random(seed)
    count = _horizon_requests(TcDispatcher(plan), 1.0 / stream_rps)
    arrivals_s, now_s = [], 0.0
    for _ in range(count):
        arrivals_s.append(now_s)
        now_s += rng.expovariate(stream_rps)
    return [x for g in _batch_latencies(plan, stream_rps, arrivals_s) for x in g]


__all__ = ["SIMULATED_BATCHES_PER_GROUP", "SIMULATED_REQUESTS_MAX", "Target", "TcDispatcher",
           "simulate_group", "simulate_stage", "simulate_stage_poisson"]
