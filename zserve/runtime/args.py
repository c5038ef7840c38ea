"""The command line every role process shares (``zserve frontend / scheduler / rank / backend``).

Each role runs alone from a cluster.toml: ``--config`` names the file, ``--index`` which
instance (not for the single rank), ``--control`` the supervisor's control address, ``--ipc-dir``
where ``ipc://`` endpoints live, ``--advertise`` the host name peers should use for wildcard
binds and, for the roles that talk to the rank, ``--rank`` to override its address.
:func:`role_parser` builds that parser (the role adds its own flags, e.g. bind addresses);
:func:`role_config_from_args` turns the parsed flags into the role's ``RoleConfig``, the same one
the supervisor hands a spawned role.

Every flag can also come from the environment, for containers whose addresses are known only
when the pod starts (docs/kubernetes.md): ``ZSERVE_<FLAG>``, the flag's name in capitals with
``_`` for ``-`` (``--rank-bind`` -> ``ZSERVE_RANK_BIND``); a flag on the command line wins, and a
repeatable flag (``--shard``) takes a comma-separated list. ``--index`` takes a number or a pod
name ending in one (``zserve-backend-3``: 3), so a StatefulSet pod can pass its own name.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from zserve.config.cluster import RoleConfig, load_config, role_config
from zserve.runtime.peer_map import peer_key

ENV_PREFIX = "ZSERVE_"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_TRAILING_NUMBER_RE = re.compile(r"^(?:.*\D)?(\d+)$")


def instance_index(text: str) -> int:
    """``--index``: a number, or a name ending in one (a StatefulSet pod's ``name-3``: 3)."""
    match = _TRAILING_NUMBER_RE.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not an index or a name ending in one (e.g. 3 or zserve-backend-3): {text!r}")
    return int(match.group(1))


def env_name(option: str) -> str:
    """The environment variable of a flag: ``--rank-bind`` -> ``ZSERVE_RANK_BIND``."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


class RoleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose long flags default to their ``ZSERVE_<FLAG>`` variables."""

    def __init__(self, *args: Any, environ: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environ = os.environ if environ is None else environ

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: None = None) -> argparse.Namespace:
        for action in self._actions:
            long_flags = [flag for flag in action.option_strings if flag.startswith("--")]
            value = self.environ.get(env_name(long_flags[0])) if long_flags else None
            if value is None or long_flags[0] == "--help":
                continue
            action.required = False  # given by the environment
            if action.nargs == 0:  # a switch: ZSERVE_STANDBY=true
                action.default = value.strip().lower() in _TRUE_WORDS
            elif isinstance(action, argparse._AppendAction):
                action.default = [item.strip() for item in value.split(",") if item.strip()]
            else:
                action.default = value  # a string default goes through the flag's type
        return super().parse_args(args, namespace)


def role_parser(prog: str, description: str | None, *, indexed: bool = True,
                rank_flag: bool = True,
                environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The shared flags of a role; ``indexed`` adds ``--index``, ``rank_flag`` ``--rank``.
    Each long flag defaults to its ``ZSERVE_<FLAG>`` variable in ``environ`` (the process's)."""
    parser = RoleArgumentParser(prog=prog, description=description, environ=environ,
                                epilog="Every flag may be given as an environment variable "
                                       "instead: ZSERVE_<FLAG> (e.g. ZSERVE_RANK, "
                                       "ZSERVE_RANK_BIND); the command line wins.")
    parser.add_argument("--config", required=True, help="cluster.toml")
    if indexed:
        parser.add_argument("--index", type=instance_index, default=0,
                            help="which instance: a number, or a pod name ending in one "
                                 "(default 0)")
    parser.add_argument("--control", default=None, help="supervisor control address")
    if rank_flag:
        parser.add_argument("--rank", default=None, help="rank address (overrides cluster.toml)")
    parser.add_argument("--advertise", default=None, metavar="HOST",
                        help="host name peers use for a socket bound to a wildcard (0.0.0.0) "
                             "address (default: this machine's host name)")
    parser.add_argument("--ipc-dir", default=None, help="folder of ipc:// endpoints")
    return parser


def role_config_from_args(args: argparse.Namespace, role: str,
                          name: str | None = None) -> RoleConfig:
    """The typed config of ``role`` instance ``args.index`` (0 without ``--index``): cluster.toml
    with its static peers, the ``--ipc-dir``/``--advertise`` choices and the ``--rank``
    override applied; ``name``: the process's, where not the role's own (the standby
    scheduler). Bind overrides are the role's own: set ``config.bind[socket]``."""
    cluster = load_config(args.config)
    ipc_dir = args.ipc_dir or cluster.ipc_dir
    config = role_config(cluster, role, getattr(args, "index", 0), ipc_dir=ipc_dir,
                         peers=cluster.static_peers(ipc_dir), advertise_host=args.advertise,
                         name=name)
    rank = getattr(args, "rank", None)
    if rank:
        config.peers[peer_key("rank", "rank")] = rank
    return config


__all__ = ["RoleArgumentParser", "env_name", "instance_index", "role_config_from_args",
           "role_parser"]
