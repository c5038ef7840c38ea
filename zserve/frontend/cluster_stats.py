"""The frontend host's cluster stats: one round of ``StatsRequest`` to every peer, for the
clients (``ClusterStatsRequest``) and the metrics endpoint (``cluster_stats``) waiting on it.

``FrontendStats`` is the part of ``zserve.frontend.host.FrontendHost`` that asks every shard, the
rank and every backend it knows for their stats, collects the ``StatsReply``s, and answers each
waiter with the frontend's own stats plus ``cluster`` (the replies) and ``cluster_silent`` (the
peers that did not answer within ``PEER_STATS_TIMEOUT_S``). A request that comes while a round
is open joins it.

The host owns the sockets and the output (``_after``, ``stats``); this mixin declares what it
uses of them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from zserve.core.hosting import Outbox
from zserve.frontend.core import TO_CLIENT, FrontendCore
from zserve.transport.messages import StatsReply, StatsRequest
from zserve.transport.reactor import SocketReactor

# A client's ClusterStatsRequest is answered once every peer has, or after this long
# with what came (the ones that did not are listed under "cluster_silent").
PEER_STATS_TIMEOUT_S = 0.5

# Who waits on a stats round: a client (its identity) or the metrics endpoint (a future).
StatsWaiter = bytes | asyncio.Future[dict[str, Any] | None]


class StatsGathering:
    """One round of StatsRequests to the frontend's peers, for clients waiting on it."""

    __slots__ = ("handle", "replies", "waiters", "waiting")

    def __init__(self, waiting: set[str]) -> None:
        self.waiting = waiting  # peer process names not yet answered
        self.replies: dict[str, Any] = {}
        self.waiters: list[tuple[StatsWaiter, dict[str, Any]]] = []  # (who, frontend's own)
        self.handle: asyncio.TimerHandle | None = None


class FrontendStats:
    """The cluster stats rounds of a ``FrontendHost`` (mixed into it; see the module docstring)."""

    # Set by FrontendHost.__init__ (and its start/bind/connect).
    name: str
    core: FrontendCore
    _gathering: StatsGathering | None
    _rank_embedded: bool
    _closed: bool
    _loop: asyncio.AbstractEventLoop | None
    _reactor: SocketReactor | None
    data_sock: zmq.Socket[Any] | None
    rank_sock: zmq.Socket[Any] | None
    shard_by_name: dict[str, zmq.Socket[Any]]

    # Provided by FrontendHost.
    @property
    def counters(self) -> dict[str, int]:
        raise NotImplementedError

    def stats(self, reset: bool = False) -> dict[str, Any]:
        raise NotImplementedError

    def _after(self, outbox: Outbox) -> None:
        raise NotImplementedError

    async def cluster_stats(self) -> dict[str, Any] | None:
        """What ``ClusterStatsRequest(reset=False)`` answers, asked in-process (the metrics
        endpoint): the same round, resolved as a future. None while the frontend is not serving."""
        if self._loop is None or self._closed:
            return None
        answer: asyncio.Future[dict[str, Any] | None] = self._loop.create_future()
        outbox: Outbox = []
        self._gather_stats(answer, False, outbox)
        self._after(outbox)
        return await answer

    def _gather_stats(self, client: StatsWaiter, reset: bool, outbox: Outbox) -> None:
        """Answer ``client`` with this frontend's stats and, under ``cluster``, those of every
        shard, the rank and every backend it knows, asked now (with ``reset``). A request that
        comes while a round is open joins it (that round's peers reset once, if the first
        asked to)."""
        own = self.stats(reset)
        gathering = self._gathering
        if gathering is None:
            gathering = self._gathering = StatsGathering(self._ask_peers(reset))
            assert self._loop is not None
            gathering.handle = self._loop.call_later(PEER_STATS_TIMEOUT_S,
                                                     self._stats_timed_out)
        gathering.waiters.append((client, own))
        if not gathering.waiting:
            self._stats_gathered(outbox)

    def _ask_peers(self, reset: bool) -> set[str]:
        """Send StatsRequest to every peer; the names of those it reached."""
        assert self._reactor is not None and self.data_sock is not None
        request = StatsRequest(reset=reset)
        asked: set[str] = set()
        for name, sock in self.shard_by_name.items():
            if self._reactor.send_nowait(sock, request) is None:
                asked.add(name)
        if self.rank_sock is not None and not self._rank_embedded and (
                self._reactor.send_nowait(self.rank_sock, request) is None):
            asked.add("rank")
        for name in sorted(self.core.backend_names()):
            # Fails for a backend that never connected, or whose queue is full.
            if self._reactor.send_nowait(self.data_sock, request, name.encode()) is None:
                asked.add(name)
        return asked

    def _on_peer_stats(self, msg: StatsReply, outbox: Outbox) -> None:
        gathering = self._gathering
        if gathering is None or msg.name not in gathering.waiting:
            self.counters["late_peer_stats"] += 1
            return
        gathering.waiting.discard(msg.name)
        gathering.replies[msg.name] = msg.stats
        if not gathering.waiting:
            self._stats_gathered(outbox)

    def _stats_timed_out(self) -> None:
        if self._closed:
            return
        outbox: Outbox = []
        self._stats_gathered(outbox)
        self._after(outbox)

    def _stats_gathered(self, outbox: Outbox) -> None:
        gathering, self._gathering = self._gathering, None
        if gathering is None:
            return
        if gathering.handle is not None:
            gathering.handle.cancel()
        silent = sorted(gathering.waiting)
        for waiter, own in gathering.waiters:
            stats = {**own, "cluster": gathering.replies, "cluster_silent": silent}
            if isinstance(waiter, bytes):
                outbox.append(((TO_CLIENT, waiter), StatsReply(self.name, stats)))
            elif not waiter.done():  # a scrape that gave up has cancelled it
                waiter.set_result(stats)
