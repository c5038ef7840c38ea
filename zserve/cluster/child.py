"""What the supervisor knows of one child role, and what runs in the spawned child.

``ENTRY_POINTS`` names each role's ``run_*(config, control_address) -> exit code`` function;
``child_main`` is the spawned process's target: it imports that function, runs it, and on an
exception leaves the traceback in the error file the supervisor reports a failed start with.
``SupervisedChild`` is the supervisor's record of one child (process, readiness, incarnation,
heartbeat, restart schedule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import multiprocessing.process
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from zserve.config.cluster import RoleConfig
from zserve.runtime import runner

ENTRY_POINTS: dict[str, str] = {
    "rank": "zserve.scheduler.rank_host:run_rank",
    "shard": "zserve.scheduler.shard_process:run_shard",
    "backend": "zserve.backends.host:run_backend",
    "frontend": "zserve.frontend.host:run_frontend",
}


def child_main(role: str, config: RoleConfig, control_address: str, error_file: str) -> None:
    """Spawned child: import the role's entry point and run it (a top-level function so that
    the spawn start method can pickle it)."""
    os.environ[runner.ERROR_FILE_ENV] = error_file
    try:
        module_name, func_name = ENTRY_POINTS[role].split(":")
        entry: Callable[[RoleConfig, str | None], int] = getattr(
            importlib.import_module(module_name), func_name
        )
        code = entry(config, control_address)
    except BaseException:
        import traceback

        with contextlib.suppress(OSError), open(error_file, "w") as f:
            traceback.print_exc(file=f)
        raise
    sys.exit(code)


@dataclasses.dataclass
class SupervisedChild:
    """One child role as the supervisor tracks it across restarts."""

    role: str
    name: str
    index: int
    config: RoleConfig
    process: multiprocessing.process.BaseProcess | None = None
    endpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    ready: bool = False
    incarnation: int = 0  # how many times it has sent Ready
    restarts: int = 0
    started_at: float = 0.0
    last_heartbeat: float = 0.0
    restart_at: float | None = None
    # (death noticed, respawned) of every restart, monotonic s: the backoff as it happened.
    restart_history: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    died_at: float | None = None
    stopping: bool = False
    # Released by the autoscaler (zserve.cluster.autoscaler): when it exits, it is not restarted.
    retiring: bool = False
    stats_waiters: list[Future[dict[str, Any]]] = dataclasses.field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None


__all__ = ["ENTRY_POINTS", "SupervisedChild", "child_main"]
