"""Rate schedules and their time rescaling (zserve.loadgen.schedules)."""

from __future__ import annotations

import numpy as np
import pytest

from zserve.loadgen import schedules


def test_constant_schedule_shape() -> None:
    s = schedules.constant(100.0, 3.0)
    assert s.duration_s == 3.0
    assert s.expected_requests == 300.0
    assert s.mean_rate_rps == 100.0
    assert s.rate_at(1.5) == 100.0
    assert s.rate_at(3.0) == 0.0


def test_steps_cumulative_and_warp_are_inverse() -> None:
    s = schedules.steps([(1.0, 100.0), (2.0, 0.0), (1.0, 300.0)])
    assert s.expected_requests == 400.0
    t = np.array([0.0, 0.5, 1.0, 2.0, 3.0, 3.5, 4.0])
    lam = s.cumulative(t)
    np.testing.assert_allclose(lam, [0, 50, 100, 100, 100, 250, 400])
    u = np.array([0.0, 50.0, 99.9, 100.0, 250.0, 399.0])
    warped = s.warp(u)
    # Nothing lands in the zero-rate segment [1, 3): u = 100 maps to its end.
    np.testing.assert_allclose(warped, [0.0, 0.5, 0.999, 3.0, 3.5, 3.0 + 299 / 300])
    np.testing.assert_allclose(s.cumulative(warped), u)
    # Operational times past the end of the schedule are dropped.
    assert len(s.warp(np.array([400.0, 500.0]))) == 0


def test_scaling_and_padding() -> None:
    s = schedules.steps([(1.0, 100.0), (1.0, 300.0)])
    assert s.with_mean_rate(400.0).rates_rps == (200.0, 600.0)
    padded = s.padded(0.5, 0.25)
    assert padded.durations_s == (0.5, 1.0, 1.0, 0.25)
    assert padded.rates_rps == (100.0, 100.0, 300.0, 300.0)


def test_trace_file(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "trace.csv"
    path.write_text("second,rate\n0,100\n1,250  # burst\n\n2,50\n")
    s = schedules.from_trace(path, scale=2.0)
    assert s.durations_s == (1.0, 1.0, 1.0)
    assert s.rates_rps == (200.0, 500.0, 100.0)
    with pytest.raises(ValueError, match="line 2"):
        schedules.parse_trace("100\n1,abc\n")
    with pytest.raises(ValueError):
        schedules.parse_trace("-5\n")


def test_invalid_schedules_rejected() -> None:
    with pytest.raises(ValueError):
        schedules.steps([])
    with pytest.raises(ValueError):
        schedules.constant(-1.0, 1.0)
    with pytest.raises(ValueError):
        schedules.constant(1.0, 0.0)
