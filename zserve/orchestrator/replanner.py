"""The orchestrator's decisions over time (pure): which model to load on demand, which to evict or
unload when idle, and, every plan period, which models move between sub-clusters.

``Replanner`` is told what happens (``note_usage``: each frontend's requests per model since its
last report and the requests it holds for a model loaded nowhere; ``step``'s ``loaded`` and
``busy``: where each model is served now and which have a repository call under way) and answers
what to do now (``step(now, ...)`` returns ``Load``, ``Unload`` and ``Move`` actions). It reads the
clock it is given and does no I/O; the supervisor's ``zserve.cluster.orchestrator_host`` turns its
actions into repository calls. Its rules:

- **On-demand loading** (Clockwork's rule): of the models with unmet demand (requests held for a
  model loaded nowhere), the one with the most goes first; one on-demand load at a time, since
  loads share the backends' time and memory. It goes to the sub-cluster with the lowest request
  rate where it fits, after evicting that sub-cluster's least recently used models (``Unload``,
  one step; the load follows once they are gone). A model that fits nowhere even alone is
  ``unservable`` (the host answers its waiting requests).
- **Idle unload**: a loaded model with no request for ``idle_unload_s`` is unloaded.
- **Re-planning**: every ``plan_period_s`` the loaded models' rates (requests over the last
  ``rate_window_s``) and memory go to ``zserve.orchestrator.partition.plan`` as a re-plan of the
  current assignment within the disruption budget (a fraction of the loaded models' bytes); each
  model whose sub-cluster changed is a ``Move`` (make-before-break, by the repository). A first
  plan (a model served on every backend, no sub-cluster yet) is a fresh plan. With one sub-cluster
  there is nothing to re-plan.

A model the host has just acted on is left alone for ``ACTION_RETRY_S`` (a call refused at once
is not repeated in a tight loop).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from zserve.orchestrator.memory import ModelMemory, placement_bytes
from zserve.orchestrator.partition import PartitionInputError, PartitionProblem, plan

ACTION_RETRY_S = 1.0
"""How long a model acted on is left alone before it may be acted on again."""
SPREAD = -1
"""A loaded model's sub-cluster when it is served by backends of several (or on every backend)."""


@dataclass(frozen=True, slots=True)
class ReplanSettings:
    """The ``[orchestration]`` keys the decisions need (seconds, bytes, a fraction)."""

    plan_period_s: float = 300.0
    rate_window_s: float = 60.0
    subclusters: int = 1
    disruption_fraction: float = 0.05
    load_on_demand: bool = True
    idle_unload_s: float | None = None
    memory_budget_bytes: int | None = None
    plan_time_limit_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Load:
    """Load ``model`` into sub-cluster ``group`` (its unmet demand: ``waiting`` requests)."""

    model: str
    group: int
    waiting: int


@dataclass(frozen=True, slots=True)
class Unload:
    """Unload ``model`` everywhere; ``why``: evicted for another, or idle."""

    model: str
    why: str


@dataclass(frozen=True, slots=True)
class Move:
    """Move ``model`` to sub-cluster ``group`` (make-before-break)."""

    model: str
    group: int


Action = Load | Unload | Move


@dataclass(slots=True)
class _Usage:
    arrivals: deque[tuple[float, int]] = field(default_factory=deque)  # (when, requests)
    last_used: float = -math.inf
    waiting: dict[str, int] = field(default_factory=dict)  # per reporting frontend


