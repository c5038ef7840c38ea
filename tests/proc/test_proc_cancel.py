"""Cancellation after the fetch, on a real backend process (emulated device): the test plays the
rank, a shard and the frontend that sends ``CancelFetched``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from proc_harness import Harness
from test_proc_backend import MODEL, BackendRig, start_backend

from zserve.transport.messages import (
    BatchOutputs,
    CancelFetched,
    InputFetch,
    InputReply,
    StatsReply,
    StatsRequest,
)

# Far enough ahead that the cancel reaches the backend before the batch starts, even on a
# busy machine (the test waits on messages, never on this clock).
LEAD_S = 1.0


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[BackendRig]:
    h = Harness(tmp_path)
    try:
        yield start_backend(h)
    finally:
        h.close()


def _serve(rig: BackendRig) -> tuple[bytes, InputFetch]:
    identity, fetch = rig.frontend.expect(InputFetch)
    assert identity is not None
    inputs = [{"x": np.full((1, 4), float(rid), np.float32)} for rid in fetch.request_ids]
    rig.frontend.send(InputReply(fetch.plan_id, fetch.request_ids, inputs, []), identity)
    return identity, fetch


def test_proc_cancel_after_fetch_is_not_executed(rig: BackendRig) -> None:
    exec_at = time.monotonic() + LEAD_S
    rig.plan(1, [11, 12, 13], exec_at)
    rig.plan(2, [21, 22], exec_at + 0.01)
    backend_identity, first = _serve(rig)
    _, second = _serve(rig)
    assert {first.plan_id, second.plan_id} == {1, 2}
    # After the fetch, before exec_at: 12 of plan 1 and the whole of plan 2 are cancelled.
    rig.frontend.send(CancelFetched([1, 2, 2], [12, 21, 22]), backend_identity)

    stats_1 = rig.stats_of(1)
    assert stats_1.ok and stats_1.batch_size == 2 and stats_1.cancelled == 1
    assert stats_1.started_at >= exec_at
    _, outputs = rig.frontend.expect(BatchOutputs, where=lambda m: m.plan_id == 1)
    assert outputs.request_ids == [11, 13]
    assert outputs.started_at == stats_1.started_at
    assert outputs.finished_at == stats_1.finished_at
    # Plan 2 lost every request: it is skipped, and says so.
    stats_2 = rig.stats_of(2)
    assert stats_2.batch_size == 0 and stats_2.cancelled == 2
    rig.shard.send(StatsRequest(reset=False))
    _, reply = rig.shard.expect(StatsReply)
    counters = reply.stats["counters"]
    assert counters["requests_cancelled"] == 3
    assert counters["batches_skipped"] == 1
    assert counters["requests_ok"] == 2
    assert reply.stats["batch_sizes"] == {MODEL: {"2": 1}}
    assert reply.stats["samples"]["batch_model"] == [MODEL]
    assert not rig.frontend.drain_kind(BatchOutputs)  # nothing ran for plan 2


def test_proc_cancel_of_a_started_or_unknown_plan_is_counted(rig: BackendRig) -> None:
    rig.plan(1, [11], time.monotonic())
    backend_identity, _ = _serve(rig)
    _, outputs = rig.frontend.expect(BatchOutputs)
    assert outputs.request_ids == [11]
    rig.frontend.send(CancelFetched([1], [11]), backend_identity)  # plan 1 is gone by now
    rig.frontend.send(StatsRequest(reset=True), backend_identity)  # answered on the data link
    _, reply = rig.frontend.expect(StatsReply)
    assert reply.stats["counters"]["cancels_too_late"] == 1
    assert reply.stats["counters"]["requests_ok"] == 1
    rig.frontend.send(StatsRequest(reset=False), backend_identity)
    _, after_reset = rig.frontend.expect(StatsReply)
    assert after_reset.stats["counters"]["requests_ok"] == 0
    assert after_reset.stats["batch_sizes"] == {}
