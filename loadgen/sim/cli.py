"""``zserve sim WORKLOAD [--policy P] [--rate R | --search goodput] [--json OUT]``.

Runs a workload file in the discrete-event simulator (``zserve.loadgen.sim.simulator``) and prints a
one-screen summary; ``--json`` writes the report (schema in ``zserve.loadgen.report``).

``--search goodput`` finds the highest total rate whose worst per-model bad rate is <= 1%
(``--max-bad-rate``) by doubling then bisecting to a relative precision of 1% (``--precision``),
starting from the analytic staggered bound (or ``--rate``). Doomed probes bail out early once a
model's bad rate in the measure window exceeds 3x the bound (with at least 200 bad requests).
Exit status: 0 on success, 1 if an invariant broke, 2 on a usage or workload error.

``--allowances-from CLUSTER.toml`` schedules with that cluster's allowances (``d_ctrl_ms``,
``d_data_ms``, ``jitter_ms`` of ``[scheduler]``, ``reply_allowance_ms`` of ``[frontends]``, and a
model's own ``d_data_ms`` for the workload's model of its name) instead of the workload's, and its
frontends' admission (``[frontends]`` count and ``max_request_bytes``, each model's ``max_queue``
and ``max_wait_ms``): the simulated twin of ``zserve bench CLUSTER.toml WORKLOAD``, which schedules
and admits as the live cluster does. ``--jitter-ms`` still wins over it. Without it no admission
bound applies (the workload file has no cluster to take them from). Where the cluster's backends
announce device kinds and a model of the workload's name has a profile file per kind (``[[models]]
profiles``), simulated GPU i has backend i's kind and runs (and is planned with) the model's
profile for that kind, and the model's own profile is the slowest of its GPUs', as in a live shard
(``cluster_gpu_profiles``).

``--hops ready=P50/P99,late=P50/P99,reply=P50/P99`` draws those hops' latencies (ms, log-normal)
instead of giving each exactly its allowance, and ``--learned-allowances`` then replays the
learned-allowance rule (``zserve.core.allowances``) on them: loadgen/sim/hops.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zserve.config.profiles import LatencyProfile, profile_from_file, slowest_profile
from zserve.loadgen.report import set_fraction_of_bound, summary_text
from zserve.loadgen.search import search_goodput
from zserve.loadgen.sim.hops import HopLatencies
from zserve.loadgen.sim.simulator import InvariantError, SimConfig, simulate, workload_bound_rps
from zserve.loadgen.workload import ArrivalSpec, ModelSpec, Workload, load_workload

if TYPE_CHECKING:
    from zserve.config.cluster import ClusterConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zserve sim", description=__doc__.split("\n\n")[0])
    p.add_argument("workload", help="workload TOML file")
    p.add_argument("--policy", help="deferred | frontrun | latest | eager | eager-edf | "
                   "eager-lsf | timeout:F; the papers' baselines: nexus[-fill][-backup][:F] | "
                   "shepherd-flex")
    p.add_argument("--drop", help="window | suffix | alone | fcfs")
    p.add_argument("--arrival", help="constant | poisson | gamma:K")
    p.add_argument("--keep-tolerance", type=float, help="window drop tolerance (see workload)")
    p.add_argument("--jitter-ms", type=float, help="timer lateness allowance (see workload)")
    p.add_argument("--allowances-from", metavar="CLUSTER.toml",
                   help="take d_ctrl, d_data, reply and jitter allowances from this cluster file")
    p.add_argument("--hops", metavar="SPEC",
                   help="draw hop latencies: ready=P50/P99,late=P50/P99,reply=P50/P99 (ms; "
                   "loadgen/sim/hops.py)")
    p.add_argument("--learned-allowances", action="store_true",
                   help="with --hops: learn d_ctrl, jitter and reply from the drawn hops, as "
                   "[scheduler] allowances = \"learned\" does live")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--rate", type=float, help="total offered rate (r/s)")
    group.add_argument("--search", choices=["goodput"], help="binary-search the goodput")
    p.add_argument("--start-rate", type=float, help="first probe of --search (default: bound)")
    p.add_argument("--max-bad-rate", type=float, default=0.01)
    p.add_argument("--precision", type=float, default=0.01, help="relative search precision")
    p.add_argument("--seed", type=int)
    p.add_argument("--gpus", type=int)
    p.add_argument("--measure", type=float, help="measure window seconds")
    p.add_argument("--warmup", type=float, help="warmup seconds")
    p.add_argument("--json", dest="json_out", help="write the report here")
    p.add_argument("--quiet", action="store_true", help="no text summary")
    return p


def cluster_allowances(config: ClusterConfig) -> dict[str, float]:
    """The workload overrides that give the simulator a cluster's scheduling allowances."""
    return {"d_ctrl_ms": config.scheduler.d_ctrl_ms, "d_data_ms": config.scheduler.d_data_ms,
            "reply_ms": config.frontends.reply_allowance_ms,
            "jitter_ms": config.scheduler.jitter_ms}


