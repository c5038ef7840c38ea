"""The hosting contract of zserve's pure role cores, and the outbox vocabulary they share.

The scheduler's ModelThread and RankThread, the backends' PlanFollower and the FrontendCore are
pure objects: a process host (or the simulator, on a virtual clock) feeds them events and delivers
what they emit. The contract, the same for all of them:

- Every method takes ``now`` (float seconds on the host's clock: the cluster clock live, the
  virtual clock in the simulator) and an ``outbox`` list, and appends ``(destination, message)``
  pairs to it. No method does I/O or reads a clock.
- Timers: each object has a ``wake_at`` attribute (float seconds, ``math.inf`` when it needs no
  timer). After *any* call returns, ``wake_at > now`` holds. The host must call
  ``obj.on_timer(now, outbox)`` at the first moment ``now >= obj.wake_at`` (calling it earlier is a
  harmless no-op; calling it late is allowed and handled, but costs schedule quality). Re-read
  ``wake_at`` after every call: any call may move it earlier or later.
- Messages in an outbox must be delivered in order per destination (the decisions assume FIFO
  between one sender and one receiver, e.g. a ModelThread and the RankThread).

Destinations are small tuples ``(kind, key)``: ``TO_RANK``, ``(DEST_MODEL, name)``,
``(DEST_BACKEND, gpu_id or name)``, ``(DEST_FRONTEND, frontend_name)``; a core may add kinds of its
own (the FrontendCore's ``("client", identity)``, the PlanFollower's ``("device", gpu_id)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the vocabulary sits below the wire's package; only the types name its messages
    from zserve.transport.messages import Message

Destination = tuple[str, bytes | str | int]
"""``(kind, key)``: where the host delivers a message (see the module docstring)."""
Outbox = list[tuple[Destination, "Message"]]
"""What a core emits during one call, in delivery order per destination."""

DEST_RANK = "rank"
DEST_MODEL = "model"
DEST_BACKEND = "backend"
DEST_FRONTEND = "frontend"
TO_RANK: Destination = (DEST_RANK, "")
"""The one RankThread of a scheduler (it needs no key)."""

__all__ = ["DEST_BACKEND", "DEST_FRONTEND", "DEST_MODEL", "DEST_RANK", "TO_RANK", "Destination",
           "Outbox"]
