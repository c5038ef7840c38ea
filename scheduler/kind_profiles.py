"""Each model's latency profiles from the rank's backend table, by the device kind each backend
announced (``BackendTable.kinds``): pure, the part of a shard's table handling that picks them.

A model's own profile (the one its ModelThread sizes candidates with) is, as before kinds, the
slowest of every serving backend's registered l(b), element-wise (``merge_profiles``): safe on
every GPU. Where backends announce kinds, each kind's backends' profiles are merged the same way,
and a GPU whose kind's profile differs from the model's own is listed with it
(``ModelThread.set_gpu_profiles``): a batch granted there is sized and timed by that kind. With one
kind, or none announced, the map is empty and planning is what it was. Each backend registers the
l(b) it runs: its kind's file where the cluster file gives the model one per kind (``[[models]]
profiles``), so that is the profile its kind is planned with here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from zserve.config.profiles import LatencyProfile
from zserve.transport.messages import BackendTable


def merge_profiles(tables_ms: list[list[float]], max_batch: int) -> LatencyProfile | None:
    """The slowest of several l(b) tables, element-wise, up to the smallest max batch."""
    if not tables_ms:
        return None
    size = min([len(t) for t in tables_ms] + [max_batch])
    if size < 1:
        return None
    return LatencyProfile.from_table_ms([max(t[b] for t in tables_ms) for b in range(size)])


@dataclass(slots=True)
class ServedProfiles:
    """What a table says of the models: ``served`` (model -> its GPU ids), ``own`` (model -> its
    merged profile, for models some backend registered one of) and ``by_gpu`` (model -> the
    GPUs of another kind and the model's profile there; absent: one kind)."""

    served: dict[str, list[int]] = field(default_factory=dict)
    own: dict[str, LatencyProfile] = field(default_factory=dict)
    by_gpu: dict[str, dict[int, LatencyProfile]] = field(default_factory=dict)


def served_profiles(table: BackendTable, max_batch: Mapping[str, int]) -> ServedProfiles:
    """The models of ``max_batch`` (model -> its configured max batch) as ``table`` serves them
    (see the module docstring); other models in the table are left out of ``own``/``by_gpu``."""
    out = ServedProfiles()
    tables: dict[str, list[list[float]]] = {}
    kind_tables: dict[str, dict[str, list[list[float]]]] = {}  # model -> kind -> tables
    kind_gpus: dict[str, dict[str, list[int]]] = {}  # model -> kind -> GPU ids
    for i, (gpu_id, models) in enumerate(zip(table.gpu_ids, table.models, strict=True)):
        profiles = table.profiles_ms[i] if i < len(table.profiles_ms) else {}
        kind = table.kinds[i] if i < len(table.kinds) else ""
        for model in models:
            out.served.setdefault(model, []).append(gpu_id)
            kind_gpus.setdefault(model, {}).setdefault(kind, []).append(gpu_id)
            if model in profiles:
                tables.setdefault(model, []).append(profiles[model])
                kind_tables.setdefault(model, {}).setdefault(kind, []).append(profiles[model])
    for model, cap in max_batch.items():
        own = merge_profiles(tables.get(model, []), cap)
        if own is None:
            continue
        out.own[model] = own
        for kind, kind_table in kind_tables.get(model, {}).items():
            profile = merge_profiles(kind_table, cap)
            if profile is not None and profile.table_s != own.table_s:
                for gpu_id in kind_gpus[model][kind]:
                    out.by_gpu.setdefault(model, {})[gpu_id] = profile
    return out


__all__ = ["ServedProfiles", "merge_profiles", "served_profiles"]
