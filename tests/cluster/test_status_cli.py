"""``zserve status ADDRESS`` against a running cluster, run as the real command in a subprocess:
it names every role, each model with its SLO and readiness, each backend with its device, and
the request rates; against a cluster ``zserve up --detach`` started, each role's pid and restart
count from the state file its supervisor rewrites (a killed backend: a new pid, one restart)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from runtime_helpers import wait_until

from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import parse_config

ZSERVE = [sys.executable, "-m", "zserve"]
COMMAND_TIMEOUT_S = 120.0
CLUSTER_TOML = """
[cluster]
name = "statustest"
drain_s = 2.0

[scheduler]
shards = 0
jitter_ms = 50.0

[backends]
count = 2
device = "emulated"

[[models]]
name = "m"
emulated = { alpha_ms = 1.0, beta_ms = 2.0, input_shape = [4] }
slo_ms = 1500.0
"""


def test_status_prints_roles_models_backends_and_rates(tmp_path: Path) -> None:
    config = parse_config({
        "cluster": {"drain_s": 2.0},
        "scheduler": {"shards": 0, "jitter_ms": 50.0},  # room for a loaded host
        "backends": {"count": 2, "device": "emulated"},
        "models": [{"name": name, "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0,
                                               "input_shape": [4]},
                    "slo_ms": 1500.0} for name in ("alpha", "beta")],
    })
    with Cluster(config, ipc_base=tmp_path) as cluster:
        done = subprocess.run(
            [sys.executable, "-m", "zserve", "status", cluster.client_address,
             "--interval", "0.2"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"cluster at {cluster.client_address}: ready" in out, out
    for role_line in ("frontend-0   frontend  up", "shard-0      shard", "backend-0    backend",
                      "backend-1    backend"):
        assert role_line in out, out
    assert "alpha        SLO 1500 ms  ready  backends 2 warmed / 2 live  arrivals 0.0 r/s" \
        "  queued 0  in flight 0" in out, out
    assert "beta         SLO 1500 ms  ready" in out, out
    assert "backend-0    device emulated" in out, out
    assert "requests over the last 0.2 s: received 0.0 r/s" in out, out


def test_status_of_an_address_where_nothing_answers_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zserve", "status", f"ipc://{tmp_path}/nothing",
         "--interval", "0"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "no StatsReply from the frontend" in done.stderr


def _status(*args: str) -> str:
    done = subprocess.run([*ZSERVE, "status", *args, "--interval", "0.1"], capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(path.read_text())
    return state


def _role_line(out: str, name: str) -> str:
    (line,) = [line for line in out.splitlines()
               if line.startswith(f"  {name} ") and "restarts" in line]  # under "roles:"
    return line


def test_status_shows_pids_and_restarts_of_a_cluster_zserve_up_started(tmp_path: Path) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text(CLUSTER_TOML)
    state_dir = tmp_path / "state"
    state_path = state_dir / "statustest.json"
    up = subprocess.run([*ZSERVE, "up", str(toml), "--detach", "--state-dir", str(state_dir),
                         "--ipc-dir", str(tmp_path)], capture_output=True, text=True,
                        timeout=COMMAND_TIMEOUT_S, check=False)
    assert up.returncode == 0, up.stderr
    try:
        state = _state(state_path)
        address = state["client_addresses"][0]
        out = _status(address, "--state-dir", str(state_dir))
        for name in ("frontend-0", "shard-0", "backend-0", "backend-1"):
            assert f"pid {state['pids'][name]}  restarts 0" in _role_line(out, name), out
        old_pid = state["pids"]["backend-1"]
        os.kill(old_pid, signal.SIGKILL)

        def restarted() -> dict[str, Any] | None:
            with contextlib.suppress(ValueError):  # not a torn read: written by rename
                current = _state(state_path)
                if current["restarts"]["backend-1"] == 1:
                    return current
            return None

        state = wait_until(restarted, "the supervisor to record backend-1's restart",
                           timeout_s=COMMAND_TIMEOUT_S)
        assert state["pids"]["backend-1"] != old_pid
        out = _status("--state-dir", str(state_dir))  # the recorded cluster's address
        assert f"pid {state['pids']['backend-1']}  restarts 1" in _role_line(out, "backend-1")
        assert "restarts 0" in _role_line(out, "backend-0"), out
    finally:
        down = subprocess.run([*ZSERVE, "down", "--state-dir", str(state_dir)],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              check=False)
    assert down.returncode == 0, down.stderr


WORKLOAD_TOML = """
[workload]
name = "bench-at-address"
gpus = 2
seed = 1
rate = 20
arrival = "poisson"
warmup_s = 0.5
measure_s = 1.0
cooldown_s = 0.5

[[models]]
name = "m"
slo_ms = 1500.0
alpha_ms = 1.0
beta_ms = 2.0
"""


def test_bench_at_an_address_finds_the_oip_port_the_kernel_picked(tmp_path: Path) -> None:
    # `zserve up` records where its frontends serve the Open Inference Protocol (port 0 in the
    # config: the kernel's pick), and `zserve bench ADDRESS --protocol http-json` sends there
    toml = tmp_path / "cluster.toml"
    toml.write_text(CLUSTER_TOML.replace(
        "[backends]", '[frontends]\nhttp_addresses = ["127.0.0.1:0"]\n\n[backends]'))
    workload = tmp_path / "workload.toml"
    workload.write_text(WORKLOAD_TOML)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "runtime")}
    up = subprocess.run([*ZSERVE, "up", str(toml), "--detach", "--ipc-dir", str(tmp_path)],
                        capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False,
                        env=env)
    assert up.returncode == 0, up.stderr
    try:
        state = _state(tmp_path / "runtime" / "zserve" / "statustest.json")
        (http,) = state["oip_addresses"]["http"]
        assert not http.endswith(":0"), state
        bench = subprocess.run(
            [*ZSERVE, "bench", state["client_addresses"][0], str(workload), "--cluster",
             str(toml), "--protocol", "http-json", "--rate", "20", "--no-progress"],
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False, env=env)
        assert bench.returncode == 0, bench.stderr + bench.stdout
        # every request sent over HTTP was answered in time (a Poisson second: not exactly 20)
        assert re.search(r"offered ([\d.]+) r/s  good \1 r/s  worst bad rate 0\.000%",
                         bench.stdout), bench.stdout
    finally:
        down = subprocess.run([*ZSERVE, "down"], capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False, env=env)
    assert down.returncode == 0, down.stderr
