"""A cluster whose processes do not share CLOCK_MONOTONIC, as on separate hosts.

Linux time namespaces give a process a shifted CLOCK_MONOTONIC (``unshare --time --monotonic
SECONDS --fork CMD``). The rank and the scheduler run as usual; the backend runs 1000 s ahead
and the frontend 2000 s ahead. Every role is started alone (``zserve rank|scheduler|backend|
frontend``) over tcp://127.0.0.1 with kernel-chosen ports, each read back from the role's
``ready: endpoints`` log line and handed to the next one's flags. Every request must come back
correct and within its SLO, and each process must report the offset its namespace imposes.

Without the clock sync the frontend's arrivals and deadlines lie 2000 s ahead of the scheduler's
clock, so batches are planned 2000 s late and every request ends DEADLINE; the backend would start
every plan at once, its ``started_at`` 1000 s after the plan's ``exec_at``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
from runtime_helpers import ask_frontend_stats, wait_until

import zserve
from zserve.backends.host import build_executor
from zserve.config.cluster import load_config
from zserve.loadgen.cpu import child_pids
from zserve.transport.messages import ClusterStatsRequest, StatsRequest
from zserve.transport.sockets import LOOPBACK_TCP_ANY_PORT

BACKEND_SHIFT_S = 1000  # the backend's CLOCK_MONOTONIC runs this far ahead of the rank's
FRONTEND_SHIFT_S = 2000
# How close each reported offset must be to its namespace's shift: all on one machine over
# loopback, so a round trip is well under a millisecond unless the machine is very busy.
OFFSET_TOLERANCE_S = 0.005
SLO_MS = 500.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
REQUESTS_ONE_BY_ONE = 12
REQUESTS_IN_BURST = 24
ZSERVE = [sys.executable, "-m", "zserve"]
READY_LINE = re.compile(r" ready: endpoints (\{.*\})$")

CLUSTER_TOML = f"""
[cluster]
name = "multihost"
transport = "tcp"
drain_s = 2.0

[scheduler]
shards = 1
# A batch runs a fifth of the SLO after its first request's arrival, an absolute time stamped
# by the frontend: a wrong clock shows at once. (Deferred batches, run at their last moment, are
# tested elsewhere; their grant window is too narrow for a 2-core machine this loaded.)
policy = "timeout:0.2"
d_ctrl_ms = 5.0

[frontends]
reply_allowance_ms = 20.0

[backends]
device = "emulated"

