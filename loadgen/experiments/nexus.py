"""``nexus``: the papers' baselines in the simulator beside the default. Symphony's Table 2 Nexus
column (ResNet50 and InceptionResNetV2 on 8 GPUs, Poisson; Symphony measured 4,027 and 618 r/s
with median batches 6 and 2), and the flat top of the second Symphony paper's section 5.3 (10
ResNet-like models on 24 GPUs, offered load 0.1x to 2x of the default's goodput) with Nexus and
the Clockwork-like ``eager-edf`` beside the default.

Two Nexus plans run (``zserve.scheduler.baselines.nexus_plan``): ``nexus`` sizes the plan to the
offered rate, as Nexus's epoch scheduler does, which runs each saturated GPU at exactly its
planned throughput; ``nexus-fill`` plans every model at the largest multiple of its rate the
GPUs hold, so no GPU idles. Table 2's check is on ``nexus-fill``: a whole cluster given to one
model is what Symphony's figure measures (its goodput is the data path's: batch B on every GPU,
deficit round robin over all of them); the rate-sized plan's figure is printed beside it.

Two more rows of the research notes: the queueing delay (NX-09, arrival to batch start of served
requests) at each Table 2 model's Nexus goodput, Nexus's against the default's on the same
arrivals (Symphony: Nexus's longest is "around half the latency SLO", the default's 2-3x
shorter); and Nexus's backup backends (NX-17, ``nexus-backup``: a GPU relays what overflows its
batch to its least utilized backup) against plain Nexus on bursty (Gamma) arrivals.
"""

from __future__ import annotations

from typing import Any

from zserve.loadgen.experiments.common import WORKLOADS_DIR, Check, Options, Outcome, Table
from zserve.loadgen.experiments.simulated import (
    FULL_PRECISION,
    QUICK_PRECISION,
    QUICK_WINDOWS_S,
    sim_goodput,
    sim_probe,
    with_windows,
)
from zserve.loadgen.workload import ArrivalSpec, Workload, load_workload, parse_workload

# Symphony (second paper) Table 2, Nexus column: goodput r/s and median batch.
TABLE2 = (("table2-resnet50", "ResNet50", 4027.0, 6), ("table2-irv2", "InceptionResNetV2",
                                                        618.0, 2))
TABLE2_TOLERANCE = 0.05
MEDIAN_BATCH_TOLERANCE = 1.0
TABLE2_POLICIES = ("nexus-fill", "nexus", "shepherd-flex", "eager-edf", "deferred")
TABLE2_QUICK_POLICIES = ("nexus-fill", "nexus")
FLAT_PROFILE_MS = (2.05, 5.378, 100.0)  # GTX 1080 Ti ResNet50: alpha, beta; the SLO
FLAT_MODELS, FLAT_QUICK_MODELS = 10, 4
FLAT_GPUS, FLAT_QUICK_GPUS = 24, 8
FLAT_LOADS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
FLAT_QUICK_LOADS = (0.5, 1.0, 1.5, 2.0)
FLAT_WINDOWS_S = (2.0, 5.0, 1.0)
FLAT_POLICIES = ("deferred", "nexus-fill", "nexus", "eager-edf")
FLAT_CHECKED = ("deferred", "nexus-fill")  # Symphony: both keep a flat top
FLAT_PEAK_FRACTION = 0.95  # good rate beyond the peak stays at least this share of it
QUEUE_POLICIES = ("nexus-fill", "deferred")  # NX-09: probed at nexus-fill's goodput
QUEUE_HALF_SLO_TOLERANCE = 0.15  # Nexus's p99 queueing within this of SLO / 2
BACKUP_WORKLOAD = "table2-resnet50"  # NX-17's burst test: ResNet50 on 8 GPUs ...
BACKUP_ARRIVAL = ArrivalSpec("gamma", 0.5)  # ... Gamma arrivals, burstier than Poisson ...
BACKUP_RATE_RPS = 2500.0  # ... at this rate (the rate-sized plan leaves GPUs partly loaded)
BACKUP_POLICIES = ("nexus", "nexus-backup")


def run_nexus(opts: Options) -> Outcome:
    table2, t2_points, checks = _table2(opts)
    queueing, q_points, q_checks = _queueing(opts, t2_points)
    backups, b_points, b_checks = _backups(opts)
    flat, flat_points, flat_checks = _flat_top(opts)
    config = {"table2_policies": list(TABLE2_QUICK_POLICIES if opts.quick else TABLE2_POLICIES),
              "flat_policies": list(FLAT_POLICIES),
              "flat_models": FLAT_QUICK_MODELS if opts.quick else FLAT_MODELS,
              "flat_gpus": FLAT_QUICK_GPUS if opts.quick else FLAT_GPUS,
              "flat_profile_ms": list(FLAT_PROFILE_MS),
              "backup_test": {"workload": BACKUP_WORKLOAD, "arrival": str(BACKUP_ARRIVAL),
                              "rate_rps": BACKUP_RATE_RPS}}
    return Outcome(config, [table2, queueing, backups, flat],
                   checks + q_checks + b_checks + flat_checks,
                   {"table2": t2_points, "queueing": q_points, "backups": b_points,
                    "flat_top": flat_points})


