"""``placement``: the 37-model A100 zoo on 64 simulated GPUs whose memory holds about a third of the
models each: goodput with the partitioned placement (Symphony's sub-clusters) against round-robin
and against random search, and against every GPU serving every model (no memory limit)."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from zserve.loadgen.experiments.common import (
    EXAMPLES_DIR,
    Check,
    Options,
    Outcome,
    Table,
)
from zserve.loadgen.experiments.simulated import (
    QUICK_PRECISION,
    Goodput,
    ratio,
    sim_goodput,
    with_windows,
)
from zserve.loadgen.experiments.zoo import ZOO_WORKLOAD, zoo_workload
from zserve.loadgen.sim.simulator import SimConfig
from zserve.loadgen.workload import Workload
from zserve.orchestrator.memory import GIB_BYTES, placement_bytes, zoo_model_memory
from zserve.orchestrator.placement import (
    Device,
    ModelDemand,
    Placement,
    check_placement,
    gpus_for_rate,
    load_imbalance,
    partitioned_placement,
    random_placement,
    round_robin_placement,
)

PLACEMENT_GROUPS = 3  # sub-clusters: each GPU holds about a third of the models
MEMORY_SLACK = 1.15  # a GPU holds a third of the zoo's weights plus this slack ...
PLAN_TIME_LIMIT_S = 1.5  # HiGHS per plan (the partition experiment's); random search: the same
PLACED_RATE_RPS = 17_860.5  # the loads placed for: the zoo's goodput with every GPU serving all
PLACEMENT_WINDOWS_S = (2.0, 5.0, 0.5)  # warmup, measure, cooldown (about 90,000 measured)
PLACEMENT_PRECISION = 0.02


def memory_budget_bytes(demands: list[ModelDemand]) -> int:
    """A third of the models' weights (with MEMORY_SLACK) plus the largest activations."""
    static = sum(d.memory.static_bytes for d in demands)
    return int(MEMORY_SLACK * static / PLACEMENT_GROUPS
               + max(d.memory.dynamic_bytes for d in demands))


def zoo_demands(w: Workload, rate_rps: float) -> list[ModelDemand]:
    """Each model's memory and its load in GPUs at ``rate_rps`` over the workload's shares."""
    demands = []
    for m, share in zip(w.models, w.model_rates(), strict=True):
        alpha_ms, beta_ms = m.profile.alpha_s * 1e3, m.profile.beta_s * 1e3
        slo_ms = m.slo_s * 1e3
        demands.append(ModelDemand(zoo_model_memory(m.name, alpha_ms, beta_ms, slo_ms),
                                   gpus_for_rate(alpha_ms, beta_ms, slo_ms,
                                                 rate_rps * share / w.rate)))
    return demands


def membership(placement: Placement, devices: list[Device]) -> SimConfig:
    """The simulator's cluster: each model served by the GPUs that hold it."""
    return SimConfig(model_gpus=placement.gpu_ids(devices))


def build_placements(demands: list[ModelDemand], devices: list[Device],
                     seed: int) -> dict[str, tuple[Placement, float]]:
    """The three placements and the seconds each took."""
    found: dict[str, tuple[Placement, float]] = {}
    started = time.perf_counter()
    found["partitioned"] = (partitioned_placement(demands, devices, PLACEMENT_GROUPS,
                                                  PLAN_TIME_LIMIT_S),
                            time.perf_counter() - started)
    budget_s = found["partitioned"][1]
    started = time.perf_counter()
    deadline = started + budget_s
    found["random search"] = (random_placement(demands, devices, PLACEMENT_GROUPS,
                                               np.random.default_rng(seed),
                                               lambda: time.perf_counter() > deadline),
                              time.perf_counter() - started)
    started = time.perf_counter()
    per_device = math.ceil(len(demands) / PLACEMENT_GROUPS)
    found["round-robin"] = (round_robin_placement(demands, devices, per_device),
                            time.perf_counter() - started)
    for placement, _ in found.values():
        check_placement(placement, demands, devices)  # refuses with one line if overcommitted
    return found


