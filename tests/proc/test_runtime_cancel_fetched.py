"""The frontend's side of cancellation after the fetch: the backend that fetched a cancelled (or
disconnected) request is told (``CancelFetched``), the client gets exactly one answer
(``CANCELLED``), and outputs that still come for it are discarded. Also the queueing delay taken
from ``BatchOutputs.started_at``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from runtime_helpers import (
    FrontendHarness,
    emulated_cluster,
    fetch,
    meta_ids,
    recv_type,
    sample,
    stats,
    wait_stats,
)

import zserve
from zserve.transport import socket_io
from zserve.transport.messages import BatchOutputs, CancelFetched, InferRequest
from zserve.transport.sockets import make_dealer


@pytest.fixture
def frontend(tmp_path: Any) -> Iterator[FrontendHarness]:
    harness = FrontendHarness(str(tmp_path), emulated_cluster())
    yield harness
    harness.close()


def _outputs(ids: list[int], values: list[float], plan_id: int, started_at: float,
             finished_at: float) -> BatchOutputs:
    rows = [{"y": np.array([[v]], np.float32)} for v in values]
    return BatchOutputs(plan_id, ids, rows, started_at, finished_at)


def test_cancel_after_fetch_tells_the_backend_and_answers_once(
    frontend: FrontendHarness,
) -> None:
    backend = frontend.backend()
    with zserve.Client(frontend.client_address, timeout=10) as client:
        keep, drop = client.submit("m", sample(1)), client.submit("m", sample(2))
        ids = meta_ids(frontend, 2)
        fetched_at = time.monotonic()
        assert fetch(backend, ids, plan_id=7).missing == []
        assert client.cancel(drop)
        with pytest.raises(zserve.CancelledError):
            drop.result(10)
        _, notice = recv_type(backend, CancelFetched, router=False)
        assert notice.plan_ids == [7] and notice.request_ids == [ids[1]]
        # Had the batch started anyway, its output for the cancelled request is discarded.
        # started_at must lie in the past when the frontend answers (queueing <= answer time):
        # the fetch moment does, and it follows the request's admission.
        started_at = fetched_at
        socket_io.sync_send(backend, _outputs(ids, [8.0, 16.0], 7, started_at, started_at + 0.002))
        assert keep.result(10)["y"][0, 0] == pytest.approx(8.0)
        current = wait_stats(frontend, lambda st: st["counters"].get("late_outputs") == 1)
    counters = current["counters"]
    assert counters["cancelled_fetched"] == 1 and counters["cancel_notices"] == 1
    assert counters["error_CANCELLED"] == 1 and counters["replied"] == 1
    hops = current["latency"]
    assert hops["queueing"]["count"] == 1 and hops["execution"]["count"] == 1
    assert hops["execution"]["p50_ms"] == pytest.approx(2.0, abs=1e-6)
    # per batch: finish -> outputs handled; per answered request: answer - admission - run
    assert hops["finish_to_answer"]["count"] == 1 and hops["overhead"]["count"] == 1
    # one sample each: answer - admission - run = (start - admission) + (answer - finish)
    assert hops["overhead"]["p50_ms"] == pytest.approx(
        hops["queueing"]["p50_ms"] + hops["finish_to_answer"]["p50_ms"], abs=1e-6)
    assert current["latency"]["queueing/m"]["count"] == 1
    # The kept request's own answer time, exactly: its one sample of answer - admission - run,
    # plus its run. It is also the larger of the two answer times (admitted first, answered
    # last), so the histogram's max is this sample; its p50 is not (it may be the cancelled
    # request's answer, admitted later by a gap the host's load decides).
    kept_answer_ms = hops["overhead"]["p50_ms"] + hops["execution"]["p50_ms"]
    assert hops["admit_to_answer"]["count"] == 2
    assert hops["admit_to_answer"]["max_ms"] == pytest.approx(kept_answer_ms, abs=1e-6)
    assert 0.0 < hops["queueing"]["p50_ms"] <= kept_answer_ms
    reset = frontend_stats_reset(frontend)
    assert reset["latency"]["queueing"]["count"] == 1  # the reply is taken before the reset
    assert stats(frontend)["latency"]["queueing"] == {"count": 0}


def frontend_stats_reset(h: FrontendHarness) -> dict[str, Any]:
    """The frontend's stats over its client socket, with reset (what ``zserve bench ADDRESS``
    uses)."""
    from zserve.transport.messages import StatsReply, StatsRequest

    sock = make_dealer(h.ctx, h.client_address, identity=b"stats-reader")
    try:
        socket_io.sync_send(sock, StatsRequest(reset=True))
        _, reply = recv_type(sock, StatsReply, router=False)
    finally:
        sock.close(linger=0)
    return reply.stats


def test_disconnect_after_fetch_tells_the_backend(frontend: FrontendHarness) -> None:
    backend = frontend.backend()
    raw = make_dealer(frontend.ctx, frontend.client_address, identity=b"vanishing")
    for i in range(3):
        socket_io.sync_send(raw, InferRequest(i, "m", sample(i)))
    ids = meta_ids(frontend, 3)
    assert fetch(backend, ids[:2], plan_id=3).missing == []
    raw.close(linger=0)
    _, notice = recv_type(backend, CancelFetched, router=False)
    assert notice.plan_ids == [3, 3] and sorted(notice.request_ids) == sorted(ids[:2])
    current = wait_stats(frontend, lambda st: st["pending"] == 0)
    assert current["counters"]["disconnect_cancelled_fetched"] == 2
    assert current["counters"]["disconnect_cancelled"] == 1
    assert fetch(backend, ids[2:], plan_id=4).missing == ids[2:]
