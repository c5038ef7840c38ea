"""``zserve up`` and ``zserve down``: a supervised cluster from the command line.

``zserve up CLUSTER.toml`` first checks the file (``zserve.cluster.preflight``: each problem one
line naming its key, exit code 2, nothing started), then runs a ``Supervisor``
(``zserve.cluster.supervisor``)
in the foreground until SIGINT/SIGTERM, then drains it; ``--detach`` starts that in a new session
and returns once the cluster is up. Either way it prints every frontend's addresses as bound
(``endpoint_lines``: the native client's, OIP HTTP, OIP gRPC, metrics; the kernel's port where
the file said 0); ``--detach`` prints the client addresses alone on stdout, one a line, for
scripts, and the rest on stderr. A running cluster leaves a pid file and a state file (JSON:
client addresses, every frontend's endpoints, run folder, child pids and restart counts,
rewritten when a restarted child is ready) in the state folder, which ``zserve down`` reads to
drain it and ``zserve status`` to name each role's pid and restarts and each frontend's
endpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zserve.cluster.preflight import PreflightError, Problem, check_cluster
from zserve.cluster.supervisor import StartupError, Supervisor
from zserve.config.cluster import ConfigError, load_config
from zserve.runtime import runner

DETACH_POLL_S = 0.05
"""How often ``zserve up --detach`` looks for the state file while its child starts (the
child's exit wakes it at once through a pidfd)."""
# How `zserve up` and `zserve status` name each of a frontend's addresses
# (``zserve.cluster.supervisor.USER_ENDPOINTS``, in that order).
ENDPOINT_LABELS = {"client": "client", "http": "OIP HTTP", "grpc": "OIP gRPC",
                   "metrics": "metrics"}


def endpoint_lines(endpoints: dict[str, dict[str, str]]) -> list[str]:
    """One line per address of each frontend (``Supervisor.user_endpoints``, or the state
    file's ``endpoints``): ``  frontend-0   OIP HTTP  127.0.0.1:8000``."""
    return [f"  {frontend:<12} {label:<9} {served[socket]}"
            for frontend, served in endpoints.items()
            for socket, label in ENDPOINT_LABELS.items() if socket in served]


def state_dir_for(arg: str | None) -> Path:
    """The folder of the pid and state files: ``arg``, else $XDG_RUNTIME_DIR/zserve, else a
    per-user folder under the temp dir (also what ``zserve status`` reads)."""
    return _state_dir(arg)


def recorded_state(address: str, state_dir_arg: str | None = None) -> dict[str, Any]:
    """The state file of the recorded cluster with a frontend at client ``address`` ({}: none)."""
    state_dir = state_dir_for(state_dir_arg)
    for path in sorted(state_dir.glob("*.json")) if state_dir.exists() else []:
        try:
            state: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):  # being rewritten, or not ours
            continue
        if address in state.get("client_addresses", []):
            return state
    return {}


def _state_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "zserve" if runtime else Path(tempfile.gettempdir()) / (
        f"zserve-{os.getuid()}"
    )


def _state_paths(state_dir: Path, name: str) -> tuple[Path, Path]:
    return state_dir / f"{name}.pid", state_dir / f"{name}.json"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zserve up", description=main_up.__doc__)
    parser.add_argument("config", help="cluster.toml")
    parser.add_argument("--detach", action="store_true",
                        help="run in the background; print the client addresses (stdout) and "
                        "every frontend's endpoints (stderr), and return")
    parser.add_argument("--state-dir", help="where the pid and state files go "
                        "(default $XDG_RUNTIME_DIR/zserve or /tmp/zserve-$UID)")
    parser.add_argument("--ipc-dir", help="parent folder of the cluster's run folder "
                        "(default: cluster.ipc_dir, else the system temp folder)")
    parser.add_argument("--no-restart", action="store_true", help="do not restart dead roles")
    return parser


