"""ShardPlanAcks on its own: a shard's sent plans, their acknowledgements, the suspicion of a
backend that does not acknowledge in time, and the split of its plans when it goes."""

from __future__ import annotations

import math

import pytest

from zserve.core.errors import ErrorKind
from zserve.core.hosting import DEST_FRONTEND, TO_RANK, Outbox
from zserve.scheduler.shard_acks import ShardPlanAcks
from zserve.transport.messages import BackendSuspect, BatchPlan, DropNotice

ALLOWANCE_S = 0.1


def _plan(plan_id: int, gpu_id: int, ids: list[int], frontend_of: list[int]) -> BatchPlan:
    return BatchPlan(plan_id=plan_id, model="m", gpu_id=gpu_id, exec_at=1.0,
                     expected_finish_at=1.01, frontends=["fa", "fb"],
                     request_frontend=frontend_of, request_ids=ids, finish_by=[1.05] * len(ids))


def test_an_acknowledgement_is_due_within_the_allowance_and_counted_once() -> None:
    acks = ShardPlanAcks(ALLOWANCE_S)
    assert acks.wake_at == math.inf and len(acks) == 0
    acks.remember(0.0, 0, _plan(1, 0, [1], [0]), slo_s=0.5)
    acks.remember(0.02, 0, _plan(2, 0, [2], [0]), slo_s=0.5)
    assert acks.wake_at == pytest.approx(ALLOWANCE_S) and len(acks) == 2
    assert acks.acknowledge([1]) == 1
    assert acks.wake_at == pytest.approx(0.02 + ALLOWANCE_S)
    assert acks.acknowledge([1, 2, 99]) == 1  # a repeat and an unknown plan count nothing
    assert acks.counters["plan_acks"] == 2 and acks.wake_at == math.inf
    assert acks.overdue(10.0) == []


def test_an_overdue_plan_makes_its_backend_suspect_and_the_rank_hears_first() -> None:
    counters = {"plan_acks": 0, "suspects": 0, "backend_failed": 0, "other": 5}
    acks = ShardPlanAcks(ALLOWANCE_S, counters)
    acks.remember(0.0, 3, _plan(7, 3, [1, 2], [0, 1]), slo_s=0.5)
    assert acks.overdue(0.05) == []
    assert acks.overdue(0.1) == [(3, 7, 0.0)]
    outbox: Outbox = []
    why = acks.suspect(0.15, 3, 7, 0.0, "tcp://gpu3", outbox)
    assert why == "GPU 3 (tcp://gpu3) did not acknowledge plan 7 within 150 ms"
    assert outbox == [(TO_RANK, BackendSuspect(3, 7, 0.0, why))]
    assert counters == {"plan_acks": 0, "suspects": 1, "backend_failed": 0, "other": 5}
    assert acks.overdue(0.15) == [(3, 7, 0.0)]  # still held: the host releases it


def test_a_stall_of_the_shard_is_credited_before_it_judges_and_a_hung_backend_still_goes(
) -> None:
    """The ack timer (due at 0.1) ran at 1.1: the shard itself was stalled a second, and on a
    loaded host its backends with it; the acknowledgements get the allowance again from the
    end of the stall, so nothing is overdue yet, and one that comes after the stall keeps its
    backend. A backend that never acknowledges is suspected once that allowance has passed."""
    acks = ShardPlanAcks(ALLOWANCE_S)
    acks.remember(0.0, 0, _plan(1, 0, [1], [0]), slo_s=5.0)
    acks.remember(0.0, 1, _plan(2, 1, [2], [0]), slo_s=5.0)
    assert acks.overdue(1.1) == [(0, 1, 0.0), (1, 2, 0.0)]  # judged without the credit
    assert acks.credit_stall(1.1) == pytest.approx(1.0)
    assert acks.overdue(1.1) == [] and acks.wake_at == pytest.approx(1.1 + ALLOWANCE_S)
    assert acks.acknowledge([1]) == 1  # backend 0's acknowledgement, late with the stall
    later = acks.wake_at + 0.001
    assert acks.credit_stall(later) == 0.0  # a timer on time credits nothing
    assert acks.overdue(later) == [(1, 2, 0.0)]  # backend 1 never acknowledged


def test_a_lost_backends_unacknowledged_plans_come_back_and_acknowledged_ones_fail() -> None:
    acks = ShardPlanAcks(ALLOWANCE_S)
    unacked = _plan(1, 0, [1, 2], [0, 1])
    acks.remember(0.0, 0, unacked, slo_s=2.0)
    acks.remember(0.0, 0, _plan(2, 0, [3, 4, 5], [0, 1, 1]), slo_s=2.0)
    acks.remember(0.0, 1, _plan(3, 1, [6], [0]), slo_s=2.0)  # another GPU's: kept
    acks.acknowledge([2, 3])
    outbox: Outbox = []
    back = acks.release(0.5, 0, "GPU 0 left the cluster", outbox)
    assert back == [unacked]
    failed = ErrorKind.BACKEND_FAILED.value
    assert outbox == [((DEST_FRONTEND, "fa"), DropNotice([3], failed, "GPU 0 left the cluster")),
                      ((DEST_FRONTEND, "fb"), DropNotice([4, 5], failed,
                                                         "GPU 0 left the cluster"))]
    assert acks.counters["backend_failed"] == 3
    assert len(acks) == 1 and acks.wake_at == math.inf  # nothing of GPU 0 awaited any more
    assert acks.release(0.5, 0, "again", outbox) == [] and len(outbox) == 2
