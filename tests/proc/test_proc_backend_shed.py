"""Late shedding and drift reports of the backend process: a plan that starts too late for some
of its requests' ``finish_by`` answers those ``DEADLINE`` at once and runs the rest, and every
BatchStats of a finished or skipped plan carries the device's projected free time. Real process,
real sockets (the rig of test_proc_backend: the test plays the rank, a shard and a frontend).
Plus the pure shedding rule, ``shed_late_rows``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from proc_harness import Harness
from test_proc_backend import ALPHA_MS, BETA_MS, MODEL, BackendRig, start_backend

from zserve.backends.host import shed_late_rows
from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.transport.messages import (
    BatchFailed,
    BatchOutputs,
    BatchPlan,
    InputFetch,
    InputReply,
    StatsReply,
    StatsRequest,
)

MAX_BATCH = 8


def _l(bs: int) -> float:
    return (ALPHA_MS * bs + BETA_MS) / 1e3


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[BackendRig]:
    h = Harness(tmp_path)
    try:
        yield start_backend(h)
    finally:
        h.close()


def _send_plan(rig: BackendRig, plan_id: int, request_ids: list[int], exec_at: float,
               finish_by: list[float]) -> BatchPlan:
    bs = len(request_ids)
    plan = BatchPlan(plan_id, MODEL, 0, exec_at, exec_at + _l(bs), [rig.frontend.endpoint],
                     [0] * bs, request_ids, finish_by)
    rig.shard.send(plan)
    return plan


def _counters(rig: BackendRig) -> dict[str, int]:
    rig.shard.send(StatsRequest(reset=False))
    _, reply = rig.shard.expect(StatsReply)
    counters: dict[str, int] = reply.stats["counters"]
    return counters


# --------------------------------------------------------------------------- the process


def test_late_plan_sheds_the_rows_that_cannot_finish_and_runs_the_rest(rig: BackendRig) -> None:
    t0 = time.monotonic()
    # 200 ms late when sent. Rows 0 and 2 had to finish 2-5 ms after t0: impossible even alone
    # (l(1) = 22 ms). Rows 1 and 3 have 500 ms: a batch of two (24 ms) makes it.
    _send_plan(rig, 1, [11, 12, 13, 14], t0 - 0.200,
               [t0 + 0.005, t0 + 0.500, t0 + 0.002, t0 + 0.500])
    rig.serve_fetch()
    _, failed = rig.frontend.expect(BatchFailed)
    assert failed.plan_id == 1 and sorted(failed.request_ids) == [11, 13]
    assert failed.error == ErrorKind.DEADLINE.value
    assert "ms late" in failed.message and "deadline" in failed.message
    _, out = rig.frontend.expect(BatchOutputs)
    assert out.plan_id == 1 and out.request_ids == [12, 14]
    # Each kept request got its own input back (2 * sum(inputs) + a model constant).
    values = [float(o["y"][0, 0]) - 2 * 4 * rid for o, rid in zip(out.outputs, [12, 14],
                                                                    strict=True)]
    assert values[0] == pytest.approx(values[1])
    stats = rig.stats_of(1)
    assert stats.ok and stats.batch_size == 2
    assert stats.finished_at - stats.started_at >= _l(2) - 1e-3
    # Nothing else held: the device is free once the outputs are pushed.
    assert stats.finished_at <= stats.device_free_at <= stats.finished_at + 0.1
    counters = _counters(rig)
    assert counters["requests_shed_late"] == 2 and counters["requests_ok"] == 2
    assert rig.frontend.drain_kind(BatchFailed) == []  # exactly one answer each


def test_plan_whose_every_row_is_too_late_is_skipped_and_the_next_runs(rig: BackendRig) -> None:
    t0 = time.monotonic()
    _send_plan(rig, 1, [1, 2], t0 - 0.200, [t0 + 0.001, t0 + 0.003])
    _send_plan(rig, 2, [3], t0 - 0.100, [t0 + 1.0])
    rig.serve_fetch()
    rig.serve_fetch()
    _, failed = rig.frontend.expect(BatchFailed)
    assert failed.plan_id == 1 and sorted(failed.request_ids) == [1, 2]
    assert failed.error == ErrorKind.DEADLINE.value
    skipped = rig.stats_of(1)
    assert skipped.batch_size == 0 and skipped.ok and skipped.device_free_at >= skipped.started_at
    _, out = rig.frontend.expect(BatchOutputs)
    assert out.plan_id == 2 and out.request_ids == [3]
    ran = rig.stats_of(2)
    assert ran.ok and ran.batch_size == 1 and ran.started_at >= skipped.started_at
    counters = _counters(rig)
    assert counters["requests_shed_late"] == 2 and counters["batches_skipped"] == 1
    assert counters["requests_ok"] == 1


def test_plan_without_finish_by_is_never_shed(rig: BackendRig) -> None:
    t0 = time.monotonic()
    _send_plan(rig, 1, [1, 2], t0 - 0.300, [])
    rig.serve_fetch()
    _, out = rig.frontend.expect(BatchOutputs)
    assert out.request_ids == [1, 2]
    assert rig.stats_of(1).batch_size == 2
    assert _counters(rig)["requests_shed_late"] == 0


def test_plan_with_a_finish_by_of_another_length_is_refused(rig: BackendRig) -> None:
    now = time.monotonic()
    _send_plan(rig, 1, [1, 2], now + 0.02, [now + 1.0])
    _, failed = rig.frontend.expect(BatchFailed)
    assert failed.request_ids == [1, 2] and failed.error == ErrorKind.INTERNAL.value
    assert "malformed plan" in failed.message
    stats = rig.stats_of(1)
    assert not stats.ok and stats.batch_size == 0
    assert _counters(rig)["plans_refused"] == 1


def test_stats_project_the_device_free_time_over_the_plans_still_held(rig: BackendRig) -> None:
    t0 = time.monotonic()
    _send_plan(rig, 1, [1], t0 - 0.200, [])  # runs as soon as its inputs are in (22 ms)
    _send_plan(rig, 2, [2, 3], t0 + 0.005, [])  # due before plan 1 can finish: held, then next
    # Inputs of plan 1 first: plan 2 is already queued on the plan socket by then, and plan 1
    # runs 22 ms, so plan 2 is held when plan 1 reports.
    identity, fetch = rig.frontend.expect(InputFetch, where=lambda f: f.plan_id == 1)
    rig.frontend.send(InputReply(1, fetch.request_ids,
                                 [{"x": np.ones((1, 4), np.float32)}], []), identity)
    rig.serve_fetch()
    first = rig.stats_of(1)
    assert first.ok and first.batch_size == 1
    # Free after plan 1's push, then plan 2 (exec_at already passed) for l(2).
    assert first.device_free_at >= first.finished_at + _l(2) - 1e-6
    assert first.device_free_at <= first.finished_at + _l(2) + 0.1
    second = rig.stats_of(2)
    assert second.ok and second.batch_size == 2 and second.started_at >= first.finished_at
    assert second.finished_at <= second.device_free_at <= second.finished_at + 0.1


# --------------------------------------------------------------------------- the rule


TABLE = LatencyProfile.linear(ALPHA_MS, BETA_MS, MAX_BATCH).table_s  # l(k) = 20 + 2k ms


def test_rule_keeps_everything_that_fits() -> None:
    rows = [0, 1, 2]
    kept, shed = shed_late_rows(rows, [1.0, 1.0, 1.0], 0.0, TABLE)
    assert kept == rows and shed == []


def test_rule_sheds_the_earliest_finish_by_until_the_rest_fits_at_its_size() -> None:
    # now 0: l(4) = 28 ms, l(3) = 26 ms. Row 1 (25 ms) cannot make it at any size >= 3; without
    # it the three others fit (26 ms <= 27 ms), so row 0 stays although l(4) > 27 ms.
    finish_by = [0.027, 0.025, 0.030, 0.100]
    kept, shed = shed_late_rows([0, 1, 2, 3], finish_by, 0.0, TABLE)
    assert kept == [0, 2, 3] and shed == [1]


def test_rule_sheds_one_at_a_time_as_the_batch_shrinks() -> None:
    # Rows due at 23, 24.5 and 25.5 ms: l(4) 28 > 23 (shed row 3), l(3) 26 > 24.5 (shed row 0),
    # l(2) 24 <= 25.5: rows 1 and 2 run.
    finish_by = [0.0245, 0.0255, 0.100, 0.023]
    kept, shed = shed_late_rows([0, 1, 2, 3], finish_by, 0.0, TABLE)
    assert kept == [1, 2] and shed == [3, 0]


def test_rule_grace_and_the_start_time() -> None:
    finish_by = [0.020, 0.500]
    assert shed_late_rows([0, 1], finish_by, 0.0, TABLE) == ([1], [0])
    # 4 ms of grace: l(2) = 24 ms <= 20 + 4 ms
    assert shed_late_rows([0, 1], finish_by, 0.0, TABLE, grace_s=0.004) == ([0, 1], [])
    # starting at 0.49: even alone (22 ms) nothing finishes by 0.5
    assert shed_late_rows([0, 1], finish_by, 0.49, TABLE) == ([], [0, 1])


def test_rule_only_looks_at_the_given_rows() -> None:
    # Row 1 (already left out: cancelled or missing) is due long ago; it does not count.
    finish_by = [1.0, -5.0, 1.0]
    assert shed_late_rows([0, 2], finish_by, 0.0, TABLE) == ([0, 2], [])
