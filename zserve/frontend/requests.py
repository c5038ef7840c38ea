"""The frontend's request table: every admitted request, its inputs, and the indexes over it.

A request lives here from admission to its terminal answer. Its inputs are held until the backend
that runs it fetches them (``take_inputs``); the table indexes requests by client connection (for
cancellation and disconnects) and by the backend that fetched them (for backend failures).
"""

from __future__ import annotations

from typing import Any

QUEUED = 0  # inputs held, waiting for a backend to fetch them
FETCHED = 1  # a backend holds the inputs; the request may be running


class Pending:
    """One admitted request, from admission to its terminal answer.

    ``rid``: its id at this frontend, the one the scheduler and the backends know (unique across
    the cluster's frontends and this frontend's restarts, ``zserve.core.request_ids``);
    ``client_rid``: the id its client gave it (unique per connection); ``owner``: the client
    connection's identity it was admitted on, ``client`` the same until the client is gone (then
    None: it is answered to nobody); ``answer_by``: the moment its SLO ends; ``expire_at``: when
    the frontend answers it ``DEADLINE`` if nothing else has (``answer_by``, or for an app's stage
    request the app's own answer-by: a stage answered late still serves its app); ``rows``: its
    batch dimension; ``state``: ``QUEUED`` or ``FETCHED``, with ``backend``, ``fetched_at`` and
    ``plan_id`` once fetched.
    """

    __slots__ = ("answer_by", "arrival", "backend", "client", "client_rid", "expire_at",
                 "fetched_at", "inputs", "model", "owner", "plan_id", "rid", "rows", "state")

    def __init__(self, rid: int, client: bytes, client_rid: int, model: str,  # noqa: PLR0917
                 inputs: dict[str, Any] | None, arrival: float, answer_by: float,
                 rows: int = 1) -> None:
        self.rid = rid
        self.owner = client
        self.client: bytes | None = client
        self.client_rid = client_rid
        self.model = model
        self.inputs = inputs
        self.arrival = arrival
        self.answer_by = self.expire_at = answer_by
        self.rows = rows
        self.state = QUEUED
        self.backend = ""
        self.fetched_at = 0.0
        self.plan_id = 0  # the plan whose fetch took the inputs (CancelFetched names it)


class Answers:
    """The answers to one client produced in one tick: one ``InferAnswers``."""

    __slots__ = ("error_ids", "errors", "messages", "outputs", "request_ids")

    def __init__(self) -> None:
        self.request_ids: list[int] = []
        self.outputs: list[dict[str, Any]] = []
        self.error_ids: list[int] = []
        self.errors: list[str] = []
        self.messages: list[str] = []


class RequestTable:
    """Pending requests by id, by client connection and by the backend that fetched them."""

    def __init__(self) -> None:
        self.pending: dict[int, Pending] = {}
        self.by_client: dict[bytes, dict[int, int]] = {}  # client -> its client_rid -> rid
        self.fetched_by: dict[str, set[int]] = {}  # backend -> rids it fetched and holds

    def add(self, p: Pending) -> None:
        self.pending[p.rid] = p
        self.by_client.setdefault(p.owner, {})[p.client_rid] = p.rid

    def in_flight(self, client: bytes, client_rid: int) -> bool:
        client_reqs = self.by_client.get(client)
        return client_reqs is not None and client_rid in client_reqs

    def take_inputs(self, rid: int, backend: str, plan_id: int,
                    now: float) -> tuple[Pending, dict[str, Any]] | None:
        """Hand request ``rid``'s inputs to ``backend`` (fetching for ``plan_id``), or None
        when it is not waiting for a fetch (answered, fetched already, its client gone)."""
        p = self.pending.get(rid)
        if p is None or p.state != QUEUED or p.inputs is None or p.client is None:
            return None
        inputs, p.inputs = p.inputs, None  # the backend has them now
        p.state = FETCHED
        p.backend = backend
        p.fetched_at = now
        p.plan_id = plan_id
        self.fetched_by.setdefault(backend, set()).add(rid)
        return p, inputs

    def fetched_requests(self, backend: str) -> list[Pending]:
        """The requests ``backend`` fetched and holds; forgets that it holds them."""
        rids = self.fetched_by.pop(backend, set())
        found = (self.pending.get(rid) for rid in rids)
        return [p for p in found if p is not None and p.state == FETCHED and p.backend == backend]

    def remove(self, p: Pending) -> None:
        """Forget a request: release its inputs and every index entry."""
        del self.pending[p.rid]
        p.inputs = None
        if p.state == FETCHED:
            fetched = self.fetched_by.get(p.backend)
            if fetched is not None:
                fetched.discard(p.rid)
        client_reqs = self.by_client.get(p.owner)
        if client_reqs is not None and client_reqs.get(p.client_rid) == p.rid:
            del client_reqs[p.client_rid]
            if not client_reqs:
                del self.by_client[p.owner]

    def fetched_counts(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in self.fetched_by.items() if ids}
