"""Input staging: each request's tensors copied into its row of a batch buffer as they arrive.

Without staging, a backend assembled a batch when it started: one ``np.concatenate`` per input
on the event loop, between the previous batch's end and this one's run (on an H200 3.1 ms of a
ResNet50 batch of 29, on the critical path). With staging, the host claims a *slot* (one batch
buffer per model input, max_batch rows, preallocated, pinned where the executor runs on CUDA)
when a plan is admitted, and copies every ``InputReply`` tensor into the plan's row of that slot
the moment the reply is decoded: while the batch before runs in the executor's worker thread
(ONNX Runtime releases the GIL) or on its timer (emulated). The reply then carries row views of
the slot instead of the wire buffers, so the ``PlanFollower`` (and the simulator, which hosts it)
is unchanged. When the batch starts, ``StagingSlots.contiguous`` finds its kept rows side by
side in one slot (every input came, or those missing were at either end) and the runner hands
that slice to the executor without any copy; otherwise the runner assembles as before.

One copy per request either way: the wire buffer (a ZeroMQ frame, zero-copy) into its row.
pyzmq's ``Socket.recv_into`` could receive a frame straight into the row, but the row is known
only once the header frame is decoded; measured here on ipc (602 KB frames, 2 shared vCPUs) it
costs within noise of ``recv(copy=False)`` plus ``np.copyto`` (128-265 against 142-206 us per
frame; 150 KB: 35-43 against 38-46 us), so the codec's decode path stays.

Only models whose request row holds ``STAGING_MIN_ROW_BYTES`` (32 KiB) or more are staged: for
small rows the copy at the start costs less CPU than staging. Slots are few per model
(``SLOTS_PER_MODEL``): a backend holds a plan from its arrival (a few ms
before its exec_at) until its batch's answer went out. A plan that finds every slot taken by a
plan the follower still holds runs unstaged (``staging_full``). A slot is freed when its plan's
batch is done, or found free (``release_dropped``) once the follower no longer holds its plan
(refused, skipped, drained). A tensor that does not match the model's signature is left as it
came: the executor then refuses it as before (the batch fails ``BACKEND_FAILED``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zserve.backends.executor import Array, TensorMap
from zserve.config.signature import ModelSignature
from zserve.transport.messages import BatchPlan, InputReply

# Staging slots per model: a plan held plus the one running plus margin for plans arriving early.
SLOTS_PER_MODEL = 4
# Models whose request row holds fewer input bytes than this are not staged. Staging costs about
# 2.5 us of CPU per request more than the copy at the batch's start (a 16-byte row: 2.6 against
# 0.2 us; a 48 KB row: 4.3 against 1.6 us), about what copying 32 KiB costs: a larger row repays it
# by taking its copy off the critical path; for smaller rows the copy at the start is cheaper.
STAGING_MIN_ROW_BYTES = 32 * 1024

BufferFactory = Callable[[tuple[int, ...], np.dtype[Any]], Array]


@dataclass(slots=True)
class _Slot:
    model: str
    buffers: dict[str, Array]  # input name -> (max_batch, *sample_shape)
    plan_id: int = -1  # -1: free
    # (frontend index, request id) -> (first row, rows) of the plan claiming the slot
    rows: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    frontends: list[str] = field(default_factory=list)
    view_ids: list[int] = field(default_factory=list)  # its entries in StagingSlots._views


class StagingSlots:
    """The staging slots of one backend's models (module docstring). Runs on the event loop."""

    def __init__(self, slots_per_model: int = SLOTS_PER_MODEL,
                 min_row_bytes: int = STAGING_MIN_ROW_BYTES) -> None:
        self.slots_per_model = slots_per_model
        self.min_row_bytes = min_row_bytes
        self._slots: dict[str, list[_Slot]] = {}
        self._signatures: dict[str, ModelSignature] = {}
        self._by_plan: dict[int, _Slot] = {}
        # id(row view) -> (the view, its slot buffer, first row, rows): ``contiguous`` reads a
        # batch's rows back by it. The view is held here until its slot is freed, so an id
        # never stands for another array meanwhile.
        self._views: dict[int, tuple[Array, Array, int, int]] = {}

    def allocate(self, model: str, signature: ModelSignature, max_batch: int,
                 make_buffer: BufferFactory) -> None:
        """``model``'s slots, every page touched now (``make_buffer`` zero-fills); none when
        its row holds fewer than ``min_row_bytes`` input bytes (``STAGING_MIN_ROW_BYTES``)."""
        row_bytes = sum(np.dtype(spec.dtype).itemsize * int(np.prod([int(d or 0)
                                                                     for d in spec.shape]))
                        for spec in signature.inputs)
        if row_bytes < self.min_row_bytes:
            return
        slots = []
        for _ in range(self.slots_per_model):
            buffers = {spec.name: make_buffer((max_batch, *(int(d or 0) for d in spec.shape)),
                                              np.dtype(spec.dtype))
                       for spec in signature.inputs}
            slots.append(_Slot(model, buffers))
        self._slots[model] = slots
        self._signatures[model] = signature

    def free(self, model: str) -> None:
        """Drop ``model``'s slots (it was unloaded; no plan of it is held)."""
        for slot in self._slots.pop(model, []):
            self.release(slot.plan_id)
        self._signatures.pop(model, None)

    def stages(self, model: str) -> bool:
        """Whether ``model`` has staging slots."""
        return model in self._slots

    # -- claiming and freeing

    def claim(self, plan: BatchPlan, holds: Callable[[int], bool]) -> bool:
        """A slot for ``plan`` (admitted just now); False when every slot of its model holds a
        plan ``holds`` says the follower still holds (the plan then runs unstaged)."""
        slots = self._slots.get(plan.model)
        if slots is None or plan.plan_id in self._by_plan:
            return False
        free = next((s for s in slots if s.plan_id < 0), None)
        if free is None:
            self.release_dropped(holds)
            free = next((s for s in slots if s.plan_id < 0), None)
            if free is None:
                return False
        rows: dict[tuple[int, int], tuple[int, int]] = {}
        start = 0
        for i, request_id in enumerate(plan.request_ids):
            count = plan.rows[i] if plan.rows else 1
            rows[(plan.request_frontend[i], request_id)] = (start, count)
            start += count
        if start > min((b.shape[0] for b in free.buffers.values()), default=0):
            return False  # more rows than max_batch: the follower refuses it anyway
        free.plan_id, free.rows, free.frontends = plan.plan_id, rows, list(plan.frontends)
        self._by_plan[plan.plan_id] = free
        return True

    def release(self, plan_id: int) -> None:
        """``plan_id``'s batch is done: its slot is free."""
        slot = self._by_plan.pop(plan_id, None)
        if slot is not None:
            for view_id in slot.view_ids:
                self._views.pop(view_id, None)
            slot.plan_id, slot.rows, slot.frontends, slot.view_ids = -1, {}, [], []

    def release_dropped(self, holds: Callable[[int], bool]) -> None:
        """Free the slots of plans the follower no longer holds."""
        for plan_id in [p for p in self._by_plan if not holds(p)]:
            self.release(plan_id)

    @property
    def claimed(self) -> int:
        return len(self._by_plan)

    # -- staging and reading back

    def stage(self, address: str, reply: InputReply, fetching: Callable[[int], bool]) -> int:
        """Copy ``reply``'s tensors into their rows of the plan's slot and put the row views in
        their place in ``reply.inputs`` (a list, mutable in a frozen message). Returns the
        requests staged; a tensor that does not fit its row exactly is left as it came. Nothing
        is copied unless ``fetching(plan_id)`` (the follower holds the plan and has not started
        it): a reply that comes once its batch runs must not write into the running slot."""
        slot = self._by_plan.get(reply.plan_id)
        if slot is None or address not in slot.frontends or not fetching(reply.plan_id):
            return 0
        index = slot.frontends.index(address)
        signature = self._signatures[slot.model]
        staged = 0
        for position, (request_id, tensors) in enumerate(
                zip(reply.request_ids, reply.inputs, strict=False)):
            place = slot.rows.get((index, request_id))
            if place is None:
                continue
            views = _copy_into_rows(slot.buffers, signature, tensors, *place)
            if views is not None:
                reply.inputs[position] = views
                for name, view in views.items():
                    self._views[id(view)] = (view, slot.buffers[name], *place)
                    slot.view_ids.append(id(view))
                staged += 1
        return staged

    def contiguous(self, requests: list[TensorMap], names: Sequence[str],
                   size: int) -> TensorMap | None:
        """The batch as one slice per input when ``requests`` are staged rows side by side in
        one slot, in order (``size`` rows in all); else None (the caller copies)."""
        if not requests:
            return None
        views = self._views
        batch: TensorMap = {}
        for name in names:
            first = views.get(id(requests[0].get(name)))
            if first is None:
                return None
            _, buffer, start, _ = first
            expected = start
            for request in requests:
                entry = views.get(id(request.get(name)))
                if entry is None or entry[1] is not buffer or entry[2] != expected:
                    return None
                expected += entry[3]
            if expected - start != size:
                return None
            batch[name] = buffer[start:expected]
        return batch


def _copy_into_rows(buffers: dict[str, Array], signature: ModelSignature, tensors: Any,
                    start: int, count: int) -> TensorMap | None:
    """``tensors`` copied into rows ``start .. start+count`` of ``buffers``: the row views, or
    None (nothing copied) unless every input is there with the exact dtype and shape."""
    if not isinstance(tensors, dict) or len(tensors) != len(buffers):
        return None
    for spec in signature.inputs:
        array = tensors.get(spec.name)
        target = buffers[spec.name]
        if (not isinstance(array, np.ndarray) or array.dtype != target.dtype
                or array.shape != (count, *target.shape[1:])):
            return None
    views: TensorMap = {}
    for name, target in buffers.items():
        rows = target[start:start + count]
        np.copyto(rows, tensors[name], casting="no")
        views[name] = rows
    return views


__all__ = ["SLOTS_PER_MODEL", "StagingSlots"]
