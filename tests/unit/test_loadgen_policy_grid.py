"""``zserve experiment policy-grid --quick``: the default against every baseline on a small grid
(a single model with network delays and a 3-model mix), and the light-load sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zserve.loadgen.experiments import common, policy_grid, runner


def test_policy_grid_quick(tmp_path: Path) -> None:
    opts = common.Options(quick=True, live=False, out_dir=tmp_path / "policy-grid", plots=True,
                          say=lambda _line: None)
    result = runner.run_experiment("policy-grid", opts, "zserve experiment policy-grid --quick")
    assert json.loads((tmp_path / "policy-grid" / "result.json").read_text()) == json.loads(
        json.dumps(result))
    cells = result["points"]["cells"]
    assert [c["cell"] for c in cells] == [c.name for c in policy_grid.grid_cells(quick=True)]
    for cell in cells:
        found = cell["policies"]
        assert set(found) == {*policy_grid.GRID_POLICIES, "timeout"}
        for g in found.values():
            assert g["goodput_rps"] > 0 and g["median_batch"] >= 1
            assert 0 < g["busy_fraction"] <= 1.0
        best = max(found["frontrun"]["goodput_rps"], found["eager"]["goodput_rps"])
        assert cell["passes"] == (found["deferred"]["goodput_rps"]
                                  >= (1 - policy_grid.GRID_MARGIN) * best)
        assert cell["over"]["eager"] == pytest.approx(
            found["deferred"]["goodput_rps"] / found["eager"]["goodput_rps"], abs=1e-4)
    check = next(c for c in result["checks"] if c["name"].startswith("default >="))
    assert check["passed"] == all(c["passes"] for c in cells)
    # the quick run must pass as the full one must: a failing check fails the run (exit 1)
    assert [(c["name"], c["detail"]) for c in result["checks"] if not c["passed"]] == []
    (light,) = result["points"]["light"]
    assert [p["fraction"] for p in light["points"]] == list(policy_grid.LIGHT_QUICK_FRACTIONS)
    low, full = light["points"]
    assert low["busy"] < full["busy"] and low["bad_rate"] <= 0.01
    assert len(result["plots"]) == 2 and all(Path(p).exists() for p in result["plots"])


def test_only_picks_cells_and_names_a_miss(tmp_path: Path) -> None:
    opts = common.Options(quick=True, live=False, out_dir=tmp_path, plots=False,
                          say=lambda _line: None, only="no such cell")
    with pytest.raises(ValueError, match="no such cell"):
        policy_grid.run_policy_grid(opts)
