"""The rank's backend table: registration, GPU ids, suspicion and revival, liveness (pure logic).

``RankBackends`` keeps one entry per GPU id and tells the RankThread which GPUs it may grant:

- ``on_register`` (``BackendRegister``) adds a backend (or gives a known name its GPU back); a
  backend's GPU id is its index in the cluster config (``configured_backend_index``), so a
  restarted rank gives every backend the id it had whatever order they register in;
- ``on_suspect`` (``BackendSuspect``: a shard's plan went unacknowledged) takes a GPU out until
  the backend heartbeats again after the suspicion (``on_heartbeat``);
- ``expire`` removes a backend silent for ``timeout_s``; ``on_gone`` one whose process died;
- ``on_retire`` (the autoscaler's ``RetireBackend``) stops granting a backend's GPU but keeps it
  in the table until its process exits, so the plans it holds are served; a backend that
  registers saying it is ``retiring`` is treated the same, so a rank that takes over or
  restarts mid-release learns the release from the backend itself;
- ``table(epoch)`` is the ``BackendTable`` every shard and frontend hears.

Membership: the RankThread matches each model's candidates only to the GPUs whose backend lists
the model (``RankThread.set_members``), kept from the models each backend last registered with:
a backend that loads or withdraws a model registers again, and that registration is the one
step in which the rank's matching changes (before the GPU is granted anything).

No I/O and no clock: each call takes ``now`` and the RankThread's outbox, and says whether the
table changed. The host (``zserve.scheduler.rank_host.RankHost``) owns the sockets, the epochs,
the timers and the loop that calls ``expire`` every ``check_interval_s``; it broadcasts the
table when a call says it changed, before it delivers the outbox, so a shard knows a GPU's plan
address before its first grant for it (one FIFO per peer).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from zserve.core.hosting import Outbox
from zserve.core.liveness import HEARTBEAT_INTERVAL_S
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import (
    BackendRegister,
    BackendSuspect,
    BackendTable,
    protocol_mismatch,
)

log = logging.getLogger(__name__)

BACKEND_ROLE = "backend"
# A backend silent for this long is removed: 4 missed heartbeats (HEARTBEAT_INTERVAL_S = 0.5 s).
BACKEND_TIMEOUT_S = 4 * HEARTBEAT_INTERVAL_S
# How many liveness checks per timeout: a silent backend goes within 1.25 timeouts.
CHECKS_PER_TIMEOUT = 4
BACKEND_COUNTERS = ("registrations", "removals", "suspects", "revivals", "deaths_announced",
                    "retirements", "bad_messages", "standby_ignored")
"""What the table counts in the host's counters (``RANK_COUNTERS`` holds them)."""


def configured_backend_index(name: str) -> int | None:
    """``n`` for the backend named ``backend-<n>`` (``zserve.config.cluster.process_name``), else
    None."""
    role, _, index = name.rpartition("-")
    return int(index) if role == BACKEND_ROLE and index.isdigit() else None


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
    # Released by the autoscaler (``on_retire``): in the table, granted nothing new.
    retired: bool = False
    kind: str = ""  # the device kind it announced ("": none)


