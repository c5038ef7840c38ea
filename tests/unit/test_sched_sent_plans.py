"""SentPlans: a shard's record of the plans it sent, for failing a departed GPU's requests, and
which of them their backend acknowledged."""

from __future__ import annotations

import math

from zserve.scheduler.sent_plans import SentPlans
from zserve.transport.messages import BatchPlan


def _plan(plan_id: int, exec_at: float, ids: list[int], frontend_of: list[int]) -> BatchPlan:
    return BatchPlan(plan_id=plan_id, model="m", gpu_id=0, exec_at=exec_at,
                     expected_finish_at=exec_at + 0.01, frontends=["fa", "fb"],
                     request_frontend=frontend_of, request_ids=ids)


def test_a_departed_gpus_unexpired_plans_come_back_by_frontend() -> None:
    sent = SentPlans()
    sent.remember(0.0, 0, _plan(1, exec_at=1.0, ids=[1, 2], frontend_of=[0, 1]), slo_s=0.5)
    sent.remember(0.0, 0, _plan(2, exec_at=2.0, ids=[3], frontend_of=[0]), slo_s=0.5)
    sent.remember(0.0, 1, _plan(3, exec_at=2.0, ids=[9], frontend_of=[1]), slo_s=0.5)
    assert len(sent) == 3
    # at 1.6 s plan 1's requests have all been answered (exec_at + SLO passed): forgotten
    assert sent.take(1.6, 0).acked == {"fa": [3]}
    assert len(sent) == 1
    assert sent.take(1.6, 0).acked == {}
    taken = sent.take(1.6, 1)
    assert taken.acked == {"fb": [9]} and taken.unacked == [] and len(sent) == 0


def test_an_unacknowledged_plan_names_its_gpu_once_due_and_comes_back_whole() -> None:
    """A plan awaits its PlanAck until ``ack_due``: ``wake_at`` is the earliest due time still
    awaited; past it, ``overdue`` names the GPU, and ``take`` returns the plans the backend never
    acknowledged (to plan again) apart from the acknowledged ones' requests (to fail)."""
    sent = SentPlans()
    plans = [_plan(i, exec_at=1.0, ids=[10 * i], frontend_of=[0]) for i in (1, 2, 3)]
    sent.remember(0.0, 0, plans[0], slo_s=0.5, ack_due=0.1)
    sent.remember(0.01, 0, plans[1], slo_s=0.5, ack_due=0.11)
    sent.remember(0.02, 1, plans[2], slo_s=0.5, ack_due=0.12)
    assert sent.wake_at == 0.1 and sent.unacked == 3
    assert sent.acknowledge([1, 99]) == 1  # an unknown id counts nothing
    assert sent.acknowledge([1]) == 0 and sent.wake_at == 0.11
    assert sent.overdue(0.105) == []
    assert sent.overdue(0.115) == [(0, 2, 0.01)]
    assert sent.acknowledge([3]) == 1
    assert sent.overdue(1.0) == [(0, 2, 0.01)]
    taken = sent.take(0.2, 0)
    assert taken.unacked == [plans[1]] and taken.acked == {"fa": [10]}
    assert sent.wake_at == math.inf and sent.overdue(1.0) == [] and sent.unacked == 0


def test_an_unacknowledged_plan_outlives_its_slo_until_its_ack_is_due() -> None:
    """A plan whose SLO ends before its acknowledgement is due is still judged: it is kept
    until then, so a short SLO cannot hide a hung backend."""
    sent = SentPlans()
    sent.remember(0.0, 0, _plan(1, exec_at=0.005, ids=[1], frontend_of=[0]), slo_s=0.02,
                  ack_due=0.1)
    sent.forget_expired(0.05)
    assert sent.overdue(0.1) == [(0, 1, 0.0)]
    assert [p.plan_id for p in sent.take(0.1, 0).unacked] == [1]
