"""``protocols``: goodput and CPU per request through each way into a frontend.

Two emulated ResNet50 replicas (alpha 1.053 ms, beta 5.072 ms, max batch 16, SLO 25 ms, Poisson
arrivals) behind one frontend whose Open Inference Protocol servers are on; the same open-loop
load generator searches the goodput (at most 1% bad) sending through zserve's own client socket
(``native``), OIP HTTP/REST with JSON tensor data, with binary tensor data, and OIP gRPC. Each
row gives the goodput and, at the best passing probe, the CPU time per request of the frontend,
of every cluster process together, and of the load generator. The paths share one cluster, so
their figures differ only by the path; the order of the searches alternates between repeats.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from zserve.loadgen.experiments.common import Check, Options, Outcome, Table
from zserve.loadgen.experiments.live import live_cluster, live_goodput, live_run
from zserve.loadgen.load_plan import GeneratorBehindError
from zserve.loadgen.sender import PROTOCOLS
from zserve.loadgen.workload import Workload, parse_workload

ALPHA_MS = 1.053
BETA_MS = 5.072
SLO_MS = 25.0
MAX_BATCH = 16
GPUS = 2
START_RPS = 700.0
# Above the two GPUs' staggered bound (about 1,300 r/s): a probe there is counted failing.
MAX_RATE_RPS = 1400.0
PRECISION = 0.05
QUICK_PRECISION = 0.2
WINDOWS_S = (2.0, 6.0, 1.0)  # warm-up, measure, cool-down of each probe
QUICK_WINDOWS_S = (0.5, 1.0, 0.5)
REPEATS = 3
# CPU per request is also measured at this fixed rate, which every path sustains: a steadier
# figure than the one at each path's own goodput on a shared host.
FIXED_RATE_RPS = 300.0
# The bar: the HTTP paths within 20% of the native client's goodput.
HTTP_WITHIN = 0.8
CLUSTER_PROCESSES = ("frontend-0", "shard-0", "backend-0", "backend-1")


def protocols_cluster_toml() -> str:
    """Two emulated ResNet50 GPUs, one frontend with both OIP servers on loopback ports the
    kernel picks (the allowances of examples/clusters/emulated-8gpu-resnet50.toml)."""
    return "\n".join([
        "# written by zserve experiment protocols (loadgen/experiments/protocols.py)",
        "[cluster]", 'name = "protocols"', "idle_poll = true", "",
        "[scheduler]", "shards = 0", 'policy = "deferred"', 'drop = "window"',
        "d_ctrl_ms = 3.0", "d_data_ms = 0.02", "jitter_ms = 3.0", "",
        "[frontends]", "count = 1", "reply_allowance_ms = 3.0",
        'http_addresses = ["127.0.0.1:0"]', 'grpc_addresses = ["127.0.0.1:0"]', "",
        "[backends]", f"count = {GPUS}", 'device = "emulated"', "",
        "[[models]]", 'name = "resnet50"',
        f"emulated = {{ alpha_ms = {ALPHA_MS}, beta_ms = {BETA_MS}, input_shape = [4], "
        "output_shape = [1] }",
        f"slo_ms = {SLO_MS}", f"max_batch = {MAX_BATCH}", "max_queue = 512", "",
    ])


def protocols_workload(*, quick: bool) -> Workload:
    warmup, measure, cooldown = QUICK_WINDOWS_S if quick else WINDOWS_S
    return parse_workload({
        "workload": {"name": "protocols-resnet50-2gpu", "gpus": GPUS, "seed": 1,
                     "rate": START_RPS, "arrival": "poisson", "warmup_s": warmup,
                     "measure_s": measure, "cooldown_s": cooldown, "policy": "deferred",
                     "jitter_ms": 3.0, "d_ctrl_ms": 3.0, "d_data_ms": 0.02, "reply_ms": 3.0},
        "models": [{"name": "resnet50", "slo_ms": SLO_MS, "alpha_ms": ALPHA_MS,
                    "beta_ms": BETA_MS, "max_batch": MAX_BATCH}],
    }, source="protocols")


def _cpu_us(cpu: dict[str, Any] | None) -> tuple[float | None, float | None, float | None]:
    """(frontend, every cluster process, load generator) CPU microseconds per request."""
    if not cpu:
        return None, None, None
    per = cpu.get("per_request_us", {})
    cluster = sum(float(per.get(name, 0.0)) for name in CLUSTER_PROCESSES)
    loadgen = float(per.get("loadgen", 0.0)) + float(per.get("loadgen workers", 0.0))
    return per.get("frontend-0"), round(cluster, 1), round(loadgen, 1)


def run_protocols(opts: Options) -> Outcome:
    quick = opts.quick
    workload = protocols_workload(quick=quick)
    repeats = 1 if quick else REPEATS
    found: dict[str, list[dict[str, Any]]] = {p: [] for p in PROTOCOLS}
    fixed: dict[str, list[dict[str, Any]]] = {p: [] for p in PROTOCOLS}
    with live_cluster(protocols_cluster_toml(), workload, Path(opts.out_dir)) as target:
        for repeat in range(repeats):
            for protocol in PROTOCOLS:
                try:
                    report = live_run(target, workload, FIXED_RATE_RPS, bail=False,
                                      lateness_bound_ms=math.inf, protocol=protocol)
                except GeneratorBehindError as exc:  # the host took the generator's CPU
                    opts.say(f"protocols: {protocol} at {FIXED_RATE_RPS:g} r/s: {exc}")
                    continue
                frontend_us, cluster_us, loadgen_us = _cpu_us(report.get("cpu"))
                fixed[protocol].append({"frontend_us": frontend_us, "cluster_us": cluster_us,
                                        "loadgen_us": loadgen_us,
                                        "bad_rate": report.get("bad_rate")})
                opts.say(f"protocols: {protocol} at {FIXED_RATE_RPS:g} r/s: frontend "
                         f"{frontend_us} us/request, bad rate {report.get('bad_rate')}")
            order = PROTOCOLS if repeat % 2 == 0 else tuple(reversed(PROTOCOLS))
            for protocol in order:
                goodput = live_goodput(target, workload, start_rps=START_RPS,
                                       precision=QUICK_PRECISION if quick else PRECISION,
                                       say=opts.say, label=protocol, protocol=protocol,
                                       max_rate_rps=MAX_RATE_RPS)
                frontend_us, cluster_us, loadgen_us = _cpu_us(goodput.cpu)
                found[protocol].append({"goodput_rps": goodput.goodput_rps,
                                        "frontend_us": frontend_us, "cluster_us": cluster_us,
                                        "loadgen_us": loadgen_us})
                opts.say(f"protocols: {protocol} {goodput.goodput_rps:.1f} r/s, frontend "
                         f"{frontend_us} us/request")
    return _outcome(found, fixed, repeats)


def _median(points: list[dict[str, Any]], key: str, digits: int = 1) -> float | None:
    values = [p[key] for p in points if p[key] is not None]
    return round(statistics.median(values), digits) if values else None


def _outcome(found: dict[str, list[dict[str, Any]]], fixed: dict[str, list[dict[str, Any]]],
             repeats: int) -> Outcome:
    native = _median(found["native"], "goodput_rps") or 0.0
    table = Table(
        f"Goodput and CPU per request by path: 2 emulated ResNet50 GPUs, SLO {SLO_MS:g} ms, "
        f"Poisson (medians of {repeats})",
        ["path", "goodput r/s", "of native", "frontend us/req", "cluster us/req",
         "loadgen us/req"])
    for protocol, points in found.items():
        goodput = _median(points, "goodput_rps")
        table.rows.append([protocol, goodput,
                           round(goodput / native, 3) if goodput and native else None,
                           _median(points, "frontend_us"), _median(points, "cluster_us"),
                           _median(points, "loadgen_us")])
    at_rate = Table(
        f"CPU per request at {FIXED_RATE_RPS:g} r/s, same cluster (medians of {repeats})",
        ["path", "frontend us/req", "cluster us/req", "loadgen us/req", "bad rate"])
    for protocol, points in fixed.items():
        at_rate.rows.append([protocol, _median(points, "frontend_us"),
                             _median(points, "cluster_us"), _median(points, "loadgen_us"),
                             _median(points, "bad_rate", 4)])
    # Nothing measured (a native goodput of 0) fails the check rather than passing it.
    checks = [Check(f"{p} goodput within {1 - HTTP_WITHIN:.0%} of native",
                    native > 0
                    and (_median(found[p], "goodput_rps") or 0.0) >= HTTP_WITHIN * native,
                    f"{_median(found[p], 'goodput_rps')} vs {native} r/s")
              for p in ("http-json", "http-binary")]
    config = {"gpus": GPUS, "alpha_ms": ALPHA_MS, "beta_ms": BETA_MS, "slo_ms": SLO_MS,
              "max_batch": MAX_BATCH, "repeats": repeats}
    return Outcome(config=config, tables=[table, at_rate], checks=checks,
                   points={"runs": found, "fixed_rate": fixed})
