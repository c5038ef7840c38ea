"""PlanFollower, the backend's pure plan logic, driven with no sockets: the test is its host (it
passes ``now`` and an outbox, reads ``wake_at`` back, and answers RunBatch with
on_batch_finished and on_batch_done)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from zserve.backends.follower import (
    DEST_DEVICE,
    FETCH_FLOOR_FACTOR,
    FETCH_FLOOR_MIN_SAMPLES,
    INPUT_WAIT_S,
    LATE_TOLERANCE_S,
    PlanFollower,
    RunBatch,
    latest_start_keeping_all,
    latest_start_keeping_some,
    shed_late_rows,
)
from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.core.hosting import TO_RANK, Outbox
from zserve.transport.messages import (
    BatchFailed,
    BatchOutputs,
    BatchPlan,
    BatchStats,
    CancelFetched,
    InputFetch,
    InputReply,
)

MODEL = "m"
FRONTEND = "ipc://frontend-0.data"
OTHER_FRONTEND = "ipc://frontend-1.data"
PROFILE = LatencyProfile.linear(1.0, 10.0, 8)  # l(b) = b + 10 ms
GRACE_S = 0.002


def only_value(follower: PlanFollower, metric: str) -> float:
    """The one value observed in ``metric`` (exact: a histogram keeps its min and max)."""
    hist = follower.histograms[metric]
    assert hist.count == 1 and hist.min == hist.max
    return hist.max


def l_s(bs: int) -> float:
    return PROFILE.table_s[bs]


def make_follower() -> PlanFollower:
    follower = PlanFollower("backend-0", shed_grace_s=GRACE_S)
    follower.add_model(MODEL, PROFILE.table_s, PROFILE.max_batch)
    return follower


def make_plan(plan_id: int, exec_at: float, ids: list[int], *,
              finish_by: list[float] | None = None,
              frontend_of: list[int] | None = None) -> BatchPlan:
    frontend_of = frontend_of or [0] * len(ids)
    frontends = [FRONTEND, OTHER_FRONTEND][: max(frontend_of) + 1]
    return BatchPlan(plan_id, MODEL, 0, exec_at, exec_at + l_s(len(ids)), frontends,
                     frontend_of, ids,
                     finish_by if finish_by is not None else [exec_at + 1.0] * len(ids))


def inputs_for(ids: list[int], plan_id: int) -> InputReply:
    return InputReply(plan_id, ids, [{"x": np.full((1, 2), rid, np.float32)} for rid in ids], [])


def of_type(outbox: Outbox, kind: type) -> list[Any]:
    return [msg for _, msg in outbox if isinstance(msg, kind)]


def runs(outbox: Outbox) -> list[RunBatch]:
    found = [msg for dest, msg in outbox if dest[0] == DEST_DEVICE]
    assert all(isinstance(m, RunBatch) for m in found)
    return [m for m in found if isinstance(m, RunBatch)]


def hold(follower: PlanFollower, now: float, plan: BatchPlan) -> Outbox:
    """Deliver a plan and, at the same moment, its inputs; the combined outbox."""
    outbox: Outbox = []
    follower.on_plan(now, plan, outbox)
    follower.on_input_reply(now, FRONTEND, inputs_for(plan.request_ids, plan.plan_id), outbox)
    return outbox


def test_plan_fetches_its_inputs_from_every_frontend_at_once() -> None:
    follower = make_follower()
    outbox: Outbox = []
    follower.on_plan(0.0, make_plan(1, 0.010, [5, 6, 7], frontend_of=[0, 1, 0]), outbox)
    fetches = [(dest, msg) for dest, msg in outbox if isinstance(msg, InputFetch)]
    assert fetches == [(("frontend", FRONTEND), InputFetch(1, [5, 7])),
                       (("frontend", OTHER_FRONTEND), InputFetch(1, [6]))]
    assert follower.wake_at == 0.010
    assert not runs(outbox)


def test_plan_starts_at_its_exec_at_not_before() -> None:
    follower = make_follower()
    assert not runs(hold(follower, 0.0, make_plan(1, 0.010, [1, 2])))
    assert follower.wake_at == 0.010
    early: Outbox = []
    follower.on_timer(0.009, early)  # a host calling early: a no-op
    assert not runs(early) and follower.wake_at == 0.010
    outbox: Outbox = []
    follower.on_timer(0.010, outbox)
    (run,) = runs(outbox)
    assert run.started_at == 0.010 and run.rows == [0, 1]
    assert [t["x"][0, 0] for t in run.inputs] == [1.0, 2.0]
    assert follower.wake_at == math.inf  # nothing to wake for while the batch runs
    assert only_value(follower, "lateness") == 0.0


def test_late_plan_runs_at_once_and_records_lateness() -> None:
    follower = make_follower()
    outbox = hold(follower, 0.105, make_plan(1, 0.100, [1, 2]))
    (run,) = runs(outbox)
    assert run.started_at == 0.105
    assert only_value(follower, "lateness") == pytest.approx(0.005)
    assert follower.counters["late_plans"] == 1
    assert only_value(follower, "slack") == pytest.approx(-0.005)


def test_never_two_batches_at_once_on_one_device() -> None:
    follower = make_follower()
    first = hold(follower, 0.0, make_plan(1, 0.0, [1, 2]))
    assert len(runs(first)) == 1
    outbox = hold(follower, 0.001, make_plan(2, 0.005, [3]))  # exec_at inside batch 1
    follower.on_timer(0.005, outbox)
    follower.on_timer(0.010, outbox)
    assert not runs(outbox)
    assert follower.wake_at == math.inf  # on_batch_done drives the next start
    done: Outbox = []
    follower.on_batch_done(0.012, ok=True, finished_at=0.012, outbox=done)
    (run,) = runs(done)
    assert run.plan.plan_id == 2 and run.started_at == 0.012
    lateness = follower.histograms["lateness"]  # batch 1 started on time, batch 2 late
    assert lateness.count == 2 and lateness.min == 0.0
    assert lateness.max == pytest.approx(0.007)
    (stats,) = of_type(done, BatchStats)
    assert (stats.plan_id, stats.batch_size, stats.ok) == (1, 2, True)


def test_a_finished_batch_is_answered_per_frontend_with_its_own_rows_outputs() -> None:
    follower = make_follower()
    outbox: Outbox = []
    follower.on_plan(0.0, make_plan(1, 0.010, [5, 6, 7, 8], frontend_of=[0, 1, 0, 1]), outbox)
    follower.on_input_reply(0.001, FRONTEND, inputs_for([5, 7], 1), outbox)
    follower.on_input_reply(0.001, OTHER_FRONTEND, inputs_for([6, 8], 1), outbox)
    follower.on_cancel_fetched(0.002, OTHER_FRONTEND, CancelFetched([1], [6]), outbox)
    follower.on_timer(0.010, outbox)
    (run,) = runs(outbox)
    assert run.rows == [0, 2, 3]  # request 6 was cancelled: not in the batch, not answered
    outputs = [{"y": np.full((1, 1), float(run.plan.request_ids[row]))} for row in run.rows]
    answer: Outbox = []
    follower.on_batch_finished(0.021, run, outputs, "", finished_at=0.020, outbox=answer)
    assert [dest for dest, _ in answer] == [("frontend", FRONTEND), ("frontend", OTHER_FRONTEND)]
    sent = of_type(answer, BatchOutputs)
    assert [(m.plan_id, m.request_ids, m.started_at, m.finished_at) for m in sent] == [
        (1, [5, 7], 0.010, 0.020), (1, [8], 0.010, 0.020)]
    assert [[float(t["y"][0, 0]) for t in m.outputs] for m in sent] == [[5.0, 7.0], [8.0]]
    assert follower.running is not None  # the device is held until on_batch_done
    assert follower.wake_at == math.inf


def test_a_failed_batch_is_answered_backend_failed_per_frontend() -> None:
    follower = make_follower()
    outbox: Outbox = []
    follower.on_plan(0.0, make_plan(1, 0.0, [5, 6, 7], frontend_of=[0, 1, 0]), outbox)
    follower.on_input_reply(0.0, FRONTEND, inputs_for([5, 7], 1), outbox)
    follower.on_input_reply(0.0, OTHER_FRONTEND, inputs_for([6], 1), outbox)
    (run,) = runs(outbox)
    assert run.rows == [0, 1, 2]
    answer: Outbox = []
    follower.on_batch_finished(0.005, run, [], "ValueError: bad input", finished_at=0.004,
                               outbox=answer)
    failed = of_type(answer, BatchFailed)
    assert [(dest, m.request_ids) for (dest, _), m in zip(answer, failed, strict=True)] == [
        (("frontend", FRONTEND), [5, 7]), (("frontend", OTHER_FRONTEND), [6])]
    assert {(m.error, m.message) for m in failed} == {
        (ErrorKind.BACKEND_FAILED.value, "backend backend-0: ValueError: bad input")}
    done: Outbox = []
    follower.on_batch_done(0.006, ok=False, finished_at=0.004, outbox=done)
    assert follower.counters["batches_failed"] == 1 and follower.counters["requests_failed"] == 3
    assert follower.idle


def test_only_the_running_batch_can_be_answered() -> None:
    follower = make_follower()
    (run,) = runs(hold(follower, 0.0, make_plan(1, 0.0, [1])))
    follower.on_batch_done(0.012, ok=True, finished_at=0.011, outbox=[])
    with pytest.raises(AssertionError, match="not running"):
        follower.on_batch_finished(0.013, run, [{}], "", finished_at=0.011, outbox=[])


def test_rows_that_would_finish_past_their_deadline_are_shed() -> None:
    follower = make_follower()
    now = 0.020  # 20 ms late: l(3) = 13 ms ends at 0.033
    finish_by = [0.040, 0.030, 0.034]  # row 1 cannot make it even with the 2 ms grace
    outbox = hold(follower, now, make_plan(1, 0.000, [10, 11, 12], finish_by=finish_by))
    (failed,) = of_type(outbox, BatchFailed)
    assert (failed.request_ids, failed.error) == ([11], ErrorKind.DEADLINE.value)
    (run,) = runs(outbox)
    assert run.rows == [0, 2]  # l(2) = 12 ms ends at 0.032 <= 0.034 + grace
    assert follower.counters["requests_shed_late"] == 1
    assert shed_late_rows([0, 1, 2], finish_by, now, PROFILE.table_s, GRACE_S) == ([0, 2], [1])


def test_plan_whose_every_row_is_late_is_skipped_and_reports_the_device_free() -> None:
    follower = make_follower()
    outbox = hold(follower, 0.050, make_plan(1, 0.000, [1, 2], finish_by=[0.02, 0.02]))
    assert not runs(outbox)
    (failed,) = of_type(outbox, BatchFailed)
    assert sorted(failed.request_ids) == [1, 2]
    (stats,) = of_type(outbox, BatchStats)
    assert (stats.batch_size, stats.ok, stats.device_free_at) == (0, True, 0.050)
    assert follower.counters["batches_skipped"] == 1
    assert follower.idle


def test_device_free_projection_over_the_plans_still_held() -> None:
    follower = make_follower()
    hold(follower, 0.0, make_plan(1, 0.0, [1]))  # runs; l(1) = 11 ms
    hold(follower, 0.001, make_plan(2, 0.011, [2, 3]))  # right after batch 1: ends 0.023
    last = make_plan(3, 0.040, [4])  # a gap before it: ends 0.051
    hold(follower, 0.001, last)
    # on time: the device frees when the last plan held was planned to finish
    assert follower.device_free_at(0.011) == last.expected_finish_at
    # batch 1 overran by 20 ms: plan 2 slides to 0.031 and pushes plan 3 to 0.043 + 11 ms
    late = follower.device_free_at(0.031)
    assert late == pytest.approx(0.031 + l_s(2) + l_s(1))
    outbox: Outbox = []
    follower.on_batch_done(0.031, ok=True, finished_at=0.030, outbox=outbox)
    stats = [m for dest, m in outbox if dest == TO_RANK and isinstance(m, BatchStats)]
    assert stats[0].plan_id == 1
    # reported before plan 2 starts: plans 2 and 3 still held
    assert stats[0].device_free_at == pytest.approx(late)
    assert stats[0].finished_at == 0.030


def test_projection_of_an_on_time_chain_is_exactly_the_planned_finish() -> None:
    follower = make_follower()
    exec_at = 1e5 + 0.1  # live times are ~1e5 s: no float drift allowed in the projection
    plan = make_plan(1, exec_at, [1, 2, 3])
    hold(follower, exec_at - 0.01, plan)
    assert follower.device_free_at(exec_at - 0.001) == plan.expected_finish_at


def test_inputs_arriving_after_exec_at_start_the_plan_when_they_come() -> None:
    follower = make_follower()
    outbox: Outbox = []
    follower.on_plan(0.0, make_plan(1, 0.010, [1, 2]), outbox)
    follower.on_timer(0.010, outbox)
    assert not runs(outbox)
    # gives up at the latest start that keeps some row: the later finish_by, alone (l(1))
    assert follower.wake_at == pytest.approx(0.010 + 1.0 + GRACE_S - l_s(1))
    follower.on_input_reply(0.013, FRONTEND, inputs_for([1, 2], 1), outbox)
    (run,) = runs(outbox)
    assert run.started_at == 0.013
    assert only_value(follower, "fetch") == pytest.approx(0.013)
    assert only_value(follower, "lateness") == pytest.approx(0.003)
    assert LATE_TOLERANCE_S < 0.003 and follower.counters["late_plans"] == 1


def test_inputs_that_never_come_are_answered_unavailable_and_the_rest_runs() -> None:
    follower = make_follower()
    outbox: Outbox = []
    # Rows 0 and 2 (frontend 0) are here; row 1 (frontend 1) never comes. The plan waits until
    # the latest start at which rows 0 and 2 alone still finish in time (the earliest of them
    # is due at 0.150): waiting never sheds a request whose inputs are here.
    plan = make_plan(1, 0.010, [1, 2, 3], frontend_of=[0, 1, 0],
                     finish_by=[0.150, 0.120, 0.400])
    follower.on_plan(0.0, plan, outbox)
    follower.on_input_reply(0.001, FRONTEND, inputs_for([1, 3], 1), outbox)
    follower.on_timer(0.010, outbox)
    assert not runs(outbox)
    give_up = follower.wake_at
    assert give_up == pytest.approx(0.150 + GRACE_S - l_s(2))
    follower.on_timer(give_up, outbox)
    (failed,) = of_type(outbox, BatchFailed)
    assert (failed.request_ids, failed.error) == ([2], ErrorKind.UNAVAILABLE.value)
    (run,) = runs(outbox)
    assert run.rows == [0, 2]
    assert follower.counters["requests_unavailable"] == 1
    late = inputs_for([2], 1)
    follower.on_input_reply(give_up + 0.001, OTHER_FRONTEND, late, outbox)  # ignored: started
    assert len(runs(outbox)) == 1


def test_inputs_80_ms_after_exec_at_run_every_row_when_the_deadline_is_far() -> None:
    follower = make_follower()
    outbox: Outbox = []
    plan = make_plan(1, 0.010, [1, 2, 3])  # finish_by 1 s after exec_at
    follower.on_plan(0.0, plan, outbox)
    follower.on_timer(0.010, outbox)
    assert follower.wake_at > 0.090  # a frontend 80 ms late can still make it
    follower.on_timer(0.089, outbox)  # (a host's early call is a no-op)
    assert not of_type(outbox, BatchFailed) and not runs(outbox)
    follower.on_input_reply(0.090, FRONTEND, inputs_for([1, 2, 3], 1), outbox)
    assert not of_type(outbox, BatchFailed)
    (run,) = runs(outbox)
    assert run.rows == [0, 1, 2] and run.started_at == 0.090
    assert follower.counters["requests_unavailable"] == 0


def test_inputs_that_never_come_are_answered_when_no_row_could_still_be_served() -> None:
    follower = make_follower()
    outbox: Outbox = []
    finish_by = [0.200, 0.300]
    follower.on_plan(0.0, make_plan(1, 0.010, [1, 2], finish_by=finish_by), outbox)
    follower.on_timer(0.010, outbox)
    # The latest start that keeps a row: row 1 alone, 0.300 + grace - l(1).
    give_up = follower.wake_at
    assert give_up == pytest.approx(0.300 + GRACE_S - l_s(1))
    assert give_up == pytest.approx(
        latest_start_keeping_some([0, 1], finish_by, PROFILE.table_s, GRACE_S))
    follower.on_timer(give_up - 0.001, outbox)
    assert not of_type(outbox, BatchFailed)
    follower.on_timer(give_up, outbox)
    (failed,) = of_type(outbox, BatchFailed)
    assert sorted(failed.request_ids) == [1, 2]
    assert failed.error == ErrorKind.UNAVAILABLE.value  # they never ran
    assert "waited 291.0 ms after the plan arrived" in failed.message
    assert "deadlines" in failed.message
    assert not runs(outbox) and follower.idle
    # Had they come just before it, the batch would have run with the row that still fits.
    other = make_follower()
    hold(other, 0.0, make_plan(1, 0.010, [1, 2], finish_by=finish_by))
    late: Outbox = []
    other.on_timer(give_up, late)  # inputs were in: nothing to wait for; a late start
    (run,) = runs(late)
    assert run.rows == [1]


def test_plan_without_finish_by_keeps_the_fixed_bound() -> None:
    follower = make_follower()
    outbox: Outbox = []
    follower.on_plan(0.0, make_plan(1, 0.010, [1, 2], finish_by=[]), outbox)
    follower.on_timer(0.010, outbox)
    assert follower.wake_at == pytest.approx(0.010 + INPUT_WAIT_S)
    follower.on_timer(follower.wake_at, outbox)
    (failed,) = of_type(outbox, BatchFailed)
    assert (sorted(failed.request_ids), failed.error) == ([1, 2], ErrorKind.UNAVAILABLE.value)
    assert "fixed wait of a plan without deadlines" in failed.message
    # a late plan: from its arrival
    follower.on_plan(0.200, make_plan(2, 0.100, [3], finish_by=[]), outbox)
    assert follower.wake_at == pytest.approx(0.200 + INPUT_WAIT_S)


def test_a_waiting_head_never_makes_a_plan_behind_it_shed() -> None:
    follower = make_follower()
    outbox: Outbox = []
    follower.on_plan(0.0, make_plan(1, 0.010, [1, 2]), outbox)  # due in 1 s; inputs never come
    # Plan 2 (one row, due at 0.100) must start by 0.100 + grace - l(1) = 0.091, so plan 1
    # (planned l(2) = 12 ms) must start by 0.079.
    hold(follower, 0.001, make_plan(2, 0.030, [3], finish_by=[0.100]))
    follower.on_timer(0.010, outbox)
    assert follower.wake_at == pytest.approx(0.100 + GRACE_S - l_s(1) - l_s(2))
    follower.on_timer(follower.wake_at, outbox)
    (failed,) = of_type(outbox, BatchFailed)
    assert (sorted(failed.request_ids), failed.error) == ([1, 2], ErrorKind.UNAVAILABLE.value)
    (run,) = runs(outbox)  # plan 1 had nothing to run: plan 2 starts now, all its rows kept
    assert run.plan.plan_id == 2 and run.rows == [0]
    assert run.started_at + l_s(1) <= 0.100 + GRACE_S
    assert follower.counters["requests_shed_late"] == 0


def _measure_fetches(follower: PlanFollower, fetch_s: float, count: int) -> float:
    """Run ``count`` one-row plans whose inputs come ``fetch_s`` after the plan; the time after."""
    now = 0.0
    for plan_id in range(100, 100 + count):
        outbox: Outbox = []
        follower.on_plan(now, make_plan(plan_id, now + fetch_s + 0.001, [plan_id]), outbox)
        follower.on_input_reply(now + fetch_s, FRONTEND, inputs_for([plan_id], plan_id), outbox)
        follower.on_timer(now + fetch_s + 0.001, outbox)
        assert len(runs(outbox)) == 1
        now += fetch_s + 0.001 + l_s(1)
        follower.on_batch_done(now, ok=True, finished_at=now, outbox=outbox)
    return now


@pytest.mark.parametrize("measured", [False, True])
def test_a_cut_short_head_still_waits_the_measured_fetch_floor(measured: bool) -> None:
    follower = make_follower()
    now = _measure_fetches(follower, 0.020, FETCH_FLOOR_MIN_SAMPLES) if measured else 1.0
    outbox: Outbox = []
    follower.on_plan(now, make_plan(1, now + 0.001, [1]), outbox)  # due in 1 s
    # plan 2 leaves plan 1 no slack at all: the plans behind cut its wait to nothing
    hold(follower, now, make_plan(2, now + 0.012, [2], finish_by=[now + 0.020]))
    follower.on_timer(now + 0.001, outbox)
    assert not runs(outbox)
    # fresh: the fixed wait (a restarted backend); measured: twice the fetches' 20 ms
    floor_s = FETCH_FLOOR_FACTOR * 0.020 if measured else INPUT_WAIT_S
    assert follower.wake_at == pytest.approx(now + floor_s)
    follower.on_input_reply(now + floor_s - 0.001, FRONTEND, inputs_for([1], 1), outbox)
    (run,) = runs(outbox)
    assert run.plan.plan_id == 1 and run.rows == [0]


def test_latest_starts_agree_with_late_shedding() -> None:
    rng = np.random.default_rng(7)
    table = PROFILE.table_s
    for _ in range(300):
        count = int(rng.integers(1, 5))
        sizes = [int(x) for x in rng.integers(1, 3, count)] if rng.random() < 0.5 else []
        finish_by = [float(x) for x in rng.uniform(0.0, 0.05, count)]
        rows = list(range(count))
        every = latest_start_keeping_all(rows, finish_by, table, GRACE_S, sizes=sizes)
        some = latest_start_keeping_some(rows, finish_by, table, GRACE_S, sizes=sizes)
        assert some >= every
        for start, kept_all, kept_some in ((every - 1e-6, True, True), (every + 1e-6, False, None),
                                           (some - 1e-6, None, True), (some + 1e-6, False, False)):
            kept, _ = shed_late_rows(rows, finish_by, start, table, GRACE_S, sizes=sizes)
            if kept_all is not None:
                assert (kept == rows) == kept_all
            if kept_some is not None:
                assert bool(kept) == kept_some
    assert latest_start_keeping_all([], [], table) == math.inf
    assert latest_start_keeping_some([], [], table) == -math.inf


def test_a_lost_fetch_runs_without_that_frontend_at_exec_at() -> None:
    follower = make_follower()
    outbox: Outbox = []
    follower.on_plan(0.0, make_plan(1, 0.010, [1, 2], frontend_of=[0, 1]), outbox)
    follower.on_input_reply(0.001, FRONTEND, inputs_for([1], 1), outbox)
    follower.on_fetch_lost(0.001, 1, OTHER_FRONTEND, outbox)
    assert follower.wake_at == 0.010  # no input wait: nothing more will come
    follower.on_timer(0.010, outbox)
    (run,) = runs(outbox)
    assert run.rows == [0]


def test_missing_and_cancelled_requests_are_left_out() -> None:
    follower = make_follower()
    outbox: Outbox = []
    follower.on_plan(0.0, make_plan(1, 0.010, [1, 2, 3]), outbox)
    follower.on_input_reply(0.001, FRONTEND, InputReply(1, [1, 2], [{}, {}], [3]), outbox)
    follower.on_cancel_fetched(0.002, FRONTEND, CancelFetched([1], [2]), outbox)
    follower.on_timer(0.010, outbox)
    (run,) = runs(outbox)
    assert run.rows == [0]
    assert follower.counters["requests_missing"] == 1
    assert follower.counters["requests_cancelled"] == 1
    follower.on_cancel_fetched(0.011, FRONTEND, CancelFetched([1], [1]), outbox)
    assert follower.counters["cancels_too_late"] == 1
    done: Outbox = []
    follower.on_batch_done(0.022, ok=True, finished_at=0.021, outbox=done)
    (stats,) = of_type(done, BatchStats)
    assert (stats.batch_size, stats.cancelled) == (1, 1)


def test_malformed_or_unknown_plans_are_refused() -> None:
    follower = make_follower()
    outbox: Outbox = []
    bad = BatchPlan(1, MODEL, 0, 0.01, 0.02, [FRONTEND], [0, 0], [1, 2], [0.5])
    follower.on_plan(0.0, bad, outbox)
    unknown = BatchPlan(2, "other", 0, 0.01, 0.02, [FRONTEND], [0], [3], [])
    follower.on_plan(0.0, unknown, outbox)
    failed = of_type(outbox, BatchFailed)
    # a malformed plan is a bug (INTERNAL); one of a model not served here never ran
    assert [(f.request_ids, f.error) for f in failed] == [
        ([1, 2], ErrorKind.INTERNAL.value), ([3], ErrorKind.UNAVAILABLE.value)]
    assert [s.batch_size for s in of_type(outbox, BatchStats)] == [0, 0]
    assert follower.counters["plans_refused"] == 2 and follower.idle


def test_a_removed_model_counts_its_plans_then_refuses_new_ones_unavailable() -> None:
    """The host unloads a model once ``plans_of`` is 0; a plan of it sent before the rank's
    table went out and arriving after the unload is answered UNAVAILABLE (it never ran)."""
    follower = make_follower()
    outbox: Outbox = []
    follower.on_plan(0.0, BatchPlan(1, MODEL, 0, 0.01, 0.02, [FRONTEND], [0], [1], []), outbox)
    assert follower.plans_of(MODEL) == 1 and follower.plans_of("other") == 0
    follower.on_input_reply(0.001, FRONTEND, InputReply(1, [1], [{}], []), outbox)
    follower.on_timer(0.010, outbox)
    done: Outbox = []
    follower.on_batch_done(0.021, ok=True, finished_at=0.02, outbox=done)
    assert follower.plans_of(MODEL) == 0
    follower.remove_model(MODEL)
    late: Outbox = []
    follower.on_plan(0.03, BatchPlan(2, MODEL, 0, 0.04, 0.05, [FRONTEND], [0], [7], []), late)
    (failed,) = of_type(late, BatchFailed)
    assert (failed.request_ids, failed.error) == ([7], ErrorKind.UNAVAILABLE.value)


def test_drain_runs_what_starts_in_time_and_refuses_the_rest() -> None:
    follower = make_follower()
    hold(follower, 0.0, make_plan(1, 0.010, [1]))
    hold(follower, 0.0, make_plan(2, 0.500, [2]))
    outbox: Outbox = []
    follower.drain(0.001, 0.101, outbox)
    (failed,) = of_type(outbox, BatchFailed)
    assert (failed.request_ids, failed.error) == ([2], ErrorKind.SHUTTING_DOWN.value)
    follower.on_plan(0.002, make_plan(3, 0.020, [3]), outbox)
    assert of_type(outbox, BatchFailed)[-1].error == ErrorKind.SHUTTING_DOWN.value
    follower.on_timer(0.010, outbox)
    assert [r.plan.plan_id for r in runs(outbox)] == [1]
    follower.on_batch_done(0.022, ok=True, finished_at=0.021, outbox=outbox)
    assert follower.idle


def test_wake_at_is_always_in_the_future_after_a_call() -> None:
    follower = make_follower()
    rng = np.random.default_rng(3)
    now, plan_id, running = 0.0, 0, False
    for _ in range(300):
        now += float(rng.exponential(0.004))
        outbox: Outbox = []
        if rng.random() < 0.05:  # an empty and a refused plan, while a timer may be overdue
            follower.on_plan(now, BatchPlan(0, MODEL, 0, now, now, [FRONTEND], [], []), outbox)
            follower.on_plan(now, BatchPlan(0, "other", 0, now, now, [FRONTEND], [0], [1]),
                             outbox)
        elif follower.wake_at <= now:
            follower.on_timer(now, outbox)
        elif running and rng.random() < 0.5:
            follower.on_batch_done(now, ok=True, finished_at=now, outbox=outbox)
            running = False
        else:
            plan_id += 1
            size = int(rng.integers(1, 5))
            exec_at = now + float(rng.uniform(-0.005, 0.02))
            finish_by = [exec_at + l_s(size) + float(rng.uniform(-0.01, 0.02))] * size
            outbox = hold(follower, now, make_plan(plan_id, exec_at, list(range(size)),
                                                   finish_by=finish_by))
        started = runs(outbox)
        assert len(started) <= 1 and not (running and started)
        running = running or bool(started)
        assert follower.wake_at > now
