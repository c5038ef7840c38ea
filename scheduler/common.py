"""Shared vocabulary of the pure scheduling objects: destinations, the outbox, timer slack, and
the cut of a RequestMetaBatch into per-model chunks that every host feeds them.

Hosting contract (ModelThread and RankThread alike):

- Every method takes ``now`` (float seconds on the host's clock: ``time.monotonic()`` live, the
  virtual clock in the simulator) and an ``outbox`` list, and appends ``(destination, message)``
  pairs to it. No method does I/O or reads a clock.
- Timers: each object has a ``wake_at`` attribute (float seconds, ``math.inf`` when it needs no
  timer). After *any* call returns, ``wake_at > now`` holds. The host must call
  ``obj.on_timer(now, outbox)`` at the first moment ``now >= obj.wake_at`` (calling it earlier is a
  harmless no-op; calling it late is allowed and handled, but costs schedule quality). Re-read
  ``wake_at`` after every call: any call may move it earlier or later.
- Messages in an outbox must be delivered in order per destination (the decisions assume FIFO
  between one ModelThread and the RankThread).

Destinations are small tuples: ``TO_RANK``, ``("model", name)``, ``("backend", gpu_id)`` and
``("frontend", frontend_name)``.
"""

from __future__ import annotations

from zserve.transport.messages import Message, RequestMetaBatch

Destination = tuple[str, str | int]
Outbox = list[tuple[Destination, Message]]

TO_RANK: Destination = ("rank", "")
DEST_MODEL = "model"
DEST_BACKEND = "backend"
DEST_FRONTEND = "frontend"

TIMER_SLACK_S = 1e-6
"""A ModelThread re-evaluates its candidate this long *after* the candidate's last grantable
moment (``latest - delay(bs)``), so the re-evaluation sees the candidate as infeasible and moves on
instead of waking again at the same instant."""

FEASIBILITY_EPS_S = 1e-9
"""Float tolerance for "finishes by its deadline" in invariant checks (times are ~1e5 s live)."""


def split_meta_by_model(
    meta: RequestMetaBatch,
) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """Cut a RequestMetaBatch into ``{model: (request_ids, arrivals, deadlines)}``."""
    models = meta.models
    if models and models.count(models[0]) == len(models):
        return {models[0]: (list(meta.request_ids), list(meta.arrivals), list(meta.deadlines))}
    out: dict[str, tuple[list[int], list[float], list[float]]] = {}
    for model, rid, arrival, deadline in zip(
        models, meta.request_ids, meta.arrivals, meta.deadlines, strict=True
    ):
        entry = out.get(model)
        if entry is None:
            entry = out[model] = ([], [], [])
        entry[0].append(rid)
        entry[1].append(arrival)
        entry[2].append(deadline)
    return out
