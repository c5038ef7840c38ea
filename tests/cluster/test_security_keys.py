"""CURVE key files and the checks before anything starts: ``zserve keys init`` (permissions,
refusal to overwrite), a secret file others may read refused by preflight and by the role, and a
non-loopback bind refused without keys unless ``insecure = true``. Real files, the real command."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq.auth

import zserve
from zserve.cluster.preflight import check_cluster
from zserve.config.cluster import ConfigError, parse_config
from zserve.runtime.keys import (
    CLIENT_KEY_NAME,
    ROLE_KEY_NAMES,
    KeyFileError,
    client_curve,
    init_keys,
    load_identity,
)
from zserve.transport.curve import CLIENTS_DOMAIN, CLUSTER_DOMAIN

ZSERVE = [sys.executable, "-m", "zserve"]
CLI_TIMEOUT_S = 60.0


def _zserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ZSERVE, *args], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, check=False)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _document(**security: Any) -> dict[str, Any]:
    return {
        "frontends": {"addresses": ["tcp://0.0.0.0:0"]},
        "backends": {"device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 1.0}}],
        "security": security,
    }


def _problems(document: dict[str, Any]) -> list[str]:
    return [str(problem) for problem in check_cluster(parse_config(document))]


def test_keys_init_writes_private_files_and_refuses_to_overwrite(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    result = _zserve("keys", "init", str(keys))
    assert result.returncode == 0, result.stderr
    assert f'keys_dir = "{keys}"' in result.stdout
    assert _mode(keys) == 0o700
    assert _mode(keys / "clients") == 0o700
    for name in (*ROLE_KEY_NAMES, CLIENT_KEY_NAME):
        assert _mode(keys / f"{name}.key_secret") == 0o600, name
        public, secret = zmq.auth.load_certificate(keys / f"{name}.key_secret")
        assert secret is not None and len(public) == len(secret) == 40
    client_public, _ = zmq.auth.load_certificate(keys / "client.key")
    assert zmq.auth.load_certificate(keys / "clients" / "client.key")[0] == client_public
    before = (keys / "frontend.key_secret").read_bytes()

    again = _zserve("keys", "init", str(keys))
    assert again.returncode == 2
    assert again.stderr.splitlines() == [
        f"zserve keys: keys already exist ({keys / 'supervisor.key'}); use --force to replace "
        "them"
    ]
    assert (keys / "frontend.key_secret").read_bytes() == before

    forced = _zserve("keys", "init", str(keys), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (keys / "frontend.key_secret").read_bytes() != before
    assert _mode(keys / "frontend.key_secret") == 0o600


def test_keys_init_tightens_an_existing_folder(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o755)
    init_keys(keys)
    assert _mode(keys) == 0o700


def test_a_role_loads_its_keys_and_whom_it_accepts(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    init_keys(keys)
    security = parse_config(_document(keys_dir=str(keys))).security
    frontend = load_identity(security, "frontend", shards=0)
    public = {name: zmq.auth.load_certificate(keys / f"{name}.key")[0]
              for name in (*ROLE_KEY_NAMES, CLIENT_KEY_NAME)}
    assert frontend.public == public["frontend"]
    assert frontend.servers["rank"] == public["shard"]  # shards = 0: shard-0 hosts the rank
    assert load_identity(security, "backend", shards=2).servers["rank"] == public["rank"]
    assert frontend.authorized[CLIENTS_DOMAIN] == {public["client"]}
    assert public["client"] not in frontend.authorized[CLUSTER_DOMAIN]
    assert CLIENTS_DOMAIN not in load_identity(security, "backend", shards=0).authorized
    curve = client_curve(keys / "frontend.key", keys / "client.key_secret")
    assert (curve.server_public, curve.public) == (public["frontend"], public["client"])


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_secret_key_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    keys = tmp_path / "keys"
    init_keys(keys)
    secret = keys / "backend.key_secret"
    os.chmod(secret, mode)
    expected = (f"secret key file {secret} is accessible by other users (mode {mode:04o}); "
                f"run `chmod 600 {secret}`")
    assert _problems(_document(keys_dir=str(keys))) == [f"security.keys_dir: {expected}"]
    security = parse_config(_document(keys_dir=str(keys))).security
    with pytest.raises(KeyFileError) as raised:
        load_identity(security, "backend", shards=0)
    assert str(raised.value) == expected
    load_identity(security, "frontend", shards=0)  # other roles' secrets are not read


def test_up_refuses_a_shared_secret_key_in_one_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    init_keys(keys)
    os.chmod(keys / "shard.key_secret", 0o644)
    config = tmp_path / "cluster.toml"
    config.write_text('[security]\nkeys_dir = "keys"\n[backends]\ndevice = "emulated"\n'
                      '[[models]]\nname = "m"\nemulated = { alpha_ms = 1.0, beta_ms = 1.0 }\n')
    result = _zserve("up", str(config), "--ipc-dir", str(tmp_path), "--state-dir",
                     str(tmp_path))
    assert result.returncode == 2
    secret = keys / "shard.key_secret"
    assert result.stderr.splitlines() == [
        f"zserve up: security.keys_dir: secret key file {secret} is accessible by other users "
        f"(mode 0644); run `chmod 600 {secret}`"
    ]


def test_missing_key_files_are_named(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    problems = _problems(_document(keys_dir=str(absent)))
    assert f"security.keys_dir: no such key file: {absent}/supervisor.key_secret (run `zserve " \
        "keys init`)" in problems
    assert problems[-1] == f"security.keys_dir: no such folder of client keys: {absent}/clients"
    keys = tmp_path / "keys"
    init_keys(keys)
    (keys / "clients" / "client.key").unlink()
    assert _problems(_document(keys_dir=str(keys))) == [
        f"security.keys_dir: no client public keys (*.key) in {keys}/clients"
    ]


def test_a_non_loopback_bind_needs_keys_or_insecure(tmp_path: Path) -> None:
    assert _problems(_document()) == [
        "frontends.addresses[0]: tcp://0.0.0.0:0 is reachable from other hosts but [security] "
        "has no keys_dir: run `zserve keys init` and set security.keys_dir (CURVE), or set "
        "security.insecure = true"
    ]
    assert _problems(_document(insecure=True)) == []
    keys = tmp_path / "keys"
    init_keys(keys)
    assert _problems(_document(keys_dir=str(keys))) == []
    loopback = {**_document(), "cluster": {"transport": "tcp", "host": "127.0.0.1"},
                "frontends": {"addresses": ["tcp://localhost:0", "tcp://[::1]:0"],
                              "count": 2}}
    assert [p for p in _problems(loopback) if "reachable" in p] == []


def test_http_endpoints_off_loopback_need_insecure_even_with_keys(tmp_path: Path) -> None:
    """The OIP and metrics endpoints have no authentication: CURVE keys do not cover them."""
    keys = tmp_path / "keys"
    init_keys(keys)
    frontends = {"addresses": ["tcp://127.0.0.1:0"], "http_addresses": ["0.0.0.0:8000"],
                 "grpc_addresses": ["127.0.0.1:0"], "metrics_addresses": ["[::]:9464"]}
    document = {**_document(keys_dir=str(keys)), "frontends": frontends}
    assert [p.split(": ")[0] for p in _problems(document)] == [
        "frontends.http_addresses[0]", "frontends.metrics_addresses[0]"]
    assert "has no authentication" in _problems(document)[0]
    insecure = {**document, "security": {"keys_dir": str(keys), "insecure": True}}
    assert _problems(insecure) == []
    loopback = {**document, "frontends": {**frontends, "http_addresses": ["localhost:0"],
                                          "metrics_addresses": ["[::1]:0"]}}
    assert _problems(loopback) == []


def test_transport_tcp_on_every_interface_needs_keys() -> None:
    document = {**_document(), "cluster": {"transport": "tcp", "host": "0.0.0.0"},
                "frontends": {}}
    assert [p.split(":")[0] for p in _problems(document)] == ["cluster.host"]


def test_security_section_is_strictly_typed() -> None:
    with pytest.raises(ConfigError, match=r"^security\.insecure: "):
        parse_config(_document(insecure="yes"))
    with pytest.raises(ConfigError, match=r"^security\.key_dir: .*keys_dir"):
        parse_config(_document(key_dir="keys"))
    with pytest.raises(ConfigError, match=r"^security\.authorized_clients: needs keys_dir"):
        parse_config(_document(authorized_clients="clients"))


def test_a_role_started_alone_refuses_a_shared_secret_in_one_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    init_keys(keys)
    secret = keys / "rank.key_secret"
    os.chmod(secret, 0o644)
    config = tmp_path / "cluster.toml"
    config.write_text('[security]\nkeys_dir = "keys"\n[scheduler]\nshards = 1\n'
                      '[[models]]\nname = "m"\nemulated = { alpha_ms = 1.0, beta_ms = 1.0 }\n')
    result = _zserve("rank", "--config", str(config))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith(
        f"rank refuses to start: secret key file {secret} is accessible by other users "
        f"(mode 0644); run `chmod 600 {secret}`"
    )


def test_the_client_reads_its_keys_at_construction(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    init_keys(keys)
    address = "tcp://127.0.0.1:9"  # never connected: the keys are checked first
    with pytest.raises(ValueError, match="both server_key and client_key"):
        zserve.Client(address, server_key=keys / "frontend.key")
    with pytest.raises(KeyFileError, match="no such key file"):
        zserve.AsyncClient(address, server_key=keys / "frontend.key",
                           client_key=keys / "absent.key_secret")
    os.chmod(keys / "client.key_secret", 0o644)
    with pytest.raises(KeyFileError, match="accessible by other users"):
        zserve.AsyncClient(address, server_key=keys / "frontend.key",
                           client_key=keys / "client.key_secret")
    with pytest.raises(ValueError, match="not a CURVE key"):
        client_curve(b"short", (b"x" * 40, b"y" * 40))
