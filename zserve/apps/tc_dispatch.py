"""The throughput-cost (TC) batch dispatcher, and a per-stage discrete-event check of a plan.

Harpagon sends runs of ``batch`` consecutive requests to one machine, visiting groups in plan
order (highest throughput per price first, a partly loaded machine after the full ones of its
configuration). The paper gives no steady-state rule; this realisation keeps its priority
meaning, that a group collects from the stream the groups before it leave (Theorem 1's ``w``):

- each group is due a batch every ``batch / group rate`` seconds (its stride); when it is due it
  opens a batch, which takes the next arrivals until full, round-robin over its machines;
- a group that falls due while a later group is collecting takes the stream over at once
  (preemption: the later group's batch resumes afterwards), unless the later run ends within
  the due group's slack, its module worst case less its own (then the run finishes first);
- a later group that falls due while an earlier one collects takes over only if it cannot wait
  for the run within its own slack and the earlier batch's slack covers the interruption;
- an arrival no open batch wants opens the batch of the group due soonest.

Without preemption (the research notes' first realisation: a run of ``batch`` consecutive
requests, never interrupted) a full machine's batch waits behind a lower group's run; a full
machine has no idle time to catch that up, so it exceeded Theorem 1 on 7% of the generated
stages (2% now). Lower groups still see the stream in lumps (a higher group's run at a time),
which Theorem 1's fluid ``w`` does not model; behind a group with no slack no dispatcher can meet
the bound there (docs/performance.md, "Harpagon", works one case).

:func:`simulate_stage` plays deterministic arrivals at the plan's rate (dummy requests
included) through the dispatcher and machines that take ``duration_s`` per batch, and returns
the largest latency any request saw. It checks one stage at a time: the DAG's end-to-end figure
is the critical path of the stages' maxima, not a simulation of requests flowing through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zserve.apps.configs import ModulePlan, group_wcl_s, plan_wcl_s

SIMULATED_BATCHES_PER_GROUP = 60  # the check runs until the slowest group has had this many
SIMULATED_REQUESTS_MAX = 50_000  # ... or this many requests have arrived, if sooner
DUE_EPSILON_S = 1e-12  # a due time this close to an arrival counts as reached


@dataclass
class _GroupState:
    batch: int
    duration_s: float
    period_s: float
    slack_s: float  # module worst case less this group's: how long it may wait for a run
    due_s: float = 0.0
    next_machine: int = 0
    machine_free_s: list[float] = field(default_factory=list)
    collected: int = 0  # requests in the open batch
    first_s: float | None = None  # arrival of the open batch's first request (None: closed)
    opened: bool = False
    interrupted_s: float = 0.0  # time other groups took the stream while this batch was open


class TcDispatcher:
    """Decides which group's batch the next arrivals join (module docstring)."""

    def __init__(self, plan: ModulePlan) -> None:
        module_s = plan_wcl_s(plan.groups, "tc")
        self.groups = [
            _GroupState(g.config.batch, g.config.duration_s, g.config.batch / g.rate_rps,
                        module_s - group_wcl_s(plan.groups, i, "tc"),
                        machine_free_s=[0.0] * g.count)
            for i, g in enumerate(plan.groups) if g.rate_rps > 0]
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

    def next_run(self, now_s: float, gap_s: float) -> tuple[int, int]:
        """(group, n): the next ``n`` arrivals, the first at ``now_s`` and then one every
        ``gap_s``, join that group's open batch (n stops at the batch's end or at the next
        due time of a group not collecting)."""
        for i, group in enumerate(self.groups):
            if not group.opened and group.due_s <= now_s + DUE_EPSILON_S \
                    and self._takes_over(i, gap_s):
                self._open(i)
        if self._active is None:
            self._open(min(range(len(self.groups)), key=lambda i: self.groups[i].due_s))
        index = self._active
        assert index is not None
        group = self.groups[index]
        count = group.batch - group.collected
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


def simulate_stage(plan: ModulePlan, rate_rps: float) -> float:
    """Largest request latency (seconds) when requests arrive every ``1 / (rate + dummies)``
    seconds and are dispatched by :class:`TcDispatcher` to machines that run one batch at a
    time."""
    gap_s = 1.0 / (rate_rps + plan.dummy_rps)
    dispatcher = TcDispatcher(plan)
    longest_period = max(g.period_s for g in dispatcher.groups)
    horizon_s = min(SIMULATED_BATCHES_PER_GROUP * longest_period,
                    SIMULATED_REQUESTS_MAX * gap_s)
    arrival = 0  # index of the next request
    worst_s = 0.0
    while arrival * gap_s < horizon_s:
        index, count = dispatcher.next_run(arrival * gap_s, gap_s)
        arrival += count
        group = dispatcher.groups[index]
        if group.collected < group.batch:
            continue
        machine, first_s = dispatcher.close(index)
        start_s = max((arrival - 1) * gap_s, group.machine_free_s[machine])
        group.machine_free_s[machine] = start_s + group.duration_s
        worst_s = max(worst_s, start_s + group.duration_s - first_s)
    return worst_s


__all__ = ["SIMULATED_BATCHES_PER_GROUP", "SIMULATED_REQUESTS_MAX", "TcDispatcher",
           "simulate_stage"]
