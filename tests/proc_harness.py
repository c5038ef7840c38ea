"""Shared harness of the process tests (tests/test_proc_*.py): real role processes, real sockets.

The test plays the supervisor (a ``control`` ROUTER: it receives each child's ``Ready`` and
answers with the peer map) and whatever peers a test needs (a rank ROUTER, a frontend ``data``
ROUTER, a shard DEALER...). Every wait is a ``poll`` with a timeout on a socket: nothing sleeps to
wait, and a test that would hang fails with a message instead. Every child is reaped.

A ROUTER the test plays the rank on answers ``ClockProbe`` by itself, as the rank does (every
other process estimates its offset to the rank's clock before it serves; the test shares the
children's host, so they find offset 0).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq

from zserve.config.cluster import ClusterConfig, RoleConfig, parse_config, role_config
from zserve.runtime.clock import reply_to_probe
from zserve.transport import socket_io
from zserve.transport.messages import BatchPlan, ClockProbe, Message, PlanAck, Ready
from zserve.transport.sockets import make_dealer, make_router

WAIT_S = 20.0  # generous: the machine is shared; a healthy test never waits this long
REAP_S = 10.0

M = TypeVar("M", bound=Message)

_ENTRY = {
    "backend": "zserve.backends.host:run_backend",
    "shard": "zserve.scheduler.shard_process:run_shard",
    "rank": "zserve.scheduler.rank_host:run_rank",
}

_RUNNER = """
import importlib, sys
import msgspec
from zserve.config.cluster import RoleConfig
module, _, func = sys.argv[1].partition(":")
config = msgspec.json.decode(sys.argv[2], type=RoleConfig)
control = sys.argv[3] or None
sys.exit(getattr(importlib.import_module(module), func)(config, control))
"""


def cluster_config(models: list[dict[str, Any]], **sections: Any) -> ClusterConfig:
    """A ClusterConfig from cluster.toml-shaped dicts (``models`` is the [[models]] list)."""
    return parse_config({"models": models, **sections})


def role_config_for(
    cluster: ClusterConfig, role: str, index: int, ipc_dir: Path
) -> RoleConfig:
    return role_config(cluster, role, index, ipc_dir=str(ipc_dir))


class Child:
    """One role process started with ``run_<role>(config, control_address)``."""

    def __init__(self, role: str, config: RoleConfig, control: str | None, log_dir: Path):
        self.role = role
        self.name: str = config.name
        self.log_path = log_dir / f"{self.name}.log"
        env = dict(os.environ, ZSERVE_LOG_LEVEL=os.environ.get("ZSERVE_LOG_LEVEL", "INFO"))
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _RUNNER, _ENTRY[role], msgspec.json.encode(config).decode(),
                 control or ""],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = REAP_S) -> int:
        return self.proc.wait(timeout=timeout)

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=REAP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=REAP_S)


class Peer:
    """A sync socket the test drives (a ROUTER it binds or a DEALER it connects)."""

    def __init__(self, sock: zmq.Socket[Any], endpoint: str, router: bool) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.router = router
        self.backlog: list[tuple[bytes | None, Message]] = []
        # A ROUTER playing a backend's plan socket acknowledges each BatchPlan as it reads it,
        # as a live backend's batch loop does (False: a hung backend, which the shard suspects).
        self.ack_plans = True

    def send(self, msg: Message, identity: bytes | str | None = None) -> None:
        if isinstance(identity, str):
            identity = identity.encode()
        socket_io.sync_send(self.sock, msg, identity=identity)

    def _receive(self) -> tuple[bytes | None, Message] | None:
        """One queued message; None for a clock probe, which it answers (as the rank would)."""
        identity, msg = socket_io.sync_recv(self.sock, router=self.router)
        if self.router and isinstance(msg, ClockProbe):
            self.send(reply_to_probe(msg), identity)
            return None
        if self.router and self.ack_plans and isinstance(msg, BatchPlan):
            self.send(PlanAck([msg.plan_id], time.monotonic()), identity)
        return identity, msg

    def recv(self, timeout: float = WAIT_S) -> tuple[bytes | None, Message]:
        if self.backlog:
            return self.backlog.pop(0)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise TimeoutError(f"nothing arrived at {self.endpoint} within {timeout} s")
            received = self._receive()
            if received is not None:
                return received

    def expect(self, kind: type[M], timeout: float = WAIT_S,
               where: Callable[[M], bool] | None = None) -> tuple[bytes | None, M]:
        """The next message of ``kind`` (matching ``where``); others are kept in the backlog."""
        deadline = time.monotonic() + timeout
        skipped: list[tuple[bytes | None, Message]] = []
        try:
            while True:
                for i, (identity, msg) in enumerate(self.backlog):
                    if isinstance(msg, kind) and (where is None or where(msg)):
                        del self.backlog[i]
                        return identity, msg
                left = deadline - time.monotonic()
                if left <= 0 or not self.sock.poll(int(left * 1000)):
                    seen = [type(m).__name__ for _, m in skipped + self.backlog]
                    raise TimeoutError(
                        f"no {kind.__name__} at {self.endpoint} within {timeout} s; saw {seen}"
                    )
                received = self._receive()
                if received is None:
                    continue
                identity, msg = received
                if isinstance(msg, kind) and (where is None or where(msg)):
                    return identity, msg
                skipped.append((identity, msg))
        finally:
            self.backlog.extend(skipped)

    def drain_kind(self, kind: type[M]) -> list[M]:
        """Every ``kind`` message already received or queued, without waiting."""
        out: list[M] = [m for _, m in self.backlog if isinstance(m, kind)]
        self.backlog = [(i, m) for i, m in self.backlog if not isinstance(m, kind)]
        while self.sock.poll(0):
            received = self._receive()
            if received is None:
                continue
            identity, msg = received
            if isinstance(msg, kind):
                out.append(msg)
            else:
                self.backlog.append((identity, msg))
        return out


class Harness:
    """Owns the test's sockets and children; ``close()`` reaps everything."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.children: list[Child] = []
        self.peers: list[Peer] = []
        self.control = self.router("control")

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.dir}/{name}"

    def router(self, name: str) -> Peer:
        sock, endpoint = make_router(self.ctx, self.endpoint(name), name=name)
        peer = Peer(sock, endpoint, router=True)
        self.peers.append(peer)
        return peer

    def dealer(self, connect: str, identity: str) -> Peer:
        sock = make_dealer(self.ctx, connect, identity=identity.encode())
        peer = Peer(sock, connect, router=False)
        self.peers.append(peer)
        return peer

    def start(self, role: str, config: RoleConfig) -> Child:
        child = Child(role, config, self.control.endpoint, self.dir)
        self.children.append(child)
        return child

    def await_ready(self, child: Child, peers: dict[str, str],
                    timeout: float = WAIT_S) -> Ready:
        """Wait for ``child``'s Ready, answer with the peer map, return its Ready."""
        try:
            identity, ready = self.control.expect(
                Ready, timeout, where=lambda m: m.name == child.name
            )
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n--- {child.name} log:\n{child.log()}") from None
        self.control.send(Ready("supervisor", "supervisor", os.getpid(), peers), identity)
        return ready

    def close(self) -> None:
        for child in self.children:
            child.reap()
        for peer in self.peers:
            peer.sock.close(linger=0)
        self.ctx.term()
