"""Prometheus metrics of a cluster, served by each frontend (docs/metrics.md).

One scrape of a frontend's endpoint asks that frontend in its own process (the HTTP thread hands
the question to the frontend's loop: no socket, so no keys under ``[security]``) for what a
``ClusterStatsRequest(reset=False)`` answers: its ``zserve.core.stats`` snapshot and those of every
shard, rank and backend it talks to, gathered in the same round a client's request joins.
:func:`cluster_families` turns that one snapshot into Prometheus families at scrape time;
nothing is counted twice and nothing is added to the request path (one stats schema). The fixed
buckets of ``zserve.core.stats`` become cumulative ``le`` buckets in seconds.

Label values come from the configuration only: ``model`` is kept only for the configured model
names handed to :class:`ClusterCollector`; ``outcome`` is ``ok`` or an ``ErrorKind`` value;
``frontend``/``process``/``backend`` are process names the configuration gives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from zserve.core.errors import ErrorKind
from zserve.core.stats import BOUNDS, Histogram
from zserve.frontend.apps import APP_COUNTERS

log = logging.getLogger(__name__)
APP_COUNTER_PREFIX = "app_"  # the frontend core's counters of application requests

# The frontend's stats round ends within its peers' bound (0.5 s); a scrape waits this long
# for it (a loop busy with a burst of requests), then reports zserve_up 0 for the frontend.
SCRAPE_STATS_TIMEOUT_S = 2.0
OUTCOMES = ("ok", *(kind.value for kind in ErrorKind))
# Exported ``le`` bounds: every 5th bound of ``zserve.core.stats`` (4 per decade: 1, 1.78, 3.16,
# 5.62)
# from 10 us up. Each is one of the stats bounds, so its cumulative count is exact; all 161
# bounds made a 200 KB exposition for four models and 23 ms of frontend CPU per scrape.
EXPORT_EVERY_NTH_BOUND = 5
SMALLEST_EXPORTED_BOUND_S = 1e-5
_EXPORTED_MAGNITUDES = frozenset(
    b for i, b in enumerate(BOUNDS["delay"])
    if i % EXPORT_EVERY_NTH_BOUND == 0 and b >= SMALLEST_EXPORTED_BOUND_S * (1 - 1e-9))
_EXPORTED_INDICES = {
    scheme: frozenset(i for i, b in enumerate(bounds) if b == 0.0 or abs(b) in _EXPORTED_MAGNITUDES)
    for scheme, bounds in BOUNDS.items()}
# Batch-size buckets (rows): powers of two up to the largest batch any model allows.
BATCH_ROW_BOUNDS = tuple(2 ** i for i in range(11))  # 1 .. 1024
# zserve_backend_busy_fraction spans the last BUSY_WINDOW_S of scrapes: from the newest scrape at
# least this old (or the oldest one kept, when none is) to now. Long enough that a second scraper
# (a person with curl between two Prometheus scrapes) does not shrink it to a blip.
BUSY_WINDOW_S = 10.0

# What the frontend's HTTP server refuses before a request reaches its core
# (zserve.frontend.oip.http_server):
# a head or body slower than its timeout (408), a body over the model's bound (413), a
# connection past the cap (503). Counted in the frontend's stats as ``http_refused/<reason>``.
HTTP_REFUSAL_REASONS = ("timeout", "too_large", "connections")
HTTP_REFUSED_COUNTER = "http_refused/{}"

StatsReader = Callable[[], dict[str, Any] | None]
# Run on the frontend's loop: its ClusterStatsRequest(reset=False) answer (None: not serving).
StatsAsker = Callable[[], Coroutine[Any, Any, dict[str, Any] | None]]


# --------------------------------------------------------------------------- conversions


def histogram_buckets(wire: Mapping[str, Any]) -> tuple[list[tuple[str, float]], float]:
    """A ``zserve.core.stats`` histogram (wire form) as Prometheus cumulative buckets and sum.

    ``zserve.core.stats`` bucket ``i`` holds ``[bounds[i-1], bounds[i])``; Prometheus ``le`` is
    ``<=``. Mapping bucket ``i`` under ``le=bounds[i]`` differs only for a value exactly on a
    bound (which the log-spaced float bounds make a measure-zero event)."""
    hist = Histogram.from_wire(wire)
    bounds = BOUNDS[hist.scheme]
    out: list[tuple[str, float]] = []
    running = 0
    for index, (bound, n) in enumerate(zip(bounds, hist.counts, strict=False)):
        running += n
        if index in _EXPORTED_INDICES[hist.scheme]:
            out.append((f"{bound:.6g}", float(running)))
    out.append(("+Inf", float(hist.count)))
    return out, hist.total


def _histogram(name: str, doc: str, labels: list[str],
               rows: Iterable[tuple[list[str], Mapping[str, Any]]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for values, wire in rows:
        buckets, total = histogram_buckets(wire)
        family.add_metric(values, buckets, total)
    return family


def _batch_rows(sizes: Mapping[str, int]) -> tuple[list[tuple[str, float]], float]:
    """``{str(rows): batches}`` as cumulative row buckets and the sum of rows."""
    counted = sorted((int(size), int(n)) for size, n in sizes.items())
    buckets = [(str(bound), float(sum(n for s, n in counted if s <= bound)))
               for bound in BATCH_ROW_BOUNDS]
    buckets.append(("+Inf", float(sum(n for _, n in counted))))
    return buckets, float(sum(s * n for s, n in counted))


# --------------------------------------------------------------------------- families


def frontend_families(name: str, stats: Mapping[str, Any],
                      models: frozenset[str]) -> list[Metric]:
    """The frontend's requests by outcome, its per-model histograms and gauges."""
    counters = stats.get("counters", {})
    hists = stats.get("histograms", {})
    total = CounterMetricFamily("zserve_requests", "Requests answered or refused by a "
                                "frontend, by terminal outcome", labels=["frontend", "outcome"])
    for outcome in OUTCOMES:
        value = counters.get("replied", 0) if outcome == "ok" else (
            counters.get(f"error_{outcome}", 0) + counters.get(f"rejected_{outcome}", 0))
        total.add_metric([name, outcome], value)
    received = CounterMetricFamily("zserve_requests_received", "Requests a frontend received",
                                   labels=["frontend"])
    received.add_metric([name], counters.get("received", 0))
    by_model = CounterMetricFamily("zserve_model_requests", "Requests of a configured model "
                                   "by terminal outcome", labels=["frontend", "model", "outcome"])
    in_flight = GaugeMetricFamily("zserve_requests_in_flight", "Admitted requests not yet "
                                  "answered", labels=["frontend", "model"])
    for model in sorted(models):
        for outcome in OUTCOMES:
            by_model.add_metric([name, model, outcome],
                                counters.get(f"outcome/{model}/{outcome}", 0))
        in_flight.add_metric([name, model], stats.get("models", {}).get(model, 0))
    refused = CounterMetricFamily("zserve_http_refused", "HTTP connections and requests the "
                                  "frontend's OIP server refused before admission, by reason",
                                  labels=["frontend", "reason"])
    for reason in HTTP_REFUSAL_REASONS:
        refused.add_metric([name, reason], counters.get(HTTP_REFUSED_COUNTER.format(reason), 0))
    out: list[Metric] = [total, received, by_model, in_flight, refused]
    apps = CounterMetricFamily("zserve_app_requests", "Application requests (``[[apps]]``) "
                               "by step: received, admitted, then one of replied, failed, "
                               "rejected, cancelled, abandoned", labels=["frontend", "step"])
    for key in APP_COUNTERS:
        apps.add_metric([name, key.removeprefix(APP_COUNTER_PREFIX)], counters.get(key, 0))
    out.append(apps)
    for metric, key, doc in (
            ("zserve_request_latency_seconds", "latency", "Admission to answer, per request"),
            ("zserve_queue_wait_seconds", "queueing", "Admission to its batch's start"),
            ("zserve_execution_seconds", "execution", "A batch's start to finish, per batch")):
        out.append(_histogram(metric, doc, ["frontend", "model"], (
            ([name, m], hists[f"{key}/{m}"]) for m in sorted(models) if f"{key}/{m}" in hists)))
    return out


