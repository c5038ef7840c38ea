"""``zserve experiment NAME [--live] [--quick] [--out DIR]``: the performance experiments.

One command per experiment; each prints its figures as tables, writes ``DIR/NAME/result.json``
(schema ``zserve-experiment/1``, below) and PNG plots next to it. ``docs/performance.md`` quotes
the full runs and says how to read them.

``fig6a``
    Symphony Figure 6a: 10 identical models (alpha 1 ms, beta 1..15 ms, SLO = 2*l(8)) on 32
    simulated GPUs, Poisson, equal popularity. Goodput (search) under deferred, frontrun (Algorithm
    1 as written), eager and timeout (the best of a few fractions of the SLO) for every beta, and
    the eager/deferred and timeout/deferred ratios. Then, on a scaled-down
    shape (8 GPUs, 3 models), that the eager/deferred ratio does not change when every time in
    the workload is multiplied by the dilation factor (10), and with ``--live`` the same dilated
    shape on a live cluster of emulated GPUs next to its simulated twin.
``zoo``
    The 37-model A100 zoo on 64 simulated GPUs: deferred vs frontrun vs eager vs timeout (a sweep
    of the timeout fraction, as in Figure 6b) and their ratios to deferred.
``flattop``
    Symphony section 3.5: offered load from 0.1x to 2x of the deferred goodput on 24 simulated
    GPUs (four zoo models), per point goodput, bad rate and GPU busy fraction, for deferred and
    (same offered rates) frontrun and eager; the checks "goodput beyond the peak stays >= 95% of
    the peak", "no collapse after the highest good rate" and "busy fraction grows with load"
    (deferred's are the experiment's; the others' are kept for contrast). ``--live`` adds an
    8-GPU emulated cluster (ResNet50's profile dilated 20x) next to its simulated twin.
``eager-floor``
    A grid of small cases (GPUs x models x beta/alpha x SLO multiple) in the simulator:
    deferred/eager (and frontrun/eager) goodput per cell and the minimum (Symphony section 3.4.2
    claims >= 0.95).
``scale``
    ``zserve bench-scheduler`` over a models x GPUs sweep (ResNet50's profile, 80% of the
    staggered bound): the scheduler's CPU per simulated second and whether one core keeps up.

``--quick`` shrinks every experiment to well under 30 s (fewer points, a smaller shape, short
windows, coarser search): the same code path, for the tests. ``--live`` adds the live parts
(fig6a, flattop); they start clusters of emulated backends on this machine.

Result JSON::

    {"schema": "zserve-experiment/1", "experiment": NAME, "quick": bool, "live": bool,
     "command": "zserve experiment ...", "started_at": ISO-8601, "wall_s": float,
     "machine": {"cpus", "load_average", "python", "platform"},
     "config": {...what was run...},
     "tables": [{"title", "columns": [...], "rows": [[...], ...]}, ...],
     "checks": [{"name", "passed", "detail"}, ...],
     "plots": [PNG paths], "points": {...raw figures per experiment...}}

Goodput (as everywhere in zserve) is the highest offered rate whose worst per-model bad rate is
<= 1%, found by ``zserve.loadgen.search``; every probe measures at least
``MIN_MEASURED_REQUESTS`` requests (the measure window is stretched at low rates), since a 1% bad
rate over fewer requests decides nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zserve.loadgen.search import search_goodput
from zserve.loadgen.sim import SimConfig, simulate, workload_bound_rps
from zserve.loadgen.workload import Workload, load_workload, parse_workload
from zserve.scheduler.bounds import staggered_bound_rps
from zserve.scheduler.profiles import LatencyProfile, load_zoo_csv

EXPERIMENT_SCHEMA = "zserve-experiment/1"
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
WORKLOADS_DIR = EXAMPLES_DIR / "workloads"
ZOO_CSV = EXAMPLES_DIR / "profiles" / "model_zoo_a100.csv"
DEFAULT_OUT_DIR = Path("out/perf")

MAX_BAD_RATE = 0.01
# A probe must measure at least this many requests: a 1% bad rate over fewer decides little.
MIN_MEASURED_REQUESTS = 1000
# A simulated probe stops once a model's bad rate is clearly above 3x the bound (sim_cli's rule).
SIM_BAIL_FACTOR = 3.0
FULL_PRECISION = 0.01  # relative precision of a simulated goodput search
QUICK_PRECISION = 0.03
QUICK_WINDOWS_S = (1.0, 1.5, 0.5)  # warmup, measure, cooldown of --quick simulations

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

Say = Callable[[str], None]


# --------------------------------------------------------------------------- tables and results


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


@dataclass
class Table:
    """A titled table of rows; numbers print with 3 decimals below 10, else 1."""

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)

    def text(self) -> str:
        cells = [[_cell(v) for v in row] for row in self.rows]
        widths = [
            max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)
        ]
        lines = [self.title, "  ".join(c.rjust(w) for c, w in zip(self.columns, widths,
                                                                 strict=True))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
        return "\n".join(lines)

    def markdown(self) -> str:
        cells = [[_cell(v) for v in row] for row in self.rows]
        lines = ["| " + " | ".join(self.columns) + " |",
                 "|" + "|".join(" --- " for _ in self.columns) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns, "rows": self.rows}


@dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass
class Options:
    quick: bool
    live: bool
    out_dir: Path
    plots: bool
    say: Say


@dataclass
class Outcome:
    """What an experiment produced (the JSON's config/tables/checks/points, plus plot data)."""

    config: dict[str, Any]
    tables: list[Table]
    checks: list[Check]
    points: dict[str, Any]
    plots: list[Path] = field(default_factory=list)


def machine_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


# --------------------------------------------------------------------------- simulation helpers


def _read_toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text())


def with_windows(workload: Workload, windows_s: tuple[float, float, float] | None) -> Workload:
    if windows_s is None:
        return workload
    warmup, measure, cooldown = windows_s
    return workload.with_overrides(warmup_s=warmup, measure_s=measure, cooldown_s=cooldown)


def scaled_windows(
    windows_s: tuple[float, float, float], factor: float
) -> tuple[float, float, float]:
    warmup, measure, cooldown = windows_s
    return warmup * factor, measure * factor, cooldown * factor


def sim_probe(workload: Workload, rate_rps: float, *, bail: bool = True) -> dict[str, Any]:
    """One simulated run at ``rate_rps``; the measure window is stretched to at least
    MIN_MEASURED_REQUESTS requests."""
    measure_s = max(workload.measure_s, MIN_MEASURED_REQUESTS / rate_rps)
    config = SimConfig(bail_bad_rate=min(1.0, SIM_BAIL_FACTOR * MAX_BAD_RATE) if bail else None)
    return simulate(workload.with_overrides(rate=rate_rps, measure_s=measure_s), config)


@dataclass
class Goodput:
    """A simulated or live goodput search, reduced to what the tables need."""

    goodput_rps: float
    bound_rps: float | None
    probes: int
    median_batch: float | None
    busy_fraction: float | None
    wall_s: float
    search: list[dict[str, Any]]
    refused_probes: int = 0  # live: probes the generator could not keep up with (twice)
    cpu: dict[str, Any] | None = None  # live: CPU per process at the best passing probe

    def to_dict(self) -> dict[str, Any]:
        return {
            "goodput_rps": self.goodput_rps, "bound_rps": self.bound_rps, "probes": self.probes,
            "median_batch": self.median_batch, "busy_fraction": self.busy_fraction,
            "wall_s": round(self.wall_s, 2), "search": self.search,
            "refused_probes": self.refused_probes, "cpu": self.cpu,
        }


def _reduce(report: dict[str, Any], bound: float | None, started: float) -> Goodput:
    search = report.get("search", {})
    return Goodput(
        goodput_rps=float(report.get("goodput_rps", 0.0)),
        bound_rps=bound,
        probes=len(search.get("probes", [])),
        median_batch=(report.get("batch_size") or {}).get("median"),
        busy_fraction=report.get("gpu_busy_fraction"),
        wall_s=time.perf_counter() - started,
        search=search.get("probes", []),
    )


def sim_goodput(
    workload: Workload, *, precision: float, start_rps: float | None = None
) -> Goodput:
    """The simulated goodput of ``workload`` (its policy), searched from ``start_rps`` (default:
    the staggered bound)."""
    started = time.perf_counter()
    try:
        bound: float | None = workload_bound_rps(workload)
    except (ValueError, ZeroDivisionError):
        bound = None
    start = start_rps or (bound if bound and math.isfinite(bound) else workload.rate)
    report = search_goodput(lambda rate: sim_probe(workload, rate), start,
                            max_bad_rate=MAX_BAD_RATE, rel_precision=precision)
    return _reduce(report, bound, started)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator to 4 decimals; None when either is unknown or the denominator 0."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 4)