class RankBackends:
    """The backend table of one rank (see the module docstring). ``rank``: the RankThread whose
    GPU set it keeps; ``counters``: where to count (``BACKEND_COUNTERS``, the host's dict);
    ``name``: the rank's name, in log lines."""

    def __init__(self, rank: RankThread, counters: MutableMapping[str, int], *, name: str,
                 timeout_s: float = BACKEND_TIMEOUT_S) -> None:
        self.rank = rank
        self.counters = counters
        for key in BACKEND_COUNTERS:
            counters.setdefault(key, 0)
        self.name = name
        self.timeout_s = timeout_s
        self._by_gpu: dict[int, _Backend] = {}
        self._gpu_by_name: dict[str, int] = {}
        # the DEALER identities that introduced themselves as backends (Hello or registration)
        self.identities: set[bytes] = set()
        self._members: dict[str, list[int]] | None = None  # as the RankThread last heard it
        # when each of them was last heard (registration, Hello or heartbeat), also by a
        # standby: a takeover waits for those heard lately (``recently_heard``)
        self.heard_at: dict[bytes, float] = {}

    @property
    def check_interval_s(self) -> float:
        """How often the host should call ``expire``."""
        return self.timeout_s / CHECKS_PER_TIMEOUT

    def alive_names(self) -> set[str]:
        return {b.name for b in self._by_gpu.values() if b.alive}

    # ------------------------------------------------------------------ membership

    def on_hello(self, identity: bytes) -> None:
        """``identity`` said Hello as a backend (it registers on hearing the active epoch)."""
        self.identities.add(identity)

    def note_heard(self, now: float, identity: bytes) -> None:
        """A backend's message came from ``identity`` at ``now``."""
        if identity in self.identities:
            self.heard_at[identity] = now

    def recently_heard(self, now: float) -> set[str]:
        """The names of the backends heard within the heartbeat timeout: those alive now, by
        what this rank knows even as a standby (a backend's DEALER identity is its name)."""
        return {identity.decode(errors="replace") for identity, at in self.heard_at.items()
                if now - at <= self.timeout_s}

    def on_register(self, now: float, identity: bytes, msg: BackendRegister, outbox: Outbox, *,
                    active: bool) -> bool:
        """A backend registers; True when it is in the table now (the table changed). A standby
        (``active`` False) only notes who it is; a backend of another wire protocol is refused
        (its plans and table entries could not be trusted to decode)."""
        refusal = protocol_mismatch(f"backend {msg.name}", msg.protocol)
        if refusal is not None:
            self.counters["bad_messages"] += 1
            log.error("%s: refusing %s", self.name, refusal)
            return False
        self.identities.add(identity)
        self.note_heard(now, identity)
        if not active:
            self.counters["standby_ignored"] += 1
            return False
        self.counters["registrations"] += 1
        gpu_id = self._gpu_by_name.get(msg.name)
        if gpu_id is None:
            gpu_id = self._new_gpu_id(msg)
            self._gpu_by_name[msg.name] = gpu_id
        previous = self._by_gpu.get(gpu_id)
        was_retired = previous is not None and previous.alive and previous.retired
        granted = previous is not None and previous.alive and not previous.retired
        # Retiring: the rank heard RetireBackend, or the backend says so (it heard it first, or
        # this rank took over or restarted mid-release and knows it only from the backend).
        retired = msg.retiring or was_retired
        self._by_gpu[gpu_id] = _Backend(
            gpu_id, msg.name, identity, msg.device, msg.plan_address, list(msg.models),
            dict(msg.profiles_ms), now, signatures=dict(msg.signatures), registered_at=now,
            retired=retired, kind=msg.kind)
        self._tell_members(now, outbox)
        if retired and not was_retired:
            self._note_retired(msg.name, gpu_id)
        if retired and granted:
            with contextlib.suppress(ValueError):
                self.rank.remove_gpu(now, gpu_id, outbox)
        elif not retired and not granted:
            self.rank.add_gpu(now, gpu_id, outbox)
        if msg.device_free_at > now and not retired:  # busy with an earlier epoch's plans
            self.rank.on_device_free_at(now, gpu_id, msg.device_free_at, outbox)
        log.info("%s: backend %s (%s, %s) is GPU %d", self.name, msg.name, msg.device,
                 msg.plan_address, gpu_id)
        return True

    def members(self) -> dict[str, list[int]]:
        """Model -> the GPU ids of the backends that list it (in use or not: one out is no
        GPU of the RankThread's)."""
        members: dict[str, list[int]] = {}
        for gpu_id in sorted(self._by_gpu):
            for model in self._by_gpu[gpu_id].models:
                members.setdefault(model, []).append(gpu_id)
        return members

    def _tell_members(self, now: float, outbox: Outbox) -> None:
        """The RankThread matches each model to its backends' GPUs (when that changed)."""
        members = self.members()
        if members != self._members:
            self._members = members
            self.rank.set_members(now, members, outbox)

    def _new_gpu_id(self, msg: BackendRegister) -> int:
        """The id of a backend this rank has not seen: its index in the cluster config (the
        ``<n>`` of its name ``backend-<n>``, ``zserve.config.cluster.process_name``), so a
        restarted rank gives every backend the id the shards' plans and tables already use,
        whatever order they register in; the lowest free id when its name has none or another
        backend holds it."""
        taken = set(self._gpu_by_name.values())
        index = configured_backend_index(msg.name)
        if index is not None and index not in taken:
            return index
        if index is not None:
            log.warning("%s: backend %s has index %d, which another backend holds", self.name,
                        msg.name, index)
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def _entry_of(self, identity: bytes) -> _Backend | None:
        """The table's entry (in use or not) of the backend connected as ``identity`` (its
        name), if that connection still holds it."""
        gpu_id = self._gpu_by_name.get(identity.decode(errors="replace"))
        backend = self._by_gpu.get(gpu_id) if gpu_id is not None else None
        return backend if backend is not None and backend.identity == identity else None

    # ------------------------------------------------------------------ liveness

    def on_heartbeat(self, now: float, identity: bytes, sent_at: float,
                     outbox: Outbox) -> bool | None:
        """A heartbeat from ``identity``: None when no backend of the table holds it; else
        whether the backend came back (the table changed): one out, and if suspect, from a
        heartbeat sent after the suspicion."""
        backend = self._entry_of(identity)
        if backend is None:
            return None
        backend.last_seen = now
        if backend.alive or sent_at <= backend.suspect_since:
            return False
        if backend.suspect_since > -math.inf:
            self.counters["revivals"] += 1
            log.info("%s: backend %s (GPU %d) answers again: back in use", self.name,
                     backend.name, backend.gpu_id)
            backend.suspect_since = -math.inf
        backend.alive = True
        if backend.models and not backend.retired:
            self.rank.add_gpu(now, backend.gpu_id, outbox)
        return True

    def on_suspect(self, now: float, msg: BackendSuspect, outbox: Outbox) -> bool:
        """A shard's plan went unacknowledged: stop granting that GPU now; True when that
        changed the table (the host tells every shard and frontend: they release its plans and
        the requests it fetched). False: the suspicion changes nothing (the backend is out
        already, or registered again since that plan was sent), and the host answers the shard
        with the table, which it then serves from again."""
        backend = self._by_gpu.get(msg.gpu_id)
        if backend is None or not backend.alive or backend.registered_at > msg.sent_at:
            return False
        self.counters["suspects"] += 1
        log.warning("%s: backend %s (GPU %d) is suspect: %s", self.name, backend.name,
                    backend.gpu_id, msg.message)
        backend.suspect_since = now
        self._take_out(now, backend, outbox)
        return True

    def on_gone(self, now: float, name: str, outbox: Outbox) -> bool:
        """The supervisor says backend ``name``'s process died: remove it now rather than after
        ``timeout_s`` of silence. True when it was in the table."""
        gpu_id = self._gpu_by_name.get(name)
        backend = self._by_gpu.get(gpu_id) if gpu_id is not None else None
        if backend is None or not backend.alive:
            return False
        self.counters["deaths_announced"] += 1
        log.warning("%s: backend %s (GPU %d) died: removed", self.name, backend.name,
                    backend.gpu_id)
        self._remove(now, backend, outbox)
        return True

    def on_retire(self, now: float, name: str, outbox: Outbox) -> bool:
        """The supervisor's autoscaler releases backend ``name`` (``RetireBackend``): its GPU is
        granted nothing new, but the backend stays in the table (the table does not change), so
        the plans it holds run and their requests are answered; its exit (``on_gone``) removes
        it. True when it was in use."""
        gpu_id = self._gpu_by_name.get(name)
        backend = self._by_gpu.get(gpu_id) if gpu_id is not None else None
        if backend is None or not backend.alive or backend.retired:
            return False
        self._note_retired(name, backend.gpu_id)
        backend.retired = True
        with contextlib.suppress(ValueError):
            self.rank.remove_gpu(now, backend.gpu_id, outbox)
        return True

    def _note_retired(self, name: str, gpu_id: int) -> None:
        self.counters["retirements"] += 1
        log.info("%s: backend %s (GPU %d) retires: no new grants", self.name, name, gpu_id)

    def expire(self, now: float, outbox: Outbox, stalled_s: float = 0.0) -> bool:
        """Remove every backend silent for more than ``timeout_s``; True when any was.
        ``stalled_s``: how long the rank's own loop was stalled before this call (the host's
        ``stall_credit_s``): credited to every live backend first, since on a loaded host their
        heartbeats are late for the same reason (two backends were removed at once after the
        rank's loop stalled 2 s, at a load average of 15-17)."""
        changed = False
        if stalled_s > 0.0:
            for backend in self._by_gpu.values():
                seen = backend.last_seen + stalled_s
                backend.last_seen = seen if seen < now else now
        for backend in self._by_gpu.values():
            if backend.alive and now - backend.last_seen > self.timeout_s:
                log.warning("%s: backend %s (GPU %d) silent for %.1f s: removed", self.name,
                            backend.name, backend.gpu_id, now - backend.last_seen)
                self._remove(now, backend, outbox)
                changed = True
        return changed

    def on_device_free_at(self, now: float, identity: bytes, gpu_id: int, free_at: float,
                          outbox: Outbox) -> None:
        """Drift correction (``BatchStats.device_free_at``): the device frees later than the
        grants planned. Only from the live backend that holds this GPU."""
        backend = self._by_gpu.get(gpu_id)
        if backend is not None and backend.alive and backend.identity == identity:
            self.rank.on_device_free_at(now, gpu_id, free_at, outbox)

    def _remove(self, now: float, backend: _Backend, outbox: Outbox) -> None:
        self.counters["removals"] += 1
        self._take_out(now, backend, outbox)

    def _take_out(self, now: float, backend: _Backend, outbox: Outbox) -> None:
        """Grant the backend's GPU nothing new (it finishes what it holds)."""
        backend.alive = False
        if backend.retired:  # its GPU left the RankThread when it retired
            return
        with contextlib.suppress(ValueError):
            self.rank.remove_gpu(now, backend.gpu_id, outbox)

    # ------------------------------------------------------------------ what it tells

    def table(self, epoch: int) -> BackendTable:
        """The live backends, by GPU id, as of scheduler epoch ``epoch``."""
        alive = sorted((b for b in self._by_gpu.values() if b.alive), key=lambda b: b.gpu_id)
        return BackendTable(
            gpu_ids=[b.gpu_id for b in alive],
            names=[b.name for b in alive],
            addresses=[b.address for b in alive],
            models=[list(b.models) for b in alive],
            profiles_ms=[dict(b.profiles_ms) for b in alive],
            signatures=[dict(b.signatures) for b in alive],
            epoch=epoch,
            kinds=[b.kind for b in alive],
        )

    def stats(self) -> dict[str, dict[str, Any]]:
        """Every GPU the table has held: its backend, whether it is in use, whether suspect,
        whether released by the autoscaler (granted nothing new)."""
        return {
            str(b.gpu_id): {"name": b.name, "alive": b.alive, "device": b.device,
                            "kind": b.kind,
                            "suspect": not b.alive and b.suspect_since > -math.inf,
                            "retired": b.retired}
            for b in self._by_gpu.values()
        }


__all__ = ["BACKEND_COUNTERS", "BACKEND_TIMEOUT_S", "RankBackends", "configured_backend_index"]
