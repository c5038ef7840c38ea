"""The `zserve` command: one subcommand per entry, each implemented in its own module.

Every subcommand is a ``main(argv: list[str]) -> int`` function imported lazily, so that
``zserve --help`` stays fast and a subcommand's heavy imports (ONNX Runtime, matplotlib) are paid
only by the subcommand that needs them.

A reader that goes away (``zserve status | head``) ends the command as it ends ``cat`` or
``seq``: nothing more is written, no traceback, exit status 141 (128 + SIGPIPE, what a shell
reports for a tool SIGPIPE stopped), so ``set -o pipefail`` sees it as it sees them. The
signal itself is not restored to its default: it would also kill ``zserve up``'s supervisor
mid-drain, and any role writing to a closed socket.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
from collections.abc import Callable, Sequence

# The names of ``zserve experiment NAME`` for the help text, without importing the experiments
# (``zserve.loadgen.experiments.runner.EXPERIMENTS`` is the registry; a test keeps them equal).
EXPERIMENT_NAMES = ("fig6a", "zoo", "flattop", "eager-floor", "policy-grid", "random-family",
                    "protocols", "scale", "failover", "model-cycles", "model-move",
                    "partition", "autoscale", "day", "placement", "fleet", "prefix", "nexus",
                    "apps", "harpagon")
SIGPIPE_EXIT_STATUS = 128 + signal.SIGPIPE

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("zserve.demo", "main", "start the built-in local cluster and measure its goodput"),
    "up": ("zserve.cluster.cli", "main_up", "start a cluster from cluster.toml"),
    "down": ("zserve.cluster.cli", "main_down", "stop a cluster started with `up --detach`"),
    "status": ("zserve.cluster.status", "main",
               "a running cluster's endpoints, roles, models, backends, readiness and rates"),
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
    "bench-perf-analyzer": (
        "zserve.loadgen.bench.perf_analyzer_pair",
        "main",
        "perf_analyzer against a cluster's policy and eager, paired per concurrency step",
    ),
    "experiment": (
        "zserve.loadgen.experiments.runner",
        "main",
        "run a performance experiment (the names: below)",
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
    lines += ["", "experiments (`zserve experiment NAME [--live] [--quick]`, docs/performance.md):",
              "  " + ", ".join(EXPERIMENT_NAMES)]
    lines += ["", "`zserve COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        status = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit
    except BrokenPipeError:
        if not _stdout_reader_gone():  # a socket's, say: a bug to see, not a reader that left
            raise
        # Python's recipe: stdout onto /dev/null, so that nothing at exit writes to the pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return SIGPIPE_EXIT_STATUS
    return status


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed it (the kernel reports an
    error condition on the writing end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (OSError, ValueError):  # no file descriptor behind stdout
        return False


def _run(args: list[str]) -> int:
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
