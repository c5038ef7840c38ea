"""What a Prometheus scrape costs: ``python -m zserve.loadgen.bench.metrics_scrape [--scrapes N]``.

Starts ``examples/clusters/demo.toml``'s shape with emulated backends and a metrics endpoint,
sends a little load so that every family has samples, then scrapes ``/metrics`` N times with a
real HTTP client and prints the median wall time of one scrape, the frontend's CPU time per
scrape (psutil, the whole process: its in-process cluster stats round and the HTTP thread's
rendering) and the size of one exposition. The request path has no added cost by construction:
the collector reads the stats snapshots at scrape time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import parse_config


def _config(models: int) -> zserve.config.cluster.ClusterConfig:
    return parse_config({
        "scheduler": {"shards": 0, "jitter_ms": 50.0},  # room for a loaded host
        "frontends": {"count": 1, "metrics_addresses": ["127.0.0.1:0"]},
        "backends": {"count": 2, "device": "emulated"},
        "models": [{"name": f"m{i}", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0,
                                                  "input_shape": [4]},
                    "slo_ms": 500.0, "max_batch": 8} for i in range(models)],
    })


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zserve.loadgen.bench.metrics_scrape")
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--models", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, Cluster(_config(args.models),
                                                        ipc_base=Path(tmp)) as cluster:
        with zserve.Client(cluster.client_address, timeout=10) as client:
            for i in range(20 * args.models):
                client.infer(f"m{i % args.models}", {"x": np.ones((1, 4), np.float32)})
        url = cluster.stats("frontend-0")["metrics_url"]
        pid = cluster.pids()["frontend-0"]
        assert pid is not None
        frontend = psutil.Process(pid)
        walls: list[float] = []
        cpu0 = sum(frontend.cpu_times()[:2])
        size = 0
        for _ in range(args.scrapes):
            t0 = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as response:
                size = len(response.read())
            walls.append(time.perf_counter() - t0)
        cpu_ms = (sum(frontend.cpu_times()[:2]) - cpu0) / args.scrapes * 1e3
    print(f"{args.scrapes} scrapes, {args.models} models, 2 backends: median wall "
          f"{statistics.median(walls) * 1e3:.1f} ms, frontend CPU {cpu_ms:.1f} ms per scrape, "
          f"{size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
