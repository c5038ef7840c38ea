"""Process plumbing shared by every zserve role (frontend, scheduler shard, rank, backend).

A role's entry point ``run_<role>(config, control_address)`` uses this module in four steps::

    def run_backend(config: dict[str, Any], control_address: str | None) -> int:
        return procutil.run_role(_main(config, control_address), name=config["name"])

    async def _main(config, control_address) -> int:
        ctx = zmq.Context()                            # plain sockets: transport.reactor
        control = await procutil.ControlLink.open(
            ctx, control_address, role="backend", name=config["name"], stats=my_stats
        )                                              # also installs SIGTERM/SIGINT handlers
        ...bind ROUTERs, load models...
        peers = await control.ready({"plan": plan_endpoint})   # Ready handshake -> peer endpoints
        clock_sync = await procutil.sync_cluster_clock(         # the rank's clock (not in rank)
            ctx, peers, name=config["name"], drain=control.drain, clock=my_clock)
        ...connect to peers (procutil.endpoints_of(peers, "data") etc.), serve...
        await control.drain.wait()                     # SIGTERM, SIGINT or Shutdown
        ...stop admitting, finish in flight for up to control.drain.drain_s, answer the rest...
        await clock_sync.close()
        await control.close()
        return 0

API (kept small on purpose):

- ``run_role(coro, name=...) -> int``: configure logging for a child process, install uvloop and
  run ``coro`` to completion; returns its exit code (1 with the traceback logged on an exception).
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
  supervisor's ``Ready`` whose ``endpoints`` is the *peer map* (below); returns it. Starts the
  heartbeat task (``Heartbeat`` every ``HEARTBEAT_INTERVAL_S``) and the control receive task (it
  answers ``StatsRequest`` with ``stats(reset)`` and turns ``Shutdown`` into a drain request).
  Detached: returns the ``peers`` given to ``open`` at once.
- ``link.drain``: a ``DrainRequest``; ``await link.drain.wait()``; ``drain.requested``,
  ``drain.reason``, ``drain.drain_s`` (seconds of grace), ``drain.immediate`` (a second signal
  or a lost supervisor: skip the grace period); ``await drain.grace(idle_event)`` waits for
  in-flight work to finish, up to ``drain_s``, cut short by a second request.
- ``await link.close()``: stop the tasks and close the DEALER (bounded LINGER).
- ``endpoints_of(peers, socket) -> {process name: address}`` and ``peer_key(name, socket)``;
  ``rank_address(peers)``: where the rank listens (``rank/rank``, or ``shard-0/rank`` when the rank
  is embedded in the one scheduler process).
- ``await sync_cluster_clock(ctx, peers, name=..., drain=link.drain, clock=clock)``: the
  ``ClockSync`` that keeps ``clock`` (a ``zserve.clock.ClusterClock``) on the rank's clock, started
  once its first estimate is in; a process that is not the rank calls it after ``ready`` and
  before it serves, and ``await sync.close()`` at exit.
- ``cpu_seconds(pid)``, ``child_pids(parent)``: CPU accounting for benchmarks (Linux ``/proc``).
- ``warm_statistics()``: pay numpy's first-call cost of its quantile code at start-up (``run_role``
  calls it), not inside the first stats request of a loaded process.

The peer map: keys are ``"<process name>/<socket name>"`` (``"rank/rank"``, ``"shard-0/shard"``,
``"frontend-0/client"``, ``"frontend-0/data"``, ``"backend-1/plan"``), values are the addresses
from each process's own ``Ready``. The supervisor pins a restarted process to its previous
addresses, so peers never need updating after a restart.

Orphan safety: when started by a supervisor, a child whose parent process disappears (its parent
pid changes) requests an immediate drain, so a SIGKILLed supervisor leaves no processes behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from zserve.clock import ClockSync, ClusterClock
from zserve.transport import codec
from zserve.transport.messages import Heartbeat, Ready, Shutdown, StatsReply, StatsRequest
from zserve.transport.sockets import make_dealer

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_DRAIN_S = 5.0
CLOSE_LINGER_MS = 200
ERROR_FILE_ENV = "ZSERVE_ERROR_FILE"
PROFILE_DIR_ENV = "ZSERVE_PROFILE_DIR"
LOG_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"

StatsFn = Callable[[bool], dict[str, Any]]


# --------------------------------------------------------------------------- first-call costs


def warm_statistics() -> None:
    """Run numpy's quantile code once, at a role's start. The first ``np.median`` in a process
    costs ~10 ms here (lazy set-up inside numpy; later calls take microseconds), and a role's
    stats are the only place it runs: paid inside the first ``StatsRequest`` under load, it
    stalled the rank's, the shard's and the frontend's event loop at once, because ``zserve
    bench`` asks them for stats at the start of its measure window. On the emulated ResNet50
    cluster (SLO 25 ms) at 1,100 r/s that cost ~27 requests in every run, a quarter of the 1%
    bad-rate budget."""
    sample = np.arange(8.0)
    np.median(sample)
    np.percentile(sample, [1, 50, 90, 99])


# --------------------------------------------------------------------------- garbage collection
#
# A full collection in a role process walks its ~30,000 start-up objects and takes 13-17 ms here,
# longer than a ResNet50 batch; so every role's stats report its collections and their pauses
# ("gc": counts, total and longest pause per generation). Measured at 1,000 r/s on the emulated
# ResNet50 cluster: 5-6 generation-0 collections per process in 15 s (under 1.5 ms each) and no
# full collection -- steady-state serving frees what it allocates, so the collector stays out of
# the way and needs no tuning (gc.freeze was tried: no pause to remove).


class GcWatch:
    """Counts collections and their pause times per generation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self._started_at = 0.0
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.max_pause_s = [0.0, 0.0, 0.0]
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        generation = info.get("generation", 2)
        pause = time.perf_counter() - self._started_at
        self.collections[generation] += 1
        self.pause_s[generation] += pause
        self.max_pause_s[generation] = max(self.max_pause_s[generation], pause)

    def stats(self, reset: bool = False) -> dict[str, Any]:
        out = {
            "collections": list(self.collections),
            "pause_ms_total": [round(x * 1e3, 3) for x in self.pause_s],
            "pause_ms_max": [round(x * 1e3, 3) for x in self.max_pause_s],
        }
        if reset:
            self.collections = [0, 0, 0]
            self.pause_s = [0.0, 0.0, 0.0]
            self.max_pause_s = [0.0, 0.0, 0.0]
        return out

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)


