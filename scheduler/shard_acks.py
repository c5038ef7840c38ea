"""A shard's sent plans: acknowledgements, suspicion, and what happens to a lost backend's plans.

``ShardPlanAcks`` is the part of ``zserve.scheduler.shard_host.ShardHost`` that follows the plans it
sent (``SentPlans``): each is remembered with the time its ``PlanAck`` is due (d_ctrl +
``PLAN_ACK_MARGIN_S``); the backends' acknowledgements come in on the plan DEALERs; a plan not
acknowledged in time makes the shard suspect its backend (``BackendSuspect`` to the rank, the GPU
out of the ModelThreads). When a backend is suspect or leaves the table, the requests of the
plans it never acknowledged go back to their ModelThreads (``replanned``) and those of the plans
it acknowledged are answered ``BACKEND_FAILED``.

The host owns the sockets, the ModelThreads and the output (``_flush``, ``_drop_now``); this
mixin declares what it uses of them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq

from zserve.config.cluster import ModelConfig
from zserve.core.errors import ErrorKind
from zserve.core.groups import group_by_frontend
from zserve.core.hosting import TO_RANK, Outbox
from zserve.runtime.clock import ClusterClock
from zserve.runtime.timers import WakeTimer
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.sent_plans import SentPlans
from zserve.transport.messages import BackendSuspect, BatchPlan, Hello, PlanAck
from zserve.transport.reactor import Chunk, SocketReactor

log = logging.getLogger(__name__)


class ShardPlanAcks:
    """The sent plans of a ``ShardHost`` (mixed into it; see the module docstring)."""

    # Set by ShardHost.__init__.
    name: str
    clock: ClusterClock
    loop: asyncio.AbstractEventLoop
    reactor: SocketReactor
    counters: dict[str, int]
    models: dict[str, ModelConfig]
    threads: dict[str, ModelThread]
    served: dict[str, list[int]]
    backend_socks: dict[int, tuple[str, zmq.Socket[Any]]]
    ack_allowance_s: float
    _sent_plans: SentPlans
    _ack_timer: WakeTimer
    _dirty: set[str]

    # Provided by ShardHost.
    def _flush(self, outbox: Outbox) -> None:
        raise NotImplementedError

    def _drop_now(self, address: str, ids: list[int], kind: ErrorKind, why: str) -> None:
        raise NotImplementedError

    def _remember_sent(self, gpu_id: int, plan: BatchPlan) -> None:
        model = self.models.get(plan.model)
        slo_s = model.slo_ms / 1e3 if model is not None else 0.0
        now = self.clock.now()
        self._sent_plans.remember(now, gpu_id, plan, slo_s, ack_due=now + self.ack_allowance_s)
        self._ack_timer.sync()

    def _release_plans(self, now: float, gpu_id: int, why: str, outbox: Outbox) -> None:
        """The backend of ``gpu_id`` is gone or suspect: the requests of the plans it never
        acknowledged go back to their ModelThreads (it never asked for their inputs, so they
        have not run; should it fetch them after all, the frontend hands each request's inputs
        out once, so one backend at most runs it); those of the plans it acknowledged are
        answered ``BACKEND_FAILED`` (it holds their inputs: they may run). Requests already
        answered (the batch ran, or the frontend failed the ones the backend fetched) are
        ignored by their frontend, which answers once."""
        taken = self._sent_plans.take(now, gpu_id)
        for plan in taken.unacked:
            self._replan(now, plan, why, outbox)
        for address, ids in taken.acked.items():
            self.counters["backend_failed"] += len(ids)
            self._drop_now(address, ids, ErrorKind.BACKEND_FAILED, why)

    def _replan(self, now: float, plan: BatchPlan, why: str, outbox: Outbox) -> None:
        """Put an unacknowledged plan's requests back into its ModelThread's queue, which
        batches them again or drops them (DEADLINE) as any queued request; with no live backend
        for the model they are answered UNAVAILABLE (they never ran)."""
        thread = self.threads.get(plan.model)
        positions_by_frontend = group_by_frontend(range(len(plan.request_ids)),
                                                  plan.request_frontend)
        for f, positions in positions_by_frontend.items():
            ids = [plan.request_ids[i] for i in positions]
            address = plan.frontends[f]
            if (thread is None or not self.served.get(plan.model)
                    or len(plan.finish_by) != len(plan.request_ids)):
                self.counters["unavailable"] += len(ids)
                self._drop_now(address, ids, ErrorKind.UNAVAILABLE,
                               f"{why}; no live backend serves {plan.model!r}")
                continue
            self.counters["replanned"] += len(ids)
            rows = [plan.rows[i] for i in positions] if plan.rows else []
            thread.on_replan(now, address, ids, [plan.finish_by[i] for i in positions], outbox,
                             rows)
            self._dirty.add(plan.model)

    # ------------------------------------------------------------------ acknowledgements

    def _on_backend_chunk(self, gpu_id: int, chunk: Chunk) -> None:
        """Acknowledgements from the backend of ``gpu_id``."""
        for _, msg in chunk:
            if type(msg) is PlanAck:
                assert isinstance(msg, PlanAck)
                self.counters["plan_acks"] += self._sent_plans.acknowledge(msg.plan_ids)
            elif type(msg) is not Hello:
                log.warning("%s: unexpected %s from GPU %d", self.name, type(msg).__name__,
                            gpu_id)
        self._ack_timer.sync()

    def _on_ack_timer(self) -> None:
        """A plan's acknowledgement is due. Read what the backends sent before judging: after a
        stall of this process the timer and an acknowledgement that came meanwhile are ready
        together, and the timer may run first."""
        for gpu_id, _, _ in self._sent_plans.overdue(self.clock.now()):
            entry = self.backend_socks.get(gpu_id)
            if entry is not None:
                self.reactor.kick(entry[1])
        self.loop.call_soon(self._judge_acks)

    def _judge_acks(self) -> None:
        now = self.clock.now()
        outbox: Outbox = []
        for gpu_id, plan_id, sent_at in self._sent_plans.overdue(now):
            self._suspect(now, gpu_id, plan_id, sent_at, outbox)
        self._flush(outbox)
        self._ack_timer.sync()

    def _suspect(self, now: float, gpu_id: int, plan_id: int, sent_at: float,
                 outbox: Outbox) -> None:
        """The backend of ``gpu_id`` did not acknowledge ``plan_id`` in time: no more grants
        for it here, its plans released, and the rank told (it broadcasts the table without
        it; a heartbeat brings it back)."""
        self.counters["suspects"] += 1
        address = self.backend_socks[gpu_id][0] if gpu_id in self.backend_socks else "?"
        why = (f"GPU {gpu_id} ({address}) did not acknowledge plan {plan_id} within "
               f"{(now - sent_at) * 1e3:.0f} ms")
        log.warning("%s: %s: suspect", self.name, why)
        # First to the rank: it hears of the suspicion before the candidates the released
        # requests make (and answers with a table, which this shard serves from again).
        outbox.append((TO_RANK, BackendSuspect(gpu_id, plan_id, sent_at, why)))
        self.served = {m: [g for g in gpus if g != gpu_id] for m, gpus in self.served.items()}
        for name, thread in self.threads.items():
            thread.set_gpus(now, self.served.get(name, []), outbox)
        self._release_plans(now, gpu_id, why, outbox)
