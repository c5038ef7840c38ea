"""Probe files: how a role without an HTTP endpoint tells Kubernetes it lives and serves.

A scheduler or backend pod has no health endpoint (the frontend's is ``/v2/health/*``), so with
``ZSERVE_HEALTH_DIR`` set every role keeps two files there for exec probes
(``examples/kubernetes/probe.sh``, docs/kubernetes.md):

- ``alive``: touched every ``TOUCH_INTERVAL_S`` by a task on the role's event loop from the
  moment the process starts, so its age says whether the loop still runs (a wedged or stopped
  process stops touching it);
- ``ready``: present while the role serves: written once it has bound, loaded and warmed what it
  must and knows the cluster clock (``RoleSession.drained``), removed the moment a drain is
  requested and when the process leaves.

Without the variable nothing is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

HEALTH_DIR_ENV = "ZSERVE_HEALTH_DIR"
ALIVE_FILE = "alive"
READY_FILE = "ready"
# The probe allows ten of these (examples/kubernetes/probe.sh): a loaded node's stalls pass.
TOUCH_INTERVAL_S = 1.0


class HealthFiles:
    """The ``alive`` and ``ready`` files of one process in ``folder`` (None: none kept)."""

    def __init__(self, folder: str | None) -> None:
        self.folder = Path(folder) if folder else None
        self._toucher: asyncio.Task[None] | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HealthFiles:
        return cls((os.environ if environ is None else environ).get(HEALTH_DIR_ENV) or None)

    def start(self) -> None:
        """Create the folder, drop a previous process's ``ready`` and keep ``alive`` fresh."""
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self.unready()
        self._toucher = asyncio.get_running_loop().create_task(self._touch_loop(),
                                                               name="health-alive")

    def ready(self) -> None:
        if self.folder is not None:
            (self.folder / READY_FILE).write_text(f"{os.getpid()}\n")

    def unready(self) -> None:
        if self.folder is not None:
            (self.folder / READY_FILE).unlink(missing_ok=True)

    async def close(self) -> None:
        """Stop touching and remove both files: the process is leaving."""
        if self._toucher is not None:
            self._toucher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._toucher
            self._toucher = None
        if self.folder is not None:
            self.unready()
            (self.folder / ALIVE_FILE).unlink(missing_ok=True)

    async def _touch_loop(self) -> None:
        assert self.folder is not None
        alive = self.folder / ALIVE_FILE
        while True:
            try:
                alive.touch()
            except OSError as exc:  # a full or read-only disk: the probe will say so
                log.warning("cannot touch %s: %s", alive, exc)
            await asyncio.sleep(TOUCH_INTERVAL_S)


__all__ = ["ALIVE_FILE", "HEALTH_DIR_ENV", "READY_FILE", "TOUCH_INTERVAL_S", "HealthFiles"]
