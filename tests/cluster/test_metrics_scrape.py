"""Prometheus metrics of a live cluster (zserve.frontend.metrics, docs/metrics.md): a scrape with a
real HTTP client after a known load, parsed by prometheus_client's own parser, matches the client's
ledger (requests sent = the sum over outcomes; histogram counts = requests answered), a request
naming an unknown model creates no label, the busy fraction is the busy seconds' increase over the
time between two scrapes, and the readiness gauges follow the backend table (a killed backend
makes its model and the frontend unready)."""

from __future__ import annotations

import collections
import math
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from runtime_helpers import ask_frontend_stats, wait_until

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import parse_config
from zserve.core.errors import ZServeError
from zserve.frontend.metrics import BusyWindows, cluster_families
from zserve.transport.messages import StatsRequest

OK_REQUESTS = 12
BAD_SHAPE_REQUESTS = 3
UNKNOWN_MODEL_REQUESTS = 2


def _scrape(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(family: Any, suffix: str = "", **labels: str) -> float:
    total = 0.0
    for sample in family.samples:
        if sample.name == family.name + suffix and all(
                sample.labels.get(k) == v for k, v in labels.items()):
            total += sample.value
    return total


def _send_load(address: str) -> collections.Counter[str]:
    """The ledger: each request's terminal outcome as the client saw it."""
    ledger: collections.Counter[str] = collections.Counter()
    good = {"x": np.ones((1, 4), np.float32)}
    bad = {"x": np.ones((1, 5), np.float32)}
    with zserve.Client(address, timeout=20) as client:
        sent = ([client.submit("a", good) for _ in range(OK_REQUESTS)]
                + [client.submit("a", bad) for _ in range(BAD_SHAPE_REQUESTS)]
                + [client.submit("nosuch-model", good) for _ in range(UNKNOWN_MODEL_REQUESTS)])
        for future in sent:
            try:
                future.result()
                ledger["ok"] += 1
            except ZServeError as exc:
                ledger[exc.kind.value] += 1
    return ledger


def _timed_scrape(url: str) -> tuple[dict[str, Any], float, float]:
    """A scrape and the monotonic seconds around it (its collector read the clock in between)."""
    started = time.monotonic()
    families = _scrape(url)
    return families, started, time.monotonic()


def test_scrape_matches_the_ledger(tmp_path: Path) -> None:
    config = parse_config({
        "cluster": {"drain_s": 2.0},
        "scheduler": {"shards": 0, "d_ctrl_ms": 5.0, "jitter_ms": 50.0},  # a loaded host
        "frontends": {"count": 1, "metrics_addresses": ["127.0.0.1:0"]},
        "backends": {"count": 1, "device": "emulated"},
        "models": [{"name": "a", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0,
                                              "input_shape": [4]},
                    "slo_ms": 2000.0, "max_batch": 8}],
    })
    with Cluster(config, ipc_base=tmp_path, restart=False) as cluster:
        url = ask_frontend_stats(cluster.client_address, StatsRequest(reset=False),
                                 b"test-metrics")["metrics_url"]
        first, first_started, first_ended = _timed_scrape(url)
        ledger = _send_load(cluster.client_address)
        own = ask_frontend_stats(cluster.client_address, StatsRequest(reset=False),
                                 b"test-metrics")
        families, started, ended = _timed_scrape(url)
        _check_ledger(families, ledger)
        _check_busy_fraction(first, families, (started - first_ended, ended - first_started))
        _check_derived_histograms(own)
        assert _value(families["zserve_frontend_ready"], frontend="frontend-0") == 1.0
        assert _value(families["zserve_model_ready"], model="a") == 1.0
        _check_arrival_rate(cluster.client_address, url)
        # No backend left for "a" (the supervisor does not restart it): both gauges drop to 0.
        cluster.kill("backend-0")
        wait_until(lambda: _value(_scrape(url)["zserve_model_ready"], model="a") == 0.0,
                   "model a unready once its only backend died")
        assert _value(_scrape(url)["zserve_frontend_ready"], frontend="frontend-0") == 0.0


