"""Late shedding and drift correction through the scheduler processes (the rig of
test_proc_scheduler: rank and shard processes, the test plays the frontend and the backend):
plans carry each request's deadline as ``finish_by``, and a backend's ``device_free_at`` report
moves its GPU later in the rank, so the rank stops granting it for the time it is really busy.
With the rank embedded, the report reaches the rank through the shard, and the acknowledgement it
carries is the plan's only one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from proc_harness import Harness, Peer
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


def _rank_stats(peer: Peer) -> dict[str, Any]:
    peer.send(StatsRequest(reset=False))
    stats: dict[str, Any] = peer.expect(StatsReply)[1].stats
    return stats


def _await_grant_answer(rig: SchedulerRig, start: float) -> dict[str, Any]:
    """The rank's stats once it has the grant's answer (the shard answers the grant right after
    sending the plan; a report for a GPU still granted and unanswered is ignored)."""
    last: dict[str, Any] = {}

    def grant_answered() -> dict[str, Any] | None:
        last.clear()
        last.update(_rank_stats(rig.fe_rank))
        return dict(last) if last["counters"]["grant_answers"] >= 1 else None

    stats: dict[str, Any] = wait_until(
        grant_answered, lambda: f"the rank to have the grant's answer; last stats {last}",
        timeout_s=start + WAIT_S - time.monotonic())
    return stats


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
        stats = _await_grant_answer(rig, now)
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


def test_proc_embedded_rank_reads_the_report_its_shard_got(tmp_path: Path) -> None:
    """With the rank embedded (``shards = 0``) a backend sends a plan's ``BatchStats`` once, on
    its plan socket, carrying the plan's acknowledgement: the shard takes the acknowledgement (no
    ``PlanAck`` came, and nothing is suspected) and hands the report to its rank, whose
    drift correction moves the GPU later."""
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, 0)
        rig.register_backend()
        rig.plans.ack_plans = False  # the report below is the only acknowledgement
        now = time.monotonic()
        rig.shard_of("alpha").send(RequestMetaBatch(rig.data_address, [1], ["alpha"], [now],
                                                    [now + 0.25]))
        shard, plan = rig.plans.expect(BatchPlan, timeout=WAIT_S)
        assert _await_grant_answer(rig, now)["rank_thread"]["drift_corrections"] == 0
        rig.plans.send(BatchStats(plan.plan_id, plan.model, plan.gpu_id, 1, plan.exec_at,
                                  plan.exec_at, plan.expected_finish_at, True, 0,
                                  plan.expected_finish_at + DRIFT_S, [plan.plan_id]), shard)
        last: dict[str, Any] = {}

        def corrected() -> dict[str, Any] | None:
            last.clear()
            last.update(_rank_stats(rig.fe_rank))
            return dict(last) if last["rank_thread"]["drift_corrections"] else None

        drift = wait_until(corrected, lambda: f"the drift correction; last stats {last}",
                           timeout_s=WAIT_S)["rank_thread"]
        assert drift["drift_corrections"] == 1
        assert drift["drift_corrected_ms"] == pytest.approx(DRIFT_S * 1e3)
        counters = _rank_stats(rig.shard_of("alpha"))["counters"]
        assert counters["plan_acks"] == 1 and counters["suspects"] == 0, counters
        assert _rank_stats(rig.fe_rank)["counters"]["suspects"] == 0
    finally:
        h.close()