def main_up(argv: list[str]) -> int:
    """``zserve up CLUSTER.toml [--detach] [--state-dir DIR]``: start a cluster and supervise it
    until SIGINT/SIGTERM (or ``zserve down``), then drain it and exit 0."""
    args = _up_parser().parse_args(argv)
    try:
        config = load_config(args.config)
    except (ConfigError, OSError) as exc:
        print(f"zserve up: {exc}", file=sys.stderr)
        return 2
    # Also checked by the Supervisor; here it runs before --detach, so the user sees the lines.
    problems = check_cluster(config, ipc_base=args.ipc_dir,
                             ipc_base_key="--ipc-dir" if args.ipc_dir else "cluster.ipc_dir")
    if problems:
        _report(problems)
        return 2
    state_dir = _state_dir(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    pid_path, state_path = _state_paths(state_dir, config.name)
    if args.detach:
        return _detach(args, pid_path, state_path)
    runner.configure_logging()
    supervisor: Supervisor | None = None

    def on_signal(signum: int, frame: Any) -> None:
        if supervisor is not None:
            supervisor.request_stop()
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        supervisor = Supervisor(config, ipc_base=args.ipc_dir, restart=not args.no_restart)
        supervisor.start()
    except PreflightError as exc:  # something changed since the check above (a port taken)
        _report(exc.problems)
        return 2
    except (StartupError, KeyboardInterrupt) as exc:
        if supervisor is not None:
            supervisor.shutdown(0.0)
        print(f"zserve up: {exc or 'interrupted'}", file=sys.stderr)
        return 1

    running = supervisor
    try:
        running.serve(on_ready=lambda: _announce(running, args.config, pid_path, state_path))
    finally:
        for path in (pid_path, state_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    print(f"zserve: cluster {config.name!r} stopped", flush=True)
    return 0


def _report(problems: Iterable[Problem]) -> None:
    for problem in problems:
        print(f"zserve up: {problem}", file=sys.stderr)


def _write_state(supervisor: Supervisor, config_path: str, state_path: Path) -> None:
    """The state file (`zserve down` and `zserve status` read it): client addresses, every
    frontend's endpoints as bound, run folder, each child's pid and how many times the
    supervisor restarted it."""
    children = supervisor.children
    state = {
        "name": supervisor.config.name,
        "pid": os.getpid(),
        "config": str(Path(config_path).resolve()),
        "client_addresses": supervisor.client_addresses,
        # Where the frontends serve the Open Inference Protocol: the ports the kernel picked for
        # a configured port 0 (`zserve bench ADDRESS --protocol http-json` reads them).
        "oip_addresses": {server: supervisor.frontend_endpoints(server)
                          for server in ("http", "grpc")},
        "endpoints": supervisor.user_endpoints(),
        "run_dir": supervisor.run_dir,
        "pids": {child_name: child.pid for child_name, child in children.items()},
        "restarts": {child_name: len(child.restart_history)
                     for child_name, child in children.items()},
    }
    _write_atomic(state_path, json.dumps(state, indent=2) + "\n")


def _announce(supervisor: Supervisor, config_path: str, pid_path: Path, state_path: Path) -> None:
    """The cluster is up: write its state and pid files (the state file again whenever a
    restarted child is ready), print where clients connect and every frontend's endpoints."""
    name = supervisor.config.name
    _write_state(supervisor, config_path, state_path)
    supervisor.on_child_ready = lambda: _write_state(supervisor, config_path, state_path)
    _write_atomic(pid_path, f"{os.getpid()}\n")
    security = supervisor.config.security
    for address in supervisor.client_addresses:
        print(f"zserve: cluster {name!r} is up; clients connect to {address}", flush=True)
        if security.curve and address.startswith("tcp://"):  # docs/security.md
            print(f"zserve: with CURVE: server_key={security.keys_dir}/frontend.key and a client "
                  f"key listed in {security.clients_dir}", flush=True)
    print(f"zserve: cluster {name!r} serves at:", flush=True)
    print("\n".join(endpoint_lines(supervisor.user_endpoints())), flush=True)
    view = supervisor.scheduler_view
    if supervisor.config.scheduler.standby and view:
        print(f"zserve: scheduler {view.get('active')} is active in epoch {view.get('epoch')}; "
              "the other one is its hot standby", flush=True)


def _detach(args: argparse.Namespace, pid_path: Path, state_path: Path) -> int:
    """Start ``zserve up`` in a new session with its output in a log file; return once its
    state file names the client address (or it has died)."""
    if pid_path.exists():
        print(f"zserve up: {pid_path} exists: is the cluster already up? (`zserve down`)",
              file=sys.stderr)
        return 1
    log_path = state_path.with_suffix(".log")
    command = [sys.executable, "-m", "zserve", "up", args.config,
               "--state-dir", str(pid_path.parent)]
    if args.no_restart:
        command.append("--no-restart")
    if args.ipc_dir:
        command += ["--ipc-dir", args.ipc_dir]
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            start_new_session=True,
        )
    # Wait on the child's exit or the state file; the pidfd makes the wait event-driven.
    pidfd = os.pidfd_open(process.pid)
    try:
        while not state_path.exists():
            readable, _, _ = select.select([pidfd], [], [], DETACH_POLL_S)
            if readable:
                process.wait()
                print(f"zserve up: the cluster failed to start (exit {process.returncode}); "
                      f"see {log_path}", file=sys.stderr)
                return 1
    finally:
        os.close(pidfd)
    state = json.loads(state_path.read_text())
    for address in state["client_addresses"]:  # stdout: what a script captures
        print(address, flush=True)
    print(f"zserve: cluster {state['name']!r} is up in the background (log: {log_path}; "
          "`zserve down` stops it); it serves at:", file=sys.stderr)
    print("\n".join(endpoint_lines(state["endpoints"])), file=sys.stderr)
    return 0


def main_down(argv: list[str]) -> int:
    """``zserve down [NAME] [--state-dir DIR] [--timeout S]``: drain a cluster started with
    ``zserve up --detach`` and wait for it to exit."""
    parser = argparse.ArgumentParser(prog="zserve down", description=main_down.__doc__)
    parser.add_argument("name", nargs="?", help="cluster name (default: the only one)")
    parser.add_argument("--state-dir")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    state_dir = _state_dir(args.state_dir)
    if args.name:
        pid_path = _state_paths(state_dir, args.name)[0]
    else:
        found = sorted(state_dir.glob("*.pid")) if state_dir.exists() else []
        if len(found) != 1:
            print(f"zserve down: {len(found)} clusters in {state_dir}; name one",
                  file=sys.stderr)
            return 1
        pid_path = found[0]
    try:
        pid = int(pid_path.read_text().strip())
    except (OSError, ValueError) as exc:
        print(f"zserve down: no running cluster ({exc})", file=sys.stderr)
        return 1
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        pid_path.unlink(missing_ok=True)
        print("zserve down: the cluster was not running", file=sys.stderr)
        return 1
    try:
        os.kill(pid, signal.SIGTERM)
        readable, _, _ = select.select([pidfd], [], [], args.timeout)
        if not readable:
            print(f"zserve down: {pid} still running after {args.timeout} s", file=sys.stderr)
            return 1
    finally:
        os.close(pidfd)
    print(f"zserve down: stopped {pid_path.stem}")
    return 0