def _check_ledger(families: dict[str, Any], ledger: collections.Counter[str]) -> None:
    sent = OK_REQUESTS + BAD_SHAPE_REQUESTS + UNKNOWN_MODEL_REQUESTS
    assert sum(ledger.values()) == sent
    requests = families["zserve_requests"]
    assert _value(requests, "_total") == sent  # every request has exactly one outcome
    for outcome, n in ledger.items():
        assert _value(requests, "_total", outcome=outcome) == n, outcome
    assert _value(families["zserve_requests_received"], "_total") == sent
    # Per model: the unknown model's refusals have no label of their own.
    by_model = families["zserve_model_requests"]
    assert {s.labels["model"] for s in by_model.samples} == {"a"}
    assert _value(by_model, "_total", model="a") == OK_REQUESTS + BAD_SHAPE_REQUESTS
    assert _value(by_model, "_total", model="a", outcome="ok") == OK_REQUESTS
    for family in families.values():
        for sample in family.samples:
            assert "nosuch-model" not in sample.labels.values(), sample
    # Histograms: one latency per answered request of "a", a queue wait per request that ran,
    # and the batches' rows add up to the requests run.
    latency = families["zserve_request_latency_seconds"]
    assert _value(latency, "_count", model="a") == OK_REQUESTS
    assert _value(latency, "_bucket", model="a", le="+Inf") == OK_REQUESTS
    assert _value(families["zserve_queue_wait_seconds"], "_count", model="a") == OK_REQUESTS
    rows = families["zserve_batch_size_rows"]
    assert _value(rows, "_sum", model="a") == OK_REQUESTS
    assert _value(families["zserve_execution_seconds"], "_count", model="a") == _value(
        rows, "_count", model="a")
    assert _value(families["zserve_backend_busy_seconds"], "_total") > 0
    assert _value(families["zserve_scheduler_arrived"], "_total", model="a") == OK_REQUESTS
    assert _value(families["zserve_up"]) == 3  # frontend, shard, backend


def _check_arrival_rate(address: str, url: str) -> None:
    """The scheduler's rate meter seals a bucket on an arrival after the bucket's end (50 ms),
    so requests go one at a time until the gauge reads a rate: NaN before, > 0 after."""
    with zserve.Client(address, timeout=20) as client:
        def rate_measured() -> bool:
            client.infer("a", {"x": np.ones((1, 4), np.float32)})
            rate = _value(_scrape(url)["zserve_scheduler_arrival_rate"], model="a")
            assert math.isnan(rate) or rate > 0
            return rate > 0
        wait_until(rate_measured, "the scheduler's arrival rate measured")


def _check_busy_fraction(first: dict[str, Any], second: dict[str, Any],
                         span_bounds: tuple[float, float]) -> None:
    """The gauge is the busy counter's increase between the two scrapes over the time between
    their collections, which lies within ``span_bounds`` (measured around the scrapes)."""
    fraction = first["zserve_backend_busy_fraction"]
    assert math.isnan(_value(fraction, backend="backend-0"))  # a first scrape spans nothing
    busy = "zserve_backend_busy_seconds"
    busy_s = (_value(second[busy], "_total", backend="backend-0")
              - _value(first[busy], "_total", backend="backend-0"))
    assert busy_s > 0  # the load ran batches
    shortest, longest = span_bounds
    measured = _value(second["zserve_backend_busy_fraction"], backend="backend-0")
    assert busy_s / longest <= measured <= min(1.0, busy_s / shortest), (busy_s, measured)


def _check_derived_histograms(stats: dict[str, Any]) -> None:
    """admit_to_answer and queueing are their per-model histograms summed at snapshot time."""
    latency = stats["latency"]
    assert latency["admit_to_answer"]["count"] == latency["latency/a"]["count"] == OK_REQUESTS
    assert latency["queueing"]["count"] == latency["queueing/a"]["count"] == OK_REQUESTS
    assert stats["histograms"]["admit_to_answer"] == stats["histograms"]["latency/a"]


def test_busy_fraction_spans_the_recent_window_and_survives_a_restart() -> None:
    windows = BusyWindows(window_s=10.0)
    assert math.isnan(windows.fraction("b", 100.0, 5.0))  # nothing to compare with yet
    assert windows.fraction("b", 102.0, 6.0) == 0.5
    assert windows.fraction("b", 104.0, 8.0) == 0.75  # 3 busy s since the scrape at 100
    # At 112 the scrape at 102 is 10 s old: it becomes the reference, the one at 100 goes.
    assert windows.fraction("b", 112.0, 8.0) == 0.2
    assert math.isnan(windows.fraction("b", 113.0, 1.0))  # the counter went back: restarted
    assert windows.fraction("b", 114.0, 2.0) == 1.0
    assert math.isnan(windows.fraction("other", 114.0, 0.0))  # each backend on its own


def test_the_schedulers_measured_rate_is_a_gauge() -> None:
    row = {"queued": 2, "arrived": 40, "target": 4, "gpus": ["backend-0"]}
    stats = {"ready": True, "unready_models": [], "cluster": {
        "shard-0": {"role": "shard", "models": {"a": {**row, "rate_rps": 12.5},
                                                "b": {**row, "rate_rps": None}}}}}
    families = {f.name: f for f in cluster_families("frontend-0", stats, frozenset({"a", "b"}))}
    rate = families["zserve_scheduler_arrival_rate"]
    assert _value(rate, shard="shard-0", model="a") == 12.5
    assert math.isnan(_value(rate, shard="shard-0", model="b"))  # before its first measurement
    assert _value(families["zserve_model_ready"], model="b") == 1.0
    assert "zserve_backend_busy_fraction" in families and not families[
        "zserve_backend_busy_fraction"].samples  # no collector, no window: no fraction