def timeout_policy(fraction: float) -> str:
    return f"timeout:{fraction:g}"


def best_timeout(
    make: Callable[[str], Workload], fractions: Sequence[float], *, precision: float,
    start_rps: float, say: Say, label: str,
) -> tuple[float, Goodput, dict[str, float]]:
    """The timeout fraction (of the SLO) with the highest goodput: the most favourable tuning of
    the baseline, as Figure 6b sweeps it. Returns (fraction, its goodput, every fraction's)."""
    best: tuple[float, Goodput] | None = None
    sweep: dict[str, float] = {}
    for fraction in fractions:
        found = sim_goodput(make(timeout_policy(fraction)), precision=precision,
                            start_rps=start_rps)
        sweep[f"{fraction:g}"] = found.goodput_rps
        say(f"  {label} timeout:{fraction:g}: {found.goodput_rps:.1f} r/s")
        if best is None or found.goodput_rps > best[1].goodput_rps:
            best = (fraction, found)
    assert best is not None
    return best[0], best[1], sweep


# --------------------------------------------------------------------------- live helpers


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
        "# written by zserve experiment (loadgen/experiments.py)",
        # idle pollers keep the 2 vCPUs awake: a halted vCPU takes milliseconds to wake
        # (zserve/idle_poll.py), which the live runs would measure instead of the scheduler
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
    """Start the cluster (in-process supervisor) and yield its ``loadgen.cli.Target``."""
    from zserve.loadgen import cli

    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "cluster.toml"
    path.write_text(cluster_toml)
    with cli.open_target(str(path), workload, cluster_config=None, model_map={}) as target:
        yield target


def live_lateness_bound_ms(workload: Workload) -> float:
    """The generator lateness (p99, ms) above which a live run of ``workload`` is refused."""
    tightest_slo_ms = min(m.slo_ms for m in workload.models)
    return max(LIVE_MAX_LATENESS_MS, LIVE_LATENESS_SLO_FRACTION * tightest_slo_ms)


def live_run(
    target: Any, workload: Workload, rate_rps: float, *, bail: bool,
    lateness_bound_ms: float | None = None,
) -> dict[str, Any]:
    """One live run at ``rate_rps``; a run the generator could not keep up with (p99 send
    lateness above ``lateness_bound_ms``, by default :func:`live_lateness_bound_ms`) is retried
    once (a burst of other work on a shared machine), then raises GeneratorBehindError."""
    from zserve.loadgen import cli
    from zserve.loadgen.generator import BailRule, GeneratorBehindError

    if lateness_bound_ms is None:
        lateness_bound_ms = live_lateness_bound_ms(workload)
    options = cli.BenchOptions(
        workers=0, lateness_bound_ms=lateness_bound_ms,
        bail=BailRule(MAX_BAD_RATE) if bail else None, progress=False, schedule=None,
    )
    try:
        return cli.run_once(workload, target, rate_rps, options)
    except GeneratorBehindError:
        return cli.run_once(workload, target, rate_rps, options)


def live_goodput(
    target: Any, workload: Workload, *, start_rps: float, precision: float, say: Say, label: str,
    max_rate_rps: float = LIVE_MAX_RATE_RPS,
) -> Goodput:
    """Goodput search on a live cluster. Rates above LIVE_MAX_RATE_RPS count as failing without a
    run (this machine cannot carry them; see the constant), and so does a probe the generator
    fell behind on twice (counted in ``refused_probes``: a figure to distrust)."""
    from zserve.loadgen.generator import GeneratorBehindError

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
            report = live_run(target, workload, rate, bail=True)
        except GeneratorBehindError as exc:
            refused += 1
            say(f"  {label} probe {rate:8.1f} r/s: refused ({exc}); counted as failing")
            return {"bad_rate": 1.0, "bailed": True}
        say(f"  {label} probe {rate:8.1f} r/s: worst bad rate {report['bad_rate']:.3%}"
            f"{' (stopped early)' if report.get('bailed') else ''}")
        return report

    report = search_goodput(probe, min(start_rps, max_rate_rps), max_bad_rate=MAX_BAD_RATE,
                            rel_precision=precision)
    found = _reduce(report, report.get("bound_rps"), started)
    found.refused_probes = refused
    found.cpu = report.get("cpu")
    return found


# --------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    from zserve.loadgen import plots

    return plots.pyplot()


def _save(fig: Any, path: Path) -> Path:
    from zserve.loadgen import plots

    return plots.save_figure(fig, path)


# --------------------------------------------------------------------------- fig6a

FIG6A_WORKLOAD = WORKLOADS_DIR / "fig6a.toml"
FIG6A_BETAS_MS = (1.0, 2.0, 3.0, 5.0, 8.0, 10.0, 12.0, 15.0)
FIG6A_QUICK_BETAS_MS = (1.0, 15.0)
FIG6A_SLO_BATCH = 8  # SLO = 2 * l(8)
# The timeout baseline is tuned per point: the best of these fractions of the SLO (Figure 6b
# sweeps the same parameter; taking the best is the most favourable reading of the baseline).
FIG6A_TIMEOUT_FRACTIONS = (0.1, 0.2, 0.3)
# 32 GPUs carry ~20-30k r/s: a 5 s measure window holds 100k+ requests per probe
FIG6A_WINDOWS_S = (2.0, 5.0, 1.0)
FIG6A_PRECISION = 0.02
FIG6A_QUICK_TIMEOUT_FRACTIONS = (0.2,)
# The scaled-down shape that a 2-core machine can run live: 8 GPUs, 3 models (2.7 GPUs per model
# against the paper's 3.2), every time multiplied by the dilation factor.
FIG6A_LIVE_GPUS = 8
FIG6A_LIVE_MODELS = 3
FIG6A_DILATION = 10.0
FIG6A_QUICK_GPUS = 4  # --quick: 2 models on 4 GPUs, every simulated part
FIG6A_QUICK_MODELS = 2
FIG6A_LIVE_BETAS_MS = (1.0, 5.0, 15.0)
FIG6A_LIVE_QUICK_BETAS_MS = (15.0,)
# Not exact: the rate meter's buckets (50 ms) and window (5 s) are absolute times, so under x10
# dilation it averages a tenth of the requests, and the rate-driven choices (target batch size,
# beta*lambda) are noisier; that moves the ratio by a few hundredths.
FIG6A_INVARIANCE_TOLERANCE = 0.06
FIG6A_QUICK_INVARIANCE_WINDOWS_S = (1.0, 3.0, 0.5)  # |ratio at dilation 10 - ratio at dilation 1|


def fig6a_workload(
    beta_ms: float, policy: str, *, gpus: int | None = None, models: int | None = None,
    dilation: float = 1.0, windows_s: tuple[float, float, float] | None = None,
) -> Workload:
    """Figure 6a's workload at ``beta_ms`` (undilated): SLO = 2*l(8). ``dilation`` multiplies
    alpha, beta, the SLO, the jitter allowance and the windows (so the same arrivals, stretched,
    reach the scheduler); ``windows_s`` (warmup, measure, cooldown) replaces the windows after
    dilation."""
    data = _read_toml(FIG6A_WORKLOAD)
    section = data["workload"]
    base = data["models"][0]
    count = models if models is not None else len(data["models"])
    alpha = float(base["alpha_ms"]) * dilation
    beta = beta_ms * dilation
    slo = 2 * (FIG6A_SLO_BATCH * alpha + beta)
    section["policy"] = policy
    if gpus is not None:
        section["gpus"] = gpus
    section["jitter_ms"] = float(section.get("jitter_ms", 0.0)) * dilation
    for key in ("warmup_s", "measure_s", "cooldown_s"):
        section[key] = float(section[key]) * dilation
    section["rate"] = float(section["rate"]) / dilation
    data["models"] = [
        {"name": f"synthetic-{i}", "slo_ms": slo, "alpha_ms": alpha, "beta_ms": beta}
        for i in range(count)
    ]
    workload = parse_workload(data, base_dir=WORKLOADS_DIR, source=str(FIG6A_WORKLOAD),
                              default_name="fig6a")
    return with_windows(workload, windows_s)