_gc_watch: GcWatch | None = None


def gc_stats(reset: bool = False) -> dict[str, Any]:
    """This process's collection counts and pauses per generation (empty before ``run_role``)."""
    return _gc_watch.stats(reset) if _gc_watch is not None else {}


def peer_key(name: str, socket: str) -> str:
    """The peer-map key of one process's socket, e.g. ``peer_key("frontend-0", "data")``."""
    return f"{name}/{socket}"


def endpoints_of(peers: dict[str, str], socket: str) -> dict[str, str]:
    """``{process name: address}`` of every process in ``peers`` that serves ``socket``,
    sorted by process name (so ``shard-0`` comes before ``shard-1``)."""
    found: dict[str, str] = {}
    for key in sorted(peers):
        name, _, sock = key.rpartition("/")
        if sock == socket:
            found[name] = peers[key]
    return found


def rank_address(peers: dict[str, str]) -> str | None:
    """The rank's address in a peer map: ``rank/rank``, else the embedded rank's
    ``shard-0/rank`` (``shards = 0``)."""
    return peers.get(peer_key("rank", "rank")) or next(
        iter(endpoints_of(peers, "rank").values()), None
    )


async def sync_cluster_clock(
    ctx: zmq.asyncio.Context | zmq.Context[Any], peers: dict[str, str], *, name: str,
    drain: DrainRequest, clock: ClusterClock,
) -> ClockSync | None:
    """Estimate ``clock``'s offset to the cluster clock (the rank's) before the process serves,
    and keep it refreshed; None when the peer map names no rank (logged) or a drain came first.
    A sync ``ctx`` (processes on the SocketReactor) is shadowed with zmq.asyncio: the probes are
    a few messages every few seconds, no hot path."""
    if not isinstance(ctx, zmq.asyncio.Context):
        ctx = zmq.asyncio.Context.shadow(ctx.underlying)
    address = rank_address(peers)
    if address is None:
        log.error("%s: no rank address in the peer map %s", name, sorted(peers))
        return None
    sync = ClockSync(ctx, address, name=name, clock=clock)
    try:
        started = await sync.start(drain.event)
    except BaseException:  # its socket must be closed, or the context's term() would wait on it
        await sync.close()
        raise
    if not started:
        await sync.close()
        return None
    return sync


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far (Linux ``/proc``; None elsewhere or
    when the process is gone). Resolution: one clock tick (10 ms)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` (Linux ``/proc``; [] elsewhere)."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if len(fields) > 1 and int(fields[1]) == parent:
            found.append(int(entry))
    return found


def configure_logging(level: int | str | None = None) -> None:
    """Log to stderr with the pid in each line (children are spawned: no inherited config)."""
    chosen = level or os.environ.get("ZSERVE_LOG_LEVEL", "INFO")
    logging.basicConfig(level=chosen, format=LOG_FORMAT, stream=sys.stderr, force=True)


def install_uvloop() -> None:
    """Make uvloop the event loop of ``asyncio.run`` in this process (no-op if unavailable)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a hard dependency; keep running without
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_role(coro: Coroutine[Any, Any, int], *, name: str = "") -> int:
    """Run a role's main coroutine on uvloop; return its exit code (1 on an exception).
    The traceback is logged, and also written to ``$ZSERVE_ERROR_FILE`` when set (the
    supervisor sets it, to report why a child died during start-up). With
    ``$ZSERVE_PROFILE_DIR`` set, the process runs under cProfile and leaves ``<name>.prof``."""
    global _gc_watch
    configure_logging()
    install_uvloop()
    _gc_watch = GcWatch()
    warm_statistics()
    profile_dir = os.environ.get(PROFILE_DIR_ENV)
    try:
        if profile_dir:  # development aid: a cProfile dump per process
            import cProfile

            profiler = cProfile.Profile()
            try:
                return int(profiler.runcall(asyncio.run, coro) or 0)
            finally:
                profiler.dump_stats(os.path.join(profile_dir, f"{name or os.getpid()}.prof"))
        code = int(asyncio.run(coro) or 0)
        log.info("%s: garbage collection while running: %s", name or os.getpid(),
                 json.dumps(gc_stats()))
        return code
    except Exception:
        logging.getLogger(name or __name__).exception("role %s failed", name)
        error_file = os.environ.get(ERROR_FILE_ENV)
        if error_file:
            with contextlib.suppress(OSError), open(error_file, "w") as f:
                traceback.print_exc(file=f)
        return 1


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
        self.drain = DrainRequest()
        self.peers: dict[str, str] = {}
        self._stats = stats
        self._on_message: Callable[[Any], None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._parent_pid = os.getppid()
        self._seq = 0

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
            sock = make_dealer(actx, control_address, identity=name.encode())
        link = cls(sock, role=role, name=name, stats=stats)
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
            signal.signal(signal.SIGINT, signal.SIG_IGN)
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
                await self._send(StatsReply(name=self.name, stats=stats))
            elif isinstance(msg, Ready):
                self.peers = dict(msg.endpoints)
            elif msg is not None and self._on_message is not None:
                self._on_message(msg)


def spawn(tasks: list[asyncio.Task[None]], coro: Awaitable[None]) -> None:
    tasks.append(asyncio.ensure_future(coro))


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    tasks.clear()
