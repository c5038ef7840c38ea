"""The experiments' frame: where their inputs are, what a run is given (``Options``) and what
it produces (``Outcome``: tables, checks, points, plots), and the plot helpers."""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXPERIMENT_SCHEMA = "zserve-experiment/1"
EXAMPLES_DIR = Path(__file__).resolve().parent.parent.parent / "examples"
WORKLOADS_DIR = EXAMPLES_DIR / "workloads"
ZOO_CSV = EXAMPLES_DIR / "profiles" / "model_zoo_a100.csv"
DEFAULT_OUT_DIR = Path("out/perf")


Say = Callable[[str], None]




def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


@dataclass
class Table:
    """A titled table of rows; numbers print with 3 decimals below 10, else 1."""

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)

    def text(self) -> str:
        cells = [[_cell(v) for v in row] for row in self.rows]
        widths = [
            max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)
        ]
        lines = [self.title, "  ".join(c.rjust(w) for c, w in zip(self.columns, widths,
                                                                 strict=True))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
        return "\n".join(lines)

    def markdown(self) -> str:
        cells = [[_cell(v) for v in row] for row in self.rows]
        lines = ["| " + " | ".join(self.columns) + " |",
                 "|" + "|".join(" --- " for _ in self.columns) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns, "rows": self.rows}


@dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass
class Options:
    quick: bool
    live: bool
    out_dir: Path
    plots: bool
    say: Say
    only: str | None = None  # run only the cells whose name contains this (experiments with cells)


@dataclass
class Outcome:
    """What an experiment produced (the JSON's config/tables/checks/points, plus plot data)."""

    config: dict[str, Any]
    tables: list[Table]
    checks: list[Check]
    points: dict[str, Any]
    plots: list[Path] = field(default_factory=list)


def machine_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }





def pyplot() -> Any:
    from zserve.loadgen import plots

    return plots.pyplot()


def save_figure(fig: Any, path: Path) -> Path:
    from zserve.loadgen import plots

    return Path(plots.save_figure(fig, path))
