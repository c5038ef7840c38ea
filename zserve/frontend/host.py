"""The frontend process: the host of a ``FrontendCore`` on sockets, and the clients' entry point.

Sockets (docs/runtime.md): a ``client`` ROUTER (clients' DEALERs connect), a ``data`` ROUTER
(backends connect to fetch inputs and push outputs), a DEALER to every scheduler shard (request
metadata out, ``DropNotice`` in), a DEALER to rank (``BackendTable`` in; heartbeats out) and
the control DEALER. With a hot spare, a shard and a rank DEALER to each scheduler process: the
one that announced the newest epoch (``Hello.epoch``, ``zserve.core.epochs``) gets the metadata, and
on a new one the requests still queued here are sent to it again; what a superseded scheduler
sends is refused (``stale_epoch``). All of them are received through one ``SocketReactor``.

The logic lives in ``zserve.frontend.core.FrontendCore`` (admission, the request table and input
store, deadlines, cancellation, backend failures, coalescing of what a tick sends). This host
feeds it what arrives, stamped on the cluster clock (``zserve.runtime.clock``: the rank's
CLOCK_MONOTONIC, estimated before the frontend connects to the scheduler), delivers its outbox
(telling it what could not be delivered) and keeps its deadline timer at its ``wake_at`` (both
through ``zserve.runtime.driver.CoreDriver``), matches client disconnects (socket monitor events)
to connections by file descriptor, and gathers the cluster's stats for clients that ask
(``ClusterStatsRequest``; ``zserve.frontend.cluster_stats.ClusterStatsRounds``). What one
socket's chunk of messages produced is sent when the chunk is handled: one ``RequestMetaBatch``
per shard, one ``InferAnswers`` per client that announced it decodes them (``ClientHello``;
other clients get one ``InferReply`` / ``InferError`` per request, every array as a frame of its
own). ``_serve`` starts and stops it in the order every role follows
(``zserve.runtime.session.RoleSession``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.utils.monitor

from zserve.config.cluster import ModelConfig, RoleConfig
from zserve.config.profiles import LatencyProfile, configured_profile
from zserve.core.epochs import EpochFence
from zserve.core.errors import ErrorKind, ProtocolError, ZServeError
from zserve.core.hosting import Destination, Outbox
from zserve.core.request_ids import new_incarnation
from zserve.frontend import readiness
from zserve.frontend.autoscale_advice import AdviceTracker, advise_every
from zserve.frontend.cluster_stats import ClusterStatsRounds
from zserve.frontend.core import TO_BACKEND, TO_CLIENT, FrontendCore
from zserve.frontend.metrics import MetricsServer, in_process_stats_reader, serve_frontend_metrics
from zserve.frontend.oip.bridge import OIP_CLIENT, OipBridge
from zserve.frontend.oip.servers import OipBindError, OipServers
from zserve.frontend.repository_link import RepositoryLink
from zserve.runtime import control_link, keys, peer_map, runner
from zserve.runtime.args import role_config_from_args, role_parser
from zserve.runtime.clock import ClusterClock
from zserve.runtime.control_link import DrainRequest
from zserve.runtime.driver import CoreDriver
from zserve.runtime.session import RoleSession
from zserve.transport import codec, socket_io
from zserve.transport.messages import (
    BackendGone,
    BackendTable,
    BatchFailed,
    BatchOutputs,
    ClientHello,
    ClusterStatsRequest,
    DropNotice,
    Heartbeat,
    Hello,
    InferAnswers,
    InferError,
    InferRequest,
    InputFetch,
    Message,
    ModelAdded,
    ModelUnservable,
    ModelUsage,
    RepositoryReply,
    StatsReply,
    StatsRequest,
)
from zserve.transport.reactor import Chunk, SocketReactor
from zserve.transport.sockets import (
    BindError,
    make_dealer,
    make_router,
    monitor_server,
    note_monitor_event,
)

log = logging.getLogger("zserve.frontend")

# Malformed messages: log the first few in full, then one line per this many.
MALFORMED_LOG_FIRST = 10
MALFORMED_LOG_EVERY = 1000
# The frame property that holds the file descriptor of the connection a message came on.
_FRAME_SOURCE_FD = int(zmq.SRCFD)
# The host's own counters, next to the core's (``FrontendCore.counters``).
# stale_epoch: messages of a superseded scheduler, refused; epoch_switches: new active schedulers
# heard of (zserve.core.epochs).
HOST_COUNTERS = ("malformed", "handler_errors", "ignored", "late_peer_stats", "stale_epoch",
                 "epoch_switches")


def _load_profile(config: ModelConfig) -> LatencyProfile | None:
    """The configured profile (``zserve.config.profiles.configured_profile``), or None when it
    cannot be read: the frontend then admits without a predicted wait until the backends' table
    brings one."""
    try:
        return configured_profile(config)
    except (OSError, ValueError) as exc:
        log.warning("model %s: cannot read profile %s: %s", config.name, config.profile, exc)
        return None


# How often a frontend tells the orchestrator its per-model admissions and held requests: the
# delay a held request adds before its on-demand load starts, at most.
USAGE_REPORT_INTERVAL_S = 0.1


class FrontendHost:
    """A ``FrontendCore`` on its sockets. ``_serve`` drives it.

    Client connections are matched to disconnects by file descriptor: ``_clients_on_fd`` holds
    the identities seen on each connection, ``_fd_of_client`` the connection of each identity.
    """

    def __init__(self, config: RoleConfig, ctx: zmq.Context[Any],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.name = config.name
        self.cluster = config.cluster
        self.ctx = ctx
        self.loop = loop
        self.bind_addresses = config.bind
        self.advertise_host = config.advertise_host
        # Offset 0 until _serve has estimated it (the rank's clock is the cluster clock).
        self.clock = ClusterClock()
        self.core = FrontendCore(
            name=self.name, cluster=self.cluster, index=config.index,
            data_address="",  # bind() sets it
            profiles={m.name: _load_profile(m) for m in self.cluster.models},
            host_counters=HOST_COUNTERS, incarnation=new_incarnation(),
        )
        self.idle = asyncio.Event()  # set while nothing is pending (the drain waits on it)
        self.idle.set()
        self._idle_now = True  # what ``idle`` says, read without a call per tick
        self._reactor = SocketReactor(loop)
        # Deadlines tolerate the loop's millisecond ticks (coalesced anyway): its timer will do.
        self.driver = CoreDriver(self.core, loop=loop, clock=self.clock, deliver=self._deliver,
                                 after=self._end_tick, precise=False)
        self.cluster_stats = ClusterStatsRounds(
            name=self.name, loop=loop, own_stats=self.stats, ask_peers=self._ask_peers,
            flush=self.driver.flush, counters=self.counters)
        self.metrics_url: str | None = None  # the Prometheus endpoint, once serving
        # The autoscaling advice ([autoscale] enabled), fed by a stats round every interval.
        self.advice = AdviceTracker.for_cluster(self.cluster, loop.time())
        self._advising: asyncio.Task[None] | None = None
        self._rank_embedded = False  # rank lives in shard-0 (shards = 0): ask it once
        self._closed = False
        self._clients_on_fd: dict[int, set[bytes]] = {}
        self._fd_of_client: dict[bytes, int] = {}
        self.client_sock: zmq.Socket[Any] | None = None
        self.data_sock: zmq.Socket[Any] | None = None
        self.monitor_sock: zmq.Socket[Any] | None = None
        self.shard_socks: list[zmq.Socket[Any] | None] = [None] * self.cluster.scheduler_processes
        self.rank_sock: zmq.Socket[Any] | None = None
        # Every scheduler process by name (an active/standby pair: two of each); the fence says
        # which one is active (zserve.core.epochs), and shard_socks[0] / rank_sock are its sockets.
        self.shard_by_name: dict[str, zmq.Socket[Any]] = {}
        self.rank_socks: dict[str, zmq.Socket[Any]] = {}
        self.fence = EpochFence()
        self._heartbeat: asyncio.Task[None] | None = None
        self._usage: asyncio.Task[None] | None = None
        self.endpoints: dict[str, str] = {}
        # The Open Inference Protocol servers' way in (zserve.frontend.oip.bridge).
        self.oip = OipBridge(self.core, self._admit_oip, self._cancel_oip)

    @property
    def counters(self) -> dict[str, int]:
        return self.core.counters

    # ------------------------------------------------------------------ set-up

    def bind(self) -> dict[str, str]:
        self.client_sock, client_ep = make_router(
            self.ctx, self.bind_addresses["client"], name=f"{self.name} client",
            advertise_host=self.advertise_host, clients=True,
        )
        self.data_sock, data_ep = make_router(
            self.ctx, self.bind_addresses["data"], name=f"{self.name} data",
            advertise_host=self.advertise_host,
        )
        self.monitor_sock = monitor_server(
            self.client_sock, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        self.endpoints = {"client": client_ep, "data": data_ep}
        self.core.data_address = data_ep
        return self.endpoints

    def connect(self, peers: dict[str, str]) -> None:
        """Connect to the shards and rank named in the peer map."""
        identity = self.name.encode()
        hello = Hello(role="frontend", name=self.name, pid=os.getpid())
        for name, address in peer_map.endpoints_of(peers, "shard").items():
            self.shard_by_name[name] = make_dealer(self.ctx, address, identity=identity,
                                                   peer_role="shard")
            socket_io.sync_send(self.shard_by_name[name], hello)
        for index in range(len(self.shard_socks)):
            sock = self.shard_by_name.get(f"shard-{index}")
            if sock is None:
                log.error("%s: no address for shard-%d: its models are unavailable",
                          self.name, index)
                self.core.shard_reachable[index] = False
            self.shard_socks[index] = sock
        for name, address in peer_map.endpoints_of(peers, "rank").items():
            self.rank_socks[name] = make_dealer(self.ctx, address, identity=identity,
                                                peer_role="rank")
            socket_io.sync_send(self.rank_socks[name], hello)
        # shards = 0: shard-0 hosts the rank (also when a flag named its address "rank/rank").
        self._rank_embedded = self.cluster.scheduler.shards == 0
        self.rank_sock = self.rank_socks.get("rank") or self.rank_socks.get("shard-0") or next(
            iter(self.rank_socks.values()), None)

    def start(self) -> None:
        """Serve: watch every socket, open the OIP bridge, heartbeat the schedulers."""
        reactor = self._reactor
        assert self.monitor_sock is not None and self.data_sock is not None
        assert self.client_sock is not None
        reactor.watch_frames(self.monitor_sock, on_frames=self._on_monitor_events)
        reactor.watch(self.data_sock, router=True, on_chunk=self._on_data,
                      on_bad=lambda exc: self._malformed("data", exc))
        for name, sock in [*self.shard_by_name.items(), *self.rank_socks.items()]:
            reactor.watch(sock, router=False, on_chunk=functools.partial(self._on_scheduler, name),
                          on_bad=lambda exc: self._malformed("scheduler", exc))
        reactor.watch_frames(self.client_sock, on_frames=self._on_client)
        # OIP requests are answered like a client that takes one InferAnswers per tick.
        outbox: Outbox = []
        self.core.on_client_message(self.clock.now(), OIP_CLIENT,
                                    ClientHello(accepts=[InferAnswers.KIND]), outbox)
        self.driver.flush(outbox)
        self.oip.open(self.loop)
        self.cluster_stats.open()
        self._heartbeat = self.loop.create_task(self._heartbeat_loop(),
                                                name="scheduler-heartbeat")
        if self.advice is not None:
            self._advising = self.loop.create_task(advise_every(
                self.advice, self.cluster.autoscale.interval_s, self.loop.time,
                self.cluster_stats.ask), name="autoscale-advice")

    async def _heartbeat_loop(self) -> None:
        """Heartbeat every scheduler: a restarted one asks who this frontend is (so it hears the
        new epoch), and a superseded one hears the newest epoch and steps down."""
        seq = 0
        while True:
            seq += 1
            beat = Heartbeat(self.name, seq, self.clock.now(), self.fence.highest)
            for sock in self.rank_socks.values():
                self._reactor.send_nowait(sock, beat)
            await asyncio.sleep(control_link.HEARTBEAT_INTERVAL_S)

    def _sockets(self) -> list[zmq.Socket[Any]]:
        socks = [self.monitor_sock, self.data_sock, *self.shard_by_name.values(),
                 *self.rank_socks.values(), self.client_sock]
        return [s for s in socks if s is not None]

    def close(self) -> None:
        if not self._closed:
            outbox: Outbox = []
            self.cluster_stats.close(outbox)  # an open stats round answers with what came
            self.driver.flush(outbox)  # answers of this tick (answer_all's at shutdown) go first
            self.driver.close()
        self._closed = True
        for task in (self._heartbeat, self._usage, self._advising):
            if task is not None:
                task.cancel()
        self._reactor.close()
        if self.client_sock is not None and self.monitor_sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.client_sock.disable_monitor()
        for sock in self._sockets():
            sock.close(linger=control_link.CLOSE_LINGER_MS)

    # ------------------------------------------------------------------ the core's outbox

    def _end_tick(self, outbox: Outbox) -> None:
        """The driver's ``after``: what the core sends once per tick, then whether anything is
        pending (the drain waits for ``idle``)."""
        core = self.core
        core.end_tick(outbox)
        # The driver calls this twice a tick or more: the Event only when idleness changes.
        idle = not core.pending
        if idle is not self._idle_now:
            self._idle_now = idle
            if idle:
                self.idle.set()
            else:
                self.idle.clear()

    def _deliver(self, outbox: Outbox) -> None:
        """Send every message of ``outbox`` (emptied); failures go back to the core, whose
        answers to them are appended and sent too."""
        index = 0
        while index < len(outbox):
            destination, msg = outbox[index]
            index += 1
            error = self._send_to(destination, msg)
            if error is not None:
                self.core.on_send_failed(self.clock.now(), destination, msg,
                                         isinstance(error, zmq.Again), outbox)
        outbox.clear()

    def _send_to(self, destination: Destination, msg: Message) -> BaseException | None:
        kind, target = destination
        if kind == TO_CLIENT and target == OIP_CLIENT:
            self.oip.deliver(msg)
            return None
        if kind == TO_CLIENT:
            assert isinstance(target, bytes) and self.client_sock is not None
            try:
                frames: list[Any] = codec.encode(msg)
            except ZServeError:  # one answer that cannot be encoded must not stop the rest
                self.counters["handler_errors"] += 1
                log.exception("%s: cannot encode %s", self.name, type(msg).__name__)
                return None
            frames.insert(0, target)
            error: BaseException | None = self._reactor.send_frames(self.client_sock, frames)
        elif kind == TO_BACKEND:
            assert isinstance(target, str) and self.data_sock is not None
            error = self._reactor.send_nowait(self.data_sock, msg, target.encode())
        else:
            assert isinstance(target, int)
            sock = self.shard_socks[target]
            if sock is None:
                return zmq.ZMQError(zmq.EHOSTUNREACH)
            error = self._reactor.send_nowait(sock, msg)
        return error

    def _malformed(self, where: str, exc: Exception) -> None:
        self.counters["malformed"] += 1
        count = self.counters["malformed"]
        if count <= MALFORMED_LOG_FIRST or count % MALFORMED_LOG_EVERY == 0:
            log.warning("%s: malformed message on %s (%d so far): %s", self.name, where, count, exc)

    # ------------------------------------------------------------------ clients

    def _on_client(self, messages: list[list[zmq.Frame]]) -> None:
        outbox: Outbox = []
        for frames in messages:
            try:
                self._on_client_message(frames, outbox)
            except Exception:
                self.counters["handler_errors"] += 1
                log.exception("%s: handler failed", self.name)
        self.driver.flush(outbox)

    def _on_client_message(self, frames: list[zmq.Frame], outbox: Outbox) -> None:
        if len(frames) < 2:
            self._malformed("client", ProtocolError("no header frame"))
            return
        identity = frames[0].bytes
        self._note_connection(identity, frames[1])
        try:
            msg = codec.decode(frames[1:])
        except ProtocolError as exc:
            self._malformed("client", exc)
            kind = ErrorKind.TOO_LARGE if isinstance(exc, codec.MessageTooLargeError) else (
                ErrorKind.BAD_REQUEST
            )
            for request_id in codec.recover_request_ids(frames[1]):  # one, or a batch's
                outbox.append(((TO_CLIENT, identity), InferError(request_id, kind.value,
                                                                 str(exc))))
            return
        if self.core.on_client_message(self.clock.now(), identity, msg, outbox):
            return
        if type(msg) is StatsRequest:  # counters for a frontend started without supervisor
            outbox.append(((TO_CLIENT, identity), StatsReply(self.name, self.stats(msg.reset))))
        elif type(msg) is ClusterStatsRequest:  # and those of its peers (`zserve bench ADDR`)
            self.cluster_stats.gather(identity, msg.reset, outbox)
        elif type(msg) is not Hello:
            self._malformed("client", ProtocolError(f"unexpected {type(msg).__name__}"))

    def _note_connection(self, identity: bytes, frame: zmq.Frame) -> None:
        """Remember the connection (file descriptor) ``identity`` speaks on, to match
        disconnect events to clients."""
        try:
            fd = int(frame.get(_FRAME_SOURCE_FD))
        except (zmq.ZMQError, TypeError, ValueError):
            fd = -1
        if self._fd_of_client.get(identity) != fd:
            self._fd_of_client[identity] = fd
            self._clients_on_fd.setdefault(fd, set()).add(identity)

    def _on_monitor_events(self, messages: list[list[zmq.Frame]]) -> None:
        for frames in messages:
            event = zmq.utils.monitor.parse_monitor_message([f.bytes for f in frames])
            if self.client_sock is not None:  # a refused CURVE handshake: auth_failed
                note_monitor_event(self.client_sock, event["event"])
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            fd = event["value"]
            for identity in self._clients_on_fd.pop(fd, ()):
                if self._fd_of_client.get(identity) == fd:
                    del self._fd_of_client[identity]
                    self.core.client_gone(identity)
        self.driver.flush([])

    def _admit_oip(self, requests: list[InferRequest]) -> None:
        if self._closed:
            return
        outbox: Outbox = []
        now = self.clock.now()
        for request in requests:
            self.core.on_infer(now, OIP_CLIENT, request, outbox)
        self.driver.flush(outbox)

    def _cancel_oip(self, request_id: int) -> None:
        if not self._closed:
            self.driver.run(lambda now, outbox: self.core.on_cancel(now, OIP_CLIENT, request_id,
                                                                    outbox))

    # ------------------------------------------------------------------ scheduler and backends

    def _on_scheduler(self, scheduler: str, chunk: Chunk) -> None:
        """Messages from a shard or the rank (process ``scheduler``)."""
        outbox: Outbox = []
        core = self.core
        fence = self.fence
        for _, msg in chunk:
            now = self.clock.now()
            if type(msg) is Hello:
                self._on_scheduler_hello(now, scheduler, msg, outbox)
            elif type(msg) is StatsReply:  # a standby's too (cluster stats list both)
                self.cluster_stats.on_reply(msg, outbox)
            elif (scheduler in fence.epoch_of and not fence.is_current(scheduler)) or (
                    type(msg) is BackendTable and not fence.admits(msg.epoch)):
                self.counters["stale_epoch"] += 1  # a superseded scheduler's
            elif type(msg) is DropNotice:
                core.on_drop(now, msg, outbox)
            elif type(msg) is BackendTable:
                core.on_backend_table(now, msg, outbox)
            else:
                self.counters["ignored"] += 1
        self.driver.flush(outbox)

    def _on_data(self, chunk: Chunk) -> None:
        """Messages from backends."""
        outbox: Outbox = []
        core = self.core
        for identity, msg in chunk:
            now = self.clock.now()
            if type(msg) is InputFetch:
                assert identity is not None
                core.on_fetch(now, identity.decode(errors="replace"), msg, outbox)
            elif type(msg) is BatchOutputs:
                core.on_outputs(now, msg, outbox)
            elif type(msg) is BatchFailed:
                core.on_batch_failed(now, msg, outbox)
            elif type(msg) is Hello:
                core.on_backend_hello(now, msg, outbox)
            elif type(msg) is StatsReply:
                self.cluster_stats.on_reply(msg, outbox)
            else:
                self._malformed("data", ProtocolError(f"unexpected {type(msg).__name__}"))
        self.driver.flush(outbox)

    def _on_scheduler_hello(self, now: float, scheduler: str, msg: Hello,
                            outbox: Outbox) -> None:
        """Epoch 0: a (re)started scheduler asks who this is. Else it announces the epoch in
        which it is active: a newer one than any heard of is the scheduler from now on, and
        the requests still queued here are sent to it."""
        fence = self.fence
        if msg.epoch == 0:
            sock = self.rank_socks.get(scheduler)
            if sock is not None:
                self._reactor.send_nowait(sock, Hello(role="frontend", name=self.name,
                                                      pid=os.getpid(), epoch=fence.highest))
        elif fence.observe(scheduler, msg.epoch):
            self.counters["epoch_switches"] += 1
            self.core.epoch = msg.epoch
            if self.cluster.scheduler.shards == 0 and scheduler in self.shard_by_name:
                self.shard_socks[0] = self.shard_by_name[scheduler]
                self.rank_sock = self.rank_socks.get(scheduler, self.rank_sock)
                self.core.requeue_queued(now, outbox)
            log.info("%s: scheduler %s is active in epoch %d", self.name, scheduler, msg.epoch)
        elif msg.epoch < fence.highest:
            self.counters["stale_epoch"] += 1

    def on_control_message(self, msg: Message) -> None:
        """The supervisor says a backend's process died (``BackendGone``), answers a model
        repository call (``RepositoryReply``), adds a model (``ModelAdded``), or cannot load one on
        demand (``ModelUnservable``)."""
        if type(msg) is BackendGone and not self._closed:
            self.driver.run(lambda now, outbox: self.core.on_backend_gone(now, msg, outbox))
        elif type(msg) is RepositoryReply and self.oip.repository is not None:
            self.oip.repository.on_reply(msg)
        elif type(msg) is ModelUnservable and not self._closed:
            log.warning("%s: model %s cannot be loaded: %s", self.name, msg.model, msg.reason)
            self.driver.run(lambda now, outbox: self.core.fail_held(now, msg.model, msg.reason,
                                                                    outbox))
        elif type(msg) is ModelAdded and not self._closed:
            config = ModelConfig.from_dict(msg.config)
            if self.core.add_model(config, _load_profile(config)):
                log.info("%s: model %s added", self.name, config.name)
                self.driver.run(lambda now, outbox: self.core.release_held(now))

    def start_usage_reports(self, send: Callable[[Any], Awaitable[bool]]) -> None:
        """With ``[orchestration]``: report to the supervisor (``send``: the control link's)
        what the core admitted per model and holds for a load, every
        ``USAGE_REPORT_INTERVAL_S`` while anything changed (``ModelUsage``)."""
        if self.cluster.orchestration is not None:
            self._usage = self.loop.create_task(self._usage_loop(send), name="model-usage")

    async def _usage_loop(self, send: Callable[[Any], Awaitable[bool]]) -> None:
        while True:
            usage = self.core.take_usage()
            if usage is not None:
                await send(ModelUsage(self.name, usage.requests, usage.waiting, usage.pending))
            await asyncio.sleep(USAGE_REPORT_INTERVAL_S)

    # ------------------------------------------------------------------ drain and stats

    def answer_all(self, kind: ErrorKind, message: str) -> None:
        self.driver.run(lambda now, outbox: self.core.answer_all(now, kind, message, outbox))

    def _ask_peers(self, reset: bool) -> set[str]:
        """A cluster stats round's question: ``StatsRequest`` to every shard, the rank and every
        backend this frontend knows; the names of those it reached."""
        assert self.data_sock is not None
        request = StatsRequest(reset=reset)
        asked: set[str] = set()
        for name, sock in self.shard_by_name.items():
            if self._reactor.send_nowait(sock, request) is None:
                asked.add(name)
        if self.rank_sock is not None and not self._rank_embedded and (
                self._reactor.send_nowait(self.rank_sock, request) is None):
            asked.add("rank")
        for name in sorted(self.core.backends.names()):
            # Fails for a backend that never connected, or whose queue is full.
            if self._reactor.send_nowait(self.data_sock, request, name.encode()) is None:
                asked.add(name)
        return asked

    def stats(self, reset: bool = False) -> dict[str, Any]:
        out = self.core.stats(reset)
        out["clock"] = self.clock.stats()
        out["scheduler"] = {"active": self.fence.active, "epoch": self.fence.highest}
        out["metrics_url"] = self.metrics_url
        out["endpoints"] = dict(self.endpoints)  # as bound: `zserve status ADDRESS` prints them
        out["pid"] = os.getpid()
        out["slo_ms"] = {m.name: m.slo_ms for m in self.cluster.models}  # for `zserve status`
        keys.count_auth_failed(self.ctx, out["counters"], reset)
        # What the health endpoints answer (zserve.frontend.readiness), for status and metrics
        # readers.
        out["ready"] = self.oip.ready()
        out["unready_models"] = readiness.unready_models(self.core.models,
                                                         self.core.backend_models)
        if self.advice is not None:  # zserve status, the metrics and zserve up read it
            out["autoscale"] = self.advice.snapshot()
        return out


# --------------------------------------------------------------------------- process entry


async def _serve(config: RoleConfig, control_address: str | None) -> int:
    async with RoleSession.open(config, control_address, role="frontend") as session:
        frontend = FrontendHost(config, session.ctx, asyncio.get_running_loop())
        session.closing(frontend.close)
        session.serve_stats(frontend.stats)
        session.on_control(frontend.on_control_message)
        frontend.oip.repository = RepositoryLink(session.link.send)
        oip = OipServers(frontend.oip, http=config.bind.get("http"),
                         grpc_address=config.bind.get("grpc"),
                         max_request_bytes=frontend.cluster.frontends.max_request_bytes)
        session.closing(oip.stop)
        endpoints = await _bind(frontend, oip)
        metrics_server = _start_metrics(config, frontend)
        if metrics_server is not None:  # reported as bound, for `zserve up` and `zserve status`
            session.closing(metrics_server.close)
            endpoints["metrics"] = metrics_server.url
        peers = await session.ready(endpoints)
        # Arrivals and deadlines are stamped on the cluster clock: estimate it before admitting.
        if not await session.sync_clock(frontend.clock, peers):
            return session.exit_code
        frontend.connect(peers)
        frontend.start()
        frontend.start_usage_reports(session.link.send)
        await _drain(frontend, oip, await session.drained())
    return 0


async def _bind(frontend: FrontendHost, oip: OipServers) -> dict[str, str]:
    """Bind the frontend's sockets and the OIP servers; every endpoint as bound."""
    endpoints = frontend.bind()
    try:
        endpoints.update(await oip.start())
    except OipBindError as exc:  # a port taken since the preflight: one line, exit 2
        raise BindError(msg=f"{frontend.name}: {exc}") from None
    log.info("%s: clients connect to %s", frontend.name, endpoints["client"])
    return endpoints


async def _drain(frontend: FrontendHost, oip: OipServers, drain: DrainRequest) -> None:
    """Admit nothing new, give the requests in flight the drain's grace, answer the rest
    ``SHUTTING_DOWN`` and stop the OIP servers."""
    frontend.core.draining = True
    log.info("%s: draining (%s), %d in flight, up to %.1f s", frontend.name, drain.reason,
             len(frontend.core.pending), drain.drain_s)
    await drain.grace(frontend.idle)
    frontend.answer_all(ErrorKind.SHUTTING_DOWN, f"frontend {frontend.name} shut down")
    frontend.oip.close(f"frontend {frontend.name} shut down")
    await oip.stop()
    log.info("%s: stopped; counters %s", frontend.name,
             {key: value for key, value in frontend.counters.items() if value})


def _start_metrics(config: RoleConfig, frontend: FrontendHost) -> MetricsServer | None:
    """This frontend's Prometheus endpoint, if ``--metrics`` or ``frontends.metrics_addresses``
    names one; a scrape asks the frontend on its loop (``ClusterStatsRounds.ask``)."""
    addresses = frontend.cluster.frontends.metrics_addresses
    address = config.bind.get("metrics") or (
        addresses[config.index] if config.index < len(addresses) else None)
    if address is None:
        return None
    try:
        server = serve_frontend_metrics(address, frontend.name,
                                        lambda: frontend.core.model_names,
                                        in_process_stats_reader(frontend.loop,
                                                                frontend.cluster_stats.ask))
    except OSError as exc:  # a port taken since the preflight: one line, exit 2
        raise BindError(exc.errno, f"{frontend.name} metrics: cannot bind {address}: "
                        f"{exc.strerror or exc}") from None
    frontend.metrics_url = server.url
    return server


def run_frontend(config: RoleConfig, control_address: str | None) -> int:
    """Process entry point (docs/runtime.md)."""
    return runner.run_role(_serve(config, control_address), name=config.name)


def main(argv: list[str]) -> int:
    """``zserve frontend --config CLUSTER.toml --index N``: run one frontend on its own; its
    peers' addresses come from the file, overridden by the flags."""
    parser = role_parser("zserve frontend", main.__doc__)
    parser.add_argument("--client", help="bind the client socket here")
    parser.add_argument("--data", help="bind the data socket here")
    parser.add_argument("--shard", action="append", default=[],
                        help="a scheduler shard's address, in shard order (repeat)")
    for server in ("http", "grpc", "metrics"):  # host:port, e.g. 0.0.0.0:8000 in a pod
        parser.add_argument(f"--{server}", metavar="HOST:PORT",
                            help=f"serve {server} here (overrides frontends.{server}_addresses)")
    args = parser.parse_args(argv)
    config = role_config_from_args(args, "frontend")
    for sock in ("client", "data", "http", "grpc", "metrics"):
        if getattr(args, sock):
            config.bind[sock] = getattr(args, sock)
    for index, address in enumerate(args.shard):
        config.peers[peer_map.peer_key(f"shard-{index}", "shard")] = address
    return run_frontend(config, args.control)
