"""The scheduler shard's process: ``zserve scheduler`` and the supervisor's ``shard`` role.

``run_shard(config, control_address)`` opens the shard's sockets and control link, hosts a
``ShardHost`` (``zserve.scheduler.shard_host``; with ``config.embedded_rank`` also the
``RankHost`` on its own ROUTER), syncs the cluster clock when the rank runs elsewhere, serves until
the control link asks it to drain, drains, and closes everything in reverse order.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import math
import sys
import time
from typing import Any

import zmq

from zserve.config.cluster import STANDBY_NAME, ModelConfig, RoleConfig, load_config
from zserve.core.epochs import SchedulerWatch, next_epoch, now_ms
from zserve.runtime import peer_map, runner
from zserve.runtime.args import role_config_from_args, role_parser
from zserve.runtime.clock import ClusterClock
from zserve.runtime.session import SOCKET_CLOSE_LINGER_MS, RoleSession
from zserve.scheduler.rank_backends import BACKEND_TIMEOUT_S
from zserve.scheduler.rank_host import RankHost
from zserve.scheduler.sent_plans import PLAN_ACK_MARGIN_S
from zserve.scheduler.shard_host import ROLE, ShardHost
from zserve.scheduler.standby import PairLink
from zserve.transport.messages import ModelAdded
from zserve.transport.reactor import SocketReactor
from zserve.transport.sockets import make_router

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _ShardProcess:
    """What one shard process runs inside its ``RoleSession``: the reactor, its sockets, the
    hosts and the pair link, closed by ``close`` in reverse order (the session then closes the
    clock sync, the control link and the context)."""

    session: RoleSession
    reactor: SocketReactor
    socks: list[zmq.Socket[Any]] = dataclasses.field(default_factory=list)
    host: ShardHost | None = None
    rank: RankHost | None = None
    pair: PairLink | None = None
    # Set when a newer scheduler epoch superseded this process (zserve.core.epochs).
    superseded: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def ctx(self) -> zmq.Context[Any]:
        return self.session.ctx

    def bind(self, address: str, name: str, advertise: str | None) -> tuple[zmq.Socket[Any], str]:
        sock, endpoint = make_router(self.ctx, address, name=name, advertise_host=advertise)
        self.socks.append(sock)
        return sock, endpoint

    async def close(self) -> None:
        if self.pair is not None:
            await self.pair.close()
        if self.host is not None:
            await self.host.close()
        if self.rank is not None:
            await self.rank.close()
        self.reactor.close()
        for sock in self.socks:
            sock.close(linger=SOCKET_CLOSE_LINGER_MS)


async def _main(config: RoleConfig, control_address: str | None) -> int:
    async with RoleSession.open(config, control_address, role=ROLE) as session:
        # Plain sockets on the reactor (the control link shadows the context with zmq.asyncio).
        proc = _ShardProcess(session, SocketReactor(asyncio.get_running_loop()))
        session.closing(proc.close)
        session.serve_stats(lambda reset: proc.host.stats(reset) if proc.host is not None else {})
        session.on_control(functools.partial(_on_control, proc))
        return await _serve(proc, config)


def _on_control(proc: _ShardProcess, msg: Any) -> None:
    """The supervisor adds a model (``ModelAdded``), or tells the embedded rank something."""
    if type(msg) is ModelAdded:
        if proc.host is not None:
            proc.host.add_model(ModelConfig.from_dict(msg.config))
    elif proc.rank is not None:
        proc.rank.on_control_message(msg)


async def _serve(proc: _ShardProcess, config: RoleConfig) -> int:
    name = config.name
    embedded = config.embedded_rank
    session = proc.session
    host, endpoints = _build(proc, config)
    host.peers.update(await session.ready(endpoints))
    if proc.rank is not None:
        _start_pair(proc, config)
    if not embedded:
        if not await session.sync_clock(host.clock, host.peers):
            return session.exit_code
        rank_address = peer_map.rank_address(host.peers)
        assert rank_address is not None
        host.start()
        host.connect_rank(rank_address)
    drained = asyncio.ensure_future(session.drained())
    superseded = asyncio.ensure_future(proc.superseded.wait())
    await asyncio.wait([drained, superseded], return_when=asyncio.FIRST_COMPLETED)
    drained.cancel()
    superseded.cancel()
    handing_over = _hands_over(proc)
    if proc.pair is not None:  # a draining scheduler neither pings nor takes over
        await proc.pair.close(leaving=not (proc.superseded.is_set() or handing_over))
        proc.pair = None
    if proc.superseded.is_set():
        # Exit without a drain: its queue is the new epoch's now (the frontends re-send it);
        # a supervisor restarts this process as the standby.
        log.error("%s: superseded; exiting", name)
        return 0
    if handing_over:
        # A rolling restart: the partner takes over when this connection closes, and the
        # frontends re-send the queue to it; a drain here would answer it SHUTTING_DOWN.
        host.fenced = True
        log.warning("%s: drain requested while active with a live partner: handing over; "
                    "exiting", name)
        return 0
    await host.drain(session.drain.drain_s)
    return 0


def _hands_over(proc: _ShardProcess) -> bool:
    """An active scheduler of a pair whose partner answers leaves at once, without a drain
    (docs/runtime.md, "Hot spare"); a cluster's shutdown drains it (the supervisor stops the
    frontends first, so nothing is left to hand over) unless the partner is up."""
    if proc.pair is None or proc.superseded.is_set():
        return False
    return proc.pair.watch.can_hand_over(time.monotonic())


def _build(proc: _ShardProcess, config: RoleConfig) -> tuple[ShardHost, dict[str, str]]:
    """Bind the shard's socket (and the embedded rank's), build the hosts; the endpoints as
    bound. An embedded rank starts here: this process's clock is the cluster clock."""
    name = config.name
    embedded = config.embedded_rank
    advertise = config.advertise_host
    sock, endpoint = proc.bind(config.bind["shard"], f"{name} shard", advertise)
    endpoints = {"shard": endpoint}
    # Embedded, this process's clock is the cluster clock; else ClockSync sets the offset
    # before the shard takes requests (the scheduler core's timer reads this same object).
    clock = ClusterClock(reference=embedded)
    host = proc.host = ShardHost(
        name=name, ctx=proc.ctx, sock=sock, reactor=proc.reactor, cluster=config.cluster,
        models=list(config.models),
        peers=dict(config.peers), index=config.index, clock=clock,
        plan_ack_margin_s=config.plan_ack_margin_s or PLAN_ACK_MARGIN_S)
    if embedded:
        rank_sock, endpoints["rank"] = proc.bind(config.bind["rank"], f"{name} rank",
                                                 advertise)
        timeout_s = config.backend_timeout_s or BACKEND_TIMEOUT_S
        proc.rank = RankHost(name=name, sock=rank_sock, reactor=proc.reactor,
                             backend_timeout_s=timeout_s, local=(name, host.deliver_from_rank),
                             watch=_watch(config), grant_order=host.policy.grant_order)
        proc.rank.on_superseded = lambda: _step_down(proc)
        host.active = proc.rank.active
        host.embed_rank(proc.rank)
        proc.rank.start()
        host.start()
        log.info("%s: %s", name, clock.describe())
    return host, endpoints


