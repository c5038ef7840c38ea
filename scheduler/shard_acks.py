"""A shard's sent plans: acknowledgements, suspicion, and what happens to a lost backend's plans.

:class:`ShardPlanAcks` is a part of ``zserve.scheduler.shard_host.ShardHost`` (and of the
simulator, which holds each plan as a live shard does): it follows the plans the shard sent
(``SentPlans``), each remembered with the time its acknowledgement is due (the plan's delivery
allowance d_ctrl + ``PLAN_ACK_MARGIN_S``; it comes on a ``BatchStats`` or as a ``PlanAck``). A
plan not acknowledged in time makes the shard suspect its backend: :meth:`ShardPlanAcks.suspect`
tells the rank (``BackendSuspect``). When a backend is suspect or leaves the table,
:meth:`ShardPlanAcks.release` answers the requests of the plans it acknowledged
``BACKEND_FAILED`` (it holds their inputs: they may run) and hands back the plans it never
acknowledged, for the host to put back into their queues
(``zserve.scheduler.core.SchedulerCore.replan``).

Pure, like the cores it serves (``zserve.core.hosting``): ``now`` passed in, messages appended to
an outbox, ``wake_at`` (the earliest acknowledgement due) read back. The host owns the sockets
and the timer, and reads the acknowledgements off them.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

from zserve.core.errors import ErrorKind
from zserve.core.hosting import DEST_FRONTEND, TO_RANK, Outbox
from zserve.core.liveness import stall_credit_s
from zserve.scheduler.sent_plans import SentPlans
from zserve.transport.messages import BackendSuspect, BatchPlan, DropNotice

ACK_COUNTERS = ("plan_acks", "suspects", "backend_failed")
"""What the part counts: acknowledgements that were awaited, suspected backends, and the
requests answered ``BACKEND_FAILED``."""


class ShardPlanAcks:
    """The plans a shard sent and their acknowledgements; see the module docstring.

    ``ack_allowance_s``: how long after it was sent a plan's acknowledgement is due (d_ctrl +
    ``PLAN_ACK_MARGIN_S``); ``counters``: where to count (``ACK_COUNTERS``; a host passes its own
    dict to share them), by default a dict of its own."""

    __slots__ = ("ack_allowance_s", "counters", "sent")

    def __init__(self, ack_allowance_s: float,
                 counters: MutableMapping[str, int] | None = None) -> None:
        self.ack_allowance_s = ack_allowance_s
        self.sent = SentPlans()
        self.counters: MutableMapping[str, int] = counters if counters is not None else {}
        for key in ACK_COUNTERS:
            self.counters.setdefault(key, 0)

    @property
    def wake_at(self) -> float:
        """The earliest acknowledgement due (``math.inf``: none awaited)."""
        return self.sent.wake_at

    def __len__(self) -> int:
        return len(self.sent)

    def remember(self, now: float, gpu_id: int, plan: BatchPlan, slo_s: float) -> None:
        """``plan`` went to ``gpu_id`` at ``now``; its acknowledgement is due within the
        allowance, and it is kept while a request of it may await an answer (``slo_s``)."""
        self.sent.remember(now, gpu_id, plan, slo_s, ack_due=now + self.ack_allowance_s)

    def acknowledge(self, plan_ids: Iterable[int]) -> int:
        """A backend's acknowledgement (``PlanAck.plan_ids`` or ``BatchStats.acked_plan_ids``):
        how many of these plans were awaited."""
        count = self.sent.acknowledge(plan_ids)
        self.counters["plan_acks"] += count
        return count

    def credit_stall(self, now: float) -> float:
        """The shard's own stall, judged at ``now`` against the earliest acknowledgement due
        (its timer's moment): from JUDGE_STALL_MIN_S on, every awaited acknowledgement becomes
        due that much later plus the allowance, so the backends, stalled with the host, get
        the allowance again from the end of the stall (both GPUs were suspected at once, 290
        ms after their plans, at a load average of 15-17). Returns the stall (0: none)."""
        stall = stall_credit_s(now - self.sent.wake_at) if self.sent.unacked else 0.0
        if stall > 0.0:
            self.sent.postpone(stall + self.ack_allowance_s)
        return stall

    def overdue(self, now: float) -> list[tuple[int, int, float]]:
        """``(gpu_id, plan_id, sent_at)`` per GPU with a plan unacknowledged past its due time."""
        return self.sent.overdue(now)

    def suspect(self, now: float, gpu_id: int, plan_id: int, sent_at: float,  # noqa: PLR0917
                address: str, outbox: Outbox) -> str:
        """The backend of ``gpu_id`` (at ``address``) did not acknowledge ``plan_id`` in time:
        the rank is told (it stops granting the GPU and broadcasts the table without it; a
        heartbeat brings it back). Returns why, for the log and the answers; the host then
        takes the GPU out of its ModelThreads and releases its plans, in that order (a plan put
        back must not be granted to that GPU again)."""
        self.counters["suspects"] += 1
        why = (f"GPU {gpu_id} ({address}) did not acknowledge plan {plan_id} within "
               f"{(now - sent_at) * 1e3:.0f} ms")
        # First to the rank: it hears of the suspicion before the candidates the released
        # requests make (and answers with a table, which the shard serves from again).
        outbox.append((TO_RANK, BackendSuspect(gpu_id, plan_id, sent_at, why)))
        return why

    def release(self, now: float, gpu_id: int, why: str, outbox: Outbox) -> list[BatchPlan]:
        """The backend of ``gpu_id`` is gone or suspect: the requests of the plans it
        acknowledged are answered ``BACKEND_FAILED`` (it holds their inputs: they may run);
        the plans it never acknowledged are returned, to be planned again (should it have
        fetched them, within ``ACK_HOLD_S`` of a plan before it stopped, or fetch them after all,
        the frontend hands each request's inputs out once, so one backend at most runs it).
        Requests already answered (the batch ran, or the frontend failed the ones the backend
        fetched) are ignored by their frontend, which answers once."""
        taken = self.sent.take(now, gpu_id)
        for address, ids in taken.acked.items():
            self.counters["backend_failed"] += len(ids)
            outbox.append(((DEST_FRONTEND, address),
                           DropNotice(ids, ErrorKind.BACKEND_FAILED.value, why)))
        return taken.unacked


__all__ = ["ACK_COUNTERS", "ShardPlanAcks"]
