"""The rank's backend table: registration, GPU ids, suspicion and revival, liveness.

``RankBackends`` is the part of ``zserve.scheduler.rank_host.RankHost`` that keeps the table of
backends (one ``_Backend`` per GPU id) and tells the RankThread which GPUs it may grant:

- ``BackendRegister`` adds a backend (or gives a known name its GPU back); a backend's GPU id is
  its index in the cluster config (``configured_backend_index``), so a restarted rank gives
  every backend the id it had whatever order they register in;
- ``BackendSuspect`` (a shard's plan went unacknowledged) takes a GPU out until the backend
  heartbeats again after the suspicion (``_revive``);
- the liveness loop removes a backend silent for ``backend_timeout_s``;
- ``table()`` is the ``BackendTable`` every shard and frontend hears.

The host owns the sockets, the epochs and the output (``_send``, ``_flush``,
``_broadcast_table``, ``_end_rebuild``); this mixin declares what it uses of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from zserve.core.hosting import Outbox
from zserve.core.liveness import HEARTBEAT_INTERVAL_S
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import (
    BackendRegister,
    BackendSuspect,
    BackendTable,
    Message,
    protocol_mismatch,
)

log = logging.getLogger(__name__)

BACKEND_ROLE = "backend"
# A backend silent for this long is removed: 4 missed heartbeats (HEARTBEAT_INTERVAL_S = 0.5 s).
BACKEND_TIMEOUT_S = 4 * HEARTBEAT_INTERVAL_S


def configured_backend_index(name: str) -> int | None:
    """``n`` for the backend named ``backend-<n>`` (``zserve.config.cluster.process_name``), else
    None."""
    role, _, index = name.rpartition("-")
    return int(index) if role == BACKEND_ROLE and index.isdigit() else None


# --------------------------------------------------------------------------- the rank host


@dataclass(slots=True)
class _Backend:
    gpu_id: int
    name: str
    identity: bytes
    device: str
    address: str
    models: list[str]
    profiles_ms: dict[str, list[float]]
    last_seen: float
    alive: bool = True
    # When a shard's suspicion took it out (rank clock; -inf: not suspect): only a heartbeat
    # sent after it brings the backend back (one sent before may arrive after).
    suspect_since: float = -math.inf
    registered_at: float = 0.0
    signatures: dict[str, dict[str, Any]] = field(default_factory=dict)


class RankBackends:
    """The backend table of a ``RankHost`` (mixed into it; see the module docstring)."""

    # Set by RankHost.__init__.
    name: str
    rank: RankThread
    counters: dict[str, int]
    backends: dict[int, _Backend]
    gpu_by_name: dict[str, int]
    backend_ids: set[bytes]
    backend_timeout_s: float
    epoch: int
    _rebuilding: set[str] | None
    _rebuild_handle: asyncio.TimerHandle | None

    # Provided by RankHost.
    @property
    def active(self) -> bool:
        raise NotImplementedError

    def _send(self, msg: Message, identity: bytes) -> bool:
        raise NotImplementedError

    def _flush(self, outbox: Outbox) -> None:
        raise NotImplementedError

    def _broadcast_table(self) -> None:
        raise NotImplementedError

    def _end_rebuild(self) -> None:
        raise NotImplementedError

    def _on_register(self, now: float, identity: bytes, msg: BackendRegister,
                     outbox: Outbox) -> None:
        refusal = protocol_mismatch(f"backend {msg.name}", msg.protocol)
        if refusal is not None:  # its plans and table entries could not be trusted to decode
            self.counters["bad_messages"] += 1
            log.error("%s: refusing %s", self.name, refusal)
            return
        self.backend_ids.add(identity)
        if not self.active:
            self.counters["standby_ignored"] += 1
            return
        self.counters["registrations"] += 1
        gpu_id = self.gpu_by_name.get(msg.name)
        if gpu_id is None:
            gpu_id = self._new_gpu_id(msg)
            self.gpu_by_name[msg.name] = gpu_id
        previous = self.backends.get(gpu_id)
        backend = _Backend(gpu_id, msg.name, identity, msg.device, msg.plan_address,
                           list(msg.models), dict(msg.profiles_ms), now,
                           signatures=dict(msg.signatures), registered_at=now)
        self.backends[gpu_id] = backend
        # The table goes out before the GPU can be granted: a shard knows a GPU's plan address
        # before its first plan for it (one FIFO per peer).
        self._broadcast_table()
        if previous is None or not previous.alive:
            self.rank.add_gpu(now, gpu_id, outbox)
        if msg.device_free_at > now:  # busy with plans of an earlier epoch: free later
            self.rank.on_device_free_at(now, gpu_id, msg.device_free_at, outbox)
        log.info("%s: backend %s (%s, %s) is GPU %d", self.name, msg.name, msg.device,
                 msg.plan_address, gpu_id)
        if self._rebuilding:
            self._rebuilding.discard(msg.name)
            if not self._rebuilding and self._rebuild_handle is not None:
                self._end_rebuild()

    def _new_gpu_id(self, msg: BackendRegister) -> int:
        """The id of a backend this rank has not seen: its index in the cluster config (the
        ``<n>`` of its name ``backend-<n>``, ``zserve.config.cluster.process_name``), so a
        restarted rank
        gives every backend the id the shards' plans and tables already use, whatever order they
        register in; the lowest free id when its name has none or another backend holds it."""
        taken = set(self.gpu_by_name.values())
        index = configured_backend_index(msg.name)
        if index is not None and index not in taken:
            return index
        if index is not None:
            log.warning("%s: backend %s has index %d, which another backend holds", self.name,
                        msg.name, index)
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def _on_suspect(self, now: float, identity: bytes, msg: BackendSuspect,
                    outbox: Outbox) -> None:
        """A shard's plan went unacknowledged: stop granting that GPU now, and tell every shard
        and frontend (they release its plans and the requests it fetched). A suspicion that
        changes nothing (the backend is out already, or registered again since that plan was
        sent) is answered with the table, which the shard then serves from again."""
        backend = self.backends.get(msg.gpu_id)
        if backend is None or not backend.alive or backend.registered_at > msg.sent_at:
            self._send(self.table(), identity)
            return
        self.counters["suspects"] += 1
        log.warning("%s: backend %s (GPU %d) is suspect: %s", self.name, backend.name,
                    backend.gpu_id, msg.message)
        backend.suspect_since = now
        self._take_out(now, backend, outbox)
        self._broadcast_table()

    def _revive(self, now: float, backend: _Backend, outbox: Outbox) -> None:
        if backend.suspect_since > -math.inf:
            self.counters["revivals"] += 1
            log.info("%s: backend %s (GPU %d) answers again: back in use", self.name,
                     backend.name, backend.gpu_id)
            backend.suspect_since = -math.inf
        backend.alive = True
        self._broadcast_table()
        self.rank.add_gpu(now, backend.gpu_id, outbox)

    async def _liveness_loop(self) -> None:
        interval = self.backend_timeout_s / 4
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            outbox: Outbox = []
            changed = False
            for backend in self.backends.values():
                if backend.alive and now - backend.last_seen > self.backend_timeout_s:
                    log.warning("%s: backend %s (GPU %d) silent for %.1f s: removed", self.name,
                                backend.name, backend.gpu_id, now - backend.last_seen)
                    self._remove(now, backend, outbox)
                    changed = True
            if changed:
                self._broadcast_table()
            self._flush(outbox)

    def _remove(self, now: float, backend: _Backend, outbox: Outbox) -> None:
        self.counters["removals"] += 1
        self._take_out(now, backend, outbox)

    def _take_out(self, now: float, backend: _Backend, outbox: Outbox) -> None:
        """Grant the backend's GPU nothing new (it finishes what it holds)."""
        backend.alive = False
        with contextlib.suppress(ValueError):
            self.rank.remove_gpu(now, backend.gpu_id, outbox)

    def table(self) -> BackendTable:
        alive = sorted((b for b in self.backends.values() if b.alive), key=lambda b: b.gpu_id)
        return BackendTable(
            gpu_ids=[b.gpu_id for b in alive],
            names=[b.name for b in alive],
            addresses=[b.address for b in alive],
            models=[list(b.models) for b in alive],
            profiles_ms=[dict(b.profiles_ms) for b in alive],
            signatures=[dict(b.signatures) for b in alive],
            epoch=self.epoch,
        )
