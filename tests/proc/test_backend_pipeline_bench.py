"""The backend pipeline benchmark (zserve.backends.bench.pipeline) runs end to end: a frontend
process, every mode, staged batches only where staging is on. Its figures are not asserted."""

from __future__ import annotations

import json

import pytest

from zserve.backends.bench.pipeline import MODES, main


def test_every_mode_runs_and_only_staged_batches_are_slices(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--executor", "emulated", "--batch", "4", "--batches", "4",
                 "--repeats", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(MODES) <= set(report)
    for mode in MODES:
        assert report[mode]["batches_per_s"] > 0
        assert report[mode]["run"] > 0
    assert report["staged"]["staged_share"] == 1.0
    assert report["serial"]["staged_share"] == report["prefetch"]["staged_share"] == 0.0
    assert report["serial"]["wait"] == 0.0  # serial never fetches ahead
