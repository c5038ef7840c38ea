"""The supervisor's orchestrator: ``zserve.orchestrator.replanner``'s decisions turned into model
repository calls (docs/orchestration.md, "Re-planning", "On-demand loading").

``OrchestratorHost`` is a part of the supervisor (``zserve.cluster.supervisor``), present when
the cluster file has an ``[orchestration]`` table. The supervisor hands it each frontend's
``ModelUsage`` (``on_usage``), calls ``step(now)`` on every turn of its loop (and wakes for
``wake_at``), and routes the answers to its calls back (``on_answer``). It reads where each
model is from the ``ModelRepository`` (a model with any state on a backend counts as resident
there: one loading or unloading holds memory too) and which have a call under way, and makes
the calls any frontend could make: ``load`` (every live backend) with one sub-cluster, else a
``move`` onto the chosen sub-cluster's backends (make-before-break; for a model loaded nowhere,
a load there), and ``unload``. Sub-cluster j is the j-th contiguous block of the backends in
their configured order; a backend the autoscaler adds joins the sub-cluster with most backends
of its device kind and loads that sub-cluster's models (``join``), a released one leaves it.

A model's memory, for the eviction rule and the partitioner: ``memory.configured_memory`` (its
declared ``memory_mib`` / ``activation_mib``, else the zoo's figures for a model named as a zoo
model, else its ``model.onnx`` file's size as weights and no activations); a model none of them
knows counts 0.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Iterable, Mapping

from zserve.cluster.repository import Call, Effects, ModelRepository
from zserve.config.cluster import ModelConfig, OrchestrationConfig
from zserve.orchestrator.autoscale_kinds import group_for
from zserve.orchestrator.memory import MIB_BYTES, ModelMemory, configured_memory
from zserve.orchestrator.replanner import (
    SPREAD,
    Action,
    Load,
    Replanner,
    ReplanSettings,
    Unload,
)
from zserve.transport.messages import ModelUnservable, ModelUsage, RepositoryReply

log = logging.getLogger(__name__)

# The caller's name in the repository's ``Call`` for the orchestrator's own calls.
ORCHESTRATOR_CALLER = "orchestrator"


def model_memory(config: ModelConfig) -> ModelMemory:
    """``config``'s memory as the orchestrator counts it (see the module docstring)."""
    known = configured_memory(config, onnx_file_bytes(config))
    return ModelMemory(config.name, 0, 0) if known is None else known


def onnx_file_bytes(config: ModelConfig) -> int | None:
    """The size of ``config``'s ONNX file (None: no file, or not readable)."""
    if config.onnx is None:
        return None
    try:
        return os.path.getsize(config.onnx)
    except OSError:
        return None


def settings_of(config: OrchestrationConfig) -> ReplanSettings:
    return ReplanSettings(
        plan_period_s=config.plan_period_s, rate_window_s=config.rate_window_s,
        subclusters=config.subclusters, disruption_fraction=config.disruption_budget,
        load_on_demand=config.load_on_demand, idle_unload_s=config.idle_unload_s,
        memory_budget_bytes=None if config.memory_budget_mb is None
        else int(config.memory_budget_mb * MIB_BYTES))


