"""ModelThread: one model's deadline-ordered queue and its one batch candidate (pure logic).

See ``zserve.core.hosting`` for the hosting contract (``now``, outbox, ``wake_at``).

Inputs (host -> ModelThread):

- ``on_arrivals(now, frontend, request_ids, arrivals, deadlines, outbox, rows=...)``: a chunk of
  this model's requests from one frontend, parallel lists as in ``RequestMetaBatch`` (use
  ``common.split_meta_by_model`` to cut a RequestMetaBatch into per-model chunks). One candidate
  update per chunk, not per request.
- ``on_grant(now, grant: GrantGpu, outbox)``: the RankThread granted a GPU.
- ``on_timer(now, outbox)``: ``now >= wake_at``.
- ``set_gpus(now, gpu_ids, outbox)``: the GPUs that exist (grants for other GPUs are returned).
- ``set_alone(alone)``: whether no other model is served on this model's GPUs.
- ``set_gpu_profiles(profiles)``: GPUs of another device kind, with this model's profile there
  (a batch granted one is sized and timed with it; ``on_grant``).
- ``on_batch_finished(now, gpu_id, exec_at, finished_at, outbox)``: a backend reported the end of
  a batch of this model (``BatchStats``): where its answers' echoes are looked for
  (``AnswerEchoes``).
- ``on_cancel(now, frontend, request_ids, outbox)``: a frontend's cancelled requests leave the
  queue and the candidate (``CancelQueued``, coalesced per tick by the host).
- ``on_replan(now, frontend, request_ids, deadlines, outbox)``: requests of a plan whose backend
  never acknowledged it come back to the queue (the host knows they did not start).

Outputs (appended to the outbox):

- ``(TO_RANK, CandidateUpdate)``: the current candidate (``batch_size`` 0 withdraws it); sent only
  when it changed, and always right after a GrantAnswer.
- ``(TO_RANK, GrantAnswer)`` and ``(("backend", gpu_id), BatchPlan)`` on a grant.
- ``(("frontend", name), DropNotice)``: dropped requests, one notice per frontend per event.

The candidate (Symphony Appendix D, ``update_candidate``): with ``d`` the earliest deadline in the
batch, ``delay(bs) = d_ctrl + d_data*bs`` and ``gpu_free_at`` the granted GPU's free time (``-inf``
when not granting), ``earliest = max(now + delay(bs), gpu_free_at)``, ``latest = d - l(bs)`` and
``exec`` from the schedule policy (``deferred``: ``max(earliest, d - l(bs + 1))``), clamped into
``[earliest, latest]``. The ModelThread wakes at ``latest - delay(bs)`` (plus TIMER_SLACK_S), the
last moment the candidate can still be granted, and re-evaluates (drops heads, shrinks the batch).

Rows: a request holds n >= 1 rows (its inputs' leading dimension). Batch sizes count rows: the
candidate's ``batch_size``, l(b), delay(b), the target and ``keep_min``, the rate meter
(rows/s) and ``max_batch``. A batch is ``[head:head + count]`` of the queue and never splits a
request (``CandidateSizing.size_rows``). While every queued request holds one row the queue
keeps no rows list at all (``_rows`` is None) and every path below is the one-row path.

The policy arithmetic (the batch size by the drop policy, the exec time by the schedule policy,
the rate meter and the target batch size, what the deferred policies learn from their grants)
is a part of its own, ``CandidateSizing`` (``zserve.scheduler.candidate_sizing``), held as
``sizing``: the ModelThread hands it the queue's lists and stores the candidate it returns.

The queue is a struct of arrays: parallel lists of deadlines, request ids, frontend indexes and
arrival times (and rows, once a request of several arrived), sorted by deadline, with a moving
head index. A chunk that arrives in deadline order
after the queue's tail (the common case: one frontend, one SLO) is appended with four
``list.extend`` calls and no per-request object at all; an out-of-order chunk is merged by a sort
of the live tail. All drops happen at the head (bulk drops find their end by bisection), so a
batch is always ``[head:head + bs]`` of each list. Drops and grants both pop the head and both
compact the popped prefix (``_advance_head``): the lists stay bounded by the live queue plus
``2 * COMPACT_AT``, not by the requests ever seen.

Hot path (the live shard feeds tens of thousands of chunks a second): the in-order test is
``sorted(chunk) == chunk`` (C-speed sort of a sorted run plus an identity-first list compare,
about 5x cheaper than a pairwise ``map(le, ...)``), request ids should arrive as a list (extending
from a ``range`` makes an int object per request), and ``_update``/``_publish`` read the profile's
table and the policy's kind from the sizing part's cached attributes. The arithmetic is the same
expression for expression, so the decisions are bit-identical to the plain formulation.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat

from zserve.config.policy_names import DEFAULT_KEEP_TOLERANCE, SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.core.groups import group_by_frontend
from zserve.core.hosting import DEST_BACKEND, DEST_FRONTEND, TO_RANK, Outbox
from zserve.scheduler.candidate_sizing import (
    DEFAULT_RATE_BUCKET_S,
    DEFAULT_RATE_WINDOW,
    CandidateSizing,
)
from zserve.scheduler.policy import RpsMeter
from zserve.transport.messages import (
    BatchPlan,
    CandidateUpdate,
    DropNotice,
    GrantAnswer,
    GrantGpu,
)

_NEG_INF = -math.inf
DEFAULT_PUBLISH_LEAD_S = 0.002
# A grant that comes more than this after the moment its candidate asked for a GPU (its exec
# time less its delay) found every GPU busy: the candidate waited (``CandidateSizing.on_grant``).
# Above a grant's round trip through a remote rank on a quiet host, below a batch's run time.
GRANT_WAITED_S = 0.0002
COMPACT_AT = 4096
"""Compact the queue's lists once this many popped entries precede the head (and they are at
least half of them)."""


class ModelThread:
    """One model's queue and candidate. Construct one per model; see the module docstring.

    The queue, parallel lists sorted by deadline and live from ``_head`` on: ``_deadlines``,
    ``_ids`` (request ids), ``_frontend_indexes`` (into ``_frontends``), ``_arrivals`` and
    ``_rows`` (None while every request holds one row). The candidate as last computed:
    ``cand_bs`` (its batch size in rows; ``bs`` in the code), ``cand_count`` (its requests,
    ``[head:head + cand_count]``, equal to ``cand_bs`` without ``_rows``), ``cand_exec`` (its
    exec time), ``cand_latest`` (its latest start, ``d - l(bs)``), ``_cand_deferred`` (a
    deferring candidate whose window may be lost) and ``_cand_early_ok`` (the rank may start it
    early); ``_sent`` is the candidate the rank holds.

    ``slo_s`` is the model's SLO; ``budget_s`` (default ``slo_s - d_ctrl_s``) is the time from
    arrival to deadline that the target batch size plans with (deadlines arrive precomputed by
    the frontend: arrival + SLO - reply allowance). ``d_ctrl_s``/``d_data_s`` give
    ``delay(bs) = d_ctrl + d_data*bs``. ``jitter_s`` is the host's timer lateness allowance (the
    authors use 100 us): the frontrun and latest policies aim that much before their moment, so
    a timer that fires up to ``jitter_s`` late still finds the candidate grantable (without it
    the window [d - l(bs+1), d - l(bs)] is only alpha wide); it is also slack for a GPU that
    frees a little late when many models share few GPUs. The rate meter seals
    ``rate_bucket_s`` buckets and averages the last ``rate_window``. ``keep_tolerance`` (window
    drop only): keep the head while a batch whose per-request cost l(b)/b is within this
    fraction of the target's still fits; 0 is the authors' rule (drop below the target).
    ``publish_lead_s``: see ``_publish`` (None publishes every change at once, as the authors'
    ModelThread does; set it above the shard-to-rank message latency).

    Plan ids: ``plan_ids`` yields them (``next(plan_ids)`` per plan). The id space belongs to
    the host, not to the ModelThread: backends match InputReplies by plan id and receive plans
    from every model of every shard, so ids must be unique across the cluster, and only the host
    knows its place in it (the shard draws ``seq * MAX_SHARDS + shard index`` from one counter
    shared by its ModelThreads). Without a source the ids are ``crc32(model) << 32`` + 1, 2, ...:
    distinct across models without coordination, enough for one process (the simulator, tests).
    """

    def __init__(
        self,
        model: str,
        profile: LatencyProfile,
        slo_s: float,
        policy: SchedulePolicy | str = "deferred",
        *,
        d_ctrl_s: float = 0.0,
        d_data_s: float = 0.0,
        jitter_s: float = 0.0,
        budget_s: float | None = None,
        rate_bucket_s: float = DEFAULT_RATE_BUCKET_S,
        rate_window: int = DEFAULT_RATE_WINDOW,
        keep_tolerance: float = DEFAULT_KEEP_TOLERANCE,
        plan_ids: Iterator[int] | None = None,
        publish_lead_s: float | None = DEFAULT_PUBLISH_LEAD_S,
    ) -> None:
        self.model = model
        self.sizing = CandidateSizing(
            profile, SchedulePolicy.parse(policy) if isinstance(policy, str) else policy,
            slo_s=slo_s, d_ctrl_s=d_ctrl_s, d_data_s=d_data_s, jitter_s=jitter_s,
            budget_s=budget_s, rate_bucket_s=rate_bucket_s, rate_window=rate_window,
            keep_tolerance=keep_tolerance)
        self.publish_lead_s = publish_lead_s
        self.wake_at = math.inf
        self.gpu_ids: set[int] | None = None  # None: accept grants for any GPU
        # GPUs of another device kind -> the sizing with this model's profile there (None: one
        # kind, every GPU runs the thread's own profile; set_gpu_profiles)
        self._kind_sizing: dict[int, CandidateSizing] | None = None
        self._clear_queue()
        self._frontends: list[str] = []
        self._frontend_index: dict[str, int] = {}
        if plan_ids is None:
            plan_ids = itertools.count((zlib.crc32(model.encode()) << 32) + 1)
        self._plan_ids = plan_ids
        # the candidate as last computed, and as last sent to the rank (None: rank has none)
        self.cand_bs = 0
        self.cand_count = 0
        self.cand_exec = 0.0
        self.cand_latest = 0.0
        self._cand_deferred = False
        self._cand_early_ok = False
        self._sent: tuple[int, float, float, bool] | None = None
        # counters (for stats and tests)
        self.n_window_misses = 0
        self.n_arrived = 0
        self.n_extra_rows = 0  # rows arrived beyond one per request
        self.n_dropped = 0
        self.n_cancelled = 0
        self.n_replanned = self.n_planned = self.n_batches = 0  # replanned: by on_replan
        self.budget_sum_s = 0.0  # arrival -> deadline, summed over the requests arrived
        # The scheduler epoch its plans carry (zserve.core.epochs); the host sets it.
        self.epoch = 0

    def _clear_queue(self) -> None:
        """An empty queue: parallel lists sorted by deadline, live from ``_head`` on."""
        self._deadlines: list[float] = []
        self._ids: list[int] = []
        self._frontend_indexes: list[int] = []
        self._arrivals: list[float] = []
        self._rows: list[int] | None = None  # None: every queued request holds one row
        self._head = 0

    # ------------------------------------------------------------------ what hosts read
    # (the sizing part's own; a host's stats and the simulator read them here)

    @property
    def profile(self) -> LatencyProfile:
        return self.sizing.profile

    def set_profile(self, profile: LatencyProfile) -> None:
        """A new latency profile (the host merged a new backend set's), and the target batch
        size that follows from it at the current rate."""
        self.sizing.set_profile(profile)

    @property
    def policy(self) -> SchedulePolicy:
        return self.sizing.policy

    @property
    def meter(self) -> RpsMeter:
        return self.sizing.meter

    @property
    def slo_s(self) -> float:
        return self.sizing.slo_s

    @property
    def d_data_s(self) -> float:
        return self.sizing.d_data_s

    @property
    def target(self) -> int:
        return self.sizing.target

    @property
    def miss_margin_s(self) -> float:
        return self.sizing.miss_margin_s

    @property
    def defer_loss(self) -> float:
        return self.sizing.defer_loss

    # ------------------------------------------------------------------ inputs

    @property
    def queue_length(self) -> int:
        return len(self._deadlines) - self._head

    @property
    def queued_rows(self) -> int:
        """The rows of the queued requests (``queue_length`` when each holds one)."""
        if self._rows is None:
            return len(self._deadlines) - self._head
        return sum(self._rows[self._head:])

    def take_queued(self, now: float, outbox: Outbox) -> dict[str, list[int]]:
        """Remove every queued request; return their ids by frontend (for a host that stops
        scheduling them, e.g. a draining shard answering them itself). The candidate goes with
        them: its withdrawal is in the outbox if the rank held it."""
        head = self._head
        groups = group_by_frontend(self._ids[head:], self._frontend_indexes[head:])
        self._clear_queue()
        self._update(now, _NEG_INF, outbox)
        self._publish(now, outbox)
        return {self._frontends[fidx]: ids for fidx, ids in groups.items()}

    def on_cancel(self, now: float, frontend: str, request_ids: Iterable[int],
                  outbox: Outbox) -> int:
        """Remove ``frontend``'s requests ``request_ids`` from the queue (cancelled, or their
        client left); ids not queued (planned already, dropped, unknown) are ignored. The
        candidate is recomputed without them. Returns how many were removed. One pass over the
        live queue per call: hosts coalesce a tick's cancellations into one call per model."""
        fidx = self._frontend_index.get(frontend)
        if fidx is None:
            return 0
        gone = set(request_ids)
        head = self._head
        ids = self._ids
        frontend_indexes = self._frontend_indexes
        keep = [i for i in range(head, len(ids))
                if frontend_indexes[i] != fidx or ids[i] not in gone]
        removed = len(ids) - head - len(keep)
        if removed == 0:
            return 0
        self._deadlines = [self._deadlines[i] for i in keep]
        self._ids = [ids[i] for i in keep]
        self._frontend_indexes = [frontend_indexes[i] for i in keep]
        self._arrivals = [self._arrivals[i] for i in keep]
        if self._rows is not None:
            sizes = self._rows
            self._rows = [sizes[i] for i in keep]
        self._head = 0
        self.n_cancelled += removed
        self._update(now, _NEG_INF, outbox)
        self._publish(now, outbox)
        return removed

    def grant_window_left(self, now: float) -> float | None:
        """How much of the candidate's grant window is left at ``now`` (its last grantable
        moment ``latest - delay(bs)`` minus now; negative: a grant now is too late for the
        batch as planned); None without a candidate."""
        bs = self.cand_bs
        if not bs:
            return None
        sizing = self.sizing
        return self.cand_latest - (sizing.d_ctrl_s + sizing.d_data_s * bs) - now

    def on_arrivals(  # noqa: PLR0917 (mirrors RequestMetaBatch's parallel lists)
        self,
        now: float,
        frontend: str,
        request_ids: Sequence[int],
        arrivals: Sequence[float],
        deadlines: Sequence[float],
        outbox: Outbox,
        rows: Sequence[int] = (),
    ) -> None:
        """Enqueue a chunk of requests from ``frontend`` (parallel sequences; ``rows``: each
        request's rows, empty when each holds one)."""
        count = len(request_ids)
        if count == 0:
            return
        arrived = count  # rows
        if rows:
            rows, arrived = self._note_rows(rows, count)
        self._enqueue(frontend, request_ids, arrivals, deadlines, rows)
        self.n_arrived += count
        self.budget_sum_s += sum(deadlines) - sum(arrivals)
        # the meter, the cold rule's count, and the arrivals the rows came in (requests stamped
        # alike came together: a fan-out's, one client message's)
        groups = len(set(arrivals)) if count > 1 else 1
        self.sizing.note_arrivals(now, arrived, count, groups)
        self._update(now, _NEG_INF, outbox)
        self._publish(now, outbox)

    def on_replan(self, now: float, frontend: str, request_ids: Sequence[int],  # noqa: PLR0917
                  deadlines: Sequence[float], outbox: Outbox, rows: Sequence[int] = ()) -> None:
        """Requests of ``frontend`` that were planned but never reached their backend (it did
        not acknowledge the plan) go back into the queue, to be batched again or dropped as any
        queued request (``rows`` as in ``on_arrivals``). They are not new load: neither
        ``n_arrived``, ``n_extra_rows`` nor the rate meter counts them. A plan carries no
        arrival times; the latest one consistent with the deadline (``deadline - budget -
        d_ctrl``, at most ``now``) stands in (only the timeout policy reads it)."""
        count = len(request_ids)
        if count == 0:
            return
        if rows:
            extra_rows = self.n_extra_rows
            rows, _ = self._note_rows(rows, count)
            self.n_extra_rows = extra_rows
        lead = self.sizing.budget_s + self.sizing.d_ctrl_s
        arrivals = [min(now, deadline - lead) for deadline in deadlines]
        self._enqueue(frontend, request_ids, arrivals, deadlines, rows)
        self.n_replanned += count
        self._update(now, _NEG_INF, outbox)
        self._publish(now, outbox)

    def _enqueue(self, frontend: str, request_ids: Sequence[int],
                 arrivals: Sequence[float], deadlines: Sequence[float],
                 rows: Sequence[int]) -> None:
        """Put a chunk into the deadline-ordered queue (appended when in order after its tail,
        else merged); ``rows`` as ``_note_rows`` returned it."""
        count = len(request_ids)
        fidx = self._frontend_index.get(frontend)
        if fidx is None:
            fidx = self._frontend_index[frontend] = len(self._frontends)
            self._frontends.append(frontend)
        if type(deadlines) is not list:
            deadlines = list(deadlines)
        dl = self._deadlines
        # in order: after the live tail, and nondecreasing (sorting a sorted run is one C pass)
        if (self._head == len(dl) or deadlines[0] >= dl[-1]) and (
            count == 1 or sorted(deadlines) == deadlines
        ):
            dl.extend(deadlines)
            self._ids.extend(request_ids)
            self._frontend_indexes.extend([fidx] * count)
            self._arrivals.extend(arrivals)
            if self._rows is not None:
                self._rows.extend(rows or [1] * count)
        elif self._rows is not None:
            self._merge_rows(fidx, request_ids, arrivals, deadlines, rows or [1] * count)
        else:  # several frontends or per-request SLOs: merge the live tail (timsort, two runs)
            head = self._head
            merged = list(zip(dl[head:], self._ids[head:], self._frontend_indexes[head:],
                              self._arrivals[head:], strict=True))
            merged.extend(zip(deadlines, request_ids, repeat(fidx, count), arrivals, strict=True))
            merged.sort()
            self._deadlines = [e[0] for e in merged]
            self._ids = [e[1] for e in merged]
            self._frontend_indexes = [e[2] for e in merged]
            self._arrivals = [e[3] for e in merged]
            self._head = 0

    def _note_rows(self, rows: Sequence[int], count: int) -> tuple[Sequence[int], int]:
        """A chunk's rows list: ``()`` while it and the queue hold one row per request (the
        one-row path), else itself, with the rows list started; and the chunk's rows."""
        if self._rows is None:
            if rows.count(1) == count:
                return (), count
            self._rows = [1] * len(self._deadlines)  # the first request of several rows
        arrived = sum(rows)
        self.n_extra_rows += arrived - count
        return rows, arrived

    def _merge_rows(self, fidx: int, request_ids: Sequence[int], arrivals: Sequence[float],
                    deadlines: Sequence[float], rows: Sequence[int]) -> None:
        """``on_arrivals``' merge of an out-of-order chunk, with the rows list."""
        head = self._head
        assert self._rows is not None
        merged = list(zip(self._deadlines[head:], self._ids[head:],
                          self._frontend_indexes[head:], self._arrivals[head:], self._rows[head:],
                          strict=True))
        merged.extend(zip(deadlines, request_ids, repeat(fidx, len(request_ids)), arrivals, rows,
                          strict=True))
        merged.sort()
        self._deadlines = [e[0] for e in merged]
        self._ids = [e[1] for e in merged]
        self._frontend_indexes = [e[2] for e in merged]
        self._arrivals = [e[3] for e in merged]
        self._rows = [e[4] for e in merged]
        self._head = 0

    def on_timer(self, now: float, outbox: Outbox) -> None:
        if now < self.wake_at:
            return
        bs = self.cand_bs
        sizing = self.sizing
        if (
            bs
            and self._cand_deferred
            and now + sizing.d_ctrl_s + sizing.d_data_s * bs > self.cand_latest
        ):
            # A deferred candidate's grant window closed with no GPU granted (the rank calls it
            # stale by the same test): aim earlier from now on, up to DEFER_MISS_MAX_S. Live, a
            # grant still on its way when the window closes counts too: it came too late for the
            # batch as planned, and the cap bounds what such misses can cost.
            self._cand_deferred = False  # counted once
            self.n_window_misses += 1
            sizing.on_window_missed()
        self._update(now, _NEG_INF, outbox)
        self._publish(now, outbox)

    def set_gpus(self, now: float, gpu_ids: Iterable[int], outbox: Outbox) -> None:
        """The GPUs that exist; a grant for any other GPU is returned unused."""
        self.gpu_ids = set(gpu_ids)

    def set_alone(self, alone: bool) -> None:
        """Whether no other model is served on this model's GPUs (``CandidateSizing.set_alone``:
        it then runs staggered from one GPU's worth of load)."""
        self.sizing.set_alone(alone)
        for sibling in (self._kind_sizing or {}).values():
            sibling.set_alone(alone)

    def set_cluster_load(self, light: bool, room: bool) -> None:
        """What the cluster's load run at once says (set by the SchedulerCore): ``light``
        (``CandidateSizing.light``, DEFER_LIGHT_LOAD: the model starts at once) and ``room``
        (``CandidateSizing.room``, DEFER_ROOM_ALL_BUSY: its deferred windows rarely find every
        GPU busy, so it defers from fewer joiners and stops only after more than one lost
        window), for its own profile and each device kind's."""
        for sizing in (self.sizing, *(self._kind_sizing or {}).values()):
            sizing.light = light
            sizing.room = room

    @property
    def gpu_profiles(self) -> dict[int, LatencyProfile]:
        """The GPUs of other device kinds and this model's profile on each (``set_gpu_profiles``;
        empty: one kind)."""
        return {gpu_id: sizing.profile for gpu_id, sizing in (self._kind_sizing or {}).items()}

    def set_allowances(self, now: float, d_ctrl_s: float, jitter_s: float,
                       outbox: Outbox, reply_s: float | None = None) -> None:
        """New learned allowances (``SchedulerCore``'s ``zserve.core.allowances``): the sizing
        (and every kind's) plans with them, its budget with the frontends' learned reply
        allowance ``reply_s`` (None: as before), and the candidate is computed again."""
        self.sizing.set_allowances(d_ctrl_s, jitter_s, reply_s)
        for sibling in (self._kind_sizing or {}).values():
            sibling.set_allowances(d_ctrl_s, jitter_s, reply_s)
        self._update(now, _NEG_INF, outbox)
        self._publish(now, outbox)

    def set_gpu_profiles(self, profiles: Mapping[int, LatencyProfile]) -> None:
        """GPUs of other device kinds and this model's profile on each (GPUs not listed run the
        thread's own profile, which sizes the candidate the rank sees). Empty: one kind."""
        siblings: dict[int, CandidateSizing] = {}  # one per distinct profile
        self._kind_sizing = {}
        for gpu_id, profile in profiles.items():
            sibling = siblings.get(id(profile))
            if sibling is None:
                sibling = siblings[id(profile)] = self.sizing.for_profile(profile)
            self._kind_sizing[gpu_id] = sibling
        if not self._kind_sizing:
            self._kind_sizing = None

    def on_grant(self, now: float, grant: GrantGpu, outbox: Outbox) -> None:
        """Finalize the batch on the granted GPU, emit the plan and the GPU's new free time, then
        publish the next candidate (the rank dropped ours when it granted). A GPU of another
        device kind runs the batch its own profile sizes (``_plan_on_kind``)."""
        self._sent = None
        gpu_id = grant.gpu_id
        if self.gpu_ids is not None and gpu_id not in self.gpu_ids:
            self._decline(grant, outbox)
            refresh = True
        elif self._kind_sizing is not None and gpu_id in self._kind_sizing:
            refresh = self._plan_on_kind(now, grant, self._kind_sizing[gpu_id], outbox)
        else:
            refresh = self._plan(now, grant, outbox)
        if refresh:
            self._update(now, _NEG_INF, outbox)
        self._publish(now, outbox)

    def on_batch_finished(self, now: float, gpu_id: int, exec_at: float,
                          finished_at: float, outbox: Outbox) -> None:
        """The batch planned at ``exec_at`` on GPU ``gpu_id`` ended at ``finished_at``, as its
        backend reported at ``now``. When the report shows the arrivals to be its answers'
        echoes, a candidate computed before it (the report may come after the echo it judges:
        a sync client's 2nd request) is computed again, and starts at once."""
        if self.sizing.note_finish(now, exec_at, finished_at, gpu_id) and self.cand_bs:
            self._update(now, _NEG_INF, outbox)
            self._publish(now, outbox)

    def _plan_on_kind(self, now: float, grant: GrantGpu, sizing: CandidateSizing,
                      outbox: Outbox) -> bool:
        """A grant of a GPU of another kind: the batch sized with that kind's profile, unless
        it would drop requests (the thread's own kind may still serve them) or run nothing:
        then the GPU goes back unused. Returns whether the candidate needs recomputing."""
        sizing.retarget()  # the shared meter may have moved since
        start = now + sizing.d_ctrl_s
        head = self._head
        if self._rows is None:
            new_head, bs = sizing.size_batch(self._deadlines, head, start, grant.free_at)
        else:
            new_head, _, bs = sizing.size_rows(self._deadlines, self._rows, head, start,
                                               grant.free_at)
        if new_head != head or bs == 0:
            self._decline(grant, outbox)
            return True
        own, self.sizing = self.sizing, sizing
        try:
            self._plan(now, grant, outbox, own_kind=False)
        finally:
            self.sizing = own
        return True  # with the thread's own profile

    def _plan(self, now: float, grant: GrantGpu, outbox: Outbox, own_kind: bool = True) -> bool:
        """The batch on the granted GPU with ``self.sizing``: the plan and the GrantAnswer (True:
        the candidate needs recomputing), or the decline when nothing can run (False: the
        candidate as computed for the grant stands). ``own_kind``: the GPU runs the thread's
        own profile, for which the candidate was computed."""
        sizing = self.sizing
        # the grant came after the moment the candidate asked for (its exec time less its
        # delay): the candidate waited for a GPU
        asked_at = self.cand_exec - sizing.d_ctrl_s - sizing.d_data_s * self.cand_bs
        waited = now > asked_at + GRANT_WAITED_S
        sizing.on_grant(self._cand_deferred, waited)
        asked_exec = self.cand_exec
        # grant.early: the rank's rescue: start at once, not at the aim
        self._update(now, grant.free_at, outbox, grant.early)
        if own_kind and sizing.rescue:
            self._start_as_asked(now, grant.free_at, asked_exec, outbox)
        bs = self.cand_bs
        if bs == 0:
            self._decline(grant, outbox)
            return False
        gpu_id = grant.gpu_id
        head = self._head
        sizes = self._rows
        count = bs if sizes is None else self.cand_count  # bs counts rows, count requests
        stop = head + count
        exec_at = self.cand_exec
        sizing.on_planned(now, exec_at, deadlines=self._deadlines, ids=self._ids,
                          arrivals=self._arrivals, rows=sizes, head=head, stop=stop,
                          gpu_id=gpu_id)
        request_ids = self._ids[head:stop]
        frontend_indexes = self._frontend_indexes[head:stop]
        finish_by = self._deadlines[head:stop]  # each request's deadline d (latest = d - l(bs))
        plan_rows = [] if sizes is None else sizes[head:stop]
        # a grant pops the head like a drop does: compact here too, or the lists grow forever
        self._advance_head(stop)
        finish_at = exec_at + sizing.table[bs]
        frontends, request_frontend = self._frontends_of(frontend_indexes)
        plan = BatchPlan(
            plan_id=next(self._plan_ids),
            model=self.model,
            gpu_id=gpu_id,
            exec_at=exec_at,
            expected_finish_at=finish_at,
            frontends=frontends,
            request_frontend=request_frontend,
            request_ids=request_ids,
            finish_by=finish_by,
            rows=plan_rows,
            epoch=self.epoch,
            sent_at=now,
            reply_allowance=sizing.reply_s,
        )
        self.n_planned += count
        self.n_batches += 1
        outbox.append(((DEST_BACKEND, gpu_id), plan))
        outbox.append((TO_RANK, GrantAnswer(self.model, gpu_id, grant.grant_id, True, finish_at)))
        return True

    def _start_as_asked(self, now: float, free_at: float, asked_exec: float,
                        outbox: Outbox) -> None:
        """``deferred``: the candidate recomputed at its grant (the GPU free at ``free_at``)
        that asked to start by now (``asked_exec``, its exec time when published) starts at
        once if it now defers. The rank grants a GPU at the moment the candidate asked for;
        one that turned to deferring since (its echo verdict flipped between its update and
        the grant) would hold the granted GPU idle to its aim: closed-loop clients on two GPUs
        3-5x faster than their profile waited 183 ms there, one to four times a perf_analyzer
        sweep, and a step read 0.91 of eager. A grant before the moment asked for keeps it."""
        sizing = self.sizing
        bs = self.cand_bs
        if bs:
            earliest = max(now + sizing.d_ctrl_s + sizing.d_data_s * bs, free_at)
            bar = earliest + sizing.jitter_s
            if asked_exec <= bar < self.cand_exec:
                self._update(now, free_at, outbox, True)

    def _decline(self, grant: GrantGpu, outbox: Outbox) -> None:
        """Give ``grant``'s GPU back untouched: nothing runs on it."""
        outbox.append((TO_RANK, GrantAnswer(self.model, grant.gpu_id, grant.grant_id, False,
                                            grant.free_at)))

    # ------------------------------------------------------------------ core

    def _frontends_of(self, frontend_indexes: list[int]) -> tuple[list[str], list[int]]:
        """A plan's frontends, and each request's position among them."""
        if len(self._frontends) == 1:
            return [self._frontends[0]], [0] * len(frontend_indexes)
        local: dict[int, int] = {}
        names: list[str] = []
        request_frontend: list[int] = []
        for fidx in frontend_indexes:
            pos = local.get(fidx)
            if pos is None:
                pos = local[fidx] = len(names)
                names.append(self._frontends[fidx])
            request_frontend.append(pos)
        return names, request_frontend

    def _update(self, now: float, gpu_free_at: float, outbox: Outbox,
                start_now: bool = False) -> None:
        """Recompute the batch and the candidate at ``now`` (``gpu_free_at``: the granted GPU's
        free time, -inf when not granting; ``start_now``: an early grant, start at once); drop
        what the policy drops."""
        if self._rows is not None:
            self._update_rows(now, gpu_free_at, outbox, start_now)
            return
        head0 = self._head
        deadlines = self._deadlines
        if len(deadlines) == head0:
            self.cand_bs = 0
            self.wake_at = math.inf
            return
        sizing = self.sizing
        head, bs = sizing.size_batch(deadlines, head0, now + sizing.d_ctrl_s, gpu_free_at)
        if head != head0:
            self._emit_drops(head0, head, outbox)
            head = self._advance_head(head)
        if bs == 0:
            self.cand_bs = 0
            self.wake_at = math.inf
            return
        # the candidate [head:head + bs] and the wake-up at its last grantable moment
        self.cand_bs = bs
        (self.cand_exec, self.cand_latest, self.wake_at, self._cand_deferred,
         self._cand_early_ok) = sizing.aim(now, gpu_free_at, bs, 1, deadlines[head],
                                           self._arrivals[head], self._ids[head], start_now)

    def _update_rows(self, now: float, gpu_free_at: float, outbox: Outbox,
                     start_now: bool) -> None:
        """``_update`` while requests of several rows are queued: the batch in rows
        (``CandidateSizing.size_rows``), its request count in ``cand_count``."""
        head0 = self._head
        if len(self._deadlines) == head0:
            self.cand_bs = self.cand_count = 0
            self.wake_at = math.inf
            self._clear_queue()  # back to the one-row path until a multi-row arrival
            return
        sizing = self.sizing
        assert self._rows is not None
        head, count, bs = sizing.size_rows(self._deadlines, self._rows, head0,
                                           now + sizing.d_ctrl_s, gpu_free_at)
        if head != head0:
            self._emit_drops(head0, head, outbox)
            head = self._advance_head(head)
        self.cand_count = count
        if bs == 0:
            self.cand_bs = 0
            self.wake_at = math.inf
            return
        self.cand_bs = bs
        (self.cand_exec, self.cand_latest, self.wake_at, self._cand_deferred,
         self._cand_early_ok) = sizing.aim(now, gpu_free_at, bs,
                                           self._next_rows(head + count, bs),
                                           self._deadlines[head], self._arrivals[head],
                                           self._ids[head], start_now)

    def _next_rows(self, stop: int, rows: int) -> int:
        """The rows the request after a batch ``[head:stop]`` of ``rows`` rows would add: the
        queued one's, else the mean rows per request so far (at least 1); capped where l(b) is
        infinite (``max_batch + 1``)."""
        sizes = self._rows
        assert sizes is not None
        if stop < len(sizes):
            grow = sizes[stop]
        else:
            arrived = self.n_arrived
            grow = round((arrived + self.n_extra_rows) / arrived) if arrived else 1
        limit = self.sizing.max_batch + 1 - rows
        grow = limit if limit < grow else grow
        return grow if grow > 1 else 1

    def _advance_head(self, head: int) -> int:
        """Move the queue's head to ``head`` (drops emitted or a batch planned); compact the
        lists once the popped prefix is long and at least half of them. Returns the new head."""
        self._head = head
        if head >= COMPACT_AT and head * 2 >= len(self._deadlines):
            del self._deadlines[:head]
            del self._ids[:head]
            del self._frontend_indexes[:head]
            del self._arrivals[:head]
            if self._rows is not None:
                del self._rows[:head]
            self._head = head = 0
        return head

    def _emit_drops(self, start: int, stop: int, outbox: Outbox) -> None:
        ids = self._ids[start:stop]
        self.n_dropped += len(ids)
        message = f"{self.model}: cannot finish within its deadline"
        if len(self._frontends) == 1:
            outbox.append(
                (
                    (DEST_FRONTEND, self._frontends[0]),
                    DropNotice(ids, ErrorKind.DEADLINE.value, message),
                )
            )
            return
        for fidx, group in group_by_frontend(ids, self._frontend_indexes[start:stop]).items():
            outbox.append(
                (
                    (DEST_FRONTEND, self._frontends[fidx]),
                    DropNotice(group, ErrorKind.DEADLINE.value, message),
                )
            )

    def _publish(self, now: float, outbox: Outbox) -> None:
        """Send the candidate to the rank if it differs from what the rank holds.

        Publish-ahead: the rank uses a candidate only from its model timer (``exec - delay``) on,
        so while the rank holds none and that moment is more than ``publish_lead_s`` away, the
        candidate is held back and the ModelThread wakes ``publish_lead_s`` before it instead.
        Decisions are unchanged when messages take less than the lead; a deferred batch then
        costs the rank one or two updates instead of one per arrival chunk."""
        bs = self.cand_bs
        sent = self._sent
        if bs == 0:
            if sent is not None:
                self._sent = None
                outbox.append((TO_RANK, CandidateUpdate(self.model, 0, 0.0, 0.0, 0.0)))
            return
        early_ok = self._cand_early_ok
        lead = self.publish_lead_s
        sizing = self.sizing
        delay = sizing.d_ctrl_s + sizing.d_data_s * bs
        exec_at = self.cand_exec
        if sent is None:
            # an early_ok candidate goes out at once: the rank's rescue needs to see it
            if lead is not None and not early_ok:
                publish_at = exec_at - delay - lead
                if publish_at > now:
                    self.wake_at = min(self.wake_at, publish_at)
                    return
        elif (sent[0] == bs and sent[1] == exec_at and sent[2] == self.cand_latest
              and sent[3] == early_ok):
            return
        self._sent = (bs, exec_at, self.cand_latest, early_ok)
        outbox.append((TO_RANK, CandidateUpdate(self.model, bs, exec_at, self.cand_latest, delay,
                                                sizing.published_duration(now, bs, exec_at),
                                                early_ok, sizing.rescue and sizing.defer_shared,
                                                sizing.early_aim, sizing.lone_wait_s)))
