"""``flattop``: goodput, bad rate, GPU busy fraction and admitted attainment vs offered load (0.1x
to 3x)."""

from __future__ import annotations

import itertools
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from zserve.config.cluster import parse_config
from zserve.loadgen.experiments.common import (
    ZOO_CSV,
    Check,
    Options,
    Outcome,
    Table,
    pyplot,
    save_figure,
)
from zserve.loadgen.experiments.live import (
    LIVE_QUICK_WINDOWS_S,
    LIVE_WINDOWS_S,
    emulated_cluster_toml,
    emulated_models,
    live_allowances,
    live_cluster,
    live_run,
)
from zserve.loadgen.experiments.simulated import (
    FULL_PRECISION,
    QUICK_PRECISION,
    QUICK_WINDOWS_S,
    sim_goodput,
    sim_probe,
)
from zserve.loadgen.workload import Workload, parse_workload
from zserve.loadgen.zoo import load_zoo_csv

FLATTOP_LOADS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0)
FLATTOP_QUICK_LOADS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0)
# Four zoo models from strong to weak batching effect (beta/alpha 195, 19, 7.4, 3.4).
FLATTOP_MODELS = ("DenseNet121", "ResNet50", "InceptionV3", "VGG16")
FLATTOP_GPUS = 24
FLATTOP_QUICK_GPUS = 8
FLATTOP_WINDOWS_S = (2.0, 5.0, 1.0)
FLATTOP_PEAK_FRACTION = 0.95  # goodput beyond the peak must stay at least this
# With admission (live, and its twin), of the requests admitted at OVERLOAD_FROM x the peak and
# beyond, at least this fraction is answered within its SLO: the excess is refused, not admitted
# to miss.
FLATTOP_ADMITTED_ATTAINMENT = 0.99
FLATTOP_OVERLOAD_FROM = 1.5
FLATTOP_BUSY_SLACK = 0.005  # busy fraction may dip this much between points (noise)
FLATTOP_SATURATED_SLACK = 0.05  # beyond the peak: within this of the highest busy fraction
# Live: ResNet50's Table 2 profile (alpha 1.053 ms, beta 5.072 ms, SLO 25 ms) with every time x20
# on 8 emulated GPUs: its peak (~270 r/s) keeps the 3x point near 820 r/s, which this machine
# carries; l(b*) = 438 ms against a 500 ms SLO makes it the slow model admission must not starve.
FLATTOP_LIVE_GPUS = 8
FLATTOP_LIVE_DILATION = 20.0
FLATTOP_LIVE_PROFILE_MS = (1.053, 5.072, 25.0)  # alpha, beta, SLO
FLATTOP_LIVE_QUICK_LOADS = (0.5, 1.5, 2.0, 3.0)


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
    attained = [m["admitted_attainment"] for m in report["per_model"].values()
                if m.get("admitted_attainment") is not None]
    return {
        "load": load, "offered_rps": round(rate, 2),
        "measured_offered_rps": report["offered_rps"], "good_rps": report["good_rps"],
        "bad_rate": report["bad_rate"], "bad_rate_all": report["bad_rate_all"],
        "busy_fraction": report["gpu_busy_fraction"],
        "median_batch": report["batch_size"]["median"],
        # the worst model's share of its admitted requests answered within the SLO
        "admitted_attainment": min(attained) if attained else None,
    }


def admission_check(points: list[dict[str, Any]], label: str) -> Check:
    """From FLATTOP_OVERLOAD_FROM x on, the admitted requests meet their SLO."""
    overload = [p for p in points if p["load"] >= FLATTOP_OVERLOAD_FROM]
    attained = [p["admitted_attainment"] for p in overload]
    worst = min((a for a in attained if a is not None), default=None)
    return Check(
        f"{label}: admitted requests within their SLO >= {FLATTOP_ADMITTED_ATTAINMENT:.0%} from "
        f"{FLATTOP_OVERLOAD_FROM:g}x",
        bool(overload) and worst is not None and None not in attained
        and worst >= FLATTOP_ADMITTED_ATTAINMENT,
        "attained " + ", ".join(f"{p['load']:g}x {p['admitted_attainment']}" for p in overload))


