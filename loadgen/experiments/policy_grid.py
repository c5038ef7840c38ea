"""``policy-grid``: the default policy against every baseline over a grid of workloads.

Each cell is a workload shape; per cell, a simulated goodput search for ``deferred`` (the
default), ``frontrun`` (Symphony Algorithm 1 as written), ``eager``, ``eager-edf`` (the paper's
Clockwork-style baseline) and ``timeout:F`` (the best of a few fractions of the SLO). The cells:

- single models: ResNet50 (SLO 25 ms) and InceptionResNetV2 (SLO 70 ms), the Table 2 profiles, on
  8 and 16 GPUs, Poisson, Gamma(0.3) and constant arrivals;
- Figure 6a's shapes: 10 identical models (alpha 1 ms, SLO 2*l(8)) on 32 GPUs, three betas;
- mixes on 16 GPUs with different SLOs, equal and Zipf(1) popularity: 3 models (ResNet50,
  InceptionResNetV2, MobileNet) and 10 (every 4th A100-zoo model);
- the 37-model A100 zoo on 64 GPUs;
- network delays (d_ctrl 0.5 ms, d_data 0.05 ms per row) on ResNet50 x 8 and the 3-model mix.

The check fails if the default's goodput is below max(frontrun, eager) - 1% in any cell. Where
the default's search stopped below that bar, the default is probed at the bar itself, and a
passing probe lifts its goodput there (a bad rate near 1% is not monotone in the rate, so a
search can stop below a rate that passes). The default also runs under the ``suffix`` drop rule
(``deferred+suffix``), against the ``window`` rule it runs by default. A second
part, light load, runs the default at fixed fractions (0.05x .. 1x) of its goodput on a single
model and a mix, and reports the GPU busy fraction against the load-proportional line (busy at 1x
times the fraction) and the p50 latency against l(1) + the allowances.

``--quick`` runs two small cells (a single model with network delays, a 3-model mix) with short
windows and a coarse search, and light load at two fractions: a smoke test of seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zserve.loadgen.experiments.common import (
    WORKLOADS_DIR,
    Check,
    Options,
    Outcome,
    Say,
    Table,
    pyplot,
    save_figure,
)
from zserve.loadgen.experiments.simulated import (
    Goodput,
    best_timeout,
    cross_probe,
    probe_at_bar,
    ratio,
    sim_goodput,
    sim_probe,
    timeout_policy,
)
from zserve.loadgen.workload import Workload, load_workload, parse_workload

# "POLICY+DROP" runs POLICY under that drop rule: the default under the other window rule
# (scheduler/policy.py, ``window`` the authors' 2021 rule, ``suffix`` nexuslb's 2022 one).
GRID_POLICIES = ("deferred", "frontrun", "eager", "eager-edf", "deferred-bl", "deferred+suffix")
GRID_TIMEOUT_FRACTIONS = (0.1, 0.2, 0.3)
GRID_QUICK_TIMEOUT_FRACTIONS = (0.2,)
GRID_WINDOWS_S = (2.0, 4.0, 1.0)  # warmup, measure, cooldown of a full-grid probe
GRID_PRECISION = 0.01  # the check is at 1%: a coarser search could not resolve it
GRID_QUICK_WINDOWS_S = (0.5, 1.0, 0.25)
GRID_QUICK_PRECISION = 0.05
GRID_MARGIN = 0.01  # the default may trail max(frontrun, eager) by at most this fraction
GRID_JITTER_MS = 1.0
NETWORK_D_CTRL_MS = 0.5
NETWORK_D_DATA_MS = 0.05
# (name, SLO ms, alpha ms, beta ms): Table 2's profiles, and a small model of the A100 zoo
RESNET50 = ("ResNet50", 25.0, 1.053, 5.072)
IRV2 = ("InceptionResNetV2", 70.0, 5.090, 18.368)
MOBILENET = ("MobileNet", 20.0, 0.285, 1.901)
FIG6A_ALPHA_MS = 1.0
FIG6A_BETAS_MS = (1.0, 5.0, 15.0)
FIG6A_MODELS = 10
FIG6A_GPUS = 32
ZOO_WORKLOAD = WORKLOADS_DIR / "a100-zoo-64gpu.toml"
ZOO_SUBSET_STRIDE = 4  # every 4th zoo model: 10 models
LIGHT_FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.8, 1.0)
LIGHT_QUICK_FRACTIONS = (0.25, 1.0)
LIGHT_BUSY_TOLERANCE = 0.1  # busy within this of the load-proportional line ...
LIGHT_BUSY_UP_TO = 0.8  # ... up to this fraction of the goodput
# A trickle of requests (this many per second per model, so about 0.1 are expected to join one
# within a 20 ms SLO): each model's p50 within LONE_TOLERANCE_MS of its own l(1) + allowances.
TRICKLE_RPS_PER_MODEL = 5.0
LONE_TOLERANCE_MS = 1.0

Make = Callable[[str], Workload]


@dataclass(frozen=True)
class Cell:
    """One workload shape of the grid: ``make(policy)`` builds its workload."""

    name: str
    group: str
    make: Make


def _workload(name: str, gpus: int, models: list[tuple[str, float, float, float]], *,
              arrival: str = "poisson", popularity: str = "equal",
              windows_s: tuple[float, float, float] = GRID_WINDOWS_S,
              network: bool = False) -> Make:
    warmup, measure, cooldown = windows_s
    section: dict[str, Any] = {
        "name": name, "gpus": gpus, "arrival": arrival, "popularity": popularity,
        "warmup_s": warmup, "measure_s": measure, "cooldown_s": cooldown,
        "jitter_ms": GRID_JITTER_MS, "rate": 1000.0}
    if network:
        section.update(d_ctrl_ms=NETWORK_D_CTRL_MS, d_data_ms=NETWORK_D_DATA_MS)
    specs = [{"name": n, "slo_ms": slo, "alpha_ms": a, "beta_ms": b} for n, slo, a, b in models]

    def make(label: str) -> Workload:
        policy, _, drop = label.partition("+")
        return parse_workload({"workload": {**section, "policy": policy, "drop": drop or "window"},
                               "models": specs}, source=f"policy-grid {name}")
    return make


def _zoo(name: str, gpus: int, stride: int, popularity: str,
         windows_s: tuple[float, float, float]) -> Make:
    base = load_workload(ZOO_WORKLOAD)
    warmup, measure, cooldown = windows_s
    zoo = base.with_overrides(models=base.models[::stride], gpus=gpus, popularity=popularity,
                              warmup_s=warmup, measure_s=measure, cooldown_s=cooldown,
                              name=name)

    def make(label: str) -> Workload:
        policy, _, drop = label.partition("+")
        return zoo.with_overrides(policy=policy, drop=drop or "window")
    return make


def grid_cells(*, quick: bool) -> list[Cell]:
    """The grid (``quick``: three small cells with short windows)."""
    if quick:
        w = GRID_QUICK_WINDOWS_S
        return [
            Cell("ResNet50 x2 network", "network", _workload(
                "r50-2-net", 2, [RESNET50], windows_s=w, network=True)),
            Cell("mix3 x4 equal", "mix", _workload(
                "mix3-4", 4, [RESNET50, IRV2, MOBILENET], windows_s=w)),
        ]
    cells = [
        Cell(f"{m[0]} x{g} {arrival}", "single",
             _workload(f"{m[0]}-{g}-{arrival}", g, [m], arrival=arrival))
        for m in (RESNET50, IRV2) for g in (8, 16) for arrival in ("poisson", "gamma:0.3",
                                                                    "constant")]
    for beta in FIG6A_BETAS_MS:
        slo = 2 * (8 * FIG6A_ALPHA_MS + beta)
        models = [(f"synthetic-{i}", slo, FIG6A_ALPHA_MS, beta) for i in range(FIG6A_MODELS)]
        cells.append(Cell(f"fig6a beta {beta:g}", "fig6a",
                          _workload(f"fig6a-{beta:g}", FIG6A_GPUS, models)))
    for popularity in ("equal", "zipf:1"):
        cells.append(Cell(f"mix3 x16 {popularity}", "mix", _workload(
            f"mix3-{popularity}", 16, [RESNET50, IRV2, MOBILENET], popularity=popularity)))
        cells.append(Cell(f"mix10 x16 {popularity}", "mix", _zoo(
            f"mix10-{popularity}", 16, ZOO_SUBSET_STRIDE, popularity, GRID_WINDOWS_S)))
    cells.append(Cell("zoo37 x64", "zoo", _zoo("zoo37", 64, 1, "equal", GRID_WINDOWS_S)))
    cells.append(Cell("ResNet50 x8 network", "network", _workload(
        "r50-8-net", 8, [RESNET50], network=True)))
    cells.append(Cell("mix3 x16 network", "network", _workload(
        "mix3-net", 16, [RESNET50, IRV2, MOBILENET], network=True)))
    return cells


def _grid_cell(cell: Cell, *, quick: bool, precision: float, say: Say) -> dict[str, Any]:
    """Every policy's goodput on one cell (searches start at the default's goodput, so
    policies that behave alike probe the same rates)."""
    found: dict[str, Goodput] = {"deferred": sim_goodput(cell.make("deferred"),
                                                         precision=precision)}
    start = found["deferred"].goodput_rps or None
    for policy in GRID_POLICIES[1:]:
        found[policy] = sim_goodput(cell.make(policy), precision=precision, start_rps=start)
    fractions = GRID_QUICK_TIMEOUT_FRACTIONS if quick else GRID_TIMEOUT_FRACTIONS
    fraction, timeout, _ = best_timeout(cell.make, fractions, precision=precision,
                                        start_rps=start or 1000.0, say=lambda _l: None,
                                        label=cell.name)
    found["timeout"] = timeout
    crossed = cross_probe(cell.make, found, {"timeout": timeout_policy(fraction)})
    best_baseline = max(found["frontrun"].goodput_rps, found["eager"].goodput_rps)
    bar = math.ceil((1 - GRID_MARGIN) * best_baseline * 10) / 10
    if probe_at_bar(cell.make, "deferred", found["deferred"], bar):
        crossed.append(f"deferred@{bar:g} (the bar)")
    d = found["deferred"].goodput_rps
    row: dict[str, Any] = {
        "cell": cell.name, "group": cell.group, "timeout_fraction": fraction,
        "cross_probes": crossed,
        "policies": {p: g.to_dict() for p, g in found.items()},
        "over": {p: ratio(d, g.goodput_rps) for p, g in found.items() if p != "deferred"},
        "passes": d >= (1 - GRID_MARGIN) * best_baseline}
    say(f"  {cell.name}: " + "  ".join(f"{p} {g.goodput_rps:.0f} (bs {g.median_batch}, busy "
                                       f"{g.busy_fraction:.2f})" for p, g in found.items()))
    return row


def _grid_tables(rows: list[dict[str, Any]]) -> tuple[list[Table], Check]:
    names = [*GRID_POLICIES, "timeout"]

    def g(r: dict[str, Any], p: str, key: str) -> Any:
        return r["policies"][p][key]

    goodput = Table(
        "Goodput (r/s, simulated, worst per-model bad rate <= 1%) and default/baseline ratios",
        ["cell", *names, "/frontrun", "/eager", "/eager-edf", "/timeout", "ok"],
        [[r["cell"], *(g(r, p, "goodput_rps") for p in names),
          *(r["over"][p] for p in ("frontrun", "eager", "eager-edf", "timeout")), r["passes"]]
         for r in rows])
    batches = Table(
        "Median batch size and GPU busy fraction at each policy's goodput",
        ["cell", *(f"{p} bs" for p in names), *(f"{p} busy" for p in names)],
        [[r["cell"], *(g(r, p, "median_batch") for p in names),
          *(g(r, p, "busy_fraction") for p in names)] for r in rows])
    def over(policy: str) -> Callable[[dict[str, Any]], float]:
        return lambda r: float(r["over"][policy] or 0.0)

    worst = {p: min(rows, key=over(p)) for p in names[1:]}
    summary = Table("The default's worst cell against each baseline",
                    ["baseline", "worst cell", "default / baseline"],
                    [[p, r["cell"], r["over"][p]] for p, r in worst.items()])
    failing = [r for r in rows if not r["passes"]]
    check = Check(f"default >= max(frontrun, eager) - {GRID_MARGIN:.0%} in every cell",
                  not failing, "below: " + (", ".join(
                      f"{r['cell']} (/frontrun {r['over']['frontrun']}, /eager "
                      f"{r['over']['eager']})" for r in failing) or "none"))
    return [goodput, batches, summary], check


def _lone_latency_ms(w: Workload) -> float:
    """A lone request's best latency: l(1) of the model with the smallest, plus the allowances
    (d_ctrl, one row of d_data, the reply)."""
    return min(m.profile.latency(1) * 1e3 + w.d_data_ms_of(m) for m in w.models) + (
        w.d_ctrl_ms + w.reply_ms)


def _trickle(w: Workload) -> dict[str, Any]:
    """The default under a trickle (TRICKLE_RPS_PER_MODEL): the largest excess of a model's p50
    over its own lone latency, l(1) + the allowances."""
    report = sim_probe(w, TRICKLE_RPS_PER_MODEL * len(w.models), bail=False)
    excess = {m.name: round(report["per_model"][m.name]["p50_ms"]
                            - (m.profile.latency(1) * 1e3 + w.d_ctrl_ms + w.d_data_ms_of(m)
                               + w.reply_ms), 3)
              for m in w.models}
    worst = max(excess, key=lambda name: excess[name])
    return {"offered_rps": report["offered_rps"], "worst_model": worst,
            "worst_excess_ms": excess[worst], "p50_ms": report["latency_ms"].get("p50")}


def _light_load(cell: Cell, goodput_rps: float, fractions: tuple[float, ...],
                say: Say) -> dict[str, Any]:
    """The default at fixed fractions of its goodput: busy fraction, p50 latency, median batch."""
    w = cell.make("deferred")
    points = []
    for fraction in fractions:
        report = sim_probe(w, fraction * goodput_rps, bail=False)
        points.append({"fraction": fraction, "offered_rps": report["offered_rps"],
                       "bad_rate": report["bad_rate"], "busy": report["gpu_busy_fraction"],
                       "p50_ms": report["latency_ms"].get("p50"),
                       "median_batch": report["batch_size"]["median"]})
    full = points[-1]["busy"] or 0.0
    for p in points:
        p["ideal_busy"] = round(full * p["fraction"] / points[-1]["fraction"], 4)
        p["busy_off"] = round((p["busy"] or 0.0) - p["ideal_busy"], 4)
    say(f"  light load {cell.name}: " + ", ".join(
        f"{p['fraction']:g}x busy {p['busy']:.2f} (ideal {p['ideal_busy']:.2f}) p50 "
        f"{p['p50_ms']:.1f} ms" for p in points))
    trickle = _trickle(w)
    say(f"  trickle {cell.name}: {trickle['offered_rps']:g} r/s, p50 {trickle['p50_ms']:.2f} ms, "
        f"worst excess over l(1) + allowances {trickle['worst_excess_ms']:+.2f} ms "
        f"({trickle['worst_model']})")
    return {"cell": cell.name, "goodput_rps": goodput_rps,
            "lone_latency_ms": round(_lone_latency_ms(w), 3), "points": points,
            "trickle": trickle}


def _light_tables(light: list[dict[str, Any]]) -> tuple[Table, list[Check]]:
    table = Table(
        "Light load (default policy): GPU busy vs the load-proportional line (busy at 1x times "
        "the fraction), p50 latency vs a lone request's l(1) + allowances",
        ["cell", "x goodput", "offered r/s", "busy", "ideal busy", "p50 ms", "lone ms",
         "median batch", "bad rate"],
        [[c["cell"], p["fraction"], p["offered_rps"], p["busy"], p["ideal_busy"], p["p50_ms"],
          c["lone_latency_ms"], p["median_batch"], p["bad_rate"]]
         for c in light for p in c["points"]])
    off = [(c["cell"], p["fraction"], p["busy_off"]) for c in light for p in c["points"]
           if p["fraction"] <= LIGHT_BUSY_UP_TO and abs(p["busy_off"]) > LIGHT_BUSY_TOLERANCE]
    check = Check(f"light load: busy within {LIGHT_BUSY_TOLERANCE} of the load-proportional line "
                  f"up to {LIGHT_BUSY_UP_TO}x", not off,
                  "off: " + (", ".join(f"{c} at {f:g}x: {o:+.3f}" for c, f, o in off) or "none"))
    slow = [c for c in light if c["trickle"]["worst_excess_ms"] > LONE_TOLERANCE_MS]
    lone = Check(f"a trickle: every model's p50 within {LONE_TOLERANCE_MS:g} ms of l(1) + the "
                 "allowances", not slow, "; ".join(
                     f"{c['cell']}: {c['trickle']['worst_model']} "
                     f"{c['trickle']['worst_excess_ms']:+.2f} ms" for c in light))
    return table, [check, lone]


def run_policy_grid(opts: Options) -> Outcome:
    quick = opts.quick
    precision = GRID_QUICK_PRECISION if quick else GRID_PRECISION
    cells = [c for c in grid_cells(quick=quick) if not opts.only or opts.only in c.name]
    if not cells:
        raise ValueError(f"no policy-grid cell matches --only {opts.only!r}")
    rows = [_grid_cell(c, quick=quick, precision=precision, say=opts.say) for c in cells]
    tables, check = _grid_tables(rows)
    fractions = LIGHT_QUICK_FRACTIONS if quick else LIGHT_FRACTIONS
    by_name = {r["cell"]: r for r in rows}
    light_cells = [c for c in cells if c.name in (
        ("mix3 x4 equal",) if quick else
        ("ResNet50 x8 poisson", "mix3 x16 equal", "mix10 x16 equal"))]
    light = [_light_load(c, by_name[c.name]["policies"]["deferred"]["goodput_rps"], fractions,
                         opts.say) for c in light_cells]
    light_table: Table | None
    light_table, light_checks = _light_tables(light)
    config = {"policies": [*GRID_POLICIES, "timeout"], "cells": [c.name for c in cells],
              "precision": precision, "margin": GRID_MARGIN, "jitter_ms": GRID_JITTER_MS,
              "windows_s": GRID_QUICK_WINDOWS_S if quick else GRID_WINDOWS_S,
              "timeout_fractions": GRID_QUICK_TIMEOUT_FRACTIONS if quick
              else GRID_TIMEOUT_FRACTIONS, "light_fractions": fractions}
    if not light:  # --only without a light-load cell: no table, and no check with nothing in it
        light_table, light_checks = None, []
    outcome = Outcome(config, [*tables, *([light_table] if light_table else [])],
                      [check, *light_checks], {"cells": rows, "light": light})
    if opts.plots:
        outcome.plots.append(_plot_grid(rows, opts.out_dir / "policy-grid.png"))
        if light:
            outcome.plots.append(_plot_light(light, opts.out_dir / "policy-grid-light.png"))
    return outcome


def _plot_grid(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    markers = {"frontrun": "x", "eager": "o", "eager-edf": "s", "timeout": "^"}
    for policy, marker in markers.items():
        ax.scatter(range(len(rows)), [r["over"][policy] for r in rows], marker=marker, s=18,
                   label=f"default / {policy}")
    ax.axhline(1 - GRID_MARGIN, color="black", linestyle=":", linewidth=0.8)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [r["cell"] for r in rows], rotation=60, fontsize="x-small",
                  ha="right")
    ax.set_ylabel("goodput ratio")
    ax.set_title("Policy grid (simulated): the default over each baseline")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=4)
    fig.tight_layout()
    return Path(save_figure(fig, path))


def _plot_light(light: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, (busy, p50) = plt.subplots(1, 2, figsize=(9, 3.4))
    for c in light:
        xs = [p["fraction"] for p in c["points"]]
        line = busy.plot(xs, [p["busy"] for p in c["points"]], marker="o", label=c["cell"])[0]
        busy.plot(xs, [p["ideal_busy"] for p in c["points"]], linestyle=":",
                  color=line.get_color())
        p50.plot(xs, [p["p50_ms"] for p in c["points"]], marker="o", color=line.get_color(),
                 label=c["cell"])
    busy.set_xlabel("offered load / goodput")
    busy.set_ylabel("GPU busy fraction (dotted: proportional)")
    p50.set_xlabel("offered load / goodput")
    p50.set_ylabel("p50 latency (ms)")
    for ax in (busy, p50):
        ax.grid(alpha=0.3)
    busy.legend(fontsize="x-small")
    fig.tight_layout()
    return Path(save_figure(fig, path))


__all__ = ["Cell", "grid_cells", "run_policy_grid"]
