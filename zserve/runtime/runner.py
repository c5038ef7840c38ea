"""What a role process's entry point runs around its main coroutine.

A role's entry point ``run_<role>(config, control_address)`` goes through four steps::

    def run_backend(config: dict[str, Any], control_address: str | None) -> int:
        return run_role(_main(config, control_address), name=config["name"])

    async def _main(config, control_address) -> int:
        ctx = zmq.Context()                            # plain sockets: transport.reactor
        control = await ControlLink.open(              # zserve.runtime.control_link; installs the
            ctx, control_address, role="backend",     # SIGTERM/SIGINT handlers
            name=config["name"], stats=my_stats)
        ...bind ROUTERs, load models...
        peers = await control.ready({"plan": plan_endpoint})   # Ready handshake -> peer map
        clock_sync = await sync_cluster_clock(                  # the rank's clock (not in rank)
            ctx, peers, name=config["name"], drain=control.drain, clock=my_clock)
        ...connect to peers (zserve.runtime.peer_map.endpoints_of(peers, "data") etc.), serve...
        await control.drain.wait()                     # SIGTERM, SIGINT or Shutdown
        ...stop admitting, finish in flight for up to control.drain.drain_s, answer the rest...
        await clock_sync.close() await control.close()
        return 0

- ``run_role(coro, name=...) -> int``: configure logging for a child process, install uvloop,
  watch garbage collection (``zserve.runtime.gc_watch``), pay numpy's first-call costs, and run
  ``coro`` to completion; returns its exit code (1 with the traceback logged on an exception; 2 with
  one line for a key file it refuses, ``zserve.runtime.keys.KeyFileError``, or an address it cannot
  bind, ``zserve.transport.sockets.BindError``).
- ``await sync_cluster_clock(ctx, peers, name=..., drain=link.drain, clock=clock)``: the
  ``ClockSync`` that keeps ``clock`` (a ``zserve.runtime.clock.ClusterClock``) on the rank's clock,
  started once its first estimate is in; a process that is not the rank calls it after
  ``ready`` and before it serves, and ``await sync.close()`` at exit.
- ``spawn(tasks, coro)`` / ``await cancel_all(tasks)``: a role's background tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Awaitable, Coroutine
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from zserve.runtime import gc_watch
from zserve.runtime.clock import ClockSync, ClusterClock
from zserve.runtime.control_link import DrainRequest
from zserve.runtime.keys import KeyFileError
from zserve.runtime.peer_map import rank_address
from zserve.transport.sockets import BindError

__all__ = (
    "ERROR_FILE_ENV",
    "LOG_FORMAT",
    "PROFILE_DIR_ENV",
    "cancel_all",
    "configure_logging",
    "install_uvloop",
    "run_role",
    "spawn",
    "sync_cluster_clock",
    "warm_statistics",
)

log = logging.getLogger(__name__)

ERROR_FILE_ENV = "ZSERVE_ERROR_FILE"
PROFILE_DIR_ENV = "ZSERVE_PROFILE_DIR"
LOG_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"


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
    configure_logging()
    install_uvloop()
    gc_watch.install()
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
                 json.dumps(gc_watch.gc_stats()))
        return code
    except (KeyFileError, BindError) as exc:  # the operator's to fix: one line, no traceback
        logging.getLogger(name or __name__).error("%s refuses to start: %s", name, exc)
        _write_error_file(f"{exc}\n")
        return 2
    except Exception:
        logging.getLogger(name or __name__).exception("role %s failed", name)
        _write_error_file(traceback.format_exc())
        return 1


def _write_error_file(text: str) -> None:
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        with contextlib.suppress(OSError), open(error_file, "w") as f:
            f.write(text)


def spawn(tasks: list[asyncio.Task[None]], coro: Awaitable[None]) -> None:
    tasks.append(asyncio.ensure_future(coro))


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    tasks.clear()
