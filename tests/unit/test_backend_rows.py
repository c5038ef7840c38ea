"""The backend side of requests that carry a batch: the plan follower checks and sheds in rows,
the batch runner concatenates mixed row counts, and each request gets its own rows back as views
of the batch's outputs (emulated executor: a function of each row's own inputs)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from zserve.backends.batch_runner import BatchRunner, request_rows
from zserve.backends.emulated import EmulatedExecutor, EmulatedModel
from zserve.backends.follower import (
    BACKEND_HISTOGRAMS,
    DEST_DEVICE,
    PlanFollower,
    RunBatch,
    shed_late_rows,
)
from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.core.hosting import TO_RANK, Outbox
from zserve.core.stats import Stats
from zserve.runtime.clock import ClusterClock
from zserve.transport.messages import BatchFailed, BatchPlan, BatchStats, InputReply

PROFILE = LatencyProfile.linear(1.0, 10.0, 8)  # l(b) = b + 10 ms, b <= 8 rows
FRONTEND = "ipc://frontend-0.data"


def _follower() -> PlanFollower:
    follower = PlanFollower("backend-0")
    follower.add_model("m", PROFILE.table_s, PROFILE.max_batch)
    return follower


def _plan(plan_id: int, rows: list[int], finish_by: list[float] | None = None) -> BatchPlan:
    ids = list(range(1, len(rows) + 1))
    return BatchPlan(plan_id, "m", 0, 0.0, PROFILE.latency(sum(rows)), [FRONTEND],
                     [0] * len(ids), ids, finish_by or [1.0] * len(ids), rows)


def test_late_shedding_counts_the_rows_a_request_holds() -> None:
    # 6 + 1 + 1 rows: l(8) = 18 ms misses the first request's 15 ms, l(2) = 12 ms fits the rest
    finish_by = [0.015, 0.016, 0.017]
    assert shed_late_rows([0, 1, 2], finish_by, 0.0, PROFILE.table_s, sizes=[6, 1, 1]) == (
        [1, 2], [0])
    # counted as one row each the batch would look like l(3) = 13 ms, and nothing would go
    assert shed_late_rows([0, 1, 2], finish_by, 0.0, PROFILE.table_s) == ([0, 1, 2], [])
    # 1 + 6 + 1 rows: shedding the first (l(7) = 17 ms) is not enough; the 6 goes too
    assert shed_late_rows([0, 1, 2], [0.012, 0.013, 0.02], 0.0, PROFILE.table_s,
                          sizes=[1, 6, 1]) == ([2], [0, 1])


def test_a_plan_over_max_batch_rows_or_with_bad_rows_is_refused() -> None:
    follower = _follower()
    outbox: Outbox = []
    follower.on_plan(0.0, _plan(1, [5, 4]), outbox)  # 9 rows > 8
    follower.on_plan(0.0, BatchPlan(2, "m", 0, 0.0, 0.02, [FRONTEND], [0, 0], [7, 8], [],
                                    [3]), outbox)  # one entry for two requests
    failed = [m for _, m in outbox if isinstance(m, BatchFailed)]
    assert [(f.request_ids, f.error) for f in failed] == [
        ([1, 2], ErrorKind.INTERNAL.value), ([7, 8], ErrorKind.INTERNAL.value)]
    assert follower.counters["plans_refused"] == 2


def test_a_plan_of_mixed_rows_runs_and_reports_its_rows() -> None:
    follower = _follower()
    outbox: Outbox = []
    plan = _plan(1, [5, 1, 2])
    follower.on_plan(0.0, plan, outbox)
    inputs = [{"x": np.zeros((n, 4), np.float32)} for n in (5, 1, 2)]
    follower.on_input_reply(0.0, FRONTEND, InputReply(1, [1, 2, 3], inputs, []), outbox)
    (run,) = [m for d, m in outbox if d[0] == DEST_DEVICE]
    assert isinstance(run, RunBatch) and run.rows == [0, 1, 2]
    outbox = []
    follower.on_batch_done(0.02, ok=True, finished_at=0.018, outbox=outbox)
    (stats,) = [m for d, m in outbox if d == TO_RANK and isinstance(m, BatchStats)]
    assert stats.batch_size == 8  # rows
    assert follower.counters["requests_ok"] == 3  # requests
    assert follower.batches.batch_histogram["m"] == {"8": 1}


def _runner(executor: EmulatedExecutor) -> BatchRunner:
    stats = Stats((), BACKEND_HISTOGRAMS)
    runner = BatchRunner(executor, ClusterClock(), stats)
    runner.allocate("m")
    return runner


def test_the_runner_gives_each_request_its_own_rows_as_views() -> None:
    executor = EmulatedExecutor([EmulatedModel("m", alpha_ms=0.01, beta_ms=0.01, max_batch=8,
                                               input_shape=(4,), output_shape=(2,))])
    executor.load()
    runner = _runner(executor)
    rng = np.random.default_rng(0)
    requests: list[dict[str, Any]] = [
        {"x": rng.standard_normal((n, 4)).astype(np.float32)} for n in (3, 1, 4)]
    assert request_rows(requests) == [3, 1, 4]
    assert request_rows([requests[1], requests[1]]) is None
    plan = BatchPlan(1, "m", 0, 0.0, 0.0, [FRONTEND], [0, 0, 0], [1, 2, 3], [], [3, 1, 4])
    result = asyncio.run(runner.run(RunBatch(plan, [0, 1, 2], requests, 0.0)))
    assert result.error == ""
    assert [out["y"].shape for out in result.outputs] == [(3, 2), (1, 2), (4, 2)]
    base = result.outputs[0]["y"].base
    assert base is not None and all(out["y"].base is base for out in result.outputs)
    for request, out in zip(requests, result.outputs, strict=True):
        np.testing.assert_array_equal(out["y"], executor.expected_outputs("m", request)["y"])
    # A request alone is passed through with no copy and gets all its rows back.
    alone = asyncio.run(runner.run(RunBatch(plan, [2], [requests[2]], 0.0)))
    np.testing.assert_array_equal(alone.outputs[0]["y"], result.outputs[2]["y"])
    # More rows than the buffer holds fails this batch only, with a message.
    big = [{"x": np.zeros((5, 4), np.float32)}, {"x": np.zeros((4, 4), np.float32)}]
    failed = asyncio.run(runner.run(RunBatch(plan, [0, 1], big, 0.0)))
    assert failed.outputs == [] and failed.error
