"""The papers' model-zoo CSV as workloads and experiments read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from zserve.loadgen.zoo import load_zoo_csv

ZOO = Path(__file__).resolve().parents[2] / "examples" / "profiles" / "model_zoo_a100.csv"


def test_zoo_csv_rows() -> None:
    rows = load_zoo_csv(ZOO)
    assert len(rows) == 37
    assert rows[0].name == "DenseNet121" and rows[0].slo_ms == 21.0


def test_zoo_csv_needs_its_columns(tmp_path: Path) -> None:
    path = tmp_path / "zoo.csv"
    path.write_text("model,alpha_ms,beta_ms\nResNet50,1.0,2.0\n")
    with pytest.raises(ValueError, match="slo_ms"):
        load_zoo_csv(path)