def _watch(config: RoleConfig) -> SchedulerWatch:
    """The epoch watch of an embedded scheduler: a pair's member, or alone (never takes over,
    still steps down on hearing a newer epoch). A pair's primary starts as a joining standby
    (``SchedulerWatch``): active once its partner answers as a standby, the standby of a
    partner that is active (a restarted primary), or active after the takeover timeout."""
    scheduler = config.cluster.scheduler
    timeout_s = scheduler.takeover_timeout_ms / 1e3 if scheduler.standby else math.inf
    return SchedulerWatch(active=not config.standby and not scheduler.standby,
                          epoch=next_epoch(0, now_ms()), takeover_timeout_s=timeout_s,
                          now=time.monotonic(), primary=not config.standby)


def _start_pair(proc: _ShardProcess, config: RoleConfig) -> None:
    """After the peer map: an active scheduler waits for the backends; a pair's member starts
    pinging its partner."""
    rank, host = proc.rank, proc.host
    assert rank is not None and host is not None
    expected = set(peer_map.endpoints_of(host.peers, "plan"))
    if rank.active:
        rank.begin_rebuild(expected)
    if not config.cluster.scheduler.standby or rank.watch is None:
        return
    partner = STANDBY_NAME if config.name != STANDBY_NAME else "shard-0"
    address = host.peers.get(peer_map.peer_key(partner, "rank"))
    if address is None:
        log.error("%s: no address for its partner %s: no watch link", config.name, partner)
        if rank.watch.joining:  # a primary with nobody to ask: active alone
            host.active = True
            rank.activate(rank.watch.claim(now_ms()), expected, takeover=False)
        return
    proc.pair = PairLink(name=config.name, ctx=proc.ctx, reactor=proc.reactor, rank=rank,
                         host=host, watch=rank.watch, expected_backends=expected)
    proc.pair.start(address)
    log.info("%s: %s of the scheduler pair (partner %s)", config.name,
             "active" if rank.active else "standby", partner)


def _step_down(proc: _ShardProcess) -> None:
    if proc.host is not None:
        proc.host.fenced = True
    proc.superseded.set()


def run_shard(config: RoleConfig, control_address: str | None) -> int:
    """Run one scheduler shard (with the rank embedded when ``config.embedded_rank``)."""
    return runner.run_role(_main(config, control_address), name=config.name)


def main(argv: list[str]) -> int:
    """``zserve scheduler``: run scheduler shard ``--index`` of a cluster.toml on its own."""
    parser = role_parser("zserve scheduler", main.__doc__)
    parser.add_argument("--bind", default=None, help="shard socket bind address")
    parser.add_argument("--rank-bind", default=None,
                        help="with shards = 0: the embedded rank's bind address")
    parser.add_argument("--standby", action=argparse.BooleanOptionalAction, default=False,
                        help=f"run as {STANDBY_NAME}, the hot spare of shard-0 "
                             "([scheduler] standby = true)")
    args = parser.parse_args(argv)
    if args.standby and not load_config(args.config).scheduler.standby:
        parser.error("--standby needs [scheduler] standby = true in the cluster file")
    config = role_config_from_args(args, ROLE, STANDBY_NAME if args.standby else None)
    if args.bind:
        config.bind["shard"] = args.bind
    if args.rank_bind:
        if "rank" not in config.bind:
            parser.error("--rank-bind needs scheduler.shards = 0 (the rank embedded here)")
        config.bind["rank"] = args.rank_bind
    return run_shard(config, args.control)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
