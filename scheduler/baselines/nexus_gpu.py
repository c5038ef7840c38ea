"""Nexus's data path as pure cores: a GPU's executor (its own queues, its sessions run
round-robin at their assigned batch sizes, Nexus's sliding-window early drop) and a frontend's
deficit round robin over a session's GPUs. No central scheduler sits on this path: a frontend
sends a request straight to a GPU, which queues and batches it alone.

``NexusGpuCore`` takes the clock with every call and reports ``wake_at`` (the end of the batch it
runs); what it decides goes into the outbox passed in: ``RunNexusBatch`` (a batch starts now and
ends at ``finish_at``) and ``DropNexus`` (requests dropped before running, answered at once).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zserve.config.profiles import LatencyProfile
from zserve.scheduler.baselines.nexus_plan import Slot

__all__ = ["DropNexus", "DrrRouter", "NexusGpuCore", "RunNexusBatch", "early_drop_batch"]


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
        self._turn = 0  # the table index whose turn is next
        self.busy_until: float | None = None
        self.wake_at = math.inf

    def load_table(self, now: float, slots: Sequence[Slot], outbox: list[object]) -> None:
        """An epoch's table; queued requests of a session it no longer holds are dropped (the
        model is unloaded)."""
        self.table = list(slots)
        self._turn = 0
        held = {s.name for s in slots}
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

    def on_timer(self, now: float, outbox: list[object]) -> None:
        """The running batch ends at ``wake_at``: the GPU takes the next session's batch."""
        if now < self.wake_at:
            return
        self.busy_until = None
        self.wake_at = math.inf
        self._start_next(now, outbox)

    def _start_next(self, now: float, outbox: list[object]) -> None:
        """One pass over the table from the session whose turn it is: the first with a batch
        runs; every session passed drops what its window drops."""
        n = len(self.table)
        for step in range(n):
            slot = self.table[(self._turn + step) % n]
            queue = self.queues[slot.name]
            if not queue:
                continue
            profile = self.profiles[slot.name]
            batch, dropped = early_drop_batch(queue, profile, slot.batch, now)
            if dropped:
                outbox.append(DropNexus(slot.name, dropped))
            if batch:
                finish = now + profile.latency(len(batch))
                outbox.append(RunNexusBatch(slot.name, batch, finish))
                self.busy_until = self.wake_at = finish
                self._turn = (self._turn + step + 1) % n
                return


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
