"""The epoch fence in real processes, one role at a time against the test's own sockets: a
backend never runs a plan of an older scheduler epoch once it has seen a newer one, and a
scheduler that hears a newer epoch steps down and exits (zserve.core.epochs)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proc_harness import Harness, cluster_config, role_config_for
from test_proc_backend import BackendRig, start_backend

from zserve.transport.messages import (
    BackendRegister,
    BatchPlan,
    DropNotice,
    Heartbeat,
    Hello,
    InputFetch,
    RequestMetaBatch,
    SchedulerPing,
    StatsReply,
    StatsRequest,
)

OLD_EPOCH = 1_000
NEW_EPOCH = 2_000


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[BackendRig]:
    h = Harness(tmp_path)
    try:
        yield start_backend(h)
    finally:
        h.close()


def _plan(rig: BackendRig, plan_id: int, rid: int, epoch: int) -> BatchPlan:
    plan = BatchPlan(plan_id=plan_id, model="emu", gpu_id=0, exec_at=0.0,
                     expected_finish_at=0.03, frontends=[rig.frontend.endpoint],
                     request_frontend=[0], request_ids=[rid], epoch=epoch)
    rig.shard.send(plan)
    return plan


def _backend_stats(rig: BackendRig) -> dict[str, Any]:
    rig.shard.send(StatsRequest(reset=False))
    _, reply = rig.shard.expect(StatsReply)
    return reply.stats


def test_backend_refuses_plans_of_an_older_epoch_and_registers_with_the_newer(
        rig: BackendRig) -> None:
    _plan(rig, 1, 11, OLD_EPOCH)  # the first active scheduler's plan runs
    rig.serve_fetch()
    identity = rig.register.name.encode()  # its DEALER identity at the rank
    # A standby took over: it announces its epoch; the backend registers with it again.
    hello_at = time.monotonic()
    rig.rank.send(Hello(role="shard", name="rank", pid=os.getpid(), epoch=NEW_EPOCH), identity)
    _, register = rig.rank.expect(BackendRegister)
    # When its device is free, on the cluster clock (this host's: the test plays the rank): not
    # before it was asked, and no later than plan 1's planned run (30 ms) after the answer.
    assert hello_at <= register.device_free_at <= time.monotonic() + 0.03, register
    # The old scheduler resumes and dispatches: refused, never fetched, never answered.
    _plan(rig, 2, 12, OLD_EPOCH)
    _plan(rig, 3, 13, NEW_EPOCH)
    _, fetch = rig.frontend.expect(InputFetch)
    assert fetch.plan_id == 3 and fetch.request_ids == [13]
    stats = _backend_stats(rig)
    assert stats["counters"]["stale_epoch"] == 1
    assert stats["scheduler"] == {"active": "rank", "epoch": NEW_EPOCH,
                                  "plans_by_epoch": {str(OLD_EPOCH): 1, str(NEW_EPOCH): 1}}
    # Its heartbeats tell every scheduler the newest epoch (a superseded one steps down).
    rig.rank.expect(Heartbeat, where=lambda m: m.epoch == NEW_EPOCH)


def test_scheduler_steps_down_when_a_peer_has_seen_a_newer_epoch(tmp_path: Path) -> None:
    cluster = cluster_config(
        [{"name": "emu", "emulated": {"alpha_ms": 2.0, "beta_ms": 20.0}}],
        scheduler={"standby": True},
    )
    h = Harness(tmp_path)
    try:
        config = role_config_for(cluster, "shard", 0, h.dir)
        child = h.start("shard", config)
        ready = h.await_ready(child, {})  # no partner, no backend: active alone
        peer = h.dealer(ready.endpoints["rank"], "frontend-0")
        peer.send(Hello(role="frontend", name="frontend-0", pid=os.getpid()))
        _, hello = peer.expect(Hello)
        assert hello.epoch > 0  # it is active in that epoch
        peer.send(SchedulerPing(name="shard-0b", epoch=hello.epoch, active=True))
        peer.send(StatsRequest(reset=False))
        _, reply = peer.expect(StatsReply)
        assert reply.stats["active"] and reply.stats["epoch"] == hello.epoch  # no newer epoch
        peer.send(Heartbeat(name="frontend-0", seq=1, sent_at=0.0, epoch=hello.epoch + 1))
        assert child.wait() == 0  # it stepped down and left (a supervisor restarts a standby)
        assert "superseded" in child.log()
    finally:
        h.close()


def test_scheduler_ignores_metadata_of_an_older_epoch(tmp_path: Path) -> None:
    """What a frontend sent to a previous scheduler process (queued for it, delivered to its
    successor) carries the older epoch and is not planned: the frontend re-sends it."""
    cluster = cluster_config([{"name": "emu", "emulated": {"alpha_ms": 2.0, "beta_ms": 20.0}}])
    h = Harness(tmp_path)
    try:
        child = h.start("shard", role_config_for(cluster, "shard", 0, h.dir))
        ready = h.await_ready(child, {})
        rank = h.dealer(ready.endpoints["rank"], "frontend-0")
        rank.send(Hello(role="frontend", name="frontend-0", pid=os.getpid()))
        _, hello = rank.expect(Hello)
        shard = h.dealer(ready.endpoints["shard"], "frontend-0")
        for rid, epoch in ((1, hello.epoch - 1), (2, hello.epoch)):
            shard.send(RequestMetaBatch("ipc://frontend-0.data", [rid], ["emu"], [0.0], [1e9],
                                        epoch=epoch))
        _, drop = shard.expect(DropNotice)  # no backend: the current one is refused at once
        assert drop.request_ids == [2] and drop.error == "UNAVAILABLE"
        shard.send(StatsRequest(reset=False))
        _, reply = shard.expect(StatsReply)
        assert reply.stats["counters"]["stale_epoch"] == 1
        assert reply.stats["counters"]["requests"] == 1
    finally:
        h.close()
