"""``zserve experiment NAME``: the registry of experiments, the command line, the result JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zserve.loadgen import experiments
from zserve.loadgen.experiments.apps import run_apps
from zserve.loadgen.experiments.autoscale import run_autoscale
from zserve.loadgen.experiments.common import (
    DEFAULT_OUT_DIR,
    EXPERIMENT_SCHEMA,
    Options,
    Outcome,
    Table,
    machine_info,
)
from zserve.loadgen.experiments.day import run_day
from zserve.loadgen.experiments.eager_floor import run_eager_floor
from zserve.loadgen.experiments.failover import run_failover
from zserve.loadgen.experiments.fig6a import run_fig6a
from zserve.loadgen.experiments.flattop import run_flattop
from zserve.loadgen.experiments.fleet import run_fleet
from zserve.loadgen.experiments.harpagon import run_harpagon
from zserve.loadgen.experiments.model_cycles import run_model_cycles
from zserve.loadgen.experiments.model_move import run_model_move
from zserve.loadgen.experiments.nexus import run_nexus
from zserve.loadgen.experiments.partition import run_partition
from zserve.loadgen.experiments.placement import run_placement
from zserve.loadgen.experiments.policy_grid import run_policy_grid
from zserve.loadgen.experiments.prefix import run_prefix
from zserve.loadgen.experiments.protocols import run_protocols
from zserve.loadgen.experiments.random_family import run_random_family
from zserve.loadgen.experiments.scale import run_scale
from zserve.loadgen.experiments.zoo import run_zoo

EXPERIMENTS: dict[str, tuple[Callable[[Options], Outcome], str]] = {
    "fig6a": (run_fig6a, "Figure 6a: eager and timeout vs deferred over beta/alpha"),
    "zoo": (run_zoo, "the 37-model A100 zoo on 64 GPUs: deferred vs eager vs timeout"),
    "flattop": (run_flattop, "goodput, bad rate, GPU busy vs offered load (0.1x..3x)"),
    "eager-floor": (run_eager_floor, "deferred/eager over a grid of small cases"),
    "policy-grid": (run_policy_grid, "the default vs frontrun, eager, eager-edf, timeout over "
                    "single models, mixes, the zoo; light load"),
    "random-family": (run_random_family, "the default vs frontrun and eager on 30 random "
                      "zoo workloads, judged on common rates"),
    "protocols": (run_protocols, "goodput and CPU per request through the native client, OIP "
                  "HTTP/JSON, HTTP/binary and gRPC (live)"),
    "scale": (run_scale, "scheduler CPU vs models x GPUs (bench-scheduler); --live: the "
              "machine's end-to-end ceiling"),
    "failover": (run_failover, "the scheduler SIGKILLed under load: hot spare vs a plain "
                 "restart (takeover time, requests lost)"),
    "model-cycles": (run_model_cycles, "a backend's RSS across 50 live load/unload cycles of "
                     "one model (live)"),
    "model-move": (run_model_move, "make-before-break model moves under steady load: "
                   "requests lost and the bad rate before, during, after (live)"),
    "partition": (run_partition, "sub-cluster partitioning (Symphony A.2): greedy-started "
                  "HiGHS MILP vs random search; a re-plan under a disruption budget"),
    "autoscale": (run_autoscale, "Symphony 5.3 with the autoscaler acting: goodput and GPUs "
                  "in use vs offered load (0.1x..2x)"),
    "day": (run_day, "Symphony 5.6: a generated day of 24 models on up to 512 GPUs, autoscaled "
            "(fluid model + a compressed hour at request level) vs Ray Serve, KPA, an oracle"),
    "placement": (run_placement, "the A100 zoo on 64 GPUs that each hold a third of the models: "
                  "goodput, partitioned placement vs round-robin vs random search"),
    "fleet": (run_fleet, "35 zoo models on A100s, GTX 1080 Tis or both: cost per hour of the "
              "smallest fleet that serves one rate"),
    "prefix": (run_prefix, "prefix batching (Nexus): numerics of grouped CNN variants, simulated "
               "goodput of 10 ResNet50 variants apart and grouped, the CPU figure; --live: "
               "CNN variants apart and as a [[prefix_groups]] group in a CPU cluster"),
    "nexus": (run_nexus, "the papers' baselines: Symphony Table 2's Nexus column, and the flat "
              "top (10 models, 24 GPUs) with Nexus and Clockwork-like beside the default"),
    "apps": (run_apps, "a three-stage app (Nexus/Harpagon) served end to end by a live cluster, "
             "called through tritonclient: every request answered within the app's SLO"),
    "harpagon": (run_harpagon, "Harpagon's DAG-app planner: the paper's toy examples, and "
                 "cost vs Nexus/Scrooge/InferLine/Clipper-like planners and the optimum"),
}


def run_experiment(name: str, opts: Options, command: str) -> dict[str, Any]:
    """Run one experiment, write DIR/NAME/result.json (and plots), return the result dict."""
    func, _ = EXPERIMENTS[name]
    started = time.perf_counter()
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    machine = machine_info()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    outcome = func(opts)
    result = {
        "schema": EXPERIMENT_SCHEMA,
        "experiment": name,
        "quick": opts.quick,
        "live": opts.live,
        "command": command,
        "started_at": started_at,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": machine,
        "config": outcome.config,
        "tables": [t.to_dict() for t in outcome.tables],
        "checks": [c.to_dict() for c in outcome.checks],
        "plots": [str(p) for p in outcome.plots],
        "points": outcome.points,
    }
    (opts.out_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (opts.out_dir / "tables.md").write_text(
        "\n\n".join(f"**{t.title}**\n\n{t.markdown()}" for t in outcome.tables) + "\n")
    return result


def result_text(result: dict[str, Any]) -> str:
    lines = []
    for t in result["tables"]:
        lines += [Table(t["title"], t["columns"], t["rows"]).text(), ""]
    for c in result["checks"]:
        lines.append(f"check {'PASS' if c['passed'] else 'FAIL'}: {c['name']} ({c['detail']})")
    if result["plots"]:
        lines.append("plots: " + ", ".join(result["plots"]))
    lines.append(f"{result['experiment']}: {result['wall_s']:.1f} s wall")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    epilog = "experiments:\n" + "\n".join(
        f"  {name:<12} {help_}" for name, (_, help_) in EXPERIMENTS.items())
    p = argparse.ArgumentParser(
        prog="zserve experiment", description=(experiments.__doc__ or "").split("\n\n")[0],
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(EXPERIMENTS), help="the experiment")
    p.add_argument("--live", action="store_true",
                   help="add the live parts (fig6a, flattop, scale): clusters of emulated "
                   "backends")
    p.add_argument("--quick", action="store_true", help="a small version (< 30 s), for tests")
    p.add_argument("--out", default=str(DEFAULT_OUT_DIR),
                   help=f"results go to OUT/NAME/ (default {DEFAULT_OUT_DIR})")
    p.add_argument("--only", metavar="TEXT",
                   help="policy-grid, random-family: run only the cells (members) whose name "
                   "contains TEXT")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    quiet = args.quiet

    def say(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    opts = Options(quick=args.quick, live=args.live, out_dir=Path(args.out) / args.name,
                   plots=not args.no_plots, say=say, only=args.only)
    command = "zserve experiment " + " ".join(argv)
    result = run_experiment(args.name, opts, command)
    print(result_text(result))
    failed = [c["name"] for c in result["checks"] if not c["passed"]]
    if failed:
        print(f"{args.name}: {len(failed)} of {len(result['checks'])} checks failed",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
