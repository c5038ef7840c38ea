"""zserve.runtime.timers.LazyTimerHeap: deadline order, lazy deletion, compaction."""

from __future__ import annotations

import math

from zserve.core.timer_heap import LazyTimerHeap


def test_due_items_come_in_deadline_then_push_order_and_stale_ones_are_skipped() -> None:
    answered: set[str] = set()
    heap: LazyTimerHeap[str] = LazyTimerHeap(lambda when, item: item not in answered)
    for when, item in ((3.0, "c"), (1.0, "a"), (2.0, "b1"), (2.0, "b2"), (9.0, "z")):
        heap.push(when, item)
    answered.add("b1")
    assert [heap.pop_due(2.5), heap.pop_due(2.5), heap.pop_due(2.5)] == ["a", "b2", None]
    assert heap.next_at() == 3.0
    answered.add("c")
    assert heap.next_at() == 9.0 and len(heap) == 1  # the stale top was dropped
    assert heap.pop_due(math.inf) == "z" and heap.next_at() == math.inf


def test_superseded_entries_are_stale_like_a_frontends_deadline_timers() -> None:
    # the frontend's shape: an entry (at, rid) is live while the request is pending with that
    # deadline; re-arming a request supersedes its old entry without touching the heap
    answer_by = {1: 5.0, 2: 7.0}
    heap: LazyTimerHeap[int] = LazyTimerHeap(lambda at, rid: answer_by.get(rid) == at)
    heap.push(5.0, 1)
    heap.push(7.0, 2)
    answer_by[1] = 8.0
    heap.push(8.0, 1)
    assert heap.pop_due(7.5) == 2 and heap.pop_due(7.5) is None
    del answer_by[2]
    assert heap.pop_due(8.0) == 1


def test_compaction_keeps_only_live_entries() -> None:
    cancelled: set[int] = set()
    heap: LazyTimerHeap[int] = LazyTimerHeap(lambda when, item: item not in cancelled)
    for i in range(100):
        heap.push(float(i), i)
    for i in range(90):
        cancelled.add(i)
        heap.mark_stale()
    heap.compact_if(10, factor=4, minimum=1000)
    assert len(heap) == 100  # below the minimum: untouched
    heap.compact_if(10, factor=4, minimum=50)
    assert len(heap) == 10 and heap.stale == 0
    assert heap.pop_due(math.inf) == 90
    assert sorted(heap.drain()) == list(range(91, 100)) and len(heap) == 0
