"""Soak of a real scheduler process (issue 16, defect 2): its memory must be bounded by the
requests in flight, not by the requests ever seen. The test plays the frontend and the backend
of a shard that embeds the rank, and feeds it a steady closed loop: a chunk of requests, then
every one of them planned (or dropped) before the next chunk. After a warm-up it measures the
process's RSS across ``SOAK_REQUESTS`` more requests.

A 30-minute soak: ``ZSERVE_SOAK_MINUTES=30 .venv/bin/python -m pytest -p no:cacheprovider
tests/proc/test_proc_sched_soak.py`` runs the same loop for that long instead (same bound, scaled).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from proc_harness import Harness, Peer, cluster_config, role_config_for

from zserve.transport import socket_io
from zserve.transport.messages import (
    BackendRegister,
    BackendTable,
    BatchPlan,
    DropNotice,
    Heartbeat,
    Hello,
    PlanAck,
    RequestMetaBatch,
    StatsReply,
    StatsRequest,
)

MODEL = "soak"
MAX_BATCH = 64
ALPHA_MS, BETA_MS = 0.05, 1.0  # l(64) = 4.2 ms: one GPU plans ~15,000 requests/s
CHUNK = 200  # requests per frontend tick
# Eager batching on generous deadlines: nothing is dropped. (A drop compacts the queue's lists;
# the leak this guards against was on the path where every request is planned.)
POLICY = "eager"
BUDGET_S = 1.0
WARMUP_REQUESTS = 20_000
SOAK_REQUESTS = 100_000
SOAK_MINUTES = float(os.environ.get("ZSERVE_SOAK_MINUTES", "0"))
# Before the fix the ModelThread kept four list entries per request ever planned (~140 bytes:
# two floats, an int, four pointers): 13 MiB per 100,000 requests. What may grow legitimately
# is allocator noise (pymalloc arenas, the stats' histograms fill in): well under 2 MiB.
MAX_GROWTH_PER_100K_BYTES = 2 * 2**20
WAIT_S = 20.0
FRONTEND = "frontend-0"

pytestmark = pytest.mark.timeout(120 + 60 * SOAK_MINUTES * 1.5)


class SoakRig:
    """A shard process with the rank embedded, the test's frontend and backend on its sockets."""

    def __init__(self, h: Harness) -> None:
        cluster = cluster_config(
            [{"name": MODEL, "slo_ms": 2000.0, "max_batch": MAX_BATCH,
              "emulated": {"alpha_ms": ALPHA_MS, "beta_ms": BETA_MS}}],
            scheduler={"shards": 0, "policy": POLICY}, backends={"device": "emulated"})
        config = role_config_for(cluster, "shard", 0, h.dir)
        config.backend_timeout_s = 30.0
        # its backend acknowledges a plan only when the test reads it, between chunks
        config.plan_ack_margin_s = 30.0
        self.child = h.start("shard", config)
        ready = h.await_ready(self.child, {})
        self.data_address = h.endpoint("fe-data")
        hello = Hello(role="frontend", name=FRONTEND, pid=os.getpid())
        self.shard = h.dealer(ready.endpoints["shard"], FRONTEND)
        self.shard.send(hello)
        fe_rank = h.dealer(ready.endpoints["rank"], FRONTEND)
        fe_rank.send(hello)
        self.plans = h.router("be-plan")
        self.be_rank = h.dealer(ready.endpoints["rank"], "backend-0")
        profile = [ALPHA_MS * b + BETA_MS for b in range(1, MAX_BATCH + 1)]
        self.be_rank.send(BackendRegister(
            name="backend-0", device="emulated", plan_address=self.plans.endpoint,
            models=[MODEL], profiles_ms={MODEL: profile}))
        fe_rank.expect(BackendTable, where=lambda t: t.names == ["backend-0"])
        while self.stats()["models"][MODEL]["gpus"] != [0]:
            pass  # each stats ask is a round trip: the shard sees the table soon
        self.next_rid = 1
        self.heartbeats = 0
        self.planned = 0
        self.dropped = 0

    def stats(self) -> dict[str, Any]:
        self.shard.send(StatsRequest(reset=False))
        return dict(self.shard.expect(StatsReply)[1].stats)

    def rss(self) -> int:
        return int(psutil.Process(self.child.proc.pid).memory_info().rss)

    def round(self) -> None:
        """One chunk of requests, then wait until each is planned or dropped."""
        ids = list(range(self.next_rid, self.next_rid + CHUNK))
        self.next_rid += CHUNK
        now = time.monotonic()
        self.shard.send(RequestMetaBatch(self.data_address, ids, [MODEL] * CHUNK,
                                         [now] * CHUNK, [now + BUDGET_S] * CHUNK))
        self.heartbeats += 1  # the backend stays alive in the rank's eyes
        self.be_rank.send(Heartbeat("backend-0", self.heartbeats, now))
        left = CHUNK
        while left:
            left -= self._answered(self.plans) + self._answered(self.shard)

    def _answered(self, peer: Peer) -> int:
        """Requests planned or dropped in the messages ``peer`` holds (waits for one)."""
        if not peer.backlog and not peer.sock.poll(1):
            return 0
        count = 0
        while peer.sock.poll(0, zmq.POLLIN):
            identity, msg = socket_io.sync_recv(peer.sock, router=peer.router)
            if isinstance(msg, BatchPlan):
                # acknowledged as a live backend's batch loop does (else the shard suspects it)
                peer.send(PlanAck([msg.plan_id], time.monotonic()), identity)
                self.planned += len(msg.request_ids)
                count += len(msg.request_ids)
            elif isinstance(msg, DropNotice):
                self.dropped += len(msg.request_ids)
                count += len(msg.request_ids)
        return count

    def run(self, requests: int, until: float = 0.0) -> None:
        stop = self.next_rid + requests
        while self.next_rid < stop or time.monotonic() < until:
            self.round()


def test_shard_memory_is_bounded_by_requests_in_flight(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        rig = SoakRig(h)
        rig.run(WARMUP_REQUESTS)
        rss_before = rig.rss()
        started = rig.next_rid
        rig.run(SOAK_REQUESTS, until=time.monotonic() + 60 * SOAK_MINUTES)
        growth = rig.rss() - rss_before
        requests = rig.next_rid - started
        stats = rig.stats()
        assert stats["models"][MODEL]["queued"] == 0
        assert rig.planned + rig.dropped == rig.next_rid - 1
        assert rig.planned >= 0.9 * (rig.next_rid - 1), (rig.planned, rig.dropped)
        allowed = MAX_GROWTH_PER_100K_BYTES * max(1.0, requests / 100_000)
        assert growth <= allowed, (
            f"RSS grew {growth / 2**20:.1f} MiB over {requests} requests "
            f"(allowed {allowed / 2**20:.1f} MiB)")
    finally:
        h.close()
