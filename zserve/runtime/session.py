"""The start-up and shut-down every role process follows, in one order.

A role's ``_serve`` reads as its own steps only; the order and the cleanup are here:

1. ``RoleSession.open``: the ZeroMQ context with the role's CURVE keys, then the control link
   to the supervisor (heartbeat, drain request, SIGTERM) before anything can fail;
2. the host binds its sockets (its own code) and ``session.serve_stats`` /
   ``session.on_control`` hand the link the host's stats and control handlers;
3. ``await session.ready(endpoints)``: Ready with the bound endpoints, the peer map back;
4. ``await session.sync_clock(clock, peers)``: the cluster clock estimated before serving
   (False: a drain came first, or no rank was named; ``session.exit_code`` says which);
5. the host connects and serves; ``await session.drained()`` returns the drain request;
6. on leaving the ``async with``: the closers the host registered (``session.closing``), last
   first, then the clock sync, the control link and the context.

With ``ZSERVE_HEALTH_DIR`` set, the session also keeps the probe files of
``zserve.runtime.health_files``: ``alive`` from step 1, ``ready`` from step 5 until the drain.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import zmq

from zserve.config.cluster import RoleConfig
from zserve.runtime import keys
from zserve.runtime.clock import ClockSync, ClusterClock
from zserve.runtime.control_link import ControlLink, DrainRequest, StatsFn
from zserve.runtime.health_files import HealthFiles
from zserve.runtime.runner import sync_cluster_clock

# A role's sockets still hold messages when it leaves: this long for them to go out.
SOCKET_CLOSE_LINGER_MS = 200
# Exit codes of a role that did not serve: a drain before it could (a clean stop), or a
# cluster without a rank to take the clock from (a configuration error).
EXIT_DRAINED = 0
EXIT_NO_CLOCK = 2

Closer = Callable[[], Awaitable[None] | None]


class RoleSession:
    """One role process's context, control link and clock sync, opened and closed in order."""

    def __init__(self, ctx: zmq.Context[Any], link: ControlLink,
                 health: HealthFiles | None = None) -> None:
        self.ctx = ctx
        self.link = link
        self.health = health or HealthFiles(None)
        self.clock_sync: ClockSync | None = None
        self.exit_code = EXIT_DRAINED
        self._closers: list[Closer] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, config: RoleConfig, control_address: str | None, *, role: str,
                   linger_ms: int = SOCKET_CLOSE_LINGER_MS) -> AsyncIterator[RoleSession]:
        """Steps 1 and 6 of the module docstring around the body of the ``async with``."""
        ctx: zmq.Context[Any] = zmq.Context()
        session: RoleSession | None = None
        try:
            keys.secure_role_context(ctx, config.cluster, role)
            cluster = config.cluster
            link = await ControlLink.open(ctx, control_address, role=role, name=config.name,
                                          drain_s=cluster.drain_s, peers=dict(config.peers))
            session = cls(ctx, link, HealthFiles.from_env())
            session.health.start()
            yield session
        finally:
            if session is not None:
                await session._close()
            keys.destroy_role_context(ctx, linger_ms=linger_ms)

    @property
    def drain(self) -> DrainRequest:
        return self.link.drain

    def serve_stats(self, stats: StatsFn) -> None:
        """Answer the supervisor's StatsRequest with ``stats(reset)`` from now on."""
        self.link.set_stats(stats)

    def on_control(self, handler: Callable[[Any], None]) -> None:
        """Hand the host every other control message from now on."""
        self.link.set_on_message(handler)

    def closing(self, closer: Closer) -> None:
        """Run ``closer`` (sync or async) on the way out, before those registered earlier."""
        self._closers.append(closer)

    async def ready(self, endpoints: dict[str, str]) -> dict[str, str]:
        """Step 3: announce the bound endpoints; the cluster's peer map back."""
        return await self.link.ready(endpoints)

    async def sync_clock(self, clock: ClusterClock, peers: dict[str, str]) -> bool:
        """Step 4: True once ``clock`` tracks the rank's; False when a drain came first (exit
        ``EXIT_DRAINED``) or the peer map names no rank (``EXIT_NO_CLOCK``)."""
        self.clock_sync = await sync_cluster_clock(self.ctx, peers, name=self.link.name,
                                                   drain=self.link.drain, clock=clock)
        if self.clock_sync is None:
            self.exit_code = EXIT_DRAINED if self.link.drain.requested else EXIT_NO_CLOCK
            return False
        return True

    async def drained(self) -> DrainRequest:
        """Step 5: the role serves (its ``ready`` probe file appears); wait for the drain
        request (SIGTERM, the supervisor's Shutdown), which takes the file away."""
        if not self.link.drain.requested:
            self.health.ready()
        await self.link.drain.wait()
        self.health.unready()
        return self.link.drain

    async def _close(self) -> None:
        self.health.unready()
        while self._closers:
            result = self._closers.pop()()
            if inspect.isawaitable(result):
                await result
        if self.clock_sync is not None:
            await self.clock_sync.close()
        await self.link.close()
        await self.health.close()


__all__ = ["EXIT_DRAINED", "EXIT_NO_CLOCK", "SOCKET_CLOSE_LINGER_MS", "RoleSession"]