[[models]]
name = "m"
emulated = {{ alpha_ms = 1.0, beta_ms = 2.0 }}
slo_ms = {SLO_MS}
max_batch = 8
"""


@functools.cache
def _unshare_prefix() -> tuple[tuple[str, ...] | None, str]:
    """The command prefix that runs a command in a new time namespace (``{shift}`` to be
    filled in), or None and why not (the missing tool, or the last command tried and its
    error): probed once, by running a Python that reports its clock."""
    if shutil.which("unshare") is None:
        return None, "`unshare` (util-linux) is not on PATH"
    base = ("--time", "--monotonic", "{shift}")
    candidates = [
        ("unshare", *base, "--kill-child=SIGTERM"),  # root
        ("unshare", "--user", "--map-root-user", *base, "--kill-child=SIGTERM"),  # unprivileged
        ("unshare", *base, "--fork"),  # util-linux without --kill-child
        ("unshare", "--user", "--map-root-user", *base, "--fork"),
    ]
    probe = [sys.executable, "-c", "import time; print(time.monotonic())"]
    failure = ""
    for prefix in candidates:
        command = [part.format(shift=100) for part in prefix] + probe
        shown = " ".join(command[:len(prefix)])
        try:
            before = time.monotonic()
            done = subprocess.run(command, capture_output=True, text=True, timeout=30,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            failure = f"`{shown}`: {exc}"
            continue
        error = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        try:
            if done.returncode == 0 and float(done.stdout) - before >= 99.0:
                return prefix, ""
            failure = f"`{shown}` gave no shifted clock: {error[0]}"
        except ValueError:
            failure = f"`{shown}` printed no clock: {error[0]}"
    return None, ("a time namespace needs CAP_SYS_ADMIN (root) or unprivileged user "
                  f"namespaces, and Linux >= 5.6; {failure}")


@pytest.fixture
def unshare_prefix() -> tuple[str, ...]:
    prefix, reason = _unshare_prefix()
    if prefix is None:
        pytest.skip(reason)
    return prefix


class Role:
    """One role process (``zserve <role> ...``), optionally in a time namespace; its stderr is
    collected by a thread, which also spots the ``ready: endpoints`` line."""

    def __init__(self, name: str, args: list[str], prefix: list[str] | None = None) -> None:
        self.name = name
        self.lines: list[str] = []
        self.endpoints: dict[str, str] = {}
        self._ready = threading.Event()
        self.proc = subprocess.Popen([*(prefix or []), *ZSERVE, *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        with stream:  # closed at EOF: the pipe is this thread's to close
            for line in stream:
                self.lines.append(line.rstrip("\n"))
                match = READY_LINE.search(line.rstrip("\n"))
                if match and not self._ready.is_set():
                    self.endpoints = json.loads(match.group(1))
                    self._ready.set()
        self._ready.set()  # the process ended: stop waiting

    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self) -> dict[str, str]:
        assert self._ready.wait(START_TIMEOUT_S) and self.endpoints, (
            f"{self.name} did not report its endpoints:\n{self.log()}"
        )
        return self.endpoints

    def role_pid(self) -> int:
        """The role process itself: the Popen's own pid, or its child under ``unshare``."""
        children = child_pids(self.proc.pid)
        return children[0] if children else self.proc.pid

    def stop(self) -> int:
        """SIGTERM the role (it drains and exits; ``unshare`` passes on its exit status)."""
        if self.proc.poll() is None:
            os.kill(self.role_pid(), signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        finally:
            self._reader.join(STOP_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in child_pids(self.proc.pid):
                os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)
        self._reader.join(STOP_TIMEOUT_S)  # the reader closes the pipe at EOF


def _ask(address: str, request: Any) -> dict[str, Any]:
    return ask_frontend_stats(address, request, f"multihost-test-{os.getpid()}".encode())


def _in_namespace(prefix: tuple[str, ...], shift_s: int) -> list[str]:
    return [part.format(shift=shift_s) for part in prefix]


def _start_roles(toml: Path, unshare_prefix: tuple[str, ...], roles: list[Role]) -> str:
    """Start rank, shard, backend (shifted clock) and frontend (shifted clock), appending each to
    ``roles`` as it starts (so the caller kills what started); returns the client address."""
    config = ["--config", str(toml)]
    any_port = LOOPBACK_TCP_ANY_PORT
    rank = Role("rank", ["rank", *config, "--bind", any_port])
    roles.append(rank)
    rank_address = rank.wait_ready()["rank"]
    shard = Role("shard-0", ["scheduler", *config, "--index", "0", "--rank", rank_address,
                             "--bind", any_port])
    roles.append(shard)
    shard_address = shard.wait_ready()["shard"]
    backend = Role("backend-0", ["backend", *config, "--index", "0", "--rank", rank_address,
                                 "--bind", any_port],
                   prefix=_in_namespace(unshare_prefix, BACKEND_SHIFT_S))
    roles.append(backend)
    backend.wait_ready()
    frontend = Role("frontend-0", ["frontend", *config, "--index", "0",
                                   "--rank", rank_address, "--shard", shard_address,
                                   "--client", any_port, "--data", any_port],
                    prefix=_in_namespace(unshare_prefix, FRONTEND_SHIFT_S))
    roles.append(frontend)
    client_address: str = frontend.wait_ready()["client"]
    # Serving once the frontend has the backend in its table.
    wait_until(lambda: "backend-0" in _ask(client_address, StatsRequest(reset=False))["backends"],
               lambda: "backend-0 in the frontend's table; logs:\n\n" + "\n\n".join(
                   f"{r.name}:\n{r.log()}" for r in roles),
               timeout_s=START_TIMEOUT_S)
    return client_address


def _serve_within_slo(client_address: str, toml: Path) -> int:
    """Requests one by one, then a burst, each answer checked against the model run locally and
    within the SLO; returns how many requests were sent."""
    model = load_config(toml).model("m")
    executor: Any = build_executor("emulated", [model])
    executor.load()
    inputs = executor.synthetic_requests("m", REQUESTS_ONE_BY_ONE + REQUESTS_IN_BURST, seed=3)
    slo_s = SLO_MS / 1e3
    latencies: list[float] = []
    with zserve.Client(client_address, timeout=30, max_retries=0) as client:
        for request in inputs[:REQUESTS_ONE_BY_ONE]:
            sent = time.monotonic()
            outputs = client.infer("m", request)
            latencies.append(time.monotonic() - sent)
            np.testing.assert_allclose(outputs["y"],
                                       executor.expected_outputs("m", request)["y"])
        sent = time.monotonic()
        burst = [client.submit("m", r) for r in inputs[REQUESTS_ONE_BY_ONE:]]
        for request, future in zip(inputs[REQUESTS_ONE_BY_ONE:], burst, strict=True):
            outputs = future.result(30)
            np.testing.assert_allclose(outputs["y"],
                                       executor.expected_outputs("m", request)["y"])
        latencies.append(time.monotonic() - sent)  # the burst's last answer
    # The first request's time also covers opening the client's connection: not held to it.
    assert max(latencies[1:]) < slo_s, latencies
    return len(inputs)


def _check_cluster_clocks(client_address: str, requests_sent: int) -> None:
    """Every peer's clock offset is the shift of its namespace, and cross-process times agree."""
    # Every peer's stats (the frontend waits 0.5 s for them: ask again if one was slower).
    last: dict[str, Any] = {}

    def every_peer_answered() -> dict[str, Any] | None:
        last.clear()
        last.update(_ask(client_address, ClusterStatsRequest(reset=False)))
        return None if last["cluster_silent"] else dict(last)

    stats = wait_until(every_peer_answered,
                       lambda: f"every peer's stats; silent: {last.get('cluster_silent')}",
                       timeout_s=START_TIMEOUT_S)
    cluster = stats["cluster"]
    offsets = {
        "frontend-0": (stats["clock"], -FRONTEND_SHIFT_S),
        "backend-0": (cluster["backend-0"]["clock"], -BACKEND_SHIFT_S),
        "shard-0": (cluster["shard-0"]["clock"], 0),
        "rank": (cluster["rank"]["clock"], 0),
    }
    for name, (clock, expected_s) in offsets.items():
        error_s = abs(clock["offset_s"] - expected_s)
        assert error_s < OFFSET_TOLERANCE_S, (name, clock)
        assert error_s <= clock["error_ms"] / 1e3 + 1e-6, (name, clock)  # the bound holds
    assert offsets["shard-0"][0]["same_host"] and offsets["shard-0"][0]["offset_s"] == 0.0
    assert offsets["rank"][0]["reference"]
    assert not offsets["backend-0"][0]["same_host"]
    # Times that cross processes are consistent: batches start at their exec_at (the rank's
    # lateness, started_at - exec_at) and after their requests arrived (the frontend's
    # queueing, started_at - arrival), never 1000 s off.
    lateness = cluster["rank"]["latency"]["lateness"]
    assert lateness["p50_ms"] > -OFFSET_TOLERANCE_S * 1e3 and lateness["max_ms"] < SLO_MS, (
        lateness)
    # The frontend's own view of every request, admission to answer (the first included).
    assert stats["latency"]["admit_to_answer"]["p99_ms"] < SLO_MS, stats["latency"]
    queueing = stats["latency"]["queueing"]
    assert queueing["count"] == REQUESTS_ONE_BY_ONE + REQUESTS_IN_BURST
    assert 0.0 <= queueing["p50_ms"] < SLO_MS, queueing
    assert cluster["backend-0"]["counters"]["requests_ok"] == requests_sent


def test_cluster_across_clock_namespaces(tmp_path: Path, unshare_prefix: tuple[str, ...]) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text(CLUSTER_TOML)
    roles: list[Role] = []
    try:
        client_address = _start_roles(toml, unshare_prefix, roles)
        requests_sent = _serve_within_slo(client_address, toml)
        _check_cluster_clocks(client_address, requests_sent)
        for role in reversed(roles):
            assert role.stop() == 0, f"{role.name}:\n{role.log()}"
    finally:
        for role in roles:
            role.kill()
