"""The throughput-cost (TC) batch dispatcher, and a per-stage discrete-event check of a plan.

Harpagon sends runs of ``batch`` consecutive requests to one machine, visiting groups in plan
order (highest throughput per price first, a partly loaded machine after the full ones of its
configuration). The paper gives no steady-state rule; this is the priority-stride realisation
of the research notes (section 2.3): each group is due a batch every ``batch / group rate``
seconds; a new batch goes to the highest-priority group that is due (else the one due first),
and round-robin among the machines inside the group. It meets Theorem 1 on the paper's toy
plans, but not on every heterogeneous plan (``zserve experiment harpagon`` counts the stages
it exceeds): a group can be handed a batch while its machine is still busy. Two machine-aware
variants tried did no better.

:func:`simulate_stage` plays deterministic arrivals at the plan's rate (dummy requests
included) through the dispatcher and machines that take ``duration_s`` per batch, and returns
the largest latency any request saw: Theorem 1's worst case should bound it (within the
quantisation of arrivals). It checks one stage at a time: the DAG's end-to-end figure is the
critical path of the stages' maxima, not a simulation of requests flowing through the DAG.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zserve.apps.configs import ModulePlan

SIMULATED_BATCHES_PER_GROUP = 60  # the check runs until the slowest group has had this many
SIMULATED_REQUESTS_MAX = 50_000  # ... or this many requests have arrived, if sooner


@dataclass
class _GroupState:
    batch: int
    duration_s: float
    period_s: float
    due_s: float = 0.0
    next_machine: int = 0
    machine_free_s: list[float] = field(default_factory=list)


class TcDispatcher:
    """Chooses the group (and machine) for each new batch of a module's plan."""

    def __init__(self, plan: ModulePlan) -> None:
        self.groups = [
            _GroupState(g.config.batch, g.config.duration_s, g.config.batch / g.rate_rps,
                        machine_free_s=[0.0] * g.count)
            for g in plan.groups if g.rate_rps > 0]

    def choose(self, now_s: float) -> tuple[int, int]:
        """(group, machine) for a batch opened at ``now_s``: the first group in plan order
        that is due (else the one due first), round-robin inside it; advances its due time."""
        due = [i for i, g in enumerate(self.groups) if g.due_s <= now_s + 1e-12]
        index = due[0] if due else min(range(len(self.groups)), key=lambda i: self.groups[i].due_s)
        group = self.groups[index]
        group.due_s += group.period_s
        machine = group.next_machine
        group.next_machine = (machine + 1) % len(group.machine_free_s)
        return index, machine


def simulate_stage(plan: ModulePlan, rate_rps: float) -> float:
    """Largest request latency (seconds) when requests arrive every ``1 / (rate + dummies)``
    seconds and are dispatched by :class:`TcDispatcher` to machines that run one batch at a
    time."""
    total_rps = rate_rps + plan.dummy_rps
    gap_s = 1.0 / total_rps
    dispatcher = TcDispatcher(plan)
    longest_period = max(g.config.batch / g.rate_rps for g in plan.groups if g.rate_rps > 0)
    horizon_s = min(SIMULATED_BATCHES_PER_GROUP * longest_period,
                    SIMULATED_REQUESTS_MAX * gap_s)
    arrival = 0  # index of the next request
    worst_s = 0.0
    while arrival * gap_s < horizon_s:
        opened_s = arrival * gap_s
        index, machine = dispatcher.choose(opened_s)
        group = dispatcher.groups[index]
        full_s = (arrival + group.batch - 1) * gap_s  # the batch's last request arrives
        start_s = max(full_s, group.machine_free_s[machine])
        group.machine_free_s[machine] = start_s + group.duration_s
        worst_s = max(worst_s, start_s + group.duration_s - opened_s)
        arrival += group.batch
    return worst_s


__all__ = ["SIMULATED_BATCHES_PER_GROUP", "SIMULATED_REQUESTS_MAX", "TcDispatcher",
           "simulate_stage"]