def _table2_base(file: str, quick: bool) -> Workload:
    base = load_workload(WORKLOADS_DIR / f"{file}.toml")
    return with_windows(base, QUICK_WINDOWS_S) if quick else base


def _queueing(opts: Options, t2_points: list[dict[str, Any]],
              ) -> tuple[Table, list[dict[str, Any]], list[Check]]:
    """NX-09: each Table 2 model probed at nexus-fill's goodput under QUEUE_POLICIES."""
    table = Table("Queueing delay (arrival to batch start, served requests) at Nexus's goodput, "
                  "8 GPUs, Poisson", ["model", "policy", "rate", "p50 ms", "p99 ms", "max ms",
                                      "SLO/2 ms", "p99 / (SLO/2)", "bad rate"])
    points, checks = [], []
    for file, model, _, _ in TABLE2:
        found = next(p for p in t2_points if p["model"] == model and p["policy"] == "nexus-fill")
        rate = found["goodput_rps"]
        base = _table2_base(file, opts.quick)
        half_ms = base.models[0].slo_ms / 2
        for policy in QUEUE_POLICIES:
            report = sim_probe(base.with_overrides(policy=policy), rate, bail=False)
            q = report["queueing_ms"]
            share = q["p99"] / half_ms
            table.rows.append([model, policy, rate, q["p50"], q["p99"], q["max"], half_ms,
                               share, report["bad_rate"]])
            points.append({"model": model, "policy": policy, "rate_rps": rate,
                           "queueing_ms": q, "bad_rate": report["bad_rate"]})
            if policy == "nexus-fill":
                checks.append(Check(
                    f"{model}: Nexus's p99 queueing delay at its goodput within "
                    f"{QUEUE_HALF_SLO_TOLERANCE:.0%} of SLO/2 ({half_ms:g} ms)",
                    abs(share - 1) <= QUEUE_HALF_SLO_TOLERANCE, f"p99 {q['p99']} ms"))
        opts.say(f"  {model} queueing p99 at {rate:.0f} r/s: " + ", ".join(
            f"{p['policy']} {p['queueing_ms']['p99']} ms" for p in points[-2:]))
    return table, points, checks


def _backups(opts: Options) -> tuple[Table, list[dict[str, Any]], list[Check]]:
    """NX-17: plain Nexus and Nexus with backup backends on the same bursty arrivals."""
    base = _table2_base(BACKUP_WORKLOAD, opts.quick).with_overrides(arrival=BACKUP_ARRIVAL)
    table = Table(f"Backup backends: ResNet50 on 8 GPUs, {BACKUP_ARRIVAL.kind} arrivals (shape "
                  f"{BACKUP_ARRIVAL.shape:g}) at {BACKUP_RATE_RPS:g} r/s, Nexus planned at the "
                  "offered rate", ["policy", "good r/s", "bad rate", "relayed requests",
                                   "queueing p99 ms"])
    points = []
    for policy in BACKUP_POLICIES:
        report = sim_probe(base.with_overrides(policy=policy), BACKUP_RATE_RPS, bail=False)
        relayed = report["nexus"]["relayed"]
        table.rows.append([policy, report["good_rps"], report["bad_rate"], relayed,
                           report["queueing_ms"]["p99"]])
        points.append({"policy": policy, "good_rps": report["good_rps"],
                       "bad_rate": report["bad_rate"], "relayed": relayed})
    plain, backed = points
    opts.say(f"  backups: bad rate {plain['bad_rate']:.2%} plain, {backed['bad_rate']:.2%} with")
    check = Check("Nexus's backup backends lower its bad rate on bursty arrivals",
                  backed["bad_rate"] < plain["bad_rate"],
                  f"{plain['bad_rate']:.2%} plain, {backed['bad_rate']:.2%} with backups "
                  f"({backed['relayed']} relayed)")
    return table, points, [check]


def _table2(opts: Options) -> tuple[Table, list[dict[str, Any]], list[Check]]:
    table = Table("Symphony Table 2, 8 GPUs, Poisson: goodput (r/s) per policy",
                  ["model", "policy", "goodput", "Symphony's Nexus", "ratio", "median batch",
                   "GPU busy"])
    points, checks = [], []
    policies = TABLE2_QUICK_POLICIES if opts.quick else TABLE2_POLICIES
    for file, model, paper_rps, paper_batch in TABLE2:
        base = _table2_base(file, opts.quick)
        for policy in policies:
            found = sim_goodput(base.with_overrides(policy=policy),
                                precision=QUICK_PRECISION if opts.quick else FULL_PRECISION,
                                start_rps=None)
            ratio = found.goodput_rps / paper_rps
            opts.say(f"  {model} {policy}: {found.goodput_rps:.1f} r/s ({ratio:.3f} of "
                     f"{paper_rps:g}), median batch {found.median_batch}")
            table.rows.append([model, policy, found.goodput_rps, paper_rps, ratio,
                               found.median_batch, found.busy_fraction])
            points.append({"model": model, "policy": policy, **found.to_dict()})
            if policy == "nexus-fill":
                checks += _table2_checks(model, found.goodput_rps, found.median_batch,
                                         paper_rps, paper_batch)
    return table, points, checks