def run_fig6a(opts: Options) -> Outcome:
    quick = opts.quick
    say = opts.say
    betas = FIG6A_QUICK_BETAS_MS if quick else FIG6A_BETAS_MS
    fractions = FIG6A_QUICK_TIMEOUT_FRACTIONS if quick else FIG6A_TIMEOUT_FRACTIONS
    precision = QUICK_PRECISION if quick else FIG6A_PRECISION
    # --quick runs a small shape instead of 10 models on 32 GPUs, and no frontrun column
    shape: dict[str, Any] = (
        {"gpus": FIG6A_QUICK_GPUS, "models": FIG6A_QUICK_MODELS, "windows_s": QUICK_WINDOWS_S}
        if quick else {"windows_s": FIG6A_WINDOWS_S}
    )
    rows: list[dict[str, Any]] = []
    for beta in betas:
        def make(policy: str, beta: float = beta) -> Workload:
            return fig6a_workload(beta, policy, **shape)

        deferred = sim_goodput(make("deferred"), precision=precision)
        frontrun = None if quick else sim_goodput(make("frontrun"), precision=precision,
                                                  start_rps=deferred.goodput_rps)
        eager = sim_goodput(make("eager"), precision=precision, start_rps=deferred.goodput_rps)
        fraction, timeout, sweep = best_timeout(
            make, fractions, precision=precision, start_rps=deferred.goodput_rps, say=say,
            label=f"beta {beta:g} ms")
        w = make("deferred")
        row = {
            "beta_ms": beta, "beta_over_alpha": beta / w.models[0].profile.alpha_s / 1e3,
            "slo_ms": w.models[0].slo_ms, "bound_rps": deferred.bound_rps,
            "deferred_rps": deferred.goodput_rps,
            "frontrun_rps": frontrun.goodput_rps if frontrun else None,
            "eager_rps": eager.goodput_rps,
            "timeout_rps": timeout.goodput_rps, "timeout_fraction": fraction,
            "timeout_sweep_rps": sweep,
            "eager_over_deferred": ratio(eager.goodput_rps, deferred.goodput_rps),
            "eager_over_frontrun": ratio(eager.goodput_rps, frontrun.goodput_rps)
            if frontrun else None,
            "timeout_over_deferred": ratio(timeout.goodput_rps, deferred.goodput_rps),
            "deferred_median_batch": deferred.median_batch,
            "eager_median_batch": eager.median_batch,
        }
        rows.append(row)
        say(f"beta {beta:g} ms: deferred {deferred.goodput_rps:.1f}, frontrun "
            f"{row['frontrun_rps']}, eager "
            f"{eager.goodput_rps:.1f}, timeout:{fraction:g} {timeout.goodput_rps:.1f} r/s "
            f"(eager/deferred {row['eager_over_deferred']})")
    sample = fig6a_workload(betas[0], "deferred", **shape)
    main = Table(
        f"Figure 6a: {len(sample.models)} models, {sample.gpus} GPUs, alpha 1 ms, SLO = 2*l(8), "
        "Poisson (simulated goodput, r/s)",
        ["beta ms", "beta/alpha", "SLO ms", "bound", "deferred", "frontrun", "eager", "timeout",
         "timeout F", "eager/def", "timeout/def", "eager/frontrun", "bs def", "bs eager"],
        [[r["beta_ms"], r["beta_over_alpha"], r["slo_ms"], r["bound_rps"], r["deferred_rps"],
          r["frontrun_rps"], r["eager_rps"], r["timeout_rps"], r["timeout_fraction"],
          r["eager_over_deferred"], r["timeout_over_deferred"], r["eager_over_frontrun"],
          r["deferred_median_batch"], r["eager_median_batch"]]
         for r in rows],
    )
    checks = [Check(
        "deferred >= 0.95x eager at every beta",
        all((r["eager_over_deferred"] or 0) <= 1 / 0.95 for r in rows),
        "eager/deferred: " + ", ".join(f"{r['beta_ms']:g}: {r['eager_over_deferred']}"
                                       for r in rows),
    )]

    # Time dilation: the same shape with every time x10 gives the same ratio (simulator).
    invariance_betas = FIG6A_LIVE_QUICK_BETAS_MS if quick else FIG6A_LIVE_BETAS_MS
    inv_gpus, inv_models = ((FIG6A_QUICK_GPUS, FIG6A_QUICK_MODELS) if quick
                            else (FIG6A_LIVE_GPUS, FIG6A_LIVE_MODELS))
    inv_rows: list[dict[str, Any]] = []
    for beta in invariance_betas:
        entry: dict[str, Any] = {"beta_ms": beta}
        for dilation in (1.0, FIG6A_DILATION):
            # the check compares two searches: both at 1% precision and with a few thousand
            # requests per probe, or the searches' own noise (a few %) swamps the comparison
            windows = scaled_windows(FIG6A_QUICK_INVARIANCE_WINDOWS_S if quick
                                     else FIG6A_WINDOWS_S, dilation)
            found: dict[str, Goodput] = {}
            for policy in ("deferred", "eager"):
                w = fig6a_workload(beta, policy, gpus=inv_gpus, models=inv_models,
                                   dilation=dilation, windows_s=windows)
                start = found["deferred"].goodput_rps if policy == "eager" else None
                found[policy] = sim_goodput(w, precision=FULL_PRECISION, start_rps=start)
            key = f"x{dilation:g}"
            entry[key] = {p: g.goodput_rps for p, g in found.items()}
            entry[f"ratio_{key}"] = ratio(found["eager"].goodput_rps,
                                          found["deferred"].goodput_rps)
        inv_rows.append(entry)
        say(f"dilation check beta {beta:g} ms: eager/deferred {entry['ratio_x1']} (x1) vs "
            f"{entry[f'ratio_x{FIG6A_DILATION:g}']} (x{FIG6A_DILATION:g})")
    dkey = f"x{FIG6A_DILATION:g}"
    inv_table = Table(
        f"Time dilation (simulator, {inv_gpus} GPUs, {inv_models} models): every "
        f"time x{FIG6A_DILATION:g}, goodput in r/s",
        ["beta ms", "deferred x1", "eager x1", "eager/def x1", f"deferred {dkey}",
         f"eager {dkey}", f"eager/def {dkey}", f"def {dkey} * {FIG6A_DILATION:g} / def x1"],
        [[e["beta_ms"], e["x1"]["deferred"], e["x1"]["eager"], e["ratio_x1"],
          e[dkey]["deferred"], e[dkey]["eager"], e[f"ratio_{dkey}"],
          ratio(e[dkey]["deferred"] * FIG6A_DILATION, e["x1"]["deferred"])] for e in inv_rows],
    )
    worst_gap = max(abs((e["ratio_x1"] or 0) - (e[f"ratio_{dkey}"] or 0)) for e in inv_rows)
    checks.append(Check(
        f"eager/deferred invariant under x{FIG6A_DILATION:g} time dilation "
        f"(within {FIG6A_INVARIANCE_TOLERANCE})",
        worst_gap <= FIG6A_INVARIANCE_TOLERANCE, f"largest difference {worst_gap:.4f}"))

    tables = [main, inv_table]
    points: dict[str, Any] = {"sim": rows, "dilation": inv_rows}
    live_rows: list[dict[str, Any]] = []
    if opts.live:
        live_rows = _fig6a_live(opts)
        points["live"] = live_rows
        tables.append(Table(
            f"Live vs simulated twin: {FIG6A_LIVE_GPUS} emulated GPUs, {FIG6A_LIVE_MODELS} "
            f"models, times x{FIG6A_DILATION:g}, live allowances (goodput r/s)",
            ["beta ms", "SLO ms", "deferred live", "deferred sim", "eager live", "eager sim",
             "eager/def live", "eager/def sim", "live/sim def", "live/sim eager"],
            [[r["beta_ms"], r["slo_ms"], r["live"]["deferred"], r["sim"]["deferred"],
              r["live"]["eager"], r["sim"]["eager"], r["ratio_live"], r["ratio_sim"],
              ratio(r["live"]["deferred"], r["sim"]["deferred"]),
              ratio(r["live"]["eager"], r["sim"]["eager"])] for r in live_rows],
        ))
    config = {
        "workload": str(FIG6A_WORKLOAD.relative_to(EXAMPLES_DIR.parent)),
        "gpus": sample.gpus, "models": len(sample.models), "alpha_ms": 1.0, "betas_ms": betas,
        "slo": "2*l(8)", "jitter_ms": sample.jitter_ms, "timeout_fractions": fractions,
        "precision": precision,
        "windows_s": [sample.warmup_s, sample.measure_s, sample.cooldown_s],
        "dilation": FIG6A_DILATION, "live_shape": {"gpus": FIG6A_LIVE_GPUS,
                                                  "models": FIG6A_LIVE_MODELS},
    }
    outcome = Outcome(config, tables, checks, points)
    if opts.plots:
        outcome.plots.append(_plot_fig6a(rows, live_rows, opts.out_dir / "fig6a.png"))
    return outcome