class OrchestratorHost:
    """See the module docstring. ``backends``: the backends' names in configured order;
    ``kinds``: each one's device kind (``backends.kinds``)."""

    def __init__(self, config: OrchestrationConfig, repository: ModelRepository,
                 backends: list[str], models: Iterable[ModelConfig], now: float, *,
                 kinds: Mapping[str, str] | None = None) -> None:
        self.repository = repository
        self.core = Replanner(settings_of(config), {m.name: model_memory(m) for m in models},
                              now)
        count = config.subclusters
        self.groups = [backends[len(backends) * j // count: len(backends) * (j + 1) // count]
                       for j in range(count)]
        self.kind_of = dict(kinds or {})  # backend -> its device kind
        self._ids = itertools.count(1)
        self._calls: dict[int, Action] = {}
        self._unservable_logged: set[str] = set()
        # (model, requests held for it) last told to the frontends as unservable
        self._unservable_told: dict[str, int] = {}
        self._notices: list[ModelUnservable] = []  # for the next step's effects

    def join(self, backend: str, kind: str) -> list[str] | None:
        """An added backend (the autoscaler's) of ``kind`` joins a sub-cluster: the one with
        most backends of its kind (``autoscale_kinds.group_for``). Returns the models it is to
        load at start, the ones resident in that sub-cluster, which are placed on it too (a
        restart loads them again); None with one sub-cluster (every model, as any backend)."""
        self.kind_of[backend] = kind
        if len(self.groups) == 1:
            self.groups[0].append(backend)
            return None
        group = group_for(kind, self.groups, self.kind_of)
        self.groups[group].append(backend)
        models = sorted(m for m, j in self.loaded().items() if j == group)
        for model in models:
            placed = self.repository.placement.get(model)
            if placed is not None:
                self.repository.placement[model] = placed | {backend}
        log.info("orchestrator: %s (%s) joins sub-cluster %d: %s", backend, kind or "-", group,
                 ", ".join(models) or "no model yet")
        return models

    def leave(self, backend: str) -> None:
        """A released backend leaves its sub-cluster."""
        self.kind_of.pop(backend, None)
        for group in self.groups:
            if backend in group:
                group.remove(backend)

    def add_model(self, config: ModelConfig) -> None:
        self.core.add_model(config.name, model_memory(config))

    def on_usage(self, now: float, msg: ModelUsage) -> None:
        self.core.note_usage(now, msg.name, msg.requests, msg.waiting, msg.pending)

    def loaded(self) -> dict[str, int]:
        """Each model resident on some backend, and its sub-cluster (``SPREAD``: several)."""
        out: dict[str, int] = {}
        for model, states in self.repository.states.items():
            if states:
                where = {j for j, group in enumerate(self.groups) for b in states if b in group}
                out[model] = where.pop() if len(where) == 1 else SPREAD
        return out

    def wake_at(self) -> float:
        if self._notices:  # a failed load's notice goes out on the next step
            return -math.inf
        return self.core.wake_at(self.loaded())

    def step(self, now: float) -> Effects:
        """The orchestrator's actions due at ``now``, as repository calls."""
        repository = self.repository
        busy = [m for m in repository.models if repository.busy(m)]
        effects = Effects()
        for action in self.core.step(now, self.loaded(), busy):
            call = Call(ORCHESTRATOR_CALLER, next(self._ids))
            self._calls[call.request_id] = action
            log.info("orchestrator: %s", action)
            if isinstance(action, Unload):
                step = repository.call(call, "unload", action.model)
            elif isinstance(action, Load) and len(self.groups) == 1:
                step = repository.call(call, "load", action.model)
            else:
                step = repository.move(call, action.model, self.groups[action.group])
            effects.commands += step.commands
            effects.answers += step.answers
        for model, why in self.core.unservable.items():
            if model not in self._unservable_logged:
                self._unservable_logged.add(model)
                log.error("orchestrator: cannot load %s on demand: %s", model, why)
            self._tell_unservable(model, why)
        effects.notices, self._notices = self._notices, []
        return effects

    def _tell_unservable(self, model: str, why: str) -> None:
        """The frontends answer what they hold for ``model`` now; told again only when they
        hold a different count (their usage reports lag the answers)."""
        unmet = self.core.unmet(model)
        if unmet > 0 and self._unservable_told.get(model) != unmet:
            self._unservable_told[model] = unmet
            self._notices.append(ModelUnservable(model, why))

    def on_answer(self, reply: RepositoryReply) -> None:
        """The answer to one of its calls (a refusal or a failure is logged; the model's state
        in the repository says the rest). A failed on-demand load tells the frontends
        (``ModelUnservable``, with the next step's effects)."""
        action = self._calls.pop(reply.request_id, None)
        if reply.error:
            log.warning("orchestrator: %s: %s: %s", action, reply.error, reply.message)
            if isinstance(action, Load):  # its held requests get the failure, not a deadline
                self._notices.append(ModelUnservable(
                    action.model, f"its load failed: {reply.error}: {reply.message}"))
        else:
            log.info("orchestrator: done: %s", action)


__all__ = ["ORCHESTRATOR_CALLER", "OrchestratorHost", "model_memory", "onnx_file_bytes",
           "settings_of"]