class Replanner:
    """See the module docstring. ``memory``: each model's memory (a model missing counts 0
    bytes); ``now``: the start (the first plan period and every idle time count from it)."""

    def __init__(self, settings: ReplanSettings, memory: Mapping[str, ModelMemory],
                 now: float) -> None:
        self.settings = settings
        self.memory = dict(memory)
        self._usage: dict[str, _Usage] = {}
        self._acted_at: dict[str, float] = {}
        self.next_plan_at = now + settings.plan_period_s
        self._started_at = now
        # Why each model that cannot be served on demand cannot (the host answers its requests).
        self.unservable: dict[str, str] = {}
        self.plans = 0
        self._loading: str | None = None  # the on-demand load under way
        self._last_step_at = -math.inf
        # when step first saw each model loaded (None: before the first step)
        self._loaded_since: dict[str, float] | None = None

    # ------------------------------------------------------------------ what it is told

    def add_model(self, model: str, memory: ModelMemory) -> None:
        """A model found after start (the repository folder was rescanned)."""
        self.memory[model] = memory

    def note_usage(self, now: float, source: str, requests: Mapping[str, int],
                   waiting: Mapping[str, int], pending: Mapping[str, int] | None = None
                   ) -> None:
        """``source`` (a frontend) admitted ``requests`` per model since its last report, holds
        ``waiting`` per model for a load, and has ``pending`` per model unanswered (whole
        counts now, not differences). A model with requests pending is in use."""
        for model, count in requests.items():
            if count > 0:
                usage = self._usage_of(model)
                usage.arrivals.append((now, count))
                usage.last_used = now
        for model, count in (pending or {}).items():
            if count > 0:
                self._usage_of(model).last_used = now
        for usage in self._usage.values():
            usage.waiting.pop(source, None)
        for model, count in waiting.items():
            if count > 0:
                usage = self._usage_of(model)
                usage.waiting[source] = count
                usage.last_used = now

    def _usage_of(self, model: str) -> _Usage:
        usage = self._usage.get(model)
        if usage is None:
            usage = self._usage[model] = _Usage()
        return usage

    def unmet(self, model: str) -> int:
        """Requests held by the frontends for ``model`` (loaded nowhere)."""
        usage = self._usage.get(model)
        return sum(usage.waiting.values()) if usage is not None else 0

    def rate_rps(self, now: float, model: str) -> float:
        """``model``'s requests per second over the last ``rate_window_s``."""
        usage = self._usage.get(model)
        if usage is None:
            return 0.0
        window = self.settings.rate_window_s
        while usage.arrivals and usage.arrivals[0][0] < now - window:
            usage.arrivals.popleft()
        return sum(count for _, count in usage.arrivals) / window

    def last_used(self, model: str) -> float:
        """When ``model`` last had a request, or was loaded if later (the start, if never)."""
        usage = self._usage.get(model)
        return max(self._started_at, (self._loaded_since or {}).get(model, -math.inf),
                   usage.last_used if usage is not None else -math.inf)

    # ------------------------------------------------------------------ what it decides

    def step(self, now: float, loaded: Mapping[str, int], busy: Iterable[str]) -> list[Action]:
        """The actions due at ``now``. ``loaded``: each model served somewhere and its
        sub-cluster (``SPREAD``: on several); ``busy``: the models with a call under way."""
        self._last_step_at = now
        self._acted_at = {m: at for m, at in self._acted_at.items() if now < at + ACTION_RETRY_S}
        held = set(busy) | set(self._acted_at)
        # a model loaded when first told counts as loaded since the start
        first_seen = now if self._loaded_since is not None else self._started_at
        self._loaded_since = {m: (self._loaded_since or {}).get(m, first_seen) for m in loaded}
        actions: list[Action] = []
        if self.settings.load_on_demand:
            actions += self._on_demand(now, loaded, held)
        if self.settings.idle_unload_s is not None:
            actions += self._idle(now, loaded, held | {a.model for a in actions})
        if now >= self.next_plan_at:
            self.next_plan_at = now + self.settings.plan_period_s
            actions += self._replan(now, loaded, held | {a.model for a in actions})
        for action in actions:
            self._acted_at[action.model] = now
        return actions

    def wake_at(self, loaded: Collection[str]) -> float:
        """When ``step`` may next have something to do without being told anything new: the
        next plan period, the earliest idle expiry of a loaded model, or the end of a model's
        retry pause; always after the last step (what was due then and not done waits for
        news: a call's end, a report)."""
        times = [self.next_plan_at]
        if self.settings.idle_unload_s is not None:
            times += [self.last_used(m) + self.settings.idle_unload_s for m in loaded]
        # a model acted on may be acted on again (a call refused at once)
        times += [t + ACTION_RETRY_S for m, t in self._acted_at.items() if m in loaded
                  or m == self._loading or self.unmet(m)]
        return min((t for t in times if t > self._last_step_at), default=math.inf)

    def _on_demand(self, now: float, loaded: Mapping[str, int], held: set[str]
                   ) -> list[Action]:
        """The model with the most unmet demand first; LRU eviction where memory is short."""
        if self._loading is not None:
            if self._loading in held:
                return []  # one on-demand load at a time
            self._loading = None  # done (or refused: it is asked for again if still wanted)
        demand = sorted(((self.unmet(m), m) for m in self._usage
                         if m not in loaded and self.unmet(m) > 0), key=lambda d: (-d[0], d[1]))
        if not demand:
            return []
        if any(m in held for m in loaded) and self._short_of_memory(loaded, demand[0][1]):
            return []  # evictions under way: the load follows once they are done
        for waiting, model in demand:
            choice = self._fit(now, model, loaded, held)
            if choice is None:
                self.unservable[model] = self._why_unservable(model)
                continue
            self.unservable.pop(model, None)
            group, evict = choice
            if evict:
                return [Unload(victim, f"evicted (least recently used) to load {model!r}")
                        for victim in evict]
            self._loading = model
            return [Load(model, group, waiting)]
        return []

    def _short_of_memory(self, loaded: Mapping[str, int], model: str) -> bool:
        budget = self.settings.memory_budget_bytes
        return budget is not None and all(
            self._bytes([*self._in_group(loaded, g), model]) > budget
            for g in range(self.settings.subclusters))

    def _in_group(self, loaded: Mapping[str, int], group: int) -> list[str]:
        """The models on the backends of ``group`` (a spread model is on all of them)."""
        return [m for m, g in loaded.items() if g in (group, SPREAD)]

    def _bytes(self, models: Iterable[str]) -> int:
        return placement_bytes([self.memory.get(m, ModelMemory(m, 0, 0)) for m in models])

    def _fit(self, now: float, model: str, loaded: Mapping[str, int], held: set[str]
             ) -> tuple[int, list[str]] | None:
        """The sub-cluster for ``model`` (the lowest rate where it fits) and the least recently
        used models to evict there first; None when it fits in none."""
        budget = self.settings.memory_budget_bytes
        groups = sorted(range(self.settings.subclusters),
                        key=lambda g: (sum(self.rate_rps(now, m)
                                           for m in self._in_group(loaded, g)), g))
        for group in groups:
            resident = self._in_group(loaded, group)
            if budget is None or self._bytes([*resident, model]) <= budget:
                return group, []
            evict: list[str] = []
            for victim in sorted((m for m in resident if m not in held),
                                 key=lambda m: (self.last_used(m), m)):
                evict.append(victim)
                if self._bytes([*(m for m in resident if m not in evict), model]) <= budget:
                    return group, evict
        return None

    def _why_unservable(self, model: str) -> str:
        need = self._bytes([model])
        return (f"model {model!r} needs {need} bytes, more than a backend's memory budget "
                f"({self.settings.memory_budget_bytes} bytes) with every other model evicted")

    def _idle(self, now: float, loaded: Mapping[str, int], held: set[str]) -> list[Action]:
        idle_s = self.settings.idle_unload_s
        assert idle_s is not None
        return [Unload(m, f"idle for {idle_s:g} s") for m in sorted(loaded)
                if m not in held and now - self.last_used(m) >= idle_s]

    def _replan(self, now: float, loaded: Mapping[str, int], held: set[str]) -> list[Action]:
        """A re-plan of the loaded models within the disruption budget: a ``Move`` for each
        model whose sub-cluster changed (none with one sub-cluster or too few models)."""
        groups = self.settings.subclusters
        models = sorted(m for m in loaded if m not in held)
        if groups < 2 or len(models) < groups:
            return []
        rates = np.array([self.rate_rps(now, m) for m in models], dtype=np.float64)
        if rates.sum() <= 0:
            return []  # no traffic measured: nothing to balance
        memory = [self.memory.get(m, ModelMemory(m, 0, 0)) for m in models]
        static = np.array([max(1, mem.static_bytes) for mem in memory], dtype=np.float64)
        current = np.array([loaded[m] for m in models], dtype=np.int64)
        fresh = bool((current == SPREAD).any())
        budget = self.settings.memory_budget_bytes
        try:
            problem = PartitionProblem(
                rates, static, np.array([mem.dynamic_bytes for mem in memory], dtype=np.float64),
                groups, memory_cap_bytes=math.inf if budget is None else float(budget),
                current=None if fresh else current,
                disruption_budget=math.inf if fresh else
                self.settings.disruption_fraction * float(static.sum()))
        except PartitionInputError:
            return []
        result = plan(problem, self.settings.plan_time_limit_s)
        self.plans += 1
        return [Move(m, int(g)) for m, g, was in zip(models, result.assignment, current,
                                                      strict=True) if int(g) != int(was)]


__all__ = ["ACTION_RETRY_S", "SPREAD", "Action", "Load", "Move", "ReplanSettings", "Replanner",
           "Unload"]
