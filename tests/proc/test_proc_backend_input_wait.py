"""The backend process waits for a slow frontend's inputs as long as the batch's deadlines allow:
a frontend that answers the InputFetch 80 ms after exec_at (a loaded host), well within the
requests' deadlines, gets every request run. Real process, real sockets (the rig of
test_proc_backend: the test plays the rank, a shard and a frontend)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from proc_harness import Harness
from test_proc_backend import ALPHA_MS, BETA_MS, MODEL, BackendRig, start_backend

from zserve.backends.follower import INPUT_WAIT_S
from zserve.transport.messages import (
    BatchFailed,
    BatchOutputs,
    BatchPlan,
    InputFetch,
    InputReply,
    StatsReply,
    StatsRequest,
)

REPLY_LATE_S = 0.080  # after exec_at: longer than the old fixed wait of 50 ms
SLO_LEFT_S = 2.0  # each request's finish_by, after exec_at


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[BackendRig]:
    h = Harness(tmp_path)
    try:
        yield start_backend(h)
    finally:
        h.close()


def test_inputs_80_ms_after_exec_at_within_the_deadline_are_all_run(rig: BackendRig) -> None:
    assert REPLY_LATE_S > INPUT_WAIT_S
    ids = [21, 22, 23, 24]
    exec_at = time.monotonic() + 0.020
    rig.shard.send(BatchPlan(1, MODEL, 0, exec_at, exec_at + (ALPHA_MS * 4 + BETA_MS) / 1e3,
                             [rig.frontend.endpoint], [0] * 4, ids,
                             [exec_at + SLO_LEFT_S] * 4))
    identity, fetch = rig.frontend.expect(InputFetch)
    assert fetch.request_ids == ids
    # The slow frontend: nothing may be answered while it holds the inputs back.
    with pytest.raises(TimeoutError):
        rig.frontend.expect(BatchFailed, timeout=exec_at + REPLY_LATE_S - time.monotonic())
    inputs = [{"x": np.full((1, 4), float(rid), np.float32)} for rid in ids]
    rig.frontend.send(InputReply(1, ids, inputs, []), identity)
    _, out = rig.frontend.expect(BatchOutputs)
    assert out.plan_id == 1 and out.request_ids == ids
    # started once the inputs came (5 ms: the backend's estimate of the test's clock)
    assert out.started_at >= exec_at + REPLY_LATE_S - 0.005
    stats = rig.stats_of(1)
    assert stats.ok and stats.batch_size == 4
    rig.shard.send(StatsRequest(reset=False))
    _, reply = rig.shard.expect(StatsReply)
    assert reply.stats["counters"]["requests_ok"] == 4
    assert reply.stats["counters"]["requests_unavailable"] == 0
    assert rig.frontend.drain_kind(BatchFailed) == []  # exactly one answer each
