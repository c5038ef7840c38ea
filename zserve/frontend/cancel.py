"""The frontend core's cancellation notices: what its shards and backends must hear of requests
taken out before they were answered.

``FrontendCancellation`` is a part of ``zserve.frontend.core.FrontendCore``. The core takes a
request out when its client cancels it (``CancelRequest``) or its client's connection closes,
and tells this part (``cancelled`` / ``abandoned``), which counts it and notes whom to tell: a
request still queued at its model's shard goes into that shard's ``CancelQueued`` (the shard
takes it off its queue); one a backend fetched goes into that backend's ``CancelFetched`` (it
drops the request if its batch has not started; if it has, the outputs come back for a request
already answered and are discarded). At the tick's end the core takes the notes
(``take_queued``, ``take_fetched``) when any is ``owed`` and sends one message per shard and per
backend, after the tick's metadata. Pure, like the core: no sockets, no loop, no clock.
"""

from __future__ import annotations

from typing import NamedTuple

from zserve.frontend.requests import QUEUED, Pending

CANCEL_COUNTERS = ("cancelled", "cancelled_fetched", "disconnect_cancelled",
                   "disconnect_cancelled_fetched")
"""The counters this part bumps: requests cancelled by their client while queued / fetched, and
the same for requests of a connection that closed."""


class QueuedCancels(NamedTuple):
    """One shard's ``CancelQueued``: requests taken out while queued there, with their models."""

    shard: int
    request_ids: list[int]
    models: list[str]


class FetchedCancels(NamedTuple):
    """One backend's ``CancelFetched``: requests taken out after it fetched them, with the plans
    whose fetches took them."""

    backend: str
    plan_ids: list[int]
    request_ids: list[int]


class FrontendCancellation:
    """The cancellation notices one frontend owes, until the tick's end (module docstring)."""

    __slots__ = ("_counters", "_fetched", "_queued", "_scheduled_as", "_shard_of", "owed")

    def __init__(self, *, shard_of: dict[str, int], shards: int,
                 counters: dict[str, int], scheduled_as: dict[str, str] | None = None) -> None:
        """``shard_of``: each configured model's shard (of ``shards``); ``counters``: where
        ``CANCEL_COUNTERS`` are counted (the core's); ``scheduled_as``: a prefix group's model
        -> the group, the model its shard queues the request under."""
        self._shard_of = shard_of
        self._scheduled_as = scheduled_as or {}
        self._counters = counters
        # per shard: (request ids, their models) taken out while still queued there
        self._queued: list[tuple[list[int], list[str]]] = [([], []) for _ in range(shards)]
        # per backend: (plan ids, request ids) taken out after it fetched them
        self._fetched: dict[str, tuple[list[int], list[int]]] = {}
        # Whether any notice is waiting to be taken: the core reads it at every tick's end, and
        # almost every tick has none (a flag, not two calls that build empty lists).
        self.owed = False

    def add_model(self, model: str, shard: int) -> None:
        """A model added after start, owned by ``shard``."""
        self._shard_of[model] = shard

    def cancelled(self, request: Pending) -> None:
        """Its client cancelled ``request`` (a ``CancelRequest``, or all of a connection's)."""
        if request.state == QUEUED:
            self._counters["cancelled"] += 1
            self._note_queued(request)
        else:
            self._counters["cancelled_fetched"] += 1
            self._note_fetched(request)

    def abandoned(self, request: Pending) -> None:
        """``request``'s client connection closed."""
        if request.state == QUEUED:
            self._counters["disconnect_cancelled"] += 1
            self._note_queued(request)
        else:
            self._counters["disconnect_cancelled_fetched"] += 1
            self._note_fetched(request)

    def take_queued(self) -> list[QueuedCancels]:
        """The queued requests taken out since the last call, per shard in shard order."""
        taken = []
        for shard, (ids, models) in enumerate(self._queued):
            if ids:
                self._queued[shard] = ([], [])
                taken.append(QueuedCancels(shard, ids, models))
        self.owed = bool(self._fetched)
        return taken

    def take_fetched(self) -> list[FetchedCancels]:
        """The fetched requests taken out since the last call, per backend."""
        notes, self._fetched = self._fetched, {}
        self.owed = any(ids for ids, _ in self._queued)
        return [FetchedCancels(backend, plans, ids) for backend, (plans, ids) in notes.items()]

    def _note_queued(self, request: Pending) -> None:
        ids, models = self._queued[self._shard_of[request.model]]
        ids.append(request.rid)
        models.append(self._scheduled_as.get(request.model, request.model))
        self.owed = True

    def _note_fetched(self, request: Pending) -> None:
        plans, ids = self._fetched.setdefault(request.backend, ([], []))
        plans.append(request.plan_id)
        ids.append(request.rid)
        self.owed = True
