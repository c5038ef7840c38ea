"""ClusterStatsRounds alone, on a real event loop: a round asks the peers once, answers every
waiter when the last peer has (or with what came once PEER_STATS_TIMEOUT_S has passed), and is
not served before the frontend serves or after it stops."""

from __future__ import annotations

import asyncio
from typing import Any

from zserve.core.hosting import Outbox
from zserve.frontend.cluster_stats import ClusterStatsRounds
from zserve.frontend.core import TO_CLIENT
from zserve.transport.messages import StatsReply

PEERS = {"shard-0", "rank"}
CLIENT = b"client-1"


class Peers:
    """The host's side of a round: who was asked (and with which reset), what was flushed."""

    def __init__(self, reachable: set[str]) -> None:
        self.reachable = reachable
        self.asked: list[bool] = []
        self.flushed: Outbox = []
        self.counters = {"late_peer_stats": 0}

    def ask(self, reset: bool) -> set[str]:
        self.asked.append(reset)
        return set(self.reachable)

    def own(self, reset: bool) -> dict[str, Any]:
        return {"name": "frontend-0", "reset": reset}

    def flush(self, outbox: Outbox) -> None:
        self.flushed.extend(outbox)
        outbox.clear()

    def rounds(self) -> ClusterStatsRounds:
        return ClusterStatsRounds(name="frontend-0", loop=asyncio.get_running_loop(),
                                  own_stats=self.own, ask_peers=self.ask, flush=self.flush,
                                  counters=self.counters)


async def test_a_round_answers_every_waiter_once_the_last_peer_has() -> None:
    peers = Peers(PEERS)
    rounds = peers.rounds()
    rounds.open()
    outbox: Outbox = []
    rounds.gather(CLIENT, True, outbox)
    scrape = asyncio.ensure_future(rounds.ask())  # joins the open round: asks no one again
    await asyncio.sleep(0)
    assert peers.asked == [True] and outbox == []
    rounds.on_reply(StatsReply("shard-0", {"n": 0}), outbox)
    assert outbox == [] and not scrape.done()
    rounds.on_reply(StatsReply("rank", {"n": 1}), outbox)
    ((destination, reply),) = outbox
    assert destination == (TO_CLIENT, CLIENT) and isinstance(reply, StatsReply)
    assert reply.stats == {"name": "frontend-0", "reset": True,
                           "cluster": {"shard-0": {"n": 0}, "rank": {"n": 1}},
                           "cluster_silent": []}
    stats = await asyncio.wait_for(scrape, timeout=10)
    assert stats is not None and stats["reset"] is False and stats["cluster_silent"] == []
    rounds.on_reply(StatsReply("rank", {"n": 2}), outbox)  # no round open: too late
    assert peers.counters["late_peer_stats"] == 1
    rounds.close([])


async def test_a_silent_peer_is_named_once_the_round_times_out() -> None:
    peers = Peers(PEERS)
    rounds = peers.rounds()
    rounds.open()
    rounds.gather(CLIENT, False, [])
    rounds.on_reply(StatsReply("rank", {"n": 1}), [])
    scrape = await asyncio.wait_for(rounds.ask(), timeout=10)  # answered by the timeout
    assert scrape is not None and scrape["cluster_silent"] == ["shard-0"]
    ((_, reply),) = peers.flushed  # the client's answer went out through the host's flush
    assert isinstance(reply, StatsReply) and reply.stats["cluster"] == {"rank": {"n": 1}}
    rounds.close([])


async def test_no_round_before_the_frontend_serves_or_after_it_stops() -> None:
    peers = Peers(set())
    rounds = peers.rounds()
    assert await rounds.ask() is None
    rounds.open()
    stats = await rounds.ask()  # no peer reachable: answered at once
    assert stats is not None and stats["cluster"] == {}
    rounds.close([])
    assert await rounds.ask() is None
    assert peers.asked == [False]
