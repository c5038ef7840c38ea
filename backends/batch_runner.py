"""The executor side of a backend: a follower's RunBatch assembled, run and timed.

``BatchRunner`` owns the preallocated batch buffers (one per model input, max_batch rows, touched
at start-up), the staging slots the host copies each request's inputs into as they arrive
(``zserve.backends.staging``) and the device's ``BusyMeter``. ``run`` hands a staged batch over as
one slice of its slot (no copy), else stacks the batch's inputs with one copy per input (none for
a batch of one), awaits ``Executor.run_async`` (ONNX Runtime in the executor's
worker thread, an emulated batch by timer) and returns the outputs, or the error that failed this
batch only. The process host (``zserve.backends.host``) sends what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from zserve.backends.executor import Executor, TensorMap
from zserve.backends.follower import RunBatch
from zserve.backends.staging import StagingSlots
from zserve.core.stats import Stats
from zserve.runtime.clock import ClusterClock


@dataclass(slots=True)
class BusyMeter:
    """The device's busy time inside each stats window, exactly: a batch running across a window
    boundary counts in both windows for the part that fell in each. (Summing whole run times
    per window credited a batch to the window in which it ended, so a window could show more
    busy time than its length.)"""

    window_start: float
    accumulated_s: float = 0.0
    running_since: float | None = None
    finished_total_s: float = 0.0  # busy seconds of every finished batch, never reset

    def start(self, t: float) -> None:
        self.running_since = t

    def stop(self, t: float) -> None:
        if self.running_since is not None:
            self.accumulated_s += max(0.0, t - max(self.running_since, self.window_start))
            self.finished_total_s += max(0.0, t - self.running_since)
            self.running_since = None

    def total(self, now: float) -> float:
        """Busy seconds since the process started, windows ignored (a Prometheus counter)."""
        running = 0.0 if self.running_since is None else max(0.0, now - self.running_since)
        return self.finished_total_s + running

    def take(self, now: float, reset: bool) -> float:
        """Busy seconds from the window's start to ``now``; ``reset`` starts a new window."""
        busy = self.accumulated_s
        if self.running_since is not None:
            busy += max(0.0, now - max(self.running_since, self.window_start))
        if reset:
            self.accumulated_s = 0.0
            self.window_start = now
        return busy


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one batch gave: its outputs, one per request (empty when it failed), the error that
    failed it ("" when it ran) and when it finished (cluster clock)."""

    outputs: list[TensorMap]
    error: str
    finished_at: float


class BatchRunner:
    """Runs batches on one executor, one at a time (the follower never starts two)."""

    def __init__(self, executor: Executor, clock: ClusterClock, stats: Stats) -> None:
        """``stats``: the follower's (``BACKEND_HISTOGRAMS``): assemble and run are observed
        here."""
        self.executor = executor
        self.clock = clock
        self._assemble = stats.histograms["assemble"]
        self._run = stats.histograms["run"]
        self.busy = BusyMeter(clock.now())
        self._buffers: dict[tuple[str, str], np.ndarray[Any, Any]] = {}
        # Each request's rows copied in on arrival (zserve.backends.staging); the host claims,
        # stages and releases, ``assemble`` reads a staged batch back without a copy.
        self.staging = StagingSlots()
        self.staged_batches = 0  # batches handed to the executor as one slice of a slot

    def allocate(self, model: str) -> None:
        """The batch buffers and staging slots of ``model``, every page touched now, not on
        the first batch."""
        max_batch = self.executor.max_batch(model)
        signature = self.executor.signature(model)
        for spec in signature.inputs:
            buffer = np.empty((max_batch, *(int(d or 0) for d in spec.shape)),
                              np.dtype(spec.dtype))
            buffer.fill(0)
            self._buffers[(model, spec.name)] = buffer
        self.staging.allocate(model, signature, max_batch, self.executor.host_buffer)

    def free(self, model: str) -> None:
        """Drop ``model``'s batch buffers and staging slots (it was unloaded)."""
        for key in [key for key in self._buffers if key[0] == model]:
            del self._buffers[key]
        self.staging.free(model)

    def assemble(self, model: str, requests: list[TensorMap],
                 size: int | None = None) -> TensorMap:
        """One stacked batch of ``size`` rows (default: one per request): the requests' rows
        concatenated along axis 0, one copy per input into the preallocated buffer, none for
        one request. A request whose arrays do not match, or more rows than the buffer holds,
        fails the batch (ValueError/TypeError). Requests staged side by side in one slot are
        that slot's slice: no copy."""
        if len(requests) == 1:
            return requests[0]
        batch: TensorMap = {}
        if size is None:
            size = len(requests)
        signature = self.executor.signature(model)
        staged = self.staging.contiguous(requests, signature.input_names, size)
        if staged is not None:
            self.staged_batches += 1
            return staged
        for spec in signature.inputs:
            buffer = self._buffers[(model, spec.name)]
            np.concatenate([r[spec.name] for r in requests], axis=0, out=buffer[:size],
                           casting="no")
            batch[spec.name] = buffer[:size]
        return batch

    async def run(self, run: RunBatch) -> BatchResult:
        """Assemble and run ``run``; an execution error is returned, not raised."""
        model = run.plan.model
        try:
            t0 = self.clock.now()
            rows = request_rows(run.inputs)
            batch = self.assemble(model, run.inputs, None if rows is None else sum(rows))
            t1 = self.clock.now()
            self.busy.start(t1)
            try:
                outputs = await self.executor.run_async(model, batch, rows)
            finally:
                t2 = self.clock.now()
                self.busy.stop(t2)
            if len(outputs) != len(run.rows):
                raise ValueError(f"executor returned {len(outputs)} outputs for "
                                 f"{len(run.rows)} rows")
            self._assemble.observe(t1 - t0)
            self._run.observe(t2 - t1)
        except Exception as exc:  # an execution error fails this batch only
            return BatchResult([], f"{type(exc).__name__}: {exc}", self.clock.now())
        return BatchResult(outputs, "", self.clock.now())


def request_rows(requests: list[TensorMap]) -> list[int] | None:
    """Each request's rows (its inputs' leading dimension), or None when every request holds
    one row (the common case, which needs no per-request bookkeeping downstream)."""
    rows = [int(next(iter(r.values())).shape[0]) if r else 1 for r in requests]
    return None if rows.count(1) == len(rows) else rows


__all__ = ["BatchResult", "BatchRunner", "BusyMeter", "request_rows"]
