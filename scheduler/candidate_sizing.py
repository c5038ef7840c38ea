"""How a ModelThread sizes and aims its batch candidate: the arithmetic half of the ModelThread.

``CandidateSizing`` is the ModelThread's base class: it owns no state of its own and holds the
computations over the ModelThread's deadline-ordered queue (parallel lists from ``_head`` on) that
decide the candidate: the target batch size and ``keep_min``, the drop policies' new head and batch
size (``_size_keeping_target``, ``_size_feasible``, ``_grow``), and the candidate's exec time and
wake-up by the schedule policy (``_aim``; Symphony Appendix D, ``update_candidate``). The
deferred policies' learned margin and window-loss estimate are updated here too
(``_missed_window``). The event handling (arrivals, grants, timers) and what goes into the
outbox stay in
``zserve.scheduler.model_thread``. A base class rather than functions: these run on the shard's
hot path, and reading the queue through ``self`` costs no argument passing.

``b if b > a else a`` stands for ``max(a, b)`` (the same value; no call on the hot path), and
``b if b < a else a`` for ``min(a, b)``.
"""

from __future__ import annotations

import math
from bisect import bisect_left

from zserve.config.policy_names import (
    DROP_FCFS,
    DROP_SUFFIX,
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
    DEFER_LOSS_DECAY,
    DEFER_LOSS_MAX,
    DEFER_LOSS_RECENT,
    DEFER_LOSS_WEIGHT,
    DEFER_MIN_JOINERS,
    DEFER_MISS_MAX_S,
    DEFER_MISS_WIDEN_S,
    DEFER_STAGGER_MIN_GPUS,
    RESCUE_SHARED_FLOOR,
    DeferralYield,
    RpsMeter,
)

COMPACT_AT = 4096
"""Compact the queue's lists once this many popped entries precede the head (and they are at
least half of them)."""


