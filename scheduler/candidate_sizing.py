"""How one model sizes and aims its batch candidate: the policy arithmetic a ModelThread asks.

``CandidateSizing`` owns what decides a candidate besides the queue itself: the model's latency
profile and schedule policy, its delays, SLO and planning budget, the rate meter and the target
batch size and ``keep_min`` that follow from it, the deferred policies' rate bounds, and what they
learn from their grants (the miss margin, the window-loss estimate and its back-off, the
``DeferralYield``) and from their arrivals (the ``AnswerEchoes``). The ModelThread
(``zserve.scheduler.model_thread``) owns the queue and the candidate: it hands the part its
deadline-ordered lists and head index, and stores what the part returns. The calls, in the
order of a ModelThread's event:

- ``note_arrivals(now, rows, requests, groups)``: a chunk's rows feed the meter (and the target,
  when it seals a bucket), its requests ``arrived_requests`` (the cold rule's evidence), its
  distinct arrival times the rows one arrival brings (the joiner rule's unit);
- ``size_batch`` / ``size_rows``: the drop policies' new head and batch size over the queue
  (``size_rows`` while requests hold several rows);
- ``aim``: the candidate's exec time by the schedule policy (Symphony Appendix D,
  ``update_candidate``), its latest start, its wake-up, and whether it defers;
- ``on_grant`` (a grant came for the candidate), ``on_planned`` (its batch was planned) and
  ``on_window_missed`` (a deferred candidate's grant window closed): the deferred policies'
  learning; ``published_duration``: the duration a ``CandidateUpdate`` carries.

The methods run on the shard's hot path: the queue comes in as the ModelThread's own lists (no
copy), the profile's table and the policy's kind are cached in attributes, ``size_batch`` is the
drop policy's own method (bound once: no dispatch per call), and ``b if b > a else a`` stands for
``max(a, b)`` (the same value; no call), ``b if b < a else a`` for ``min(a, b)``.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable

from zserve.config.policy_names import (
    DEFAULT_KEEP_TOLERANCE,
    DROP_FCFS,
    DROP_SUFFIX,
    GRANT_EARLIEST_DEADLINE,
    KIND_DEFERRED,
    KIND_EAGER,
    KIND_FRONTRUN,
    KIND_LATEST,
    KIND_TIMEOUT,
    SchedulePolicy,
)
from zserve.config.profiles import LatencyProfile
from zserve.scheduler.common import TIMER_SLACK_S
from zserve.scheduler.policy import (
    DEFER_BACKOFF_MAX,
    DEFER_COLD_MIN_REQUESTS,
    DEFER_LOSS_DECAY,
    DEFER_LOSS_MAX,
    DEFER_LOSS_RECENT,
    DEFER_LOSS_WEIGHT,
    DEFER_MIN_JOINERS,
    DEFER_MISS_MAX_S,
    DEFER_MISS_RELAX_S,
    DEFER_MISS_WIDEN_S,
    DEFER_ROOM_LOSS_MAX,
    DEFER_ROOM_MIN_JOINERS,
    DEFER_STAGGER_ALONE_MIN_GPUS,
    DEFER_STAGGER_MIN_GPUS,
    RESCUE_SHARED_FLOOR,
    AnswerEchoes,
    DeferralYield,
    RpsMeter,
    target_batch_size,
)

# ``deferred``: why a planned batch started when it did (``CandidateSizing.decisions``, in the
# scheduler's stats): waited for its aim, or started at once because the rank rescued it, it
# reached its stagger, its waits gained no joiners, its arrivals echo its answers, its windows
# were being lost, it is a cold lone request (waits for the first rate sample), the cluster is
# lightly loaded (DEFER_LIGHT_LOAD), or fewer than DEFER_MIN_JOINERS arrivals were expected
# before its aim.
REASON_DEFERRED = "deferred"
REASON_AT_ONCE = "at_once"  # a policy that never defers
REASON_RESCUED = "rescued"
REASON_STAGGER = "stagger_reached"
REASON_NO_YIELD = "no_yield"
REASON_ECHOES = "echoes"
REASON_LOSING = "losing_windows"
REASON_COLD = "cold_lone"
REASON_FEW_JOINERS = "few_joiners"
REASON_LIGHT = "light_load"
DECISION_REASONS = (REASON_DEFERRED, REASON_AT_ONCE, REASON_RESCUED, REASON_STAGGER,
                    REASON_NO_YIELD, REASON_ECHOES, REASON_LOSING, REASON_COLD,
                    REASON_LIGHT, REASON_FEW_JOINERS)

# ``deferred``: the weight of one arrival chunk in the decayed rows-per-arrival average that
# the joiner rule divides the row rate by (about the last 64 chunks count).
ARRIVAL_GROUP_DECAY = 1.0 / 64

DEFAULT_RATE_BUCKET_S = 0.05
DEFAULT_RATE_WINDOW = 100

Aim = tuple[float, float, float, bool, bool]
"""What ``aim`` returns: ``(exec_at, latest, wake_at, deferred, early_ok)``."""


class CandidateSizing:
    """One model's candidate arithmetic and the state it learns (see the module docstring).

    ``slo_s``: the model's SLO; ``budget_s`` (default ``slo_s - d_ctrl_s``): the time from
    arrival to deadline the target batch size plans with. ``d_ctrl_s``/``d_data_s`` give
    ``delay(bs) = d_ctrl + d_data*bs``. ``jitter_s``: the host's timer lateness allowance (the
    frontrun and latest policies aim that much before their moment). The meter seals
    ``rate_bucket_s`` buckets and averages the last ``rate_window``. ``keep_tolerance`` (window
    drop): keep the head while a batch whose per-row cost l(b)/b is within this fraction of the
    target's still fits (0: the authors' rule).

    Read by the ModelThread: ``table`` (l(b) in seconds, by batch rows), ``max_batch``,
    ``rescue`` (the policy's rank rescue: ``deferred``), ``defer_shared`` (the model shares its
    GPUs), the delays above, ``target``, ``keep_min``, and the learned ``miss_margin_s``,
    ``defer_loss``, ``defer_backoff``, ``deferral_yield``.
    """

    __slots__ = (
        "_defer_below",
        "_defer_from",
        "_defer_head_id",
        "_defer_rate",
        "_drop",
        "_group_rows",
        "_groups",
        "_kind",
        "_reason",
        "_rescue_from",
        "alone",
        "answer_echoes",
        "arrived_requests",
        "budget_s",
        "by_deadline",
        "d_ctrl_s",
        "d_data_s",
        "decisions",
        "defer_backoff",
        "defer_loss",
        "defer_shared",
        "deferral_yield",
        "deferred_wait_s",
        "early_aim",
        "jitter_s",
        "keep_min",
        "keep_tolerance",
        "keeps_target",
        "light",
        "lone_wait_s",
        "max_batch",
        "meter",
        "miss_margin_s",
        "policy",
        "profile",
        "reply_s",
        "rescue",
        "room",
        "size_batch",
        "slo_s",
        "stall_at",
        "table",
        "target",
        "timeout_s",
    )

    def __init__(self, profile: LatencyProfile, policy: SchedulePolicy, *, slo_s: float,
                 d_ctrl_s: float = 0.0, d_data_s: float = 0.0, jitter_s: float = 0.0,
                 budget_s: float | None = None, rate_bucket_s: float = DEFAULT_RATE_BUCKET_S,
                 rate_window: int = DEFAULT_RATE_WINDOW,
                 keep_tolerance: float = DEFAULT_KEEP_TOLERANCE) -> None:
        self.profile = profile
        self.table: list[float] = profile.table_s
        self.max_batch = profile.max_batch
        self.policy = policy
        self._drop = policy.drop
        self.keeps_target = policy.keeps_target  # window or suffix drop
        # One row per request: the new head of the queue ``deadlines[head:]`` and the batch
        # size, by the drop policy; called as ``size_batch(deadlines, head, start,
        # gpu_free_at)`` with ``start`` = now + d_ctrl and ``gpu_free_at`` the granted GPU's
        # free time (-inf when not granting).
        self.size_batch: Callable[[list[float], int, float, float], tuple[int, int]] = (
            self._size_keeping_target if policy.keeps_target else self._size_feasible)
        self._kind = policy.kind
        self.rescue = policy.rank_rescue  # deferred: the joiner rule and the rank's rescue
        self.by_deadline = policy.grant_order == GRANT_EARLIEST_DEADLINE
        self.slo_s = slo_s
        self.timeout_s = policy.timeout_fraction * slo_s  # the timeout policy's wait
        self.d_ctrl_s = d_ctrl_s
        self.d_data_s = d_data_s
        self.jitter_s = jitter_s
        self.budget_s = slo_s - d_ctrl_s if budget_s is None else budget_s
        self.reply_s = slo_s - d_ctrl_s - self.budget_s  # the reply allowance the budget keeps
        self.keep_tolerance = keep_tolerance
        self.meter = RpsMeter(rate_bucket_s, rate_window)
        self.arrived_requests = 0  # deferred, before a rate: DEFER_COLD_MIN_REQUESTS
        # the deferred policies' beta*lambda bounds (inf until the meter has a rate), whether
        # the model shares its GPUs, and the metered rate the joiner rule reads (inf: none yet)
        self._defer_below = self._rescue_from = self._defer_rate = math.inf
        self.defer_shared = False
        # no other model is served on the model's GPUs (DEFER_STAGGER_ALONE_MIN_GPUS)
        self.alone = False
        # deferred-bl: the margin learned after missed grant windows (DEFER_MISS_WIDEN_S);
        # deferred: the estimate of lost windows and its back-off (policy.py)
        self.miss_margin_s = 0.0
        self.defer_loss = 0.0
        self.defer_backoff = 1  # divides DEFER_LOSS_DECAY: doubles with each loss soon after
        # deferred: whether waiting pays (its joiners), and when the candidate headed by request
        # ``_defer_head_id`` first deferred: the moment it could have started instead
        self.deferral_yield = DeferralYield()
        # deferred: whether its arrivals come right after its answers (closed-loop clients)
        self.answer_echoes = AnswerEchoes()
        # deferred: where the last candidate that starts at once for want of joiners would
        # have aimed (0.0: none), the moment the rank may hold it back to (RankThread)
        self.early_aim = 0.0
        # deferred: when a deferring candidate is taken for a stalled closed loop
        # (AnswerEchoes.stall_at; inf: not deferring)
        self.stall_at = math.inf
        self._defer_head_id = -1
        self._defer_from = math.inf
        self._init_arrivals_and_decisions()
        self.target = self.keep_min = 1
        self.lone_wait_s = self.budget_s - d_data_s - self.table[1]
        self.set_target(target_batch_size(profile, self.budget_s, None, d_data_s))

    def _init_arrivals_and_decisions(self) -> None:
        """``deferred``: what it counts of its decisions and of how its rows arrive."""
        # why each planned batch started when it did (DECISION_REASONS, counted at plan time),
        # the reason of the last aim computed, and the deferred batches' waits, summed
        self.decisions: dict[str, int] = dict.fromkeys(DECISION_REASONS, 0)
        self._reason = REASON_AT_ONCE
        self.deferred_wait_s = 0.0
        # decayed sums of the rows that arrived and of their arrival groups (the requests of one
        # chunk stamped with one arrival time: a fan-out's, a client's InferRequests), whose
        # ratio is the rows one joining arrival brings
        self._group_rows = self._groups = 0.0
        # the cluster's load run at once is under DEFER_LIGHT_LOAD, and its windows rarely find
        # every GPU busy (DEFER_ROOM_ALL_BUSY): both set by the SchedulerCore
        self.light = False
        self.room = False

    # ------------------------------------------------------------------ the target

    def set_profile(self, profile: LatencyProfile) -> None:
        """A new latency profile (the host merged a new backend set's), and the target batch
        size that follows from it at the current rate."""
        self.profile = profile
        self.table = profile.table_s
        self.max_batch = profile.max_batch
        self.lone_wait_s = self.budget_s - self.d_data_s - self.table[1]
        self.retarget()

    def set_allowances(self, d_ctrl_s: float, jitter_s: float,
                       reply_s: float | None = None) -> None:
        """New learned allowances (``zserve.core.allowances``): the budget follows ``d_ctrl``
        and the reply allowance (None: its reply part as it was); the target follows the
        budget."""
        if reply_s is not None:
            self.reply_s = reply_s
        self.budget_s = self.slo_s - self.reply_s - d_ctrl_s
        self.d_ctrl_s, self.jitter_s = d_ctrl_s, jitter_s
        self.lone_wait_s = self.budget_s - self.d_data_s - self.table[1]
        self.retarget()

    def for_profile(self, profile: LatencyProfile) -> CandidateSizing:
        """A sibling for GPUs of another device kind: ``profile`` (that kind's), this one's
        policy, SLO, delays and budget, and this one's meter (one rate per model)."""
        sibling = CandidateSizing(profile, self.policy, slo_s=self.slo_s, d_ctrl_s=self.d_ctrl_s,
                                  d_data_s=self.d_data_s, jitter_s=self.jitter_s,
                                  budget_s=self.budget_s, keep_tolerance=self.keep_tolerance)
        sibling.alone = self.alone
        sibling.reply_s = self.reply_s  # exactly (budget - ... would round)
        sibling.set_meter(self.meter)
        sibling.answer_echoes = self.answer_echoes  # one model, one stream of answers
        sibling.retarget()
        return sibling

    def set_meter(self, meter: RpsMeter) -> None:
        """Read the rate from ``meter`` from now on (the target stays until it seals a bucket)."""
        self.meter = meter
        self._refresh_defer_below()

    def set_alone(self, alone: bool) -> None:
        """Whether the model has its GPUs to itself: it then runs staggered from one GPU's worth
        of load on (DEFER_STAGGER_ALONE_MIN_GPUS), not two."""
        if alone != self.alone:
            self.alone = alone
            self._refresh_defer_below()

    def note_arrivals(self, now: float, rows: int, requests: int, groups: int = 0) -> None:
        """``requests`` of ``rows`` rows in all arrived at ``now``, in ``groups`` distinct
        arrival times (0: one per request): the meter counts the rows; a sealed bucket moves
        the target; the joiner rule learns the rows an arrival brings (``rows_per_arrival``)."""
        self.arrived_requests += requests
        keep = 1.0 - ARRIVAL_GROUP_DECAY
        self._group_rows = keep * self._group_rows + rows
        self._groups = keep * self._groups + (groups if groups > 0 else requests)
        if self.rescue:
            self.answer_echoes.note_arrivals(now, rows, self._defer_rate)
        if self.meter.add(now, rows):
            self.retarget()

    def note_finish(self, now: float, exec_at: float, finished_at: float, gpu_id: int) -> bool:
        """``deferred``: the batch planned at ``exec_at`` on GPU ``gpu_id`` ended at
        ``finished_at`` (its backend's report): where its answers' echoes are looked for
        (``AnswerEchoes``). True when that turned the model's arrivals into echoes."""
        if not self.rescue:
            return False
        echoes, rate = self.answer_echoes, self._defer_rate
        before = echoes.closed_loop(now, rate)
        echoes.note_finish(now, exec_at, finished_at, gpu_id, rate)
        return not before and echoes.closed_loop(now, rate)

    def retarget(self) -> None:
        """The target batch size at the meter's current rate."""
        self.set_target(target_batch_size(self.profile, self.budget_s, self.meter.rate(),
                                          self.d_data_s))

    def set_target(self, target: int) -> None:
        """The target batch size, and ``keep_min``: the smallest batch whose per-request cost
        l(b)/b is within ``keep_tolerance`` of the target's (equal to the target at tolerance 0,
        the authors' rule)."""
        self.target = target
        self._refresh_defer_below()
        if self.keep_tolerance <= 0:
            self.keep_min = target
            return
        table = self.table
        limit = (1 + self.keep_tolerance) * table[target] / target
        keep = target
        while keep > 1 and table[keep - 1] / (keep - 1) <= limit:
            keep -= 1
        self.keep_min = keep

    def _refresh_defer_below(self) -> None:
        """The batch size from which the ``deferred`` policy stops deferring (policy.py), from
        the metered rate lambda, beta, and the GPUs the model's load needs at its target batch
        size b (n = lambda*l(b)/b; staggered from two, or one when ``alone``), and the rate the
        joiner rule reads. Cached: it changes only when the meter seals a bucket or the target
        or profile changes."""
        rate = self.meter.rate()
        self.defer_shared = False
        self._defer_rate = math.inf if rate is None else rate  # no rate yet: plain frontrun
        if rate is None:
            self._defer_below = self._rescue_from = math.inf
            return
        beta_lambda = self.profile.beta_s * rate
        self._rescue_from = beta_lambda - 1.0
        target = self.target
        stagger_from = DEFER_STAGGER_ALONE_MIN_GPUS if self.alone else DEFER_STAGGER_MIN_GPUS
        if beta_lambda >= 1.0 and rate * self.table[target] / target >= stagger_from:
            self._defer_below = max(beta_lambda, target)
        else:  # shares GPUs: deferred: rescued by the rank; deferred-bl: beta*lambda - 1
            self._defer_below = math.inf if self.rescue else beta_lambda - 1.0
            self.defer_shared = True
            self._rescue_from *= RESCUE_SHARED_FLOOR

    # ------------------------------------------------------------------ the batch

    def _size_keeping_target(self, dl: list[float], head: int, start: float,
                             gpu_free_at: float) -> tuple[int, int]:
        """Window and suffix drops: drop the head while keeping it would force a batch smaller
        than the target (keep_min; suffix: or than the longest feasible suffix, if shorter).
        While at least keep_min requests remain the bar is one deadline threshold: bisect to it,
        then step through the short remainder."""
        size = len(dl)
        avail = size - head
        table = self.table
        d_data = self.d_data_s
        keep_min = self.keep_min
        if self._drop == DROP_SUFFIX:
            suffix = self._longest_feasible_suffix(dl, head, start, gpu_free_at)
            if not suffix:  # not even the last request can finish alone: all are lost
                return size, 0
            keep_min = suffix if suffix < keep_min else keep_min
        earliest = start + d_data * keep_min
        earliest = gpu_free_at if gpu_free_at > earliest else earliest
        threshold = earliest + table[keep_min]
        if dl[head] < threshold and avail > keep_min:
            head = bisect_left(dl, threshold, head, size - keep_min)
            avail = size - head
        while avail:
            bs = keep_min if keep_min < avail else avail
            earliest = start + d_data * bs
            earliest = gpu_free_at if gpu_free_at > earliest else earliest
            if dl[head] >= earliest + table[bs]:
                break
            head += 1
            avail -= 1
        else:
            return head, 0
        max_batch = self.max_batch
        cap = avail if avail < max_batch else max_batch
        if bs < cap:
            bs = self._grow(dl[head], bs, cap, start, gpu_free_at)
        return head, bs

    def _longest_feasible_suffix(self, dl: list[float], head: int, start: float,
                                 gpu_free_at: float) -> int:
        """``suffix`` drop (nexuslb's batch_policy.cpp since 2022): the most requests at the
        queue's tail (latest deadlines) that could still run as one batch in time, at most
        max_batch. Feasibility is monotone along the queue (a later start index has a later
        deadline and a smaller batch), so it is a bisection."""
        table = self.table
        d_data = self.d_data_s
        size = len(dl)
        lo = size - self.max_batch
        lo = head if head > lo else lo
        hi = size
        while lo < hi:
            mid = (lo + hi) // 2
            bs = size - mid
            earliest = start + d_data * bs
            earliest = gpu_free_at if gpu_free_at > earliest else earliest
            if dl[mid] >= earliest + table[bs]:
                hi = mid
            else:
                lo = mid + 1
        return size - lo

    def _size_feasible(self, dl: list[float], head: int, start: float,
                       gpu_free_at: float) -> tuple[int, int]:
        """FCFS and no-drop policies: drop only what cannot finish even alone; the batch up to
        the target under FCFS."""
        size = len(dl)
        earliest = start + self.d_data_s
        earliest = gpu_free_at if gpu_free_at > earliest else earliest
        threshold = earliest + self.table[1]
        if dl[head] < threshold:
            head = bisect_left(dl, threshold, head, size)
        avail = size - head
        if not avail:
            return head, 0
        max_batch = self.max_batch
        cap = avail if avail < max_batch else max_batch
        if self._drop == DROP_FCFS and self.target < cap:
            cap = self.target
        bs = 1
        if bs < cap:
            bs = self._grow(dl[head], bs, cap, start, gpu_free_at)
        return head, bs

    def size_rows(self, deadlines: list[float], rows: list[int], head: int, start: float,
                  gpu_free_at: float) -> tuple[int, int, int]:
        """Both drop policies when requests hold several rows (``rows``, parallel to
        ``deadlines``): the new head, and the batch ``[head:head + count]`` and its rows. A
        batch is a prefix of the queue in deadline order and never splits a request: one that
        does not fit the rows left waits, with everything behind it, for the next batch. The
        head stays while a batch of the rows it must be able to go with is feasible:
        ``keep_min`` rows or all that is queued if fewer (window drop; the one-row rule's
        ``min(keep_min, queued)``), 1 for the others, and never fewer than the head's own rows,
        so a head of n rows goes whenever n alone fits. Then the batch grows request by request
        up to ``max_batch`` rows (FCFS: the target) while it still finishes by the head's
        deadline."""
        dl = deadlines
        size = len(dl)
        table = self.table
        d_data = self.d_data_s
        max_batch = self.max_batch
        earliest = start + d_data
        earliest = gpu_free_at if gpu_free_at > earliest else earliest
        threshold = earliest + table[1]
        if dl[head] < threshold:  # what cannot finish even as one row: drop in bulk
            head = bisect_left(dl, threshold, head, size)
        # suffix: as window here (rows make the suffix rule's bisection a scan; not built)
        floor = self.keep_min if self.keeps_target else 1
        while head < size:
            first = rows[head]
            if first <= max_batch:
                need = self._rows_up_to(rows, head, floor) if floor > first else first
                earliest = start + d_data * need
                earliest = gpu_free_at if gpu_free_at > earliest else earliest
                if dl[head] >= earliest + table[need]:
                    break
            head += 1
        else:
            return head, 0, 0
        cap = max_batch
        if self._drop == DROP_FCFS:
            cap = self.target if self.target < cap else cap
            cap = first if first > cap else cap
        return head, *self._grow_rows(dl, rows, head, first, cap=cap, start=start,
                                      gpu_free_at=gpu_free_at)

    def _rows_up_to(self, rows: list[int], head: int, need: int) -> int:
        """``need`` rows (at most ``max_batch``), or fewer when the queue from ``head`` holds
        fewer: the batch size the window rule checks the head with, whatever the requests'
        sizes."""
        need = self.max_batch if self.max_batch < need else need
        total = 0
        stop = head
        size = len(rows)
        while stop < size and total < need:
            total += rows[stop]
            stop += 1
        return need if total > need else total

    def _grow_rows(self, dl: list[float], rows: list[int], head: int, batch_rows: int, *,
                   cap: int, start: float, gpu_free_at: float) -> tuple[int, int]:
        """Add whole requests after the head (``batch_rows`` rows) while the batch stays within
        ``cap`` rows and finishes by the head's deadline (feasibility is monotone in rows); the
        batch's requests and rows."""
        deadline = dl[head]
        table = self.table
        d_data = self.d_data_s
        stop = head + 1
        size = len(rows)
        while stop < size:
            grown = batch_rows + rows[stop]
            if grown > cap:
                break
            earliest = start + d_data * grown
            earliest = gpu_free_at if gpu_free_at > earliest else earliest
            if deadline < earliest + table[grown]:
                break
            batch_rows = grown
            stop += 1
        return stop - head, batch_rows

    def _grow(self, deadline: float, bs: int, cap: int, start: float, gpu_free_at: float) -> int:
        """The largest b in [bs, cap] whose batch still finishes by ``deadline`` (feasibility is
        monotone in b)."""
        table = self.table
        d_data = self.d_data_s
        earliest = start + d_data * cap
        earliest = gpu_free_at if gpu_free_at > earliest else earliest
        if deadline >= earliest + table[cap]:
            return cap
        lo, hi = bs, cap - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            earliest = start + d_data * mid
            earliest = gpu_free_at if gpu_free_at > earliest else earliest
            if deadline >= earliest + table[mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ------------------------------------------------------------------ the aim

    def aim(self, now: float, gpu_free_at: float, bs: int, grow: int,  # noqa: PLR0917
            deadline: float, arrival: float, head_id: int, start_now: bool) -> Aim:
        """The candidate of ``bs`` rows headed by request ``head_id`` (its ``deadline`` and
        ``arrival``): its exec time by the policy's kind, clamped into [earliest, latest], its
        latest start, the wake-up at its last grantable moment, whether it is a deferring
        candidate whose window may be lost, and whether the rank may start it early. ``grow``:
        the rows the next request would add (frontrun: the last moment it could still join,
        ``d - l(bs + grow)``; at most ``max_batch + 1 - bs``, where l is infinite).
        ``start_now``: an early grant (the rank's rescue) is being planned: start at once."""
        table = self.table
        delay = self.d_ctrl_s + self.d_data_s * bs
        earliest = now + delay
        earliest = gpu_free_at if gpu_free_at > earliest else earliest
        latest = deadline - table[bs]
        kind = self._kind
        deferred = False
        self.early_aim = 0.0
        self._reason = REASON_AT_ONCE
        # the last deferring candidate's stall check came with nothing arrived since
        stalled = self.stall_at <= now
        self.stall_at = math.inf
        if start_now:
            exec_at = earliest
            self._reason = REASON_RESCUED
        elif self.rescue:
            exec_at = self._aim_rescue(now, earliest, deadline, bs, grow, latest, stalled)
        elif kind == KIND_DEFERRED:  # deferred-bl (policy.py)
            deferred = bs < self._defer_below
            if self.defer_shared:  # sharing GPUs: aim earlier by the learned margin
                exec_at = deadline - self.jitter_s - self.miss_margin_s - table[bs + grow]
            else:  # staggered: the authors' aim
                exec_at = deadline - self.jitter_s - table[bs + grow]
            if not deferred:
                # waiting does not pay (policy.py, deferred): at its batch size
                exec_at = earliest
            elif not self.defer_shared:
                deferred = False  # staggered: a missed window is the stagger at work
        elif kind == KIND_FRONTRUN:
            exec_at = deadline - self.jitter_s - table[bs + grow]
        elif kind == KIND_EAGER:
            exec_at = earliest
        elif kind == KIND_LATEST:
            exec_at = latest - self.jitter_s
        elif kind == KIND_TIMEOUT:
            exec_at = arrival + self.timeout_s
        else:  # pragma: no cover - parse() admits only the kinds above
            raise AssertionError(kind)
        exec_at = earliest if earliest > exec_at else exec_at
        exec_at = latest if latest < exec_at else exec_at
        # deferred: the rank may start it early (its rescue); a staggered model only once its
        # batch reaches beta*lambda - 1, where waiting no longer pays in throughput, a shared
        # model from RESCUE_SHARED_FLOOR of that (policy.py). A shared model's deferring
        # candidate is the one whose window may be lost.
        waits = self.rescue and exec_at > earliest and self._deferring_from(head_id, earliest)
        early_ok = waits and bs >= self._rescue_from
        deferred = (waits and self.defer_shared) if self.rescue else deferred
        wake = latest - delay + TIMER_SLACK_S
        wake = self.stall_at if self.stall_at < wake else wake
        return exec_at, latest, wake if wake > now else now + TIMER_SLACK_S, deferred, early_ok

    def _deferring_from(self, head_id: int, earliest: float) -> bool:
        """The candidate headed by request ``head_id`` defers: the first time, note when it
        could have started instead (where its wait is measured from: ``DeferralYield``). True."""
        if head_id != self._defer_head_id:
            self._defer_head_id = head_id
            self._defer_from = earliest
        return True

    def _aim_rescue(self, now: float, earliest: float, deadline: float,  # noqa: PLR0917
                    bs: int, grow: int, latest: float, stalled: bool) -> float:
        """``deferred``: the frontrun moment while deferring pays, else ``earliest``.
        Staggered models defer while below max(beta*lambda, b*) (as ``deferred-bl``); every model
        starts at once when fewer than DEFER_MIN_JOINERS requests are expected before its aim
        (light load: nothing would join). Before the meter's first sample (no rate: the joiner
        rule cannot count) a model's lone first request waits no later than that sample, and
        from its DEFER_COLD_MIN_REQUESTS-th request on the model defers as frontrun does. A
        model whose arrivals echo its answers (closed-loop clients, ``AnswerEchoes``) or whose
        deferred windows gained nothing (``DeferralYield``) starts at once.
        Contention is the rank's: a deferring candidate is published ``early_ok`` (``aim``) and
        the rank starts it early while the cluster is short of GPUs (``RankThread``, rescue). A
        candidate started at once for want of joiners notes its aim (clamped to ``latest``) in
        ``early_aim``: the rank may hold it back to there."""
        reason = self._no_wait_reason(now, bs)
        if reason is not None:
            return self._at_once(reason, earliest)
        rate = self._defer_rate
        aim = deadline - self.jitter_s - self.table[bs + grow]
        stall_at = self.answer_echoes.stall_at(rate)
        if stalled and stall_at <= now and self.answer_echoes.note_stall(bs):
            # the arrivals stopped while it waited: a closed loop stalled
            return self._at_once(REASON_ECHOES, earliest)
        if rate == math.inf and self.arrived_requests < DEFER_COLD_MIN_REQUESTS:
            # cold, and nothing says a second request will come: wait for one no later than
            # the meter's first sample (-inf with no arrival yet, only replanned requests: now)
            first = self.meter.first_sample_at()
            self._reason = REASON_COLD
            return first if first < aim else aim
        if self.defer_shared:
            # the GPUs have the time a wait would save (DEFER_LIGHT_LOAD); a model without a
            # rate yet (a cold burst) defers as above
            light = self.light and rate != math.inf
            bar = DEFER_ROOM_MIN_JOINERS if self.room else DEFER_MIN_JOINERS
            if light or (aim - now) * rate < bar * self.rows_per_arrival:
                held = latest if latest < aim else aim
                if held > earliest:  # the rank may hold it back to here (RankThread)
                    self.early_aim = held
                return self._at_once(REASON_LIGHT if light else REASON_FEW_JOINERS, earliest)
        if stall_at > now:  # looked at again there, if nothing arrives before
            self.stall_at = stall_at
        self._reason = REASON_DEFERRED
        return aim

    def at_once_load(self) -> float:
        """The GPU seconds a second this model's load takes run at once (each arrival's rows
        alone, at the metered rate); 0 before the meter's first sample."""
        rate = self.meter.rate()
        if rate is None:
            return 0.0
        per_arrival = self.rows_per_arrival
        rows = round(per_arrival)
        rows = 1 if rows < 1 else (self.max_batch if rows > self.max_batch else rows)
        return rate / per_arrival * self.table[rows]

    @property
    def rows_per_arrival(self) -> float:
        """The rows one arrival brings, on the decayed average (1 before any): the joiner rule
        counts arrivals, since rows that come together join together or not at all."""
        groups = self._groups
        return self._group_rows / groups if groups > 0.0 else 1.0

    def _no_wait_reason(self, now: float, bs: int) -> str | None:
        """Why the candidate of ``bs`` rows starts at once whatever its aim (None: the aim
        decides): past the stagger, or deferral has not been paying, or the arrivals are the
        answers' echoes (closed-loop clients: nothing can join while they wait), or its
        deferred windows are being lost (to other models' batches: waiting costs more heads
        than it buys joiners, so it starts at once while the estimate is high)."""
        if bs >= self._defer_below:
            return REASON_STAGGER
        if not self.deferral_yield.pays:
            return REASON_NO_YIELD
        if self.answer_echoes.closed_loop(now, self._defer_rate):
            return REASON_ECHOES
        if self.defer_shared and self.defer_loss > (DEFER_ROOM_LOSS_MAX if self.room
                                                    else DEFER_LOSS_MAX):
            return REASON_LOSING
        return None

    def _at_once(self, reason: str, earliest: float) -> float:
        """Start at ``earliest``, noting why (``decisions``)."""
        self._reason = reason
        return earliest

    def published_duration(self, now: float, bs: int, exec_at: float) -> float:
        """The duration a ``CandidateUpdate`` of ``bs`` rows at ``exec_at`` carries: deferred's
        projection (l(b) of the batch expected at the exec time: bs plus the rows the metered
        rate brings until then; a deferred batch grows while it waits), eager-edf's l(bs) (its
        deadline order: latest + l(bs) is the head's deadline), else 0 (no work)."""
        if not self.rescue:
            return self.table[bs] if self.by_deadline else 0.0
        grow = (exec_at - now) * self._defer_rate
        if grow > 0.0 and grow != math.inf:
            expected = bs + int(grow)
            bs = expected if expected < self.max_batch else self.max_batch
        return self.table[bs]

    # ------------------------------------------------------------------ learning

    def on_grant(self, deferred: bool, waited: bool = False) -> None:
        """``deferred``: a grant came for the candidate (``deferred``: as ``aim`` returned it): a
        deferred one kept its window (the loss estimate falls by DEFER_LOSS_WEIGHT), one started
        at once lets the estimate decay (DEFER_LOSS_DECAY), so a model that stopped deferring
        tries again (policy.py), unless it ``waited`` for its GPU: a candidate that would start
        at once and found every GPU busy is no evidence that a deferred window would now be
        kept. Other policies learn nothing here."""
        if not self.rescue:
            return
        loss = self.defer_loss
        if deferred:
            loss -= DEFER_LOSS_WEIGHT * loss
            if loss < DEFER_LOSS_RECENT * DEFER_LOSS_MAX:  # the losses are behind it
                self.defer_backoff = 1
        elif not waited:
            loss -= DEFER_LOSS_DECAY / self.defer_backoff * loss
        self.defer_loss = loss

    def on_window_missed(self) -> None:
        """A deferred candidate lost its grant window (policy.py): ``deferred`` raises its
        estimate of lost windows, ``deferred-bl`` aims earlier, up to DEFER_MISS_MAX_S."""
        if self.rescue:
            loss = self.defer_loss
            if loss > DEFER_LOSS_RECENT * DEFER_LOSS_MAX:  # soon after the last loss: back off
                backoff = 2 * self.defer_backoff
                self.defer_backoff = backoff if backoff < DEFER_BACKOFF_MAX else DEFER_BACKOFF_MAX
            self.defer_loss = loss + DEFER_LOSS_WEIGHT * (1.0 - loss)
            return
        margin = self.miss_margin_s + DEFER_MISS_WIDEN_S
        self.miss_margin_s = margin if margin < DEFER_MISS_MAX_S else DEFER_MISS_MAX_S

    def on_planned(self, now: float, exec_at: float, *, deadlines: list[float], ids: list[int],
                   arrivals: list[float], rows: list[int] | None, head: int, stop: int,
                   gpu_id: int = 0) -> None:
        """The candidate granted at ``now`` became a plan at ``exec_at`` on GPU ``gpu_id``: the
        batch ``[head:stop]`` of the ModelThread's queue (its parallel lists; ``rows`` None: one
        row each). ``deferred`` notes what its wait yielded (``_note_yield``) and looks for its
        answers' echoes (``AnswerEchoes``); ``deferred-bl`` gives back DEFER_MISS_RELAX_S of its
        margin."""
        if self.rescue:
            self._note_decision(exec_at, ids[head])
            self._note_yield(now, exec_at, deadlines=deadlines, ids=ids, arrivals=arrivals,
                             rows=rows, head=head, stop=stop)
            batch_rows = stop - head if rows is None else sum(rows[head:stop])
            self.answer_echoes.note_answer(exec_at, self.table[batch_rows], batch_rows,
                                           self._defer_rate, gpu_id)
        if self.miss_margin_s:
            margin = self.miss_margin_s - DEFER_MISS_RELAX_S
            self.miss_margin_s = margin if margin > 0.0 else 0.0

    def _note_decision(self, exec_at: float, head_id: int) -> None:
        """Count why the batch starting at ``exec_at`` started then: a head that deferred
        (waited for its aim at some point, ``_deferring_from``) is ``deferred``, with its wait
        from the moment it could have started; otherwise the last aim's reason."""
        if head_id == self._defer_head_id and exec_at > self._defer_from:
            self.decisions[REASON_DEFERRED] += 1
            self.deferred_wait_s += exec_at - self._defer_from
        else:
            self.decisions[REASON_AT_ONCE if self._reason == REASON_DEFERRED
                           else self._reason] += 1

    def _note_yield(self, now: float, exec_at: float, *, deadlines: list[float], ids: list[int],
                    arrivals: list[float], rows: list[int] | None, head: int,
                    stop: int) -> None:
        """What the batch granted at ``now`` gained in the second half of its wait (the rows
        that arrived then and joined it) against what its rate promised for that half, up to
        the room its batch had, or that it did not defer (``DeferralYield``). The wait runs from
        the moment the candidate could have started to its aim (exec time) or the grant,
        whichever came first: waiting for a busy GPU past the aim is not deferral. Only its
        second half counts: closed-loop clients whose answers all came together send their next
        requests in one burst just after the candidate starts waiting, and nothing after; a
        Poisson stream brings as many in the second half as the rate says. A batch with
        requests queued behind it, or no room to grow, promised nothing."""
        since = self._defer_from
        end = now if now < exec_at else exec_at
        if ids[head] != self._defer_head_id or not end > since:
            self.deferral_yield.note_at_once()
            return
        self._defer_head_id = -1
        rate = self._defer_rate
        if rate == math.inf or stop < len(ids):  # no rate yet, or a full batch
            return
        mid = 0.5 * (since + end)
        count = stop - head
        batch_rows = [1] * count if rows is None else rows[head:stop]
        joined = sum(n for at, n in zip(arrivals[head:stop], batch_rows, strict=True)
                     if mid < at <= end)
        by_mid = sum(batch_rows) - joined
        room = self.profile.largest_batch_within(deadlines[head] - exec_at)
        promised = min(rate * (end - mid), float(room - by_mid))
        if promised > 0.0:
            self.deferral_yield.note_deferred(float(joined), promised)


__all__ = ["DECISION_REASONS", "DEFAULT_RATE_BUCKET_S", "DEFAULT_RATE_WINDOW", "Aim",
           "CandidateSizing"]
