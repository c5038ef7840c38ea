"""Latency profiles l(b) per (model, device kind), and the profile file format.

A :class:`LatencyProfile` gives the execution latency of one batch of ``b`` requests, in seconds,
for ``b = 1..max_batch``. It comes from a linear model ``l(b) = alpha*b + beta`` or from a measured
table. Tables are forced monotone (``l(b) = max(l(1..b))``: a larger batch never finishes earlier,
which the batch-growing rules rely on) and batch sizes above ``max_batch`` are infeasible
(``l(b) = inf``).

Profile file (``zserve-profile/1``), JSON or TOML with the same structure::

    {"format": "zserve-profile/1",
     "device": "cpu",
     "models": {"resnet50": {"alpha_ms": 1.053, "beta_ms": 5.072, "max_batch": 64,
                             "latency_ms": [6.1, 7.2, ...]}}}

``latency_ms`` (optional) lists l(1)..l(max_batch) in milliseconds and wins over alpha/beta when
present; ``max_batch`` defaults to the length of ``latency_ms``. The file is read with
:func:`load_profiles` and written with :func:`save_profiles` (``.toml`` paths are written as TOML).

Model-zoo CSV rows (``model,alpha_ms,beta_ms,beta_over_alpha,slo_ms``, as in the papers' appendix
tables) are read with :func:`load_zoo_csv`.
"""

from __future__ import annotations

import csv
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "zserve-profile/1"
DEFAULT_MAX_BATCH = 1024
"""Cap for linear profiles that name no max_batch (the SLO usually caps the batch far below)."""


@dataclass(slots=True)
class LatencyProfile:
    """l(b) in seconds for b = 1..max_batch.

    ``table_s[b]`` is l(b) for ``1 <= b <= max_batch``; ``table_s[0]`` is 0 and
    ``table_s[max_batch + 1]`` is ``inf`` so that l(bs + 1) needs no bounds check on the hot path.
    """

    max_batch: int
    table_s: list[float]
    alpha_s: float
    beta_s: float
    measured: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction

    @classmethod
    def linear(cls, alpha_ms: float, beta_ms: float, max_batch: int) -> LatencyProfile:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if alpha_ms < 0 or beta_ms < 0:
            raise ValueError(f"alpha_ms and beta_ms must be >= 0, got {alpha_ms}, {beta_ms}")
        alpha_s, beta_s = alpha_ms / 1e3, beta_ms / 1e3
        table = [0.0] + [alpha_s * b + beta_s for b in range(1, max_batch + 1)] + [math.inf]
        return cls(max_batch, table, alpha_s, beta_s)

    @classmethod
    def from_table_ms(cls, latency_ms: list[float]) -> LatencyProfile:
        """A measured table l(1)..l(n) in ms, forced monotone; alpha/beta are a least-squares fit
        (used by the beta*lambda rule and the analytic bounds)."""
        if not latency_ms:
            raise ValueError("latency_ms must not be empty")
        table = [0.0]
        running = 0.0
        for value in latency_ms:
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"latency_ms entries must be positive and finite, got {value}")
            running = max(running, value / 1e3)
            table.append(running)
        table.append(math.inf)
        alpha_s, beta_s = _fit_linear(table[1:-1])
        return cls(len(latency_ms), table, alpha_s, beta_s, measured=True)

    @classmethod
    def linear_for_slo(
        cls, alpha_ms: float, beta_ms: float, slo_ms: float, max_batch: int | None = None
    ) -> LatencyProfile:
        """A linear profile whose max_batch defaults to the largest b with l(b) <= SLO."""
        if max_batch is None:
            fit = math.floor((slo_ms - beta_ms) / alpha_ms) if alpha_ms > 0 else DEFAULT_MAX_BATCH
            max_batch = max(1, min(DEFAULT_MAX_BATCH, fit))
        return cls.linear(alpha_ms, beta_ms, max_batch)

    # ------------------------------------------------------------------ queries

    def latency(self, batch_size: int) -> float:
        """l(b) in seconds; ``inf`` for unprofiled sizes (b > max_batch); 0 for b <= 0."""
        if batch_size <= 0:
            return 0.0
        if batch_size > self.max_batch:
            return math.inf
        return self.table_s[batch_size]

    def largest_batch_within(self, budget_s: float) -> int:
        """The largest b with l(b) <= budget_s (0 when even b = 1 does not fit)."""
        lo, hi = 0, self.max_batch
        table = self.table_s
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if table[mid] <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def latency_ms_list(self) -> list[float]:
        return [t * 1e3 for t in self.table_s[1 : self.max_batch + 1]]

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "alpha_ms": self.alpha_s * 1e3,
            "beta_ms": self.beta_s * 1e3,
            "max_batch": self.max_batch,
        }
        if self.measured:
            entry["latency_ms"] = self.latency_ms_list()
        return entry


