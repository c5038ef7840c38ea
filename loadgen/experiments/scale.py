"""``scale``: the scheduler's CPU over a models x GPUs sweep; ``--live``: the end-to-end ceiling."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from zserve.config.profiles import LatencyProfile
from zserve.loadgen.experiments.common import Options, Outcome, Say, Table, pyplot, save_figure
from zserve.loadgen.experiments.live import (
    LIVE_PRECISION,
    LIVE_QUICK_WINDOWS_S,
    LIVE_WINDOWS_S,
    emulated_cluster_toml,
    emulated_models,
    live_allowances,
    live_cluster,
    live_goodput,
)
from zserve.loadgen.experiments.simulated import QUICK_PRECISION, with_windows
from zserve.loadgen.workload import parse_workload
from zserve.scheduler.bounds import staggered_bound_rps

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
    return SCALE_LOAD * float(bound)


def _scale_point(models: int, gpus: int, *, quick: bool, duration: float, max_batch: int,
                 say: Say) -> dict[str, Any]:
    """One models x GPUs cell: the median (by CPU) of its bench-scheduler probes."""
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
    say(f"  {models} models, {gpus} GPUs at {rate:.0f} r/s: {row['cores']:.2f} cores, "
        f"{row['cpu_us_per_request']:.2f} us/request, lag p99 {row['lag_p99_ms']:.2f} ms"
        f", bad {row['bad_rate']:.2%} -> {'ok' if row['sustained'] else 'FAIL'}")
    return row


def _scale_tables(rows: list[dict[str, Any]], largest: dict[str, int | None],
                  duration: float) -> list[Table]:
    return [
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


def _scale_live_table(live: dict[str, Any]) -> Table:
    cpu = live.get("cpu") or {}
    per_request = cpu.get("per_request_us", {})
    return Table(
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
    )


def run_scale(opts: Options) -> Outcome:
    quick = opts.quick
    models_list = SCALE_QUICK_MODELS if quick else SCALE_MODELS
    gpus_list = SCALE_QUICK_GPUS if quick else SCALE_GPUS
    duration = SCALE_QUICK_DURATION_S if quick else SCALE_DURATION_S
    alpha, beta, slo = SCALE_PROFILE_MS
    max_batch = LatencyProfile.linear_for_slo(alpha, beta, slo).max_batch
    rows = [_scale_point(models, gpus, quick=quick, duration=duration, max_batch=max_batch,
                         say=opts.say)
            for models in models_list for gpus in gpus_list if models <= gpus]
    largest: dict[str, int | None] = {}
    for models in models_list:
        ok = [r["gpus"] for r in rows if r["models"] == models and r["sustained"]]
        largest[str(models)] = max(ok) if ok else None
    tables = _scale_tables(rows, largest, duration)
    config: dict[str, Any] = {
        "models": models_list, "gpus": gpus_list, "profile_ms": SCALE_PROFILE_MS,
        "max_batch": max_batch, "load": SCALE_LOAD, "duration_s": duration,
        "criterion": "lag p99 <= 2 ms and worst bad rate <= 1% (zserve bench-scheduler)",
    }
    points: dict[str, Any] = {"probes": rows, "largest_gpus": largest}
    if opts.live:
        live = _scale_live(opts)
        points["live"] = live
        config["live"] = {k: live[k] for k in ("gpus", "model", "slo_ms", "policy")}
        tables.append(_scale_live_table(live))
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
    from zserve.scheduler.bench import throughput

    alpha, beta, slo = SCALE_PROFILE_MS
    with tempfile.TemporaryDirectory(prefix="zserve-exp-") as tmp:
        out = Path(tmp) / "bench.json"
        argv = ["--models", str(models), "--gpus", str(gpus), "--rate", f"{rate:.1f}",
                "--duration", str(duration), "--alpha-ms", str(alpha), "--beta-ms", str(beta),
                "--slo-ms", str(slo), "--max-batch", str(max_batch), "--jitter-ms", "1.0",
                "--json", str(out)]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = throughput.main(argv)
        if code != 0:
            raise RuntimeError(f"zserve bench-scheduler {' '.join(argv)} exited {code}")
        probe: dict[str, Any] = json.loads(out.read_text())["probes"][0]
        return probe


def _plot_scale(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
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
    return Path(save_figure(fig, path))
