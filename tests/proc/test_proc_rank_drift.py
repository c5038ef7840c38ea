"""Late shedding and drift correction through the scheduler processes (the rig of
test_proc_scheduler: rank and shard processes, the test plays the frontend and the backend):
plans carry each request's deadline as ``finish_by``, and a backend's ``device_free_at`` report
moves its GPU later in the rank, so the rank stops granting it for the time it is really busy."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from proc_harness import Harness
from runtime_helpers import wait_until
from test_proc_scheduler import WAIT_S, SchedulerRig

from zserve.core.errors import ErrorKind
from zserve.transport.messages import (
    BatchPlan,
    BatchStats,
    DropNotice,
    RequestMetaBatch,
    StatsReply,
    StatsRequest,
)

DRIFT_S = 5.0


@pytest.mark.parametrize("shards", [0, 1])
def test_proc_device_free_at_report_moves_the_gpu_later(tmp_path: Path, shards: int) -> None:
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards)
        rig.register_backend()
        now = time.monotonic()
        deadline = now + 0.25
        rig.shard_of("alpha").send(RequestMetaBatch(rig.data_address, [1], ["alpha"], [now],
                                                    [deadline]))
        _, plan = rig.plans.expect(BatchPlan, timeout=WAIT_S)
        assert plan.request_ids == [1] and plan.finish_by == [deadline]
        # The shard answers the grant right after sending the plan: wait until the rank has the
        # answer (a report for a GPU still granted and unanswered is ignored).
        last: dict[str, Any] = {}

        def grant_answered() -> dict[str, Any] | None:
            rig.fe_rank.send(StatsRequest(reset=False))
            last.clear()
            last.update(rig.fe_rank.expect(StatsReply)[1].stats)
            return dict(last) if last["counters"]["grant_answers"] >= 1 else None

        stats = wait_until(grant_answered,
                           lambda: f"the rank to have the grant's answer; last stats {last}",
                           timeout_s=now + WAIT_S - time.monotonic())
        assert stats["rank_thread"]["drift_corrections"] == 0
        # The backend reports its device free DRIFT_S later than planned (same DEALER, so the
        # rank handles the report before the StatsRequest).
        free_at = plan.expected_finish_at + DRIFT_S
        rig.be_rank.send(BatchStats(plan.plan_id, plan.model, plan.gpu_id, 1, plan.exec_at,
                                    plan.exec_at, plan.expected_finish_at, True, 0, free_at))
        rig.be_rank.send(StatsRequest(reset=False))
        _, reply = rig.be_rank.expect(StatsReply)
        drift = reply.stats["rank_thread"]
        assert drift["drift_corrections"] == 1
        assert drift["drift_corrected_ms"] == pytest.approx(DRIFT_S * 1e3)
        # A report from a peer that is not the GPU's backend changes nothing.
        rig.fe_rank.send(BatchStats(plan.plan_id, plan.model, plan.gpu_id, 1, plan.exec_at,
                                    plan.exec_at, plan.expected_finish_at, True, 0,
                                    free_at + DRIFT_S))
        rig.fe_rank.send(StatsRequest(reset=False))
        _, reply = rig.fe_rank.expect(StatsReply)
        assert reply.stats["rank_thread"]["drift_corrections"] == 1
        # The only GPU is busy for seconds: a request due in 250 ms is not planned onto it but
        # dropped at its last moment (without the report the GPU would be free by then).
        now = time.monotonic()
        rig.shard_of("alpha").send(RequestMetaBatch(rig.data_address, [2], ["alpha"], [now],
                                                    [now + 0.25]))
        _, drop = rig.shard_of("alpha").expect(DropNotice, timeout=WAIT_S)
        assert drop.request_ids == [2] and drop.error == ErrorKind.DEADLINE
        assert rig.plans.drain_kind(BatchPlan) == []
    finally:
        h.close()
