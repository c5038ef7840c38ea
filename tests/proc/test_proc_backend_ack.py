"""A backend acknowledges each plan from the loop that runs its batches, exactly once: on its next
``BatchStats`` to that shard or, held ``ACK_HOLD_S`` without one, alone (``PlanAck``); a backend
whose running batch is wedged neither acknowledges nor heartbeats; a scheduler process that hosts
the rank and the shard gets each report once. The real backend process with the test playing the
rank, a shard and a frontend."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from proc_harness import Harness, cluster_config, role_config_for
from runtime_helpers import wait_until
from test_proc_backend import FRONTEND, MAX_BATCH, MODEL, BackendRig, start_backend

from zserve.backends.liveness import WEDGED_MIN_S
from zserve.transport.messages import (
    BackendRegister,
    BatchOutputs,
    BatchStats,
    Heartbeat,
    InputFetch,
    InputReply,
    PlanAck,
    StatsReply,
    StatsRequest,
)

# The emulated batch really runs this long, while its plan (BackendRig.plan) says 22 ms: from
# WEDGED_MIN_S into it the backend counts it wedged (WEDGED_FACTOR x 22 ms is far less).
STUCK_S = WEDGED_MIN_S + 1.5
QUIET_S = 0.6  # longer than a heartbeat interval (0.5 s)
# The drain of the stuck-exit test: over well before the batch (its wait for the running batch
# adds WEDGED_MIN_S past the plan's finish, still 1.5 s short of STUCK_S).
SHORT_DRAIN_S = 0.2


def _start(h: Harness, drain_s: float = 5.0) -> BackendRig:
    cluster = cluster_config(
        [{"name": MODEL, "max_batch": MAX_BATCH,
          "emulated": {"alpha_ms": 0.0, "beta_ms": STUCK_S * 1e3}}],
        cluster={"drain_s": drain_s},
        backends={"device": "emulated"},
    )
    rank = h.router("rank")
    frontend = h.router("fe-data")
    child = h.start("backend", role_config_for(cluster, "backend", 0, h.dir))
    h.await_ready(child, {"rank/rank": rank.endpoint, f"{FRONTEND}/data": frontend.endpoint})
    _, register = rank.expect(BackendRegister)
    shard = h.dealer(register.plan_address, "shard-0")
    return BackendRig(h, child, rank=rank, shard=shard, frontend=frontend, register=register)


def _send_plan(rig: BackendRig, plan_id: int, exec_at: float) -> None:
    rig.plan(plan_id, [plan_id], exec_at)


def _serve_fetch(rig: BackendRig) -> None:
    identity, fetch = rig.frontend.expect(InputFetch)
    inputs = [{"x": np.full((1, 4), float(rid), np.float32)} for rid in fetch.request_ids]
    rig.frontend.send(InputReply(fetch.plan_id, fetch.request_ids, inputs, []), identity)


def test_proc_backend_acks_plans_unless_its_batch_is_wedged(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        rig = _start(h)
        rig.rank.expect(Heartbeat)
        now = time.monotonic()
        _send_plan(rig, 1, now)  # acknowledged at once, then it runs for STUCK_S
        _, ack = rig.shard.expect(PlanAck)
        assert ack.plan_ids == [1] and ack.received_at >= now
        _serve_fetch(rig)
        # Once the batch counts as wedged (its stats say so), listen for QUIET_S: no
        # heartbeat, and a plan sent now gets no acknowledgement.
        last: dict[str, Any] = {}

        def wedged() -> dict[str, Any] | None:
            rig.shard.send(StatsRequest(reset=False))
            last.clear()
            last.update(rig.shard.expect(StatsReply)[1].stats)
            return dict(last) if last["wedged"] else None

        wait_until(wedged, lambda: f"the batch to count as wedged; last stats {last}",
                   timeout_s=now + STUCK_S - time.monotonic())
        wedged_at = time.monotonic()
        rig.rank.drain_kind(Heartbeat)
        _send_plan(rig, 2, time.monotonic())
        end = time.monotonic() + QUIET_S
        while time.monotonic() < end:
            if rig.shard.sock.poll(int((end - time.monotonic()) * 1000) + 1):
                rig.shard.recv(0.0)
                raise AssertionError("a wedged backend acknowledged a plan")
        late = [hb for hb in rig.rank.drain_kind(Heartbeat) if hb.sent_at > wedged_at]
        assert late == [], "a wedged backend heartbeated"
        # Once the batch ends the backend heartbeats and acknowledges again.
        rig.frontend.expect(BatchOutputs, timeout=STUCK_S + 5.0)
        _send_plan(rig, 3, time.monotonic() + 10.0)
        _, ack = rig.shard.expect(PlanAck, where=lambda a: 3 in a.plan_ids)
        rig.rank.expect(Heartbeat)
    finally:
        h.close()


def test_proc_backend_whose_batch_outlasts_the_drain_exits_1_without_it(tmp_path: Path) -> None:
    """A batch still running once the drain gave up on it holds the executor (ONNX Runtime's
    worker thread, which the interpreter would join forever): the backend closes everything
    else and leaves with exit code 1 before the batch ends."""
    h = Harness(tmp_path)
    try:
        rig = _start(h, drain_s=SHORT_DRAIN_S)
        _send_plan(rig, 1, time.monotonic())
        rig.shard.expect(PlanAck)
        _serve_fetch(rig)

        def busy_s() -> float:
            rig.shard.send(StatsRequest(reset=False))
            busy: float = rig.shard.expect(StatsReply)[1].stats["busy_total_s"]
            return busy

        # Until the batch holds the device (it then runs for STUCK_S).
        wait_until(busy_s, "the batch to start", timeout_s=STUCK_S)
        rig.child.terminate()
        # Exit code 1: the batch still ran when the host closed, and the process did not wait
        # for it (its outputs never came).
        assert rig.child.wait(timeout=STUCK_S + 5.0) == 1, rig.child.log()
        assert "a batch is still running after the drain; exiting without it" in rig.child.log()
        assert rig.frontend.drain_kind(BatchOutputs) == []
    finally:
        h.close()


def test_proc_backend_reports_once_to_a_scheduler_that_hosts_both(tmp_path: Path) -> None:
    """With the rank in the shard's process (peer ``shard-0``, as with ``shards = 0``), each
    plan's BatchStats goes only to the plan socket, and each plan is acknowledged exactly once,
    on a report or alone."""
    h = Harness(tmp_path)
    try:
        rig = start_backend(h, rank_process="shard-0")
        rig.rank.expect(Heartbeat)
        reports = []
        for plan_id in (1, 2, 3):
            rig.plan(plan_id, [plan_id], time.monotonic())
            rig.serve_fetch()
            rig.frontend.expect(BatchOutputs)
            reports.append(rig.shard.expect(BatchStats)[1])
        reported_at = time.monotonic()
        assert [r.plan_id for r in reports] == [1, 2, 3]
        # Everything a report acknowledges, and any PlanAck before it on the same connection.
        acked = [i for r in reports for i in r.acked_plan_ids]
        acked += [i for a in rig.shard.drain_kind(PlanAck) for i in a.plan_ids]
        assert sorted(acked) == [1, 2, 3], reports
        rig.shard.send(StatsRequest(reset=False))
        counters = rig.shard.expect(StatsReply)[1].stats["counters"]
        assert counters["acks_on_reports"] + counters["acks_alone"] == 3, counters
        # A heartbeat sent after the last report follows any report on the rank's connection.
        rig.rank.expect(Heartbeat, where=lambda hb: hb.sent_at > reported_at + 0.05)
        assert rig.rank.drain_kind(BatchStats) == []
    finally:
        h.close()
