"""Nexus's data path as pure cores: a GPU's executor (its own queues, its sessions run
round-robin at their assigned batch sizes, Nexus's sliding-window early drop) and a frontend's
deficit round robin over a session's GPUs. No central scheduler sits on this path: a frontend
sends a request straight to a GPU, which queues and batches it alone.

``NexusGpuCore`` takes the clock with every call and reports ``wake_at`` (the end of the batch it
runs); what it decides goes into the outbox passed in: ``RunNexusBatch`` (a batch starts now and
ends at ``finish_at``) and ``DropNexus`` (requests dropped before running, answered at once).

Backup backends (the public code's, off by default; notes NX-17): a model may list backup GPUs.
When a GPU's open requests of a model would exceed its assigned batch, the request is relayed to
the backup with the lowest utilization (queued work against the duty cycle) below full, else
queued where it arrived (:class:`BackupRelay`, :func:`backup_gpus`). A backup GPU that does not
hold the model runs it only in time its own sessions leave (``load_table``'s ``backups``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zserve.config.profiles import LatencyProfile
from zserve.scheduler.baselines.nexus_plan import NexusPlan, Slot

__all__ = ["BACKUPS_PER_MODEL", "BackupRelay", "DropNexus", "DrrRouter", "NexusGpuCore",
           "RunNexusBatch", "backup_gpus", "early_drop_batch"]

BACKUPS_PER_MODEL = 2  # GPUs that do not hold a model but list it as a backup
FULL_UTILIZATION = 1.0  # a backup at or above this takes no relayed request


@dataclass(frozen=True)
class RunNexusBatch:
    model: str
    request_ids: list[int]
    finish_at: float


@dataclass(frozen=True)
class DropNexus:
    model: str
    request_ids: list[int]


Queue = deque[tuple[int, float]]  # (request id, deadline), earliest deadline first


def early_drop_batch(queue: Queue, profile: LatencyProfile, assigned: int, now: float,
                     ) -> tuple[list[int], list[int]]:
    """Nexus's ``GetBatchTaskSlidingWindow``: a window of ``min(assigned, max_batch, queue)``
    requests must all finish by their deadlines if run now; requests from the head whose
    deadline falls before that window's finish are dropped, and the window shrinks when too few
    remain to fill it. Pops from ``queue``; returns (batch, dropped) request ids."""
    expect = min(assigned, profile.max_batch, len(queue))
    finish = now + profile.latency(expect)
    batch: list[int] = []
    dropped: list[int] = []
    while len(batch) < expect and queue:
        rid, deadline = queue.popleft()
        if deadline < finish:
            dropped.append(rid)
        else:
            batch.append(rid)
        if expect > len(batch) + len(queue):
            expect = len(batch) + len(queue)
            finish = now + profile.latency(expect)
    return batch, dropped


class NexusGpuCore:
    """One GPU: a queue per model, the epoch's table of sessions (order and assigned batch), and
    a work-conserving round robin: when the GPU is free, the next session in the table with a
    non-empty window runs its batch (the duty cycle is a planning quantity, not a timer)."""

    def __init__(self, profiles: Mapping[str, LatencyProfile]) -> None:
        self.profiles = dict(profiles)
        self.queues: dict[str, Queue] = {name: deque() for name in profiles}
        self.table: list[Slot] = []
        self.backups: list[Slot] = []  # sessions run only when no table session has a batch
        self.duty_cycle_s = 0.0
        self._turn = 0  # the table index whose turn is next
        self.busy_until: float | None = None
        self.wake_at = math.inf

    def load_table(self, now: float, slots: Sequence[Slot], outbox: list[object], *,
                   duty_cycle_s: float = 0.0, backups: Sequence[Slot] = ()) -> None:
        """An epoch's table (and the backup sessions this GPU runs in leftover time); queued
        requests of a session it no longer holds are dropped (the model is unloaded)."""
        self.table = list(slots)
        self.backups = [b for b in backups if b.name not in {s.name for s in slots}]
        self.duty_cycle_s = duty_cycle_s
        self._turn = 0
        held = {s.name for s in [*slots, *self.backups]}
        for name, queue in self.queues.items():
            if queue and name not in held:
                outbox.append(DropNexus(name, [rid for rid, _ in queue]))
                queue.clear()
        if self.busy_until is None:
            self._start_next(now, outbox)

    def on_request(self, now: float, model: str, request_id: int, deadline: float,
                   outbox: list[object]) -> None:
        self.queues[model].append((request_id, deadline))
        if self.busy_until is None:
            self._start_next(now, outbox)

    def open_requests(self, model: str) -> int:
        return len(self.queues[model])

    def assigned_batch(self, model: str) -> int | None:
        """The model's batch in this GPU's table (None: not held, or held as a backup)."""
        return next((s.batch for s in self.table if s.name == model), None)

    def utilization(self, now: float) -> float:
        """Queued work against the duty cycle (Nexus's ``CurrentUtilization``): the running
        batch's rest and every queue run at its assigned batch, over one duty cycle; inf
        without a duty cycle (a GPU with no table is no backup)."""
        if self.duty_cycle_s <= 0:
            return math.inf
        work = max(0.0, (self.busy_until or now) - now)
        for slot in [*self.table, *self.backups]:
            waiting = len(self.queues[slot.name])
            if waiting:
                profile = self.profiles[slot.name]
                full, rest = divmod(waiting, slot.batch)
                work += full * profile.latency(slot.batch)
                work += profile.latency(rest) if rest else 0.0
        return work / self.duty_cycle_s

    def on_timer(self, now: float, outbox: list[object]) -> None:
        """The running batch ends at ``wake_at``: the GPU takes the next session's batch."""
        if now < self.wake_at:
            return
        self.busy_until = None
        self.wake_at = math.inf
        self._start_next(now, outbox)

    def _start_next(self, now: float, outbox: list[object]) -> None:
        """One pass over the table from the session whose turn it is: the first with a batch
        runs; every session passed drops what its window drops. Then, if none ran, the backup
        sessions in order (the time the table leaves)."""
        n = len(self.table)
        for step in range(n):
            if self._run(self.table[(self._turn + step) % n], now, outbox):
                self._turn = (self._turn + step + 1) % n
                return
        for slot in self.backups:
            if self._run(slot, now, outbox):
                return

    def _run(self, slot: Slot, now: float, outbox: list[object]) -> bool:
        """The session's window: drops go out, and a batch starts if one is left."""
        queue = self.queues[slot.name]
        if not queue:
            return False
        profile = self.profiles[slot.name]
        batch, dropped = early_drop_batch(queue, profile, slot.batch, now)
        if dropped:
            outbox.append(DropNexus(slot.name, dropped))
        if not batch:
            return False
        finish = now + profile.latency(len(batch))
        outbox.append(RunNexusBatch(slot.name, batch, finish))
        self.busy_until = self.wake_at = finish
        return True


class DrrRouter:
    """A frontend's deficit round robin over one session's GPUs, weighted by the throughput the
    plan routes to each (uwsampl/nexus ``GetBackendDeficitRoundRobin``): each visit tops a
    GPU's deficit up by weight / smallest weight and sends while it holds one request's worth."""

    def __init__(self, weights: Mapping[int, float]) -> None:
        positive = {gpu: w for gpu, w in sorted(weights.items()) if w > 0}
        if not positive:
            raise ValueError("a route needs at least one GPU with a positive weight")
        least = min(positive.values())
        self.order = list(positive)
        self.quantum = [positive[g] / least for g in self.order]
        self.deficit = [0.0] * len(self.order)
        self._pos = 0

    def pick(self) -> int:
        while True:
            if self.deficit[self._pos] >= 1.0:
                self.deficit[self._pos] -= 1.0
                return self.order[self._pos]
            self.deficit[self._pos] += self.quantum[self._pos]
            self._pos = (self._pos + 1) % len(self.order)


def backup_gpus(plan: NexusPlan, per_model: int = BACKUPS_PER_MODEL,
                ) -> tuple[dict[str, list[int]], dict[int, list[Slot]]]:
    """A plan's static backup lists: each model's backups are the other GPUs that hold it (a
    relayed request joins that GPU's queue of it) and the ``per_model`` least occupied GPUs that
    do not (they run it at its largest planned batch in time their own sessions leave). Returns
    ({model: backup GPUs}, {GPU: the backup sessions it runs})."""
    holders: dict[str, list[int]] = {}
    batch: dict[str, int] = {}
    for gpu, g in enumerate(plan.gpus):
        for slot in g.slots:
            holders.setdefault(slot.name, []).append(gpu)
            batch[slot.name] = max(batch.get(slot.name, 0), slot.batch)
    load = {gpu: sum(s.rate_rps * g.duty_cycle_s / max(1, s.batch) for s in g.slots)
            for gpu, g in enumerate(plan.gpus)}
    lists: dict[str, list[int]] = {}
    runs: dict[int, list[Slot]] = {}
    for name, held in holders.items():
        others = sorted((gpu for gpu in load if gpu not in held), key=lambda g: (load[g], g))
        extra = others[:per_model]
        lists[name] = held + extra
        for gpu in extra:
            runs.setdefault(gpu, []).append(Slot(name, batch[name], 0.0))
    return lists, runs


class BackupRelay:
    """Where a GPU puts a request that arrived for ``model`` (NX-17): at home, unless its open
    requests of the model would exceed its assigned batch and a backup is below full; then the
    least utilized backup (lowest GPU id on a tie). A relayed request is not relayed again."""

    def __init__(self, backups: Mapping[str, Sequence[int]]) -> None:
        self.backups = {name: list(gpus) for name, gpus in backups.items()}
        self.relayed = 0

    def place(self, model: str, home: int, cores: Sequence[NexusGpuCore], now: float) -> int:
        core = cores[home]
        assigned = core.assigned_batch(model)
        if assigned is None or core.open_requests(model) + 1 <= assigned:
            return home
        candidates = [(cores[g].utilization(now), g) for g in self.backups.get(model, [])
                      if g != home]
        free = [c for c in candidates if c[0] < FULL_UTILIZATION]
        if not free:
            return home
        self.relayed += 1
        return min(free)[1]
