"""The plan acknowledgements a backend holds for a moment, so that they ride its next report.

A backend acknowledges every plan to the shard that sent it (docs/runtime.md, "Liveness"). Sent
alone, each acknowledgement is one more message per batch: a wake-up of the backend's I/O thread
and two of the shard's (its I/O thread, then its loop). Under load a GPU's next plan arrives
while its running batch still has ``d_ctrl`` to go (deferred scheduling sends it only that far
ahead), and that batch's ``BatchStats`` goes to the same shard when it ends; so the host holds
each acknowledgement and puts it on that report (``BatchStats.acked_plan_ids``). An
acknowledgement no report took within ``ACK_HOLD_S`` of the first one held goes alone
(``PlanAck``), far inside the shard's allowance (``d_ctrl`` + ``PLAN_ACK_MARGIN_S``, 250 ms).

:class:`HeldAcks` is the pure bookkeeping (no clock, no sockets): the backend host decides when
to take and where to send.
"""

from __future__ import annotations

__all__ = ["ACK_HOLD_S", "HeldAcks"]

# How long the first held acknowledgement waits for a BatchStats to the same shard before the
# held ones go alone. A plan received by an idle backend rides its own batch's report when that
# comes in time: ResNet50's comes ~18 ms after the plan (3 ms of slack, a batch of 9 runs 15 ms);
# at 20 ms a third of the acknowledgements went alone on a host at load 10-17. 30 ms is 12% of
# the shard's margin (PLAN_ACK_MARGIN_S, 250 ms), which a live backend's acknowledgement keeps.
ACK_HOLD_S = 0.03


class HeldAcks:
    """Plan ids received but not yet acknowledged, by the identity of the shard that sent them,
    with when the first of them was received."""

    def __init__(self) -> None:
        self._held: dict[bytes, list[int]] = {}
        self._received_at: dict[bytes, float] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, shard: bytes, plan_id: int, now: float) -> None:
        """Plan ``plan_id`` from ``shard``, received at ``now``, awaits its acknowledgement."""
        held = self._held.get(shard)
        if held is None:
            self._held[shard] = [plan_id]
            self._received_at[shard] = now
        else:
            held.append(plan_id)

    def take(self, shard: bytes) -> tuple[list[int], float]:
        """The plan ids held for ``shard`` (now no longer held) and when the first came; ([], 0.0)
        when none are."""
        held = self._held.pop(shard, None)
        if held is None:
            return [], 0.0
        return held, self._received_at.pop(shard)

    def take_all(self) -> list[tuple[bytes, list[int], float]]:
        """Every shard's held plan ids, as ``take`` gives them, in the order first held."""
        taken = [(shard, held, self._received_at[shard]) for shard, held in self._held.items()]
        self._held.clear()
        self._received_at.clear()
        return taken
