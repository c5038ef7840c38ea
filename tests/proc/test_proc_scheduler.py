"""Rank and shard processes with the test playing the frontend and the backend: request metadata
in, BatchPlans and DropNotices out, for shards = 0 (embedded rank), 1 and 2."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from proc_harness import Harness, Peer, cluster_config, role_config_for

from zserve.config.cluster import shard_for_model
from zserve.core.errors import ErrorKind
from zserve.core.stats import merge_snapshots
from zserve.scheduler.shard_host import MAX_SHARDS
from zserve.transport.messages import (
    BackendGone,
    BackendRegister,
    BackendTable,
    BatchPlan,
    DropNotice,
    Heartbeat,
    Hello,
    RequestMetaBatch,
    StatsReply,
    StatsRequest,
)

MODELS = ("alpha", "beta")  # crc32 puts them on different shards when shards = 2
# alpha 30 ms: the frontrun and latest moments of a batch lie 30 ms apart, far more than the
# scheduling noise of a busy shared test machine (a timer 10 ms late would shrink a batch).
ALPHA_MS, BETA_MS, MAX_BATCH = 30.0, 5.0, 8
SLO_MS = 500.0
FRONTEND = "frontend-0"
WAIT_S = 20.0


def _profile_ms() -> list[float]:
    return [ALPHA_MS * b + BETA_MS for b in range(1, MAX_BATCH + 1)]


class SchedulerRig:
    """Rank and shard processes started for ``shards``; the test's backend and frontend."""

    def __init__(self, h: Harness, shards: int, backend_timeout_s: float = 30.0,
                 drain_s: float = 5.0, plan_ack_margin_s: float | None = 30.0) -> None:
        """``plan_ack_margin_s``: the shards' wait for a plan's acknowledgement past d_ctrl;
        long by default, since the test's backend acknowledges a plan only once the test reads
        it (None: the production default, for the tests of suspicion)."""
        self.h = h
        self.shards = shards
        cluster = cluster_config(
            [{"name": m, "slo_ms": SLO_MS, "max_batch": MAX_BATCH,
              "emulated": {"alpha_ms": ALPHA_MS, "beta_ms": BETA_MS}} for m in MODELS],
            cluster={"drain_s": drain_s},
            scheduler={"shards": shards},
            backends={"device": "emulated"},
        )
        self.cluster = cluster
        peers: dict[str, str] = {}
        if shards > 0:
            config = role_config_for(cluster, "rank", 0, h.dir)
            config.backend_timeout_s = backend_timeout_s
            rank = h.start("rank", config)
            peers["rank/rank"] = h.await_ready(rank, {}).endpoints["rank"]
        self.shard_endpoints: list[str] = []
        for index in range(max(1, shards)):
            config = role_config_for(cluster, "shard", index, h.dir)
            config.backend_timeout_s = backend_timeout_s
            config.plan_ack_margin_s = plan_ack_margin_s
            shard = h.start("shard", config)
            ready = h.await_ready(shard, dict(peers))
            self.shard_endpoints.append(ready.endpoints["shard"])
            if shards == 0:
                peers["rank/rank"] = ready.endpoints["rank"]
        self.rank_endpoint = peers["rank/rank"]
        # The test's frontend: a data address (never connected to here), a DEALER per shard and
        # one to the rank, each saying hello as a frontend does.
        self.data_address = h.endpoint("fe-data")
        hello = Hello(role="frontend", name=FRONTEND, pid=os.getpid())
        self.to_shard: list[Peer] = []
        for endpoint in self.shard_endpoints:
            peer = h.dealer(endpoint, FRONTEND)
            peer.send(hello)
            self.to_shard.append(peer)
        self.fe_rank = h.dealer(self.rank_endpoint, FRONTEND)
        self.fe_rank.send(hello)
        # The test's backend: a plan ROUTER and a DEALER to the rank.
        self.plans = h.router("be-plan")
        self.be_rank = h.dealer(self.rank_endpoint, "backend-0")

    def register_backend(self) -> None:
        self.be_rank.send(BackendRegister(
            name="backend-0", device="emulated", plan_address=self.plans.endpoint,
            models=list(MODELS), profiles_ms={m: _profile_ms() for m in MODELS},
        ))
        self.fe_rank.expect(BackendTable, where=lambda t: t.names == ["backend-0"])
        # Wait until every shard knows the GPU (the table reaches each over its own socket).
        deadline = time.monotonic() + WAIT_S
        for peer in self.to_shard:
            while True:
                peer.send(StatsRequest(reset=False))
                _, reply = peer.expect(StatsReply)
                models = reply.stats["models"]
                if models and all(m["gpus"] == [0] for m in models.values()):
                    break
                assert time.monotonic() < deadline, f"shard never saw the backend: {reply.stats}"
        self.be_rank.send(Heartbeat("backend-0", 1, time.monotonic()))

    def diagnose(self) -> str:
        """The shards' stats and every child's log, for a failure message."""
        parts = []
        for peer in self.to_shard:
            peer.send(StatsRequest(reset=False))
            parts.append(repr(peer.expect(StatsReply, timeout=5)[1].stats))
        parts += [f"--- {c.name}:\n{c.log()}" for c in self.h.children]
        return "\n".join(parts)

    def shard_of(self, model: str) -> Peer:
        return self.to_shard[shard_for_model(model, self.shards)]

    def send_requests(self, model: str, ids: list[int], budget_s: float) -> None:
        now = time.monotonic()
        self.shard_of(model).send(RequestMetaBatch(
            self.data_address, ids, [model] * len(ids), [now] * len(ids),
            [now + budget_s] * len(ids),
        ))