def _fig6a_live(opts: Options) -> list[dict[str, Any]]:
    from zserve.loadgen.generator import GeneratorBehindError

    quick = opts.quick
    say = opts.say
    windows = LIVE_QUICK_WINDOWS_S if quick else LIVE_WINDOWS_S
    precision = QUICK_PRECISION if quick else LIVE_PRECISION
    out: list[dict[str, Any]] = []
    for beta in FIG6A_LIVE_QUICK_BETAS_MS if quick else FIG6A_LIVE_BETAS_MS:
        row: dict[str, Any] = {"beta_ms": beta, "live": {}, "sim": {}, "live_runs": {}}
        for policy in ("deferred", "eager"):
            w = live_allowances(fig6a_workload(
                beta, policy, gpus=FIG6A_LIVE_GPUS, models=FIG6A_LIVE_MODELS,
                dilation=FIG6A_DILATION, windows_s=windows))
            row["slo_ms"] = w.models[0].slo_ms
            twin = sim_goodput(w, precision=FULL_PRECISION)
            row["sim"][policy] = twin.goodput_rps
            toml = emulated_cluster_toml(
                f"fig6a-live-{policy}", emulated_models(w), gpus=w.gpus, policy=policy,
                jitter_ms=w.jitter_ms)
            with tempfile.TemporaryDirectory(prefix="zserve-exp-") as tmp, \
                    live_cluster(toml, w, Path(tmp)) as target:
                if quick:
                    # one run at 90% of the twin's goodput instead of a search (quick budget):
                    # its good rate if it passes, else 0
                    rate = 0.9 * twin.goodput_rps
                    try:
                        report = live_run(target, w, rate, bail=False)
                    except GeneratorBehindError as exc:
                        row["live"][policy] = None
                        row["live_runs"][policy] = {"rate_rps": rate, "refused": str(exc)}
                        continue
                    good = float(report["good_rps"]) if report["bad_rate"] <= MAX_BAD_RATE \
                        else 0.0
                    row["live"][policy] = good
                    row["live_runs"][policy] = {
                        "rate_rps": rate, "good_rps": report["good_rps"],
                        "bad_rate": report["bad_rate"],
                        "busy_fraction": report["gpu_busy_fraction"]}
                else:
                    found = live_goodput(target, w, start_rps=twin.goodput_rps * 1.05,
                                         precision=precision, say=say,
                                         label=f"live beta {beta:g} {policy}")
                    row["live"][policy] = found.goodput_rps
                    row["live_runs"][policy] = found.to_dict()
            say(f"live beta {beta:g} ms {policy}: live {row['live'][policy]} r/s, sim twin "
                f"{twin.goodput_rps:.1f} r/s")
        row["ratio_live"] = ratio(row["live"].get("eager"), row["live"].get("deferred"))
        row["ratio_sim"] = ratio(row["sim"]["eager"], row["sim"]["deferred"])
        out.append(row)
    return out


def _plot_fig6a(rows: list[dict[str, Any]], live: list[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = [r["beta_over_alpha"] for r in rows]
    left.plot(x, [r["bound_rps"] for r in rows], "k:", label="staggered bound")
    left.plot(x, [r["deferred_rps"] for r in rows], "o-", label="deferred")
    if rows[0]["frontrun_rps"] is not None:
        left.plot(x, [r["frontrun_rps"] for r in rows], "v--", label="frontrun (Algorithm 1)")
    left.plot(x, [r["eager_rps"] for r in rows], "s-", label="eager")
    left.plot(x, [r["timeout_rps"] for r in rows], "^-", label="timeout (best F)")
    left.set_xlabel("beta / alpha")
    left.set_ylabel("goodput (r/s)")
    left.set_title("simulated goodput")
    left.grid(alpha=0.3)
    left.legend(fontsize="small")
    right.plot(x, [100 * (r["eager_over_deferred"] or 0) for r in rows], "s-",
               label="eager / deferred", color="tab:orange")
    right.plot(x, [100 * (r["timeout_over_deferred"] or 0) for r in rows], "^-",
               label="timeout / deferred", color="tab:green")
    if rows[0]["eager_over_frontrun"] is not None:
        right.plot(x, [100 * (r["eager_over_frontrun"] or 0) for r in rows], "s:",
                   label="eager / frontrun", color="tab:purple")
    measured = [r for r in live if r["ratio_live"] is not None]
    if measured:
        right.plot([r["beta_ms"] for r in measured], [100 * r["ratio_live"] for r in measured],
                   "D", color="tab:red", label=f"eager / deferred, live (x{FIG6A_DILATION:g})")
        right.plot([r["beta_ms"] for r in measured], [100 * (r["ratio_sim"] or 0)
                                                      for r in measured],
                   "x", color="black", label="... its simulated twin")
    right.axhline(100, color="gray", linewidth=0.8)
    right.axhline(95, color="gray", linestyle=":", linewidth=0.8)
    right.set_xlabel("beta / alpha")
    right.set_ylabel("% of deferred goodput")
    right.set_title("relative to deferred (Figure 6a)")
    right.grid(alpha=0.3)
    right.legend(fontsize="small")
    return _save(fig, path)


# --------------------------------------------------------------------------- zoo

ZOO_WORKLOAD = WORKLOADS_DIR / "a100-zoo-64gpu.toml"
ZOO_TIMEOUT_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5)
ZOO_QUICK_TIMEOUT_FRACTIONS = (0.3,)
ZOO_QUICK_STRIDE = 4  # --quick: every 4th zoo model ...
ZOO_QUICK_GPUS = 16  # ... on 16 GPUs (64 GPUs / 37 models ~ 16 / 10)


def zoo_workload(policy: str, *, quick: bool) -> Workload:
    w = load_workload(ZOO_WORKLOAD).with_overrides(policy=policy)
    if quick:
        w = with_windows(w.with_overrides(models=w.models[::ZOO_QUICK_STRIDE],
                                          gpus=ZOO_QUICK_GPUS), QUICK_WINDOWS_S)
    return w


def run_zoo(opts: Options) -> Outcome:
    quick = opts.quick
    say = opts.say
    precision = QUICK_PRECISION if quick else FULL_PRECISION
    fractions = ZOO_QUICK_TIMEOUT_FRACTIONS if quick else ZOO_TIMEOUT_FRACTIONS
    deferred = sim_goodput(zoo_workload("deferred", quick=quick), precision=precision)
    say(f"zoo deferred: {deferred.goodput_rps:.1f} r/s")
    frontrun = sim_goodput(zoo_workload("frontrun", quick=quick), precision=precision,
                           start_rps=deferred.goodput_rps)
    say(f"zoo frontrun: {frontrun.goodput_rps:.1f} r/s")
    eager = sim_goodput(zoo_workload("eager", quick=quick), precision=precision,
                        start_rps=deferred.goodput_rps)
    say(f"zoo eager: {eager.goodput_rps:.1f} r/s")
    timeouts: dict[str, Goodput] = {}
    for fraction in fractions:
        found = sim_goodput(zoo_workload(timeout_policy(fraction), quick=quick),
                            precision=precision, start_rps=deferred.goodput_rps)
        timeouts[f"{fraction:g}"] = found
        say(f"zoo timeout:{fraction:g}: {found.goodput_rps:.1f} r/s")
    best_fraction = max(timeouts, key=lambda k: timeouts[k].goodput_rps)
    w = zoo_workload("deferred", quick=quick)
    policies: list[tuple[str, Goodput]] = [
        ("deferred", deferred), ("frontrun", frontrun), ("eager", eager)]
    policies += [(timeout_policy(float(f)), g) for f, g in timeouts.items()]
    table = Table(
        f"A100 zoo: {len(w.models)} models, {w.gpus} GPUs, Poisson, equal popularity "
        f"(simulated goodput; bound {deferred.bound_rps:.1f} r/s)",
        ["policy", "goodput r/s", "/ deferred", "/ bound", "median batch", "GPU busy",
         "probes"],
        [[name, g.goodput_rps, ratio(g.goodput_rps, deferred.goodput_rps),
          ratio(g.goodput_rps, deferred.bound_rps or 0.0), g.median_batch, g.busy_fraction,
          g.probes] for name, g in policies],
    )
    checks = [Check("deferred >= 0.95x eager", deferred.goodput_rps >= 0.95 * eager.goodput_rps,
                    f"deferred/eager {ratio(deferred.goodput_rps, eager.goodput_rps)}")]
    points: dict[str, Any] = {name: g.to_dict() for name, g in policies}
    points["best_timeout_fraction"] = float(best_fraction)
    config = {"workload": str(ZOO_WORKLOAD.relative_to(EXAMPLES_DIR.parent)),
              "models": len(w.models), "gpus": w.gpus, "precision": precision,
              "timeout_fractions": fractions, "jitter_ms": w.jitter_ms,
              "windows_s": [w.warmup_s, w.measure_s, w.cooldown_s]}
    outcome = Outcome(config, [table], checks, points)
    if opts.plots:
        outcome.plots.append(_plot_zoo(policies, deferred.bound_rps, opts.out_dir / "zoo.png"))
    return outcome


def _plot_zoo(policies: list[tuple[str, Goodput]], bound: float | None, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [n for n, _ in policies]
    values = [g.goodput_rps for _, g in policies]
    colors = ["tab:blue", "tab:purple", "tab:orange"] + ["tab:green"] * (len(names) - 3)
    ax.bar(range(len(names)), values, color=colors)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize="small")
    if bound:
        ax.axhline(bound, color="black", linestyle=":", label=f"staggered bound {bound:.0f}")
        ax.legend(fontsize="small")
    ax.set_ylabel("goodput (r/s)")
    ax.set_title("A100 zoo (simulated): goodput by policy")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


# --------------------------------------------------------------------------- flattop

FLATTOP_LOADS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)
FLATTOP_QUICK_LOADS = (0.25, 0.5, 1.0, 1.5, 2.0)
# Four zoo models from strong to weak batching effect (beta/alpha 195, 19, 7.4, 3.4).
FLATTOP_MODELS = ("DenseNet121", "ResNet50", "InceptionV3", "VGG16")
FLATTOP_GPUS = 24
FLATTOP_QUICK_GPUS = 8
FLATTOP_WINDOWS_S = (2.0, 5.0, 1.0)
FLATTOP_PEAK_FRACTION = 0.95  # goodput beyond the peak must stay at least this
FLATTOP_BUSY_SLACK = 0.005  # busy fraction may dip this much between points (noise)
# Live: ResNet50's Table 2 profile (alpha 1.053 ms, beta 5.072 ms, SLO 25 ms) with every time x20
# on 8 emulated GPUs: its peak (~270 r/s) keeps the 2x point near 550 r/s, which this machine
# carries.
FLATTOP_LIVE_GPUS = 8
FLATTOP_LIVE_DILATION = 20.0
FLATTOP_LIVE_PROFILE_MS = (1.053, 5.072, 25.0)  # alpha, beta, SLO
FLATTOP_LIVE_QUICK_LOADS = (0.5, 2.0)


