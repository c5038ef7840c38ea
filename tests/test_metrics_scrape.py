"""Prometheus metrics of a live cluster (zserve.metrics, docs/metrics.md): a scrape with a real
HTTP client after a known load, parsed by prometheus_client's own parser, matches the client's
ledger (requests sent = the sum over outcomes; histogram counts = requests answered), and a
request naming an unknown model creates no label."""

from __future__ import annotations

import collections
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from runtime_helpers import ask_frontend_stats

import zserve
from zserve.config import parse_config
from zserve.errors import ZServeError
from zserve.supervisor import Cluster
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
    with Cluster(config, ipc_base=tmp_path) as cluster:
        ledger = _send_load(cluster.client_address)
        url = ask_frontend_stats(cluster.client_address, StatsRequest(reset=False),
                                 b"test-metrics")["metrics_url"]
        families = _scrape(url)
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
