"""``prefix``: prefix batching (Nexus section 2.5, NX-12 and NX-18), measured three ways.

1. **Numerics** (real ONNX Runtime, CPU): variants of the built-in CNN that differ in their last
   layer (``zserve.backends.prefix.cnn_variants``) are cut into one prefix and a head each
   (found by structural digests, cut with ``onnx.utils.extract_model``); a group run (the prefix
   once at the merged batch, then each head on its rows) gives each variant's outputs within
   ``MAX_ABS_DIFF`` of the full model's; a head's file is the memory one more variant adds.
2. **Goodput in the simulator**: ``VARIANTS`` variants of Symphony's Table 2 ResNet50 (alpha
   1.053 ms, beta 5.072 ms, SLO 25 ms), equal rates, Poisson arrivals, scheduled apart (each its
   own model) and grouped (one model with the summed rate, Nexus's NX-12). The grouped l(b) is
   the live rule (``zserve.backends.prefix.merge_group``: every head's nodes run on every batch,
   on zero rows when none is its own): the full model's l(b) plus the fixed cost of the
   ``VARIANTS - 1`` other heads, ``HEAD_BETA_MS`` each (an assumed 50 us per head per batch for
   a 2048 x 1000 layer on a GPU), whatever the batch's mix. On 1, 2 and 8 GPUs; the check:
   grouped at least ``GOAL_RATIO`` x apart on one GPU, the setting of Nexus's Figure 15 (+110%
   with 10 ResNet-50 variants). On 8 GPUs Symphony's staggering already lets each variant batch,
   and grouping gains less (the table shows how much).
3. **CPU figure** (real ONNX Runtime, one thread): one request per variant, ``VARIANTS``
   variants: the full models run one after another against the group's run; median time of
   ``CPU_REPEATS`` repetitions, and the ratio of throughputs.
4. **Live** (``--live``): a cluster of one CPU backend serving ``LIVE_VARIANTS`` CNN variants,
   declared as a ``[[prefix_groups]]`` group or not, driven by ``LIVE_CLIENTS`` closed-loop
   clients (requests spread evenly over the variants) in alternating rounds: answers per
   second, latency, the mean batch and the backend's CPU time per request
   (``zserve.loadgen.experiments.prefix_live``).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from zserve.backends.prefix import PrefixGroup, cnn_variants, split_models
from zserve.config.profiles import LatencyProfile
from zserve.loadgen.experiments.common import Check, Options, Outcome, Table
from zserve.loadgen.experiments.prefix_live import MAX_GROUPED_ERROR_FRACTION, live_table
from zserve.loadgen.experiments.simulated import (
    FULL_PRECISION,
    QUICK_PRECISION,
    QUICK_WINDOWS_S,
    sim_goodput,
    with_windows,
)
from zserve.loadgen.workload import Workload, parse_workload

VARIANTS = 10
QUICK_VARIANTS = 3  # numerics and CPU figure under --quick (the simulation keeps 10)
ALPHA_MS, BETA_MS, SLO_MS = 1.053, 5.072, 25.0  # Symphony Table 2, ResNet50
HEAD_BETA_MS = 0.05
GPU_COUNTS = (1, 2, 8)
QUICK_GPU_COUNTS = (1,)
GOAL_RATIO = 1.5
MAX_ABS_DIFF = 1e-5
CPU_REPEATS = 9
QUICK_CPU_REPEATS = 3
IMAGE_SHAPE = (3, 64, 64)


def grouped_latency_ms(batch: int) -> float:
    """The grouped model's l(b) in ms: the live rule (module docstring, part 2)."""
    return ALPHA_MS * batch + BETA_MS + (VARIANTS - 1) * HEAD_BETA_MS


def variants_workload(gpus: int, *, grouped: bool, quick: bool) -> Workload:
    """``VARIANTS`` ResNet50 variants on ``gpus`` GPUs, apart or as one grouped model."""
    names = ["group"] if grouped else [f"variant{i}" for i in range(VARIANTS)]
    data = {"workload": {"name": f"prefix-{'grouped' if grouped else 'apart'}-{gpus}gpu",
                         "gpus": gpus, "seed": 1, "rate": 100.0 * gpus, "arrival": "poisson",
                         "popularity": "equal", "warmup_s": 3.0, "measure_s": 10.0,
                         "cooldown_s": 1.0, "policy": "deferred", "jitter_ms": 1.0},
            "models": [{"name": n, "slo_ms": SLO_MS, "alpha_ms": ALPHA_MS, "beta_ms": BETA_MS}
                       for n in names]}
    workload = parse_workload(data, source="prefix")
    if grouped:
        spec = workload.models[0]
        table = [grouped_latency_ms(b) for b in range(1, spec.profile.max_batch + 1)]
        grouped_spec = dataclasses.replace(spec, profile=LatencyProfile.from_table_ms(table))
        workload = dataclasses.replace(workload, models=[grouped_spec])
    return with_windows(workload, QUICK_WINDOWS_S if quick else None)


