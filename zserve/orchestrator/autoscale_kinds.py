"""The autoscaling advice per device kind (``backends.kinds``, ``[autoscale.kinds.<kind>]``):
one :class:`~zserve.orchestrator.autoscale.Autoscaler` per kind, each fed its own kind's
signals. Pure: the host passes the clock in.

A kind's signals for one interval (:func:`kind_signals`):

- its **backends** serving and their **busy seconds**: those of the backends of that kind;
- its **offered** and **bad** requests: each model's, split over the kinds whose backends serve
  it, in proportion to its backends of each kind (a model served by one kind, as sub-clusters
  by kind place them, counts wholly for that kind; a model no backend serves, for none).

So an overloaded kind is advised to grow while another kind that is idle is advised to shrink,
each within its own bounds: Symphony's rule per sub-cluster, with the kinds as the sub-clusters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from zserve.orchestrator.autoscale import Advice, AutoscalePolicy, Autoscaler, Signals


@dataclass(frozen=True)
class BackendSample:
    """One backend over one interval: its kind, the seconds it ran batches, what it serves."""

    kind: str
    busy_s: float
    models: tuple[str, ...]


def kind_signals(duration_s: float, offered: Mapping[str, int], bad: Mapping[str, int],
                 backends: Mapping[str, BackendSample]) -> dict[str, Signals]:
    """Each kind's :class:`Signals` for one interval of ``duration_s`` (module docstring):
    ``offered`` / ``bad``: requests per model; ``backends``: the serving backends by name."""
    serving: dict[str, dict[str, int]] = {}  # model -> kind -> its backends of that kind
    count: dict[str, int] = {}
    busy: dict[str, float] = {}
    for sample in backends.values():
        count[sample.kind] = count.get(sample.kind, 0) + 1
        busy[sample.kind] = busy.get(sample.kind, 0.0) + sample.busy_s
        for model in sample.models:
            by_kind = serving.setdefault(model, {})
            by_kind[sample.kind] = by_kind.get(sample.kind, 0) + 1
    offered_by_kind = dict.fromkeys(count, 0.0)
    bad_by_kind = dict.fromkeys(count, 0.0)
    for model, by_kind in serving.items():
        total = sum(by_kind.values())
        for kind, n in by_kind.items():
            offered_by_kind[kind] += offered.get(model, 0) * n / total
            bad_by_kind[kind] += bad.get(model, 0) * n / total
    return {kind: Signals(duration_s, round(offered_by_kind[kind]), round(bad_by_kind[kind]),
                          busy[kind], count[kind]) for kind in count}


class KindAutoscalers:
    """One Autoscaler per kind: ``policy`` with each kind's ``bounds`` (min, max) in place of
    its own, starting from ``started`` backends of each kind."""

    def __init__(self, policy: AutoscalePolicy, bounds: Mapping[str, tuple[int, int]],
                 started: Mapping[str, int], now: float) -> None:
        self.autoscalers = {
            kind: Autoscaler(dataclasses.replace(policy, min_backends=low, max_backends=high),
                             started.get(kind, low), now)
            for kind, (low, high) in bounds.items()}
        # each kind's backends serving, as the latest interval measured them
        self.serving = {kind: started.get(kind, 0) for kind in bounds}

    def observe(self, now: float, signals: Mapping[str, Signals]) -> None:
        """One interval ending at ``now``; a kind with no backend serving gets an empty
        sample (its bad rate and idle fraction say nothing)."""
        for kind, autoscaler in self.autoscalers.items():
            sample = signals.get(kind)
            if sample is None:
                duration_s = next(iter(signals.values())).duration_s if signals else 0.0
                sample = Signals(duration_s, 0, 0, 0.0, 0)
            self.serving[kind] = sample.backends
            autoscaler.observe(now, sample)

    def advise(self, now: float) -> dict[str, Advice]:
        """Each kind's advice now (a change is recorded as made, as Autoscaler.advise)."""
        return {kind: autoscaler.advise(now) for kind, autoscaler in self.autoscalers.items()}


def kind_targets(advice: Mapping[str, int], kept: Mapping[str, list[str]],
                 bounds: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """How many backends each kind should gain (> 0) or give up (< 0): its advice clamped to
    its bounds, less the backends of that kind kept now. A kind with no advice (not yet
    measured) keeps what it has, within its bounds."""
    out: dict[str, int] = {}
    for kind, (low, high) in bounds.items():
        have = len(kept.get(kind, []))
        target = min(max(advice.get(kind, have), low), high)
        if target != have:
            out[kind] = target - have
    return out


def group_for(kind: str, groups: list[list[str]], kind_of: Mapping[str, str]) -> int:
    """The sub-cluster a new backend of ``kind`` joins: the group holding most backends of its
    kind (their models are what it should serve); none has any: the smallest group. Ties: the
    lowest index."""
    def key(j: int) -> tuple[int, int, int]:
        same = sum(1 for b in groups[j] if kind_of.get(b) == kind)
        return (-same, len(groups[j]) if same == 0 else 0, j)

    return min(range(len(groups)), key=key)


__all__ = ["BackendSample", "KindAutoscalers", "group_for", "kind_signals", "kind_targets"]
