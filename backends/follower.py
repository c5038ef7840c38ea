"""PlanFollower: one device's plans from arrival to the device freeing again (pure logic).

The backend process (``zserve.backends.host``) and the simulator (``zserve.loadgen.sim.simulator``)
host the same follower, so live and simulated runs share input waiting, the start decision, late
shedding and the device-free projection (the rank's drift correction). Hosting contract as in
``zserve.scheduler.common``: every method takes ``now`` (cluster-clock seconds) and an outbox, does
no I/O and reads no clock; ``wake_at`` (``math.inf``: no timer) is read back after every call and
``on_timer`` is called at the first moment ``now >= wake_at``.

Inputs (host -> follower): ``on_plan``, ``on_input_reply``, ``on_cancel_fetched``,
``on_fetch_lost`` (an InputFetch the host could not send), ``on_batch_finished`` (the batch ran
or failed: answer its frontends), ``on_batch_done`` (the answer went out: the device is free
again), ``on_timer``, ``drain``.

Outputs (appended to the outbox):

- ``(("frontend", address), InputFetch | BatchOutputs | BatchFailed)``: one fetch per frontend
  of a plan at once; a finished batch's answer, one message per frontend of its rows
  (``on_batch_finished``); requests answered here (UNAVAILABLE inputs, DEADLINE shed,
  SHUTTING_DOWN, refused plans, BACKEND_FAILED batches).
- ``(TO_RANK, BatchStats)``: a plan refused, skipped or finished; a skipped or finished one carries
  ``device_free_at`` (:meth:`PlanFollower.device_free_at`).
- ``(("device", gpu_id), RunBatch)``: run these rows now. The host runs them, then calls
  ``on_batch_finished`` with what they gave, delivers that answer and calls ``on_batch_done``
  (the device is free only after the answer went out). Never two at once.

Start decision: the held plan with the earliest ``exec_at`` (the head) starts at its exec_at (at
once when it is already late; lateness is recorded) once every frontend answered its fetch, or,
without the inputs that have not come, at its give-up moment (those requests are answered
UNAVAILABLE: they never ran). Late shedding (:func:`shed_late_rows`) then leaves out the rows that
cannot finish by their ``finish_by`` plus ``shed_grace_s`` (answered DEADLINE); a plan left empty
is skipped.

Input wait (``PlanFollower._give_up_at``): the head waits for missing inputs past its exec_at
only as long as waiting costs no request that starting at once would have served:

- *its own deadlines*: at most until the latest start at which late shedding would still keep
  some row of the plan (:func:`latest_start_keeping_some`; later, inputs that come could only be
  shed), and, when some rows' inputs are in, until the latest start at which those rows alone
  still all fit (:func:`latest_start_keeping_all`): waiting never sheds a request that is here;
- *the plans held behind it*: at most until the latest head start at which each of them, run in
  exec_at order for its planned duration, still starts in time to keep every one of its rows
  (a plan without ``finish_by``: ``input_wait_s`` after its exec_at), so a waiting head delays
  the queue only within the slack the later plans have anyway;
- *a floor*: never less than the fetch floor after the plan's arrival, so a fetch the frontend is
  about to answer is not cut short: ``FETCH_FLOOR_FACTOR`` x the ``FETCH_FLOOR_QUANTILE`` of the
  last ``FETCH_WINDOW`` measured fetch times (arrival -> last InputReply; a plan that gave up
  counts its wait), clamped to ``FETCH_FLOOR_MIN_S`` .. ``input_wait_s``; ``input_wait_s`` until
  ``FETCH_FLOOR_MIN_SAMPLES`` were measured (a fresh or restarted backend).

So give_up_at = max(arrival + floor, min(own bound, queue bound)). A plan without ``finish_by``
(the scheduler always sends it; hand-made and benchmark plans may not) keeps the fixed bound
``input_wait_s`` after max(exec_at, arrival). The floor is at most ``input_wait_s`` after the
arrival, so a head never holds the plans behind it longer than the old fixed rule could, except
within their own slack. The rule reads only the plans held and the samples recorded: no clock.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zserve.core.errors import ErrorKind
from zserve.core.groups import group_by_frontend
from zserve.core.hosting import DEST_FRONTEND, TO_RANK, Outbox
from zserve.core.stats import Stats
from zserve.transport.messages import (
    BatchFailed,
    BatchOutputs,
    BatchPlan,
    BatchStats,
    CancelFetched,
    InputFetch,
    InputReply,
    Message,
    TensorMap,
)

DEST_DEVICE = "device"
# A plan without finish_by waits this long after max(exec_at, its arrival) for its inputs; it also
# caps the fetch floor (a frontend that is alive answers within a millisecond or two, tens of ms
# on a loaded host).
INPUT_WAIT_S = 0.050
# The fetch floor (module docstring, "Input wait"): FETCH_FLOOR_FACTOR x this quantile of the last
# FETCH_WINDOW fetch times, at least FETCH_FLOOR_MIN_S; input_wait_s until the follower measured
# FETCH_FLOOR_MIN_SAMPLES of them.
FETCH_WINDOW = 256
FETCH_FLOOR_QUANTILE = 0.99
FETCH_FLOOR_FACTOR = 2.0
FETCH_FLOOR_MIN_S = 0.005
FETCH_FLOOR_MIN_SAMPLES = 16
# Ready-delay samples held for the next PlanAck at most (a backend that gets no plans for a
# while keeps the first ones: the shard needs a sample of the tail, not every batch).
READY_SAMPLES_MAX = 64
# The give-up moment is taken this much before the deadline-derived bounds, so that float rounding
# never makes late shedding drop, at that moment, a request the bound meant to keep.
BOUND_ROUNDING_S = 1e-9
# A plan that starts more than this after its exec_at counts as late in the stats.
LATE_TOLERANCE_S = 0.001
# Batch sizes kept for the stats (a ring of the most recent batches).
STATS_WINDOW = 4096
# Late shedding keeps a request whose batch finishes up to this fraction of the cluster's reply
# allowance after its finish_by: the reply allowance exists to absorb small lateness (the push
# and the reply hop take well under half of it), so such a request is still answered in time.
SHED_GRACE_FRACTION = 0.5

COUNTER_NAMES = (
    "plans",
    "batches_ok",
    "batches_failed",
    "requests_ok",
    "requests_failed",
    "requests_missing",
    "requests_unavailable",
    "requests_cancelled",
    "requests_shed_late",
    "cancels_too_late",
    "batches_skipped",
    "late_plans",
    "plans_refused",
)
BACKEND_HISTOGRAMS = {
    "slack": "signed",  # exec_at - plan arrival: what was left of the allowance d_ctrl + d_data
    "fetch": "delay",  # plan arrival -> the last InputReply (the input-fetch round trip)
    "lateness": "signed",  # batch start - exec_at
    "assemble": "delay",  # stacking the batch (the host's BatchRunner)
    "run": "delay",  # execution
    "push": "delay",  # execution end -> the outputs sent (the host)
}
"""Per-batch latency histograms (seconds) of a backend; the follower observes slack, fetch and
lateness, its host assemble, run and push."""


def shed_late_rows(
    rows: list[int], finish_by: Sequence[float], now: float, table_s: Sequence[float],
    grace_s: float = 0.0, *, sizes: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """Late shedding for a batch starting at ``now``: ``(kept, shed)`` rows (indexes of the
    plan's requests). While the ``k`` rows left cannot finish by the earliest ``finish_by``
    among them (``now + table_s[k] > min + grace_s``), the request with the earliest
    ``finish_by`` is shed. ``sizes[i]``: how many batch rows request i holds (empty: one
    each). ``kept`` keeps the order of ``rows``; ``shed`` is in shedding order. ``table_s[k]``
    is l(k) (``LatencyProfile``)."""
    order = sorted(rows, key=finish_by.__getitem__)
    count = len(order)
    left = sum(sizes[i] for i in order) if sizes else count
    cut = 0
    while cut < count and now + table_s[left] > finish_by[order[cut]] + grace_s:
        left -= sizes[order[cut]] if sizes else 1
        cut += 1
    if cut == 0:
        return rows, []
    shed = order[:cut]
    dropped = set(shed)
    return [row for row in rows if row not in dropped], shed


def latest_start_keeping_all(
    rows: list[int], finish_by: Sequence[float], table_s: Sequence[float],
    grace_s: float = 0.0, *, sizes: Sequence[int] = (),
) -> float:
    """The latest start at which :func:`shed_late_rows` keeps every one of ``rows`` (same
    arguments): the earliest ``finish_by`` among them plus ``grace_s`` minus l(their rows).
    ``math.inf`` for no rows."""
    if not rows:
        return math.inf
    left = sum(sizes[i] for i in rows) if sizes else len(rows)
    return min(finish_by[i] for i in rows) + grace_s - table_s[left]


def latest_start_keeping_some(
    rows: list[int], finish_by: Sequence[float], table_s: Sequence[float],
    grace_s: float = 0.0, *, sizes: Sequence[int] = (),
) -> float:
    """The latest start at which :func:`shed_late_rows` keeps at least one of ``rows``: it keeps
    the rows from the ``c``-th earliest ``finish_by`` on while they fit, so this is the latest of
    ``finish_by[c] + grace_s - l(rows from c on)``. ``-math.inf`` for no rows."""
    order = sorted(rows, key=finish_by.__getitem__)
    left = sum(sizes[i] for i in order) if sizes else len(order)
    latest = -math.inf
    for row in order:
        latest = max(latest, finish_by[row] + grace_s - table_s[left])
        left -= sizes[row] if sizes else 1
    return latest


def _indexes_within(indexes: list[int], count: int) -> bool:
    """Every index in ``0 <= i < count``."""
    return not indexes or (min(indexes) >= 0 and max(indexes) < count)


class RunBatch(Message, frozen=True):
    """Follower -> its host, never on the wire (it has no tag, so the codec refuses it): run
    ``rows`` of ``plan`` now, ``inputs[i]`` being row ``rows[i]``'s tensors."""

    plan: BatchPlan
    rows: list[int]
    inputs: list[TensorMap]
    started_at: float


@dataclass(slots=True, eq=False)
class HeldPlan:
    """A plan the follower holds, from arrival until the device is free after it."""

    plan: BatchPlan
    received_at: float
    awaiting: set[int]  # indices into plan.frontends whose InputReply has not come
    # Keyed by (frontend index in the plan, request id): request ids are unique per frontend
    # only (frontends make them cluster-unique today, but nothing here relies on it).
    inputs: dict[tuple[int, int], TensorMap] = field(default_factory=dict)
    missing: set[tuple[int, int]] = field(default_factory=set)
    # Fetched, then cancelled by their frontend before the batch started: left out of it.
    cancelled: set[tuple[int, int]] = field(default_factory=set)
    inputs_at: float = 0.0  # when the last InputReply came (0: not yet)
    # The latest starts at which late shedding keeps every row / some row (inf: no finish_by);
    # computed when an input wait first needs them (PlanFollower._latest_starts).
    latest_starts: tuple[float, float] | None = None
    started_at: float = 0.0
    batch_size: int = 0  # the batch it ran, in rows
    requests_run: int = 0  # its requests (fewer than batch_size when a request holds several)

    @property
    def planned_s(self) -> float:
        """The plan's own duration, ``expected_finish_at - exec_at``."""
        planned_s: float = self.plan.expected_finish_at - self.plan.exec_at
        return max(0.0, planned_s)


class BatchSizes:
    """The batches run since the last reset: the most recent sizes and models (for the load
    generator's per-window batch-size distribution) and a histogram per model."""

    __slots__ = ("batch_histogram", "batch_model", "batch_size")

    def __init__(self) -> None:
        self.batch_size: deque[int] = deque(maxlen=STATS_WINDOW)
        self.batch_model: deque[str] = deque(maxlen=STATS_WINDOW)
        # {model: {str(batch size): batches}}
        self.batch_histogram: dict[str, dict[str, int]] = {}

    def add_batch(self, model: str, size: int) -> None:
        self.batch_size.append(size)
        self.batch_model.append(model)
        sizes = self.batch_histogram.setdefault(model, {})
        sizes[str(size)] = sizes.get(str(size), 0) + 1

    def samples(self) -> dict[str, Any]:
        return {
            "batch_size": list(self.batch_size),
            "batch_model": list(self.batch_model),  # the model of each batch_size entry
        }

    def clear(self) -> None:
        self.batch_size.clear()
        self.batch_model.clear()
        self.batch_histogram.clear()


class PlanFollower:
    """The plans of one device: holds them, collects their inputs, starts each at its exec_at,
    sheds late rows, answers each batch's frontends and projects when the device frees (see the
    module docstring).

    Its state: ``_plans``, the plans held by plan id (from arrival until the device is free after
    them); ``_by_exec_at``, a heap of ``(exec_at, arrival number, plan id)`` over those not
    started (the arrival number breaks ties in arrival order); ``_running``, the plan whose
    batch holds the device; ``_fetch_times``, the recent fetch times the fetch floor is taken
    from. ``latency_s[model][b]`` is l(b) in seconds.
    """

    def __init__(self, name: str, *, shed_grace_s: float = 0.0,
                 input_wait_s: float = INPUT_WAIT_S) -> None:
        self.name = name
        # How far past a request's finish_by its batch may finish before late shedding drops it.
        self.shed_grace_s = shed_grace_s
        self.input_wait_s = input_wait_s
        self.wake_at = math.inf
        self.latency_s: dict[str, Sequence[float]] = {}  # per model: l(b) at [b], as table_s
        self.max_batch: dict[str, int] = {}
        self.stats = Stats(COUNTER_NAMES, BACKEND_HISTOGRAMS)
        self.counters = self.stats.counters
        self.histograms = self.stats.histograms
        self.batches = BatchSizes()
        self.draining = False
        self._plans: dict[int, HeldPlan] = {}
        self._by_exec_at: list[tuple[float, int, int]] = []  # (exec_at, arrival number, plan id)
        self._arrivals = 0
        self._running: HeldPlan | None = None
        self._fetch_times: deque[float] = deque(maxlen=FETCH_WINDOW)  # seconds, most recent
        self._fetch_floor_s: float | None = None  # computed from _fetch_times when needed
        # (model, ready delay s, rows) of batches started since the host last took them: it
        # sends them on its next PlanAck (the shard's learned d_ctrl)
        self.ready_samples: list[tuple[str, float, int]] = []

    def add_model(self, model: str, latency_s: Sequence[float], max_batch: int) -> None:
        """Serve ``model``: ``latency_s[b]`` is l(b) in seconds for ``1 <= b <= max_batch``
        (``LatencyProfile.table_s``; late shedding reads it) and ``max_batch`` its largest
        batch."""
        self.latency_s[model] = latency_s
        self.max_batch[model] = max_batch

    def remove_model(self, model: str) -> None:
        """Serve ``model`` no more: a plan of it that comes later is refused ``UNAVAILABLE``
        (it never ran). The host removes a model only once ``plans_of(model)`` is 0."""
        self.latency_s.pop(model, None)
        self.max_batch.pop(model, None)

    def holds(self, plan_id: int) -> bool:
        """Whether plan ``plan_id`` is held (waiting, or its batch running until done)."""
        return plan_id in self._plans

    def fetching(self, plan_id: int) -> bool:
        """Whether plan ``plan_id`` is held and has not started (its inputs are still taken)."""
        held = self._plans.get(plan_id)
        return held is not None and not held.started_at

    def plans_of(self, model: str) -> int:
        """The plans of ``model`` held or running."""
        return sum(1 for held in self._plans.values() if held.plan.model == model)

    # ------------------------------------------------------------------ read back

    @property
    def running(self) -> HeldPlan | None:
        """The plan whose batch holds the device (from RunBatch until ``on_batch_done``)."""
        return self._running

    @property
    def held_plans(self) -> int:
        return len(self._plans)

    @property
    def idle(self) -> bool:
        """No plan held and no batch running."""
        return not self._plans

    def device_free_at(self, free_at: float) -> float:
        """When the device will be free, given that it is free at ``free_at`` (no batch running):
        each plan still held runs at max(previous finish, its exec_at) for its planned duration
        (``expected_finish_at - exec_at``), in exec_at order. A plan that starts on time ends at
        its own ``expected_finish_at`` exactly (no float drift), so an on-time device projects
        exactly what the rank planned."""
        for exec_at, _, plan_id in sorted(self._by_exec_at):
            plan = self._plans[plan_id].plan
            if free_at <= exec_at:
                free_at = max(exec_at, plan.expected_finish_at)
            else:
                free_at += max(0.0, plan.expected_finish_at - exec_at)
        return free_at

    # ------------------------------------------------------------------ inputs

    def on_plan(self, now: float, plan: BatchPlan, outbox: Outbox) -> None:
        """Hold ``plan`` and fetch its inputs from each of its frontends at once."""
        self.counters["plans"] += 1
        if not plan.request_ids:
            pass
        elif self.draining or not self._well_formed(plan):
            self._refuse(now, plan, outbox)
        else:
            self._hold(now, plan, outbox)
        self._advance(now, outbox)

    def _hold(self, now: float, plan: BatchPlan, outbox: Outbox) -> None:
        self.histograms["slack"].observe(plan.exec_at - now)
        held = HeldPlan(plan, now, set(range(len(plan.frontends))))
        self._plans[plan.plan_id] = held
        self._arrivals += 1
        heapq.heappush(self._by_exec_at, (plan.exec_at, self._arrivals, plan.plan_id))
        ids_by_frontend = group_by_frontend(plan.request_ids, plan.request_frontend)
        for index, address in enumerate(plan.frontends):  # every frontend of the plan answers
            ids = ids_by_frontend.get(index, [])
            outbox.append(((DEST_FRONTEND, address), InputFetch(plan.plan_id, ids)))

    def _well_formed(self, plan: BatchPlan) -> bool:
        count = len(plan.request_ids)
        if plan.rows:  # requests of several rows: the batch holds their sum
            if len(plan.rows) != count or min(plan.rows) < 1:
                return False
            count = sum(plan.rows)
        return (plan.plan_id not in self._plans and plan.model in self.latency_s
                and len(plan.request_frontend) == len(plan.request_ids)
                and _indexes_within(plan.request_frontend, len(plan.frontends))
                and count <= self.max_batch[plan.model]
                and (not plan.finish_by or len(plan.finish_by) == len(plan.request_ids)))

    def _refuse(self, now: float, plan: BatchPlan, outbox: Outbox) -> None:
        self.counters["plans_refused"] += 1
        if self.draining:
            kind, why = ErrorKind.SHUTTING_DOWN, f"backend {self.name} is shutting down"
        elif plan.plan_id in self._plans:
            kind, why = ErrorKind.INTERNAL, f"duplicate plan id {plan.plan_id}"
        elif plan.model not in self.latency_s:  # never served here, or unloaded: it never ran
            kind, why = ErrorKind.UNAVAILABLE, f"backend {self.name} does not serve {plan.model!r}"
        else:
            kind, why = ErrorKind.INTERNAL, f"malformed plan {plan.plan_id}"
        count = len(plan.request_ids)
        if kind is not ErrorKind.INTERNAL or (
            len(plan.request_frontend) == count
            and _indexes_within(plan.request_frontend, len(plan.frontends))
        ):
            self._fail_rows(plan, list(range(count)), kind, why, outbox)
        outbox.append((TO_RANK, self._stats(plan, 0, now, now, ok=False)))

    def on_fetch_lost(self, now: float, plan_id: int, address: str, outbox: Outbox) -> None:
        """The host could not send the InputFetch to ``address``: nothing will come from it."""
        held = self._plans.get(plan_id)
        if held is not None and not held.started_at and address in held.plan.frontends:
            self._frontend_answered(now, held, held.plan.frontends.index(address))
        self._advance(now, outbox)

    def on_input_reply(self, now: float, address: str, reply: InputReply, outbox: Outbox) -> None:
        """A frontend's inputs for one plan (ignored once the plan started without them)."""
        held = self._plans.get(reply.plan_id)
        if held is not None and not held.started_at and address in held.plan.frontends:
            index = held.plan.frontends.index(address)
            for request_id, tensors in zip(reply.request_ids, reply.inputs, strict=False):
                held.inputs[(index, request_id)] = tensors
            held.missing.update((index, request_id) for request_id in reply.missing)
            self._frontend_answered(now, held, index)
        self._advance(now, outbox)

    def _frontend_answered(self, now: float, held: HeldPlan, index: int) -> None:
        held.awaiting.discard(index)
        if not held.awaiting:
            held.inputs_at = now

    def on_cancel_fetched(self, now: float, address: str, msg: CancelFetched,
                          outbox: Outbox) -> None:
        """Leave cancelled requests out of their plans if those have not started (a started
        batch runs; its frontend discards the outputs)."""
        for plan_id, request_id in zip(msg.plan_ids, msg.request_ids, strict=False):
            held = self._plans.get(plan_id)
            if held is None or held.started_at:
                self.counters["cancels_too_late"] += 1
                continue
            if address not in held.plan.frontends:
                continue
            key = (held.plan.frontends.index(address), request_id)
            if held.inputs.pop(key, None) is not None:
                held.cancelled.add(key)
                self.counters["requests_cancelled"] += 1
        self._advance(now, outbox)

    # ------------------------------------------------------------------ the device

    def on_timer(self, now: float, outbox: Outbox) -> None:
        self._advance(now, outbox)

    def on_batch_finished(self, now: float, run: RunBatch, outputs: Sequence[TensorMap],
                          error: str, *, finished_at: float, outbox: Outbox) -> None:
        """The backend's answer to the running batch ``run``, which stopped executing at
        ``finished_at``: one BatchOutputs per frontend of its rows (``outputs[i]`` is row
        ``run.rows[i]``'s), or, when ``error`` says why it failed, one BatchFailed
        (BACKEND_FAILED) per frontend. The device stays held until ``on_batch_done``."""
        plan = run.plan
        assert self._running is not None and self._running.plan is plan, (
            "on_batch_finished for a batch that is not running")
        rows = run.rows
        positions_by_frontend = group_by_frontend(
            range(len(rows)), [plan.request_frontend[row] for row in rows])
        why = f"backend {self.name}: {error}"
        for index, positions in positions_by_frontend.items():
            request_ids = [plan.request_ids[rows[position]] for position in positions]
            if error:
                answer: BatchFailed | BatchOutputs = BatchFailed(
                    plan.plan_id, request_ids, ErrorKind.BACKEND_FAILED.value, why)
            else:
                answer = BatchOutputs(plan.plan_id, request_ids,
                                      [outputs[position] for position in positions],
                                      run.started_at, finished_at)
            outbox.append(((DEST_FRONTEND, plan.frontends[index]), answer))

    def on_batch_done(self, now: float, *, ok: bool, finished_at: float, outbox: Outbox) -> None:
        """The running batch finished executing at ``finished_at`` (``ok``: it ran; else it
        failed), its answer (``on_batch_finished``) went out, and the device is free again at
        ``now`` (after the push: the next plan can start only now, so the projection starts
        here)."""
        held = self._running
        assert held is not None, "on_batch_done without a running batch"
        plan = held.plan
        prefix = "batches_ok" if ok else "batches_failed"
        self.counters[prefix] += 1
        self.counters["requests_ok" if ok else "requests_failed"] += held.requests_run
        self.batches.add_batch(plan.model, held.batch_size)
        self._running = None
        del self._plans[plan.plan_id]
        outbox.append((TO_RANK, self._stats(plan, held.batch_size, held.started_at, finished_at,
                                            ok=ok, cancelled=len(held.cancelled),
                                            device_free_at=self.device_free_at(now))))
        self._advance(now, outbox)

    def _advance(self, now: float, outbox: Outbox) -> None:
        """Start the head plan if its time has come, its inputs are in (or waited for long
        enough) and the device is free; then set ``wake_at``."""
        self.wake_at = math.inf
        if self._running is not None:
            return  # on_batch_done advances
        while self._by_exec_at:
            exec_at, _, plan_id = self._by_exec_at[0]
            held = self._plans[plan_id]
            if now < exec_at:
                self.wake_at = exec_at
                return
            if held.awaiting:
                give_up_at = self._give_up_at(held)
                if now < give_up_at:
                    self.wake_at = give_up_at  # or the InputReply comes first
                    return
            heapq.heappop(self._by_exec_at)
            if self._start(now, held, outbox):
                return

    def _give_up_at(self, held: HeldPlan) -> float:
        """When the head ``held`` stops waiting for the inputs not yet in (module docstring,
        "Input wait"): max(arrival + fetch floor, min(own bound, queue bound))."""
        plan = held.plan
        if not plan.finish_by:  # no deadlines to derive a bound from: the fixed one
            return max(plan.exec_at, held.received_at) + self.input_wait_s
        own = self._latest_starts(held)[1]
        if held.inputs:  # never wait so long that a request whose inputs are here is shed
            keys = list(zip(plan.request_frontend, plan.request_ids, strict=True))
            here = [i for i, key in enumerate(keys) if key in held.inputs]
            own = min(own, latest_start_keeping_all(here, plan.finish_by,
                                                    self.latency_s[plan.model],
                                                    self.grace_s(plan), sizes=plan.rows))
        bound = min(own, self._queue_bound(held)) - BOUND_ROUNDING_S
        return max(held.received_at + self._fetch_floor(), bound)

    def grace_s(self, plan: BatchPlan) -> float:
        """How far past its ``finish_by`` a row of ``plan`` may finish and still run: the
        configured grace, or ``SHED_GRACE_FRACTION`` of the reply allowance the plan was made
        with when that is smaller (a learned one: the grace stays inside what it leaves)."""
        if plan.reply_allowance > 0.0:
            return min(self.shed_grace_s, SHED_GRACE_FRACTION * plan.reply_allowance)
        return self.shed_grace_s

    def _queue_bound(self, head: HeldPlan) -> float:
        """The latest start of ``head`` at which every plan held behind it, run in exec_at order
        for its planned duration, still starts by the latest start that keeps all its rows."""
        limit = math.inf  # the latest start of the plan after the one being looked at
        for _, _, plan_id in sorted(self._by_exec_at, reverse=True):
            held = self._plans[plan_id]
            if held is head:
                break
            start_by = (self._latest_starts(held)[0] if held.plan.finish_by
                        else held.plan.exec_at + self.input_wait_s)
            limit = min(start_by, limit - held.planned_s)
        return limit - head.planned_s

    def _latest_starts(self, held: HeldPlan) -> tuple[float, float]:
        """``held``'s latest starts keeping every row and some row (only the rare input-wait
        path needs them, so they are computed then, once)."""
        if held.latest_starts is None:
            plan = held.plan
            every = list(range(len(plan.request_ids)))
            args = (every, plan.finish_by, self.latency_s[plan.model], self.grace_s(plan))
            held.latest_starts = (latest_start_keeping_all(*args, sizes=plan.rows),
                                  latest_start_keeping_some(*args, sizes=plan.rows))
        return held.latest_starts

    def _fetch_floor(self) -> float:
        """How long after its arrival a plan waits for its inputs at least (module docstring)."""
        if self._fetch_floor_s is None:
            samples = sorted(self._fetch_times)
            if len(samples) < FETCH_FLOOR_MIN_SAMPLES:
                self._fetch_floor_s = self.input_wait_s
            else:
                high = samples[min(len(samples) - 1, int(FETCH_FLOOR_QUANTILE * len(samples)))]
                self._fetch_floor_s = min(self.input_wait_s,
                                          max(FETCH_FLOOR_MIN_S, FETCH_FLOOR_FACTOR * high))
        return self._fetch_floor_s

    def _start(self, now: float, held: HeldPlan, outbox: Outbox) -> bool:
        """Start ``held``; False when nothing was left to run (the caller moves on)."""
        plan = held.plan
        held.started_at = now
        # the fetch time, or how long it waited in vain: a lower bound of that fetch's time
        self._fetch_times.append((held.inputs_at or now) - held.received_at)
        self._fetch_floor_s = None
        rows = self._rows_with_inputs(held, outbox)
        lateness = now - plan.exec_at
        shed: list[int] = []
        if rows and plan.finish_by:
            rows, shed = shed_late_rows(rows, plan.finish_by, now,
                                        self.latency_s[plan.model], self.grace_s(plan),
                                        sizes=plan.rows)
            if shed:
                self.counters["requests_shed_late"] += len(shed)
                self._fail_rows(
                    plan, shed, ErrorKind.DEADLINE,
                    f"batch started {lateness * 1e3:.2f} ms late on backend {self.name}; "
                    "could not finish by its deadline", outbox)
        if not rows:  # every request cancelled, missing or shed: the batch is skipped
            del self._plans[plan.plan_id]
            if held.cancelled or shed:
                self.counters["batches_skipped"] += 1
            outbox.append((TO_RANK, self._stats(plan, 0, now, now, ok=True,
                                                cancelled=len(held.cancelled),
                                                device_free_at=self.device_free_at(now))))
            return False
        self.histograms["lateness"].observe(lateness)
        if lateness > LATE_TOLERANCE_S:
            self.counters["late_plans"] += 1
        self.histograms["fetch"].observe((held.inputs_at or now) - held.received_at)
        held.batch_size = sum(plan.rows[i] for i in rows) if plan.rows else len(rows)
        if plan.sent_at and len(self.ready_samples) < READY_SAMPLES_MAX:
            self.ready_samples.append(
                (plan.model, (held.inputs_at or now) - plan.sent_at, held.batch_size))
        held.requests_run = len(rows)
        self._running = held
        keys = [(plan.request_frontend[i], plan.request_ids[i]) for i in rows]
        outbox.append(((DEST_DEVICE, plan.gpu_id),
                       RunBatch(plan, rows, [held.inputs[key] for key in keys], now)))
        return True

    def _rows_with_inputs(self, held: HeldPlan, outbox: Outbox) -> list[int]:
        """The rows whose inputs came; the rows still awaited are answered UNAVAILABLE."""
        plan = held.plan
        inputs = held.inputs
        keys = list(zip(plan.request_frontend, plan.request_ids, strict=True))
        if held.awaiting:
            late = [i for i, key in enumerate(keys)
                    if key[0] in held.awaiting and key not in inputs
                    and key not in held.cancelled]
            if late:
                self.counters["requests_unavailable"] += len(late)
                waited_ms = (held.started_at - held.received_at) * 1e3
                bound = ("as long as the deadlines of this batch and the next allowed"
                         if plan.finish_by else "the fixed wait of a plan without deadlines")
                self._fail_rows(plan, late, ErrorKind.UNAVAILABLE,
                                f"inputs did not reach backend {self.name} in time (waited "
                                f"{waited_ms:.1f} ms after the plan arrived: {bound})", outbox)
        if held.missing:
            self.counters["requests_missing"] += sum(
                1 for key in keys if key in held.missing and key not in inputs)
        return [i for i, key in enumerate(keys) if key in inputs]

    # ------------------------------------------------------------------ drain

    def drain(self, now: float, deadline: float, outbox: Outbox) -> None:
        """Refuse plans from now on and answer SHUTTING_DOWN for every held plan that has not
        started and whose exec_at is after ``deadline`` (``-inf``: all of them)."""
        self.draining = True
        keep: list[tuple[float, int, int]] = []
        for entry in self._by_exec_at:
            if entry[0] > deadline:
                plan = self._plans.pop(entry[2]).plan
                self._fail_rows(plan, list(range(len(plan.request_ids))),
                                ErrorKind.SHUTTING_DOWN,
                                f"backend {self.name} is shutting down", outbox)
                outbox.append((TO_RANK, self._stats(plan, 0, now, now, ok=False)))
            else:
                keep.append(entry)
        heapq.heapify(keep)
        self._by_exec_at = keep
        self._advance(now, outbox)

    # ------------------------------------------------------------------ messages out

    def _fail_rows(self, plan: BatchPlan, rows: list[int], kind: ErrorKind, why: str,
                   outbox: Outbox) -> None:
        by_frontend: dict[int, list[int]] = {}
        for row in rows:
            by_frontend.setdefault(plan.request_frontend[row], []).append(plan.request_ids[row])
        for index, ids in by_frontend.items():
            outbox.append(((DEST_FRONTEND, plan.frontends[index]),
                           BatchFailed(plan.plan_id, ids, kind.value, why)))

    @staticmethod
    def _stats(plan: BatchPlan, size: int, started_at: float, finished_at: float, *, ok: bool,
               cancelled: int = 0, device_free_at: float = 0.0) -> BatchStats:
        return BatchStats(plan.plan_id, plan.model, plan.gpu_id, size, plan.exec_at, started_at,
                          finished_at, ok, cancelled, device_free_at)


__all__ = [
    "DEST_DEVICE",
    "FETCH_FLOOR_FACTOR",
    "FETCH_FLOOR_MIN_S",
    "FETCH_FLOOR_MIN_SAMPLES",
    "FETCH_FLOOR_QUANTILE",
    "FETCH_WINDOW",
    "INPUT_WAIT_S",
    "SHED_GRACE_FRACTION",
    "BatchSizes",
    "HeldPlan",
    "PlanFollower",
    "RunBatch",
    "latest_start_keeping_all",
    "latest_start_keeping_some",
    "shed_late_rows",
]
