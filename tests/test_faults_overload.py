"""Overload (F12, feature 1): open-loop Poisson load at three times the cluster's capacity. The
frontend's admission control refuses the excess at once with OVERLOADED (never ran, retryable);
the requests it admits still meet their SLO (>= 99% answered with their own outputs within it);
every request gets exactly one outcome (the ledger of tests/fault_harness.py).

At the default admission bound (``max_wait_ms`` = the SLO) the frontend admits requests whose
predicted queueing alone takes the whole SLO, so about a tenth of those it admits at 3x miss it
(0.51-0.93 measured): an open defect, held by the strict xfail below until the default changes. With
``max_wait_ms`` at half the SLO every admitted request meets it at the same goodput."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest
from fault_harness import OK, Ledger, Load, drive, fault_cluster

from zserve.supervisor import Cluster

# Slow enough that a loaded 2-core machine's stalls (100-200 ms) are small against the SLO.
SLO_S = 2.0
# One emulated GPU, l(b) = 40 b + 160 ms up to b = 8: the frontend's analytic capacity at a 2 s
# SLO is 8 / 480 ms = 16.7 requests/s (the largest batch whose l(b) fits the SLO / (1 + 1/N)).
CAPACITY_RPS = 8 / 0.480
OVERLOAD = 3.0
REQUESTS = 450  # ~9 s of load: ~150 admitted, so one stalled miss is under 1%
# The client measures from its send to its receive: the SLO runs from admission at the frontend,
# a hop later. A loaded 2-core machine's hops take a few ms; this allows for more.
HOP_ALLOWANCE_S = 0.05


def test_overload_at_three_times_capacity_keeps_admitted_requests_within_slo(
        tmp_path: Path) -> None:
    _overload(tmp_path, max_wait_ms=SLO_S * 1e3 / 2)


@pytest.mark.xfail(strict=True, reason="the default admission bound (max_wait_ms = slo_ms) "
                   "admits requests that then miss their SLO: 0.51-0.93 within it at 3x")
def test_overload_at_the_default_admission_bound(tmp_path: Path) -> None:
    _overload(tmp_path, max_wait_ms=None)


def _overload(tmp_path: Path, max_wait_ms: float | None) -> None:
    config = fault_cluster(backends=1, alpha_ms=40.0, beta_ms=160.0, slo_ms=SLO_S * 1e3,
                           max_batch=8, max_wait_ms=max_wait_ms)
    ledger = Ledger(config)
    with Cluster(config, ipc_base=tmp_path) as cluster:
        run = asyncio.run(drive(cluster.client_address, ledger,
                                Load(rate_rps=OVERLOAD * CAPACITY_RPS, count=REQUESTS, seed=7)))
    latency = {i: ledger.answered_at[i] - sent for i, sent in ledger.sent.items()}
    kinds = {i: outcome[0] for i, outcome in ledger.outcomes.items()}
    admitted = [i for i, kind in kinds.items() if kind != "OVERLOADED"]
    within = [i for i in admitted if kinds[i] == OK and latency[i] <= SLO_S + HOP_ALLOWANCE_S]
    refused = sorted(latency[i] for i, kind in kinds.items() if kind == "OVERLOADED")
    attainment = len(within) / len(admitted)
    goodput = len(within) / run.sent_s
    print(f"overload x{OVERLOAD}, max_wait_ms {max_wait_ms}: {run.counts}; admitted "
          f"{len(admitted)}, within the SLO {attainment:.4f}; goodput {goodput:.1f} r/s of "
          f"{CAPACITY_RPS:.1f}; OVERLOADED answered in "
          f"{statistics.median(refused) * 1e3:.1f} ms median, "
          f"{refused[int(0.99 * (len(refused) - 1))] * 1e3:.1f} ms p99")
    assert set(run.counts) <= {OK, "OVERLOADED", "DEADLINE"}, run.counts
    assert len(refused) >= REQUESTS // 2, run.counts  # two thirds are past capacity
    assert attainment >= 0.99, (attainment, run.counts)
    assert statistics.median(refused) < 0.05 * SLO_S
