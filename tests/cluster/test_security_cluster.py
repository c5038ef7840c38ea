"""A whole cluster over tcp with CURVE (supervisor, rank, shard, backend and frontend processes,
every link between them authenticated and encrypted): a client with the keys is served
correctly; a client without CURVE and a client whose key the frontend does not list get nothing
served, each call ends with UNAVAILABLE within its bound (no hang), and the frontend counts the
refused handshakes (``auth_failed``). The frontend's Prometheus endpoint works under CURVE too: a
scrape shows every process up and the keyed client's requests, nothing of the refused ones."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from runtime_helpers import wait_until

import zserve
from zserve.backends.host import build_executor
from zserve.client.async_client import CONNECTION_DOWN_BOUND_S
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.runtime.keys import init_keys
from zserve.transport import codec
from zserve.transport.messages import Hello
from zserve.transport.sockets import make_dealer

REQUESTS = 6
# A refused call ends after the connection-down bound (1 s); generous for a loaded machine.
REFUSED_CALL_BOUND_S = CONNECTION_DOWN_BOUND_S + 9.0
CALL_TIMEOUT_S = 30.0
STATS_BOUND_S = 20.0
ZSERVE = [sys.executable, "-m", "zserve"]
# `zserve up --detach` returns once every process is ready; generous for a loaded machine.
CLI_TIMEOUT_S = 120.0
# How long a refused raw peer's close waits with its message queued: handshakes are retried.
REFUSED_LINGER_S = 1.0


def _config(keys_dir: Path, shards: int) -> ClusterConfig:
    return parse_config({
        "cluster": {"transport": "tcp", "drain_s": 1.0},
        "scheduler": {"shards": shards, "policy": "eager", "d_ctrl_ms": 5.0},
        "frontends": {"reply_allowance_ms": 20.0, "metrics_addresses": ["127.0.0.1:0"]},
        "backends": {"count": 1, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0},
                    "slo_ms": 2000.0, "max_batch": 8}],
        "security": {"keys_dir": str(keys_dir)},
    })


def _refused_within_bound(client: zserve.Client, inputs: dict[str, Any]) -> float:
    started = time.monotonic()
    with pytest.raises(zserve.core.errors.UnavailableError):
        client.infer("m", inputs)
    elapsed_s = time.monotonic() - started
    assert elapsed_s < REFUSED_CALL_BOUND_S
    return elapsed_s


def _refused_raw_peer(address: str) -> None:
    """A DEALER without CURVE sends a plan-shaped message to ``address``, then goes."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = make_dealer(ctx, address, identity=b"intruder")
        sock.send_multipart(codec.encode(Hello(role="shard", name="intruder", pid=1)))
        sock.close(linger=int(REFUSED_LINGER_S * 1e3))  # long enough to try the handshake
    finally:
        ctx.term()


def _wait_auth_failed(cluster: Cluster, at_least: int, name: str = "frontend-0") -> None:
    """Until ``name`` has counted ``at_least`` failed handshakes (its stats, asked again)."""
    wait_until(lambda: cluster.stats(name)["counters"]["auth_failed"] >= at_least,
               f"{at_least} failed handshakes counted by {name}", timeout_s=STATS_BOUND_S)


def _assert_scrape_shows(cluster: Cluster, processes: tuple[str, ...], served: int) -> None:
    """A scrape of the frontend's /metrics (a real HTTP client, prometheus_client's parser): every
    process answered its stats round, and the requests counted are the ``served`` ones, all ok."""
    url = cluster.stats("frontend-0")["metrics_url"]
    with urllib.request.urlopen(url, timeout=CALL_TIMEOUT_S) as response:
        text = response.read().decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    up = {s.labels["process"]: s.value for s in families["zserve_up"].samples}
    assert up == dict.fromkeys(processes, 1.0)
    requests = {s.labels["outcome"]: s.value for s in families["zserve_requests"].samples
                if s.name == "zserve_requests_total" and s.value}
    assert requests == {"ok": served}
    (received,) = families["zserve_requests_received"].samples
    assert received.value == served
    arrived = [s.value for s in families["zserve_scheduler_arrived"].samples
               if s.name == "zserve_scheduler_arrived_total" and s.labels["model"] == "m"]
    assert arrived == [served]


