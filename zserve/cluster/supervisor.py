"""The supervisor: start a cluster from cluster.toml, keep it running, drain it on request.

Python API (tests and the load generator start clusters in-process)::

    with Cluster("examples/clusters/demo.toml", ipc_base=tmp_path) as cluster:
        client = zserve.Client(cluster.client_address)
        ...
        cluster.kill("backend-1")          # SIGKILL a child; the supervisor restarts it
        cluster.wait_ready("backend-1", incarnation=2)
        cluster.stats("frontend-0")        # the child's counters (StatsRequest over control)
    # leaving the block drains: frontends stop admitting and finish in flight, then the rest

Command line (``zserve.cluster.cli``)::

    zserve up CLUSTER.toml [--detach] [--state-dir DIR]   # prints every frontend's addresses
    zserve down [NAME] [--state-dir DIR]                   # drains a detached cluster

Start-up: ``zserve.cluster.preflight`` first checks what the file names (model and profile files,
built-in names, bind addresses) and raises ``PreflightError`` listing every problem; nothing is
spawned then. Every role is spawned (multiprocessing ``spawn``) at once with its role config (see
``zserve.config.cluster``); the supervisor polls its ``control`` ROUTER and every child's process
sentinel in one ``zmq.Poller``, so a child that dies during start-up fails the start at once,
with the child's traceback. When every child has sent ``Ready``, each gets the peer map (rank
first, then shards, backends, frontends), and the start completes once every frontend reports
all backends registered (so the first request finds a serving cluster).

Running: a child that exits is restarted with exponential backoff, pinned to its previous
addresses (peers never need new addresses); one that stops heartbeating for
``HEARTBEAT_TIMEOUT_S`` is killed and restarted. The supervisor owns the model repository
(``zserve.cluster.repository``; an index or load reads the folder again, and a model added there
is sent to every frontend and scheduler, ``ModelAdded``) and, with ``[orchestration]``, hosts the
orchestrator (``zserve.cluster.orchestrator_host``), stepped on every turn of its loop.

Autoscaling (``[autoscale] enabled`` and ``act``): ``zserve.cluster.autoscaler`` adds backends and
releases them (drained first; a released one is not restarted) on the frontends' advice.

Drain (SIGINT/SIGTERM, ``zserve down``, ``Cluster.stop``): frontends get ``Shutdown(drain_s)``
(stop admitting, finish in flight for up to drain_s, answer the rest ``SHUTTING_DOWN``); once
they have exited, the scheduler processes and backends get ``Shutdown``; stragglers get SIGTERM,
then SIGKILL. A child still starting (no ``Ready`` yet: nothing to drain) gets SIGKILL at once.
Then the ipc folder and state files are removed. A second signal skips the grace.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.process
import os
import queue
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import zmq

from zserve.cluster import model_catalog
from zserve.cluster.autoscaler import BackendAutoscaler
from zserve.cluster.child import SupervisedChild, child_main
from zserve.cluster.orchestrator_host import ORCHESTRATOR_CALLER, OrchestratorHost
from zserve.cluster.preflight import bound_addresses, preflight
from zserve.cluster.repository import MOVE, Call, Effects, ModelRepository
from zserve.config.cluster import STANDBY_NAME, ClusterConfig, load_config, role_config
from zserve.core.errors import ErrorKind, ProtocolError
from zserve.runtime import peer_map
from zserve.runtime.keys import release_role_context, secure_role_context
from zserve.transport import codec
from zserve.transport.idle_poll import IdlePollers
from zserve.transport.messages import (
    BackendGone,
    Heartbeat,
    ModelAdded,
    ModelReport,
    ModelUsage,
    Ready,
    RepositoryReply,
    RepositoryRequest,
    Shutdown,
    StatsReply,
    StatsRequest,
)
from zserve.transport.sockets import make_router

log = logging.getLogger(__name__)
T = TypeVar("T")

HEARTBEAT_TIMEOUT_S = 10.0
RESTART_BACKOFF_S = 0.2
RESTART_BACKOFF_MAX_S = 5.0
# A child that stayed up this long has its backoff reset.
RESTART_HEALTHY_S = 30.0
# After Shutdown: how much longer than drain_s a child may take before SIGTERM, then SIGKILL.
EXIT_GRACE_S = 3.0
KILL_GRACE_S = 2.0
BACKEND_DRAIN_S = 1.0
POLL_MAX_MS = 100
# Cluster API calls run on the supervisor's thread; it answers within one poll.
COMMAND_TIMEOUT_S = 30.0
# A repository call made in this process (``Cluster.move_model``): the caller's name in its
# ``Call``, and how long the caller waits (as a frontend's forwarded call, REPOSITORY_TIMEOUT_S).
LOCAL_CALLER = "supervisor"
REPOSITORY_CALL_TIMEOUT_S = 300.0
ERROR_TAIL_CHARS = 4000
# A role's exit code for what the operator must fix (an address it cannot bind, a key file it
# refuses): its error file holds one line, not a traceback (zserve.runtime.runner.run_role).
REFUSED_EXIT_CODE = 2


# A frontend's addresses that users reach (its ``data`` socket is the backends'), in the order
# `zserve up` and `zserve status` print them; ``metrics`` is the Prometheus endpoint's URL.
USER_ENDPOINTS = ("client", "http", "grpc", "metrics")


class StartupError(RuntimeError):
    """The cluster could not start: a child died or a step timed out (the message says which)."""


class Supervisor:
    """Owns the children and the control socket. ``start`` then ``serve`` (blocking, in the
    thread that owns the sockets); other threads talk to it through ``call``."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        ipc_base: str | os.PathLike[str] | None = None,
        restart: bool = True,
    ) -> None:
        self.config = config
        self.restart = restart
        base = ipc_base if ipc_base is not None else config.ipc_dir
        # Every checkable problem of the file, before a folder is made or a process spawned.
        preflight(config, ipc_base=None if base is None else os.fspath(base),
                  ipc_base_key="cluster.ipc_dir" if ipc_base is None else "ipc_base")
        self.run_dir = tempfile.mkdtemp(prefix="zs-", dir=base)
        ipc_dir = self.run_dir if config.transport == "ipc" else None
        self.ctx: zmq.Context[Any] = zmq.Context()
        secure_role_context(self.ctx, config, "supervisor")
        control_bind = (
            f"ipc://{self.run_dir}/control" if ipc_dir else f"tcp://{config.host}:0"
        )
        self.control, self.control_address = make_router(
            self.ctx, control_bind, name="supervisor control"
        )
        self.children: dict[str, SupervisedChild] = {}
        for role, name, index in config.process_names():
            self.children[name] = SupervisedChild(
                role, name, index, role_config(config, role, index, ipc_dir=ipc_dir, name=name)
            )
        self._mp = multiprocessing.get_context("spawn")
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._cond = threading.Condition()
        self._stop_requested = False
        self._stop_drain_s: float | None = None
        self.peers: dict[str, str] = {}
        self.started = False
        # Called (on the serving thread) when a restarted child is ready: `zserve up` rewrites
        # its state file then, so `zserve status` shows current pids and restart counts.
        self.on_child_ready: Callable[[], None] | None = None
        self.closed = False
        # What the frontends last said of the schedulers: {"active": name, "epoch": int}.
        self.scheduler_view: dict[str, Any] = {}
        self.idle_pollers: IdlePollers | None = None
        # Control messages refused: undecodable, or from a process that is not a child.
        self.counters = {"malformed": 0, "unknown_peer": 0}
        # The model repository: where each model is loaded, the repository calls under way.
        self.repository = ModelRepository(
            {m.name: m.to_dict() for m in config.models},
            {c.name: self._serves(c) for c in self.children.values() if c.role == "backend"})
        # The orchestrator (``[orchestration]``): on-demand loads, idle unloads, re-plans.
        self.orchestrator = self._orchestrator()
        # Repository calls made in this process (``repository_call``): request id -> its reply.
        self._local_replies: dict[int, Future[RepositoryReply]] = {}
        self._local_calls = 0
        self.autoscaler = self._autoscaler(ipc_dir)

    def _orchestrator(self) -> OrchestratorHost | None:
        """The orchestrator (``[orchestration]``): on-demand loads, idle unloads, re-plans."""
        if self.config.orchestration is None:
            return None
        backends = [c for c in self.children.values() if c.role == "backend"]
        return OrchestratorHost(self.config.orchestration, self.repository,
                                [c.name for c in backends], self.config.models,
                                time.monotonic(), kinds={c.name: c.config.kind for c in backends})

    def _autoscaler(self, ipc_dir: str | None) -> BackendAutoscaler | None:
        """Starts and releases backends on the frontends' advice ([autoscale] enabled and act);
        `zserve up` rewrites its state file when a released one is gone."""
        if not (self.config.autoscale.enabled and self.config.autoscale.act):
            return None
        return BackendAutoscaler(
            self.config, self.children, spawn=self._spawn, send=self._send,
            stats=self.child_stats, ipc_dir=ipc_dir,
            on_released=lambda: self.on_child_ready and self.on_child_ready(),
            on_added=self._backend_added, on_gone=self._backend_released)

    def _backend_added(self, child: SupervisedChild) -> None:
        """An added backend joins a sub-cluster of the orchestrator (its kind's) and loads
        that sub-cluster's models at start."""
        if self.orchestrator is not None:
            serve = self.orchestrator.join(child.name, child.config.kind)
            if serve is not None:
                child.config.serve = tuple(serve)

    def _backend_released(self, name: str) -> None:
        if self.orchestrator is not None:
            self.orchestrator.leave(name)

    # ------------------------------------------------------------------ helpers

    @property
    def client_addresses(self) -> list[str]:
        return self.frontend_endpoints("client")

    def frontend_endpoints(self, socket: str) -> list[str]:
        """Where each frontend serves ``socket`` (``client``; ``http`` / ``grpc`` where its
        Open Inference Protocol servers are on; ``metrics``, a URL, where it serves Prometheus),
        in frontend order."""
        return [
            c.endpoints[socket]
            for c in self.children.values()
            if c.role == "frontend" and socket in c.endpoints
        ]

    def user_endpoints(self) -> dict[str, dict[str, str]]:
        """Each frontend's ``USER_ENDPOINTS`` as bound (the kernel's port where the file said
        0), those it serves: ``{"frontend-0": {"client": ..., "http": ..., "metrics": ...}}``."""
        return {
            c.name: {socket: c.endpoints[socket] for socket in USER_ENDPOINTS
                     if socket in c.endpoints}
            for c in self.children.values() if c.role == "frontend"
        }

    def _error_file(self, child: SupervisedChild) -> str:
        return os.path.join(self.run_dir, f"{child.name}.err")

    def _spawn(self, child: SupervisedChild) -> None:
        error_file = self._error_file(child)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(error_file)
        process = self._mp.Process(
            target=child_main,
            args=(child.role, child.config, self.control_address, error_file),
            name=f"zserve-{child.name}",
            daemon=False,
        )
        spawning_at = time.monotonic()
        process.start()
        child.process = process
        child.ready = False
        child.started_at = time.monotonic()
        child.last_heartbeat = child.started_at
        child.restart_at = None
        if child.died_at is not None:
            child.restart_history.append((child.died_at, spawning_at))
            child.died_at = None
            with self._cond:
                self._cond.notify_all()
        log.debug("started %s (pid %s)", child.name, process.pid)

    def _death_message(self, child: SupervisedChild) -> str:
        code = child.process.exitcode if child.process is not None else None
        reason = f"exit code {code}"
        if code is not None and code < 0:
            reason = f"killed by {signal.Signals(-code).name}"
        text = ""
        with contextlib.suppress(OSError):
            text = Path(self._error_file(child)).read_text()[-ERROR_TAIL_CHARS:]
        if code == REFUSED_EXIT_CODE and text.strip() and "\n" not in text.strip():
            # One line (no traceback), with the key of the address it names, if it names one.
            key = self._key_named_in(child, text)
            return f"{child.name} ({child.role}) died: {reason}: " + (
                f"{key}: " if key else "") + text.strip()
        return f"{child.name} ({child.role}) died: {reason}" + (f"\n{text}" if text else "")

    def _key_named_in(self, child: SupervisedChild, text: str) -> str | None:
        """The cluster.toml key of the address of ``child``'s that ``text`` names (the
        longest, so that port 80 is not found in port 8000), or None."""
        own = set(child.config.bind.values())
        metrics = self.config.frontends.metrics_addresses
        if child.role == "frontend" and child.index < len(metrics):
            own.add(metrics[child.index])
        named = [(len(address), key) for key, address in bound_addresses(self.config)
                 if address in own and re.search(re.escape(address) + r"(?!\d)", text)]
        return max(named)[1] if named else None

    def _send(self, child: SupervisedChild, msg: Any) -> None:
        frames: list[Any] = codec.encode(msg)
        frames.insert(0, child.name.encode())
        try:
            self.control.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.warning("cannot send %s to %s: %s", type(msg).__name__, child.name, exc)

    def _poll(self, timeout_ms: int) -> None:
        """Wait for control messages, child deaths or commands; handle what arrived."""
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        for child in self.children.values():
            if child.alive:
                assert child.process is not None
                poller.register(child.process.sentinel, zmq.POLLIN)
        poller.poll(timeout_ms)
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        while True:
            try:
                frames = self.control.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._on_control(frames)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command()

    def _on_control(self, frames: list[Any]) -> None:
        if len(frames) < 2:  # a ROUTER always delivers an identity and a header
            self.counters["malformed"] += 1
            return
        name = frames[0].bytes.decode(errors="replace")
        child = self.children.get(name)
        try:
            msg = codec.decode(frames[1:])
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            log.warning("malformed control message from %r: %s", name, exc)
            return
        if child is None:
            self.counters["unknown_peer"] += 1
            log.warning("control message from unknown process %r", name)
            return
        child.last_heartbeat = time.monotonic()
        if type(msg) is Ready:
            child.endpoints = dict(msg.endpoints)
            child.ready = True
            child.incarnation += 1
            # Pin restarts to these addresses (tcp port 0 becomes the real port).
            child.config.bind = dict(msg.endpoints)
            log.info("%s ready (pid %d): %s", name, msg.pid, msg.endpoints)
            if self.started:  # a restart: it gets the same peer map as before
                self._send(child, self._peer_ready())
                if child.role == "backend":
                    self._apply(self.repository.on_backend_started(child.name,
                                                                   self._serves(child)))
                if self.on_child_ready is not None:
                    self.on_child_ready()
            with self._cond:
                self._cond.notify_all()
        elif type(msg) is StatsReply:
            if child.stats_waiters:
                waiter = child.stats_waiters.pop(0)
                if not waiter.done():
                    waiter.set_result(msg.stats)
        elif type(msg) is Heartbeat:
            pass
        else:
            self._on_repository(child, msg)

    def _serves(self, backend: SupervisedChild) -> list[str]:
        """The models ``backend`` loads when it starts."""
        serve = backend.config.serve
        return [m.name for m in self.config.models] if serve is None else list(serve)

    def _on_repository(self, child: SupervisedChild, msg: Any) -> None:
        """A frontend's forwarded repository call, or a backend's report of a model."""
        if type(msg) is RepositoryRequest and child.role == "frontend":
            self._apply(self._repository_call(Call(child.name, msg.request_id), msg.action,
                                              msg.model))
        elif type(msg) is ModelUsage and child.role == "frontend":
            if self.orchestrator is not None:
                self.orchestrator.on_usage(time.monotonic(), msg)
        elif type(msg) is ModelReport and child.role == "backend":
            log.info("%s: model %s is %s %s", child.name, msg.model, msg.state, msg.message)
            self._apply(self.repository.on_report(child.name, msg.model, msg.state,
                                                  msg.message))
            # A restart of it loads what it serves now.
            child.config.serve = tuple(self.repository.served_by(child.name))

    def _repository_call(self, call: Call, action: str, model: str) -> Effects:
        """A repository call; an index or a load reads the repository folder again first (a
        model folder added since start joins the cluster: ``_add_models``)."""
        if action in ("index", "load"):
            added, problem = model_catalog.rescan(self.config)
            if problem is not None:
                log.warning("repository folder: %s", problem)
                if action == "load" and model not in self.repository.models:
                    effects = Effects()
                    effects.answer(call, ErrorKind.BAD_REQUEST, problem)
                    return effects
            if added:
                self._add_models(added)
        return self.repository.call(call, action, model)

    def _add_models(self, added: list[Any]) -> None:
        """Models found in the repository folder after start: every role's config lists them
        (a role restarted later starts with them), the frontends and schedulers learn them
        (``ModelAdded``), the repository and the orchestrator know them, loaded nowhere."""
        self.config = model_catalog.with_models(self.config, added)
        for child in self.children.values():
            child.config.cluster = self.config
            child.config.models = model_catalog.role_models(self.config, child.role,
                                                            child.index)
        for model in added:
            log.info("repository: model %s added", model.name)
            self.repository.add_model(model.name, model.to_dict())
            if self.orchestrator is not None:
                self.orchestrator.add_model(model)
            notice = ModelAdded(model.to_dict())
            for child in self.children.values():
                if child.role in ("frontend", "shard") and child.ready and child.alive:
                    self._send(child, notice)

    def _apply(self, effects: Effects) -> None:
        """Send the repository's commands to the backends, its answers to the frontends (or
        to the caller in this process, ``repository_call``) and its notices to every
        frontend."""
        for name, msg in [*effects.commands, *effects.answers]:
            if name == LOCAL_CALLER and type(msg) is RepositoryReply:
                local = self._local_replies.pop(msg.request_id, None)
                if local is not None:
                    local.set_result(msg)
                continue
            if name == ORCHESTRATOR_CALLER and type(msg) is RepositoryReply:
                if self.orchestrator is not None:
                    self.orchestrator.on_answer(msg)
                continue
            target = self.children.get(name)
            if target is not None and target.ready and target.alive:
                self._send(target, msg)
        for notice in effects.notices:
            for child in self.children.values():
                if child.role == "frontend" and child.ready and child.alive:
                    self._send(child, notice)

    def _peer_ready(self) -> Ready:
        return Ready(role="supervisor", name="supervisor", pid=os.getpid(), endpoints=self.peers)

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Spawn everything, run the handshake; raise StartupError on any failure."""
        deadline = time.monotonic() + self.config.start_timeout_s
        try:
            if self.config.idle_poll:
                self.idle_pollers = IdlePollers().start()
            for child in self.children.values():
                self._spawn(child)
            while not all(c.ready for c in self.children.values()):
                self._check_startup(deadline, "Ready")
                self._poll(POLL_MAX_MS)
            self.peers = {
                peer_map.peer_key(c.name, sock): address
                for c in self.children.values()
                for sock, address in c.endpoints.items()
            }
            for child in self.children.values():  # dependency order: rank, shards, ...
                self._send(child, self._peer_ready())
            self.started = True
            self._wait_serving(deadline)
        except BaseException:
            self.shutdown(drain_s=0.0)
            raise

    def _check_startup(self, deadline: float, waiting_for: str) -> None:
        for child in self.children.values():
            if child.process is not None and child.process.exitcode is not None:
                raise StartupError(self._death_message(child))
        if time.monotonic() > deadline or self._stop_requested:
            missing = [c.name for c in self.children.values() if not c.ready]
            why = "stopped" if self._stop_requested else "timed out"
            raise StartupError(f"start-up {why} waiting for {waiting_for} from {missing}")

    def _wait_serving(self, deadline: float) -> None:
        """Until every frontend has heard of every backend (asks each frontend for its stats
        whenever the previous answer has come back)."""
        expected = self.config.backends.total
        frontends = [c for c in self.children.values() if c.role == "frontend"]
        waiting: dict[str, Future[dict[str, Any]]] = {}
        serving: set[str] = set()
        while len(serving) < len(frontends):
            self._check_startup(deadline, "frontends to see every backend")
            for child in frontends:
                if child.name in serving:
                    continue
                future = waiting.get(child.name)
                if future is None:
                    future = Future()
                    child.stats_waiters.append(future)
                    waiting[child.name] = future
                    self._send(child, StatsRequest(reset=False))
                elif future.done():
                    del waiting[child.name]
                    self.scheduler_view = dict(future.result().get("scheduler") or {})
                    if len(future.result().get("backends", [])) >= expected:
                        serving.add(child.name)
                    else:
                        continue
            self._poll(POLL_MAX_MS if waiting else 0)

    # ------------------------------------------------------------------ run

    def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Supervise until ``request_stop``; then drain and clean up."""
        try:
            if on_ready is not None:
                on_ready()
            while not self._stop_requested:
                now = time.monotonic()
                for child in list(self.children.values()):
                    self._supervise(child, now)
                if self.autoscaler is not None:
                    self.autoscaler.tick(now)
                if self.orchestrator is not None:
                    self._apply(self.orchestrator.step(now))
                self._poll(self._poll_timeout_ms())
        finally:  # also on a bug above: never leave children behind
            self.shutdown(self._stop_drain_s)

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        timeout = POLL_MAX_MS / 1e3
        for child in self.children.values():
            if child.restart_at is not None:
                timeout = min(timeout, max(0.0, child.restart_at - now))
        if self.orchestrator is not None:
            timeout = min(timeout, max(0.0, self.orchestrator.wake_at() - now))
        return int(timeout * 1e3)

    def _supervise(self, child: SupervisedChild, now: float) -> None:
        if child.process is not None and child.process.exitcode is not None:
            if child.restart_at is None:
                message = self._death_message(child)
                child.process.join()
                if child.role == "backend":
                    self._announce_backend_death(child)
                if child.retiring:  # released by the autoscaler, which forgets it now
                    log.info("%s (released) exited", child.name)
                    child.process = None
                    return
                if not self.restart:
                    log.error("%s; not restarting", message)
                    child.process = None
                    return
                healthy = now - child.started_at > RESTART_HEALTHY_S
                child.restarts = 0 if healthy else child.restarts + 1
                backoff = RESTART_BACKOFF_S * 2 ** max(0, child.restarts - 1)
                delay = min(RESTART_BACKOFF_MAX_S, backoff)
                child.restart_at = now + delay
                child.died_at = now
                child.ready = False
                log.error("%s; restarting in %.2f s", message, delay)
            if now >= child.restart_at:
                if child.role == "shard" and self.config.scheduler.standby:
                    # The other one of the pair has taken over (or will): this one comes back
                    # as its standby (docs/runtime.md, "Hot spare").
                    child.config.standby = True
                    log.warning("%s restarts as the standby scheduler", child.name)
                self._spawn(child)
        elif child.ready and child.alive and now - child.last_heartbeat > HEARTBEAT_TIMEOUT_S:
            log.error("%s sent no heartbeat for %.1f s; killing it", child.name,
                      now - child.last_heartbeat)
            assert child.process is not None
            child.process.kill()

    def _announce_backend_death(self, backend: SupervisedChild) -> None:
        """Tell every frontend and the rank at once, so that the backend's requests are answered
        BACKEND_FAILED now rather than at their deadlines: the frontends fail those it had
        fetched, and the rank removes it from the table, whereupon the shards fail those they had
        planned onto it (fetched or not)."""
        self._apply(self.repository.on_backend_gone(backend.name))
        notice = BackendGone(name=backend.name)
        # Both of an active/standby pair: only the active one has the backend registered.
        rank_hosts = {"rank"} if self.config.scheduler.shards > 0 else {"shard-0", STANDBY_NAME}
        for child in self.children.values():
            told = child.role == "frontend" or child.name in rank_hosts
            if told and child.ready and child.alive:
                self._send(child, notice)

    def call(self, command: Callable[[], T]) -> T:
        """Run ``command`` on the supervisor's thread and return its result."""
        result: Future[T] = Future()

        def run() -> None:
            try:
                result.set_result(command())
            except BaseException as exc:
                result.set_exception(exc)

        if self.closed:
            raise RuntimeError("the supervisor has stopped")
        self._commands.put(run)
        self.wake()
        return result.result(timeout=COMMAND_TIMEOUT_S)

    def repository_call(self, action: str, model: str,
                        to: tuple[str, ...] = ()) -> Future[RepositoryReply]:
        """A repository call made in this process (``index``, ``load``, ``unload``, or ``move``
        of ``model`` to the backends ``to``); the future holds its ``RepositoryReply``."""
        reply: Future[RepositoryReply] = Future()

        def start() -> None:
            self._local_calls += 1
            call = Call(LOCAL_CALLER, self._local_calls)
            self._local_replies[call.request_id] = reply
            self._apply(self.repository.move(call, model, to) if action == MOVE
                        else self._repository_call(call, action, model))

        self.call(start)
        return reply

    def wake(self) -> None:
        if self.closed:  # the pipe is closed: its fd number may belong to someone else now
            return
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def request_stop(self, drain_s: float | None = None) -> None:
        """Thread- and signal-safe: ask ``serve`` to drain and return (twice: no grace)."""
        if self._stop_requested:
            self._stop_drain_s = 0.0
        else:
            self._stop_requested = True
            self._stop_drain_s = drain_s
        self.wake()

    # ------------------------------------------------------------------ drain

    def shutdown(self, drain_s: float | None = None) -> None:
        """Drain frontends, then everything else; reap every child; remove the run folder."""
        if self.closed:
            return
        self._stop_requested = True
        drain = self.config.drain_s if drain_s is None else drain_s
        tiers = [
            [c for c in self.children.values() if c.role == "frontend"],
            [c for c in self.children.values() if c.role != "frontend"],
        ]
        for tier_index, tier in enumerate(tiers):
            tier_drain = drain if tier_index == 0 else min(drain, BACKEND_DRAIN_S)
            self._stop_tier(tier, tier_drain)
        self.closed = True
        if self.idle_pollers is not None:
            self.idle_pollers.stop()
        self.control.close(linger=0)
        release_role_context(self.ctx)
        self.ctx.destroy(linger=0)  # also closes any socket a caller opened on it
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        with self._cond:
            self._cond.notify_all()

    def _stop_tier(self, tier: list[SupervisedChild], drain_s: float) -> None:
        for child in tier:
            child.stopping = True
            child.restart_at = None
            if child.alive:
                if child.ready:
                    self._send(child, Shutdown(reason="cluster shutdown", drain_s=drain_s))
                else:
                    # Not ready: nothing to drain, and a SIGTERM would wait for a model load
                    # to return and then for a peer map that never comes (5 s, then SIGKILL).
                    log.info("%s was still starting; SIGKILL", child.name)
                    assert child.process is not None
                    child.process.kill()
        end = time.monotonic() + drain_s + EXIT_GRACE_S
        self._wait_exit(tier, end)
        for child in tier:
            if child.alive:
                log.warning("%s did not exit after Shutdown; SIGTERM", child.name)
                assert child.process is not None
                child.process.terminate()
        self._wait_exit(tier, time.monotonic() + KILL_GRACE_S)
        for child in tier:
            if child.alive:
                log.warning("%s did not exit after SIGTERM; SIGKILL", child.name)
                assert child.process is not None
                child.process.kill()
        for child in tier:
            if child.process is not None:
                child.process.join()
                child.process.close()
                child.process = None

    def _wait_exit(self, tier: list[SupervisedChild], end: float) -> None:
        while any(c.alive for c in tier) and time.monotonic() < end:
            remaining_ms = max(1, int((end - time.monotonic()) * 1e3))
            self._poll(min(POLL_MAX_MS, remaining_ms))

    # ------------------------------------------------------------------ API helpers

    def child_stats(self, name: str) -> Future[dict[str, Any]]:
        child = self.children[name]
        future: Future[dict[str, Any]] = Future()
        if not child.ready:
            future.set_exception(RuntimeError(f"{name} is not ready"))
            return future
        child.stats_waiters.append(future)
        self._send(child, StatsRequest(reset=False))
        return future

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)