class BusyWindows:
    """Each backend's busy fraction over its recent scrapes: the increase of its busy seconds
    (``busy_total_s``, never reset) over the time between the reference scrape and this one.
    Scrapes may come from several HTTP threads at once (hence the lock)."""

    def __init__(self, window_s: float = BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def fraction(self, backend: str, now: float, busy_total_s: float) -> float:
        """Record ``(now, busy_total_s)``; the busy share since the reference scrape (NaN on a
        backend's first scrape, and after its counter went back: a restarted process)."""
        with self._lock:
            samples = self._samples.setdefault(backend, deque())
            if samples and busy_total_s < samples[-1][1]:
                samples.clear()
            samples.append((now, busy_total_s))
            while len(samples) > 2 and samples[1][0] <= now - self.window_s:
                samples.popleft()  # the next one is old enough to be the reference
            then, busy_then = samples[0]
        if now <= then:
            return math.nan
        return min(1.0, (busy_total_s - busy_then) / (now - then))


def backend_families(cluster: Mapping[str, Mapping[str, Any]], models: frozenset[str],
                     busy_windows: BusyWindows | None = None) -> list[Metric]:
    """Batch sizes per backend and model, and each backend's busy time and busy fraction
    (with ``busy_windows``, which keeps the scrapes it spans)."""
    rows = HistogramMetricFamily("zserve_batch_size_rows", "Rows per batch a backend ran",
                                 labels=["backend", "model"])
    busy = CounterMetricFamily("zserve_backend_busy_seconds", "Seconds the backend's device "
                               "ran batches (rate(): the busy fraction)", labels=["backend"])
    fraction = GaugeMetricFamily("zserve_backend_busy_fraction", "Share of the recent scrapes' "
                                 f"span (at least {BUSY_WINDOW_S:g} s, else since the first) the "
                                 "backend's device ran batches", labels=["backend"])
    now = time.monotonic()
    for name, stats in sorted(cluster.items()):
        if stats.get("role") != "backend":
            continue
        for model, sizes in sorted(stats.get("batch_sizes", {}).items()):
            if model in models:
                buckets, total = _batch_rows(sizes)
                rows.add_metric([name, model], buckets, total)
        busy_total_s = float(stats.get("busy_total_s", 0.0))
        busy.add_metric([name], busy_total_s)
        if busy_windows is not None:
            fraction.add_metric([name], busy_windows.fraction(name, now, busy_total_s))
    return [rows, busy, fraction]


_SHARD_COUNTERS = (
    ("arrived", "Requests that reached the scheduler"),
    ("dropped", "Requests the scheduler dropped (could not serve in time)"),
    ("batches", "Batches the scheduler bound to a GPU"),
    ("window_misses", "Batches whose execution window was missed"),
)
_SHARD_GAUGES = (
    ("queued", "zserve_scheduler_queue_length", "Requests queued at the scheduler"),
    ("target", "zserve_scheduler_target_batch", "The batch size the policy aims for"),
)


def scheduler_families(cluster: Mapping[str, Mapping[str, Any]],
                       models: frozenset[str]) -> list[Metric]:
    """Each shard's per-model load signals."""
    labels = ["shard", "model"]
    counters = {key: CounterMetricFamily(f"zserve_scheduler_{key}", doc, labels=labels)
                for key, doc in _SHARD_COUNTERS}
    gauges = {key: GaugeMetricFamily(metric, doc, labels=labels)
              for key, metric, doc in _SHARD_GAUGES}
    gpus = GaugeMetricFamily("zserve_scheduler_gpus", "GPUs serving the model", labels=labels)
    rate = GaugeMetricFamily("zserve_scheduler_arrival_rate", "The arrival rate the scheduler "
                             "measures (requests/s; NaN before its first measurement)",
                             labels=labels)
    for name, stats in sorted(cluster.items()):
        rows = stats.get("models")
        if stats.get("role") == "backend" or not isinstance(rows, dict):
            continue  # a backend's "models" is the list it runs
        for model, row in sorted(rows.items()):
            if model not in models or not isinstance(row, dict):
                continue
            for key, family in counters.items():
                family.add_metric([name, model], float(row.get(key, 0)))
            for key, gauge in gauges.items():
                gauge.add_metric([name, model], float(row.get(key, 0)))
            gpus.add_metric([name, model], float(len(row.get("gpus", []))))
            if "rate_rps" in row:  # a shard that reports its rate meter's reading
                measured = row["rate_rps"]
                rate.add_metric([name, model], math.nan if measured is None else float(measured))
    return [*counters.values(), *gauges.values(), gpus, rate]


def readiness_families(frontend: str, stats: Mapping[str, Any],
                       models: frozenset[str]) -> list[Metric]:
    """What the frontend's health endpoints answer (``zserve.frontend.readiness``), as gauges."""
    ready = GaugeMetricFamily("zserve_frontend_ready", "1 when the frontend admits requests and "
                              "every configured model is ready (its health endpoints' answer)",
                              labels=["frontend"])
    ready.add_metric([frontend], 1.0 if stats.get("ready") else 0.0)
    model_ready = GaugeMetricFamily("zserve_model_ready", "1 when a live, warmed backend serves "
                                    "the model", labels=["frontend", "model"])
    unready = set(stats.get("unready_models", models))
    for model in sorted(models):
        model_ready.add_metric([frontend, model], 0.0 if model in unready else 1.0)
    return [ready, model_ready]


# The autoscaling advice (zserve.frontend.autoscale_advice): stats key -> (metric, help).
AUTOSCALE_GAUGES = (
    ("advice_backends", "zserve_autoscale_backends_advice", "The backends the cluster should "
     "have ([autoscale] advice; KEDA / an HPA scale on it)"),
    ("backends", "zserve_autoscale_backends", "The backends serving now (the frontend's table)"),
    ("change", "zserve_autoscale_change", "The last advised change: backends to add (> 0) or "
     "release (< 0)"),
    ("needed", "zserve_autoscale_needed_backends", "The backends the measured load needs at "
     "the peak's busy fraction (the advice's estimate, before rounding and hysteresis)"),
    ("bad_rate", "zserve_autoscale_bad_rate", "Share of the requests of the up window not "
     "answered with outputs in time"),
    ("idle_fraction", "zserve_autoscale_idle_fraction", "Share of the serving backends' time "
     "they ran no batch, over the down window"),
    ("min_backends", "zserve_autoscale_min_backends", "[autoscale] min_backends"),
    ("max_backends", "zserve_autoscale_max_backends", "[autoscale] max_backends"),
)


# Per device kind ([autoscale.kinds]): stats key of each kind's entry -> (metric, help).
AUTOSCALE_KIND_GAUGES = (
    ("advice_backends", "zserve_autoscale_kind_backends_advice", "The backends of this device "
     "kind the cluster should have ([autoscale.kinds] advice)"),
    ("backends", "zserve_autoscale_kind_backends", "The backends of this device kind serving"),
    ("bad_rate", "zserve_autoscale_kind_bad_rate", "Share of this kind's models' requests of "
     "the up window not answered with outputs in time"),
    ("idle_fraction", "zserve_autoscale_kind_idle_fraction", "Share of this kind's backends' "
     "time they ran no batch, over the down window"),
)


def autoscale_families(frontend: str, stats: Mapping[str, Any]) -> list[Metric]:
    """The frontend's autoscaling advice as gauges (none unless ``[autoscale] enabled``)."""
    advice = stats.get("autoscale")
    if not isinstance(advice, Mapping):
        return []
    out: list[Metric] = []
    for key, metric, doc in AUTOSCALE_GAUGES:
        gauge = GaugeMetricFamily(metric, doc, labels=["frontend"])
        gauge.add_metric([frontend], float(advice.get(key, math.nan)))
        out.append(gauge)
    kinds = advice.get("kinds")
    if isinstance(kinds, Mapping):  # [autoscale.kinds]: each kind's advice, labelled
        for key, metric, doc in AUTOSCALE_KIND_GAUGES:
            gauge = GaugeMetricFamily(metric, doc, labels=["frontend", "kind"])
            for kind, entry in sorted(kinds.items()):
                gauge.add_metric([frontend, kind], float(entry.get(key, math.nan)))
            out.append(gauge)
    return out


def cluster_families(frontend: str, stats: Mapping[str, Any] | None, models: frozenset[str],
                     busy_windows: BusyWindows | None = None) -> list[Metric]:
    """Every family of one ``ClusterStatsRequest`` answer (None: the frontend did not answer);
    ``busy_windows``: the scrapes the backends' busy fractions span (none: no fraction)."""
    up = GaugeMetricFamily("zserve_up", "1 if the process answered this scrape's stats request",
                           labels=["process"])
    up.add_metric([frontend], 1.0 if stats is not None else 0.0)
    if stats is None:
        return [up]
    cluster = stats.get("cluster") or {}
    for name in sorted(cluster):
        up.add_metric([name], 1.0)
    for name in stats.get("cluster_silent", []):
        up.add_metric([name], 0.0)
    return [up, *frontend_families(frontend, stats, models),
            *readiness_families(frontend, stats, models),
            *backend_families(cluster, models, busy_windows),
            *scheduler_families(cluster, models), *autoscale_families(frontend, stats)]


# --------------------------------------------------------------------------- serving


class ClusterCollector(Collector):
    """Reads a frontend's cluster stats at scrape time (``read``) and yields its families.
    ``models``: the frontend's model names, or a call that gives them at scrape time (a model
    added to a running cluster has its series from the next scrape)."""

    def __init__(self, frontend: str, models: Iterable[str] | Callable[[], Iterable[str]],
                 read: StatsReader) -> None:
        self.frontend = frontend
        self.models: Callable[[], Iterable[str]]
        if callable(models):
            self.models = models
        else:
            names = frozenset(models)
            self.models = lambda: names
        self.read = read
        self.busy_windows = BusyWindows()

    def collect(self) -> Iterator[Metric]:
        yield from cluster_families(self.frontend, self.read(), frozenset(self.models()),
                                    self.busy_windows)


def in_process_stats_reader(loop: asyncio.AbstractEventLoop, ask: StatsAsker) -> StatsReader:
    """Reads the cluster stats from the frontend's own loop: each call (on an HTTP thread) runs
    ``ask()`` on ``loop`` and waits for its answer; None when it does not come within
    ``SCRAPE_STATS_TIMEOUT_S`` or the loop no longer runs. No socket: a scrape is the frontend
    asking itself, so it needs no keys with ``[security]`` CURVE."""

    def read() -> dict[str, Any] | None:
        asking = ask()
        try:
            answer = asyncio.run_coroutine_threadsafe(asking, loop)
        except RuntimeError:  # the loop has closed: the frontend is stopping
            asking.close()
            return None
        try:
            return answer.result(SCRAPE_STATS_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            answer.cancel()
            return None

    return read


class MetricsServer:
    """A ``prometheus_client`` HTTP server in a daemon thread, serving one collector."""

    def __init__(self, address: str, collector: Collector) -> None:
        host, _, port = address.rpartition(":")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._server, self._thread = start_http_server(int(port), addr=host or "127.0.0.1",
                                                       registry=self.registry)
        bound_host, bound_port = self._server.server_address[:2]
        if isinstance(bound_host, bytes):
            bound_host = bound_host.decode()
        self.url = f"http://{bound_host}:{bound_port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve_frontend_metrics(address: str, frontend: str,
                           models: Iterable[str] | Callable[[], Iterable[str]],
                           read: StatsReader) -> MetricsServer:
    """Start the endpoint of one frontend (``address``: ``HOST:PORT``; port 0 picks one)."""
    server = MetricsServer(address, ClusterCollector(frontend, models, read))
    log.info("%s: Prometheus metrics at %s", frontend, server.url)
    return server


__all__ = ["AUTOSCALE_GAUGES", "HTTP_REFUSAL_REASONS", "HTTP_REFUSED_COUNTER", "BusyWindows",
           "ClusterCollector", "MetricsServer", "autoscale_families", "cluster_families",
           "histogram_buckets", "in_process_stats_reader", "serve_frontend_metrics"]
