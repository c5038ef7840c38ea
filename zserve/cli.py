"""The `zserve` command: one subcommand per entry, each implemented in its own module.

Every subcommand is a ``main(argv: list[str]) -> int`` function imported lazily, so that
``zserve --help`` stays fast and a subcommand's heavy imports (ONNX Runtime, matplotlib) are paid
only by the subcommand that needs them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("zserve.demo", "main", "start the built-in local cluster and measure its goodput"),
    "up": ("zserve.cluster.cli", "main_up", "start a cluster from cluster.toml"),
    "down": ("zserve.cluster.cli", "main_down", "stop a cluster started with `up --detach`"),
    "status": ("zserve.cluster.status", "main",
               "a running cluster's roles, models, backends, readiness and rates"),
    "frontend": ("zserve.frontend.host", "main", "run one frontend process"),
    "scheduler": ("zserve.scheduler.shard_process", "main", "run one scheduler shard process"),
    "rank": ("zserve.scheduler.rank_host", "main", "run the rank process"),
    "backend": ("zserve.backends.host", "main", "run one backend process"),
    "sim": ("zserve.loadgen.sim.cli", "main", "run a workload in the discrete-event simulator"),
    "bench-scheduler": (
        "zserve.scheduler.bench.throughput",
        "main",
        "scheduler-only throughput benchmark (no sockets)",
    ),
    "bench-transport": (
        "zserve.transport.bench.throughput", "main", "transport throughput benchmark",
    ),
    "bench-wakeup": (
        "zserve.loadgen.bench.wakeup",
        "main",
        "process wake-up latency with and without idle pollers; --stalls: host stalls",
    ),
    "bench": ("zserve.loadgen.cli", "main", "open-loop load on a live cluster; goodput search"),
    "experiment": (
        "zserve.loadgen.experiments.runner",
        "main",
        "run a performance experiment (fig6a, zoo, flattop, eager-floor, scale, failover)",
    ),
    "profile": ("zserve.backends.profiler", "main", "measure l(b) of an ONNX model"),
    "models": ("zserve.backends.builtin", "main", "build (or list) the built-in ONNX models"),
    "keys": (
        "zserve.runtime.keys", "main",
        "`keys init [DIR]`: write CURVE key pairs (docs/security.md)",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: zserve COMMAND [ARGS...] | zserve --version", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "`zserve COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] in {"-V", "--version"}:
        from zserve import __version__

        print(f"zserve {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"zserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    func: Callable[[list[str]], int] = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
