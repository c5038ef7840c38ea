"""``zserve status ADDRESS`` against a running cluster, run as the real command in a subprocess:
it names every role, each model with its SLO and readiness, each backend with its device, and
the request rates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zserve.config import parse_config
from zserve.supervisor import Cluster


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
    assert "alpha        SLO 1500 ms  ready  backends 2 warmed / 2 live" in out, out
    assert "beta         SLO 1500 ms  ready" in out, out
    assert "backend-0    device emulated" in out, out
    assert "requests over the last 0.2 s: received 0.0 r/s" in out, out


def test_status_of_an_address_where_nothing_answers_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zserve", "status", f"ipc://{tmp_path}/nothing",
         "--interval", "0"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "no StatsReply from the frontend" in done.stderr
