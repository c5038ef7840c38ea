"""The frontend host's cluster stats: one round of ``StatsRequest`` to every peer, for the
clients (``ClusterStatsRequest``) and the metrics endpoint (``ask``) waiting on it.

``ClusterStatsRounds`` is a part of ``zserve.frontend.host.FrontendHost``. A round asks every
shard, the rank and every backend the frontend knows for their stats (``ask_peers``, the host's
sockets), collects the ``StatsReply``s, and answers each waiter with the frontend's own stats
(``own_stats``) plus ``cluster`` (the replies) and ``cluster_silent`` (the peers that did not
answer within ``PEER_STATS_TIMEOUT_S``). A request that comes while a round is open joins it.
Answers to clients go into the outbox it is handed; what it sends on its own (a round that
timed out) goes out through ``flush``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from zserve.core.hosting import Outbox
from zserve.frontend.core import TO_CLIENT
from zserve.transport.messages import StatsReply

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
        self.handle: asyncio.TimerHandle | None = None  # the round's timeout


class ClusterStatsRounds:
    """The cluster stats rounds of one frontend host (see the module docstring)."""

    __slots__ = ("_ask_peers", "_counters", "_flush", "_loop", "_name", "_own_stats", "_round",
                 "_serving")

    def __init__(self, *, name: str, loop: asyncio.AbstractEventLoop,
                 own_stats: Callable[[bool], dict[str, Any]],
                 ask_peers: Callable[[bool], set[str]], flush: Callable[[Outbox], None],
                 counters: dict[str, int]) -> None:
        """``own_stats(reset)``: the frontend's stats; ``ask_peers(reset)``: send every peer a
        ``StatsRequest``, the names of those it reached; ``flush``: send an outbox (the host's
        driver); ``counters``: where ``late_peer_stats`` is counted."""
        self._name = name
        self._loop = loop
        self._own_stats = own_stats
        self._ask_peers = ask_peers
        self._flush = flush
        self._counters = counters
        self._round: StatsGathering | None = None
        self._serving = False

    def open(self) -> None:
        """The frontend serves: rounds may start."""
        self._serving = True

    def close(self, outbox: Outbox) -> None:
        """The frontend stops: an open round answers with what came; no round starts again."""
        self._answer(outbox)
        self._serving = False

    async def ask(self) -> dict[str, Any] | None:
        """What ``ClusterStatsRequest(reset=False)`` answers, asked in-process (the metrics
        endpoint): the same round, resolved as a future. None while the frontend is not serving."""
        if not self._serving:
            return None
        answer: asyncio.Future[dict[str, Any] | None] = self._loop.create_future()
        outbox: Outbox = []
        self.gather(answer, False, outbox)
        self._flush(outbox)
        return await answer

    def gather(self, waiter: StatsWaiter, reset: bool, outbox: Outbox) -> None:
        """Answer ``waiter`` with this frontend's stats and, under ``cluster``, those of every
        shard, the rank and every backend it knows, asked now (with ``reset``). A request that
        comes while a round is open joins it (that round's peers reset once, if the first
        asked to)."""
        own = self._own_stats(reset)
        gathering = self._round
        if gathering is None:
            gathering = self._round = StatsGathering(self._ask_peers(reset))
            gathering.handle = self._loop.call_later(PEER_STATS_TIMEOUT_S, self._timed_out)
        gathering.waiters.append((waiter, own))
        if not gathering.waiting:
            self._answer(outbox)

    def on_reply(self, msg: StatsReply, outbox: Outbox) -> None:
        """A peer's ``StatsReply``: the round answers once the last peer has."""
        gathering = self._round
        if gathering is None or msg.name not in gathering.waiting:
            self._counters["late_peer_stats"] += 1
            return
        gathering.waiting.discard(msg.name)
        gathering.replies[msg.name] = msg.stats
        if not gathering.waiting:
            self._answer(outbox)

    def _timed_out(self) -> None:
        if not self._serving:
            return
        outbox: Outbox = []
        self._answer(outbox)
        self._flush(outbox)

    def _answer(self, outbox: Outbox) -> None:
        """Close the open round (if any): every waiter gets what came."""
        gathering, self._round = self._round, None
        if gathering is None:
            return
        if gathering.handle is not None:
            gathering.handle.cancel()
        silent = sorted(gathering.waiting)
        for waiter, own in gathering.waiters:
            stats = {**own, "cluster": gathering.replies, "cluster_silent": silent}
            if isinstance(waiter, bytes):
                outbox.append(((TO_CLIENT, waiter), StatsReply(self._name, stats)))
            elif not waiter.done():  # a scrape that gave up has cancelled it
                waiter.set_result(stats)
