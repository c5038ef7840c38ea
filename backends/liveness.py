"""The backend host's liveness and drain: when a batch is wedged, the heartbeats to the rank,
and the drain at shutdown.

``BackendLiveness`` is the part of ``zserve.backends.host.Backend`` that says whether the
backend is alive: it heartbeats to every scheduler process every ``HEARTBEAT_INTERVAL_S``
(carrying the newest epoch seen), except while a batch is wedged (running ``WEDGED_FACTOR`` x its
planned duration, at least ``WEDGED_MIN_S``), so the rank takes a wedged backend out. ``drain``
refuses new plans, runs the held plans that can start within the grace period, answers the
others SHUTTING_DOWN and waits (bounded) for the running batch.

The host owns the sockets, the follower and the output (``_send``, ``_deliver``,
``counter_totals``); this mixin declares what it uses of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import zmq

from zserve.backends.follower import PlanFollower
from zserve.core.epochs import EpochFence
from zserve.core.hosting import Outbox
from zserve.runtime import control_link
from zserve.runtime.clock import ClusterClock
from zserve.transport.messages import Heartbeat, Message

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = control_link.HEARTBEAT_INTERVAL_S
# A batch running longer than max(WEDGED_MIN_S, WEDGED_FACTOR x its planned duration) is wedged.
WEDGED_FACTOR = 10.0
WEDGED_MIN_S = 2.0


class BackendLiveness:
    """The heartbeats and drain of a ``Backend`` (mixed into it; see the module docstring)."""

    # Set by Backend.__init__.
    name: str
    clock: ClusterClock
    follower: PlanFollower
    fence: EpochFence
    rank_socks: dict[str, zmq.Socket[Any]]
    _idle: asyncio.Event
    _hb_seq: int
    _wedged_logged: bool

    # Provided by Backend.
    def _send(self, sock: zmq.Socket[Any], msg: Message, identity: bytes | None = None) -> bool:
        raise NotImplementedError

    def _deliver(self, outbox: Outbox) -> None:
        raise NotImplementedError

    def counter_totals(self) -> dict[str, int]:
        raise NotImplementedError

    def wedged(self, now: float) -> bool:
        """True while the running batch has overrun its planned duration many times over."""
        held = self.follower.running
        if held is None:
            return False
        started_at: float = held.started_at
        planned_s: float = held.planned_s
        return now - started_at > max(WEDGED_MIN_S, WEDGED_FACTOR * planned_s)

    async def _rank_heartbeat_loop(self) -> None:
        while True:
            now = self.clock.now()
            if self.wedged(now):
                if not self._wedged_logged:
                    self._wedged_logged = True
                    running = self.follower.running
                    log.error("%s: batch %d is wedged; heartbeats to the rank stop", self.name,
                              running.plan.plan_id if running else -1)
            else:
                # To every scheduler: a standby learns this backend, and a superseded one
                # hears the newest epoch and steps down.
                self._wedged_logged = False
                self._hb_seq += 1
                beat = Heartbeat(self.name, self._hb_seq, now, self.fence.highest)
                for sock in self.rank_socks.values():
                    self._send(sock, beat)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def drain(self, drain_s: float) -> None:
        """Refuse new plans; run the held plans that can start within ``drain_s``; answer the
        others SHUTTING_DOWN; wait (bounded) for the running batch."""
        outbox: Outbox = []
        now = self.clock.now()
        self.follower.drain(now, now + drain_s, outbox)
        self._deliver(outbox)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=drain_s)
        self.follower.drain(self.clock.now(), -float("inf"), outbox)
        self._deliver(outbox)
        running = self.follower.running
        if running is not None:
            grace = max(0.0, running.plan.expected_finish_at - self.clock.now()) + WEDGED_MIN_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=grace)
        log.info("%s: drained; counters since start %s", self.name, self.counter_totals())
