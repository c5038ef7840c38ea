"""SentPlans: a shard's record of the plans it sent, for failing a departed GPU's requests."""

from __future__ import annotations

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
    assert sent.take(1.6, 0) == {"fa": [3]}
    assert len(sent) == 1
    assert sent.take(1.6, 0) == {}
    assert sent.take(1.6, 1) == {"fb": [9]} and len(sent) == 0