def flattop_workload(policy: str, *, quick: bool) -> Workload:
    rows = {r.name: r for r in load_zoo_csv(ZOO_CSV)}
    models = [
        {"name": name, "slo_ms": rows[name].slo_ms, "alpha_ms": rows[name].alpha_ms,
         "beta_ms": rows[name].beta_ms}
        for name in FLATTOP_MODELS
    ]
    warmup, measure, cooldown = QUICK_WINDOWS_S if quick else FLATTOP_WINDOWS_S
    data = {"workload": {"name": "flattop-zoo4", "gpus": FLATTOP_QUICK_GPUS if quick
                         else FLATTOP_GPUS, "policy": policy, "arrival": "poisson",
                         "warmup_s": warmup, "measure_s": measure, "cooldown_s": cooldown,
                         "jitter_ms": 1.0, "rate": 1000.0},
            "models": models}
    return parse_workload(data, source="flattop-zoo4")


def flattop_live_workload(policy: str, *, quick: bool) -> Workload:
    alpha, beta, slo = (x * FLATTOP_LIVE_DILATION for x in FLATTOP_LIVE_PROFILE_MS)
    warmup, measure, cooldown = LIVE_QUICK_WINDOWS_S if quick else LIVE_WINDOWS_S
    data = {"workload": {"name": f"flattop-resnet50-x{FLATTOP_LIVE_DILATION:g}",
                         "gpus": FLATTOP_LIVE_GPUS, "policy": policy, "arrival": "poisson",
                         "warmup_s": warmup, "measure_s": measure, "cooldown_s": cooldown,
                         "jitter_ms": 1.0 * FLATTOP_LIVE_DILATION, "rate": 200.0},
            "models": [{"name": "resnet50", "slo_ms": slo, "alpha_ms": alpha,
                        "beta_ms": beta}]}
    return live_allowances(parse_workload(data, source="flattop-live"))


def _flat_point(load: float, rate: float, report: dict[str, Any]) -> dict[str, Any]:
    return {
        "load": load, "offered_rps": round(rate, 2),
        "measured_offered_rps": report["offered_rps"], "good_rps": report["good_rps"],
        "bad_rate": report["bad_rate"], "bad_rate_all": report["bad_rate_all"],
        "busy_fraction": report["gpu_busy_fraction"],
        "median_batch": report["batch_size"]["median"],
    }


def flattop_checks(points: list[dict[str, Any]], label: str, peak_rps: float) -> list[Check]:
    """Section 3.5's goodput stability and load-proportional GPU use, as three checks:

    - beyond the peak (offered >= ``peak_rps``, the searched goodput), good r/s stays >= 95% of
      the peak;
    - after the highest good r/s of the sweep, good r/s stays >= 95% of it (no collapse past the
      top: with several models the total good rate can keep rising past the 1%-bad goodput);
    - the GPU busy fraction grows with the offered load (dips within FLATTOP_BUSY_SLACK pass).
    """
    beyond = [p for p in points if p["load"] >= 1.0]
    worst = min((p["good_rps"] for p in beyond), default=peak_rps)
    top_index = max(range(len(points)), key=lambda i: points[i]["good_rps"])
    top = points[top_index]["good_rps"]
    after_top = min(p["good_rps"] for p in points[top_index:])
    busy = [p["busy_fraction"] for p in points]
    dips = [
        f"{a['load']:g}x->{b['load']:g}x: {a['busy_fraction']:.3f}->{b['busy_fraction']:.3f}"
        for a, b in itertools.pairwise(points)
        if b["busy_fraction"] is None or a["busy_fraction"] is None
        or b["busy_fraction"] < a["busy_fraction"] - FLATTOP_BUSY_SLACK
    ]
    return [
        Check(f"{label}: goodput beyond the peak >= {FLATTOP_PEAK_FRACTION:.0%} of the peak",
              worst >= FLATTOP_PEAK_FRACTION * peak_rps,
              f"peak (searched goodput) {peak_rps:.1f} r/s, lowest good r/s at >= 1x "
              f"{worst:.1f} ({worst / peak_rps:.3f})"),
        Check(f"{label}: no collapse after the highest good rate",
              after_top >= FLATTOP_PEAK_FRACTION * top,
              f"highest {top:.1f} r/s at {points[top_index]['load']:g}x, lowest after it "
              f"{after_top:.1f} ({after_top / top:.3f})"),
        Check(f"{label}: GPU busy fraction grows with offered load",
              not dips and all(b is not None for b in busy),
              "busy " + ", ".join(f"{b:.3f}" if b is not None else "-" for b in busy)
              + (f"; dips: {'; '.join(dips)}" if dips else "")),
    ]


def run_flattop(opts: Options) -> Outcome:
    quick = opts.quick
    say = opts.say
    precision = QUICK_PRECISION if quick else FULL_PRECISION
    loads = FLATTOP_QUICK_LOADS if quick else FLATTOP_LOADS
    base = flattop_workload("deferred", quick=quick)
    peak = sim_goodput(base, precision=precision)
    say(f"flattop: deferred goodput {peak.goodput_rps:.1f} r/s on {base.gpus} GPUs")
    series: dict[str, list[dict[str, Any]]] = {}
    for policy in ("deferred", "frontrun", "eager"):
        w = flattop_workload(policy, quick=quick)
        points = []
        for load in loads:
            rate = load * peak.goodput_rps
            report = sim_probe(w, rate, bail=False)
            points.append(_flat_point(load, rate, report))
            say(f"  {policy} {load:g}x ({rate:.0f} r/s): good {report['good_rps']:.1f} r/s, "
                f"bad {report['bad_rate_all']:.2%}, busy {report['gpu_busy_fraction']:.3f}")
        series[f"sim {policy}"] = points
    goodput = peak.goodput_rps
    checks = flattop_checks(series["sim deferred"], "sim deferred", goodput)
    checks_info = (flattop_checks(series["sim frontrun"], "sim frontrun (for contrast)", goodput)
                   + flattop_checks(series["sim eager"], "sim eager (for contrast)", goodput))
    tables = [_flattop_table(
        f"Flat-top (simulated): {', '.join(FLATTOP_MODELS)} on {base.gpus} GPUs; load = offered /"
        f" deferred goodput ({peak.goodput_rps:.1f} r/s)",
        [(p, series[f"sim {p}"]) for p in ("deferred", "frontrun", "eager")], peak.goodput_rps)]
    live_peak: float | None = None
    if opts.live:
        refused: list[dict[str, Any]] = []
        live_series, live_peak = _flattop_live(opts, refused)
        series.update(live_series)
        if refused:
            checks.append(Check("live deferred: every load point measured", False,
                                f"{len(refused)} point(s) refused: the generator fell behind"))
        # the live cluster's own peak: its best good rate up to the twin's goodput (the live
        # goodput sits below the simulated one: docs/performance.md, live vs the bound)
        live_own_peak = max(p["good_rps"] for p in series["live deferred"] if p["load"] <= 1.0)
        checks += flattop_checks(series["live deferred"], "live deferred", live_own_peak)
        tables.append(_flattop_table(
            f"Flat-top live: ResNet50 x{FLATTOP_LIVE_DILATION:g} on {FLATTOP_LIVE_GPUS} emulated "
            f"GPUs, deferred, next to its simulated twin; load = offered / the twin's goodput "
            f"({live_peak:.1f} r/s)",
            [("live", series["live deferred"]), ("twin", series["sim twin deferred"])],
            live_peak))
    config = {"models": FLATTOP_MODELS, "gpus": base.gpus, "loads": loads,
              "windows_s": [base.warmup_s, base.measure_s, base.cooldown_s],
              "peak_fraction": FLATTOP_PEAK_FRACTION, "busy_slack": FLATTOP_BUSY_SLACK,
              "live": {"gpus": FLATTOP_LIVE_GPUS, "dilation": FLATTOP_LIVE_DILATION,
                       "profile_ms": FLATTOP_LIVE_PROFILE_MS}}
    points_out: dict[str, Any] = {"deferred_goodput_rps": peak.goodput_rps, "series": series,
                                  "contrast_checks": [c.to_dict() for c in checks_info]}
    if live_peak is not None:
        points_out["live_twin_goodput_rps"] = live_peak
        points_out["live_refused"] = refused
    outcome = Outcome(config, tables, checks, points_out)
    if opts.plots:
        outcome.plots.append(_plot_flattop(series, opts.out_dir / "flattop.png"))
    return outcome