def _check_stats_schema(rig: SchedulerRig) -> None:
    """Every shard reports zserve.core.stats' schema: counters, latency summaries, histograms; the
    meta_delay histograms of all shards merge into one holding every metadata batch."""
    replies = []
    for peer in rig.to_shard:
        peer.send(StatsRequest(reset=False))
        replies.append(peer.expect(StatsReply)[1].stats)
    for stats in replies:
        assert {"counters", "latency", "histograms"} <= stats.keys()
        assert stats["latency"]["meta_delay"]["count"] == stats["counters"]["meta_batches"]
    merged = merge_snapshots(replies)
    assert merged["counters"]["requests"] == 9
    meta = merged["latency"]["meta_delay"]
    # (not necessarily >= 0: a shard apart from the rank reads the cluster clock through its
    # offset estimate, a few microseconds off)
    assert meta["count"] == 3 and meta["min_ms"] <= meta["p50_ms"] <= meta["max_ms"]


def _run_scenario(tmp_path: Path, shards: int) -> dict[str, Any]:
    """Feasible requests of both models and one infeasible one; returns what came out."""
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards)
        rig.register_backend()
        # Deadlines 200 ms apart: one GPU serves both models' batches in time.
        rig.send_requests("alpha", [1, 2, 3, 4, 5], budget_s=0.25)  # l(5) = 155 ms
        rig.send_requests("beta", [11, 12, 13], budget_s=0.45)  # l(3) = 95 ms
        rig.send_requests("alpha", [99], budget_s=0.005)  # l(1) = 35 ms: cannot make it
        planned: dict[str, list[list[int]]] = {m: [] for m in MODELS}
        while sum(len(b) for v in planned.values() for b in v) < 8:
            try:
                _, plan = rig.plans.expect(BatchPlan)
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; planned {planned}; {rig.diagnose()}") from None
            assert plan.gpu_id == 0 and plan.frontends == [rig.data_address]
            assert plan.exec_at <= plan.expected_finish_at
            # plan ids are the shard's: its index in the low bits, unique in the cluster
            assert plan.plan_id % MAX_SHARDS == shard_for_model(plan.model, rig.shards)
            assert plan.plan_id >= MAX_SHARDS
            planned[plan.model].append(plan.request_ids)
        _, drop = rig.shard_of("alpha").expect(DropNotice)
        assert drop.request_ids == [99] and drop.error == ErrorKind.DEADLINE
        _check_stats_schema(rig)
        for child in h.children:  # SIGTERM drains: every scheduler process exits 0
            child.terminate()
        assert [child.wait() for child in h.children] == [0] * len(h.children)
        return {m: sorted(b) for m, b in planned.items()}
    finally:
        h.close()


@pytest.mark.parametrize("shards", [0, 1, 2])
def test_proc_scheduler_plans_and_drops(tmp_path: Path, shards: int) -> None:
    planned = _run_scenario(tmp_path, shards)
    # Deferred batching holds each model's requests back until the last moment, so each model's
    # requests leave as one batch, whatever the process layout.
    assert planned == {"alpha": [[1, 2, 3, 4, 5]], "beta": [[11, 12, 13]]}


