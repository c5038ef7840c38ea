"""Live parts: clusters of emulated backends on this machine, one run on them, a goodput search."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zserve.loadgen.experiments.common import Say
from zserve.loadgen.experiments.simulated import (
    MAX_BAD_RATE,
    MIN_MEASURED_REQUESTS,
    Goodput,
    reduce_search,
)
from zserve.loadgen.search import search_goodput
from zserve.loadgen.workload import Workload

# Live runs (a cluster of emulated backends on this machine). The allowances are those of
# examples/clusters/emulated-8gpu-resnet50-slow.toml (measured hop latencies, docs/design-notes.md).
LIVE_D_CTRL_MS = 3.0
LIVE_D_DATA_MS = 0.02
LIVE_REPLY_MS = 3.0
LIVE_PRECISION = 0.03
LIVE_WINDOWS_S = (3.0, 10.0, 1.0)
LIVE_QUICK_WINDOWS_S = (1.0, 2.0, 0.5)
# Two shared cores carry the load generator, the frontend, the scheduler and eight backend
# processes: above this offered rate a live probe would measure the CPU, not the scheduling, so
# the search treats it as failing without running it.
LIVE_MAX_RATE_RPS = 900.0
LIVE_MAX_LATENESS_MS = 5.0
# A run is refused when the generator's p99 send lateness exceeds the larger of
# LIVE_MAX_LATENESS_MS and this fraction of the tightest SLO: what distorts a verdict is lateness
# relative to the SLO, and on a shared 2-core host 5-10 ms stalls come and go, so a fixed 5 ms
# refused probes of the x20 dilated workloads (SLO 500 ms) where such lateness is 1% of the SLO.
LIVE_LATENESS_SLO_FRACTION = 0.02





@dataclass(frozen=True)
class EmulatedModel:
    name: str
    alpha_ms: float
    beta_ms: float
    slo_ms: float
    max_batch: int


def emulated_models(workload: Workload) -> list[EmulatedModel]:
    out = []
    for m in workload.models:
        p = m.profile
        out.append(EmulatedModel(m.name, p.alpha_s * 1e3, p.beta_s * 1e3, m.slo_ms, p.max_batch))
    return out


def emulated_cluster_toml(
    name: str, models: Sequence[EmulatedModel], *, gpus: int, policy: str, jitter_ms: float,
) -> str:
    """A cluster.toml of ``gpus`` emulated backends serving ``models`` (one process hosting the
    rank and the model threads, one frontend) with the live allowances."""
    lines = [
        "# written by zserve experiment (loadgen/experiments/live.py)",
        # idle pollers keep the 2 vCPUs awake: a halted vCPU takes milliseconds to wake
        # (transport/idle_poll.py), which the live runs would measure instead of the scheduler
        "[cluster]", f'name = "{name}"', "idle_poll = true", "",
        "[scheduler]", "shards = 0", f'policy = "{policy}"', 'drop = "window"',
        f"d_ctrl_ms = {LIVE_D_CTRL_MS}", f"d_data_ms = {LIVE_D_DATA_MS}",
        f"jitter_ms = {jitter_ms}", "",
        "[frontends]", "count = 1", f"reply_allowance_ms = {LIVE_REPLY_MS}", "",
        "[backends]", f"count = {gpus}", 'device = "emulated"', "",
    ]
    for m in models:
        lines += [
            "[[models]]", f'name = "{m.name}"',
            f"emulated = {{ alpha_ms = {m.alpha_ms!r}, beta_ms = {m.beta_ms!r}, "
            "input_shape = [4], output_shape = [1] }",
            f"slo_ms = {m.slo_ms!r}", f"max_batch = {m.max_batch}",
            # admission must not turn requests away before the scheduler sees them: the
            # experiment measures the scheduler's drops, and the overload points need a deep queue
            "max_queue = 4096", "",
        ]
    return "\n".join(lines)


def live_allowances(workload: Workload) -> Workload:
    """The workload with the live cluster's allowances, so that its simulated twin schedules with
    the budget the live scheduler has."""
    return workload.with_overrides(d_ctrl_ms=LIVE_D_CTRL_MS, d_data_ms=LIVE_D_DATA_MS,
                                   reply_ms=LIVE_REPLY_MS)


@contextlib.contextmanager
def live_cluster(cluster_toml: str, workload: Workload, work_dir: Path) -> Iterator[Any]:
    """Start the cluster (in-process supervisor) and yield its ``loadgen.target.Target``."""
    from zserve.loadgen.target import open_target

    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "cluster.toml"
    path.write_text(cluster_toml)
    with open_target(str(path), workload, cluster_config=None, model_map={}) as target:
        yield target


def live_lateness_bound_ms(workload: Workload) -> float:
    """The generator lateness (p99, ms) above which a live run of ``workload`` is refused."""
    tightest_slo_ms = min(m.slo_ms for m in workload.models)
    return max(LIVE_MAX_LATENESS_MS, LIVE_LATENESS_SLO_FRACTION * float(tightest_slo_ms))


def live_run(
    target: Any, workload: Workload, rate_rps: float, *, bail: bool,
    lateness_bound_ms: float | None = None, protocol: str = "native",
) -> dict[str, Any]:
    """One live run at ``rate_rps``; a run the generator could not keep up with (p99 send
    lateness above ``lateness_bound_ms``, by default :func:`live_lateness_bound_ms`) is retried
    once (a burst of other work on a shared machine), then raises GeneratorBehindError."""
    from zserve.loadgen.live_run import BenchOptions, run_once
    from zserve.loadgen.load_plan import BailRule, GeneratorBehindError

    if lateness_bound_ms is None:
        lateness_bound_ms = live_lateness_bound_ms(workload)
    options = BenchOptions(
        workers=0, lateness_bound_ms=lateness_bound_ms,
        bail=BailRule(MAX_BAD_RATE) if bail else None, progress=False, schedule=None,
        protocol=protocol,
    )
    report: dict[str, Any]
    try:
        report = run_once(workload, target, rate_rps, options)
    except GeneratorBehindError:
        report = run_once(workload, target, rate_rps, options)
    return report


def live_goodput(
    target: Any, workload: Workload, *, start_rps: float, precision: float, say: Say, label: str,
    max_rate_rps: float = LIVE_MAX_RATE_RPS, protocol: str = "native",
) -> Goodput:
    """Goodput search on a live cluster. Rates above LIVE_MAX_RATE_RPS count as failing without a
    run (this machine cannot carry them; see the constant), and so does a probe the generator
    fell behind on twice (counted in ``refused_probes``: a figure to distrust)."""
    from zserve.loadgen.load_plan import GeneratorBehindError

    started = time.perf_counter()
    floor_rps = MIN_MEASURED_REQUESTS / 10 / workload.measure_s  # 100 requests at least
    refused = 0

    def probe(rate: float) -> dict[str, Any]:
        nonlocal refused
        if rate > max_rate_rps:
            say(f"  {label} probe {rate:8.1f} r/s: above the live cap, counted as failing")
            return {"bad_rate": 1.0, "bailed": True}
        if rate < floor_rps:
            return {"bad_rate": 1.0, "bailed": True}
        try:
            report = live_run(target, workload, rate, bail=True, protocol=protocol)
        except GeneratorBehindError as exc:
            refused += 1
            say(f"  {label} probe {rate:8.1f} r/s: refused ({exc}); counted as failing")
            return {"bad_rate": 1.0, "bailed": True}
        say(f"  {label} probe {rate:8.1f} r/s: worst bad rate {report['bad_rate']:.3%}"
            f"{' (stopped early)' if report.get('bailed') else ''}")
        return report

    report = search_goodput(probe, min(start_rps, max_rate_rps), max_bad_rate=MAX_BAD_RATE,
                            rel_precision=precision)
    found = reduce_search(report, report.get("bound_rps"), started)
    found.refused_probes = refused
    found.cpu = report.get("cpu")
    return found
