"""CURVE key files: ``zserve keys init``, loading a role's keys, and their checks.

Layout of a keys folder (mode 0700; secret files 0600), in pyzmq's ``zmq.auth`` certificate
format (``<name>.key`` holds the public key, ``<name>.key_secret`` both keys)::

    keys/supervisor.key  supervisor.key_secret   the control socket
    keys/rank.key        rank.key_secret
    keys/shard.key       shard.key_secret          (with shards = 0 it also serves the rank)
    keys/backend.key     backend.key_secret
    keys/frontend.key    frontend.key_secret
    keys/client.key      client.key_secret         a client's pair: give it to the client
    keys/clients/client.key                        the client public keys a frontend accepts

A process reads every role's public key, its own role's secret file (refused when a group or
other user may read it) and, for the frontend, the client public keys. docs/security.md has the
threat model, the set-up and the rotation procedure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from zserve.config.cluster import ClusterConfig, SecurityConfig
from zserve.transport.curve import (
    CLIENTS_DOMAIN,
    CLUSTER_DOMAIN,
    CurveClient,
    CurveIdentity,
    check_z85_key,
)
from zserve.transport.sockets import context_security, release_context, secure_context

__all__ = (
    "CLIENT_KEY_NAME",
    "ROLE_KEY_NAMES",
    "KeyFileError",
    "client_curve",
    "init_keys",
    "key_problems",
    "load_identity",
    "main",
    "secure_role_context",
)

# One key pair per role; a process's role picks its pair.
ROLE_KEY_NAMES = ("supervisor", "rank", "shard", "backend", "frontend")
CLIENT_KEY_NAME = "client"
CLIENTS_FOLDER = "clients"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
FOLDER_MODE = 0o700
SECRET_MODE = 0o600
# Permission bits a secret file may not have: any access by the group or other users.
_SHARED_BITS = stat.S_IRWXG | stat.S_IRWXO


class KeyFileError(ValueError):
    """A key file is missing, malformed or readable by others; the message is one line."""


def _secret_path(keys_dir: str, name: str) -> str:
    return os.path.join(keys_dir, name + SECRET_SUFFIX)


def _public_path(keys_dir: str, name: str) -> str:
    return os.path.join(keys_dir, name + PUBLIC_SUFFIX)


# --------------------------------------------------------------------------- writing


@contextlib.contextmanager
def _private_umask() -> Iterator[None]:
    """New files and folders are born owner-only: no moment where a secret is world-readable."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def init_keys(folder: str | os.PathLike[str], *, force: bool = False) -> list[str]:
    """Write a key pair per role and a client pair into ``folder`` (made 0700, secret files
    0600) and the client's public key into ``folder/clients``; returns the files written.
    Existing key files are refused (``KeyFileError``) unless ``force``."""
    keys_dir = os.fspath(folder)
    names = (*ROLE_KEY_NAMES, CLIENT_KEY_NAME)
    clients_dir = os.path.join(keys_dir, CLIENTS_FOLDER)
    targets = [path for name in names
               for path in (_public_path(keys_dir, name), _secret_path(keys_dir, name))]
    targets.append(_public_path(clients_dir, CLIENT_KEY_NAME))
    existing = [path for path in targets if os.path.exists(path)]
    if existing and not force:
        raise KeyFileError(f"keys already exist ({existing[0]}); use --force to replace them")
    with _private_umask():
        os.makedirs(clients_dir, mode=FOLDER_MODE, exist_ok=True)
        for path in (keys_dir, clients_dir):
            os.chmod(path, FOLDER_MODE)
        for name in names:
            zmq.auth.create_certificates(keys_dir, name)
            os.chmod(_secret_path(keys_dir, name), SECRET_MODE)
        shutil.copyfile(_public_path(keys_dir, CLIENT_KEY_NAME),
                        _public_path(clients_dir, CLIENT_KEY_NAME))
    return targets


# --------------------------------------------------------------------------- reading


def secret_file_problem(path: str) -> str | None:
    """Why ``path`` cannot serve as a secret key file, or None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"no such key file: {path} (run `zserve keys init`)"
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror}"
    if mode & _SHARED_BITS:
        return (f"secret key file {path} is accessible by other users (mode "
                f"{stat.S_IMODE(mode):04o}); run `chmod 600 {path}`")
    return None


def _read_key(path: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    if secret:
        problem = secret_file_problem(path)
        if problem:
            raise KeyFileError(problem)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot load key file {path}: {exc}") from None
    if secret and secret_key is None:
        raise KeyFileError(f"no secret key in {path}")
    try:
        check_z85_key(path, public)
        if secret_key is not None:
            check_z85_key(path, secret_key)
    except ValueError as exc:
        raise KeyFileError(str(exc)) from None
    return public, secret_key


def _client_keys(folder: str) -> frozenset[bytes]:
    if not os.path.isdir(folder):
        raise KeyFileError(f"no such folder of client keys: {folder}")
    keys = [_read_key(os.path.join(folder, name), secret=False)[0]
            for name in sorted(os.listdir(folder)) if name.endswith(PUBLIC_SUFFIX)]
    return frozenset(keys)


def load_identity(security: SecurityConfig, role: str, *, shards: int) -> CurveIdentity:
    """The CURVE material of a process of ``role`` (a name of ``ROLE_KEY_NAMES``): its key pair,
    every role's public key (``rank`` is the shard's key when the rank is embedded,
    ``shards = 0``), and the keys it accepts: the roles' on its cluster sockets, the listed
    client keys on a frontend's client socket."""
    keys_dir, clients_dir = security.keys_dir, security.clients_dir
    if keys_dir is None or clients_dir is None:
        raise KeyFileError("security.keys_dir is not set")
    if role not in ROLE_KEY_NAMES:
        raise ValueError(f"unknown role {role!r}")
    public, secret = _read_key(_secret_path(keys_dir, role), secret=True)
    assert secret is not None
    servers = {name: _read_key(_public_path(keys_dir, name), secret=False)[0]
               for name in ROLE_KEY_NAMES}
    if shards == 0:
        servers["rank"] = servers["shard"]
    authorized = {CLUSTER_DOMAIN: frozenset(servers.values())}
    if role == "frontend":
        authorized[CLIENTS_DOMAIN] = _client_keys(clients_dir)
    return CurveIdentity(public=public, secret=secret, servers=servers, authorized=authorized)