def run_placement(opts: Options) -> Outcome:
    quick, say = opts.quick, opts.say
    precision = QUICK_PRECISION if quick else PLACEMENT_PRECISION
    w = zoo_workload("deferred", quick=quick)
    if not quick:
        w = with_windows(w, PLACEMENT_WINDOWS_S)
    rate = PLACED_RATE_RPS * w.gpus / 64 * len(w.models) / 37 if quick else PLACED_RATE_RPS
    demands = zoo_demands(w, rate)
    budget = memory_budget_bytes(demands)
    devices = [Device(f"gpu-{i}", budget) for i in range(w.gpus)]
    placements = build_placements(demands, devices, w.seed)
    everywhere = sim_goodput(w, precision=precision)
    say(f"placement every GPU serves every model: {everywhere.goodput_rps:.1f} r/s")
    results: dict[str, Goodput] = {}
    for name, (placement, _) in placements.items():
        results[name] = sim_goodput(w, precision=precision, start_rps=everywhere.goodput_rps,
                                    cluster=membership(placement, devices))
        say(f"placement {name}: {results[name].goodput_rps:.1f} r/s")
    return _outcome(w, demands, devices, placements, results, everywhere, precision)


def _outcome(w: Workload, demands: list[ModelDemand], devices: list[Device],  # noqa: PLR0917
             placements: dict[str, tuple[Placement, float]], results: dict[str, Goodput],
             everywhere: Goodput, precision: float) -> Outcome:
    budget = devices[0].budget_bytes
    rows: list[list[Any]] = [["every GPU, every model (no memory limit)", everywhere.goodput_rps,
                              ratio(everywhere.goodput_rps, everywhere.goodput_rps), len(w.models),
                              w.gpus, 0.0, everywhere.median_batch, everywhere.busy_fraction,
                              "-"]]
    for name, (placement, took_s) in placements.items():
        g = results[name]
        per_gpu = [len(m) for m in placement.models_on.values()]
        replicas = placement.replicas()
        rows.append([name, g.goodput_rps, ratio(g.goodput_rps, everywhere.goodput_rps),
                     f"{min(per_gpu)}-{max(per_gpu)}",
                     f"{min(replicas.values())}-{max(replicas.values())}",
                     round(load_imbalance(placement, demands), 4), g.median_batch,
                     g.busy_fraction, round(took_s, 2)])
    table = Table(
        f"A100 zoo: {len(w.models)} models on {w.gpus} GPUs of {budget / GIB_BYTES:.2f} GiB each "
        f"(a third of the weights x {MEMORY_SLACK:g} + the largest activations), simulated "
        "goodput by placement",
        ["placement", "goodput r/s", "/ every GPU", "models per GPU", "GPUs per model",
         "load imbalance", "median batch", "GPU busy", "placement s"], rows)
    memory = {d.name: d.memory for d in demands}
    peak = max(placement_bytes([memory[m] for m in models])
               for placement, _ in placements.values() for models in placement.models_on.values())
    # Placing costs goodput (fewer GPUs share each model): no placement may beat every GPU
    # serving every model by more than the two searches' precision.
    ceiling = (1 + 2 * precision) * everywhere.goodput_rps
    checks = [Check("no placement above every GPU serving every model",
                    all(g.goodput_rps <= ceiling for g in results.values()),
                    ", ".join(f"{n} {ratio(g.goodput_rps, everywhere.goodput_rps)}"
                              for n, g in results.items())),
              Check("every placement fits every GPU's memory", peak <= budget,
                    f"the fullest GPU needs {peak / GIB_BYTES:.2f} of "
                    f"{budget / GIB_BYTES:.2f} GiB")]
    points: dict[str, Any] = {name: g.to_dict() for name, g in results.items()}
    points["everywhere"] = everywhere.to_dict()
    points["placements"] = {name: {d: list(m) for d, m in p.models_on.items()}
                            for name, (p, _) in placements.items()}
    config = {"workload": str(ZOO_WORKLOAD.relative_to(EXAMPLES_DIR.parent)),
              "models": len(w.models), "gpus": w.gpus, "precision": precision,
              "groups": PLACEMENT_GROUPS, "budget_bytes": budget,
              "load_gpus": {d.name: round(d.load_gpus, 3) for d in demands},
              "plan_time_limit_s": PLAN_TIME_LIMIT_S}
    return Outcome(config, [table], checks, points)
