"""FrontendCancellation alone: what a frontend's shards and backends must hear of requests taken
out before their answer (one note per request, sent once, to the right shard or backend, counted
as a cancellation or a disconnect)."""

from __future__ import annotations

from zserve.frontend.cancel import (
    CANCEL_COUNTERS,
    FetchedCancels,
    FrontendCancellation,
    QueuedCancels,
)
from zserve.frontend.requests import Pending, RequestTable

CLIENT = b"client-1"
SHARD_OF = {"m": 0, "a": 1}


def _part() -> tuple[FrontendCancellation, dict[str, int]]:
    counters = dict.fromkeys(CANCEL_COUNTERS, 0)
    return FrontendCancellation(shard_of=SHARD_OF, shards=2, counters=counters), counters


def _table(models: list[str]) -> RequestTable:
    """Requests ``rid`` = 100 + client id, one per model in ``models``, all queued."""
    table = RequestTable()
    for client_rid, model in enumerate(models):
        table.add(Pending(100 + client_rid, CLIENT, client_rid, model, {"x": None}, 0.0, 0.1))
    return table


def test_queued_requests_go_to_their_models_shard_in_one_note_per_shard() -> None:
    cancels, counters = _part()
    table = _table(["m", "a", "m"])
    for p in table.pending.values():
        cancels.cancelled(p)
    assert cancels.take_queued() == [QueuedCancels(0, [100, 102], ["m", "m"]),
                                     QueuedCancels(1, [101], ["a"])]
    assert cancels.take_fetched() == []
    assert counters["cancelled"] == 3 and counters["cancelled_fetched"] == 0
    assert cancels.take_queued() == []  # taken once


def test_fetched_requests_go_to_the_backend_that_holds_them_with_their_plans() -> None:
    cancels, counters = _part()
    table = _table(["m", "m", "a"])
    assert table.take_inputs(100, "backend-0", 7, 0.01) is not None
    assert table.take_inputs(101, "backend-1", 8, 0.01) is not None
    assert table.take_inputs(102, "backend-0", 9, 0.01) is not None
    for p in table.pending.values():
        cancels.cancelled(p)
    assert cancels.take_fetched() == [FetchedCancels("backend-0", [7, 9], [100, 102]),
                                      FetchedCancels("backend-1", [8], [101])]
    assert cancels.take_queued() == []
    assert counters["cancelled_fetched"] == 3 and counters["cancelled"] == 0
    assert cancels.take_fetched() == []


def test_a_closed_connections_requests_count_as_disconnects() -> None:
    cancels, counters = _part()
    table = _table(["m", "a"])
    assert table.take_inputs(101, "backend-0", 3, 0.01) is not None
    for p in table.pending.values():
        cancels.abandoned(p)
    assert cancels.take_queued() == [QueuedCancels(0, [100], ["m"])]
    assert cancels.take_fetched() == [FetchedCancels("backend-0", [3], [101])]
    assert counters == {"cancelled": 0, "cancelled_fetched": 0, "disconnect_cancelled": 1,
                        "disconnect_cancelled_fetched": 1}


def test_owed_says_whether_a_notice_waits_until_every_one_is_taken() -> None:
    """The core skips the takes on a tick where ``owed`` is False: it must be True while any
    notice waits, whichever of the two takes comes first."""
    cancels, _ = _part()
    assert cancels.owed is False
    table = _table(["m", "a"])
    assert table.take_inputs(101, "backend-0", 3, 0.01) is not None
    for p in table.pending.values():
        cancels.cancelled(p)
    assert cancels.owed is True
    assert cancels.take_fetched() == [FetchedCancels("backend-0", [3], [101])]
    assert cancels.owed is True  # the queued note is still there
    assert cancels.take_queued() == [QueuedCancels(0, [100], ["m"])]
    assert cancels.owed is False
    cancels.abandoned(next(iter(_table(["a"]).pending.values())))
    assert cancels.owed is True
    assert cancels.take_queued() == [QueuedCancels(1, [100], ["a"])]
    assert cancels.owed is False
