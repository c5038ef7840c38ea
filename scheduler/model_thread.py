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
request (``CandidateSizing._size_rows``). While every queued request holds one row the queue
keeps no rows list at all (``_rows`` is None) and every path below is the one-row path.

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
table and the policy's kind from per-instance caches (``profile`` and ``policy`` are properties
that refresh them on assignment). The arithmetic is the same expression for expression, so the
decisions are bit-identical to the plain formulation.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat

from zserve.config.policy_names import (
    DEFAULT_KEEP_TOLERANCE,
    GRANT_EARLIEST_DEADLINE,
    SchedulePolicy,
)
from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.core.groups import group_by_frontend
from zserve.core.hosting import DEST_BACKEND, DEST_FRONTEND, TO_RANK, Outbox
from zserve.scheduler.candidate_sizing import CandidateSizing
from zserve.scheduler.policy import (
    DEFER_MISS_RELAX_S,
    DeferralYield,
    RpsMeter,
    target_batch_size,
)
from zserve.transport.messages import (
    BatchPlan,
    CandidateUpdate,
    DropNotice,
    GrantAnswer,
    GrantGpu,
)

_NEG_INF = -math.inf
DEFAULT_PUBLISH_LEAD_S = 0.002


class ModelThread(CandidateSizing):
    """One model's queue and candidate. Construct one per model; see the module docstring.

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
        rate_bucket_s: float = 0.05,
        rate_window: int = 100,
        keep_tolerance: float = DEFAULT_KEEP_TOLERANCE,
        plan_ids: Iterator[int] | None = None,
        publish_lead_s: float | None = DEFAULT_PUBLISH_LEAD_S,
    ) -> None:
        self.model = model
        self._profile = profile
        self._table: list[float] = profile.table_s
        self._max_batch = profile.max_batch
        self.slo_s = slo_s
        # the policy and its hot-path caches (the setter; the rescue: the rank may start early)
        self.policy = SchedulePolicy.parse(policy) if isinstance(policy, str) else policy
        self._start_now = False  # set while an early (rescue) grant is planned
        self.d_ctrl_s = d_ctrl_s
        self.d_data_s = d_data_s
        self.jitter_s = jitter_s
        self.publish_lead_s = publish_lead_s
        self.budget_s = slo_s - d_ctrl_s if budget_s is None else budget_s
        # the deferred policies' beta*lambda bounds (inf until the meter has a rate)
        self._defer_below = self._rescue_from = math.inf
        self._defer_shared = False  # set with _defer_below: the model shares its GPUs
        self._defer_rate = math.inf  # the metered rate the joiner rule reads (inf: no rate yet)
        self._meter = RpsMeter(rate_bucket_s, rate_window)
        self.keep_tolerance = keep_tolerance
        self.target = 1
        self.keep_min = 1
        self._set_target(target_batch_size(profile, self.budget_s, None, d_data_s))
        self.wake_at = math.inf
        self.gpu_ids: set[int] | None = None  # None: accept grants for any GPU
        self._clear_queue()
        self._frontends: list[str] = []
        self._frontend_index: dict[str, int] = {}
        if plan_ids is None:
            plan_ids = itertools.count((zlib.crc32(model.encode()) << 32) + 1)
        self._plan_ids = plan_ids
        self._clear_candidate()
        # counters (for stats and tests)
        self.n_window_misses = 0
        self.n_arrived = 0
        self.n_extra_rows = 0  # rows arrived beyond one per request
        self.n_dropped = 0
        self.n_cancelled = 0
        self.n_replanned = self.n_planned = self.n_batches = 0  # replanned: by on_replan
        # The scheduler epoch its plans carry (zserve.core.epochs); the host sets it.
        self.epoch = 0

    def _clear_queue(self) -> None:
        """An empty queue: parallel lists sorted by deadline, live from ``_head`` on."""
        self._dl: list[float] = []  # deadlines, sorted
        self._rid: list[int] = []
        self._fe: list[int] = []  # frontend index
        self._arr: list[float] = []
        self._rows: list[int] | None = None  # None: every queued request holds one row
        self._head = 0

    def _clear_candidate(self) -> None:
        # the candidate as last computed, and as last sent to the rank (None: rank has none)
        self.cand_bs = 0
        self.cand_count = 0
        self.cand_exec = 0.0
        self.cand_latest = 0.0
        self._sent: tuple[int, float, float, bool] | None = None
        # deferred: whether the candidate waits for its frontrun moment, and the margin this
        # model has learned to aim earlier by after missed grant windows (DEFER_MISS_WIDEN_S)
        self._cand_deferred = False
        self._cand_early_ok = False  # deferring by choice: the rank may start it early
        self.miss_margin_s = 0.0
        self.defer_loss = 0.0
        self.defer_backoff = 1
        # deferred: whether waiting pays (its joiners), and when the candidate headed by
        # request ``_defer_head`` first deferred: the moment it could have started instead
        self.deferral_yield = DeferralYield()
        self._defer_head = -1
        self._defer_from = math.inf

    # ------------------------------------------------------------------ attributes

    @property
    def profile(self) -> LatencyProfile:
        return self._profile

    @profile.setter
    def profile(self, profile: LatencyProfile) -> None:
        # the shard swaps profiles at run time (backend set changes): refresh the hot-path caches
        self._profile = profile
        self._table = profile.table_s
        self._max_batch = profile.max_batch
        self._refresh_defer_below()

    def set_profile(self, profile: LatencyProfile) -> None:
        """A new latency profile (the host merged a new backend set's), and the target batch
        size that follows from it at the current rate."""
        self.profile = profile
        self._set_target(target_batch_size(profile, self.budget_s, self._meter.rate(),
                                           self.d_data_s))

    @property
    def meter(self) -> RpsMeter:
        return self._meter

    @meter.setter
    def meter(self, meter: RpsMeter) -> None:
        self._meter = meter
        self._refresh_defer_below()

    @property
    def policy(self) -> SchedulePolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: SchedulePolicy) -> None:
        self._policy = policy
        self._drop = policy.drop
        self._keeps_target = policy.keeps_target
        self._kind = policy.kind
        # deferred: the joiner rule and the rank's rescue (policy.py)
        self._rescue = policy.rank_rescue
        self._by_deadline = policy.grant_order == GRANT_EARLIEST_DEADLINE
        if hasattr(self, "_meter"):
            self._refresh_defer_below()

    # ------------------------------------------------------------------ inputs

    @property
    def queue_length(self) -> int:
        return len(self._dl) - self._head

    @property
    def queued_rows(self) -> int:
        """The rows of the queued requests (``queue_length`` when each holds one)."""
        if self._rows is None:
            return len(self._dl) - self._head
        return sum(self._rows[self._head:])

    def take_queued(self, now: float, outbox: Outbox) -> dict[str, list[int]]:
        """Remove every queued request; return their ids by frontend (for a host that stops
        scheduling them, e.g. a draining shard answering them itself). The candidate goes with
        them: its withdrawal is in the outbox if the rank held it."""
        head = self._head
        groups = group_by_frontend(self._rid[head:], self._fe[head:])
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
        rid = self._rid
        fe = self._fe
        keep = [i for i in range(head, len(rid)) if fe[i] != fidx or rid[i] not in gone]
        removed = len(rid) - head - len(keep)
        if removed == 0:
            return 0
        self._dl = [self._dl[i] for i in keep]
        self._rid = [rid[i] for i in keep]
        self._fe = [fe[i] for i in keep]
        self._arr = [self._arr[i] for i in keep]
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
        return self.cand_latest - (self.d_ctrl_s + self.d_data_s * bs) - now

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
        meter = self._meter
        if meter.add(now, arrived):
            self._set_target(target_batch_size(self._profile, self.budget_s, meter.rate(),
                                               self.d_data_s))
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
        lead = self.budget_s + self.d_ctrl_s
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
        dl = self._dl
        # in order: after the live tail, and nondecreasing (sorting a sorted run is one C pass)
        if (self._head == len(dl) or deadlines[0] >= dl[-1]) and (
            count == 1 or sorted(deadlines) == deadlines
        ):
            dl.extend(deadlines)
            self._rid.extend(request_ids)
            self._fe.extend([fidx] * count)
            self._arr.extend(arrivals)
            if self._rows is not None:
                self._rows.extend(rows or [1] * count)
        elif self._rows is not None:
            self._merge_rows(fidx, request_ids, arrivals, deadlines, rows or [1] * count)
        else:  # several frontends or per-request SLOs: merge the live tail (timsort, two runs)
            head = self._head
            merged = list(
                zip(dl[head:], self._rid[head:], self._fe[head:], self._arr[head:], strict=True)
            )
            merged.extend(zip(deadlines, request_ids, repeat(fidx, count), arrivals, strict=True))
            merged.sort()
            self._dl = [e[0] for e in merged]
            self._rid = [e[1] for e in merged]
            self._fe = [e[2] for e in merged]
            self._arr = [e[3] for e in merged]
            self._head = 0

    def _note_rows(self, rows: Sequence[int], count: int) -> tuple[Sequence[int], int]:
        """A chunk's rows list: ``()`` while it and the queue hold one row per request (the
        one-row path), else itself, with the rows list started; and the chunk's rows."""
        if self._rows is None:
            if rows.count(1) == count:
                return (), count
            self._rows = [1] * len(self._dl)  # the first request of several rows
        arrived = sum(rows)
        self.n_extra_rows += arrived - count
        return rows, arrived

    def _merge_rows(self, fidx: int, request_ids: Sequence[int], arrivals: Sequence[float],
                    deadlines: Sequence[float], rows: Sequence[int]) -> None:
        """``on_arrivals``' merge of an out-of-order chunk, with the rows list."""
        head = self._head
        assert self._rows is not None
        merged = list(zip(self._dl[head:], self._rid[head:], self._fe[head:], self._arr[head:],
                          self._rows[head:], strict=True))
        merged.extend(zip(deadlines, request_ids, repeat(fidx, len(request_ids)), arrivals, rows,
                          strict=True))
        merged.sort()
        self._dl = [e[0] for e in merged]
        self._rid = [e[1] for e in merged]
        self._fe = [e[2] for e in merged]
        self._arr = [e[3] for e in merged]
        self._rows = [e[4] for e in merged]
        self._head = 0

    def on_timer(self, now: float, outbox: Outbox) -> None:
        if now < self.wake_at:
            return
        bs = self.cand_bs
        if (
            bs
            and self._cand_deferred
            and now + self.d_ctrl_s + self.d_data_s * bs > self.cand_latest
        ):
            # A deferred candidate's grant window closed with no GPU granted (the rank calls it
            # stale by the same test): aim earlier from now on, up to DEFER_MISS_MAX_S. Live, a
            # grant still on its way when the window closes counts too: it came too late for the
            # batch as planned, and the cap bounds what such misses can cost.
            self._missed_window(now)
        self._update(now, _NEG_INF, outbox)
        self._publish(now, outbox)

    def set_gpus(self, now: float, gpu_ids: Iterable[int], outbox: Outbox) -> None:
        """The GPUs that exist; a grant for any other GPU is returned unused."""
        self.gpu_ids = set(gpu_ids)

    def on_grant(self, now: float, grant: GrantGpu, outbox: Outbox) -> None:
        """Finalize the batch on the granted GPU, emit the plan and the GPU's new free time, then
        publish the next candidate (the rank dropped ours when it granted)."""
        self._sent = None
        gpu_id = grant.gpu_id
        if self.gpu_ids is not None and gpu_id not in self.gpu_ids:
            self._decline(grant, outbox)
            self._update(now, _NEG_INF, outbox)
            self._publish(now, outbox)
            return
        if self._rescue:
            self._granted_in_window()
        self._start_now = grant.early  # a rescue: start at once, not at the aim
        self._update(now, grant.free_at, outbox)
        self._start_now = False
        bs = self.cand_bs
        if self._rescue and bs:
            self._note_yield(now)
        if bs == 0:
            self._decline(grant, outbox)
            self._publish(now, outbox)
            return
        if self.miss_margin_s:
            margin = self.miss_margin_s - DEFER_MISS_RELAX_S
            self.miss_margin_s = margin if margin > 0.0 else 0.0
        head = self._head
        sizes = self._rows
        count = bs if sizes is None else self.cand_count  # bs counts rows, count requests
        stop = head + count
        request_ids = self._rid[head:stop]
        fe = self._fe[head:stop]
        finish_by = self._dl[head:stop]  # each request's deadline d (latest = d - l(bs))
        plan_rows = [] if sizes is None else sizes[head:stop]
        # a grant pops the head like a drop does: compact here too, or the lists grow forever
        self._advance_head(stop)
        exec_at = self.cand_exec
        finish_at = exec_at + self._table[bs]
        frontends, request_frontend = self._frontends_of(fe)
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
        )
        self.n_planned += count
        self.n_batches += 1
        outbox.append(((DEST_BACKEND, gpu_id), plan))
        outbox.append((TO_RANK, GrantAnswer(self.model, gpu_id, grant.grant_id, True, finish_at)))
        self._update(now, _NEG_INF, outbox)
        self._publish(now, outbox)

    def _decline(self, grant: GrantGpu, outbox: Outbox) -> None:
        """Give ``grant``'s GPU back untouched: nothing runs on it."""
        outbox.append((TO_RANK, GrantAnswer(self.model, grant.gpu_id, grant.grant_id, False,
                                            grant.free_at)))

    def _note_yield(self, now: float) -> None:
        """``deferred``: what the candidate granted at ``now`` gained in the second half of its
        wait (the rows that arrived then and joined it) against what its rate promised for that
        half, up to the room its batch had, or that it did not defer (``DeferralYield``). The
        wait runs from the moment the candidate could have started to its aim (exec time) or the
        grant, whichever came first: waiting for a busy GPU past the aim is not deferral. Only
        its second half counts: closed-loop clients whose answers all came together send their
        next requests in one burst just after the candidate starts waiting, and nothing after;
        a Poisson stream brings as many in the second half as the rate says. A batch with
        requests queued behind it, or no room to grow, promised nothing."""
        head = self._head
        since = self._defer_from
        end = now if now < self.cand_exec else self.cand_exec
        if self._rid[head] != self._defer_head or not end > since:
            self.deferral_yield.note_at_once()
            return
        self._defer_head = -1
        rate = self._defer_rate
        count = self.cand_bs if self._rows is None else self.cand_count
        stop = head + count
        if rate == math.inf or stop < len(self._rid):  # no rate yet, or a full batch
            return
        mid = 0.5 * (since + end)
        rows = [1] * count if self._rows is None else self._rows[head:stop]
        arrivals = self._arr[head:stop]
        joined = sum(n for at, n in zip(arrivals, rows, strict=True) if mid < at <= end)
        by_mid = sum(rows) - joined
        room = self._profile.largest_batch_within(self._dl[head] - self.cand_exec)
        promised = min(rate * (end - mid), float(room - by_mid))
        if promised > 0.0:
            self.deferral_yield.note_deferred(float(joined), promised)

    # ------------------------------------------------------------------ core

    def _frontends_of(self, fe: list[int]) -> tuple[list[str], list[int]]:
        if len(self._frontends) == 1:
            return [self._frontends[0]], [0] * len(fe)
        local: dict[int, int] = {}
        names: list[str] = []
        request_frontend: list[int] = []
        for fidx in fe:
            pos = local.get(fidx)
            if pos is None:
                pos = local[fidx] = len(names)
                names.append(self._frontends[fidx])
            request_frontend.append(pos)
        return names, request_frontend

    def _update(self, now: float, gpu_free_at: float, outbox: Outbox) -> None:
        """Recompute the batch and the candidate at ``now``; drop what the policy drops.

        ``b if b > a else a`` stands for ``max(a, b)`` (the same value; no call on this hot
        path), and ``b if b < a else a`` for ``min(a, b)``."""
        if self._rows is not None:
            self._update_rows(now, gpu_free_at, outbox)
            return
        head0 = self._head
        if len(self._dl) == head0:
            self.cand_bs = 0
            self.wake_at = math.inf
            return
        start = now + self.d_ctrl_s
        if self._keeps_target:
            head, bs = self._size_keeping_target(start, gpu_free_at)
        else:
            head, bs = self._size_feasible(start, gpu_free_at)
        if head != head0:
            self._emit_drops(head0, head, outbox)
            head = self._advance_head(head)
        if bs == 0:
            self.cand_bs = 0
            self.wake_at = math.inf
            return
        self._aim(now, gpu_free_at, head, bs)

    def _update_rows(self, now: float, gpu_free_at: float, outbox: Outbox) -> None:
        """``_update`` while requests of several rows are queued: the batch in rows
        (``_size_rows``), its request count in ``cand_count``."""
        head0 = self._head
        if len(self._dl) == head0:
            self.cand_bs = self.cand_count = 0
            self.wake_at = math.inf
            self._clear_queue()  # back to the one-row path until a multi-row arrival
            return
        head, count, bs = self._size_rows(now + self.d_ctrl_s, gpu_free_at)
        if head != head0:
            self._emit_drops(head0, head, outbox)
            head = self._advance_head(head)
        self.cand_count = count
        if bs == 0:
            self.cand_bs = 0
            self.wake_at = math.inf
            return
        self._aim(now, gpu_free_at, head, bs, self._next_rows(head + count, bs))

    def _emit_drops(self, start: int, stop: int, outbox: Outbox) -> None:
        ids = self._rid[start:stop]
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
        for fidx, group in group_by_frontend(ids, self._fe[start:stop]).items():
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
        delay = self.d_ctrl_s + self.d_data_s * bs
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
        # the duration feeds deferred's projection, and eager-edf's deadline order (latest +
        # l(bs) is the head's deadline): no work for the other policies
        duration = (self._expected_duration(now, bs) if self._rescue
                    else self._table[bs] if self._by_deadline else 0.0)
        outbox.append((TO_RANK, CandidateUpdate(self.model, bs, exec_at, self.cand_latest, delay,
                                                duration, early_ok,
                                                self._rescue and self._defer_shared)))

    def _expected_duration(self, now: float, bs: int) -> float:
        """l(b) of the batch expected at the exec time: bs plus the requests the metered rate
        brings until then (the rescue's projection; a deferred batch grows while it waits)."""
        grow = (self.cand_exec - now) * self._defer_rate
        if grow > 0.0 and grow != math.inf:
            expected = bs + int(grow)
            bs = expected if expected < self._max_batch else self._max_batch
        return self._table[bs]
