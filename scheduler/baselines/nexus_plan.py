"""Nexus's planner (SOSP 2019, section 4.1, as its public code runs it): squishy bin packing of
model sessions onto GPUs from their profiles, rates and SLOs, and the epoch controller that
re-plans from measured rates.

Code mode (uwsampl/nexus ``BackendDelegate``, ``Scheduler::AllocateUnassignedWorkloads``):

- a session's largest batch B is the largest b with l(b) <= (SLO - NETWORK_RESERVE_S) / 2 (a
  request that just missed a batch rides the next one: worst case 2 l(B));
- floor(R / T) GPUs run it alone at batch B (T = B / l(B), its saturated throughput);
- the residual rate r runs at the largest b <= B with (b - 1)/r + l(b) <= budget, with duty
  cycle min(budget - l(b), b / r); residuals go, by descending rate, to the shared GPU whose
  occupancy after the merge is highest (best fit), or to a new GPU. A merge is valid when, at
  the node's duty cycle d (the smallest of its sessions'), every session's batch ceil(d r) stays
  within its B and the batches' sum of l(b) fits in d.
- Memory is not checked (as in the code). When the GPUs run out, the rest of a session's rate is
  ``unassigned``: its frontends still route it over the session's GPUs by their weights.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from zserve.config.profiles import LatencyProfile

__all__ = [
    "EPOCH_MIN_GAP_S",
    "EPOCH_PERIOD_S",
    "NETWORK_RESERVE_S",
    "GpuPlan",
    "NexusEpochs",
    "NexusPlan",
    "Session",
    "Slot",
    "plan_filling",
    "plan_sessions",
    "residual_batch",
    "saturated_batch",
]

NETWORK_RESERVE_S = 0.002
"""Nexus's ``network_latency_us_``: taken off every SLO before planning."""
BATCH_CEIL_EPS = 1e-3  # BatchSizeCeilEps: d*r within this of an integer rounds down
EPOCH_PERIOD_S = 30.0
EPOCH_MIN_GAP_S = 10.0
BEACON_S = 1.0
HISTORY_SAMPLES = 30  # (3 * avg_interval + beacon - 1) / beacon: no re-plan before these
EWMA_WEIGHT = 1.0 - math.exp(-BEACON_S / 10.0)  # EWMA(1 s, avg_interval 10 s)
TRIGGER_LOW, TRIGGER_HIGH = 0.8, 1.1  # estimate outside [low, high] x allocated: re-plan
MIN_ESTIMATE_RPS = 0.1


@dataclass(frozen=True)
class Session:
    """A model at one SLO, with the rate to plan for."""

    name: str
    profile: LatencyProfile
    slo_s: float
    rate_rps: float
    reserve_s: float = NETWORK_RESERVE_S  # 0: the paper's worked example

    @property
    def budget_s(self) -> float:
        return self.slo_s - self.reserve_s


@dataclass(frozen=True)
class Slot:
    """A session on one GPU: its assigned batch and the throughput routed to it (the
    frontends' weight)."""

    name: str
    batch: int
    rate_rps: float


@dataclass
class GpuPlan:
    """One GPU's sessions, run round-robin in this order, and its duty cycle."""

    slots: list[Slot]
    duty_cycle_s: float

    def occupancy(self, profiles: Mapping[str, LatencyProfile]) -> float:
        used = sum(profiles[s.name].latency(s.batch) for s in self.slots)
        return used / self.duty_cycle_s if self.duty_cycle_s > 0 else 0.0


@dataclass
class NexusPlan:
    """The GPUs' plans (a GPU without one is idle) and each session's unplaced rate."""

    gpus: list[GpuPlan]
    unassigned_rps: dict[str, float] = field(default_factory=dict)

    def allocated_rps(self, name: str) -> float:
        return sum(s.rate_rps for g in self.gpus for s in g.slots if s.name == name)