def cluster_model_allowances(config: ClusterConfig, models: list[ModelSpec]) -> list[ModelSpec]:
    """``models`` with the per-model ``d_data_ms`` of the cluster's models of the same name
    (exact names, as the simulated admission matches them; ``zserve bench --model-map`` maps
    names for the live run only)."""
    own = {m.name: m.d_data_ms for m in config.models if m.d_data_ms is not None}
    return [replace(m, d_data_ms=own[m.name]) if m.name in own else m for m in models]


def cluster_gpu_profiles(config: ClusterConfig, workload: Workload
                         ) -> tuple[Workload, list[dict[str, LatencyProfile]] | None]:
    """The twin's device kinds: simulated GPU i has the kind backend i announces
    (``backends.kind_of(i)``), and runs each workload model whose cluster model of the same name
    has a profile file for that kind with that file's l(b) (up to the workload model's max
    batch); its other GPUs run the workload's profile. As a live shard does
    (``zserve.scheduler.kind_profiles``), the model's own profile becomes the slowest of those,
    batch by batch, and ``SimConfig.gpu_profiles`` lists the GPUs whose profile differs from it.
    Returns the workload (those models' profiles replaced) and the list; None where no workload
    model has per-kind files."""
    given = {m.name: m for m in config.models if m.profiles}
    if not any(m.name in given for m in workload.models):
        return workload, None
    kinds = [config.backends.kind_of(gpu) for gpu in range(workload.gpus)]
    models: list[ModelSpec] = []
    out: list[dict[str, LatencyProfile]] = [{} for _ in kinds]
    for spec in workload.models:
        model = given.get(spec.name)
        if model is None:
            models.append(spec)
            continue
        cap, files = spec.profile.max_batch, model.profiles or {}
        runs = [spec.profile if kind not in files else
                profile_from_file(model, files[kind]).truncated(cap) for kind in kinds]
        own = slowest_profile(list({id(p): p for p in runs}.values()))
        for gpu, profile in enumerate(runs):
            if profile.table_s != own.table_s:
                out[gpu][spec.name] = profile
        models.append(replace(spec, profile=own))
    return workload.with_overrides(models=models), out


def _load(args: argparse.Namespace) -> tuple[Workload, ClusterConfig | None]:
    """The workload with the command line's overrides, and the cluster of --allowances-from."""
    from zserve.config.cluster import load_config  # its ConfigError is a ValueError: exit status 2

    workload = load_workload(args.workload)
    cluster = None
    overrides: dict[str, Any] = {}
    if args.allowances_from is not None:
        cluster = load_config(args.allowances_from)
        overrides.update(cluster_allowances(cluster))
        overrides["models"] = cluster_model_allowances(cluster, workload.models)
    for key, value in (("policy", args.policy), ("drop", args.drop), ("rate", args.rate),
                       ("seed", args.seed), ("gpus", args.gpus),
                       ("measure_s", args.measure), ("warmup_s", args.warmup),
                       ("keep_tolerance", args.keep_tolerance),
                       ("jitter_ms", args.jitter_ms)):
        if value is not None:
            overrides[key] = value
    if args.arrival is not None:
        overrides["arrival"] = ArrivalSpec.parse(args.arrival)
    if overrides:
        workload = workload.with_overrides(**overrides)
    return workload, cluster


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        workload, cluster = _load(args)
        kinds = None
        if cluster is not None:
            workload, kinds = cluster_gpu_profiles(cluster, workload)
        hops = None if args.hops is None else HopLatencies.parse(args.hops)
        if args.learned_allowances and hops is None:
            raise ValueError("--learned-allowances needs --hops (what the rule learns from)")
    except (OSError, ValueError) as exc:
        print(f"zserve sim: {exc}", file=sys.stderr)
        return 2
    sim_config = SimConfig(frontend=cluster, gpu_profiles=kinds, hops=hops,
                           learned_allowances=args.learned_allowances)
    try:
        if args.search:
            bail = args.max_bad_rate  # exact: a bailed probe could only have failed

            def probe(rate: float) -> dict[str, Any]:
                probed: dict[str, Any] = simulate(
                    workload.with_overrides(rate=rate),
                    replace(sim_config, bail_bad_rate=bail))
                if not args.quiet:
                    print(f"  probe {rate:10.1f} r/s: worst bad rate {probed['bad_rate']:.3%}"
                          f"{' (bailed)' if probed['bailed'] else ''}", file=sys.stderr)
                return probed

            start = args.start_rate
            if start is None:
                bound = workload_bound_rps(workload)
                start = bound if 0 < bound < float("inf") else workload.rate
            report = search_goodput(probe, start, max_bad_rate=args.max_bad_rate,
                                    rel_precision=args.precision)
            set_fraction_of_bound(report)
        else:
            report = simulate(workload, sim_config)
    except InvariantError as exc:
        print(f"zserve sim: INVARIANT BROKEN: {exc}", file=sys.stderr)
        return 1
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if not args.quiet:
        print(summary_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
