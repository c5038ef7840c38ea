"""The backend's liveness and drain: when a batch is wedged, the heartbeats to the rank, and the
drain at shutdown.

``BackendLiveness`` is a part of the backend host (``zserve.backends.host.BackendHost``), built
by it around the host's ``PlanFollower``. It says whether the backend is alive: the host
heartbeats to every scheduler process every ``HEARTBEAT_INTERVAL_S`` (carrying the newest epoch
seen) with what ``heartbeat(now)`` returns, which is nothing while a batch is wedged (running
``WEDGED_FACTOR`` x its planned duration, at least ``WEDGED_MIN_S``), so the rank takes a wedged
backend out; the host also stops acknowledging plans then (``wedged``). ``drain`` refuses new
plans, runs the held plans that can start within the grace period, answers the others
SHUTTING_DOWN and waits (bounded) for the running batch: it learns that the follower went idle
from ``note_delivered``, which the host calls after every delivery of the follower's outbox.

Its interface to the host: the follower (read: the running batch, idle; called through the
host's ``run``, ``zserve.runtime.driver.CoreDriver.run``), the clock, the epoch fence (read:
``highest``) and ``send_beat`` (the heartbeat to every scheduler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable

from zserve.backends.follower import PlanFollower
from zserve.core.epochs import EpochFence
from zserve.core.hosting import Outbox
from zserve.core.liveness import HEARTBEAT_INTERVAL_S
from zserve.runtime.clock import ClusterClock
from zserve.runtime.driver import Event
from zserve.transport.messages import Heartbeat

log = logging.getLogger(__name__)

# A batch running longer than max(WEDGED_MIN_S, WEDGED_FACTOR x its planned duration) is wedged.
WEDGED_FACTOR = 10.0
WEDGED_MIN_S = 2.0


class BackendLiveness:
    """The heartbeats, the wedged rule and the drain of one backend (see the module docstring)."""

    def __init__(self, name: str, follower: PlanFollower, clock: ClusterClock, fence: EpochFence,
                 *, run: Callable[[Event], None], send_beat: Callable[[Heartbeat], None]) -> None:
        self.name = name
        self.follower = follower
        self.clock = clock
        self.fence = fence
        self._run = run
        self._send_beat = send_beat
        self._heartbeat_seq = 0
        self._wedge_logged = False  # the running batch's wedge was logged (once per wedge)
        self._idle = asyncio.Event()  # set while the follower holds no plan
        self._idle.set()

    def wedged(self, now: float) -> bool:
        """True while the running batch has overrun its planned duration many times over."""
        held = self.follower.running
        if held is None:
            return False
        return now - held.started_at > max(WEDGED_MIN_S, WEDGED_FACTOR * held.planned_s)

    def heartbeat(self, now: float) -> Heartbeat | None:
        """The heartbeat to send to every scheduler at ``now`` (a standby learns this backend, a
        superseded one hears the newest epoch and steps down); None while a batch is wedged
        (logged once per wedge)."""
        if self.wedged(now):
            if not self._wedge_logged:
                self._wedge_logged = True
                running = self.follower.running
                log.error("%s: batch %d is wedged; heartbeats to the rank stop", self.name,
                          running.plan.plan_id if running else -1)
            return None
        self._wedge_logged = False
        self._heartbeat_seq += 1
        return Heartbeat(self.name, self._heartbeat_seq, now, self.fence.highest)

    async def heartbeat_loop(self) -> None:
        """Send ``heartbeat(now)`` every ``HEARTBEAT_INTERVAL_S`` until cancelled."""
        while True:
            beat = self.heartbeat(self.clock.now())
            if beat is not None:
                self._send_beat(beat)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def note_delivered(self, outbox: Outbox) -> None:
        """After every delivery of the follower's outbox (``CoreDriver``'s ``after``): whether
        it is idle now. Appends nothing."""
        if self.follower.idle:
            self._idle.set()
        else:
            self._idle.clear()

    async def drain(self, drain_s: float) -> None:
        """Refuse new plans; run the held plans that can start within ``drain_s``; answer the
        others SHUTTING_DOWN; wait (bounded) for the running batch."""
        follower = self.follower
        self._run(lambda now, outbox: follower.drain(now, now + drain_s, outbox))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=drain_s)
        self._run(lambda now, outbox: follower.drain(now, -math.inf, outbox))
        running = follower.running
        if running is not None:
            grace = max(0.0, running.plan.expected_finish_at - self.clock.now()) + WEDGED_MIN_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=grace)


__all__ = ["HEARTBEAT_INTERVAL_S", "WEDGED_FACTOR", "WEDGED_MIN_S", "BackendLiveness"]
