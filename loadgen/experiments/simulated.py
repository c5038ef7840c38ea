"""Goodput in the simulator: one probe, a search, and the timeout baseline's best tuning."""

from __future__ import annotations

import dataclasses
import math
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zserve.config.cluster import ClusterConfig
from zserve.loadgen.experiments.common import Say
from zserve.loadgen.search import search_goodput
from zserve.loadgen.sim.simulator import SimConfig, simulate, workload_bound_rps
from zserve.loadgen.workload import Workload

MAX_BAD_RATE = 0.01
# A probe must measure at least this many requests: a 1% bad rate over fewer decides little.
MIN_MEASURED_REQUESTS = 1000
# A simulated probe stops once a model's bad requests exceed the bound times its whole measure
# window: it can then only fail, so stopping changes no verdict.
SIM_BAIL_FACTOR = 1.0
FULL_PRECISION = 0.01  # relative precision of a simulated goodput search
QUICK_PRECISION = 0.03
QUICK_WINDOWS_S = (1.0, 1.5, 0.5)  # warmup, measure, cooldown of --quick simulations
CROSS_PROBE_SPAN = 0.05  # a policy is probed at another's goodput up to this much above its own


def read_toml(path: Path) -> dict[str, Any]:
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


def sim_probe(workload: Workload, rate_rps: float, *, bail: bool = True,
              frontend: ClusterConfig | None = None,
              cluster: SimConfig | None = None) -> dict[str, Any]:
    """One simulated run at ``rate_rps``; the measure window is stretched to at least
    MIN_MEASURED_REQUESTS requests. ``frontend``: the cluster whose admission the simulated
    frontends apply (a live cluster's twin); None: a default cluster's, with no admission
    bounds. ``cluster``: the placement and device kinds (its other knobs are the probe's)."""
    measure_s = max(workload.measure_s, MIN_MEASURED_REQUESTS / rate_rps)
    config = dataclasses.replace(
        cluster or SimConfig(),
        bail_bad_rate=min(1.0, SIM_BAIL_FACTOR * MAX_BAD_RATE) if bail else None,
        frontend=frontend)
    report: dict[str, Any] = simulate(
        workload.with_overrides(rate=rate_rps, measure_s=measure_s), config)
    return report


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


def reduce_search(report: dict[str, Any], bound: float | None, started: float) -> Goodput:
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
    workload: Workload, *, precision: float, start_rps: float | None = None,
    cluster: SimConfig | None = None,
) -> Goodput:
    """The simulated goodput of ``workload`` (its policy), searched from ``start_rps`` (default:
    the staggered bound); ``cluster``: a placement and device kinds (``sim_probe``)."""
    started = time.perf_counter()
    try:
        bound: float | None = workload_bound_rps(workload)
    except (ValueError, ZeroDivisionError):
        bound = None
    start = start_rps or (bound if bound and math.isfinite(bound) else workload.rate)
    report = search_goodput(lambda rate: sim_probe(workload, rate, cluster=cluster), start,
                            max_bad_rate=MAX_BAD_RATE, rel_precision=precision)
    return reduce_search(report, bound, started)


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


def cross_probe(make: Callable[[str], Workload], found: dict[str, Goodput],
                names: dict[str, str] | None = None) -> list[str]:
    """Lift each policy's goodput to another policy's higher goodput (within CROSS_PROBE_SPAN)
    where a probe of it there passes. A bisection over a bad rate that is not monotone in the
    rate stops at different rates for two policies with the same curve (the 3-model mix with
    network delays: both near 1% from 4,600 to 4,650 r/s; searches found 4,564 and 4,671), and
    a passing probe is a lower bound of the goodput whichever search ran it. Every policy gets
    the same chance, so the ratios compare curves rather than search paths. ``names``: the
    workload policy of a ``found`` key where they differ. Returns what was lifted, as
    ``policy@rate``."""
    lifted = []
    rates = sorted({g.goodput_rps for g in found.values()})
    for policy, goodput in found.items():
        own = goodput.goodput_rps
        for rate in reversed(rates):
            if not own < rate <= (1 + CROSS_PROBE_SPAN) * own:
                continue
            report = sim_probe(make((names or {}).get(policy, policy)), rate)
            if report["bad_rate"] <= MAX_BAD_RATE:
                goodput.goodput_rps = rate
                lifted.append(f"{policy}@{rate:g}")
                break
    return lifted


def probe_at_bar(make: Callable[[str], Workload], policy: str, goodput: Goodput,
                 bar_rps: float) -> bool:
    """A check's own question, asked directly: does ``policy`` pass at the check's bar? Where
    its search stopped below the bar and a probe at the bar passes, its goodput is lifted to
    the bar (a lower bound, as in ``cross_probe``: a search can stop below a rate that passes).
    True when it lifted."""
    if goodput.goodput_rps >= bar_rps:
        return False
    if sim_probe(make(policy), bar_rps)["bad_rate"] > MAX_BAD_RATE:
        return False
    goodput.goodput_rps = bar_rps
    return True
