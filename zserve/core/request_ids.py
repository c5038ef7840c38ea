"""Frontend request ids: unique across the cluster's frontends and across each frontend's restarts.

A frontend numbers its requests ``seq * MAX_FRONTENDS + index`` (its index in the low digits, so
a batch that mixes frontends never holds two requests with one id) with its *incarnation* in the
high bits. A restarted frontend (same index, same data address) therefore never reuses an id its
previous process used: the outputs, drops, failures and fetches still in flight for the dead
process's requests cannot match a live request, and the frontend refuses and counts them.

Why in the id rather than an incarnation field in every message: the id already travels
unchanged through every role (RequestMetaBatch, the shard's queues, BatchPlan, InputFetch,
BatchOutputs, DropNotice, BatchFailed, CancelFetched), so no role can forget to carry or check it,
and the shards' and backends' (frontend, id) keys stay unique across incarnations for free.

Layout, within an int64 (numpy and msgpack both carry it): bits 39..62 the incarnation, bits
0..38 ``seq * MAX_FRONTENDS + index`` (seq wraps after 2**29 requests: hours of traffic, long
after any message of those requests has died).
"""

from __future__ import annotations

import time

MAX_FRONTENDS = 1024
INCARNATION_SHIFT = 39
INCARNATION_BITS = 24
INCARNATIONS = 1 << INCARNATION_BITS
_LOCAL_ID_LIMIT = 1 << INCARNATION_SHIFT


def new_incarnation() -> int:
    """A frontend process's incarnation: the wall-clock millisecond of its start, modulo
    2**24 - 1, plus 1. Two starts of one frontend share one only if they are a multiple of
    4.66 hours apart to the millisecond (a restart takes far longer than 1 ms), and no message
    outlives its request's SLO by hours. 0 is left to hosts that never restart (the simulator,
    unit tests)."""
    return time.time_ns() // 1_000_000 % (INCARNATIONS - 1) + 1


def incarnation_of(rid: int) -> int:
    """The incarnation of the frontend process that numbered request id ``rid``."""
    return rid >> INCARNATION_SHIFT


class RequestIds:
    """The ids one frontend process gives its requests, in order (see the module docstring)."""

    __slots__ = ("first", "incarnation", "last", "next")

    def __init__(self, index: int, incarnation: int) -> None:
        if not 0 <= incarnation < INCARNATIONS:
            raise ValueError(f"incarnation {incarnation} is not in [0, {INCARNATIONS})")
        self.incarnation = incarnation
        base = incarnation << INCARNATION_SHIFT
        self.first = base + MAX_FRONTENDS + index % MAX_FRONTENDS
        self.last = base + _LOCAL_ID_LIMIT - MAX_FRONTENDS + index % MAX_FRONTENDS
        self.next = self.first

    def take(self) -> int:
        """The next request id."""
        rid = self.next
        self.next = rid + MAX_FRONTENDS if rid < self.last else self.first
        return rid

    def is_foreign(self, rid: int) -> bool:
        """``rid`` was numbered by another incarnation (or is no id of this frontend's)."""
        return rid >> INCARNATION_SHIFT != self.incarnation
