"""The watch link of an active/standby scheduler pair (``[scheduler] standby = true``).

Each of the two scheduler processes (``shard-0`` and ``zserve.config.cluster.STANDBY_NAME``, each
with its rank embedded) keeps a DEALER to the other's ``rank`` ROUTER and sends it a
``SchedulerPing(name, epoch, active)`` every ``zserve.core.epochs.PING_INTERVAL_S``; the other's
``RankHost`` answers each at once with its own, from its event loop, so an answer proves the loop
that dispatches is running (a hung or SIGSTOPped process stops answering even though its sockets
stay open). Each process judges its partner by the answers on the connection it made itself: a
restarted standby's fresh connection works at once, whereas the partner's own DEALER to it may
be in ZeroMQ's reconnect backoff (up to seconds) and its pings late. A crash is seen sooner:
the dead process's end of the connection closes, the DEALER's monitor reports it, and a standby
whose partner was active takes over at once. The decisions are the pure
``zserve.core.epochs.SchedulerWatch`` held by the process's ``RankHost``: a standby whose active
partner has been silent for ``takeover_timeout_ms`` takes over here (``RankHost.activate`` with
the next epoch); an active one that hears a newer epoch steps down (``RankHost.on_superseded``).

Everything runs on the process's event loop through its ``SocketReactor``, like every role's
sockets: the answers and the monitor's events are reactor callbacks, and the pings are a chain of
loop timers (``_tick``), each armed for the next ping or the takeover deadline, whichever is
sooner; a closed connection re-arms it at once. No task of its own, so nothing to cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

import zmq

from zserve.core.epochs import PING_INTERVAL_S, SchedulerWatch, now_ms
from zserve.scheduler.rank_host import RankHost
from zserve.scheduler.shard_host import ShardHost
from zserve.transport.messages import SchedulerPing
from zserve.transport.reactor import Chunk, SocketReactor
from zserve.transport.sockets import make_dealer

log = logging.getLogger(__name__)

# Long enough for the last ping ("leaving") to go out when a draining scheduler closes the link.
SOCKET_CLOSE_LINGER_MS = 200


class PairLink:
    """Pings the partner and takes over when the watch says so; ``close`` stops both."""

    def __init__(self, *, name: str, ctx: zmq.Context[Any], reactor: SocketReactor,
                 rank: RankHost, host: ShardHost, watch: SchedulerWatch,
                 expected_backends: set[str]) -> None:
        self.name = name
        self.ctx = ctx
        self.reactor = reactor
        self.rank = rank
        self.host = host
        self.watch = watch
        self.expected_backends = expected_backends
        self.sock: zmq.Socket[Any] | None = None
        self.monitor: zmq.Socket[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_tick: asyncio.Handle | None = None  # the armed _tick
        self._partner_gone = False  # the last takeover reason, for the log
        self._closed = False

    def start(self, partner_rank_address: str) -> None:
        self.sock = make_dealer(self.ctx, partner_rank_address,
                                identity=f"{self.name}.watch".encode(), peer_role="rank")
        self.reactor.watch(self.sock, router=False, on_chunk=self._on_answers,
                           on_bad=lambda exc: log.warning("%s: bad ping: %s", self.name, exc))
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.reactor.watch_frames(self.monitor, on_frames=self._on_monitor)
        self.watch.start(time.monotonic())
        self._loop = asyncio.get_running_loop()
        self._tick()

    def _tick(self) -> None:
        """Take over if the watch says so, ping the partner, and arm the next tick (the next
        ping or the takeover deadline, whichever is sooner). Superseded or closed: no more."""
        self._next_tick = None
        if self.watch.superseded or self._closed:
            return
        now = time.monotonic()
        try:
            joining = self.watch.joining
            epoch = self.watch.take_over(now, now_ms())
            if epoch is not None and joining:
                self._start_active(epoch)
            elif epoch is not None:
                self._take_over(now, epoch)
            assert self.sock is not None
            self.reactor.send_nowait(self.sock, SchedulerPing(self.name, self.watch.epoch,
                                                              self.watch.active))
        finally:  # a failed tick (logged by the loop) does not end the watch
            wait = min(PING_INTERVAL_S, self.watch.takeover_at - time.monotonic())
            assert self._loop is not None
            self._next_tick = self._loop.call_later(max(0.0, wait), self._tick)

    def _tick_now(self) -> None:
        if self._next_tick is not None and self._loop is not None:
            self._next_tick.cancel()
            self._next_tick = self._loop.call_soon(self._tick)

    def _on_answers(self, chunk: Chunk) -> None:
        now = time.monotonic()
        for _, msg in chunk:
            if isinstance(msg, SchedulerPing):
                self.rank.on_partner(now, msg)

    def _on_monitor(self, messages: list[list[zmq.Frame]]) -> None:
        """The partner's process closed the connection: it died."""
        self._partner_gone = self.watch.partner_active
        self.watch.on_partner_gone(time.monotonic())
        self._tick_now()  # a standby whose partner was active takes over at once

    def _start_active(self, epoch: int) -> None:
        """A primary starting: its partner answered as a standby (or never answered)."""
        log.info("%s: active of the scheduler pair in epoch %d (its partner %s)", self.name,
                 epoch, "is a standby" if self.watch.partner_seen_at > -math.inf
                 else "did not answer")
        self.host.active = True
        self.rank.activate(epoch, self.expected_backends, takeover=False)

    def _take_over(self, now: float, epoch: int) -> None:
        why = ("its connection closed" if self._partner_gone else
               f"it has been silent for {now - self.watch.partner_active_at:.2f} s")
        log.error("%s: the active scheduler is gone (%s): taking over in epoch %d", self.name,
                  why, epoch)
        self.host.active = True
        self.rank.activate(epoch, self.expected_backends)

    async def close(self, *, leaving: bool = False) -> None:
        """Stop pinging and watching. ``leaving``: this process drains (a cluster's shutdown):
        its last ping says it is no longer active, so its closing connection does not make the
        partner take over at once (a partner left running still does, after the timeout)."""
        if leaving and self.sock is not None:
            self.reactor.send_nowait(self.sock, SchedulerPing(self.name, self.watch.epoch, False))
        self._closed = True
        if self._next_tick is not None:
            self._next_tick.cancel()
            self._next_tick = None
        if self.sock is not None:
            self.reactor.unwatch(self.sock)
        if self.monitor is not None:
            self.reactor.unwatch(self.monitor)
            assert self.sock is not None
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        if self.sock is not None:
            self.sock.close(linger=SOCKET_CLOSE_LINGER_MS)
            self.sock = None
