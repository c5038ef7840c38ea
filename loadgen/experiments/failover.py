"""``failover``: the scheduler SIGKILLed under load, hot spare (``standby = true``) against a
plain supervisor restart (``standby = false``); and SIGSTOPped (hung) with a hot spare, resumed
once the load is over.

Each run starts a cluster of two emulated backends, sends open-loop load from the public client
(``RATE_RPS`` for ``LOAD_S``), SIGKILLs (or SIGSTOPs) the active scheduler after ``KILL_AT_S``
and measures

- the takeover time: from the kill to the first plan the successor sends (its ``first_plan_at``
  on the cluster clock, which is this host's CLOCK_MONOTONIC), and
- the requests lost: every request's answer, by kind (a request the client sent gets exactly one
  answer; anything but its outputs is counted as lost).

A hung scheduler is resumed after the load: the plans it still makes are refused by the
backends (their ``stale_epoch``), and it steps down (it exits; the supervisor restarts it as the
standby). The figure of each mode is the median over ``--quick`` 1 run, else ``RUNS`` runs.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import tempfile
import time
from typing import Any

import numpy as np

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import STANDBY_NAME, ClusterConfig, parse_config
from zserve.loadgen.experiments.common import Check, Options, Outcome, Table

RATE_RPS = 100.0
LOAD_S = 6.0
KILL_AT_S = 2.0
SLO_MS = 500.0
RUNS = 5
ANSWER_WAIT_S = 30.0
POLL_S = 0.05


def failover_cluster(*, standby: bool) -> ClusterConfig:
    return parse_config({
        "cluster": {"drain_s": 1.0},
        "scheduler": {"standby": standby, "d_ctrl_ms": 5.0},
        "frontends": {"reply_allowance_ms": 20.0},
        "backends": {"count": 2, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 2.0, "beta_ms": 20.0},
                    "slo_ms": SLO_MS, "max_batch": 16}],
    })


MODES = (("hot spare", True, signal.SIGKILL), ("plain restart", False, signal.SIGKILL),
         ("hot spare, hang", True, signal.SIGSTOP))


async def _load(address: str, cluster: Cluster, requests: int,
                sig: int) -> tuple[dict[str, int], float]:
    """Open loop; signals ``shard-0`` when due; the answers by kind and the signal's moment."""
    x = {"x": np.zeros((1, 4), np.float32)}
    kill_at = 0.0
    async with zserve.AsyncClient(address, timeout=ANSWER_WAIT_S, max_retries=0) as client:
        futures = []
        start = time.monotonic()
        for i in range(requests):
            delay = start + i / RATE_RPS - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if not kill_at and time.monotonic() - start >= KILL_AT_S:
                kill_at = time.monotonic()
                cluster.kill("shard-0", sig)
            futures.append(client.submit("m", x))
        await asyncio.wait(futures, timeout=ANSWER_WAIT_S)
    kinds: dict[str, int] = {}
    for future in futures:
        kind = "no answer"
        if future.done():
            error = future.exception()
            kind = "OK" if error is None else getattr(getattr(error, "kind", None), "value",
                                                       type(error).__name__)
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds, kill_at


def _successor_first_plan(cluster: Cluster, standby: bool, kill_at: float) -> float:
    """When the scheduler that replaced the killed one sent its first plan (bounded poll)."""
    name = STANDBY_NAME if standby else "shard-0"
    end = time.monotonic() + ANSWER_WAIT_S
    while time.monotonic() < end:
        try:
            first = float(cluster.stats(name).get("first_plan_at", 0.0))
        except (RuntimeError, TimeoutError):
            first = 0.0
        if first > kill_at:
            return first
        time.sleep(POLL_S)
    return float("nan")


def one_run(*, standby: bool, sig: int = signal.SIGKILL) -> dict[str, Any]:
    requests = int(RATE_RPS * LOAD_S)
    with tempfile.TemporaryDirectory(prefix="zs-failover-") as folder, Cluster(
            failover_cluster(standby=standby), ipc_base=folder) as cluster:
        kinds, kill_at = asyncio.run(_load(cluster.client_address, cluster, requests, sig))
        first = _successor_first_plan(cluster, standby, kill_at)
        stale = 0
        if sig == signal.SIGSTOP:
            cluster.kill("shard-0", signal.SIGCONT)
            cluster.wait_ready("shard-0", incarnation=2)  # it stepped down: back as standby
            stale = sum(int(cluster.stats(b)["counters"].get("stale_epoch", 0))
                        for b in ("backend-0", "backend-1"))
    return {"standby": standby, "signal": signal.Signals(sig).name,
            "takeover_s": first - kill_at, "answers": kinds,
            "lost": requests - kinds.get("OK", 0), "requests": requests,
            "stale_plans_refused": stale}


def run_failover(opts: Options) -> Outcome:
    runs = 1 if opts.quick else RUNS
    points: dict[str, Any] = {"runs": []}
    rows = []
    medians: dict[str, float] = {}
    for label, standby, sig in MODES:
        results = []
        for run in range(runs):
            opts.say(f"failover: {label}, run {run + 1}/{runs}")
            results.append(one_run(standby=standby, sig=sig))
        points["runs"] += results
        takeover = statistics.median(r["takeover_s"] for r in results)
        lost = statistics.median(r["lost"] for r in results)
        kinds = sorted({k for r in results for k in r["answers"] if k != "OK"})
        by_kind = ", ".join(
            f"{k} {statistics.median(r['answers'].get(k, 0) for r in results):g}" for k in kinds)
        medians[label] = takeover
        stale = statistics.median(r["stale_plans_refused"] for r in results)
        rows.append([label, signal.Signals(sig).name, f"{takeover * 1e3:.0f}", f"{lost:g}",
                     by_kind or "-", f"{stale:g}", results[0]["requests"]])
    table = Table(f"scheduler failure under {RATE_RPS:g} r/s (SLO {SLO_MS:g} ms), median of "
                  f"{runs} run(s)", ["mode", "signal", "takeover ms", "requests lost",
                                     "lost by kind", "old plans refused", "requests"], rows)
    check = Check("the hot spare takes over faster than a restart",
                  medians["hot spare"] < medians["plain restart"],
                  f"{medians['hot spare'] * 1e3:.0f} ms vs {medians['plain restart'] * 1e3:.0f} ms")
    config = {"rate_rps": RATE_RPS, "load_s": LOAD_S, "kill_at_s": KILL_AT_S, "slo_ms": SLO_MS,
              "runs": runs}
    return Outcome(config=config, tables=[table], checks=[check], points=points)
