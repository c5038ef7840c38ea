"""A network partition and its healing (F10, F11), in network namespaces this test creates: the
rank, the shard and the backend run in a namespace of their own, joined to the frontend's (the
test's) by a veth pair, every role over tcp. Under open-loop load the link goes down for
``CUT_S`` and comes up again. Requests during the cut get one typed error each (the frontend's
deadline timer answers what the cut swallowed); after the healing the cluster serves again and
no request is answered twice, nor with another's outputs (the ledger, tests/fault_harness.py).
Results that cross the healed link for requests already answered are refused by the frontend.

Needs root and ``ip netns`` (iproute2); skipped where either is missing, naming what is missing
or the ``ip`` command that failed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_harness import OK, Ledger, Load, drive, wait_served
from runtime_helpers import ask_frontend_stats, wait_until
from test_runtime_multihost import Role

from zserve.config.cluster import load_config
from zserve.transport.messages import StatsRequest

CUT_S = 3.0
SLO_MS = 1000.0
START_TIMEOUT_S = 60.0
# 10.213.<n>.0/30 per test process: the veth pair's two ends.
SUBNET = 10 + os.getpid() % 200

CLUSTER_TOML = f"""
[cluster]
name = "partition"
transport = "tcp"
drain_s = 1.0

[scheduler]
shards = 1
d_ctrl_ms = 5.0

[frontends]
reply_allowance_ms = 20.0

[backends]
device = "emulated"

[[models]]
name = "m"
emulated = {{ alpha_ms = 2.0, beta_ms = 20.0 }}
slo_ms = {SLO_MS}
max_batch = 16
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Veth:
    """A namespace joined to this one by a veth pair (both ends up, addressed)."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100_000}"
        self.namespace = f"zsf-{tag}"
        self.here, self.there = f"zsfh{tag}", f"zsft{tag}"
        self.here_ip, self.there_ip = f"10.213.{SUBNET}.1", f"10.213.{SUBNET}.2"
        _ip("netns", "add", self.namespace)
        try:
            _ip("link", "add", self.here, "type", "veth", "peer", "name", self.there)
            _ip("link", "set", self.there, "netns", self.namespace)
            _ip("addr", "add", f"{self.here_ip}/30", "dev", self.here)
            _ip("link", "set", self.here, "up")
            _ip("-n", self.namespace, "addr", "add", f"{self.there_ip}/30", "dev", self.there)
            _ip("-n", self.namespace, "link", "set", self.there, "up")
            _ip("-n", self.namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def cut(self, down_s: float) -> None:
        """The fault: the link down for ``down_s`` (the cut's own length), then up again."""
        _ip("link", "set", self.here, "down")
        try:
            threading.Event().wait(down_s)
        finally:
            _ip("link", "set", self.here, "up")

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.here)  # also removes its peer
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", self.namespace)


@pytest.fixture
def veth() -> Iterator[Veth]:
    if os.geteuid() != 0:
        pytest.skip(f"network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); euid is "
                    f"{os.geteuid()}")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not on PATH")
    try:
        pair = Veth()
    except subprocess.CalledProcessError as exc:
        error = exc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [str(exc)]
        pytest.skip(f"`{' '.join(exc.cmd)}` failed: {error[0]}")
    try:
        yield pair
    finally:
        pair.close()


def _start(toml: Path, veth: Veth, roles: list[Role]) -> str:
    """rank, shard, backend in the namespace; the frontend here; returns the client address."""
    config = ["--config", str(toml)]
    there = f"tcp://{veth.there_ip}:0"
    rank = Role("rank", ["rank", *config, "--bind", there], prefix=veth.prefix())
    roles.append(rank)
    rank_address = rank.wait_ready()["rank"]
    shard = Role("shard-0", ["scheduler", *config, "--index", "0", "--rank", rank_address,
                             "--bind", there], prefix=veth.prefix())
    roles.append(shard)
    shard_address = shard.wait_ready()["shard"]
    backend = Role("backend-0", ["backend", *config, "--index", "0", "--rank", rank_address,
                                 "--bind", there], prefix=veth.prefix())
    roles.append(backend)
    backend.wait_ready()
    frontend = Role("frontend-0", ["frontend", *config, "--index", "0", "--rank", rank_address,
                                   "--shard", shard_address, "--client", "tcp://127.0.0.1:0",
                                   "--data", f"tcp://{veth.here_ip}:0"])
    roles.append(frontend)
    client_address: str = frontend.wait_ready()["client"]
    wait_until(lambda: "backend-0" in ask_frontend_stats(
                   client_address, StatsRequest(reset=False), b"partition-test")["backends"],
               lambda: "backend-0 in the frontend's table; logs:\n\n" + "\n\n".join(
                   f"{r.name}:\n{r.log()}" for r in roles),
               timeout_s=START_TIMEOUT_S)
    return client_address


def test_a_partition_between_frontend_and_scheduler_heals(tmp_path: Path, veth: Veth) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text(CLUSTER_TOML)
    ledger = Ledger(load_config(toml))
    roles: list[Role] = []
    try:
        address = _start(toml, veth, roles)
        run = asyncio.run(drive(address, ledger, Load(rate_rps=80.0, count=560, seed=11),
                                fault=lambda: veth.cut(CUT_S), fault_after=120, check=False))
        served_s = wait_served(address, ledger, first_index=10_000, count=16)
        counts = ledger.check()
        assert run.fault_at is not None
        disturbed_s = ledger.latest_failure_after(run.fault_at)
        stale = ask_frontend_stats(address, StatsRequest(reset=False), b"partition-test")
        assert [role.stop() for role in reversed(roles)] == [0, 0, 0, 0]
    finally:
        for role in roles:
            role.kill()
    print(f"partition {CUT_S} s: load {run.counts}; disturbed until {disturbed_s:.2f} s after "
          f"the cut began; served again {served_s:.2f} s after the load; all {counts}; frontend "
          f"late_outputs {stale['counters'].get('late_outputs')}")
    assert set(run.counts) <= {OK, "DEADLINE", "UNAVAILABLE", "BACKEND_FAILED"}, run.counts
    assert run.counts.get("DEADLINE", 0) > 0, run.counts  # the cut did swallow requests
    assert run.counts.get(OK, 0) > 0, run.counts
