"""The plans a shard sent to each GPU, held while their requests may still await an answer.

When a backend leaves the cluster, the frontends fail the requests it had fetched, but only the
shard knows the requests planned onto it and not yet fetched (plans queued for a backend that
died). :class:`SentPlans` keeps each sent plan until no request of it can still be waiting
(``exec_at`` + the model's SLO: every request of a plan arrived before ``exec_at``, and its
frontend's deadline timer fires by arrival + SLO), and hands a departed GPU's plans back as
request ids by frontend. Pure bookkeeping: ``now`` passed in, no I/O.
"""

from __future__ import annotations

from collections import deque

from zserve.groups import group_by_frontend
from zserve.transport.messages import BatchPlan


class SentPlans:
    """Sent plans by GPU, forgotten in send order as they expire."""

    __slots__ = ("_by_gpu", "_expiry")

    def __init__(self) -> None:
        self._by_gpu: dict[int, dict[int, BatchPlan]] = {}
        # (forget_at, gpu_id, plan_id) in send order (forget_at grows with exec_at per model)
        self._expiry: deque[tuple[float, int, int]] = deque()

    def __len__(self) -> int:
        return sum(len(plans) for plans in self._by_gpu.values())

    def remember(self, now: float, gpu_id: int, plan: BatchPlan, slo_s: float) -> None:
        """``plan`` went to ``gpu_id``; keep it until ``plan.exec_at + slo_s``."""
        self.forget_expired(now)
        self._by_gpu.setdefault(gpu_id, {})[plan.plan_id] = plan
        self._expiry.append((plan.exec_at + slo_s, gpu_id, plan.plan_id))

    def forget_expired(self, now: float) -> None:
        """Drop the plans whose requests have all been answered by ``now``."""
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, gpu_id, plan_id = expiry.popleft()
            plans = self._by_gpu.get(gpu_id)
            if plans is not None:
                plans.pop(plan_id, None)

    def take(self, now: float, gpu_id: int) -> dict[str, list[int]]:
        """Remove the unexpired plans of ``gpu_id``; their request ids by frontend address."""
        self.forget_expired(now)
        plans = list(self._by_gpu.pop(gpu_id, {}).values())
        request_ids = [rid for plan in plans for rid in plan.request_ids]
        frontends = [plan.frontends[f] for plan in plans for f in plan.request_frontend]
        return group_by_frontend(request_ids, frontends)


__all__ = ["SentPlans"]
