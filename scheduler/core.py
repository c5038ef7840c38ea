"""The scheduler's pure core: one shard's ModelThreads, the RankThread when it runs in the same
place, and the one loop that hands messages between them.

Hosted alike by the shard process (``zserve.scheduler.shard_host``), the discrete-event
simulator (``zserve.loadgen.sim.simulator``) and ``zserve bench-scheduler``
(``zserve.scheduler.bench.throughput``), so a simulated or benchmarked schedule is the schedule
of the code that runs live. The contract is ``zserve.core.hosting``'s: every method takes ``now``
and an ``outbox``; ``wake_at`` is read back after every call; ``on_timer(now, outbox)`` once the
clock reaches it. No I/O, no clock.

Inputs (host -> core):

- ``on_meta(now, meta, outbox)`` / ``on_metas``: frontends' ``RequestMetaBatch``\\ es, cut per
  model (``common.split_meta_by_model``), merged per (model, frontend) and fed to the
  ModelThreads, one chunk each; ``on_arrivals`` feeds one model's chunk. Requests of a model the
  core does not schedule are refused at once (``BAD_REQUEST``), those of a model no GPU serves
  ``UNAVAILABLE``, and every request ``SHUTTING_DOWN`` while ``draining``.
- ``on_cancel(now, model, frontend, request_ids, outbox)``: cancelled requests leave the queue.
- With a remote rank: ``on_grant(now, grant, outbox)`` (a ``GrantGpu`` that came over the wire),
  ``set_served(now, served, outbox)`` (the GPUs serving each model, from the rank's
  ``BackendTable``), ``remove_gpu`` (a suspect backend) and ``replan`` (a plan its backend never
  acknowledged). With the rank embedded, ``set_members(now, members, outbox)`` says which of
  the rank's GPUs serve which model (model -> GPU ids; by default, and after None, every GPU
  serves every model; a model listed with no GPU has its queue answered UNAVAILABLE, as a remote
  rank's ``set_served``), and ``on_device_free_at`` passes a backend's device-free report to the
  RankThread.
- ``shed_queued(now, outbox)``: answer every queued request ``SHUTTING_DOWN`` (the end of a
  drain).
- With ``allowances`` set (``scheduler.learned_allowances.ShardAllowances``, ``[scheduler]
  allowances = "learned"``): ``note_ready(now, model, delay_s, rows, outbox)``, a backend's
  ready delay; the core itself notes its timer's lateness in ``on_timer`` (and a remote rank's
  grant's in ``on_grant``), and hands moved allowances to every ModelThread.
- ``on_batch_stats(now, stats, outbox)``: a backend's ``BatchStats`` for a plan of this core's,
  sent to the shard that planned it: a batch that ran tells its ModelThread when it ended (where
  its answers' echoes are looked for, ``AnswerEchoes``); a report that shows the model's
  arrivals to be its answers' echoes replans a candidate that waits.

The dispatch loop: what a ModelThread sends the rank (``TO_RANK``) goes to the embedded
RankThread, and what the RankThread sends a model (``(DEST_MODEL, name)``) to that ModelThread,
in outbox order, until only messages for elsewhere are left. Those stay in the outbox, in their
order: ``BatchPlan`` for the backends ``(DEST_BACKEND, gpu_id)``, ``DropNotice`` for the
frontends ``(DEST_FRONTEND, address)``, and, when the rank is remote, the rank's messages.

Timers: ``wake_at`` is the earliest ``wake_at`` of the ModelThreads and the RankThread, exact
whenever it is read, however many models: the RankThread's (it moves with nearly every
candidate) is read directly. Up to ``SCAN_THREADS_MAX`` ModelThreads, their moments are scanned
when read (a few dozen attribute reads: under load nearly every thread moves between two reads,
and a heap would push each of them, which costs more than the scan). Past it, they are kept in
a heap with lazy deletion (as
``zserve.core.timer_heap.LazyTimerHeap``, written out here with the bookkeeping below: this runs
once per arrival chunk, and ``bench-scheduler`` counts every instruction of it). A thread whose
moment moved without becoming or ceasing to be the earliest costs a few dictionary stores, no
heap push. ``on_timer`` fires every due object, earliest first (ties: the ModelThreads before the
rank, and among them the one added first when scanned, the one whose moment reached the heap
first past ``SCAN_THREADS_MAX``), each followed by the dispatch loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from heapq import heapify, heappop, heappush

from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.core.groups import group_by_frontend
from zserve.core.hosting import DEST_FRONTEND, DEST_MODEL, DEST_RANK, Outbox
from zserve.scheduler.common import MetaChunk, extend_chunk, split_meta_by_model
from zserve.scheduler.learned_allowances import ShardAllowances
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.policy import DEFER_LIGHT_LOAD, DEFER_ROOM_ALL_BUSY
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import (
    BatchPlan,
    BatchStats,
    CandidateUpdate,
    DropNotice,
    GrantAnswer,
    GrantGpu,
    RequestMetaBatch,
)

CORE_COUNTERS = ("unknown_model", "unavailable", "shutting_down", "cancelled", "replanned")
"""What the core counts: refused chunks (``unknown_model``, ``unavailable``, ``shutting_down``,
one per (model, frontend) chunk; ``unavailable`` and ``shutting_down`` also count the requests of
a plan that could not be put back and of a shed queue), and requests ``cancelled`` and
``replanned``."""

# Rebuild the timer heap from its live entries once it holds more than this many entries per
# thread (plus the minimum): stale entries leave it only when they reach its top.
_HEAP_COMPACT_FACTOR = 3
_HEAP_COMPACT_MIN = 256
_INF = math.inf
_NEG_INF = -math.inf
# How often the light-load flag (DEFER_LIGHT_LOAD) is recomputed from the models' rates: the
# meters average 5 s, so a quarter second follows them closely at a loop over the models.
LIGHT_LOAD_REFRESH_S = 0.25
# Up to this many ModelThreads the core scans their moments instead of keeping a heap (see the
# module docstring). `bench-scheduler --models 20`: the heap cost 15% more CPU per request than
# the scan (the fixed-trace A/B in docs/performance.md, "Scheduler scale").
SCAN_THREADS_MAX = 64


class SchedulerCore:
    """One shard's ModelThreads and, when embedded, the RankThread; see the module docstring.

    ``name`` names the scheduler in refusals; ``models``: the names it schedules (a model's
    ModelThread may come later, ``add_thread``, once its latency profile is known); ``rank``:
    the embedded RankThread, or None when the rank runs elsewhere; ``counters``: where to count
    (``CORE_COUNTERS``; a host passes its own dict to share them), by default a dict of its own;
    ``scan_threads_max``: scan the threads' moments up to this many threads, keep a heap past it.
    """

    __slots__ = ("_compact_above", "_draining", "_entry", "_first", "_heap", "_light_due",
                 "_moved", "_open", "_order", "_pending", "_scan", "_scan_threads_max", "_seen",
                 "_seq",
                 "allowances", "counters", "known", "members", "n_timer_fires", "name", "rank",
                 "served", "threads")

    def __init__(self, name: str, models: Iterable[str] = (), *, rank: RankThread | None = None,
                 counters: MutableMapping[str, int] | None = None,
                 scan_threads_max: int = SCAN_THREADS_MAX) -> None:
        self.name = name
        self.known: set[str] = set(models)
        self.rank = rank
        self.threads: dict[str, ModelThread] = {}
        # model -> GPU ids serving it (a remote rank's BackendTable; unused with the rank here)
        self.served: dict[str, list[int]] = {}
        # model -> the embedded rank's GPU ids serving it; None: every GPU serves every model
        self.members: dict[str, list[int]] | None = None
        self._draining = False
        # the threads that take requests now: every one with the rank here, else those a GPU
        # serves; none while draining (one lookup on the hot path)
        self._open: dict[str, ModelThread] = {}
        self.counters: MutableMapping[str, int] = counters if counters is not None else {}
        for key in CORE_COUNTERS:
            self.counters.setdefault(key, 0)
        self.n_timer_fires = 0  # ModelThread and RankThread timers fired
        # The threads' moments: ``_seen[thread]``, its wake_at as last seen, and ``_first``, the
        # earliest of them (exact after every call). The heap holds (when, seq, thread), live
        # while ``_entry[thread] == when`` (seq: ties in push order); a thread whose moment moved
        # waits in ``_pending`` (an ordered set) until the heap is needed: when the earliest
        # moment moves later, or a timer fires. Most moves (a chunk arrives; the moment moves a
        # little, not past the earliest) then cost no heap push.
        self._heap: list[tuple[float, int, ModelThread]] = []
        self._entry: dict[ModelThread, float] = {}
        self._seen: dict[ModelThread, float] = {}
        self._pending: dict[ModelThread, None] = {}
        self._first = _INF
        self._seq = 0
        self._compact_above = _HEAP_COMPACT_MIN
        self._moved: list[ModelThread] = []  # called since ``_first`` was last made exact
        # Scanning (few threads): ``_order`` is every thread, in the order added; the heap's
        # bookkeeping above is unused and ``_moved`` is only emptied.
        self._scan_threads_max = scan_threads_max
        self._scan = True
        self._order: list[ModelThread] = []
        # Learned d_ctrl and jitter (None: the configured ones, fixed); a host sets it
        self.allowances: ShardAllowances | None = None
        self._light_due = _NEG_INF  # when the light-load flag is next recomputed

    @property
    def wake_at(self) -> float:
        """The earliest moment of the ModelThreads and the RankThread (``math.inf``: none)."""
        if self._scan:
            self._moved.clear()
            first = min([t.wake_at for t in self._order], default=_INF)
        else:
            if self._moved:
                self._settle()
            first = self._first
        rank = self.rank
        return rank.wake_at if rank is not None and rank.wake_at < first else first

    @property
    def draining(self) -> bool:
        """Refusing every request (``SHUTTING_DOWN``): the host is draining."""
        return self._draining

    @draining.setter
    def draining(self, draining: bool) -> None:
        self._draining = draining
        self._reopen()

    def _reopen(self) -> None:
        rank = self.rank
        served = self.served
        members = self.members
        self._open = {} if self._draining else {
            name: thread for name, thread in self.threads.items()
            if (served.get(name) if rank is None
                else members is None or members.get(name))}

    # ------------------------------------------------------------------ set-up

    def add_thread(self, now: float, thread: ModelThread, outbox: Outbox) -> None:
        """Schedule ``thread.model`` with ``thread`` (a model added late is known from now)."""
        self.known.add(thread.model)
        self.threads[thread.model] = thread
        self._order.append(thread)
        self._entry[thread] = self._seen[thread] = _INF
        self._compact_above = _HEAP_COMPACT_FACTOR * len(self._seen) + _HEAP_COMPACT_MIN
        if self._scan and len(self._order) > self._scan_threads_max:
            self._scan = False  # from now on the heap: every thread's moment goes into it
            self._moved.extend(self._order)
        if self.rank is None:
            thread.set_gpus(now, self.served.get(thread.model, []), outbox)
        self._note_sharing()
        self._reopen()
        self._after(now, outbox, thread)

    def set_profile(self, model: str, profile: LatencyProfile) -> None:
        """A new latency profile for ``model`` (its backends changed); ignored when unchanged."""
        thread = self.threads.get(model)
        if thread is not None and profile.table_s != thread.profile.table_s:
            thread.set_profile(profile)

    def set_served(self, now: float, served: Mapping[str, list[int]], outbox: Outbox) -> None:
        """The GPUs serving each model (a remote rank's table): every ModelThread learns its.
        The requests queued for a model no GPU serves any more (unloaded everywhere, or its
        last backend gone) are answered UNAVAILABLE now (they never ran), not at their
        deadlines."""
        self.served = dict(served)
        for name, thread in self.threads.items():
            gpus = self.served.get(name, [])
            thread.set_gpus(now, gpus, outbox)
            if not gpus and thread.queue_length:
                self._shed(now, thread, ErrorKind.UNAVAILABLE, f"no backend serves {name!r}",
                           counter="unavailable", outbox=outbox)
            self._moved.append(thread)
        self._note_sharing()
        self._reopen()
        self._after(now, outbox, None)

    def set_home(self, home: Mapping[str, Iterable[int]] | None) -> None:
        """The embedded rank's kind preference (``RankThread.set_home``)."""
        assert self.rank is not None, "the embedded rank only"
        self.rank.set_home(home)

    def set_members(self, now: float, members: Mapping[str, Iterable[int]] | None,
                    outbox: Outbox) -> None:
        """The embedded rank's GPUs serving each model (None: every GPU serves every model): the
        rank matches each model's candidates to its GPUs only (``RankThread.set_members``). A
        model that no GPU serves takes no requests, and those queued are answered UNAVAILABLE
        (they never ran)."""
        rank = self.rank
        assert rank is not None, "a remote rank's membership comes with its table (set_served)"
        self.members = None if members is None else {m: sorted(g) for m, g in members.items()}
        rank.set_members(now, self.members, outbox)
        self._note_sharing()
        if self.members is not None:
            for name, thread in self.threads.items():
                if not self.members.get(name) and thread.queue_length:
                    self._shed(now, thread, ErrorKind.UNAVAILABLE,
                               f"no backend serves {name!r}", counter="unavailable",
                               outbox=outbox)
                    self._moved.append(thread)
        self._reopen()
        self._after(now, outbox, None)

    def _note_sharing(self) -> None:
        """Tell every ModelThread whether another model is served on any of its GPUs, from the
        table the core has: a remote rank's ``served`` (every model's, this shard's or not), or
        the embedded rank's ``members`` (None: every GPU serves every model, all of them here)."""
        table: Mapping[str, list[int]]
        if self.rank is None:
            table = self.served
        elif self.members is None:
            alone = len(self.threads) == 1
            for thread in self.threads.values():
                thread.set_alone(alone)
            return
        else:
            table = self.members
        models_on: dict[int, int] = {}
        for gpus in table.values():
            for gpu_id in set(gpus):
                models_on[gpu_id] = models_on.get(gpu_id, 0) + 1
        for name, thread in self.threads.items():
            served = table.get(name) or []
            thread.set_alone(bool(served) and all(models_on[g] == 1 for g in served))

    def _note_light_load(self, now: float) -> None:
        """Tell every ModelThread whether the cluster is lightly loaded (DEFER_LIGHT_LOAD), and
        whether it has room (DEFER_ROOM_ALL_BUSY): its models' load run at once against its
        GPUs, every LIGHT_LOAD_REFRESH_S. Only where this core schedules every model the GPUs
        serve (the rank here, or a rank's table naming no model of another shard): otherwise
        the load is not all seen and the models keep deferring as before. Never while a model
        that has requests has no rate yet (a cold burst must batch, policy.py)."""
        self._light_due = now + LIGHT_LOAD_REFRESH_S
        threads = self.threads
        if self.rank is not None:
            gpus = len(self.rank.gpu_ids)
        elif all(name in threads for name, served in self.served.items() if served):
            gpus = len({g for served in self.served.values() for g in served})
        else:
            return
        load = 0.0
        for thread in threads.values():
            if thread.n_arrived and thread.meter.rate() is None:
                load = _INF
                break
            load += thread.sizing.at_once_load()
        light = load < DEFER_LIGHT_LOAD * gpus
        # how often a window would find every GPU busy, about: each GPU busy at u, independently
        room = gpus > 0 and (load / gpus) ** gpus < DEFER_ROOM_ALL_BUSY
        for thread in threads.values():
            thread.set_cluster_load(light, room)

    def rank_add_gpu(self, now: float, gpu_id: int, outbox: Outbox, free_at: float) -> None:
        """The embedded rank gains ``gpu_id``, free from ``free_at`` (a backend that joined)."""
        assert self.rank is not None
        self.rank.add_gpu(now, gpu_id, outbox, max(now, free_at))
        self._after(now, outbox, None)

    def rank_remove_gpu(self, now: float, gpu_id: int, outbox: Outbox) -> None:
        """The embedded rank stops granting ``gpu_id`` (its backend drains what it holds)."""
        assert self.rank is not None
        self.rank.remove_gpu(now, gpu_id, outbox)
        self._after(now, outbox, None)

    def remove_gpu(self, now: float, gpu_id: int, outbox: Outbox) -> None:
        """``gpu_id`` serves no model any more (its backend is suspect)."""
        self.set_served(now, {m: [g for g in gpus if g != gpu_id]
                              for m, gpus in self.served.items()}, outbox)

    # ------------------------------------------------------------------ requests

    def on_meta(self, now: float, meta: RequestMetaBatch, outbox: Outbox) -> None:
        """One frontend's metadata: each model's part to its ModelThread."""
        for model, (ids, arrivals, deadlines, rows) in split_meta_by_model(meta).items():
            self.on_arrivals(now, model, meta.frontend, ids, arrivals, deadlines, outbox, rows)

    def on_metas(self, now: float, metas: Iterable[RequestMetaBatch], outbox: Outbox) -> None:
        """Several frontends' metadata at once: merged per (model, frontend), one chunk each."""
        merged: dict[tuple[str, str], MetaChunk] = {}
        for meta in metas:
            for model, part in split_meta_by_model(meta).items():
                entry = merged.get((model, meta.frontend))
                if entry is None:
                    merged[(model, meta.frontend)] = part
                else:
                    extend_chunk(entry, part)
        for (model, frontend), (ids, arrivals, deadlines, rows) in merged.items():
            self.on_arrivals(now, model, frontend, ids, arrivals, deadlines, outbox, rows)

    def on_arrivals(  # noqa: PLR0917 (mirrors ModelThread.on_arrivals)
        self, now: float, model: str, frontend: str, request_ids: Sequence[int],
        arrivals: Sequence[float], deadlines: Sequence[float], outbox: Outbox,
        rows: Sequence[int] = (),
    ) -> None:
        """A chunk of ``model``'s requests from ``frontend`` (as ``ModelThread.on_arrivals``),
        or their refusal."""
        thread = self._open.get(model)
        if thread is None:
            self._refuse(model, frontend, request_ids, outbox)
            return
        thread.on_arrivals(now, frontend, request_ids, arrivals, deadlines, outbox, rows)
        if now >= self._light_due:
            self._note_light_load(now)
        allowances = self.allowances
        if allowances is not None:  # the frontend's learned reply allowance, for the budget
            allowances.note_deadlines(now, frontend, thread.slo_s, arrivals, deadlines)
        if outbox and self.rank is not None:
            self._dispatch(now, outbox)
        self._moved.append(thread)  # _after(now, outbox, thread), written out: the hot path

    def _refuse(self, model: str, frontend: str, request_ids: Sequence[int],
                outbox: Outbox) -> None:
        counters = self.counters
        if self._draining:
            counters["shutting_down"] += 1
            kind, why = ErrorKind.SHUTTING_DOWN, f"scheduler {self.name} is shutting down"
        elif model not in self.known:
            counters["unknown_model"] += 1
            kind, why = ErrorKind.BAD_REQUEST, f"model {model!r} is not scheduled by {self.name}"
        else:
            counters["unavailable"] += 1
            kind, why = ErrorKind.UNAVAILABLE, f"no backend serves {model!r}"
        outbox.append(((DEST_FRONTEND, frontend), DropNotice(list(request_ids), kind.value, why)))

    def on_cancel(self, now: float, model: str, frontend: str, request_ids: Iterable[int],
                  outbox: Outbox) -> int:
        """Take ``frontend``'s cancelled requests out of ``model``'s queue; how many were
        queued (one already planned is the frontend's to handle)."""
        thread = self.threads.get(model)
        if thread is None:
            return 0
        removed = thread.on_cancel(now, frontend, request_ids, outbox)
        self.counters["cancelled"] += removed
        self._after(now, outbox, thread)
        return removed

    def replan(self, now: float, plan: BatchPlan, why: str, outbox: Outbox) -> None:
        """Put the requests of a plan its backend never acknowledged back into their queue,
        which batches them again or drops them (DEADLINE) as any queued request; with no live
        GPU for the model they are answered UNAVAILABLE (they never ran)."""
        thread = self.threads.get(plan.model)
        served = (bool(self.served.get(plan.model)) if self.rank is None
                  else self.members is None or bool(self.members.get(plan.model)))
        whole = len(plan.finish_by) == len(plan.request_ids)
        positions_by_frontend = group_by_frontend(range(len(plan.request_ids)),
                                                  plan.request_frontend)
        for f, positions in positions_by_frontend.items():
            ids = [plan.request_ids[i] for i in positions]
            frontend = plan.frontends[f]
            if thread is None or not served or not whole:
                self.counters["unavailable"] += len(ids)
                outbox.append(((DEST_FRONTEND, frontend), DropNotice(
                    ids, ErrorKind.UNAVAILABLE.value,
                    f"{why}; no live backend serves {plan.model!r}")))
                continue
            self.counters["replanned"] += len(ids)
            rows = [plan.rows[i] for i in positions] if plan.rows else []
            thread.on_replan(now, frontend, ids, [plan.finish_by[i] for i in positions], outbox,
                             rows)
        self._after(now, outbox, thread)

    def shed_queued(self, now: float, outbox: Outbox) -> None:
        """Answer every queued request ``SHUTTING_DOWN`` (a drain's end)."""
        why = f"scheduler {self.name} is shutting down"
        for thread in self.threads.values():
            self._shed(now, thread, ErrorKind.SHUTTING_DOWN, why, counter="shutting_down",
                       outbox=outbox)
            self._moved.append(thread)
        self._after(now, outbox, None)

    def _shed(self, now: float, thread: ModelThread, kind: ErrorKind, why: str, *,
              counter: str, outbox: Outbox) -> None:
        """Answer every request queued in ``thread`` ``kind``, counted under ``counter``."""
        for frontend, ids in thread.take_queued(now, outbox).items():
            self.counters[counter] += len(ids)
            outbox.append(((DEST_FRONTEND, frontend), DropNotice(ids, kind.value, why)))

    def queued(self) -> int:
        """Requests waiting in the ModelThreads' queues."""
        return sum(t.queue_length for t in self.threads.values())

    # ------------------------------------------------------------------ the rank

    def on_grant(self, now: float, grant: GrantGpu, outbox: Outbox) -> bool:
        """A remote rank's grant; False when no ModelThread here schedules its model."""
        thread = self.threads.get(grant.model)
        if thread is None:
            return False
        if self.allowances is not None and thread.cand_bs and not grant.early:
            # how long after the later of the aim and the GPU's freeing the grant came
            self.allowances.note_late(now, now - max(thread.cand_exec, grant.free_at))
        thread.epoch = grant.epoch  # its plan carries the granting rank's epoch
        thread.on_grant(now, grant, outbox)
        self._after(now, outbox, thread)
        return True

    def on_batch_stats(self, now: float, stats: BatchStats, outbox: Outbox) -> None:
        """A backend's report of one of this core's plans: a batch that ran (``batch_size``
        above 0) tells its ModelThread when it ended."""
        thread = self.threads.get(stats.model)
        if thread is not None and stats.batch_size > 0 and stats.ok:
            thread.on_batch_finished(now, stats.gpu_id, stats.exec_at, stats.finished_at,
                                     outbox)
            self._after(now, outbox, thread)

    def on_device_free_at(self, now: float, gpu_id: int, free_at: float,
                          outbox: Outbox) -> bool:
        """The embedded rank hears when a backend's device frees (its drift correction); True
        when that moved the GPU's free time."""
        assert self.rank is not None, "a remote rank hears this from the backend itself"
        moved = self.rank.on_device_free_at(now, gpu_id, free_at, outbox)
        self._after(now, outbox, None)
        return moved

    # ------------------------------------------------------------------ timers

    def note_ready(self, now: float, model: str, delay_s: float, rows: int,
                   outbox: Outbox) -> None:
        """A backend's report: a batch of ``model`` of ``rows`` rows had its inputs
        ``delay_s`` after its plan was sent (``ShardAllowances.note_ready``)."""
        thread = self.threads.get(model)
        if self.allowances is not None and thread is not None:
            self.allowances.note_ready(now, delay_s, rows, thread.d_data_s)
            self.apply_allowances(now, outbox)

    def apply_allowances(self, now: float, outbox: Outbox) -> None:
        """The learned allowances to every ModelThread when they moved (then the dispatch)."""
        allowances = self.allowances
        if allowances is not None and allowances.apply(now, self._order, outbox):
            self._moved.extend(self._order)
            if outbox and self.rank is not None:
                self._dispatch(now, outbox)

    def on_timer(self, now: float, outbox: Outbox) -> None:
        """Fire every thread due at ``now``, earliest first, each followed by the dispatch."""
        allowances = self.allowances
        if allowances is not None:
            due = self.wake_at
            if due <= now:
                allowances.note_late(now, now - due)  # the host's timer lateness
                self.apply_allowances(now, outbox)
        if self._scan:
            self._fire_scanned(now, outbox)
            return
        entry = self._entry
        rank = self.rank
        self._settle()
        self._first = self._flush()  # every due thread in the heap
        while True:
            heap = self._heap  # (a flush may compact it)
            first = heap[0][0] if heap else _INF
            if rank is not None and rank.wake_at < first and rank.wake_at <= now:
                rank.on_timer(now, outbox)
                self.n_timer_fires += 1
                self._after(now, outbox, None)
                self._settle()
                continue
            if first > now:
                break
            when, _, thread = heappop(heap)
            if entry[thread] != when:
                continue  # stale: the thread's moment moved
            entry[thread] = _INF
            self._pending[thread] = None  # its next moment goes into the heap at the flush
            thread.on_timer(now, outbox)
            self.n_timer_fires += 1
            self._after(now, outbox, thread)
            self._settle()  # the moments the fire moved, before the next entry is judged
        self._first = self._flush()

    def _fire_scanned(self, now: float, outbox: Outbox) -> None:
        """``on_timer`` with the threads' moments scanned: the earliest due object, until none."""
        order = self._order
        rank = self.rank
        while True:
            wakes = [t.wake_at for t in order]
            first = min(wakes, default=_INF)
            if rank is not None and rank.wake_at < first and rank.wake_at <= now:
                rank.on_timer(now, outbox)
            elif first <= now:
                order[wakes.index(first)].on_timer(now, outbox)
            else:
                break
            self.n_timer_fires += 1
            if outbox and rank is not None:
                self._dispatch(now, outbox)
        self._moved.clear()

    def _after(self, now: float, outbox: Outbox, thread: ModelThread | None) -> None:
        """Every call's end: the dispatch loop; ``thread`` (the call's own) and those the
        dispatch reached are noted as moved (``wake_at`` settles them when read)."""
        if outbox and self.rank is not None:
            self._dispatch(now, outbox)
        if thread is not None:
            self._moved.append(thread)

    def _dispatch(self, now: float, outbox: Outbox) -> None:
        """THE dispatch loop between the ModelThreads and the embedded RankThread: their
        messages to each other are delivered, in order, until only messages for elsewhere are
        left in ``outbox``."""
        rank = self.rank
        assert rank is not None
        if len(outbox) == 1:  # the common case, a chunk that moved its candidate: no copy
            dest, msg = outbox[0]
            if dest[0] == DEST_RANK and type(msg) is CandidateUpdate:
                outbox.clear()
                rank.on_candidate(now, msg, outbox)
                if not outbox:
                    return
        threads = self.threads
        moved = self._moved
        kept: Outbox = []
        pos = 0
        while pos < len(outbox):
            entry = outbox[pos]
            pos += 1
            dest, msg = entry
            kind = dest[0]
            if kind == DEST_RANK:
                if type(msg) is CandidateUpdate:
                    rank.on_candidate(now, msg, outbox)
                else:
                    assert type(msg) is GrantAnswer
                    rank.on_grant_answer(now, msg, outbox)
            elif kind == DEST_MODEL:
                assert type(msg) is GrantGpu
                thread = threads[str(dest[1])]
                thread.on_grant(now, msg, outbox)
                moved.append(thread)
            else:
                kept.append(entry)
        outbox[:] = kept

    def _settle(self) -> None:
        """Note the moments of the threads called since the last settle, in call order."""
        seen = self._seen
        entry = self._entry
        pending = self._pending
        moved = self._moved
        for thread in moved:
            wake = thread.wake_at
            old = seen[thread]
            if wake == old:
                continue
            first = self._first
            if wake < first or old == first:
                self._note(thread)
                continue
            # _note's common case, written out: neither the earliest before nor now
            seen[thread] = wake
            entry[thread] = _INF
            pending[thread] = None
        moved.clear()

    def _note(self, thread: ModelThread) -> None:
        """``thread``'s moment may have moved: keep ``_first`` exact."""
        wake = thread.wake_at
        seen = self._seen
        old = seen[thread]
        if wake == old:
            return
        seen[thread] = wake
        self._entry[thread] = _INF  # its heap entry, if any, is stale
        self._pending[thread] = None
        first = self._first
        if wake < first:
            self._first = wake
        elif old == first:  # it may have been the earliest: the heap decides
            self._first = self._flush()

    def _flush(self) -> float:
        """Push the pending threads' moments; the earliest live entry's moment."""
        heap = self._heap
        entry = self._entry
        seen = self._seen
        for thread in self._pending:
            wake = seen[thread]
            if wake != _INF:
                self._seq += 1
                heappush(heap, (wake, self._seq, thread))
                entry[thread] = wake
        self._pending.clear()
        if len(heap) > self._compact_above:
            heap = [e for e in heap if entry[e[2]] == e[0]]
            heapify(heap)
            self._heap = heap
        while heap:
            when, _, top = heap[0]
            if entry[top] == when:
                return when
            heappop(heap)  # stale
        return _INF


__all__ = ["CORE_COUNTERS", "SchedulerCore"]
