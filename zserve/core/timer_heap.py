"""A timer heap with lazy deletion: the deadline-ordered queue under every timer in zserve.

Pure (no clock, no loop): the frontend core's deadline timers and the runtime's precise timers
(``zserve.runtime.timers.PreciseTimers``) both keep their entries in one.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyTimerHeap(Generic[T]):
    """Timers in deadline order, with lazy deletion: a cancelled or superseded entry stays in
    the heap until it reaches the top, where ``is_live(when, item)`` tells it apart and it is
    dropped. Cancelling costs nothing then, which suits timers that are mostly cancelled (most
    requests are answered well before their deadline timer). Ties fire in push order.

    The owner may report entries that went stale (``mark_stale``); ``compact_if`` rebuilds the
    heap from its live entries once stale ones dominate, so it stays proportional to the live
    timers.
    """

    __slots__ = ("_entries", "_is_live", "_seq", "stale")

    def __init__(self, is_live: Callable[[float, T], bool]) -> None:
        self._entries: list[tuple[float, int, T]] = []
        self._is_live = is_live
        self._seq = 0
        self.stale = 0  # entries reported stale and not yet dropped

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, when: float, item: T) -> None:
        self._seq += 1
        heapq.heappush(self._entries, (when, self._seq, item))

    def mark_stale(self) -> None:
        """One entry in the heap is no longer live (counted for ``compact_if``)."""
        self.stale += 1

    def pop_due(self, now: float) -> T | None:
        """The next live item whose time ``<= now`` (removed), or None; stale entries met on
        the way are dropped."""
        entries = self._entries
        is_live = self._is_live
        while entries and entries[0][0] <= now:
            when, _, item = heapq.heappop(entries)
            if is_live(when, item):
                return item
            self._dropped_stale()
        return None

    def next_at(self) -> float:
        """When the earliest live timer is due (``math.inf``: none); stale tops are dropped."""
        entries = self._entries
        while entries:
            when, _, item = entries[0]
            if self._is_live(when, item):
                return when
            heapq.heappop(entries)
            self._dropped_stale()
        return math.inf

    def compact_if(self, live: int, *, factor: float, minimum: int) -> None:
        """Rebuild from the live entries when there are more than ``minimum`` entries and more
        than ``factor`` times ``live`` of them."""
        if len(self._entries) > minimum and len(self._entries) > factor * live:
            is_live = self._is_live
            self._entries = [e for e in self._entries if is_live(e[0], e[2])]
            heapq.heapify(self._entries)
            self.stale = 0

    def drain(self) -> list[T]:
        """Remove every entry; return the items (live or not), in no particular order."""
        items = [e[2] for e in self._entries]
        self._entries.clear()
        self.stale = 0
        return items

    def _dropped_stale(self) -> None:
        if self.stale:
            self.stale -= 1