def saturated_batch(profile: LatencyProfile, budget_s: float) -> int:
    """B: the largest b with l(b) <= budget / 2, at least 1 (``GetMaxBatch``)."""
    return max(1, profile.largest_batch_within(budget_s / 2))


def residual_batch(profile: LatencyProfile, budget_s: float, rate_rps: float, cap: int) -> int:
    """The largest b <= cap with (b - 1)/rate + l(b) <= budget, or 0 if not even b = 1."""
    for b in range(cap, 0, -1):
        if (b - 1) / rate_rps + profile.latency(b) <= budget_s:
            return b
    return 0


@dataclass
class _Residual:
    session: Session
    rate_rps: float
    cap: int  # B
    max_duty_s: float


def _ceil_eps(value: float) -> int:
    floor = math.floor(value)
    return floor if value - floor <= BATCH_CEIL_EPS else floor + 1


def _cycle(members: Sequence[_Residual]) -> GpuPlan | None:
    """The node of ``members`` at the smallest duty cycle, or None when it is overloaded."""
    duty = min(m.max_duty_s for m in members)
    slots, used = [], 0.0
    for m in members:
        batch = max(1, _ceil_eps(duty * m.rate_rps))
        if batch > m.cap:
            return None
        used += m.session.profile.latency(batch)
        slots.append(Slot(m.session.name, batch, m.rate_rps))
    return GpuPlan(slots, duty) if used <= duty else None


def _residual(session: Session, rate: float, cap: int) -> _Residual | None:
    batch = residual_batch(session.profile, session.budget_s, rate, cap)
    if batch == 0:
        return None
    duty = min(session.budget_s - session.profile.latency(batch), batch / rate)
    res = _Residual(session, rate, cap, duty)
    return res if _cycle([res]) is not None else None


