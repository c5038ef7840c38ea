"""The one drive loop of every host: feed a pure core an event, deliver what it emitted, re-arm
its one timer at its ``wake_at``.

Every role's logic is a pure core (``zserve.core.hosting``): a host calls one of its methods with
the clock's reading and an empty outbox, then must deliver the outbox and call ``on_timer`` once
the clock reaches ``wake_at``. ``CoreDriver`` is that contract, written once for the frontend,
the backend, the scheduler shard and the rank:

- ``driver.run(core.on_something)`` for an event (the method is called as ``method(now,
  outbox)``; bind other arguments with a lambda), ``driver.flush(outbox)`` when the host already
  called the core itself;
- ``deliver(outbox)`` is the host's one way out (sockets, the embedded rank, an OIP answer); it
  empties the outbox, and may call the core again (a send that failed), appending to it;
- ``after(outbox)`` runs once the outbox is empty and before the timer is re-armed; what it
  appends is delivered too, and it runs again until it appends nothing (the frontend's
  end-of-tick answers and its idleness live there).

The timer is precise by default (``zserve.runtime.timers.WakeTimer``: a timerfd, woken a few tens
of microseconds after ``wake_at`` and never before): the scheduler's grant windows are about one
millisecond wide. A core whose deadlines tolerate the loop's millisecond ticks (the frontend's
deadline timers, coalesced anyway) passes ``precise=False`` and costs the loop one timer handle.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Protocol

from zserve.core.hosting import Outbox
from zserve.runtime.clock import ClusterClock
from zserve.runtime.timers import WakeTimer


class Core(Protocol):
    """What a host needs of any pure core: its next moment and what to do then."""

    @property
    def wake_at(self) -> float:
        """Cluster-clock seconds of the next ``on_timer`` call; ``math.inf``: none needed."""
        ...

    def on_timer(self, now: float, outbox: Outbox) -> None:
        """Whatever was due at ``wake_at``; a call before it is a harmless no-op."""
        ...


Event = Callable[[float, Outbox], None]


class CoreDriver:
    """Runs events into one core, delivers its outbox and keeps its one timer (module docstring)."""

    __slots__ = (
        "_after",
        "_clock",
        "_closed",
        "_deliver",
        "_loop",
        "_loop_at",
        "_loop_handle",
        "_precise",
        "core",
    )

    def __init__(self, core: Core, *, loop: asyncio.AbstractEventLoop, clock: ClusterClock,
                 deliver: Callable[[Outbox], None], after: Callable[[Outbox], None] | None = None,
                 precise: bool = True) -> None:
        self.core = core
        self._loop = loop
        self._clock = clock
        self._deliver = deliver
        self._after = after
        self._precise: WakeTimer | None = (
            WakeTimer(loop, core, self._on_timer, clock) if precise else None)
        self._loop_handle: asyncio.TimerHandle | None = None
        self._loop_at = math.inf
        self._closed = False

    def run(self, event: Event) -> None:
        """Call ``event(now, outbox)`` on the core's clock, then deliver and re-arm."""
        outbox: Outbox = []
        event(self._clock.now(), outbox)
        self.flush(outbox)

    def flush(self, outbox: Outbox) -> None:
        """Deliver ``outbox`` (``deliver`` empties it; what it appends goes out too), run
        ``after`` until it appends nothing, re-arm the timer at the core's ``wake_at``."""
        if self._closed:
            outbox.clear()
            return
        while True:
            while outbox:
                self._deliver(outbox)
            if self._after is None:
                break
            self._after(outbox)
            if not outbox:
                break
        self._rearm()

    def close(self) -> None:
        """No more timer calls; later events deliver nothing."""
        self._closed = True
        if self._precise is not None:
            self._precise.cancel()
        if self._loop_handle is not None:
            self._loop_handle.cancel()
            self._loop_handle = None

    def _rearm(self) -> None:
        if self._precise is not None:
            self._precise.sync()
            return
        wake_at = self.core.wake_at
        if wake_at == self._loop_at:
            return
        if self._loop_handle is not None:
            self._loop_handle.cancel()
            self._loop_handle = None
        self._loop_at = wake_at
        if wake_at < math.inf:
            # A delay on the loop's own clock: the cluster time needs no conversion.
            delay_s = max(0.0, wake_at - self._clock.now())
            self._loop_handle = self._loop.call_later(delay_s, self._on_loop_timer)

    def _on_loop_timer(self) -> None:
        self._loop_handle = None
        self._loop_at = math.inf
        self._on_timer()

    def _on_timer(self) -> None:
        if not self._closed:
            self.run(self.core.on_timer)


__all__ = ["Core", "CoreDriver", "Event"]
