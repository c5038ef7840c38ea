"""GPU ids survive a rank restart: a rank gives each backend its index in the cluster config (the
``n`` of its name ``backend-<n>``) as GPU id, whatever order the backends register in. A restarted
rank knows nobody and hears the backends re-register in whatever order their heartbeats reach it;
with ids in registration order a GPU id could name another backend than before, and the shards,
whose plans and sockets are keyed by the old ids, failed live plans as ``BACKEND_FAILED``
(``test_faults_signals.py``, the rank cases)."""

from __future__ import annotations

import os
from pathlib import Path

from proc_harness import Harness, cluster_config, role_config_for

from zserve.config.cluster import process_name
from zserve.scheduler.rank_backends import configured_backend_index
from zserve.transport.messages import BackendRegister, BackendTable, Hello

MODEL = "alpha"
PROFILE_MS = [10.0, 15.0]


def _register(h: Harness, rank_endpoint: str, name: str) -> None:
    h.dealer(rank_endpoint, name).send(BackendRegister(
        name=name, device="emulated", plan_address=h.endpoint(f"{name}-plan"), models=[MODEL],
        profiles_ms={MODEL: PROFILE_MS}))


def _ids_by_name(table: BackendTable) -> dict[str, int]:
    return dict(zip(table.names, table.gpu_ids, strict=True))


def test_gpu_ids_are_the_configured_indexes_in_any_registration_order(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        cluster = cluster_config(
            [{"name": MODEL, "slo_ms": 500.0, "max_batch": 2,
              "emulated": {"alpha_ms": 5.0, "beta_ms": 5.0}}],
            scheduler={"shards": 1}, backends={"device": "emulated"})
        rank = h.start("rank", role_config_for(cluster, "rank", 0, h.dir))
        endpoint = h.await_ready(rank, {}).endpoints["rank"]
        frontend = h.dealer(endpoint, "frontend-0")
        frontend.send(Hello(role="frontend", name="frontend-0", pid=os.getpid()))
        frontend.expect(BackendTable)
        # What a restarted rank sees when backend-2's heartbeat comes first, then backend-0's:
        _register(h, endpoint, process_name("backend", 2))
        frontend.expect(BackendTable, where=lambda t: t.names == ["backend-2"])
        _register(h, endpoint, process_name("backend", 0))
        _, table = frontend.expect(BackendTable, where=lambda t: len(t.names) == 2)
        assert _ids_by_name(table) == {"backend-0": 0, "backend-2": 2}, (
            f"GPU ids follow the registration order: {table}")
        # A backend without an index, or whose index another holds, gets the lowest free id.
        _register(h, endpoint, "backend-x")
        _register(h, endpoint, "backend-00")
        _, table = frontend.expect(BackendTable, where=lambda t: len(t.names) == 4)
        assert _ids_by_name(table) == {"backend-0": 0, "backend-x": 1, "backend-2": 2,
                                       "backend-00": 3}, table
    finally:
        h.close()


def test_the_configured_index_is_read_from_the_process_name() -> None:
    assert [configured_backend_index(process_name("backend", i)) for i in (0, 7, 31)] == [0, 7, 31]
    for name in ("frontend-0", "rank", "backend-x", "backend-", "my-backend"):
        assert configured_backend_index(name) is None, name
