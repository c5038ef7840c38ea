"""Latency profiles as the scheduler imports them, and the model-zoo CSV.

The one :class:`LatencyProfile`, its file format and :func:`configured_profile` live in the
runtime kit (``zserve.profiles``); they are re-exported here for the scheduler's modules.
Model-zoo CSV rows (``model,alpha_ms,beta_ms,beta_over_alpha,slo_ms``, as in the papers'
appendix tables) are read with :func:`load_zoo_csv`.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from zserve.profiles import (
    DEFAULT_MAX_BATCH,
    PROFILE_FORMAT,
    LatencyProfile,
    configured_profile,
    load_profiles,
    save_profiles,
)

__all__ = [
    "DEFAULT_MAX_BATCH", "PROFILE_FORMAT", "LatencyProfile", "ZooRow", "configured_profile",
    "load_profiles", "load_zoo_csv", "save_profiles",
]


@dataclass(frozen=True, slots=True)
class ZooRow:
    name: str
    alpha_ms: float
    beta_ms: float
    slo_ms: float


def load_zoo_csv(path: str | Path) -> list[ZooRow]:
    """Rows ``model,alpha_ms,beta_ms,beta_over_alpha,slo_ms`` (header required)."""
    rows: list[ZooRow] = []
    with Path(path).open(newline="") as handle:
        reader = csv.DictReader(handle)
        needed = {"model", "alpha_ms", "beta_ms", "slo_ms"}
        if reader.fieldnames is None or not needed <= set(reader.fieldnames):
            raise ValueError(f"{path}: header must include {sorted(needed)}")
        for row in reader:
            rows.append(
                ZooRow(
                    row["model"].strip(),
                    float(row["alpha_ms"]),
                    float(row["beta_ms"]),
                    float(row["slo_ms"]),
                )
            )
    return rows
