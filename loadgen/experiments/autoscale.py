"""``autoscale``: Symphony v2 section 5.3's flat top with the autoscaler acting (simulated): 10
ResNet-like models (GTX 1080 Ti ResNet50, 100 ms SLO), offered load from 0.1x to 2x of the peak
goodput p of N GPUs; each load point starts on N GPUs and the autoscaler
(:mod:`zserve.orchestrator.autoscale`, hosted by :mod:`zserve.loadgen.sim.elastic`) adds and
releases GPUs. Checks: the good rate within 2% of the offered load at every point (the top moves
up with the GPUs), and the GPUs in use within 5% (or one GPU) of N o / p.

Durations are compressed (the autoscaler's windows are seconds, not minutes) so that each point
runs in seconds of simulated time; the policy's shape (thresholds, dead band, hold) is the one
``[autoscale]`` defaults to, its times scaled by ``AUTOSCALE_SIM_TIME_SCALE``.

``--live``: a step in load on emulated backends under the supervisor's autoscaler instead
(:mod:`zserve.loadgen.experiments.autoscale_live`).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from zserve.loadgen.experiments.autoscale_live import run_autoscale_live
from zserve.loadgen.experiments.common import Check, Options, Outcome, Table, pyplot, save_figure
from zserve.loadgen.experiments.simulated import FULL_PRECISION, QUICK_PRECISION, sim_goodput
from zserve.loadgen.sim.elastic import ElasticConfig
from zserve.loadgen.sim.simulator import SimConfig, simulate
from zserve.loadgen.workload import Workload, parse_workload
from zserve.orchestrator.autoscale import AutoscalePolicy

AUTOSCALE_MODELS = 10
AUTOSCALE_QUICK_MODELS = 4  # --quick: 4 models on 8 GPUs (10 on 8 share every GPU: no idle)
AUTOSCALE_PROFILE_MS = (2.05, 5.378, 100.0)  # GTX 1080 Ti ResNet50: alpha, beta; the SLO
AUTOSCALE_GPUS = 24
AUTOSCALE_QUICK_GPUS = 8
AUTOSCALE_LOADS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0)
AUTOSCALE_QUICK_LOADS = (0.75, 1.5)
AUTOSCALE_POOL_FACTOR = 2.5  # GPUs in the simulated pool: this times N (room for 2x)
# The policy's windows in simulated seconds: the live defaults (zserve.config.cluster) x 1/10.
AUTOSCALE_SIM_POLICY = AutoscalePolicy(up_window_s=1.0, down_window_s=2.0, settle_s=0.5,
                                       down_hold_s=2.0)
AUTOSCALE_START_DELAY_S = 0.25
AUTOSCALE_TICK_S = 0.25
AUTOSCALE_CONVERGE_S = 8.0  # from the start on N GPUs to the measure window (24 -> 3: 3 steps)
AUTOSCALE_MEASURE_S = 4.0
AUTOSCALE_QUICK_CONVERGE_S = 5.0
AUTOSCALE_QUICK_MEASURE_S = 2.0
GOOD_SHARE_MIN = 0.98  # good rate / offered at every point
GPUS_TOLERANCE = 0.05  # GPUs in use within this share of N o / p (or one GPU)


def autoscale_workload(gpus: int, rate: float, windows_s: tuple[float, float, float], *,
                       quick: bool) -> Workload:
    alpha, beta, slo = AUTOSCALE_PROFILE_MS
    warmup, measure, cooldown = windows_s
    models = [{"name": f"resnet{i}", "slo_ms": slo, "alpha_ms": alpha, "beta_ms": beta}
              for i in range(AUTOSCALE_QUICK_MODELS if quick else AUTOSCALE_MODELS)]
    data = {"workload": {"name": "autoscale-resnet10", "gpus": gpus, "policy": "deferred",
                         "arrival": "poisson", "warmup_s": warmup, "measure_s": measure,
                         "cooldown_s": cooldown, "jitter_ms": 1.0, "rate": rate},
            "models": models}
    return parse_workload(data, source="autoscale-resnet10")


def autoscaled_point(n: int, rate: float, policy: AutoscalePolicy, *, quick: bool,
                     ) -> dict[str, Any]:
    """One load point: start on ``n`` GPUs of a pool, converge, measure."""
    converge = AUTOSCALE_QUICK_CONVERGE_S if quick else AUTOSCALE_CONVERGE_S
    measure = AUTOSCALE_QUICK_MEASURE_S if quick else AUTOSCALE_MEASURE_S
    pool = int(AUTOSCALE_POOL_FACTOR * n)
    w = autoscale_workload(pool, rate, (converge, measure, 0.5), quick=quick)
    scaling = ElasticConfig(replace(policy, max_backends=pool), n,
                            start_delay_s=AUTOSCALE_START_DELAY_S, tick_s=AUTOSCALE_TICK_S)
    report = simulate(w, SimConfig(autoscale=scaling))
    timeline = report["autoscale"]["timeline"]
    window = [r for r in timeline if converge < r["t"] <= converge + measure]
    in_use = sum(r["serving"] + r["starting"] + r["draining"] for r in window) / len(window)
    return {"offered_rps": report["offered_rps"], "good_rps": report["good_rps"],
            "bad_rate": report["bad_rate_all"], "gpus_in_use": round(in_use, 2),
            "gpus_end": timeline[-1]["serving"], "changes": report["autoscale"]["changes"],
            "timeline": timeline}


def _checks(points: list[dict[str, Any]], n: int) -> list[Check]:
    short = [f"{p['load']:g}x {p['good_rps'] / p['offered_rps']:.3f}" for p in points
             if p["good_rps"] < GOOD_SHARE_MIN * p["offered_rps"]]
    far = []
    for p in points:
        ideal = p["ideal_gpus"]
        if abs(p["gpus_in_use"] - ideal) > max(GPUS_TOLERANCE * ideal, 1.0):
            far.append(f"{p['load']:g}x {p['gpus_in_use']:.1f} vs {ideal:.1f}")
    return [
        Check(f"good rate >= {GOOD_SHARE_MIN:.0%} of the offered load at every load up to 2x",
              not short, "good/offered " + ", ".join(
                  f"{p['load']:g}x {p['good_rps'] / p['offered_rps']:.3f}" for p in points)
              + (f"; short: {', '.join(short)}" if short else "")),
        Check(f"GPUs in use within {GPUS_TOLERANCE:.0%} (or one GPU) of N o / p (N = {n})",
              not far, "in use " + ", ".join(
                  f"{p['load']:g}x {p['gpus_in_use']:.1f}/{p['ideal_gpus']:.1f}" for p in points)
              + (f"; far: {', '.join(far)}" if far else "")),
    ]


def run_autoscale(opts: Options) -> Outcome:
    if opts.live:  # a step in load on emulated backends under the supervisor's autoscaler
        return run_autoscale_live(opts)
    quick = opts.quick
    n = AUTOSCALE_QUICK_GPUS if quick else AUTOSCALE_GPUS
    loads = AUTOSCALE_QUICK_LOADS if quick else AUTOSCALE_LOADS
    fixed = autoscale_workload(n, 1000.0, (1.0, 3.0, 0.5) if not quick else (0.5, 1.5, 0.5),
                               quick=quick)
    peak = sim_goodput(fixed, precision=QUICK_PRECISION if quick else FULL_PRECISION)
    # the idle floor: the idle fraction N GPUs keep at their peak (chosen by this measurement)
    floor = round(max(0.0, 1.0 - (peak.busy_fraction or 1.0)), 3)
    policy = replace(AUTOSCALE_SIM_POLICY, idle_floor=floor)
    opts.say(f"autoscale: peak {peak.goodput_rps:.0f} r/s on {n} GPUs, idle floor {floor}")
    points = []
    for load in loads:
        point = autoscaled_point(n, load * peak.goodput_rps, policy, quick=quick)
        point.update(load=load, ideal_gpus=round(n * load, 2))
        points.append(point)
        opts.say(f"  {load:g}x: good {point['good_rps']:.0f} of {point['offered_rps']:.0f} r/s, "
                 f"bad {point['bad_rate']:.2%}, GPUs {point['gpus_in_use']:.1f} "
                 f"(N o/p {n * load:.1f}), {len(point['changes'])} changes")
    converge_s = AUTOSCALE_QUICK_CONVERGE_S if quick else AUTOSCALE_CONVERGE_S
    table = Table(
        f"Autoscaled flat top (simulated): {len(fixed.models)} ResNet50 (1080 Ti) models, SLO "
        f"100 ms, start on N = {n} GPUs (peak p = {peak.goodput_rps:.0f} r/s, idle floor "
        f"{floor}); measured after {converge_s:g} s of autoscaling",
        ["load o/p", "offered r/s", "good r/s", "good/offered", "bad", "GPUs in use",
         "N o/p", "changes"],
        [[p["load"], p["offered_rps"], p["good_rps"], round(p["good_rps"] / p["offered_rps"], 4),
          p["bad_rate"], p["gpus_in_use"], p["ideal_gpus"], len(p["changes"])] for p in points])
    config = {"models": len(fixed.models), "profile_ms": AUTOSCALE_PROFILE_MS, "gpus": n,
              "loads": loads, "policy": asdict(policy), "start_delay_s":
              AUTOSCALE_START_DELAY_S, "tick_s": AUTOSCALE_TICK_S}
    outcome = Outcome(config, [table], _checks(points, n),
                      {"peak_rps": peak.goodput_rps, "idle_floor": floor, "points": points})
    if opts.plots:
        outcome.plots.append(_plot(points, n, opts.out_dir / "autoscale.png"))
    return outcome


def _plot(points: list[dict[str, Any]], n: int, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    loads = [p["load"] for p in points]
    axes[0].plot(loads, [p["good_rps"] / p["offered_rps"] for p in points], "o-")
    axes[0].axhline(GOOD_SHARE_MIN, color="gray", linestyle=":")
    axes[0].set_ylabel("good rate / offered")
    axes[1].plot(loads, [p["gpus_in_use"] for p in points], "o-", label="GPUs in use")
    axes[1].plot(loads, [n * x for x in loads], "k:", label="N o / p")
    axes[1].set_ylabel("GPUs")
    axes[1].legend(fontsize="small")
    for ax in axes[:2]:
        ax.set_xlabel("offered load / peak of N GPUs")
        ax.grid(alpha=0.3)
    top = points[-1]
    t = [r["t"] for r in top["timeline"]]
    axes[2].plot(t, [r["serving"] for r in top["timeline"]], label="serving")
    axes[2].plot(t, [r["advice"] for r in top["timeline"]], "--", label="advice")
    axes[2].set_xlabel(f"simulated s at {top['load']:g}x")
    axes[2].set_ylabel("GPUs")
    axes[2].legend(fontsize="small")
    fig.suptitle("Autoscaled flat top: good rate and GPUs vs offered load")
    return Path(save_figure(fig, path))
