"""Plan acknowledgement through the scheduler processes (the rig of test_proc_scheduler: rank and
shard processes, the test plays the frontend and two backends): a plan its backend does not
acknowledge makes that backend suspect at once, its requests are planned again onto the other
backend instead of failing, and a heartbeat the suspect sends afterwards brings it back."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from proc_harness import Harness, Peer
from test_proc_scheduler import MAX_BATCH, MODELS, WAIT_S, SchedulerRig, _profile_ms

from zserve.core.errors import ErrorKind
from zserve.scheduler.sent_plans import PLAN_ACK_MARGIN_S
from zserve.transport.messages import (
    BackendRegister,
    BackendTable,
    BatchPlan,
    DropNotice,
    Heartbeat,
    StatsReply,
    StatsRequest,
)

BOTH = ["backend-0", "backend-1"]


def _register_second_backend(h: Harness, rig: SchedulerRig) -> Peer:
    """A second test backend (GPU 1): its plan ROUTER, once every shard serves both GPUs."""
    plans = h.router("be1-plan")
    to_rank = h.dealer(rig.rank_endpoint, "backend-1")
    to_rank.send(BackendRegister(
        name="backend-1", device="emulated", plan_address=plans.endpoint,
        models=list(MODELS), profiles_ms={m: _profile_ms() for m in MODELS}))
    rig.fe_rank.expect(BackendTable, where=lambda t: t.names == BOTH)
    deadline = time.monotonic() + WAIT_S
    for peer in rig.to_shard:
        while _stats(peer)["models"]["beta"]["gpus"] != [0, 1]:
            assert time.monotonic() < deadline, "a shard never saw the second backend"
    return plans


def _stats(peer: Peer) -> dict[str, Any]:
    peer.send(StatsRequest(reset=False))
    stats: dict[str, Any] = peer.expect(StatsReply)[1].stats
    return stats


@pytest.mark.parametrize("shards", [0, 1])
def test_proc_unacknowledged_plan_is_planned_again_elsewhere(tmp_path: Path,
                                                              shards: int) -> None:
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards, plan_ack_margin_s=None)
        rig.register_backend()
        other = _register_second_backend(h, rig)
        rig.plans.ack_plans = False  # backend-0 (GPU 0) hangs: it never acknowledges
        ids = list(range(51, 51 + MAX_BATCH))  # a full batch: planned at once, onto GPU 0
        rig.send_requests("beta", ids, budget_s=2.0)
        _, plan = rig.plans.expect(BatchPlan)
        sent = time.monotonic()
        assert plan.gpu_id == 0 and sorted(plan.request_ids) == ids
        # Suspect at once: the rank's table drops GPU 0 (not after the rig's 30 s timeout) ...
        rig.fe_rank.expect(BackendTable, where=lambda t: t.names == ["backend-1"])
        assert time.monotonic() - sent < PLAN_ACK_MARGIN_S + 1.0
        # ... and the same requests are planned again, onto GPU 1, with nothing dropped.
        _, again = other.expect(BatchPlan)
        assert again.gpu_id == 1 and sorted(again.request_ids) == ids
        assert rig.shard_of("beta").drain_kind(DropNotice) == []
        shard = _stats(rig.shard_of("beta"))["counters"]
        assert shard["replanned"] == MAX_BATCH and shard["suspects"] == 1, shard
        assert shard["backend_failed"] == 0 and shard["plan_acks"] >= 1, shard
        rank = _stats(rig.fe_rank)
        assert rank["counters"]["suspects"] == 1 and rank["gpus"]["0"]["suspect"], rank
        # A heartbeat sent after the suspicion brings backend-0 back into the table.
        rig.be_rank.send(Heartbeat("backend-0", 2, time.monotonic()))
        rig.fe_rank.expect(BackendTable, where=lambda t: t.names == BOTH)
        rank = _stats(rig.fe_rank)
        assert rank["counters"]["revivals"] == 1 and not rank["gpus"]["0"]["suspect"], rank
    finally:
        h.close()


def test_proc_unacknowledged_plan_without_another_backend_is_unavailable(
        tmp_path: Path) -> None:
    """With no live backend left for the model, the requests of a plan that was never
    acknowledged are answered UNAVAILABLE (they never ran) at once, not at their deadline."""
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards=0, plan_ack_margin_s=None)
        rig.register_backend()
        rig.plans.ack_plans = False
        ids = list(range(61, 61 + MAX_BATCH))
        rig.send_requests("beta", ids, budget_s=20.0)
        rig.plans.expect(BatchPlan)
        _, drop = rig.shard_of("beta").expect(DropNotice)
        assert sorted(drop.request_ids) == ids and drop.error == ErrorKind.UNAVAILABLE, drop
    finally:
        h.close()
