"""How a shard reads the ``BackendTable`` of a rank that restarted (pure: the clock is passed in).

A restarted rank knows nobody. Backends and shards heartbeat to it; it answers each with
``Hello`` and the peer introduces itself again: a backend registers, a shard says Hello and gets
the table at once. So the first tables a shard gets from the new rank hold only the backends
that have registered again so far, often none. Read as is, such a table says every other backend
left the cluster: the shard would fail the plans they acknowledged (``BACKEND_FAILED``) and
answer the models nobody serves ``UNAVAILABLE``, though the backends are alive and will register
within a heartbeat.

``RankRejoin`` keeps, for ``REJOIN_GRACE_S`` after the rank's Hello, every GPU the shard knew that
the new table lacks (same id, address and models: GPU ids are the backends' configured indexes,
stable across rank restarts). A GPU the new table gives another address is replaced at once. When
the grace ends, the rank's latest table applies as it is: a backend still missing has left.
"""

from __future__ import annotations

import math
from typing import Any

from zserve.core.liveness import HEARTBEAT_INTERVAL_S
from zserve.transport.messages import BackendTable

# Every live backend heartbeats within HEARTBEAT_INTERVAL_S and then registers: four intervals
# (the rank's own timeout for a silent backend) leave room for a loaded host.
REJOIN_GRACE_S = 4 * HEARTBEAT_INTERVAL_S


class RankRejoin:
    """The table a shard serves from, given the tables the rank sends and its Hellos."""

    def __init__(self, counters: dict[str, int]) -> None:
        # ``gpus_kept``: GPUs kept past a table that lacked them
        self.counters = counters
        self.applied: BackendTable | None = None  # what the shard serves from now
        self.latest: BackendTable | None = None  # what the rank last sent
        self.grace_until = -math.inf

    def on_rank_hello(self, now: float) -> float:
        """The rank restarted (it asked who this shard is): returns when the grace ends."""
        self.grace_until = now + REJOIN_GRACE_S
        return self.grace_until

    def on_table(self, now: float, table: BackendTable) -> BackendTable:
        """The table to serve from, given the one the rank just sent."""
        self.latest = table
        if now < self.grace_until and self.applied is not None:
            present = set(table.gpu_ids)
            missing = [i for i, gpu_id in enumerate(self.applied.gpu_ids)
                       if gpu_id not in present]
            self.counters["gpus_kept"] += len(missing)
            table = _merged([_rows(table), [_rows(self.applied)[i] for i in missing]])
        self.applied = table
        return table

    def on_grace_over(self, now: float) -> BackendTable | None:
        """The rank's latest table, when it differs from the one served (else None)."""
        if now < self.grace_until or self.latest is None or self.latest == self.applied:
            return None
        self.applied = self.latest
        return self.latest


# One backend's entry of a table: gpu id, name, address, models, profiles, signatures, kind.
_Row = tuple[int, str, str, list[str], dict[str, list[float]], dict[str, dict[str, Any]], str]


def _rows(table: BackendTable) -> list[_Row]:
    n = len(table.gpu_ids)
    profiles = table.profiles_ms + [{}] * (n - len(table.profiles_ms))
    signatures = table.signatures + [{}] * (n - len(table.signatures))
    kinds = table.kinds + [""] * (n - len(table.kinds))
    return list(zip(table.gpu_ids, table.names, table.addresses, table.models, profiles,
                    signatures, kinds, strict=True))


def _merged(parts: list[list[_Row]]) -> BackendTable:
    rows = sorted((row for part in parts for row in part), key=lambda row: row[0])
    return BackendTable(
        gpu_ids=[r[0] for r in rows], names=[r[1] for r in rows], addresses=[r[2] for r in rows],
        models=[r[3] for r in rows], profiles_ms=[r[4] for r in rows],
        signatures=[r[5] for r in rows], kinds=[r[6] for r in rows])
