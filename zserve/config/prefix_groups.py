"""``[[prefix_groups]]``: models that share a prefix, scheduled and run as one group.

A group names two or more ONNX (or built-in) models that compute the same first layers, such as
classifiers fine-tuned from one network (Nexus's prefix batching, section 2.5). Clients still
call each model by its own name, with its own SLO, admission, stats and answers; the scheduler
sees one model, the group (its name), so rows of every model join one batch and the prefix runs
once at their merged batch (``zserve.backends.prefix.merge_group``: the backend loads one merged
ONNX model, the prefix once and each model's head). The models of a group therefore share what
the scheduler plans a batch by: ``slo_ms``, ``max_batch`` and their ``backends``. Validated at
load: a key-path error names the first offending key (``prefix_groups[0].models[1]: ...``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from zserve.config.decode import FieldError, SchemaError

if TYPE_CHECKING:
    from zserve.config.cluster import ModelConfig

# The group's extra input (int64, one per row): the row's head, its model's index in the group.
# The frontend adds it to a grouped request's inputs when a backend fetches them.
HEAD_INPUT = "zserve_prefix_head"
# What every model of a group must share with the first: the scheduler plans the group's
# batches by one SLO, one max batch, on one set of backends.
SHARED_KEYS = ("slo_ms", "max_batch", "backends")


class PrefixGroupConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[prefix_groups]]``: ``name`` (the group's name to the scheduler and the backends; not
    a model clients call) and ``models`` (at least two, in the order of their heads)."""

    name: str
    models: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.models) < 2:
            raise FieldError("models", f"a prefix group needs at least two models, got "
                             f"{len(self.models)}")


def check_prefix_groups(groups: Sequence[PrefixGroupConfig], models: Sequence[ModelConfig],
                        *, orchestrated: bool, unloaded: Sequence[str] = ()) -> None:
    """Raise ``SchemaError`` naming the first problem's key (``prefix_groups[i]...``);
    ``unloaded``: the repository's models not loaded at start (a group's are loaded at start)."""
    if groups and orchestrated:
        raise SchemaError("prefix_groups", "not supported with [orchestration]: it loads and "
                          "moves models one by one, a group's models must stay together")
    by_name = {m.name: m for m in models}
    grouped: dict[str, str] = {}
    for i, group in enumerate(groups):
        key = f"prefix_groups[{i}]"
        if group.name in by_name or any(g.name == group.name for g in groups[:i]):
            raise SchemaError(f"{key}.name", f"{group.name!r} is taken (by a model or an "
                              "earlier group): a group's name must be its own")
        for j, name in enumerate(group.models):
            where = f"{key}.models[{j}]"
            model = by_name.get(name)
            if model is None:
                raise SchemaError(where, f"no model named {name!r}")
            if name in grouped:
                raise SchemaError(where, f"model {name!r} is in group {grouped[name]!r} already")
            grouped[name] = group.name
            if name in unloaded:
                raise SchemaError(where, f"model {name!r} is not loaded at start ([repository] "
                                  "load): a group's models are loaded together, at start")
            if model.kind == "emulated":
                raise SchemaError(where, f"model {name!r} is emulated: a prefix group cuts ONNX "
                                  "models (onnx or builtin)")
            first = by_name[group.models[0]]
            for shared in SHARED_KEYS:
                if getattr(model, shared) != getattr(first, shared):
                    raise SchemaError(where, f"model {name!r} has {shared} "
                                      f"{getattr(model, shared)!r}, {first.name!r} has "
                                      f"{getattr(first, shared)!r}: a group is scheduled as one "
                                      f"model, so its models share {', '.join(SHARED_KEYS)}")


def group_model(group: PrefixGroupConfig, models: Sequence[ModelConfig],
                onnx: str | None = None) -> ModelConfig:
    """The model the scheduler (and, with ``onnx``: the merged file, a backend) knows the group
    as: its first model's settings under the group's name, its queue the sum of its models', no
    profile file (its l(b) is the merged model's, which the backends measure)."""
    by_name = {m.name: m for m in models}
    first = by_name[group.models[0]]
    queue = sum(by_name[name].max_queue for name in group.models)
    grouped = msgspec.structs.replace(first, name=group.name, max_queue=queue, profile=None,
                                      memory_mib=None)
    if onnx is None:
        return grouped
    return msgspec.structs.replace(grouped, onnx=onnx, builtin=None)


def scheduled_models(groups: Sequence[PrefixGroupConfig], models: Sequence[ModelConfig]
                     ) -> tuple[ModelConfig, ...]:
    """The models as the scheduler sees them: each group's models replaced by the group, in
    the place of its first model."""
    first_of = {g.models[0]: g for g in groups}
    grouped = {name for g in groups for name in g.models}
    out: list[ModelConfig] = []
    for model in models:
        if model.name in first_of:
            out.append(group_model(first_of[model.name], models))
        elif model.name not in grouped:
            out.append(model)
    return tuple(out)


def group_heads(groups: Sequence[PrefixGroupConfig]) -> dict[str, tuple[str, int]]:
    """Each grouped model -> (its group's name, its head's index in the group)."""
    return {name: (g.name, i) for g in groups for i, name in enumerate(g.models)}


__all__ = ["HEAD_INPUT", "PrefixGroupConfig", "check_prefix_groups", "group_heads", "group_model",
           "scheduled_models"]