class CandidateSizing:
    """The candidate's size and aim over the ModelThread's queue; the ModelThread sets every
    attribute below (see ``zserve.scheduler.model_thread.ModelThread``)."""

    # the queue: parallel lists sorted by deadline, live from _head on
    _dl: list[float]
    _rid: list[int]
    _fe: list[int]
    _arr: list[float]
    # each request's rows, parallel to the lists above; None while every request holds one
    # row (then the sizing below counts requests, which are rows, on its unchanged fast path)
    _rows: list[int] | None
    _head: int
    # hot-path caches of the profile and policy
    _profile: LatencyProfile
    _table: list[float]
    _max_batch: int
    _policy: SchedulePolicy
    _drop: int
    _keeps_target: bool  # window or suffix drop (SchedulePolicy.keeps_target)
    _kind: int
    _meter: RpsMeter
    slo_s: float
    d_ctrl_s: float
    d_data_s: float
    jitter_s: float
    keep_tolerance: float
    target: int
    keep_min: int
    # the deferred policy's beta*lambda batch size, and whether the model shares its GPUs
    _defer_below: float
    _defer_shared: bool
    _defer_rate: float
    _rescue: bool
    _rescue_from: float  # the batch from which a deferring candidate is early_ok (cached)
    _start_now: bool
    miss_margin_s: float
    # deferred: this model's estimate of how often a deferred candidate loses its window
    defer_loss: float
    defer_backoff: int  # divides DEFER_LOSS_DECAY: doubles with each loss soon after the last
    # deferred: whether waiting pays; the candidate head that deferred and when it could start
    deferral_yield: DeferralYield
    _defer_head: int
    _defer_from: float
    # the candidate as last computed
    cand_bs: int  # in rows
    cand_count: int  # requests, [head:head + cand_count] (equal to cand_bs without _rows)
    cand_exec: float
    cand_latest: float
    n_arrived: int  # requests
    n_extra_rows: int  # their rows beyond one each
    _cand_deferred: bool
    _cand_early_ok: bool
    n_window_misses: int
    wake_at: float

    def _set_target(self, target: int) -> None:
        """The target batch size, and ``keep_min``: the smallest batch whose per-request cost
        l(b)/b is within ``keep_tolerance`` of the target's (equal to the target at tolerance 0,
        the authors' rule)."""
        self.target = target
        self._refresh_defer_below()
        if self.keep_tolerance <= 0:
            self.keep_min = target
            return
        table = self._profile.table_s
        limit = (1 + self.keep_tolerance) * table[target] / target
        keep = target
        while keep > 1 and table[keep - 1] / (keep - 1) <= limit:
            keep -= 1
        self.keep_min = keep

    def _refresh_defer_below(self) -> None:
        """The batch size from which the ``deferred`` policy stops deferring (policy.py), from
        the metered rate lambda, beta, and the GPUs the model's load needs at its target batch
        size b (n = lambda*l(b)/b), and the rate the joiner rule reads. Cached: it changes only
        when the meter seals a bucket or the target or profile changes."""
        rate = self._meter.rate()
        self._defer_shared = False
        self._defer_rate = math.inf if rate is None else rate  # no rate yet: plain frontrun
        if rate is None:
            self._defer_below = self._rescue_from = math.inf
            return
        beta_lambda = self._profile.beta_s * rate
        self._rescue_from = beta_lambda - 1.0
        target = self.target
        if beta_lambda >= 1.0 and rate * self._table[target] / target >= DEFER_STAGGER_MIN_GPUS:
            self._defer_below = max(beta_lambda, target)
        else:  # shares GPUs: deferred: rescued by the rank; deferred-bl: beta*lambda - 1
            self._defer_below = math.inf if self._rescue else beta_lambda - 1.0
            self._defer_shared = True
            self._rescue_from *= RESCUE_SHARED_FLOOR

    def _size_keeping_target(self, start: float, gpu_free_at: float) -> tuple[int, int]:
        """Window and suffix drops: the new head and batch size. Drop the head while keeping it
        would force a batch smaller than the target (keep_min; suffix: or than the longest
        feasible suffix, if shorter). While at least keep_min requests remain the
        bar is one deadline threshold: bisect to it, then step through the short remainder.
        ``start`` is now + d_ctrl."""
        dl = self._dl
        head = self._head
        size = len(dl)
        avail = size - head
        table = self._table
        d_data = self.d_data_s
        keep_min = self.keep_min
        if self._drop == DROP_SUFFIX:
            suffix = self._longest_feasible_suffix(start, gpu_free_at)
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
        max_batch = self._max_batch
        cap = avail if avail < max_batch else max_batch
        if bs < cap:
            bs = self._grow(dl[head], bs, cap, start, gpu_free_at)
        return head, bs

    def _longest_feasible_suffix(self, start: float, gpu_free_at: float) -> int:
        """``suffix`` drop (nexuslb's batch_policy.cpp since 2022): the most requests at the
        queue's tail (latest deadlines) that could still run as one batch in time, at most
        max_batch. Feasibility is monotone along the queue (a later start index has a later
        deadline and a smaller batch), so it is a bisection."""
        dl = self._dl
        table = self._table
        d_data = self.d_data_s
        size = len(dl)
        lo = size - self._max_batch
        lo = self._head if self._head > lo else lo
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

    def _size_feasible(self, start: float, gpu_free_at: float) -> tuple[int, int]:
        """FCFS and no-drop policies: drop only what cannot finish even alone; the new head and
        batch size (up to the target under FCFS). ``start`` is now + d_ctrl."""
        dl = self._dl
        head = self._head
        size = len(dl)
        earliest = start + self.d_data_s
        earliest = gpu_free_at if gpu_free_at > earliest else earliest
        threshold = earliest + self._table[1]
        if dl[head] < threshold:
            head = bisect_left(dl, threshold, head, size)
        avail = size - head
        if not avail:
            return head, 0
        max_batch = self._max_batch
        cap = avail if avail < max_batch else max_batch
        if self._drop == DROP_FCFS and self.target < cap:
            cap = self.target
        bs = 1
        if bs < cap:
            bs = self._grow(dl[head], bs, cap, start, gpu_free_at)
        return head, bs

    def _size_rows(self, start: float, gpu_free_at: float) -> tuple[int, int, int]:
        """Both drop policies when requests hold several rows (``_rows``): the new head, and
        the batch ``[head:head + count]`` and its rows. A batch is a prefix of the queue in
        deadline order and never splits a request: one that does not fit the rows left waits,
        with everything behind it, for the next batch. The head stays while a batch of the
        rows it must be able to go with is feasible: ``keep_min`` rows or all that is queued
        if fewer (window drop; the one-row rule's ``min(keep_min, queued)``), 1 for the
        others, and never fewer than the head's own rows, so a head of n rows goes whenever
        n alone fits. Then the batch grows request by request up to ``max_batch`` rows (FCFS:
        the target) while it still finishes by the head's deadline."""
        dl = self._dl
        sizes = self._rows
        assert sizes is not None
        head = self._head
        size = len(dl)
        table = self._table
        d_data = self.d_data_s
        max_batch = self._max_batch
        earliest = start + d_data
        earliest = gpu_free_at if gpu_free_at > earliest else earliest
        threshold = earliest + table[1]
        if dl[head] < threshold:  # what cannot finish even as one row: drop in bulk
            head = bisect_left(dl, threshold, head, size)
        # suffix: as window here (rows make the suffix rule's bisection a scan; not built)
        floor = self.keep_min if self._keeps_target else 1
        while head < size:
            first = sizes[head]
            if first <= max_batch:
                rows = self._rows_up_to(head, floor) if floor > first else first
                earliest = start + d_data * rows
                earliest = gpu_free_at if gpu_free_at > earliest else earliest
                if dl[head] >= earliest + table[rows]:
                    break
            head += 1
        else:
            return head, 0, 0
        cap = max_batch
        if self._drop == DROP_FCFS:
            cap = self.target if self.target < cap else cap
            cap = first if first > cap else cap
        return head, *self._grow_rows(head, 1, first, cap=cap, start=start,
                                      gpu_free_at=gpu_free_at)

    def _rows_up_to(self, head: int, need: int) -> int:
        """``need`` rows (at most ``max_batch``), or fewer when the queue from ``head`` holds
        fewer: the batch size the window rule checks the head with, whatever the requests'
        sizes."""
        sizes = self._rows
        assert sizes is not None
        need = self._max_batch if self._max_batch < need else need
        rows = 0
        stop = head
        size = len(sizes)
        while stop < size and rows < need:
            rows += sizes[stop]
            stop += 1
        return need if rows > need else rows

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
        limit = self._max_batch + 1 - rows
        grow = limit if limit < grow else grow
        return grow if grow > 1 else 1

    def _grow_rows(self, head: int, count: int, rows: int, *, cap: int, start: float,
                   gpu_free_at: float) -> tuple[int, int]:
        """Add whole requests after ``[head:head + count]`` while the batch stays within
        ``cap`` rows and finishes by the head's deadline (feasibility is monotone in rows)."""
        sizes = self._rows
        assert sizes is not None
        deadline = self._dl[head]
        table = self._table
        d_data = self.d_data_s
        stop = head + count
        size = len(sizes)
        while stop < size:
            grown = rows + sizes[stop]
            if grown > cap:
                break
            earliest = start + d_data * grown
            earliest = gpu_free_at if gpu_free_at > earliest else earliest
            if deadline < earliest + table[grown]:
                break
            rows = grown
            stop += 1
        return stop - head, rows

    def _grow(self, deadline: float, bs: int, cap: int, start: float, gpu_free_at: float) -> int:
        """The largest b in [bs, cap] whose batch still finishes by ``deadline`` (feasibility is
        monotone in b). ``start`` is now + d_ctrl."""
        table = self._table
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

    def _advance_head(self, head: int) -> int:
        """Move the queue's head to ``head`` (drops emitted or a batch planned); compact the
        lists once the popped prefix is long and at least half of them. Returns the new head."""
        self._head = head
        if head >= COMPACT_AT and head * 2 >= len(self._dl):
            del self._dl[:head]
            del self._rid[:head]
            del self._fe[:head]
            del self._arr[:head]
            if self._rows is not None:
                del self._rows[:head]
            self._head = head = 0
        return head

    def _aim(self, now: float, gpu_free_at: float, head: int, bs: int, grow: int = 1) -> None:
        """Set the candidate ``[head:head + bs]``: its exec time by the policy's kind, clamped
        into [earliest, latest], and the wake-up at its last grantable moment. ``grow``: the
        rows the next request would add (frontrun: the last moment it could still join,
        ``d - l(bs + grow)``; at most ``max_batch + 1 - bs``, where l is infinite)."""
        deadline = self._dl[head]
        table = self._table
        delay = self.d_ctrl_s + self.d_data_s * bs
        earliest = now + delay
        earliest = gpu_free_at if gpu_free_at > earliest else earliest
        latest = deadline - table[bs]
        kind = self._kind
        deferred = False
        if self._start_now:  # an early grant (the rank's rescue): start at once
            exec_at = earliest
        elif self._rescue:
            exec_at = self._aim_rescue(now, earliest, deadline, bs, grow)
        elif kind == KIND_DEFERRED:  # deferred-bl (policy.py)
            deferred = bs < self._defer_below
            if self._defer_shared:  # sharing GPUs: aim earlier by the learned margin
                exec_at = deadline - self.jitter_s - self.miss_margin_s - table[bs + grow]
            else:  # staggered: the authors' aim
                exec_at = deadline - self.jitter_s - table[bs + grow]
            if not deferred:
                # waiting does not pay (policy.py, deferred): at its batch size
                exec_at = earliest
            elif not self._defer_shared:
                deferred = False  # staggered: a missed window is the stagger at work
        elif kind == KIND_FRONTRUN:
            exec_at = deadline - self.jitter_s - table[bs + grow]
        elif kind == KIND_EAGER:
            exec_at = earliest
        elif kind == KIND_LATEST:
            exec_at = latest - self.jitter_s
        elif kind == KIND_TIMEOUT:
            exec_at = self._arr[head] + self._policy.timeout_fraction * self.slo_s
        else:  # pragma: no cover - parse() admits only the kinds above
            raise AssertionError(kind)
        exec_at = earliest if earliest > exec_at else exec_at
        exec_at = latest if latest < exec_at else exec_at
        self.cand_bs = bs
        self.cand_exec = exec_at
        self.cand_latest = latest
        # deferred: the rank may start it early (its rescue); a staggered model only once its
        # batch reaches beta*lambda - 1, where waiting no longer pays in throughput, a shared
        # model from RESCUE_SHARED_FLOOR of that (policy.py). A shared model's deferring
        # candidate is the one whose window may be lost.
        waits = self._rescue and exec_at > earliest and self._deferring_from(head, earliest)
        self._cand_early_ok = waits and bs >= self._rescue_from
        self._cand_deferred = (waits and self._defer_shared) if self._rescue else deferred
        wake = latest - delay + TIMER_SLACK_S
        self.wake_at = wake if wake > now else now + TIMER_SLACK_S

    def _deferring_from(self, head: int, earliest: float) -> bool:
        """The candidate headed at ``head`` defers: the first time, note when it could have
        started instead (where its wait is measured from: ``DeferralYield``). True."""
        rid = self._rid[head]
        if rid != self._defer_head:
            self._defer_head = rid
            self._defer_from = earliest
        return True

    def _aim_rescue(self, now: float, earliest: float, deadline: float, bs: int,
                    grow: int) -> float:
        """``deferred``: the frontrun moment while deferring pays, else ``earliest``.
        Staggered models defer while below max(beta*lambda, b*) (as ``deferred-bl``); every model
        starts at once when fewer than DEFER_MIN_JOINERS requests are expected before its aim
        (light load: nothing would join). Contention is the rank's: a deferring candidate is
        published ``early_ok`` (set in ``_aim``) and the rank starts it early while the
        cluster is short of GPUs (``RankThread``, rescue)."""
        if bs >= self._defer_below or not self.deferral_yield.pays:
            # past the stagger, or deferral has not been paying (closed-loop clients)
            return earliest
        if self._defer_shared and self.defer_loss > DEFER_LOSS_MAX:
            # its deferred windows are being lost (to other models' batches): waiting costs
            # more heads than it buys joiners, so it starts at once while the estimate is high
            return earliest
        aim = deadline - self.jitter_s - self._table[bs + grow]
        if self._defer_shared and (aim - now) * self._defer_rate < DEFER_MIN_JOINERS:
            return earliest
        return aim

    def _granted_in_window(self) -> None:
        """``deferred``: a grant came for the candidate: a deferred one kept its window (the
        loss estimate falls by DEFER_LOSS_WEIGHT), one started at once lets the estimate decay
        (DEFER_LOSS_DECAY), so a model that stopped deferring tries again (policy.py)."""
        loss = self.defer_loss
        if self._cand_deferred:
            loss -= DEFER_LOSS_WEIGHT * loss
            if loss < DEFER_LOSS_RECENT * DEFER_LOSS_MAX:  # the losses are behind it
                self.defer_backoff = 1
        else:
            loss -= DEFER_LOSS_DECAY / self.defer_backoff * loss
        self.defer_loss = loss

    def _missed_window(self, now: float) -> None:
        """A deferred candidate lost its grant window (policy.py): count it; ``deferred`` raises
        its estimate of lost windows, ``deferred-bl`` aims earlier, up to DEFER_MISS_MAX_S."""
        self._cand_deferred = False  # counted once
        self.n_window_misses += 1
        if self._rescue:
            loss = self.defer_loss
            if loss > DEFER_LOSS_RECENT * DEFER_LOSS_MAX:  # soon after the last loss: back off
                backoff = 2 * self.defer_backoff
                self.defer_backoff = backoff if backoff < DEFER_BACKOFF_MAX else DEFER_BACKOFF_MAX
            self.defer_loss = loss + DEFER_LOSS_WEIGHT * (1.0 - loss)
            return
        margin = self.miss_margin_s + DEFER_MISS_WIDEN_S
        self.miss_margin_s = margin if margin < DEFER_MISS_MAX_S else DEFER_MISS_MAX_S

__all__ = ["COMPACT_AT", "CandidateSizing"]
