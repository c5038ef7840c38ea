"""The frontend core's cancellations: a client's cancel, and a client connection that closed.

``FrontendCancellation`` is the part of ``zserve.frontend.core.FrontendCore`` that takes a
request out before it is answered: one the client cancels (``CancelRequest``; answered
``CANCELLED``), or every request of a connection that closed (forgotten, unanswered). A request
still queued at its shard is noted for that shard's ``CancelQueued``; one a backend fetched is
noted for that backend's ``CancelFetched`` (it drops the request if its batch has not started;
if it has, the outputs come back for a request already answered and are discarded). Both
notices go out at the tick's end (``FrontendCore.end_tick``).

The core owns the request table and the answers (``_answer_error``, ``_finish``); this mixin
declares what it uses of them. Pure, like the core: no sockets, no loop, no clock.
"""

from __future__ import annotations

from zserve.core.errors import ErrorKind
from zserve.core.hosting import Outbox
from zserve.frontend.admission import ModelAdmission
from zserve.frontend.requests import QUEUED, Answers, Pending, RequestTable


class FrontendCancellation:
    """The cancellations of a ``FrontendCore`` (mixed into it; see the module docstring)."""

    # Set by FrontendCore.__init__.
    counters: dict[str, int]
    requests: RequestTable
    models: dict[str, ModelAdmission]
    batched_clients: set[bytes]
    refused_clients: dict[bytes, str]
    _answers: dict[bytes, Answers]
    _cancel_notes: dict[str, tuple[list[int], list[int]]]
    _queued_cancels: list[tuple[list[int], list[str]]]

    # Provided by FrontendCore.
    def _finish(self, p: Pending) -> None:
        raise NotImplementedError

    def _answer_error(self, now: float, p: Pending, kind: ErrorKind, message: str,
                      outbox: Outbox) -> None:
        raise NotImplementedError

    def on_cancel(self, now: float, client: bytes, client_rid: int, outbox: Outbox) -> None:
        """Cancel one request of ``client`` (``client_rid`` < 0: all of them, unanswered)."""
        client_reqs = self.requests.by_client.get(client)
        if not client_reqs:
            return
        if client_rid < 0:  # cancel everything this connection has in flight (client close)
            for rid in list(client_reqs.values()):
                self._cancel(now, rid, False, outbox)
            return
        target = client_reqs.get(client_rid)
        if target is not None:
            self._cancel(now, target, True, outbox)

    def _cancel(self, now: float, rid: int, answer: bool, outbox: Outbox) -> None:
        """Cancel a request that has not started; one that has runs on and is answered."""
        p = self.requests.pending.get(rid)
        if p is None:
            return
        if p.state == QUEUED:
            self.counters["cancelled"] += 1
            self._note_queued_cancel(p)
        else:
            # Fetched: the backend drops it if its batch has not started; if it has, the
            # outputs come back for a request already answered and are discarded.
            self.counters["cancelled_fetched"] += 1
            self._note_cancel(p)
        if answer:
            self._answer_error(now, p, ErrorKind.CANCELLED, "cancelled by the client", outbox)
        else:
            p.client = None
            self._finish(p)

    def client_gone(self, client: bytes) -> None:
        """``client``'s connection closed: forget its requests, unanswered."""
        self.batched_clients.discard(client)
        self.refused_clients.pop(client, None)
        self._answers.pop(client, None)
        client_reqs = self.requests.by_client.get(client)
        if not client_reqs:
            return
        self.counters["client_disconnects"] += 1
        for rid in list(client_reqs.values()):
            p = self.requests.pending.get(rid)
            if p is None:
                continue
            if p.state == QUEUED:
                self.counters["disconnect_cancelled"] += 1
                self._note_queued_cancel(p)
            else:
                self.counters["disconnect_cancelled_fetched"] += 1
                self._note_cancel(p)
            p.client = None
            self._finish(p)
        self.requests.by_client.pop(client, None)

    def _note_queued_cancel(self, p: Pending) -> None:
        """Tell the owning shard, at the tick's end, to take ``p`` out of its queue."""
        ids, models = self._queued_cancels[self.models[p.model].shard]
        ids.append(p.rid)
        models.append(p.model)

    def _note_cancel(self, p: Pending) -> None:
        plans, rids = self._cancel_notes.setdefault(p.backend, ([], []))
        plans.append(p.plan_id)
        rids.append(p.rid)
