"""A running cluster's statistics, asked of one of its frontends.

The frontend answers ``ClusterStatsRequest`` on its client socket with its own stats and those of
the shards, rank and backends it talks to; ``zserve status`` and the load generator's runs
against a cluster at an address read them through ``frontend_stats_reader``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from zserve.transport import codec
from zserve.transport.messages import ClusterStatsRequest, StatsReply
from zserve.transport.sockets import make_dealer

# The frontend at the address a bench drives, as a name in Target.frontends (its stats come
# from its client socket, with those of its peers: see frontend_stats_reader).
FRONTEND_AT_ADDRESS = "frontend"
# How long a frontend may take to gather its peers' stats (its own bound, 0.5 s, plus slack).
CLUSTER_STATS_TIMEOUT_S = 1.0
# Names asked of one frontend within this long share its answer (the names of one mark).
CLUSTER_STATS_REUSE_S = 0.2


def frontend_stats_reader(address: str) -> Callable[[str], dict[str, Any]]:
    """``control_stats`` for a cluster at an address: asks its frontend's client socket
    ``ClusterStatsRequest(reset=False)``; the frontend answers with its own stats and those of
    the shards, rank and backends it talks to. ``FRONTEND_AT_ADDRESS`` names the frontend
    itself; ``"rank"`` falls back to ``"shard-0"`` (a scheduler embedding the rank). One answer
    serves the names asked within CLUSTER_STATS_REUSE_S (one mark); a server that did not answer
    once (not a zserve frontend) is not asked again."""
    counter = iter(range(1 << 30))
    last: list[tuple[float, dict[str, Any]]] = []
    silent = False

    def ask() -> dict[str, Any]:
        nonlocal silent
        if silent:
            raise TimeoutError(f"the server at {address} does not answer ClusterStatsRequest")
        if last and time.monotonic() - last[0][0] < CLUSTER_STATS_REUSE_S:
            return last[0][1]
        ctx: zmq.Context[Any] = zmq.Context.instance()
        identity = f"loadgen-cstats-{os.getpid()}-{next(counter)}".encode()
        sock = make_dealer(ctx, address, identity=identity)
        try:
            sock.send_multipart(codec.encode(ClusterStatsRequest(reset=False)), copy=False)
            if not sock.poll(int(CLUSTER_STATS_TIMEOUT_S * 1e3)):
                silent = True
                raise TimeoutError(f"no StatsReply from the frontend at {address}")
            msg = codec.decode(sock.recv_multipart(copy=False))
        finally:
            sock.close(linger=0)
        if not isinstance(msg, StatsReply):
            raise TypeError(f"{type(msg).__name__} instead of a StatsReply from {address}")
        last[:] = [(time.monotonic(), dict(msg.stats))]
        return last[0][1]

    def read(name: str) -> dict[str, Any]:
        stats = ask()
        if name == FRONTEND_AT_ADDRESS:
            return stats
        cluster = stats.get("cluster") or {}
        for candidate in (name, "shard-0") if name == "rank" else (name,):
            if isinstance(cluster.get(candidate), dict):
                return dict(cluster[candidate])
        raise KeyError(f"the frontend at {address} has no stats of {name!r}")

    return read
