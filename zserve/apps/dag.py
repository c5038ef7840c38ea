"""The application model: a DAG of stages (each runs one model) under one end-to-end SLO.

An edge ``parent -> child`` carries a fan-out factor: each request the parent finishes makes
``fanout`` requests of the child (a detector that finds two objects per frame feeds a classifier
at twice its rate). A stage's rate is the app's rate at the sources, and the sum over its
parents of the parent's rate times the edge's fan-out elsewhere. An app request ends when every
stage on every path has finished, so its latency is the longest source-to-sink path of the
stages' latencies (the critical path).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass


class AppError(ValueError):
    """An application declaration that cannot be served (one line: what is wrong)."""


@dataclass(frozen=True)
class Edge:
    """``child`` runs on ``parent``'s outputs; ``fanout`` child requests per parent request."""

    parent: str
    child: str
    fanout: float = 1.0


@dataclass(frozen=True)
class Stage:
    """One node of the DAG: its name (unique in the app) and the model it runs."""

    name: str
    model: str


@dataclass(frozen=True)
class App:
    """An application: stages, edges and one end-to-end latency SLO in seconds."""

    name: str
    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    slo_s: float

    def __post_init__(self) -> None:
        validate(self)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def parents(self, stage: str) -> tuple[str, ...]:
        return tuple(e.parent for e in self.edges if e.child == stage)

    def children(self, stage: str) -> tuple[str, ...]:
        return tuple(e.child for e in self.edges if e.parent == stage)

    def sources(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if not self.parents(n))

    def model_of(self, stage: str) -> str:
        return next(s.model for s in self.stages if s.name == stage)


def chain(name: str, models: list[str], slo_s: float) -> App:
    """A pipeline ``models[0] -> models[1] -> ...`` (stage names are the model names)."""
    stages = tuple(Stage(m, m) for m in models)
    edges = tuple(Edge(a, b) for a, b in itertools.pairwise(models))
    return App(name, stages, edges, slo_s)


def validate(app: App) -> None:
    """Raise :class:`AppError` unless the app is a non-empty DAG over unique, known stages with
    positive fan-outs and a positive SLO."""
    names = [s.name for s in app.stages]
    if not names:
        raise AppError(f"app {app.name!r}: no stages")
    if len(set(names)) != len(names):
        raise AppError(f"app {app.name!r}: stage names repeat")
    if not app.slo_s > 0:
        raise AppError(f"app {app.name!r}: SLO must be > 0 s, got {app.slo_s}")
    for e in app.edges:
        if e.parent not in names or e.child not in names:
            raise AppError(f"app {app.name!r}: edge {e.parent}->{e.child} names an unknown stage")
        if not e.fanout > 0:
            raise AppError(f"app {app.name!r}: edge {e.parent}->{e.child} fan-out must be > 0")
    topological_order(app)


def topological_order(app: App) -> list[str]:
    """The stages, every parent before its children; :class:`AppError` on a cycle."""
    indegree = {s.name: 0 for s in app.stages}
    for e in app.edges:
        indegree[e.child] += 1
    ready = [n for n, d in indegree.items() if d == 0]
    order: list[str] = []
    while ready:
        node = ready.pop(0)
        order.append(node)
        for e in app.edges:
            if e.parent == node:
                indegree[e.child] -= 1
                if indegree[e.child] == 0:
                    ready.append(e.child)
    if len(order) != len(indegree):
        raise AppError(f"app {app.name!r}: the edges make a cycle")
    return order


def stage_rates(app: App, rate_rps: float) -> dict[str, float]:
    """Each stage's request rate when the app receives ``rate_rps`` (fan-outs multiply)."""
    rates: dict[str, float] = {}
    for node in topological_order(app):
        inbound = [e for e in app.edges if e.child == node]
        rates[node] = rate_rps if not inbound else sum(
            rates[e.parent] * e.fanout for e in inbound)
    return rates


def critical_path_s(app: App, latency_s: Mapping[str, float]) -> float:
    """The longest source-to-sink sum of the stages' latencies: the app's end-to-end latency."""
    finish: dict[str, float] = {}
    for node in topological_order(app):
        start = max((finish[p] for p in app.parents(node)), default=0.0)
        finish[node] = start + latency_s[node]
    return max(finish.values())


def longest_path_through_s(app: App, latency_s: Mapping[str, float]) -> dict[str, float]:
    """For each stage, the longest source-to-sink path that passes through it."""
    order = topological_order(app)
    to_end: dict[str, float] = {}  # the stage's latency plus the longest path after it
    for node in reversed(order):
        to_end[node] = latency_s[node] + max((to_end[c] for c in app.children(node)),
                                             default=0.0)
    from_start: dict[str, float] = {}  # the longest path before the stage
    for node in order:
        from_start[node] = max((from_start[p] + latency_s[p] for p in app.parents(node)),
                               default=0.0)
    return {n: from_start[n] + to_end[n] for n in order}


def is_tree(app: App) -> bool:
    """Whether no stage has two parents (the dynamic-program splitter's shape)."""
    return all(len(app.parents(n)) <= 1 for n in app.names)


__all__ = ["App", "AppError", "Edge", "Stage", "chain", "critical_path_s", "is_tree",
           "longest_path_through_s", "stage_rates", "topological_order", "validate"]
