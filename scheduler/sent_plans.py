"""The plans a shard sent to each GPU, held while their requests may still await an answer, and
whether each backend acknowledged them.

When a backend leaves the cluster, the frontends fail the requests it had fetched, but only the
shard knows the requests planned onto it and not yet fetched (plans queued for a backend that
died). :class:`SentPlans` keeps each sent plan until no request of it can still be waiting
(``exec_at`` + the model's SLO: every request of a plan arrived before ``exec_at``, and its
frontend's deadline timer fires by arrival + SLO), and hands a departed GPU's plans back.

Acknowledgement: a backend acknowledges every plan from the loop that runs its batches, on its
next ``BatchStats`` to the shard or alone (``PlanAck``) within ``ACK_HOLD_S`` (30 ms). A plan not
acknowledged by its ``ack_due`` (sent + d_ctrl + ``PLAN_ACK_MARGIN_S``) says that the backend is
stopped or wedged: :meth:`SentPlans.overdue` names its GPU, and :meth:`SentPlans.take` splits that
GPU's plans into those it never acknowledged (planned again; the frontend hands each request's
inputs out once, so one it fetched before it stopped runs nowhere else) and those it did (it
holds their inputs: they may run whenever it resumes). Pure bookkeeping: ``now`` passed in,
``wake_at`` read back (the earliest ``ack_due`` still unacknowledged), no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from zserve.core.groups import group_by_frontend
from zserve.transport.messages import BatchPlan

# How long past its delivery allowance (d_ctrl) a plan may go unacknowledged before its backend
# is suspect. The acknowledgement needs the plan's hop, one hop back, the backend's loop to run
# once, and the backend's hold for a report to ride (at most ACK_HOLD_S, 30 ms). An idle host
# takes a process off its CPU for up to 26 ms (docs/performance.md, "Host stalls"), but a
# shared 2-vCPU host at a load average of 10-15 (this one, running test suites side by side)
# kept live backends from acknowledging within 100 ms now and then, and a false suspicion fails
# the requests the backend holds. 250 ms keeps that away while a hung backend is
# out 8x sooner than by the heartbeat timeout (2 s); a re-planned request loses at most this much
# of its budget.
PLAN_ACK_MARGIN_S = 0.25


@dataclass(slots=True)
class TakenPlans:
    """A departed or suspect GPU's plans: ``unacked`` (never acknowledged: planned again) and the
    request ids of the acknowledged ones by frontend address (their backend holds the inputs)."""

    unacked: list[BatchPlan] = field(default_factory=list)
    acked: dict[str, list[int]] = field(default_factory=dict)


class SentPlans:
    """Sent plans by GPU, forgotten in send order as they expire; unacknowledged ones by due
    time."""

    __slots__ = ("_by_gpu", "_due", "_expiry", "_unacked", "wake_at")

    def __init__(self) -> None:
        self._by_gpu: dict[int, dict[int, BatchPlan]] = {}
        # (forget_at, gpu_id, plan_id) in send order (forget_at grows with exec_at per model)
        self._expiry: deque[tuple[float, int, int]] = deque()
        # plan_id -> (gpu_id, sent_at, ack_due) while unacknowledged; (ack_due, plan_id), lazily
        # pruned
        self._unacked: dict[int, tuple[int, float, float]] = {}
        self._due: list[tuple[float, int]] = []
        self.wake_at = math.inf

    def __len__(self) -> int:
        return sum(len(plans) for plans in self._by_gpu.values())

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def remember(self, now: float, gpu_id: int, plan: BatchPlan, slo_s: float,
                 ack_due: float = math.inf) -> None:
        """``plan`` went to ``gpu_id``; keep it until ``plan.exec_at + slo_s``. With a finite
        ``ack_due`` it awaits a ``PlanAck``; while it does, it is kept until
        ``PLAN_ACK_MARGIN_S`` past that at least (a short SLO must not hide a hung backend)."""
        self.forget_expired(now)
        self._by_gpu.setdefault(gpu_id, {})[plan.plan_id] = plan
        self._expiry.append((plan.exec_at + slo_s, gpu_id, plan.plan_id))
        if ack_due < math.inf:
            self._unacked[plan.plan_id] = (gpu_id, now, ack_due)
            heapq.heappush(self._due, (ack_due, plan.plan_id))
            self.wake_at = min(self.wake_at, ack_due)

    def acknowledge(self, plan_ids: Iterable[int]) -> int:
        """The backend received these plans; how many were awaited (a late or repeated
        acknowledgement, or one for a plan already taken back, counts nothing)."""
        unacked = self._unacked
        count = 0
        for plan_id in plan_ids:
            if unacked.pop(plan_id, None) is not None:
                count += 1
        if count:
            self._prune_due()
        return count

    def overdue(self, now: float) -> list[tuple[int, int, float]]:
        """``(gpu_id, plan_id, sent_at)`` for each GPU with a plan unacknowledged past its due
        time at ``now`` (its earliest such plan). They stay until :meth:`take`."""
        found: dict[int, tuple[int, int, float]] = {}
        for due, plan_id in sorted(self._due):
            if due > now:
                break
            entry = self._unacked.get(plan_id)
            if entry is not None and entry[0] not in found:
                found[entry[0]] = (entry[0], plan_id, entry[1])
        return list(found.values())

    def postpone(self, by_s: float) -> None:
        """Every awaited acknowledgement becomes due ``by_s`` later (the judge's own stall,
        ``zserve.core.liveness.stall_credit_s``)."""
        self._unacked = {plan_id: (gpu_id, sent_at, due + by_s)
                         for plan_id, (gpu_id, sent_at, due) in self._unacked.items()}
        self._due = [(due + by_s, plan_id) for due, plan_id in self._due]  # order kept
        self._prune_due()

    def forget_expired(self, now: float) -> None:
        """Drop the plans whose requests have all been answered by ``now``."""
        expiry = self._expiry
        pruned = False
        while expiry and expiry[0][0] <= now:
            _, gpu_id, plan_id = expiry.popleft()
            awaited = self._unacked.get(plan_id)
            if awaited is not None:
                judge_by = awaited[2] + PLAN_ACK_MARGIN_S
                if judge_by > now:  # still awaited: kept until its host has judged it
                    expiry.append((judge_by, gpu_id, plan_id))
                    continue
                del self._unacked[plan_id]
                pruned = True
            plans = self._by_gpu.get(gpu_id)
            if plans is not None:
                plans.pop(plan_id, None)
        if pruned:
            self._prune_due()

    def take(self, now: float, gpu_id: int) -> TakenPlans:
        """Remove the unexpired plans of ``gpu_id``: the unacknowledged plans, and the request
        ids of the acknowledged ones by frontend address."""
        self.forget_expired(now)
        taken = TakenPlans()
        acked: list[BatchPlan] = []
        for plan in self._by_gpu.pop(gpu_id, {}).values():
            if self._unacked.pop(plan.plan_id, None) is not None:
                taken.unacked.append(plan)
            else:
                acked.append(plan)
        self._prune_due()
        request_ids = [rid for plan in acked for rid in plan.request_ids]
        frontends = [plan.frontends[f] for plan in acked for f in plan.request_frontend]
        taken.acked = group_by_frontend(request_ids, frontends)
        return taken

    def _prune_due(self) -> None:
        """Pop acknowledged or taken plans off the due heap's top; ``wake_at`` is the rest's
        earliest due time."""
        due = self._due
        unacked = self._unacked
        while due and due[0][1] not in unacked:
            heapq.heappop(due)
        if not unacked:
            due.clear()
        self.wake_at = due[0][0] if due else math.inf


__all__ = ["PLAN_ACK_MARGIN_S", "SentPlans", "TakenPlans"]