def _table2_checks(model: str, goodput: float, median: float | None, paper_rps: float,
                   paper_batch: int) -> list[Check]:
    within = abs(goodput / paper_rps - 1) <= TABLE2_TOLERANCE
    checks = [Check(f"{model}: nexus-fill goodput within 5% of {paper_rps:g} r/s", within,
                    f"{goodput:.1f} r/s ({goodput / paper_rps:.3f})")]
    if model == "ResNet50":
        near = median is not None and abs(median - paper_batch) <= MEDIAN_BATCH_TOLERANCE
        checks.append(Check(f"{model}: nexus-fill median batch about {paper_batch}", near,
                            f"median {median}"))
    return checks


def flat_workload(policy: str, rate: float, *, quick: bool) -> Workload:
    alpha, beta, slo = FLAT_PROFILE_MS
    warmup, measure, cooldown = QUICK_WINDOWS_S if quick else FLAT_WINDOWS_S
    count = FLAT_QUICK_MODELS if quick else FLAT_MODELS
    data = {"workload": {"name": "nexus-flattop-resnet", "policy": policy, "rate": rate,
                         "gpus": FLAT_QUICK_GPUS if quick else FLAT_GPUS, "arrival": "poisson",
                         "warmup_s": warmup, "measure_s": measure, "cooldown_s": cooldown,
                         "jitter_ms": 1.0},
            "models": [{"name": f"resnet{i}", "slo_ms": slo, "alpha_ms": alpha,
                        "beta_ms": beta} for i in range(count)]}
    return parse_workload(data, source="nexus-flattop-resnet")


def _flat_top(opts: Options) -> tuple[Table, dict[str, Any], list[Check]]:
    quick = opts.quick
    peak = sim_goodput(flat_workload("deferred", 1000.0, quick=quick),
                       precision=QUICK_PRECISION if quick else FULL_PRECISION)
    opts.say(f"  flat top: the default's goodput {peak.goodput_rps:.1f} r/s")
    loads = FLAT_QUICK_LOADS if quick else FLAT_LOADS
    table = Table(f"Flat top: good r/s (bad rate) vs offered load, x {peak.goodput_rps:.0f} "
                  "r/s, the default's goodput",
                  ["load", "offered", *(f"{p} good" for p in FLAT_POLICIES),
                   *(f"{p} bad" for p in FLAT_POLICIES), *(f"{p} busy" for p in FLAT_POLICIES)])
    curves: dict[str, list[dict[str, Any]]] = {p: [] for p in FLAT_POLICIES}
    for load in loads:
        rate = load * peak.goodput_rps
        row: list[Any] = [load, rate]
        for policy in FLAT_POLICIES:
            report = sim_probe(flat_workload(policy, rate, quick=quick), rate, bail=False)
            curves[policy].append({"load": load, "offered_rps": report["offered_rps"],
                                   "good_rps": report["good_rps"],
                                   "bad_rate": report["bad_rate"],
                                   "busy": report["gpu_busy_fraction"]})
        row += [curves[p][-1]["good_rps"] for p in FLAT_POLICIES]
        row += [f"{curves[p][-1]['bad_rate']:.2%}" for p in FLAT_POLICIES]
        row += [curves[p][-1]["busy"] for p in FLAT_POLICIES]
        table.rows.append(row)
        opts.say(f"  load {load:g}x: " + ", ".join(
            f"{p} {curves[p][-1]['good_rps']:.0f}" for p in FLAT_POLICIES))
    checks = [_flat_check(p, curves[p]) for p in FLAT_CHECKED]
    points = {"default_goodput_rps": peak.goodput_rps, "curves": curves,
              "beyond_peak_share": {p: _beyond_peak_share(curves[p]) for p in FLAT_POLICIES}}
    return table, points, checks


def _beyond_peak_share(curve: list[dict[str, Any]]) -> float:
    """The lowest good rate after the peak point, as a share of the peak's."""
    goods = [p["good_rps"] for p in curve]
    top = max(range(len(goods)), key=goods.__getitem__)
    after = goods[top:]
    return round(min(after) / goods[top], 4) if goods[top] > 0 else 0.0


def _flat_check(policy: str, curve: list[dict[str, Any]]) -> Check:
    share = _beyond_peak_share(curve)
    return Check(f"{policy}: good rate beyond its peak stays >= {FLAT_PEAK_FRACTION:.0%} of it",
                 share >= FLAT_PEAK_FRACTION, f"lowest after the peak: {share:.3f} of it")