# shards = 1: a rank process of its own (its key pair and the shard's both in use); shards = 0:
# shard-0 hosts the rank, and its peers reach the rank socket with the shard's key.
@pytest.mark.parametrize("shards", [1, 0])
def test_a_curve_cluster_serves_only_clients_with_keys(tmp_path: Path, shards: int) -> None:
    keys = tmp_path / "keys"
    init_keys(keys)
    config = _config(keys, shards)
    model = config.models[0]
    executor: Any = build_executor("emulated", [model])
    executor.load()
    requests = executor.synthetic_requests("m", REQUESTS, seed=3)
    with Cluster(config, ipc_base=tmp_path) as cluster:
        address = cluster.client_address
        assert address.startswith("tcp://127.0.0.1:")
        with zserve.Client(address, timeout=CALL_TIMEOUT_S, server_key=keys / "frontend.key",
                           client_key=keys / "client.key_secret") as client:
            futures = [client.submit("m", request) for request in requests]
            for request, future in zip(requests, futures, strict=True):
                outputs = future.result(CALL_TIMEOUT_S)
                expected = executor.expected_outputs("m", request)
                assert outputs.keys() == expected.keys()
                for name, value in expected.items():
                    np.testing.assert_allclose(outputs[name], value)
        admitted = cluster.stats("frontend-0")["counters"]["admitted"]
        assert admitted == REQUESTS

        stranger = zmq.curve_keypair()
        with zserve.Client(address, timeout=CALL_TIMEOUT_S, max_retries=0) as no_keys, \
                zserve.Client(address, timeout=CALL_TIMEOUT_S, max_retries=0,
                              server_key=keys / "frontend.key", client_key=stranger) as unknown:
            for refused in (no_keys, unknown):
                _refused_within_bound(refused, requests[0])
        _wait_auth_failed(cluster, 2)
        counters = cluster.stats("frontend-0")["counters"]
        assert counters["admitted"] == REQUESTS  # nothing of theirs got through
        roles = ("rank", "shard-0", "backend-0") if shards else ("shard-0", "backend-0")
        for name in roles:  # every role link handshook fine
            assert cluster.stats(name)["counters"]["auth_failed"] == 0, name
        _assert_scrape_shows(cluster, ("frontend-0", *roles), served=REQUESTS)
        # The roles' own sockets refuse a peer without keys too: a raw DEALER to the backend's
        # plan socket (where shards send plans) is refused and counted, and the backend runs on.
        plan_address = cluster.peers()["backend-0/plan"]
        assert plan_address.startswith("tcp://")
        _refused_raw_peer(plan_address)
        _wait_auth_failed(cluster, 1, "backend-0")
        assert cluster.stats("backend-0")["counters"]["bad_messages"] == 0


def test_keys_init_then_up_serves_a_client_with_keys(tmp_path: Path) -> None:
    """The commands a user runs: `zserve keys init`, `zserve up --detach` of a tcp cluster file
    naming the keys, a client with the keys, `zserve down`."""
    assert subprocess.run([*ZSERVE, "keys", "init", str(tmp_path / "keys")],
                          capture_output=True, timeout=CLI_TIMEOUT_S, check=False).returncode == 0
    toml = tmp_path / "secure.toml"
    toml.write_text(
        '[cluster]\nname = "secure"\ntransport = "tcp"\ndrain_s = 1.0\n'
        '[security]\nkeys_dir = "keys"\n'
        # Eager batches and generous allowances: a loaded test machine's lateness sheds nothing.
        '[scheduler]\npolicy = "eager"\nd_ctrl_ms = 5.0\n[frontends]\nreply_allowance_ms = 20.0\n'
        '[backends]\ndevice = "emulated"\n'
        '[[models]]\nname = "m"\nemulated = { alpha_ms = 1.0, beta_ms = 2.0 }\nslo_ms = 2000.0\n'
    )
    state_dir = tmp_path / "state"
    up = subprocess.run([*ZSERVE, "up", str(toml), "--detach", "--state-dir", str(state_dir)],
                        capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)
    assert up.returncode == 0, up.stderr
    try:
        address = up.stdout.strip()
        assert address.startswith("tcp://127.0.0.1:")
        executor: Any = build_executor("emulated", list(parse_config(
            {"models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0}}]}
        ).models))
        executor.load()
        (request,) = executor.synthetic_requests("m", 1, seed=5)
        with zserve.Client(address, timeout=CALL_TIMEOUT_S,
                           server_key=tmp_path / "keys" / "frontend.key",
                           client_key=tmp_path / "keys" / "client.key_secret") as client:
            outputs = client.infer("m", request)
        np.testing.assert_allclose(outputs["y"], executor.expected_outputs("m", request)["y"])
    finally:
        down = subprocess.run([*ZSERVE, "down", "--state-dir", str(state_dir)],
                              capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)
    assert down.returncode == 0, down.stderr
    log = (state_dir / "secure.log").read_text()
    assert f"with CURVE: server_key={tmp_path}/keys/frontend.key" in log