def test_proc_scheduler_unserved_model_is_unavailable(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards=0)
        rig.send_requests("alpha", [1], budget_s=0.1)  # no backend registered yet
        _, drop = rig.shard_of("alpha").expect(DropNotice)
        assert drop.request_ids == [1] and drop.error == ErrorKind.UNAVAILABLE
    finally:
        h.close()


def test_proc_scheduler_removes_silent_backend(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards=1, backend_timeout_s=0.3)
        rig.register_backend()
        # No more heartbeats: the rank removes it and tells the frontend.
        rig.fe_rank.expect(BackendTable, where=lambda t: t.names == [])
    finally:
        h.close()


@pytest.mark.parametrize("shards", [0, 1])
def test_proc_scheduler_fails_plans_of_a_dead_backend(tmp_path: Path, shards: int) -> None:
    """The supervisor says a backend died (``BackendGone`` to the process hosting the rank):
    the rank removes it at once, and the shard answers BACKEND_FAILED the requests it had
    planned onto it, which the backend never fetched (only the shard knows of those)."""
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards=shards)
        rig.register_backend()
        rig.send_requests("beta", [51, 52], budget_s=0.2)
        _, plan = rig.plans.expect(BatchPlan)  # the test's backend never fetches: it is "dead"
        assert sorted(plan.request_ids) == [51, 52]
        rank_host = "rank" if shards else "shard-0"
        h.control.send(BackendGone(name="backend-0"), rank_host)
        # At once: the rig's backend timeout (30 s) is far beyond the wait.
        rig.fe_rank.expect(BackendTable, where=lambda t: t.names == [])
        _, drop = rig.shard_of("beta").expect(
            DropNotice, where=lambda d: d.error == ErrorKind.BACKEND_FAILED)
        assert sorted(drop.request_ids) == [51, 52], drop
    finally:
        h.close()


def test_proc_scheduler_survives_rank_restart(tmp_path: Path) -> None:
    """A restarted rank knows nobody: heartbeats make the backend re-register and the shard say
    hello again, and requests are planned as before."""
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards=1)
        rig.register_backend()
        rank = h.children[0]
        rank.proc.kill()
        rank.wait()
        cluster = cluster_config(
            [{"name": m, "slo_ms": SLO_MS, "max_batch": MAX_BATCH,
              "emulated": {"alpha_ms": ALPHA_MS, "beta_ms": BETA_MS}} for m in MODELS],
            scheduler={"shards": 1},
            backends={"device": "emulated"},
        )
        config = role_config_for(cluster, "rank", 0, h.dir)
        config.bind["rank"] = rig.rank_endpoint  # pinned to its old address, as on restart
        h.await_ready(h.start("rank", config), {})
        # The (test) backend heartbeats; the new rank asks it to introduce itself again.
        while True:
            rig.be_rank.send(Heartbeat("backend-0", 2, time.monotonic()))
            if rig.be_rank.sock.poll(200):
                break
        _, hello = rig.be_rank.expect(Hello)
        assert hello.role == "rank"
        # Frontends do not heartbeat the rank: the test's frontend says hello again itself.
        rig.fe_rank.send(Hello(role="frontend", name=FRONTEND, pid=os.getpid()))
        rig.register_backend()  # re-registers; returns once the shard has the new table
        rig.send_requests("beta", [21, 22], budget_s=0.3)
        _, plan = rig.plans.expect(BatchPlan)
        assert plan.request_ids == [21, 22]
    finally:
        h.close()


def test_proc_scheduler_sigterm_answers_queued_requests(tmp_path: Path) -> None:
    """A draining shard keeps scheduling for drain_s, then answers what is still queued
    SHUTTING_DOWN, and exits 0."""
    h = Harness(tmp_path)
    try:
        rig = SchedulerRig(h, shards=0, drain_s=0.2)
        rig.register_backend()
        rig.send_requests("beta", [31, 32], budget_s=30.0)  # held back for ~30 s: still queued
        rig.to_shard[0].send(StatsRequest(reset=False))  # the requests are in once this answers
        rig.to_shard[0].expect(StatsReply)
        (shard,) = h.children
        shard.terminate()
        _, drop = rig.to_shard[0].expect(DropNotice)
        assert sorted(drop.request_ids) == [31, 32] and drop.error == ErrorKind.SHUTTING_DOWN
        assert shard.wait() == 0
    finally:
        h.close()