def secure_role_context(ctx: zmq.Context[Any], cluster: ClusterConfig, role: str) -> None:
    """Install the role's CURVE keys on ``ctx`` when ``[security]`` names a keys folder (the
    factory then secures every tcp socket of ``ctx``); a no-op otherwise. Undo with
    ``transport.sockets.release_context(ctx)`` before ``ctx.term()``."""
    if cluster.security.curve:
        identity = load_identity(cluster.security, role, shards=cluster.scheduler.shards)
        secure_context(ctx, identity)


def release_role_context(ctx: zmq.Context[Any]) -> None:
    """Stop what ``secure_role_context`` started (no-op without CURVE); before ``ctx.term()``."""
    release_context(ctx)


def destroy_role_context(ctx: zmq.Context[Any], *, linger_ms: int) -> None:
    """``release_role_context`` then ``ctx.destroy``: the end of a role process's context."""
    release_context(ctx)
    ctx.destroy(linger=linger_ms)


def count_auth_failed(ctx: zmq.Context[Any], counters: dict[str, int], reset: bool) -> None:
    """Put the ``auth_failed`` counter (failed CURVE handshakes on ``ctx``'s server sockets in
    the stats window; 0 without CURVE) into a role's ``counters``, unless already there."""
    if "auth_failed" not in counters:
        security = context_security(ctx)
        counters["auth_failed"] = 0 if security is None else security.auth_failed_window(reset)


def client_curve(server_key: str | bytes | os.PathLike[str],
                 client_key: str | os.PathLike[str] | tuple[bytes, bytes]) -> CurveClient:
    """A client's CURVE settings. ``server_key``: the frontend's public key, as a 40-character
    Z85 key or the path of its ``.key`` file (``keys/frontend.key``); ``client_key``: the path
    of the client's ``.key_secret`` file (``keys/client.key_secret``), or its (public, secret)
    Z85 pair."""
    if isinstance(server_key, bytes) or (
        isinstance(server_key, str) and len(server_key) == 40 and not os.path.exists(server_key)
    ):
        server_public = server_key.encode() if isinstance(server_key, str) else server_key
    else:
        server_public = _read_key(os.fspath(server_key), secret=False)[0]
    if isinstance(client_key, tuple):
        public, secret = client_key
    else:
        public, maybe_secret = _read_key(os.fspath(client_key), secret=True)
        assert maybe_secret is not None
        secret = maybe_secret
    return CurveClient(public=public, secret=secret, server_public=server_public)


def key_problems(security: SecurityConfig, roles: set[str]) -> list[tuple[str, str]]:
    """``(key path, problem)`` for each key file ``roles`` need that is missing, malformed or
    readable by others, and for an empty client key folder."""
    if security.keys_dir is None or security.clients_dir is None:
        return []
    problems: list[tuple[str, str]] = []
    for name in ROLE_KEY_NAMES:
        paths = [(_public_path(security.keys_dir, name), False)]
        if name in roles:
            paths.append((_secret_path(security.keys_dir, name), True))
        for path, secret in paths:
            try:
                _read_key(path, secret=secret)
            except KeyFileError as exc:
                problems.append(("security.keys_dir", str(exc)))
    key = "security.authorized_clients" if security.authorized_clients else "security.keys_dir"
    try:
        if not _client_keys(security.clients_dir):
            problems.append((key, f"no client public keys (*.key) in {security.clients_dir}"))
    except KeyFileError as exc:
        problems.append((key, str(exc)))
    return problems


# --------------------------------------------------------------------------- the command


def main(argv: list[str]) -> int:
    """``zserve keys init [DIR] [--force]``: write the CURVE key pairs of a cluster."""
    parser = argparse.ArgumentParser(prog="zserve keys", description=main.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="write a key pair per role and a client pair")
    init.add_argument("dir", nargs="?", default="keys", help="the keys folder (default: keys)")
    init.add_argument("--force", action="store_true", help="replace existing keys")
    args = parser.parse_args(argv)
    try:
        written = init_keys(args.dir, force=args.force)
    except (KeyFileError, OSError) as exc:
        print(f"zserve keys: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} key files in {Path(args.dir).resolve()} (secret files 0600); "
          f"add to cluster.toml:\n\n[security]\nkeys_dir = \"{args.dir}\"")
    return 0
