"""``prefix --live``: prefix batching in a live cluster, grouped against apart, on this CPU.

One CPU backend serves ``LIVE_VARIANTS`` variants of the built-in CNN (its last layer re-drawn
per variant, ``zserve.backends.prefix.cnn_variants``), declared once as a ``[[prefix_groups]]``
group (the scheduler batches their requests together, the backend runs the merged model: the
prefix once at the merged batch, each head on its rows) and once as separate models. Clients:
``LIVE_CLIENTS`` closed loops, each request's variant drawn evenly (``run_closed_loop``), for a
warm-up and then a measured window; the rounds alternate the two builds, so a load change of the
shared host hits both. Per round: answers per second, latency percentiles, errors, the mean
batch (rows per batch the backend ran) and each process's CPU time per answer
(``zserve.loadgen.cpu``), the measure that survives a loaded host best.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from zserve.backends.prefix import cnn_variants
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.loadgen.closed_loop import run_closed_loop
from zserve.loadgen.cpu import cpu_per_request, cpu_snapshot
from zserve.loadgen.experiments.common import Options, Table
from zserve.loadgen.target import Target
from zserve.loadgen.workload import Workload, parse_workload

LIVE_VARIANTS, QUICK_LIVE_VARIANTS = 6, 3
LIVE_CLIENTS, QUICK_LIVE_CLIENTS = 12, 6
LIVE_ROUNDS, QUICK_LIVE_ROUNDS = 2, 1  # rounds of (apart, grouped)
WARMUP_S, QUICK_WARMUP_S = 2.0, 1.0
MEASURE_S, QUICK_MEASURE_S = 6.0, 3.0
# The demo's SLO. A generous one (2 s) made the separate models' lone requests wait for their
# last moment under closed-loop load (a deferred batch is held while more rows could join).
LIVE_SLO_MS = 200.0
# The live check: the grouped build answers at most this fraction with an error (a shared host's
# stalls can push a few requests past the SLO).
MAX_GROUPED_ERROR_FRACTION = 0.01
LIVE_MAX_BATCH = 12
GROUP = "cnn-heads"
IMAGE_SHAPE = (1, 3, 64, 64)


def live_config(paths: list[Path], *, grouped: bool) -> ClusterConfig:
    """One CPU backend serving the variants ``cnn-v<i>``, grouped or apart."""
    names = [f"cnn-v{i}" for i in range(len(paths))]
    groups = [{"name": GROUP, "models": names}] if grouped else []
    return parse_config({
        "cluster": {"name": f"prefix-{'grouped' if grouped else 'apart'}", "drain_s": 2.0},
        "scheduler": {"policy": "deferred", "d_ctrl_ms": 2.0},
        "frontends": {"reply_allowance_ms": 10.0},
        "backends": {"count": 1, "device": "cpu"},
        "models": [{"name": n, "onnx": str(p), "slo_ms": LIVE_SLO_MS,
                    "max_batch": LIVE_MAX_BATCH} for n, p in zip(names, paths, strict=True)],
        "prefix_groups": groups,
    })


def _workload(names: list[str]) -> Workload:
    """Equal shares over ``names`` (the closed loop draws each request's model by them)."""
    return parse_workload({
        "workload": {"name": "prefix-live", "gpus": 1, "seed": 1, "rate": 1.0,
                     "popularity": "equal"},
        "models": [{"name": n, "slo_ms": LIVE_SLO_MS, "alpha_ms": 1.0, "beta_ms": 1.0}
                   for n in names]}, source="prefix-live")


def _batches(cluster: Cluster) -> tuple[int, int]:
    """(rows, batches) the backend has run so far, every model."""
    rows = batches = 0
    for sizes in cluster.stats("backend-0")["batch_sizes"].values():
        for size, count in sizes.items():
            rows += int(size) * int(count)
            batches += int(count)
    return rows, batches


def live_round(paths: list[Path], *, grouped: bool, quick: bool, work_dir: Path
               ) -> dict[str, Any]:
    """One cluster, a warm-up, then the measured closed-loop window."""
    import numpy as np

    config = live_config(paths, grouped=grouped)
    names = [m.name for m in config.models]
    image = np.random.default_rng(5).standard_normal(IMAGE_SHAPE).astype(np.float32)
    workload = _workload(names)
    clients = QUICK_LIVE_CLIENTS if quick else LIVE_CLIENTS
    with Cluster(config, ipc_base=work_dir) as cluster:
        target = Target(cluster.client_address, {n: {"image": image} for n in names},
                        {n: n for n in names}, {}, client_addresses=list(cluster.client_addresses))
        run_closed_loop(target, workload, clients=clients, measure_s=0.001,
                        warmup_s=QUICK_WARMUP_S if quick else WARMUP_S)
        rows0, batches0 = _batches(cluster)
        start = cpu_snapshot(cluster.pids())
        report = run_closed_loop(target, workload, clients=clients, warmup_s=0.0,
                                 measure_s=QUICK_MEASURE_S if quick else MEASURE_S)
        end = cpu_snapshot(cluster.pids())
        rows1, batches1 = _batches(cluster)
    cpu = cpu_per_request(start, end, report["answers"], report["measure_s"]) or {}
    per_request = cpu.get("per_request_us", {})
    return {"grouped": grouped, "answers_per_s": report["answers_per_s"],
            "answers": report["answers"], "errors": sum(report["errors"].values()),
            "p50_ms": report["latency_ms"]["p50"], "p99_ms": report["latency_ms"]["p99"],
            "mean_batch": round((rows1 - rows0) / max(1, batches1 - batches0), 2),
            "backend_cpu_us": per_request.get("backend-0"),
            "cluster_cpu_us": round(sum(v for k, v in per_request.items()
                                        if not k.startswith("loadgen")), 1),
            "load_average": round(os.getloadavg()[0], 2)}


def live_table(opts: Options, work_dir: Path) -> tuple[Table, list[dict[str, Any]]]:
    """Alternating rounds apart / grouped; the table's rows and the rounds' records."""
    count = QUICK_LIVE_VARIANTS if opts.quick else LIVE_VARIANTS
    paths = cnn_variants(count, work_dir / "variants")
    rounds: list[dict[str, Any]] = []
    for index in range(QUICK_LIVE_ROUNDS if opts.quick else LIVE_ROUNDS):
        for grouped in (False, True):
            row = live_round(paths, grouped=grouped, quick=opts.quick,
                             work_dir=work_dir)
            row["round"] = index
            rounds.append(row)
            opts.say(f"  round {index} {'grouped' if grouped else 'apart'}: "
                     f"{row['answers_per_s']} answers/s, p99 {row['p99_ms']} ms, mean batch "
                     f"{row['mean_batch']}, backend {row['backend_cpu_us']} us CPU/answer "
                     f"(load {row['load_average']})")
    table = Table(f"live: {count} CNN variants, 1 CPU backend, "
                  f"{QUICK_LIVE_CLIENTS if opts.quick else LIVE_CLIENTS} closed-loop clients "
                  "(median of rounds)",
                  ["build", "answers/s", "p50 ms", "p99 ms", "mean batch",
                   "backend CPU us/answer", "cluster CPU us/answer", "errors", "load avg"])
    for grouped in (False, True):
        mine = [r for r in rounds if r["grouped"] is grouped]

        def median(key: str, rows: list[dict[str, Any]] = mine) -> float:
            return round(statistics.median(float(r[key] or 0.0) for r in rows), 2)

        table.rows.append(["grouped" if grouped else "apart", median("answers_per_s"),
                           median("p50_ms"), median("p99_ms"), median("mean_batch"),
                           median("backend_cpu_us"), median("cluster_cpu_us"),
                           sum(r["errors"] for r in mine), median("load_average")])
    return table, rounds


__all__ = ["MAX_GROUPED_ERROR_FRACTION", "live_config", "live_round", "live_table"]
