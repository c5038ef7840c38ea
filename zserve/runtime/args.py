"""The command line every role process shares (``zserve frontend / scheduler / rank / backend``).

Each role runs alone from a cluster.toml: ``--config`` names the file, ``--index`` which
instance (not for the single rank), ``--control`` the supervisor's control address, ``--ipc-dir``
where ``ipc://`` endpoints live, ``--advertise`` the host name peers should use for wildcard
binds and, for the roles that talk to the rank, ``--rank`` to override its address.
:func:`role_parser` builds that parser (the role adds its own flags, e.g. bind addresses);
:func:`role_config_from_args` turns the parsed flags into the role's ``RoleConfig``, the same one
the supervisor hands a spawned role.
"""

from __future__ import annotations

import argparse

from zserve.config.cluster import RoleConfig, load_config, role_config
from zserve.runtime.peer_map import peer_key


def role_parser(prog: str, description: str | None, *, indexed: bool = True,
                rank_flag: bool = True) -> argparse.ArgumentParser:
    """The shared flags of a role; ``indexed`` adds ``--index``, ``rank_flag`` ``--rank``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help="cluster.toml")
    if indexed:
        parser.add_argument("--index", type=int, default=0, help="which instance (default 0)")
    parser.add_argument("--control", default=None, help="supervisor control address")
    if rank_flag:
        parser.add_argument("--rank", default=None, help="rank address (overrides cluster.toml)")
    parser.add_argument("--advertise", default=None, metavar="HOST",
                        help="host name peers use for a socket bound to a wildcard (0.0.0.0) "
                             "address (default: this machine's host name)")
    parser.add_argument("--ipc-dir", default=None, help="folder of ipc:// endpoints")
    return parser


def role_config_from_args(args: argparse.Namespace, role: str) -> RoleConfig:
    """The typed config of ``role`` instance ``args.index`` (0 without ``--index``): cluster.toml
    with its static peers, the ``--ipc-dir``/``--advertise`` choices and the ``--rank``
    override applied. Bind overrides are the role's own: set ``config.bind[socket]``."""
    cluster = load_config(args.config)
    ipc_dir = args.ipc_dir or cluster.ipc_dir
    config = role_config(cluster, role, getattr(args, "index", 0), ipc_dir=ipc_dir,
                         peers=cluster.static_peers(ipc_dir), advertise_host=args.advertise)
    rank = getattr(args, "rank", None)
    if rank:
        config.peers[peer_key("rank", "rank")] = rank
    return config


__all__ = ["role_config_from_args", "role_parser"]
