"""``zoo``: the 37-model A100 zoo on 64 simulated GPUs, deferred vs frontrun, eager, timeout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zserve.loadgen.experiments.common import (
    EXAMPLES_DIR,
    WORKLOADS_DIR,
    Check,
    Options,
    Outcome,
    Table,
    pyplot,
    save_figure,
)
from zserve.loadgen.experiments.simulated import (
    FULL_PRECISION,
    QUICK_PRECISION,
    QUICK_WINDOWS_S,
    Goodput,
    probe_at_bar,
    ratio,
    sim_goodput,
    timeout_policy,
    with_windows,
)
from zserve.loadgen.workload import Workload, load_workload

ZOO_WORKLOAD = WORKLOADS_DIR / "a100-zoo-64gpu.toml"
ZOO_TIMEOUT_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5)
ZOO_QUICK_TIMEOUT_FRACTIONS = (0.3,)
ZOO_QUICK_STRIDE = 4  # --quick: every 4th zoo model ...
ZOO_QUICK_GPUS = 16  # ... on 16 GPUs (64 GPUs / 37 models ~ 16 / 10)
ZOO_EAGER_BAR = 0.95  # the default's goodput at least this fraction of eager's
ZOO_PAPER_OVER_EDF = (2.0, 2.4)  # Symphony's gain over its eager EDF baseline on this zoo


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
    # the papers' eager baseline: earliest deadline first across models (Symphony reports
    # 2.0-2.4x over it on this zoo)
    edf = sim_goodput(zoo_workload("eager-edf", quick=quick), precision=precision,
                      start_rps=deferred.goodput_rps)
    say(f"zoo eager-edf: {edf.goodput_rps:.1f} r/s")
    timeouts: dict[str, Goodput] = {}
    for fraction in fractions:
        found = sim_goodput(zoo_workload(timeout_policy(fraction), quick=quick),
                            precision=precision, start_rps=deferred.goodput_rps)
        timeouts[f"{fraction:g}"] = found
        say(f"zoo timeout:{fraction:g}: {found.goodput_rps:.1f} r/s")
    best_fraction = max(timeouts, key=lambda k: timeouts[k].goodput_rps)
    # The check's own question asked directly: two searches each within their precision put
    # their ratio anywhere within twice it of the truth (the quick subset read 0.91-0.94).
    if probe_at_bar(lambda policy: zoo_workload(policy, quick=quick), "deferred", deferred,
                    ZOO_EAGER_BAR * eager.goodput_rps):
        say(f"zoo deferred: passes at {deferred.goodput_rps:.1f} r/s, the check's bar")
    w = zoo_workload("deferred", quick=quick)
    policies: list[tuple[str, Goodput]] = [
        ("deferred", deferred), ("frontrun", frontrun), ("eager", eager), ("eager-edf", edf)]
    policies += [(timeout_policy(float(f)), g) for f, g in timeouts.items()]
    table = Table(
        f"A100 zoo: {len(w.models)} models, {w.gpus} GPUs, Poisson, equal popularity "
        f"(simulated goodput; bound {deferred.bound_rps:.1f} r/s; the paper reports the default "
        f"at {ZOO_PAPER_OVER_EDF[0]:g}-{ZOO_PAPER_OVER_EDF[1]:g}x its eager EDF baseline)",
        ["policy", "goodput r/s", "/ deferred", "/ bound", "median batch", "GPU busy",
         "probes"],
        [[name, g.goodput_rps, ratio(g.goodput_rps, deferred.goodput_rps),
          ratio(g.goodput_rps, deferred.bound_rps or 0.0), g.median_batch, g.busy_fraction,
          g.probes] for name, g in policies],
    )
    checks = [Check(f"deferred >= {ZOO_EAGER_BAR:g}x eager",
                    deferred.goodput_rps >= ZOO_EAGER_BAR * eager.goodput_rps,
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
    plt = pyplot()
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
    return Path(save_figure(fig, path))
