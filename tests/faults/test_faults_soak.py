"""Soak of a whole cluster (F22, defect 2): frontend, shard, rank and two backends, each its own
process, serve open-loop load through the public client, a new client connection every chunk
(clients come and go), every answer checked by the ledger (tests/fault_harness.py). After a
warm-up, no role's resident memory may grow by more than ``MAX_GROWTH_PER_100K_BYTES`` per 100,000
requests: memory is bounded by the requests in flight, not by the requests ever served.

The CI run sends ``SOAK_REQUESTS`` requests after the warm-up (about 45 s on a 2-core
machine). A 30-minute soak is the same test, made longer:

    ZSERVE_SOAK_MINUTES=30 .venv/bin/python -m pytest -p no:cacheprovider -s \
        tests/faults/test_faults_soak.py
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from fault_harness import OK, Ledger, Load, drive, fault_cluster, rss_bytes

from zserve.cluster.supervisor import Cluster

RATE_RPS = 1500.0
CHUNK = 7_500  # requests per client connection (5 s at the rate)
WARMUP_REQUESTS = 15_000
SOAK_REQUESTS = 45_000
SOAK_MINUTES = float(os.environ.get("ZSERVE_SOAK_MINUTES", "0"))
# What may grow legitimately: allocator noise (pymalloc arenas, ZeroMQ's buffers settling, the
# histograms filling in). A request table, a per-client record or a plan kept forever costs
# 100-200 bytes a request: 10-20 MiB per 100,000.
MAX_GROWTH_PER_100K_BYTES = 4 * 2**20
ROLES = ("frontend-0", "shard-0", "rank", "backend-0", "backend-1")

pytestmark = pytest.mark.timeout(240 + 60 * SOAK_MINUTES * 1.5)


def _rss(cluster: Cluster) -> dict[str, int]:
    pids = cluster.pids()
    return {name: rss_bytes(pids[name] or 0) for name in ROLES}


def _chunk(cluster: Cluster, first_index: int,
           messages: dict[str, str]) -> dict[str, int]:
    """One client connection's worth of load; the ledger checks every answer. ``messages``
    gathers the first message of each error kind (what a failed attainment is explained by)."""
    ledger = Ledger(cluster.config)
    load = Load(rate_rps=RATE_RPS, count=CHUNK, seed=first_index, first_index=first_index)
    counts = asyncio.run(drive(cluster.client_address, ledger, load)).counts
    for kind, message in ledger.first_message.items():
        messages.setdefault(kind, f"{message} (first in the chunk from request {first_index})")
    return counts


def test_no_role_grows_with_the_requests_served(tmp_path: Path) -> None:
    # l(b) = 0.1 b + 1 ms on two GPUs: far above the rate, so the run measures memory, not
    # overload; a 500 ms SLO rides out a loaded machine's stalls.
    config = fault_cluster(alpha_ms=0.1, beta_ms=1.0, slo_ms=500.0, max_batch=32,
                           max_queue=4096)
    totals: dict[str, int] = {}
    messages: dict[str, str] = {}
    with Cluster(config, ipc_base=tmp_path) as cluster:
        pids = cluster.pids()
        sent = 0
        while sent < WARMUP_REQUESTS:
            for kind, n in _chunk(cluster, sent, messages).items():
                totals[kind] = totals.get(kind, 0) + n
            sent += CHUNK
        before = _rss(cluster)
        started = time.monotonic()
        measured = 0
        while (measured < SOAK_REQUESTS if not SOAK_MINUTES
               else time.monotonic() - started < SOAK_MINUTES * 60):
            for kind, n in _chunk(cluster, sent + measured, messages).items():
                totals[kind] = totals.get(kind, 0) + n
            measured += CHUNK
        after = _rss(cluster)
        assert cluster.pids() == pids  # nothing died or restarted
    growth = {name: (after[name] - before[name]) * 100_000 / measured for name in ROLES}
    print(f"soak: {measured} requests in {time.monotonic() - started:.0f} s after a warm-up of "
          f"{sent}; outcomes {totals}; RSS growth per 100,000 requests (MiB): "
          + ", ".join(f"{name} {g / 2**20:+.2f} (at {after[name] / 2**20:.0f})"
                      for name, g in growth.items()) + f"; errors {messages or 'none'}")
    assert totals.get(OK, 0) >= 0.99 * (sent + measured), (totals, messages)
    for name, bytes_per_100k in growth.items():
        assert bytes_per_100k < MAX_GROWTH_PER_100K_BYTES, (name, growth)