def plan_sessions(sessions: Sequence[Session], gpus: int) -> NexusPlan:
    """Squishy bin packing of ``sessions`` onto at most ``gpus`` GPUs (code mode, above)."""
    plan = NexusPlan([])
    residuals: list[_Residual] = []
    for s in sorted(sessions, key=lambda s: -s.rate_rps):
        cap = saturated_batch(s.profile, s.budget_s)
        throughput = cap / s.profile.latency(cap)
        whole = min(int(s.rate_rps // throughput), gpus - len(plan.gpus))
        plan.gpus += [GpuPlan([Slot(s.name, cap, throughput)], s.profile.latency(cap))
                      for _ in range(whole)]
        rest = s.rate_rps - whole * throughput
        if rest <= 1e-9:
            continue
        res = _residual(s, rest, cap)
        if res is None:  # no batch fits a GPU of its own at this rate (GPUs ran out)
            plan.unassigned_rps[s.name] = rest
        else:
            residuals.append(res)
    _pack_residuals(plan, residuals, gpus)
    return plan


def _pack_residuals(plan: NexusPlan, residuals: list[_Residual], gpus: int) -> None:
    """Best fit by descending rate: the shared node with the highest occupancy after the
    merge, else a new GPU, else unassigned."""
    profiles = {r.session.name: r.session.profile for r in residuals}
    nodes: list[list[_Residual]] = []
    built: list[GpuPlan] = []
    free = gpus - len(plan.gpus)
    for res in sorted(residuals, key=lambda r: -r.rate_rps):
        best, best_occ = -1, -1.0
        for i, members in enumerate(nodes):
            merged = _cycle([*members, res])
            if merged is not None and merged.occupancy(profiles) > best_occ:
                best, best_occ = i, merged.occupancy(profiles)
        if best >= 0:
            nodes[best].append(res)
            merged = _cycle(nodes[best])
            assert merged is not None
            built[best] = merged
        elif len(nodes) < free:
            nodes.append([res])
            alone = _cycle([res])
            assert alone is not None
            built.append(alone)
        else:
            name = res.session.name
            plan.unassigned_rps[name] = plan.unassigned_rps.get(name, 0.0) + res.rate_rps
    plan.gpus += built


FILL_SEARCH_STEPS = 30


def _fits(sessions: Sequence[Session], gpus: int, scale: float) -> NexusPlan | None:
    scaled = [Session(s.name, s.profile, s.slo_s, s.rate_rps * scale, s.reserve_s)
              for s in sessions]
    plan = plan_sessions(scaled, gpus)
    return None if plan.unassigned_rps else plan


def plan_filling(sessions: Sequence[Session], gpus: int) -> NexusPlan:
    """``nexus-fill``: the squishy plan of every session at the largest common multiple (>= 1)
    of its rate that the ``gpus`` GPUs still hold, so that a cluster larger than the load needs
    leaves no GPU idle and every GPU keeps headroom (the plan at the rate itself runs its
    saturated GPUs at exactly their throughput). Bisection on the multiple."""
    base = plan_sessions(sessions, gpus)
    if base.unassigned_rps or not any(s.rate_rps > 0 for s in sessions):
        return base
    lo, hi = 1.0, 2.0
    while _fits(sessions, gpus, hi) is not None and hi < 1e6:
        lo, hi = hi, hi * 2
    best = _fits(sessions, gpus, lo) or base
    for _ in range(FILL_SEARCH_STEPS):
        mid = (lo + hi) / 2
        plan = _fits(sessions, gpus, mid)
        if plan is None:
            hi = mid
        else:
            lo, best = mid, plan
    return best


class NexusEpochs:
    """The epoch controller: each beacon adds the sessions' request counts to an EWMA; a re-plan
    is due every EPOCH_PERIOD_S, or sooner (no closer than EPOCH_MIN_GAP_S to the last) when a
    session's estimate leaves [TRIGGER_LOW, TRIGGER_HIGH] x its allocated throughput; none
    before HISTORY_SAMPLES beacons. It re-packs from scratch (the code shrinks and grows each
    session's GPUs in place; at a steady rate both give one plan). ``warm`` rates stand for an
    earlier epoch's measurement, so a run starts planned for its offered load."""

    def __init__(self, sessions: Sequence[Session], gpus: int, *, warm: bool = True,
                 fill: bool = False) -> None:
        self.sessions = {s.name: s for s in sessions}
        self.gpus = gpus
        self._planner = plan_filling if fill else plan_sessions
        self.ewma = {s.name: s.rate_rps if warm else 0.0 for s in sessions}
        self.samples = HISTORY_SAMPLES if warm else 0
        self.last_epoch_s = 0.0
        self.epochs: list[tuple[float, str]] = []  # (time, reason)
        self.plan = self._planner(self._estimated(), gpus)

    def _estimated(self) -> list[Session]:
        return [Session(s.name, s.profile, s.slo_s, max(self.ewma[s.name], MIN_ESTIMATE_RPS),
                        s.reserve_s) for s in self.sessions.values()]

    def on_beacon(self, now: float, counts: Mapping[str, int]) -> NexusPlan | None:
        """One BEACON_S of requests per session; the new plan when an epoch ran, else None."""
        for name in self.ewma:
            rate = counts.get(name, 0) / BEACON_S
            self.ewma[name] += EWMA_WEIGHT * (rate - self.ewma[name])
        self.samples += 1
        reason = self._epoch_reason(now)
        if reason is None:
            return None
        self.last_epoch_s = now
        self.epochs.append((now, reason))
        self.plan = self._planner(self._estimated(), self.gpus)
        return self.plan

    def _epoch_reason(self, now: float) -> str | None:
        if self.samples < HISTORY_SAMPLES:
            return None
        since = now - self.last_epoch_s
        if since >= EPOCH_PERIOD_S:
            return "period"
        if since < EPOCH_MIN_GAP_S:
            return None
        for name, estimate in self.ewma.items():
            allocated = self.plan.allocated_rps(name) + self.plan.unassigned_rps.get(name, 0.0)
            if not TRIGGER_LOW * allocated <= estimate <= TRIGGER_HIGH * allocated:
                return f"{name} rate {estimate:.1f} vs allocated {allocated:.1f}"
        return None