def flattop_checks(points: list[dict[str, Any]], label: str, peak_rps: float) -> list[Check]:
    """Section 3.5's goodput stability and load-proportional GPU use, as three checks:

    - beyond the peak (offered >= ``peak_rps``, the searched goodput), good r/s stays >= 95% of
      the peak;
    - after the highest good r/s of the sweep, good r/s stays >= 95% of it (no collapse past the
      top: with several models the total good rate can keep rising past the 1%-bad goodput);
    - the GPU busy fraction grows with the offered load up to the peak (dips within
      FLATTOP_BUSY_SLACK pass), and beyond it stays within FLATTOP_SATURATED_SLACK of its highest:
      past the capacity the GPUs are as busy as admission lets them be, which trades a few
      points of GPU time for admitted requests that meet their SLO.
    """
    beyond = [p for p in points if p["load"] >= 1.0]
    worst = min((p["good_rps"] for p in beyond), default=peak_rps)
    top_index = max(range(len(points)), key=lambda i: points[i]["good_rps"])
    top = points[top_index]["good_rps"]
    after_top = min(p["good_rps"] for p in points[top_index:])
    busy = [p["busy_fraction"] for p in points]
    rising = [p for p in points if p["load"] <= 1.0]
    dips = [
        f"{a['load']:g}x->{b['load']:g}x: {a['busy_fraction']:.3f}->{b['busy_fraction']:.3f}"
        for a, b in itertools.pairwise(rising)
        if b["busy_fraction"] is None or a["busy_fraction"] is None
        or b["busy_fraction"] < a["busy_fraction"] - FLATTOP_BUSY_SLACK
    ]
    known = [b for b in busy if b is not None]
    highest = max(known, default=0.0)
    dips += [f"{p['load']:g}x: {p['busy_fraction']:.3f} (highest {highest:.3f})"
             for p in points if p["load"] > 1.0 and p["busy_fraction"] is not None
             and p["busy_fraction"] < highest - FLATTOP_SATURATED_SLACK]
    return [
        Check(f"{label}: goodput beyond the peak >= {FLATTOP_PEAK_FRACTION:.0%} of the peak",
              worst >= FLATTOP_PEAK_FRACTION * peak_rps,
              f"peak (searched goodput) {peak_rps:.1f} r/s, lowest good r/s at >= 1x "
              f"{worst:.1f} ({worst / peak_rps:.3f})"),
        Check(f"{label}: no collapse after the highest good rate",
              after_top >= FLATTOP_PEAK_FRACTION * top,
              f"highest {top:.1f} r/s at {points[top_index]['load']:g}x, lowest after it "
              f"{after_top:.1f} ({after_top / top:.3f})"),
        Check(f"{label}: GPU busy fraction grows with offered load to the peak, then holds",
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
    refused: list[dict[str, Any]] = []
    if opts.live:
        live_series, live_peak = _flattop_live(opts, refused)
        series.update(live_series)
        checks += _live_checks(series, refused, live_peak)
        tables.append(_flattop_table(
            f"Flat-top live: ResNet50 x{FLATTOP_LIVE_DILATION:g} on {FLATTOP_LIVE_GPUS} emulated "
            f"GPUs, deferred, next to its simulated twin with the cluster's admission; load = "
            f"offered / the twin's goodput ({live_peak:.1f} r/s)",
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


def _live_checks(series: dict[str, list[dict[str, Any]]], refused: list[dict[str, Any]],
                 twin_peak: float) -> list[Check]:
    """The live sweep's checks and its twin's: the flat top and the admitted requests' SLO."""
    checks = []
    if refused:
        checks.append(Check("live deferred: every load point measured", False,
                            f"{len(refused)} point(s) refused: the generator fell behind"))
    # the live cluster's own peak: its best good rate up to the twin's goodput (the live
    # goodput sits below the simulated one: docs/performance.md, live vs the bound)
    live_own_peak = max(p["good_rps"] for p in series["live deferred"] if p["load"] <= 1.0)
    checks += flattop_checks(series["live deferred"], "live deferred", live_own_peak)
    checks += flattop_checks(series["sim twin deferred"], "sim twin deferred", twin_peak)
    checks += [admission_check(series["live deferred"], "live deferred"),
               admission_check(series["sim twin deferred"], "sim twin deferred")]
    return checks


def _flattop_table(title: str, series: list[tuple[str, list[dict[str, Any]]]],
                   peak: float) -> Table:
    """Per load point: offered rate, then goodput, bad rate and busy fraction of each series
    (the first one next to the ideal flat top: bad (o-p)/o, busy share min(load, 1)), and the
    share of admitted requests answered within the SLO."""
    columns = ["load", "offered r/s"]
    columns += [f"good {name}" for name, _ in series]
    columns += [f"bad {name}" for name, _ in series] + ["bad ideal"]
    columns += [f"busy {name}" for name, _ in series] + [f"bs {series[0][0]}"]
    columns += [f"attained {name}" for name, _ in series]
    rows = []
    for i, first in enumerate(series[0][1]):
        offered = first["offered_rps"]
        row: list[Any] = [first["load"], offered]
        row += [points[i]["good_rps"] for _, points in series]
        row += [points[i]["bad_rate_all"] for _, points in series]
        row.append(round(max(0.0, (offered - peak) / offered), 4))
        row += [points[i]["busy_fraction"] for _, points in series]
        row.append(first["median_batch"])
        row += [points[i]["admitted_attainment"] for _, points in series]
        rows.append(row)
    return Table(title, columns, rows)


def _flattop_live(
    opts: Options, refused: list[dict[str, Any]]
) -> tuple[dict[str, list[dict[str, Any]]], float]:
    """The live sweep and its simulated twin at the same rates; a point the generator could not
    keep up with (twice) is left out and listed in ``refused``."""
    from zserve.loadgen.load_plan import GeneratorBehindError

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
    cluster = parse_config(tomllib.loads(toml))  # the twin admits as the live frontend does
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
            twin_points.append(_flat_point(load, rate, sim_probe(w, rate, bail=False,
                                                                 frontend=cluster)))
            say(f"  live {load:g}x ({rate:.0f} r/s): good {report['good_rps']:.1f} r/s, bad "
                f"{report['bad_rate_all']:.2%}, busy {report['gpu_busy_fraction']}")
    return {"live deferred": live_points, "sim twin deferred": twin_points}, twin_peak


def _plot_flattop(series: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    plt = pyplot()
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
    return Path(save_figure(fig, path))