def _flattop_table(title: str, series: list[tuple[str, list[dict[str, Any]]]],
                   peak: float) -> Table:
    """Per load point: offered rate, then goodput, bad rate and busy fraction of each series
    (the first one next to the ideal flat top: bad (o-p)/o, busy share min(load, 1))."""
    columns = ["load", "offered r/s"]
    columns += [f"good {name}" for name, _ in series]
    columns += [f"bad {name}" for name, _ in series] + ["bad ideal"]
    columns += [f"busy {name}" for name, _ in series] + [f"bs {series[0][0]}"]
    rows = []
    for i, first in enumerate(series[0][1]):
        offered = first["offered_rps"]
        row: list[Any] = [first["load"], offered]
        row += [points[i]["good_rps"] for _, points in series]
        row += [points[i]["bad_rate_all"] for _, points in series]
        row.append(round(max(0.0, (offered - peak) / offered), 4))
        row += [points[i]["busy_fraction"] for _, points in series]
        row.append(first["median_batch"])
        rows.append(row)
    return Table(title, columns, rows)


def _flattop_live(
    opts: Options, refused: list[dict[str, Any]]
) -> tuple[dict[str, list[dict[str, Any]]], float]:
    """The live sweep and its simulated twin at the same rates; a point the generator could not
    keep up with (twice) is left out and listed in ``refused``."""
    from zserve.loadgen.generator import GeneratorBehindError

    quick = opts.quick
    say = opts.say
    loads = FLATTOP_LIVE_QUICK_LOADS if quick else FLATTOP_LOADS
    w = flattop_live_workload("deferred", quick=quick)
    twin_peak = sim_goodput(w, precision=FULL_PRECISION).goodput_rps
    say(f"flattop live: twin goodput {twin_peak:.1f} r/s")
    live_points: list[dict[str, Any]] = []
    twin_points: list[dict[str, Any]] = []
    toml = emulated_cluster_toml("flattop-live", emulated_models(w), gpus=w.gpus,
                                 policy="deferred", jitter_ms=w.jitter_ms)
    with tempfile.TemporaryDirectory(prefix="zserve-exp-") as tmp, \
            live_cluster(toml, w, Path(tmp)) as target:
        for load in loads:
            rate = load * twin_peak
            try:
                report = live_run(target, w, rate, bail=False)
            except GeneratorBehindError as exc:
                refused.append({"load": load, "offered_rps": rate, "reason": str(exc)})
                say(f"  live {load:g}x ({rate:.0f} r/s): refused ({exc})")
                continue
            live_points.append(_flat_point(load, rate, report))
            twin_points.append(_flat_point(load, rate, sim_probe(w, rate, bail=False)))
            say(f"  live {load:g}x ({rate:.0f} r/s): good {report['good_rps']:.1f} r/s, bad "
                f"{report['bad_rate_all']:.2%}, busy {report['gpu_busy_fraction']}")
    return {"live deferred": live_points, "sim twin deferred": twin_points}, twin_peak


