"""``HeldAcks``: a backend's held plan acknowledgements are kept by shard, in order, with when the
first came, and each is taken exactly once (by a report to its shard or by the flush)."""

from __future__ import annotations

from zserve.backends.held_acks import ACK_HOLD_S, HeldAcks
from zserve.scheduler.sent_plans import PLAN_ACK_MARGIN_S


def test_a_shards_acks_are_taken_once_in_order_with_the_first_receipt() -> None:
    held = HeldAcks()
    assert not held
    held.hold(b"shard-0", 4, 1.0)
    held.hold(b"shard-1", 9, 1.001)
    held.hold(b"shard-0", 5, 1.002)
    assert held
    assert held.take(b"shard-0") == ([4, 5], 1.0)
    assert held.take(b"shard-0") == ([], 0.0)  # taken once
    assert held  # shard-1's is still held
    assert held.take_all() == [(b"shard-1", [9], 1.001)]
    assert not held and held.take_all() == []


def test_take_all_gives_every_shard_in_the_order_first_held() -> None:
    held = HeldAcks()
    held.hold(b"b", 1, 2.0)
    held.hold(b"a", 2, 2.5)
    held.hold(b"b", 3, 3.0)
    assert held.take_all() == [(b"b", [1, 3], 2.0), (b"a", [2], 2.5)]
    held.hold(b"a", 7, 4.0)  # held again after a flush: a fresh first receipt
    assert held.take(b"a") == ([7], 4.0)


def test_the_hold_is_a_small_part_of_the_shards_margin() -> None:
    # A held acknowledgement must still reach the shard well inside d_ctrl + the margin: a live
    # backend keeps at least 4/5 of the margin for a stall.
    assert 0.0 < ACK_HOLD_S <= PLAN_ACK_MARGIN_S / 5
