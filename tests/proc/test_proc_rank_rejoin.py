"""A shard and a restarted rank: the new rank's first table lacks the backends that have not
registered with it again yet, and the shard must not take them for departed (it used to fail or
re-plan every plan it had sent them, and answer their models ``UNAVAILABLE``, though they were
alive and registered within a heartbeat). The rig of ``test_proc_scheduler``: rank and shard
processes, the test plays the frontend and the backend."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from proc_harness import Harness, Peer, role_config_for
from runtime_helpers import wait_until
from test_proc_scheduler import MODELS, WAIT_S, SchedulerRig, _profile_ms

from zserve.scheduler.rank_rejoin import REJOIN_GRACE_S, RankRejoin
from zserve.transport.messages import (
    BackendRegister,
    BackendTable,
    BatchPlan,
    DropNotice,
    Heartbeat,
    Hello,
    StatsReply,
    StatsRequest,
)

MODEL = "beta"  # its plan comes soon after the requests (a short l(b))


def _shard_stats(peer: Peer) -> dict[str, Any]:
    peer.send(StatsRequest(reset=False))
    stats: dict[str, Any] = peer.expect(StatsReply)[1].stats
    return stats


def _restart_rank(h: Harness, rig: SchedulerRig) -> None:
    old = next(c for c in h.children if c.role == "rank")
    old.terminate()
    assert old.wait() == 0, old.log()
    h.children.remove(old)
    config = role_config_for(rig.cluster, "rank", 0, h.dir)
    config.backend_timeout_s = 30.0
    rank = h.start("rank", config)
    assert h.await_ready(rank, {}).endpoints["rank"] == rig.rank_endpoint


def test_restarted_rank_s_partial_table_keeps_the_shard_s_backends(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards=1)
        rig.register_backend()
        rig.send_requests(MODEL, [1, 2], budget_s=0.5)
        rig.plans.expect(BatchPlan)  # planned onto GPU 0; the plan stays with the backend
        shard = rig.to_shard[0]
        _restart_rank(h, rig)
        # The shard heartbeats, the new rank asks who it is, and answers its Hello with a table
        # that has no backend (the test's backend has not heartbeated to the new rank yet).
        deadline = time.monotonic() + WAIT_S
        last: dict[str, Any] = {}

        def rejoined() -> dict[str, Any] | None:
            last.clear()
            last.update(_shard_stats(shard))
            kept = last["counters"].get("gpus_kept", 0) >= 1
            return dict(last) if kept or last["models"][MODEL]["gpus"] != [0] else None

        stats = wait_until(rejoined, lambda: f"the shard to rejoin the rank; last stats {last}",
                           timeout_s=WAIT_S)
        assert stats["models"][MODEL]["gpus"] == [0], (
            f"the new rank's first table made the shard drop a live backend: {stats}")
        # The backend heartbeats; the new rank asks it to register; it does, under its index.
        rig.be_rank.send(Heartbeat("backend-0", 2, time.monotonic()))
        _, hello = rig.be_rank.expect(Hello)
        assert hello.role == "rank"
        rig.be_rank.send(BackendRegister(
            name="backend-0", device="emulated", plan_address=rig.plans.endpoint,
            models=list(MODELS), profiles_ms={m: _profile_ms() for m in MODELS}))
        # Past the grace the rank's own table (with the backend) is what the shard serves.
        time_after_grace = time.monotonic() + REJOIN_GRACE_S

        def served_after_grace() -> dict[str, Any] | None:
            past_grace = time.monotonic() >= time_after_grace  # stats asked for after the grace
            last.clear()
            last.update(_shard_stats(shard))
            return dict(last) if past_grace and last["models"][MODEL]["gpus"] == [0] else None

        wait_until(served_after_grace,
                   lambda: f"the shard to serve GPU 0 past the grace; last stats {last}\n"
                           f"{rig.diagnose()}",
                   timeout_s=deadline + WAIT_S - time.monotonic())
        drops = shard.drain_kind(DropNotice)
        assert drops == [], f"requests of a live backend's plan were dropped: {drops}"
        assert _shard_stats(shard)["counters"]["replanned"] == 0
    finally:
        h.close()


def _table(*gpus: tuple[int, str]) -> BackendTable:
    return BackendTable(gpu_ids=[g for g, _ in gpus], names=[n for _, n in gpus],
                        addresses=[f"ipc:///{n}" for _, n in gpus],
                        models=[[MODEL] for _ in gpus], profiles_ms=[{} for _ in gpus],
                        signatures=[{} for _ in gpus], kinds=["" for _ in gpus])


def test_the_grace_keeps_missing_gpus_then_the_rank_s_table_applies() -> None:
    counters = {"gpus_kept": 0}
    rejoin = RankRejoin(counters)
    both = _table((0, "backend-0"), (1, "backend-1"))
    assert rejoin.on_table(0.0, both) == both  # no restart: tables apply as they come
    assert rejoin.on_table(1.0, _table((1, "backend-1"))) == _table((1, "backend-1"))
    rejoin.on_table(1.5, both)
    grace_over_at = rejoin.on_rank_hello(2.0)
    assert grace_over_at == 2.0 + REJOIN_GRACE_S
    assert rejoin.on_table(2.1, _table()) == both  # the new rank's first, empty, table
    assert rejoin.on_table(2.2, _table((1, "backend-1"))) == both
    assert counters["gpus_kept"] == 3
    assert rejoin.on_grace_over(grace_over_at - 0.1) is None
    # backend-0 never registered again: it has left
    assert rejoin.on_grace_over(grace_over_at) == _table((1, "backend-1"))
    assert rejoin.on_grace_over(grace_over_at + 1.0) is None  # nothing new since
    assert rejoin.on_table(grace_over_at + 1.0, _table()) == _table()