def _plot_flattop(series: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    styles = {"sim deferred": "o-", "sim eager": "s--", "sim frontrun": "v:", "live deferred": "D-",
              "sim twin deferred": "x:"}
    for name, points in series.items():
        x = [p["load"] for p in points]
        # normalise by the rate that load 1.0 stands for (the deferred or twin goodput)
        good = [p["good_rps"] * p["load"] / p["offered_rps"] for p in points]
        style = styles.get(name, "o-")
        axes[0].plot(x, good, style, label=name)
        axes[1].plot(x, [p["bad_rate_all"] for p in points], style, label=name)
        axes[2].plot(x, [p["busy_fraction"] or 0.0 for p in points], style, label=name)
    grid = [i / 100 for i in range(10, 201, 5)]
    axes[0].plot(grid, [min(g, 1.0) for g in grid], "k:", linewidth=0.8, label="ideal min(o, p)")
    axes[1].plot(grid, [max(0.0, (g - 1) / g) for g in grid], "k:", linewidth=0.8,
                 label="ideal (o-p)/o")
    axes[0].axhline(FLATTOP_PEAK_FRACTION, color="gray", linestyle=":", linewidth=0.8)
    axes[0].set_ylabel("good rate / deferred goodput")
    axes[1].set_ylabel("bad rate (all requests)")
    axes[2].set_ylabel("GPU busy fraction")
    for ax in axes:
        ax.set_xlabel("offered load / deferred goodput")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    axes[1].legend(fontsize="small")
    fig.suptitle("Flat-top: goodput, bad rate and GPU busy fraction vs offered load")
    return _save(fig, path)


# --------------------------------------------------------------------------- eager-floor

FLOOR_GPUS = (1, 2, 4, 8)
FLOOR_MODELS = (1, 2, 4)
FLOOR_BETA_OVER_ALPHA = (0.25, 1.0, 4.0, 16.0)
FLOOR_SLO_MULTIPLES = (2.0, 4.0, 8.0)  # SLO = k * l(1)
FLOOR_ALPHA_MS = 1.0
FLOOR_WINDOWS_S = (2.0, 4.0, 1.0)
FLOOR_PRECISION = 0.02
FLOOR_THRESHOLD = 0.95
# --quick: the known failure shape (2 GPUs, 2 models) and three neighbours
FLOOR_QUICK_CELLS = ((2, 2, 1.0, 4.0), (2, 2, 16.0, 2.0), (1, 2, 4.0, 4.0), (4, 1, 4.0, 4.0))


def floor_workload(gpus: int, models: int, beta_over_alpha: float, slo_multiple: float,
                   policy: str, *, quick: bool) -> Workload:
    alpha = FLOOR_ALPHA_MS
    beta = beta_over_alpha * alpha
    slo = slo_multiple * (alpha + beta)
    warmup, measure, cooldown = QUICK_WINDOWS_S if quick else FLOOR_WINDOWS_S
    data = {"workload": {"name": f"floor-g{gpus}-m{models}-r{beta_over_alpha:g}-"
                                 f"k{slo_multiple:g}", "gpus": gpus, "policy": policy,
                         "arrival": "poisson", "warmup_s": warmup, "measure_s": measure,
                         "cooldown_s": cooldown, "jitter_ms": 1.0, "rate": 100.0},
            "models": [{"name": f"m{i}", "slo_ms": slo, "alpha_ms": alpha, "beta_ms": beta}
                       for i in range(models)]}
    return parse_workload(data, source="eager-floor")


def run_eager_floor(opts: Options) -> Outcome:
    quick = opts.quick
    say = opts.say
    precision = QUICK_PRECISION if quick else FLOOR_PRECISION
    if quick:
        cells: list[tuple[int, int, float, float]] = list(FLOOR_QUICK_CELLS)
    else:
        cells = [(g, m, r, k) for g in FLOOR_GPUS for m in FLOOR_MODELS
                 for r in FLOOR_BETA_OVER_ALPHA for k in FLOOR_SLO_MULTIPLES]
    rows: list[dict[str, Any]] = []
    for gpus, models, beta_over_alpha, slo_multiple in cells:
        def make(policy: str, g: int = gpus, m: int = models, r: float = beta_over_alpha,
                 k: float = slo_multiple) -> Workload:
            return floor_workload(g, m, r, k, policy, quick=quick)

        # every policy's search starts at the same rate (the bound), so policies that behave
        # alike probe the same rates: the 0.95 threshold is tighter than a search's path noise
        deferred = sim_goodput(make("deferred"), precision=precision)
        eager = sim_goodput(make("eager"), precision=precision)
        frontrun = sim_goodput(make("frontrun"), precision=precision)
        row: dict[str, Any] = {"gpus": gpus, "models": models, "beta_over_alpha": beta_over_alpha,
               "slo_multiple": slo_multiple, "slo_ms": make("eager").models[0].slo_ms,
               "deferred_rps": deferred.goodput_rps, "eager_rps": eager.goodput_rps,
               "frontrun_rps": frontrun.goodput_rps,
               "deferred_over_eager": ratio(deferred.goodput_rps, eager.goodput_rps),
               "frontrun_over_eager": ratio(frontrun.goodput_rps, eager.goodput_rps)}
        rows.append(row)
        say(f"  g={gpus} m={models} beta/alpha={beta_over_alpha:g} SLO={slo_multiple:g}*l(1): "
            f"deferred {deferred.goodput_rps:.1f} frontrun {frontrun.goodput_rps:.1f} eager "
            f"{eager.goodput_rps:.1f}: deferred/eager {row['deferred_over_eager']}, "
            f"frontrun/eager {row['frontrun_over_eager']}")
    ratios = [r["deferred_over_eager"] for r in rows if r["deferred_over_eager"] is not None]
    f_ratios = [r["frontrun_over_eager"] for r in rows if r["frontrun_over_eager"] is not None]
    worst = sorted(rows, key=lambda r: r["deferred_over_eager"] or 0.0)
    below = [r for r in rows if (r["deferred_over_eager"] or 0.0) < FLOOR_THRESHOLD]
    table_rows = rows if quick or len(rows) <= 12 else worst[:12]
    tables = [
        Table(
            "Deferred vs eager, simulated goodput (r/s), alpha 1 ms, SLO = k*l(1), Poisson"
            + ("" if table_rows is rows else f" (the 12 lowest of {len(rows)} cells)"),
            ["GPUs", "models", "beta/alpha", "k", "SLO ms", "deferred", "frontrun", "eager",
             "def/eager", "frontrun/eager"],
            [[r["gpus"], r["models"], r["beta_over_alpha"], r["slo_multiple"], r["slo_ms"],
              r["deferred_rps"], r["frontrun_rps"], r["eager_rps"], r["deferred_over_eager"],
              r["frontrun_over_eager"]] for r in table_rows],
        ),
        Table("Summary (frontrun: Algorithm 1 without the beta*lambda rule, for contrast)",
              ["policy", "cells", "min / eager", "median / eager", "cells below 0.95"],
              [["deferred", len(rows), min(ratios), sorted(ratios)[len(ratios) // 2],
                len(below)],
               ["frontrun", len(rows), min(f_ratios), sorted(f_ratios)[len(f_ratios) // 2],
                sum(1 for x in f_ratios if x < FLOOR_THRESHOLD)]]),
    ]
    checks = [Check(f"deferred >= {FLOOR_THRESHOLD}x eager in every cell", not below,
                    f"min {min(ratios):.3f}; below: " + (", ".join(
                        f"g{r['gpus']} m{r['models']} b/a {r['beta_over_alpha']:g} k "
                        f"{r['slo_multiple']:g}: {r['deferred_over_eager']}" for r in below)
                        or "none"))]
    config = {"gpus": FLOOR_GPUS, "models": FLOOR_MODELS,
              "beta_over_alpha": FLOOR_BETA_OVER_ALPHA, "slo_multiples": FLOOR_SLO_MULTIPLES,
              "alpha_ms": FLOOR_ALPHA_MS, "precision": precision, "cells": len(cells),
              "windows_s": QUICK_WINDOWS_S if quick else FLOOR_WINDOWS_S, "jitter_ms": 1.0}
    outcome = Outcome(config, tables, checks, {"cells": rows})
    if opts.plots:
        outcome.plots.append(_plot_floor(rows, opts.out_dir / "eager-floor.png"))
    return outcome


def _plot_floor(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ordered = sorted(rows, key=lambda r: (r["gpus"], r["models"], r["beta_over_alpha"],
                                          r["slo_multiple"]))
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green", 8: "tab:red"}
    for gpus in sorted({r["gpus"] for r in ordered}):
        idx = [i for i, r in enumerate(ordered) if r["gpus"] == gpus]
        ax.scatter(idx, [ordered[i]["deferred_over_eager"] for i in idx], s=14,
                   color=colors.get(gpus, "gray"), label=f"{gpus} GPU(s)")
        ax.scatter(idx, [ordered[i]["frontrun_over_eager"] for i in idx], s=14, marker="x",
                   color=colors.get(gpus, "gray"), alpha=0.5)
    ax.axhline(FLOOR_THRESHOLD, color="black", linestyle=":", linewidth=0.8, label="0.95")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("grid cell (by GPUs, models, beta/alpha, SLO multiple)")
    ax.set_ylabel("deferred / eager goodput")
    ax.set_title("Eager floor (simulated): deferred (dots) and frontrun (x) over eager")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=5)
    return _save(fig, path)


# --------------------------------------------------------------------------- scale

SCALE_MODELS = (1, 8, 32, 128)
# up to 512: one core runs out between 256 and 512 GPUs, so the grid shows where
SCALE_GPUS = (16, 32, 64, 128, 256, 512)
SCALE_REPEATS = 3  # CPU figures on a shared machine: the median of three probes
SCALE_QUICK_MODELS = (1, 4)
SCALE_QUICK_GPUS = (8, 32)
SCALE_PROFILE_MS = (1.053, 5.072, 25.0)  # ResNet50, Symphony Table 2: alpha, beta, SLO
SCALE_LOAD = 0.8  # offered rate / staggered bound
SCALE_DURATION_S = 3.0
SCALE_QUICK_DURATION_S = 0.5


def scale_rate(models: int, gpus: int) -> float:
    alpha, beta, slo = SCALE_PROFILE_MS
    profile = LatencyProfile.linear_for_slo(alpha, beta, slo)
    bound = staggered_bound_rps([(profile, slo / 1e3, 1.0 / models)] * models, gpus)
    return SCALE_LOAD * bound


def run_scale(opts: Options) -> Outcome:
    quick = opts.quick
    say = opts.say
    models_list = SCALE_QUICK_MODELS if quick else SCALE_MODELS
    gpus_list = SCALE_QUICK_GPUS if quick else SCALE_GPUS
    duration = SCALE_QUICK_DURATION_S if quick else SCALE_DURATION_S
    alpha, beta, slo = SCALE_PROFILE_MS
    max_batch = LatencyProfile.linear_for_slo(alpha, beta, slo).max_batch
    rows: list[dict[str, Any]] = []
    for models in models_list:
        for gpus in gpus_list:
            if models > gpus:
                continue
            rate = scale_rate(models, gpus)
            runs = [_bench_probe(models, gpus, rate=rate, duration=duration, max_batch=max_batch)
                    for _ in range(1 if quick else SCALE_REPEATS)]
            probe = sorted(runs, key=lambda r: r["busy_fraction"])[len(runs) // 2]
            cores = probe["busy_fraction"]
            row = {"models": models, "gpus": gpus, "rate_rps": round(rate, 1),
                   "cores": cores, "cpu_us_per_request":
                   probe["cpu_us_per_request"], "capacity_rps": probe["capacity_rps"],
                   "gpus_per_core": round(gpus / cores, 1) if cores > 0 else None,
                   "lag_p99_ms": probe["lag_ms"]["p99"], "bad_rate": probe["bad_rate"],
                   "mean_batch": probe["mean_batch"], "sustained": probe["sustained"],
                   "repeats": len(runs), "cores_all": [r["busy_fraction"] for r in runs]}
            rows.append(row)
            say(f"  {models} models, {gpus} GPUs at {rate:.0f} r/s: {row['cores']:.2f} cores, "
                f"{row['cpu_us_per_request']:.2f} us/request, lag p99 {row['lag_p99_ms']:.2f} ms"
                f", bad {row['bad_rate']:.2%} -> {'ok' if row['sustained'] else 'FAIL'}")
    largest = {}
    for models in models_list:
        ok = [r["gpus"] for r in rows if r["models"] == models and r["sustained"]]
        largest[str(models)] = max(ok) if ok else None
    tables = [
        Table(
            f"One scheduler process (bench-scheduler, CPU clock): ResNet50 profile, "
            f"{SCALE_LOAD:.0%} of the staggered bound, {duration:g} s per probe",
            ["models", "GPUs", "offered r/s", "cores", "us/request", "capacity r/s",
             "GPUs/core", "lag p99 ms", "bad rate", "mean batch", "sustained"],
            [[r["models"], r["gpus"], r["rate_rps"], r["cores"], r["cpu_us_per_request"],
              r["capacity_rps"], r["gpus_per_core"], r["lag_p99_ms"], r["bad_rate"],
              r["mean_batch"], r["sustained"]] for r in rows]),
        Table("Largest GPU count driven at full load, per model count",
              ["models", "largest GPUs sustained"],
              [[int(m), g] for m, g in largest.items()]),
    ]
    config = {"models": models_list, "gpus": gpus_list, "profile_ms": SCALE_PROFILE_MS,
              "max_batch": max_batch, "load": SCALE_LOAD, "duration_s": duration,
              "criterion": "lag p99 <= 2 ms and worst bad rate <= 1% (zserve bench-scheduler)"}
    points: dict[str, Any] = {"probes": rows, "largest_gpus": largest}
    if opts.live:
        live = _scale_live(opts)
        points["live"] = live
        config["live"] = {k: live[k] for k in ("gpus", "model", "slo_ms", "policy")}
        cpu = live.get("cpu") or {}
        per_request = cpu.get("per_request_us", {})
        tables.append(Table(
            f"End to end through real processes on this machine: the load generator, one "
            f"frontend, the scheduler and {live['gpus']} emulated GPUs running a near-free model "
            f"(l(b) = {SCALE_LIVE_ALPHA_MS} ms x b + {SCALE_LIVE_BETA_MS} ms, SLO "
            f"{SCALE_LIVE_SLO_MS:g} ms, {live['policy']}): the highest rate with <= 1% bad",
            ["goodput r/s", "probes", "refused probes", "cores busy", "us/request (all)",
             "us/request by process"],
            [[live["goodput_rps"], live["probes"], live["refused_probes"],
              cpu.get("total_cores"),
              round(sum(per_request.values()), 1) if per_request else None,
              ", ".join(f"{k} {v:g}" for k, v in per_request.items()) or None]],
        ))
    outcome = Outcome(config, tables, [], points)
    if opts.plots:
        outcome.plots.append(_plot_scale(rows, opts.out_dir / "scale.png"))
    return outcome


# scale --live: the machine's end-to-end ceiling, with a model so cheap that the GPUs never are
SCALE_LIVE_GPUS = 4
SCALE_LIVE_ALPHA_MS = 0.01
SCALE_LIVE_BETA_MS = 0.1
SCALE_LIVE_SLO_MS = 100.0
SCALE_LIVE_START_RPS = 2000.0
SCALE_LIVE_MAX_RATE_RPS = 20000.0


def _scale_live(opts: Options) -> dict[str, Any]:
    quick = opts.quick
    data = {"workload": {"name": "scale-live", "gpus": SCALE_LIVE_GPUS, "policy": "eager",
                         "arrival": "poisson", "rate": SCALE_LIVE_START_RPS,
                         "warmup_s": 1.0, "measure_s": 1.0, "cooldown_s": 0.5, "jitter_ms": 1.0},
            "models": [{"name": "tiny", "slo_ms": SCALE_LIVE_SLO_MS,
                        "alpha_ms": SCALE_LIVE_ALPHA_MS, "beta_ms": SCALE_LIVE_BETA_MS,
                        "max_batch": 64}]}
    workload = live_allowances(with_windows(
        parse_workload(data, source="scale-live"),
        LIVE_QUICK_WINDOWS_S if quick else LIVE_WINDOWS_S))
    toml = emulated_cluster_toml("scale-live", emulated_models(workload), gpus=workload.gpus,
                                 policy="eager", jitter_ms=workload.jitter_ms)
    with tempfile.TemporaryDirectory(prefix="zserve-exp-") as tmp, \
            live_cluster(toml, workload, Path(tmp)) as target:
        found = live_goodput(target, workload, start_rps=SCALE_LIVE_START_RPS,
                             precision=QUICK_PRECISION if quick else LIVE_PRECISION,
                             say=opts.say, label="end to end",
                             max_rate_rps=SCALE_LIVE_MAX_RATE_RPS)
    opts.say(f"end to end: {found.goodput_rps:.0f} r/s with <= 1% bad")
    return {**found.to_dict(), "gpus": workload.gpus, "model": "tiny",
            "slo_ms": SCALE_LIVE_SLO_MS, "policy": "eager"}


def _bench_probe(
    models: int, gpus: int, *, rate: float, duration: float, max_batch: int
) -> dict[str, Any]:
    """One ``zserve bench-scheduler --rate`` probe (its CLI, quietly); returns the probe dict."""
    from zserve.scheduler import bench

    alpha, beta, slo = SCALE_PROFILE_MS
    with tempfile.TemporaryDirectory(prefix="zserve-exp-") as tmp:
        out = Path(tmp) / "bench.json"
        argv = ["--models", str(models), "--gpus", str(gpus), "--rate", f"{rate:.1f}",
                "--duration", str(duration), "--alpha-ms", str(alpha), "--beta-ms", str(beta),
                "--slo-ms", str(slo), "--max-batch", str(max_batch), "--jitter-ms", "1.0",
                "--json", str(out)]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = bench.main(argv)
        if code != 0:
            raise RuntimeError(f"zserve bench-scheduler {' '.join(argv)} exited {code}")
        probe: dict[str, Any] = json.loads(out.read_text())["probes"][0]
        return probe


def _plot_scale(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for models in sorted({r["models"] for r in rows}):
        mine = [r for r in rows if r["models"] == models]
        ax.plot([r["gpus"] for r in mine], [r["cores"] for r in mine], "o-",
                label=f"{models} model(s)")
        for r in mine:
            if not r["sustained"]:
                ax.plot(r["gpus"], r["cores"], "x", color="red", markersize=10)
    ax.axhline(1.0, color="black", linestyle=":", linewidth=0.8, label="one core")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("simulated GPUs (offered load 80% of the staggered bound)")
    ax.set_ylabel("scheduler cores per simulated second")
    ax.set_title("Scheduler CPU vs cluster size (x: not sustained)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


# --------------------------------------------------------------------------- command line

EXPERIMENTS: dict[str, tuple[Callable[[Options], Outcome], str]] = {
    "fig6a": (run_fig6a, "Figure 6a: eager and timeout vs deferred over beta/alpha"),
    "zoo": (run_zoo, "the 37-model A100 zoo on 64 GPUs: deferred vs eager vs timeout"),
    "flattop": (run_flattop, "goodput, bad rate, GPU busy vs offered load (0.1x..2x)"),
    "eager-floor": (run_eager_floor, "deferred/eager over a grid of small cases"),
    "scale": (run_scale, "scheduler CPU vs models x GPUs (bench-scheduler); --live: the "
              "machine's end-to-end ceiling"),
}


def run_experiment(name: str, opts: Options, command: str) -> dict[str, Any]:
    """Run one experiment, write DIR/NAME/result.json (and plots), return the result dict."""
    func, _ = EXPERIMENTS[name]
    started = time.perf_counter()
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    machine = machine_info()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    outcome = func(opts)
    result = {
        "schema": EXPERIMENT_SCHEMA,
        "experiment": name,
        "quick": opts.quick,
        "live": opts.live,
        "command": command,
        "started_at": started_at,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": machine,
        "config": outcome.config,
        "tables": [t.to_dict() for t in outcome.tables],
        "checks": [c.to_dict() for c in outcome.checks],
        "plots": [str(p) for p in outcome.plots],
        "points": outcome.points,
    }
    (opts.out_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (opts.out_dir / "tables.md").write_text(
        "\n\n".join(f"**{t.title}**\n\n{t.markdown()}" for t in outcome.tables) + "\n")
    return result


def result_text(result: dict[str, Any]) -> str:
    lines = []
    for t in result["tables"]:
        lines += [Table(t["title"], t["columns"], t["rows"]).text(), ""]
    for c in result["checks"]:
        lines.append(f"check {'PASS' if c['passed'] else 'FAIL'}: {c['name']} ({c['detail']})")
    if result["plots"]:
        lines.append("plots: " + ", ".join(result["plots"]))
    lines.append(f"{result['experiment']}: {result['wall_s']:.1f} s wall")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    epilog = "experiments:\n" + "\n".join(
        f"  {name:<12} {help_}" for name, (_, help_) in EXPERIMENTS.items())
    p = argparse.ArgumentParser(
        prog="zserve experiment", description=__doc__.split("\n\n")[0], epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(EXPERIMENTS), help="the experiment")
    p.add_argument("--live", action="store_true",
                   help="add the live parts (fig6a, flattop, scale): clusters of emulated "
                   "backends")
    p.add_argument("--quick", action="store_true", help="a small version (< 30 s), for tests")
    p.add_argument("--out", default=str(DEFAULT_OUT_DIR),
                   help=f"results go to OUT/NAME/ (default {DEFAULT_OUT_DIR})")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    quiet = args.quiet

    def say(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    opts = Options(quick=args.quick, live=args.live, out_dir=Path(args.out) / args.name,
                   plots=not args.no_plots, say=say)
    command = "zserve experiment " + " ".join(argv)
    result = run_experiment(args.name, opts, command)
    print(result_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