def simulated_table(opts: Options) -> tuple[Table, list[dict[str, Any]]]:
    precision = QUICK_PRECISION if opts.quick else FULL_PRECISION
    table = Table(f"{VARIANTS} ResNet50 variants, SLO {SLO_MS:g} ms, simulated goodput (r/s)",
                  ["GPUs", "apart", "grouped", "ratio", "median batch apart", "grouped"])
    rows: list[dict[str, Any]] = []
    for gpus in QUICK_GPU_COUNTS if opts.quick else GPU_COUNTS:
        apart = sim_goodput(variants_workload(gpus, grouped=False, quick=opts.quick),
                            precision=precision)
        grouped = sim_goodput(variants_workload(gpus, grouped=True, quick=opts.quick),
                              precision=precision)
        ratio = grouped.goodput_rps / apart.goodput_rps if apart.goodput_rps > 0 else 0.0
        row = {"gpus": gpus, "apart_rps": apart.goodput_rps, "grouped_rps": grouped.goodput_rps,
               "ratio": round(ratio, 3), "apart_batch": apart.median_batch,
               "grouped_batch": grouped.median_batch}
        rows.append(row)
        table.rows.append([gpus, apart.goodput_rps, grouped.goodput_rps, row["ratio"],
                           apart.median_batch, grouped.median_batch])
        opts.say(f"  {gpus} GPU(s): apart {apart.goodput_rps:.1f}, grouped "
                 f"{grouped.goodput_rps:.1f} r/s ({ratio:.2f}x)")
    return table, rows


def numerics_and_cpu(opts: Options, work_dir: Path) -> dict[str, Any]:
    """Cut the CNN variants, check every variant's outputs, and time one request each."""
    import onnxruntime as ort

    count = QUICK_VARIANTS if opts.quick else VARIANTS
    paths = cnn_variants(count, work_dir / "variants")
    split = split_models(paths, work_dir / "split")
    group = PrefixGroup(split)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    full = [ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"])
            for p in paths]
    rng = np.random.default_rng(3)
    rows = {v: {"image": rng.standard_normal((v % 3 + 1, *IMAGE_SHAPE)).astype(np.float32)}
            for v in range(count)}
    grouped = group.run(rows)
    diffs = [float(np.abs(full[v].run(None, rows[v])[0] - grouped[v][0]).max())
             for v in range(count)]
    one = {v: {"image": rng.standard_normal((1, *IMAGE_SHAPE)).astype(np.float32)}
           for v in range(count)}
    apart_s, grouped_s = [], []
    for _ in range(QUICK_CPU_REPEATS if opts.quick else CPU_REPEATS):
        started = time.perf_counter()
        for v in range(count):
            full[v].run(None, one[v])
        apart_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        group.run(one)
        grouped_s.append(time.perf_counter() - started)
    return {"variants": count, "max_abs_diff": max(diffs), "cut": split.cut.cut_names[0],
            "prefix_nodes": split.cut.prefix_nodes,
            "model_bytes": paths[0].stat().st_size,
            "prefix_bytes": split.prefix_path.stat().st_size,
            "head_bytes": split.head_paths[0].stat().st_size,
            "apart_ms": statistics.median(apart_s) * 1e3,
            "grouped_ms": statistics.median(grouped_s) * 1e3}


def run_prefix(opts: Options) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="zserve-prefix-") as tmp:
        opts.say("numerics and CPU time of the built-in CNN's variants")
        cpu = numerics_and_cpu(opts, Path(tmp))
    opts.say("simulated goodput, apart and grouped")
    sim_table, sim_rows = simulated_table(opts)
    cpu_table = Table(f"built-in CNN, {cpu['variants']} variants (last layer re-drawn), one "
                      "request each, ONNX Runtime CPU, 1 thread",
                      ["apart ms", "grouped ms", "speed-up", "max abs diff", "model MB",
                       "head KB"])
    speed_up = cpu["apart_ms"] / cpu["grouped_ms"]
    cpu_table.rows.append([cpu["apart_ms"], cpu["grouped_ms"], round(speed_up, 3),
                           f"{cpu['max_abs_diff']:.1e}", cpu["model_bytes"] / 1e6,
                           cpu["head_bytes"] / 1e3])
    one_gpu = next(r for r in sim_rows if r["gpus"] == 1)
    checks = [
        Check(f"every variant's grouped outputs within {MAX_ABS_DIFF:g} of its full model's",
              cpu["max_abs_diff"] <= MAX_ABS_DIFF, f"max abs diff {cpu['max_abs_diff']:.2e}"),
        Check(f"grouped goodput >= {GOAL_RATIO:g}x apart on one GPU",
              one_gpu["ratio"] >= GOAL_RATIO, f"{one_gpu['ratio']:.2f}x"),
        Check("one more variant costs its head, not a model",
              cpu["head_bytes"] < 0.05 * cpu["model_bytes"],
              f"head {cpu['head_bytes']} B of a {cpu['model_bytes']} B model"),
    ]
    tables = [sim_table, cpu_table]
    points: dict[str, Any] = {"simulated": sim_rows, "cpu": cpu}
    if opts.live:
        opts.say("live: a CPU cluster of CNN variants, apart and grouped, alternating")
        with tempfile.TemporaryDirectory(prefix="zserve-prefix-live-") as tmp:
            live, rounds = live_table(opts, Path(tmp))
        tables.append(live)
        points["live"] = rounds
        grouped = [r for r in rounds if r["grouped"]]
        errors, answers = (sum(r[k] for r in grouped) for k in ("errors", "answers"))
        checks.append(Check(f"live: the grouped variants answered, at most "
                            f"{MAX_GROUPED_ERROR_FRACTION:.0%} with an error",
                            answers > 0 and errors <= MAX_GROUPED_ERROR_FRACTION * answers,
                            f"{errors} errors in {answers} answers"))
    config = {"variants": VARIANTS, "alpha_ms": ALPHA_MS, "beta_ms": BETA_MS, "slo_ms": SLO_MS,
              "head_beta_ms": HEAD_BETA_MS, "gpus": [r["gpus"] for r in sim_rows]}
    return Outcome(config, tables, checks, points)


__all__ = ["run_prefix", "variants_workload"]
