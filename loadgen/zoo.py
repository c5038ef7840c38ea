"""The papers' model-zoo CSV (``examples/profiles/model_zoo_a100.csv``): one linear latency profile
and SLO per model, as in their appendix tables. Workloads (``zoo = "..."``) and experiments read
their models from it.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

ZOO_COLUMNS = frozenset({"model", "alpha_ms", "beta_ms", "slo_ms"})
"""Columns a zoo CSV must have (the papers' files also carry ``beta_over_alpha``)."""


@dataclass(frozen=True, slots=True)
class ZooRow:
    """One model of the zoo: latency ``alpha_ms * batch + beta_ms``, its SLO."""

    name: str
    alpha_ms: float
    beta_ms: float
    slo_ms: float


def load_zoo_csv(path: str | Path) -> list[ZooRow]:
    """Rows ``model,alpha_ms,beta_ms,beta_over_alpha,slo_ms`` (header required)."""
    rows: list[ZooRow] = []
    with Path(path).open(newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or not set(reader.fieldnames) >= ZOO_COLUMNS:
            raise ValueError(f"{path}: header must include {sorted(ZOO_COLUMNS)}")
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


__all__ = ["ZOO_COLUMNS", "ZooRow", "load_zoo_csv"]
