"""Shepherd's Flex (NSDI 2023) as a pure core: one central scheduler over a group of GPUs that,
whenever a GPU is free, starts the largest batch any model can run in time, and preempts a
running batch for a new one at least PREEMPT_FACTOR times larger.

A model's candidate batch is the largest prefix of its queue (earliest deadline first) that
finishes by its head's deadline if started now; a head that cannot finish even alone is dropped
first (answered at once). Preemption: with every GPU busy, the largest candidate is compared with
the smallest running batch; when it is at least PREEMPT_FACTOR times that batch's size, the
running batch stops (its GPU time is lost), its requests go back to their queue, and the GPU
starts the candidate. The clock comes in with every call, ``wake_at`` is the next batch end, and
decisions go to the outbox: ``StartFlexBatch`` (on ``gpu``, until ``finish_at``),
``PreemptFlexBatch`` (the batch on ``gpu`` stopped now) and ``DropFlex``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from zserve.config.profiles import LatencyProfile

__all__ = ["PREEMPT_FACTOR", "DropFlex", "FlexCore", "PreemptFlexBatch", "StartFlexBatch"]

PREEMPT_FACTOR = 3.0
"""Shepherd's lambda: a running batch is preempted only for one this many times its size."""


@dataclass(frozen=True)
class StartFlexBatch:
    gpu: int
    model: str
    request_ids: list[int]
    finish_at: float


@dataclass(frozen=True)
class PreemptFlexBatch:
    gpu: int
    model: str
    request_ids: list[int]


@dataclass(frozen=True)
class DropFlex:
    model: str
    request_ids: list[int]


@dataclass
class _Running:
    model: str
    queued: list[tuple[float, int]]  # (deadline, request id): back to the queue if preempted
    finish_at: float
    started_at: float


class FlexCore:
    """The central Flex scheduler of ``gpus`` GPUs serving every model in ``profiles``."""

    def __init__(self, profiles: Mapping[str, LatencyProfile], gpus: int) -> None:
        self.profiles = dict(profiles)
        self.queues: dict[str, list[tuple[float, int]]] = {m: [] for m in profiles}
        self.running: list[_Running | None] = [None] * gpus
        self.preemptions = 0
        self.wake_at = math.inf

    def on_request(self, now: float, model: str, request_id: int, deadline: float,
                   outbox: list[object]) -> None:
        bisect.insort(self.queues[model], (deadline, request_id))
        self._schedule(now, outbox)

    def on_timer(self, now: float, outbox: list[object]) -> None:
        """Batches ending by ``now`` free their GPUs."""
        for gpu, run in enumerate(self.running):
            if run is not None and run.finish_at <= now:
                self.running[gpu] = None
        self._schedule(now, outbox)

    def _candidate(self, now: float, model: str, outbox: list[object]) -> int:
        """The largest batch ``model`` can start now, after dropping heads that cannot finish
        even alone."""
        queue, profile = self.queues[model], self.profiles[model]
        late = 0
        while late < len(queue) and now + profile.latency(1) > queue[late][0]:
            late += 1
        if late:
            outbox.append(DropFlex(model, [rid for _, rid in queue[:late]]))
            del queue[:late]
        if not queue:
            return 0
        return min(len(queue), profile.largest_batch_within(queue[0][0] - now))

    def _best(self, now: float, outbox: list[object]) -> tuple[str, int]:
        best, size = "", 0
        for model in self.queues:
            b = self._candidate(now, model, outbox)
            if b > size:
                best, size = model, b
        return best, size

    def _schedule(self, now: float, outbox: list[object]) -> None:
        while True:
            model, size = self._best(now, outbox)
            if size == 0:
                break
            gpu = self._free_gpu()
            if gpu is None:
                gpu = self._preemptable(now, size)
                if gpu is None:
                    break
                # its requests rejoin their queue: the candidates are formed again, on a free GPU
                self._preempt(gpu, outbox)
                continue
            self._start(now, gpu, model, size, outbox)
        ends = [r.finish_at for r in self.running if r is not None]
        self.wake_at = min(ends, default=math.inf)

    def _free_gpu(self) -> int | None:
        for gpu, run in enumerate(self.running):
            if run is None:
                return gpu
        return None

    def _preemptable(self, now: float, size: int) -> int | None:
        """The GPU running the smallest batch, if ``size`` is at least PREEMPT_FACTOR times it.
        A batch started at this instant is not preempted: its requests rejoining the queue can
        shrink the candidate that displaced them (their deadlines come first), and preempting
        it again and again would never end."""
        sizes = [(len(r.queued), gpu) for gpu, r in enumerate(self.running)
                 if r is not None and r.started_at < now]
        if not sizes:
            return None
        smallest, gpu = min(sizes)
        return gpu if size >= PREEMPT_FACTOR * smallest else None

    def _preempt(self, gpu: int, outbox: list[object]) -> None:
        run = self.running[gpu]
        assert run is not None
        for item in run.queued:
            bisect.insort(self.queues[run.model], item)
        outbox.append(PreemptFlexBatch(gpu, run.model, [rid for _, rid in run.queued]))
        self.running[gpu] = None
        self.preemptions += 1

    def _start(self, now: float, gpu: int, model: str, size: int, outbox: list[object]) -> None:
        queue = self.queues[model]
        taken, self.queues[model] = queue[:size], queue[size:]
        finish = now + self.profiles[model].latency(size)
        self.running[gpu] = _Running(model, taken, finish, now)
        outbox.append(StartFlexBatch(gpu, model, [rid for _, rid in taken], finish))