def _fit_linear(values_s: list[float]) -> tuple[float, float]:
    """Least-squares alpha, beta for values_s[i] = l(i + 1)."""
    n = len(values_s)
    if n == 1:
        return 0.0, values_s[0]
    xs = range(1, n + 1)
    mean_x = (n + 1) / 2
    mean_y = sum(values_s) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, values_s, strict=True))
    alpha = max(0.0, sxy / sxx)
    beta = max(0.0, mean_y - alpha * mean_x)
    return alpha, beta


def profile_from_entry(name: str, entry: dict[str, Any], where: str = "") -> LatencyProfile:
    """Build a profile from one ``models.NAME`` entry of a profile file (see module docstring)."""
    where = where or f"models.{name}"
    allowed = {"alpha_ms", "beta_ms", "max_batch", "latency_ms"}
    unknown = set(entry) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    table = entry.get("latency_ms")
    max_batch = entry.get("max_batch")
    if table is not None:
        if not isinstance(table, list) or not all(isinstance(v, int | float) for v in table):
            raise ValueError(f"{where}.latency_ms must be a list of numbers")
        if max_batch is not None:
            if int(max_batch) > len(table):
                raise ValueError(f"{where}: max_batch {max_batch} > len(latency_ms) {len(table)}")
            table = table[: int(max_batch)]
        return LatencyProfile.from_table_ms([float(v) for v in table])
    if "alpha_ms" not in entry or "beta_ms" not in entry:
        raise ValueError(f"{where}: needs alpha_ms and beta_ms, or latency_ms")
    if max_batch is None:
        raise ValueError(f"{where}: max_batch is required with alpha_ms/beta_ms")
    return LatencyProfile.linear(float(entry["alpha_ms"]), float(entry["beta_ms"]), int(max_batch))


def load_profiles(path: str | Path) -> dict[str, LatencyProfile]:
    """Read a ``zserve-profile/1`` file (JSON, or TOML when the name ends in ``.toml``)."""
    path = Path(path)
    raw = path.read_bytes()
    data: Any = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile file is an object")
    unknown = set(data) - {"format", "device", "models"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {sorted(unknown)}")
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: format must be {PROFILE_FORMAT!r}, got {data.get('format')!r}")
    models = data.get("models")
    if not isinstance(models, dict):
        raise ValueError(f"{path}: 'models' must be a table of model entries")
    return {
        name: profile_from_entry(name, entry, f"{path}: models.{name}")
        for name, entry in models.items()
    }


def save_profiles(path: str | Path, profiles: dict[str, LatencyProfile], device: str) -> None:
    """Write profiles as ``zserve-profile/1`` (TOML when the name ends in ``.toml``, else JSON)."""
    path = Path(path)
    data = {
        "format": PROFILE_FORMAT,
        "device": device,
        "models": {name: prof.to_dict() for name, prof in profiles.items()},
    }
    if path.suffix == ".toml":
        path.write_text(_to_toml(data))
    else:
        path.write_text(json.dumps(data, indent=2) + "\n")


def _to_toml(data: dict[str, Any]) -> str:
    lines = [f'format = "{data["format"]}"', f"device = {json.dumps(data['device'])}", ""]
    for name, entry in data["models"].items():
        lines.append(f"[models.{json.dumps(name)}]")
        for key, value in entry.items():
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)


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
