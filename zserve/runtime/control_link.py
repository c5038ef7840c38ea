"""The control link: a role process's DEALER to the supervisor, its heartbeat, its drain request.

- ``ControlLink.open(ctx, control_address, *, role, name, stats=None, drain_s=5.0, peers=None,
  on_message=None)``:
  the control DEALER (identity = ``name``) to the supervisor's ``control`` ROUTER, or a detached
  link when ``control_address`` is None (a role started alone; pass ``peers=config["peers"]``).
  ``ctx`` is the process's sync ``zmq.Context`` (the link makes its socket from a
  ``zmq.asyncio`` shadow of it: a heartbeat twice a second and a stats reply now and then are no
  hot path) or a ``zmq.asyncio.Context``.
  ``on_message(msg)`` gets any other control message (frontends and the process hosting the
  rank: the supervisor's ``BackendGone(name)`` when that backend's process has
  died).
  Installs the signal handlers: SIGTERM drains; SIGINT drains when detached and is ignored under
  a supervisor (which coordinates the drain). ``drain_s``: the grace period a signal gives.
- ``await link.ready(endpoints)``: send ``Ready(role, name, pid, endpoints)`` and wait for the
  supervisor's ``Ready`` whose ``endpoints`` is the peer map (``zserve.runtime.peer_map``); returns
  it.
  Starts the heartbeat task (``Heartbeat`` every ``HEARTBEAT_INTERVAL_S``) and the control
  receive task (it answers ``StatsRequest`` with ``stats(reset)`` and turns ``Shutdown`` into a
  drain request). Detached: returns the ``peers`` given to ``open`` at once.
- ``link.drain``: a ``DrainRequest``; ``await link.drain.wait()``; ``drain.requested``,
  ``drain.reason``, ``drain.drain_s`` (seconds of grace), ``drain.immediate`` (a second signal
  or a lost supervisor: skip the grace period); ``await drain.grace(idle_event)`` waits for
  in-flight work to finish, up to ``drain_s``, cut short by a second request.
- ``await link.close()``: stop the tasks and close the DEALER (bounded LINGER).

Orphan safety: when started by a supervisor, a child whose parent process disappears (its parent
pid changes) requests an immediate drain, so a SIGKILLed supervisor leaves no processes behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from zserve.core.liveness import HEARTBEAT_INTERVAL_S
from zserve.runtime.gc_watch import gc_stats
from zserve.runtime.keys import count_auth_failed
from zserve.transport import codec
from zserve.transport.messages import Heartbeat, Ready, Shutdown, StatsReply, StatsRequest
from zserve.transport.sockets import make_dealer

__all__ = (
    "CLOSE_LINGER_MS",
    "DEFAULT_DRAIN_S",
    "HEARTBEAT_INTERVAL_S",
    "ControlLink",
    "DrainRequest",
    "StatsFn",
)

log = logging.getLogger(__name__)

DEFAULT_DRAIN_S = 5.0
CLOSE_LINGER_MS = 200

StatsFn = Callable[[bool], dict[str, Any]]


class DrainRequest:
    """Set once when the process must stop: a signal, a ``Shutdown`` or a lost supervisor."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._immediate = asyncio.Event()
        self.reason = ""
        self.drain_s = DEFAULT_DRAIN_S
        self.immediate = False

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    @property
    def event(self) -> asyncio.Event:
        """Set once a drain is requested (to wait on it together with something else)."""
        return self._event

    def request(self, reason: str, drain_s: float | None = None) -> None:
        """Ask for a drain; a second request makes it immediate (drain_s = 0)."""
        if self._event.is_set():
            self.immediate = True
            self.drain_s = 0.0
            self._immediate.set()
            return
        self.reason = reason
        if drain_s is not None:
            self.drain_s = max(0.0, drain_s)
        self.immediate = self.drain_s == 0.0
        if self.immediate:
            self._immediate.set()
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()

    async def grace(self, done: asyncio.Event) -> bool:
        """After a drain request: wait until ``done`` is set, for at most ``drain_s``; a second
        request (immediate) cuts the wait short. Returns whether ``done`` is set."""
        if done.is_set() or self.immediate:
            return done.is_set()
        waiters = [
            asyncio.ensure_future(done.wait()),
            asyncio.ensure_future(self._immediate.wait()),
        ]
        try:
            await asyncio.wait(waiters, timeout=self.drain_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        return done.is_set()


class ControlLink:
    """The control DEALER to the supervisor, plus this process's heartbeat and drain request."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket | None,
        *,
        role: str,
        name: str,
        stats: StatsFn | None,
    ) -> None:
        self._sock = sock
        self.role = role
        self.name = name
        # SIGINT's disposition before an attached link ignored it: restored at close, so a link
        # opened inside a longer-lived process (a test run) does not leave Ctrl-C ignored there
        # and in every process it starts afterwards
        self._sigint_before: Any = None
        self.drain = DrainRequest()
        self.peers: dict[str, str] = {}
        self._stats = stats
        self._on_message: Callable[[Any], None] | None = None
        self._ctx: zmq.Context[Any] | None = None  # open() sets it: the auth_failed counter
        self._tasks: list[asyncio.Task[None]] = []
        self._parent_pid = os.getppid()
        self._seq = 0

    def set_stats(self, stats: StatsFn) -> None:
        """Answer StatsRequest with ``stats(reset)`` from now on (a host built after the link)."""
        self._stats = stats

    def set_on_message(self, handler: Callable[[Any], None]) -> None:
        """Hand every control message other than Shutdown and StatsRequest to ``handler``."""
        self._on_message = handler

    @property
    def attached(self) -> bool:
        """True when a supervisor started this process."""
        return self._sock is not None

    @classmethod
    async def open(
        cls,
        ctx: zmq.Context[Any],
        control_address: str | None,
        *,
        role: str,
        name: str,
        stats: StatsFn | None = None,
        drain_s: float = DEFAULT_DRAIN_S,
        peers: dict[str, str] | None = None,
        on_message: Callable[[Any], None] | None = None,
    ) -> ControlLink:
        sock = None
        if control_address:
            actx = ctx if isinstance(ctx, zmq.asyncio.Context) else zmq.asyncio.Context.shadow(ctx)
            sock = make_dealer(actx, control_address, identity=name.encode(),
                               peer_role="supervisor")
        link = cls(sock, role=role, name=name, stats=stats)
        link._ctx = ctx
        link._on_message = on_message
        link.drain.drain_s = drain_s
        link.peers = dict(peers or {})
        link._install_signal_handlers()
        return link

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.drain.request, "SIGTERM")
        if self.attached:
            # A terminal Ctrl-C reaches the whole process group; the supervisor coordinates.
            self._sigint_before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:
            loop.add_signal_handler(signal.SIGINT, self.drain.request, "SIGINT")

    async def ready(self, endpoints: dict[str, str]) -> dict[str, str]:
        """Announce readiness and return the peer map (the ``peers`` given to ``open`` when
        detached: then the endpoints are logged, one JSON object, for whoever started it)."""
        if self._sock is None:
            log.info("%s ready: endpoints %s", self.name, json.dumps(endpoints, sort_keys=True))
            return self.peers
        ready = Ready(role=self.role, name=self.name, pid=os.getpid(), endpoints=endpoints)
        await self._send(ready)
        while True:
            msg = await self._recv()
            if isinstance(msg, Ready):
                self.peers = dict(msg.endpoints)
                break
            if isinstance(msg, Shutdown):
                self.drain.request(msg.reason, msg.drain_s)
                break
            if msg is not None:
                log.warning("%s: ignoring %s before the peer map", self.name, type(msg).__name__)
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        self._tasks.append(asyncio.create_task(self._receive_loop(), name="control-recv"))
        return self.peers

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._sock is not None:
            self._sock.close(linger=CLOSE_LINGER_MS)
            self._sock = None
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signum)
        if self._sigint_before is not None:
            with contextlib.suppress(ValueError):  # (not the main thread)
                signal.signal(signal.SIGINT, self._sigint_before)
            self._sigint_before = None

    async def send(self, msg: Any) -> bool:
        """Send ``msg`` to the supervisor; False when detached (no supervisor to tell)."""
        if self._sock is None:
            return False
        await self._send(msg)
        return True

    async def _send(self, msg: Any) -> None:
        assert self._sock is not None
        await self._sock.send_multipart(codec.encode(msg), copy=False)

    async def _recv(self) -> Any:
        assert self._sock is not None
        frames = await self._sock.recv_multipart(copy=False)
        try:
            return codec.decode(frames)
        except Exception as exc:  # malformed control message: log, keep serving
            log.warning("%s: bad control message: %s", self.name, exc)
            return None

    async def _heartbeat_loop(self) -> None:
        while True:
            if os.getppid() != self._parent_pid:
                log.error("%s: supervisor is gone; exiting", self.name)
                self.drain.request("supervisor lost", 0.0)
                return
            self._seq += 1
            with contextlib.suppress(zmq.ZMQError):
                await self._send(Heartbeat(name=self.name, seq=self._seq, sent_at=time.monotonic()))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _receive_loop(self) -> None:
        while True:
            msg = await self._recv()
            if isinstance(msg, Shutdown):
                self.drain.request(msg.reason, msg.drain_s)
            elif isinstance(msg, StatsRequest):
                stats = self._stats(msg.reset) if self._stats is not None else {}
                stats.setdefault("gc", gc_stats(msg.reset))
                if self._ctx is not None:
                    count_auth_failed(self._ctx, stats.setdefault("counters", {}), msg.reset)
                await self._send(StatsReply(name=self.name, stats=stats))
            elif isinstance(msg, Ready):
                self.peers = dict(msg.endpoints)
            elif msg is not None and self._on_message is not None:
                self._on_message(msg)
