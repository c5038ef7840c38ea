"""The peer map: where every process of a cluster listens.

Keys are ``"<process name>/<socket name>"`` (``"rank/rank"``, ``"shard-0/shard"``,
``"frontend-0/client"``, ``"frontend-0/data"``, ``"backend-1/plan"``), values are the addresses
from each process's own ``Ready``. The supervisor hands the map to every process in its ``Ready``
reply, and pins a restarted process to its previous addresses, so peers never need updating
after a restart.
"""

from __future__ import annotations

__all__ = ("endpoints_of", "peer_key", "rank_address")


def peer_key(name: str, socket: str) -> str:
    """The peer-map key of one process's socket, e.g. ``peer_key("frontend-0", "data")``."""
    return f"{name}/{socket}"


def endpoints_of(peers: dict[str, str], socket: str) -> dict[str, str]:
    """``{process name: address}`` of every process in ``peers`` that serves ``socket``,
    sorted by process name (so ``shard-0`` comes before ``shard-1``)."""
    found: dict[str, str] = {}
    for key in sorted(peers):
        name, _, sock = key.rpartition("/")
        if sock == socket:
            found[name] = peers[key]
    return found


def rank_address(peers: dict[str, str]) -> str | None:
    """The rank's address in a peer map: ``rank/rank``, else the embedded rank's
    ``shard-0/rank`` (``shards = 0``)."""
    return peers.get(peer_key("rank", "rank")) or next(
        iter(endpoints_of(peers, "rank").values()), None
    )