class Cluster:
    """A cluster started in-process: ``with Cluster(config) as cluster: cluster.client_address``.
    The supervisor runs on a background thread; leaving the block drains and reaps everything."""

    def __init__(
        self,
        config: ClusterConfig | str | os.PathLike[str],
        *,
        ipc_base: str | os.PathLike[str] | None = None,
        restart: bool = True,
        drain_s: float | None = None,
    ) -> None:
        self.config = config if isinstance(config, ClusterConfig) else load_config(config)
        self._ipc_base = ipc_base
        self._restart = restart
        self._drain_s = drain_s
        self.supervisor: Supervisor | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> Cluster:
        def run() -> None:
            try:
                supervisor = Supervisor(
                    self.config, ipc_base=self._ipc_base, restart=self._restart
                )
                self.supervisor = supervisor
                supervisor.start()
            except BaseException as exc:
                self._error = exc
                self._started.set()
                return
            supervisor.serve(on_ready=self._started.set)

        self._thread = threading.Thread(target=run, name="zserve-supervisor", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def stop(self, drain_s: float | None = None) -> None:
        """Drain and reap everything (idempotent)."""
        if self._thread is None or self.supervisor is None:
            return
        self.supervisor.request_stop(self._drain_s if drain_s is None else drain_s)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def _sup(self) -> Supervisor:
        assert self.supervisor is not None, "cluster not started"
        return self.supervisor

    @property
    def client_address(self) -> str:
        return self._sup.client_addresses[0]

    @property
    def client_addresses(self) -> list[str]:
        return self._sup.client_addresses

    @property
    def http_addresses(self) -> list[str]:
        """Each frontend's OIP HTTP/REST ``host:port`` (those configured to serve it)."""
        return self._sup.frontend_endpoints("http")

    @property
    def grpc_addresses(self) -> list[str]:
        """Each frontend's OIP gRPC ``host:port`` (those configured to serve it)."""
        return self._sup.frontend_endpoints("grpc")

    def endpoints(self) -> dict[str, dict[str, str]]:
        """Each frontend's addresses that users reach, as bound (``Supervisor.user_endpoints``)."""
        return self._sup.call(self._sup.user_endpoints)

    @property
    def run_dir(self) -> str:
        return self._sup.run_dir

    def peers(self) -> dict[str, str]:
        """The peer map: ``"<process>/<socket>"`` -> address (docs/runtime.md)."""
        return self._sup.call(lambda: dict(self._sup.peers))

    def pids(self) -> dict[str, int | None]:
        return self._sup.call(lambda: {n: c.pid for n, c in self._sup.children.items()})

    def incarnation(self, name: str) -> int:
        """How many times ``name`` has become ready (1 after start, 2 after one restart)."""
        return self._sup.call(lambda: self._sup.children[name].incarnation)

    def supervisor_counters(self) -> dict[str, int]:
        """The supervisor's own counters: control messages refused (``malformed``,
        ``unknown_peer``)."""
        return self._sup.call(lambda: dict(self._sup.counters))

    def autoscale_events(self) -> list[tuple[float, str, str]]:
        """What the autoscaler did: (monotonic s, ``add``/``retire``/``exit``, backend name)."""
        scaler = self._sup.autoscaler
        return [] if scaler is None else self._sup.call(lambda: list(scaler.events))

    def release_backend(self, name: str) -> None:
        """Release backend ``name`` as the autoscaler does (``BackendAutoscaler.release``: no
        new grants, drained, stopped, not restarted). Needs ``[autoscale]`` enabled and acting;
        ValueError otherwise or for a name that is not a serving backend."""
        scaler = self._sup.autoscaler
        if scaler is None:
            raise ValueError("releasing a backend needs [autoscale] enabled = true and act = true")
        self._sup.call(lambda: scaler.release(time.monotonic(), name))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one child; returns its pid."""
        pid = self.pids()[name]
        assert pid is not None, f"{name} is not running"
        os.kill(pid, sig)
        return pid

    def restart_history(self, name: str) -> list[tuple[float, float]]:
        """(death noticed, respawned) of each restart of ``name`` (monotonic s)."""
        return self._sup.call(lambda: list(self._sup.children[name].restart_history))

    def wait_restarts(self, name: str, count: int, timeout: float = 30.0) -> None:
        """Block until ``name`` has been respawned ``count`` times."""
        child = self._sup.children[name]
        if not self._sup.wait_for(lambda: len(child.restart_history) >= count, timeout):
            raise TimeoutError(f"{name} was not restarted {count} times within {timeout} s")

    def wait_ready(self, name: str, incarnation: int, timeout: float = 30.0) -> None:
        """Block until ``name`` has become ready ``incarnation`` times (and has its peers)."""
        child = self._sup.children[name]
        if not self._sup.wait_for(lambda: child.incarnation >= incarnation, timeout):
            raise TimeoutError(f"{name} did not become ready (incarnation {incarnation})")

    def move_model(self, model: str, to: list[str] | tuple[str, ...],
                   timeout: float = REPOSITORY_CALL_TIMEOUT_S) -> None:
        """Move ``model`` onto the backends named ``to``, make-before-break
        (``ModelRepository.move``); returns once the old backends have freed it. A refused or
        failed move raises ``RuntimeError`` with the repository's one-line reason."""
        reply = self._sup.repository_call(MOVE, model, tuple(to)).result(timeout)
        if reply.error:
            raise RuntimeError(f"{reply.error}: {reply.message}")

    def stats(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        """A child's counters (its ``StatsReply``)."""
        future = self._sup.call(lambda: self._sup.child_stats(name))
        return future.result(timeout)
