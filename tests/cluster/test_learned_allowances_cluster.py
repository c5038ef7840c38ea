"""Learned allowances in a running cluster (``[scheduler] allowances``): after some batches the
shard's d_ctrl and jitter and the frontend's reply allowance are learned from the hops they
measured, stay within their floor and the configured cap, and show in the cluster's stats and in
``zserve status``; ``allowances = "fixed"`` keeps the configured values."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from runtime_helpers import ask_frontend_stats

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import parse_config
from zserve.core.allowances import FLOOR_D_CTRL_S, FLOOR_JITTER_S, FLOOR_REPLY_S, MIN_SAMPLES
from zserve.core.errors import DeadlineError
from zserve.transport.messages import ClusterStatsRequest

CAP_MS = {"d_ctrl": 4.0, "jitter": 3.0, "reply": 5.0}
WAVES = 2 * MIN_SAMPLES  # one batch each at least: the window fills
WAVE = 3


def _config(mode: str) -> Any:
    return parse_config({
        "cluster": {"drain_s": 2.0},
        "scheduler": {"shards": 0, "allowances": mode, "d_ctrl_ms": CAP_MS["d_ctrl"],
                      "jitter_ms": CAP_MS["jitter"]},
        "frontends": {"count": 1, "reply_allowance_ms": CAP_MS["reply"]},
        "backends": {"count": 2, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 0.2, "beta_ms": 1.0,
                                              "input_shape": [4]},
                    "slo_ms": 100.0, "max_batch": 8}],
    })


def _run_waves(address: str) -> None:
    """Waves of a few requests, each answered before the next: every wave is a batch or more.
    A loaded host may miss a deadline now and then (a stall of tens of ms): that is an answer
    too, and a third at least must be outputs."""
    answered = 0
    with zserve.Client(address, timeout=10) as client:
        x = np.ones((1, 4), np.float32)
        for _ in range(WAVES):
            futures = [client.submit("m", {"x": x}) for _ in range(WAVE)]
            for future in futures:
                with contextlib.suppress(DeadlineError):
                    future.result()
                    answered += 1
    assert answered >= WAVES  # a third at least: the batches the allowances learn from


def _shard_allowances(address: str) -> tuple[dict[str, Any], dict[str, Any]]:
    stats = ask_frontend_stats(address, ClusterStatsRequest(reset=False), b"test-allowances")
    return stats["cluster"]["shard-0"]["allowances"], stats["reply_allowance"]


def _within(entry: dict[str, Any], floor_s: float, cap_ms: float) -> None:
    assert entry["cap_ms"] == cap_ms
    assert floor_s * 1e3 <= entry["value_ms"] <= cap_ms, entry
    assert entry["samples"] >= MIN_SAMPLES and entry["target_ms"] is not None, entry
    assert entry["p99_ms"] is not None and entry["p99_ms"] >= 0.0


def test_learned_allowances_are_measured_bounded_and_shown(tmp_path: Path) -> None:
    with Cluster(_config("learned"), ipc_base=tmp_path) as cluster:
        _run_waves(cluster.client_address)
        shard, reply = _shard_allowances(cluster.client_address)
        status = subprocess.run(
            [sys.executable, "-m", "zserve", "status", cluster.client_address,
             "--interval", "0.1"], capture_output=True, text=True, timeout=60, check=False)
    assert shard["mode"] == "learned" and reply["mode"] == "learned"
    _within(shard["d_ctrl"], FLOOR_D_CTRL_S, CAP_MS["d_ctrl"])
    _within(shard["jitter"], FLOOR_JITTER_S, CAP_MS["jitter"])
    _within(reply, FLOOR_REPLY_S, CAP_MS["reply"])
    assert status.returncode == 0, status.stderr
    assert "allowances: shard-0 d_ctrl " in status.stdout, status.stdout
    assert "(learned: p95 " in status.stdout and ", p99 " in status.stdout, status.stdout
    assert "cap 4)" in status.stdout, status.stdout


def test_fixed_allowances_keep_the_configured_values(tmp_path: Path) -> None:
    with Cluster(_config("fixed"), ipc_base=tmp_path) as cluster:
        _run_waves(cluster.client_address)
        shard, reply = _shard_allowances(cluster.client_address)
    assert shard == {"mode": "fixed", "d_ctrl": {"value_ms": CAP_MS["d_ctrl"]},
                     "jitter": {"value_ms": CAP_MS["jitter"]}}
    assert reply == {"mode": "fixed", "value_ms": CAP_MS["reply"]}
