"""The backend process: a thin host around one device's PlanFollower.

``run_backend(config, control_address)`` (``zserve backend``) serves one device (``cpu``,
``cuda:N`` or ``emulated``). The decisions -- holding plans, fetching inputs, the start decision,
late shedding, the device-free projection -- are the pure ``PlanFollower``
(``zserve.backends.follower``; the simulator hosts the same one), and the executor side is the
``BatchRunner`` (``zserve.backends.batch_runner``). This host owns the rest:

1. Start-up: binds its ``plan`` ROUTER, loads and warms every model at every batch size, fixes
   each model's profile (the configured file, the emulated alpha/beta, or measured here), and
   only then sends ``Ready``. Then it registers with the rank (``BackendRegister``; with a hot
   spare, with both scheduler processes, and again with one that announces a newer epoch, with
   when its device frees) and opens a
   DEALER to every frontend ``data`` address of the peer map at once (its ``Hello`` carries the
   pid, so a frontend knows when a backend of this name restarted); a frontend a plan names
   first is connected when that plan arrives, before the follower fetches from it.
   The epoch fence (``zserve.core.epochs.EpochFence``): a plan of an older scheduler epoch than the
   newest seen is refused, counted (``stale_epoch``) and never run.
2. Serving: feeds the follower every message with ``clock.now()`` (the cluster clock) through
   one ``zserve.runtime.driver.CoreDriver``, which delivers its outbox and keeps one precise
   timer at ``follower.wake_at``: a plan starts tens of microseconds after its exec_at, never
   before. A ``RunBatch`` is run by the ``BatchRunner``; the follower answers what it gave
   (``on_batch_finished``: ``BatchOutputs`` or ``BatchFailed`` per frontend), the host sends
   that, then ``on_batch_done`` frees the device.
   Each plan is acknowledged to its shard from this same loop, on the next ``BatchStats`` to
   that shard or alone (``PlanAck``) once held ``ACK_HOLD_S`` (``zserve.backends.held_acks``).
   A plan's ``BatchStats`` goes to its shard (which learns when its batch really ended:
   ``zserve.scheduler.policy.AnswerEchoes``) and to the rank, once where one process hosts
   both (its shard hands it to its rank).
   Heartbeats to the rank and acknowledgements stop while a batch is wedged (running
   ``WEDGED_FACTOR`` x its planned duration, at least ``WEDGED_MIN_S``): ONNX Runtime runs a
   batch in the executor's worker thread, so the loop itself keeps running and must say so.
3. Drain (SIGTERM/SIGINT or ``Shutdown``): every model is withdrawn from the schedulers first
   (a ``BackendRegister`` without them) and plans still run until none has come for
   ``UNLOAD_QUIET_S``; then held plans that cannot start within the grace period and new plans
   are answered SHUTTING_DOWN; the rest run; exit 0. A batch still running after
   the drain holds the executor's worker thread for good: the process then leaves with
   ``os._exit(1)`` once everything else is closed.

The heartbeats, the wedged rule and the drain are a part, ``zserve.backends.liveness``'s
``BackendLiveness``; the start-up order and the cleanup are ``zserve.runtime.session``'s
``RoleSession``.

Sends never block: a message ZeroMQ cannot queue is dropped, counted and logged (a lost
InputFetch is reported to the follower, which runs without those inputs); the frontends'
deadline timers answer whatever a lost message leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import time
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
import zmq

from zserve.backends.batch_runner import BatchRunner, BusyMeter
from zserve.backends.builtin import cache_dir
from zserve.backends.executor import Executor
from zserve.backends.follower import (
    DEST_DEVICE,
    INPUT_WAIT_S,
    SHED_GRACE_FRACTION,
    PlanFollower,
    RunBatch,
    shed_late_rows,
)
from zserve.backends.held_acks import ACK_HOLD_S, HeldAcks
from zserve.backends.liveness import BackendLiveness
from zserve.backends.model_lifecycle import ModelLifecycle, Report
from zserve.backends.prefix import backend_groups
from zserve.backends.ready_routing import ReadyRouting, ReadySamples
from zserve.config.cluster import DEVICE_RE, ModelConfig, RoleConfig
from zserve.config.profiles import LatencyProfile, configured_profile
from zserve.core.epochs import EpochFence
from zserve.core.errors import ZServeError
from zserve.core.hosting import DEST_FRONTEND, Outbox
from zserve.core.request_ids import INCARNATIONS, incarnation_of
from zserve.core.stats import Stats
from zserve.runtime import peer_map, runner
from zserve.runtime.args import role_config_from_args, role_parser
from zserve.runtime.clock import ClusterClock
from zserve.runtime.driver import CoreDriver, Event
from zserve.runtime.session import EXIT_DRAINED, SOCKET_CLOSE_LINGER_MS, RoleSession
from zserve.transport.messages import (
    BackendRegister,
    BatchPlan,
    BatchStats,
    CancelFetched,
    Heartbeat,
    Hello,
    InputFetch,
    InputReply,
    LoadModel,
    Message,
    ModelReport,
    PlanAck,
    RetireBackend,
    StatsReply,
    StatsRequest,
    UnloadModel,
)
from zserve.transport.reactor import Chunk, SocketReactor
from zserve.transport.sockets import make_dealer, make_router

log = logging.getLogger(__name__)

ROLE = "backend"
# Repeats per batch size when a profile has to be measured at start-up.
PROFILE_REPEATS = 3
# stale_epoch: plans (and announcements) of an older scheduler epoch than the newest seen,
# refused (zserve.core.epochs)
# plans_unstaged: plans of a staged model admitted while every staging slot of their model was
# held (their batch is assembled when it starts, zserve.backends.staging)
# Plans whose shard is remembered for their BatchStats at most (a plan that ends without one,
# in a drain, is forgotten once this many newer plans came).
PLAN_SHARDS_MAX = 4096
# acks_on_reports / acks_alone: plan acknowledgements sent on a BatchStats / alone (PlanAck)
HOST_COUNTER_NAMES = ("send_dropped", "bad_messages", "stale_epoch", "plans_unstaged",
                      "acks_on_reports", "acks_alone")


def _newer_incarnation(incarnation: int, than: int) -> bool:
    """Whether frontend incarnation ``incarnation`` started after ``than`` (incarnations are
    start milliseconds modulo ``INCARNATIONS``: compared on that circle)."""
    return 0 < (incarnation - than) % INCARNATIONS < INCARNATIONS // 2


# --------------------------------------------------------------------------- executors


def build_executor(device: str, models: Sequence[ModelConfig],
                   onnx_io: str = "iobinding", kind: str = "") -> Executor:
    """The executor for ``device``: emulated for ``emulated`` (every model then needs a profile:
    emulated alpha/beta or a profile file), else ONNX Runtime on the device (``cpu``, ``cuda:N``)
    for the ``builtin`` and ``onnx`` models, run as ``onnx_io`` says (``[backends] onnx_io``:
    ``iobinding``, ``bound``, ``graph`` or ``tensorrt``; ``zserve.backends.onnx_binding``). An
    emulated device of ``kind`` runs each model's profile for that kind (``[[models]]
    profiles``)."""
    if device == "emulated":
        from zserve.backends.emulated import EmulatedExecutor, EmulatedModel

        return EmulatedExecutor([EmulatedModel.from_config(m, kind) for m in models])
    from zserve.backends.builtin import ModelSpec, ensure_builtin
    from zserve.backends.onnx_executor import OnnxExecutor
    from zserve.backends.onnx_session import SessionConfig

    specs: list[ModelSpec] = []
    for m in models:
        if m.kind == "builtin" and m.builtin:
            specs.append(ModelSpec(m.name, ensure_builtin(m.builtin)))
        elif m.kind == "onnx" and m.onnx:
            specs.append(ModelSpec(m.name, Path(m.onnx)))
        else:
            raise ValueError(f"model {m.name!r} ({m.kind}) needs device 'emulated', not {device!r}")
    config = SessionConfig(bound_buffers=onnx_io in ("bound", "graph"),
                           cuda_graph=onnx_io == "graph", tensorrt=onnx_io == "tensorrt")
    return OnnxExecutor(specs, device=device, max_batch={m.name: m.max_batch for m in models},
                        config=config,
                        session_batch_sizes={m.name: m.session_batch_sizes for m in models
                                             if m.session_batch_sizes})


# --------------------------------------------------------------------------- the host


class BackendHost:
    """The process host of one device's PlanFollower: sockets, executor, driver, liveness.
    Created and run by ``_serve``; every method runs on the event loop.

    Its parts: ``follower`` (the decisions), ``driver`` (delivers the follower's outbox and keeps
    its timer), ``liveness`` (heartbeats, the wedged rule, the drain), ``runner`` (runs a
    batch), ``fence`` (the scheduler epoch whose plans run). Its sockets: ``plan_sock`` (the
    ``plan`` ROUTER the shards send to), ``rank_socks`` (a DEALER to every scheduler process
    that hosts a rank, by scheduler name) and ``frontend_socks`` (a DEALER to every frontend's
    ``data`` ROUTER, by address).
    """

    # A prefix group's models -> (the group, their own signature): announced as served, by the
    # group's profile, so frontends admit them (zserve.backends.prefix.backend_groups; the
    # host's builder sets it before the host registers).
    grouped: Mapping[str, tuple[str, dict[str, Any]]] = MappingProxyType({})
    _stuck = False  # a batch still ran at close (``stuck``)
    _ack_flush: asyncio.TimerHandle | None = None  # sends the held acknowledgements alone

    def __init__(
        self,
        *,
        name: str,
        device: str,
        kind: str = "",
        executor: Executor,
        ctx: zmq.Context[zmq.Socket[bytes]],
        plan_sock: zmq.Socket[Any],
        plan_address: str,
        reactor: SocketReactor,
        clock: ClusterClock | None = None,
        shed_grace_s: float = 0.0,
        report: Report | None = None,
    ) -> None:
        self.name = name
        # Set before the backend starts (its offset is estimated after Ready, before it serves).
        self.clock = clock if clock is not None else ClusterClock()
        self.identity = name.encode()
        self.device = device
        self.kind = kind  # the device kind it announces to the rank and reports in its stats
        self.executor = executor
        self.ctx = ctx
        self.plan_sock = plan_sock
        self.plan_address = plan_address
        self.loop = asyncio.get_running_loop()
        self.reactor = reactor
        self.follower = PlanFollower(name, shed_grace_s=shed_grace_s)
        # An active/standby pair of schedulers: two; the fence (zserve.core.epochs) says which
        self.rank_socks: dict[str, zmq.Socket[Any]] = {}
        self.fence = EpochFence()
        self._stale_epochs_logged: set[int] = set()
        self.plans_by_epoch: dict[int, int] = {}  # plans admitted, by scheduler epoch
        self._plan_shards: dict[int, bytes] = {}  # plan id -> its shard, until its BatchStats
        self.ready_routing = ReadyRouting()  # the follower's ready samples, by their shard
        self.held_acks = HeldAcks()  # acknowledgements waiting for a BatchStats to ride
        self.retiring = False  # released by the autoscaler: said in every registration
        self.frontend_socks: dict[str, zmq.Socket[Any]] = {}
        # address -> the newest frontend incarnation its plans named (_note_frontend_restarts)
        self._frontend_incarnations: dict[str, int] = {}
        self.profiles: dict[str, LatencyProfile] = {}
        self.models = list(executor.models)
        self.warmed: dict[str, list[int]] = {}
        self.warm_s = self.warm_finished_at = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._host_stats = Stats(HOST_COUNTER_NAMES)
        self.counters = self._host_stats.counters
        self.runner = BatchRunner(executor, self.clock, self.follower.stats)
        self._counted_before_reset: dict[str, int] = {}
        # The liveness first: the driver tells it after every delivery whether the follower is
        # idle, and its drain runs follower events through the driver (_run_event).
        self.liveness = BackendLiveness(name, self.follower, self.clock, self.fence,
                                        run=self._run_event, send_beat=self._send_heartbeat)
        self.driver = CoreDriver(self.follower, loop=self.loop, clock=self.clock,
                                 deliver=self._deliver, after=self.liveness.note_delivered)
        # Live load and unload (LoadModel / UnloadModel on the control link).
        self.lifecycle = ModelLifecycle(
            name=name, executor=executor, follower=self.follower, runner=self.runner,
            clock=self.clock, served=self.models, profiles=self.profiles, warmed=self.warmed,
            announce=self._announce, report=report or _no_report, kind=kind)

    # ------------------------------------------------------------------ start-up

    def load_and_warm(self, models: Sequence[ModelConfig]) -> None:
        """Load every model, warm it at every batch size, allocate the batch buffers and fix the
        profiles. Blocking: runs before the process reports Ready."""
        started = time.monotonic()
        self.executor.load()
        self.executor.warm()
        for model in self.models:
            self.warmed[model] = list(range(1, self.executor.max_batch(model) + 1))
            self.runner.allocate(model)
        by_name = {m.name: m for m in models}
        for model in self.models:
            profile = (configured_profile(by_name[model], self.kind) if model in by_name
                       else None)
            if profile is None:
                measured = self.executor.profile(model, repeats=PROFILE_REPEATS, warmup=0)
                profile = LatencyProfile.from_table_ms(measured.table_ms())
            self.profiles[model] = profile
            self.follower.add_model(model, profile.table_s, self.executor.max_batch(model))
        self.warm_finished_at = time.monotonic()
        self.warm_s = self.warm_finished_at - started
        log.info("%s: %d model(s) loaded and warmed in %.2f s", self.name, len(self.models),
                 self.warm_s)

    def start(self, rank_addresses: dict[str, str],
              frontend_addresses: Sequence[str] = ()) -> None:
        """Serve: watch the plan socket, connect the frontends known now, register with every
        scheduler's rank (a standby ignores it until it takes over) and start heartbeating."""
        self.reactor.watch(self.plan_sock, router=True, on_chunk=self._on_plan_chunk,
                           on_bad=self._on_bad)
        for address in frontend_addresses:
            self._connect_frontend(address)
        for scheduler, address in rank_addresses.items():
            sock = make_dealer(self.ctx, address, identity=self.identity, peer_role="rank")
            self.rank_socks[scheduler] = sock
            self.reactor.watch(sock, router=False, on_bad=self._on_bad,
                               on_chunk=functools.partial(self._on_rank_chunk, scheduler))
            self._register(sock)
        self._spawn(self.liveness.heartbeat_loop())

    def on_control_message(self, msg: Any) -> None:
        """The supervisor's commands: load or unload a model (``ModelLifecycle``); the
        autoscaler's release (``RetireBackend``: register again as retiring)."""
        if isinstance(msg, LoadModel | UnloadModel) and not self.follower.draining:
            self._spawn(self.lifecycle.handle(msg))
        elif isinstance(msg, RetireBackend) and msg.name == self.name and not self.retiring:
            log.info("%s: released by the autoscaler: registering as retiring", self.name)
            self.retiring = True
            self._announce()
        else:
            log.debug("%s: ignoring control %s", self.name, type(msg).__name__)

    def _announce(self) -> None:
        """Register again with every scheduler: the models served changed."""
        for sock in self.rank_socks.values():
            self._register(sock)

    @property
    def rank_sock(self) -> zmq.Socket[Any] | None:
        """The active scheduler's rank (before any announced an epoch: the first, which starts
        active)."""
        sock = self.rank_socks.get(self.fence.active)
        if sock is None and self.rank_socks:
            sock = next(iter(self.rank_socks.values()))
        return sock

    def _register(self, sock: zmq.Socket[Any]) -> None:
        profiles_ms = {m: p.latency_ms_list() for m, p in self.profiles.items()}
        grouped = {m: v for m, v in self.grouped.items() if v[0] in profiles_ms}
        profiles_ms.update({m: profiles_ms[group] for m, (group, _) in grouped.items()})
        running = self.follower.running
        now = self.clock.now()
        free_at = max(now, running.started_at + running.planned_s) if running else now
        self._send(
            sock,
            BackendRegister(
                name=self.name,
                device=self.device,
                plan_address=self.plan_address,
                models=[*self.models, *grouped],
                profiles_ms=profiles_ms,
                signatures={**{m: self.executor.signature(m).to_dict() for m in self.models},
                            **{m: wire for m, (_, wire) in grouped.items()}},
                device_free_at=self.follower.device_free_at(free_at),
                retiring=self.retiring,
                kind=self.kind,
            ),
        )

    def _connect_frontend(self, address: str) -> None:
        """A DEALER to a frontend's ``data`` ROUTER, opened once, when the host learns the
        address. The pid in its Hello tells the frontend when a backend of this name restarted
        (it then fails the requests the old process had fetched)."""
        if address in self.frontend_socks:
            return
        sock = make_dealer(self.ctx, address, identity=self.identity, peer_role="frontend")
        self.frontend_socks[address] = sock
        self.reactor.watch(sock, router=False, on_bad=self._on_bad,
                           on_chunk=functools.partial(self._on_data_chunk, address))
        self._send(sock, Hello(role=ROLE, name=self.name, pid=os.getpid()))

    def _note_frontend_restarts(self, plan: BatchPlan) -> None:
        """A plan naming a newer incarnation of a frontend than the last plan of its address
        did: the frontend restarted at the same address (a pod's container restarted). Its
        DEALER here is replaced by a fresh one, which connects at once and says Hello (with this
        process's pid, which the new frontend has not heard). The old one reconnects only on
        ZeroMQ's backoff, up to ``RECONNECT_INTERVAL_MAX_MS`` after the frontend bound again,
        and this plan's InputFetch would wait on it that long: past the deadline of a batch
        the deferred policy planned at its edge."""
        newest: dict[int, int] = {}
        for slot, rid in zip(plan.request_frontend, plan.request_ids, strict=False):
            newest.setdefault(slot, incarnation_of(rid))
        for slot, incarnation in newest.items():
            if not 0 <= slot < len(plan.frontends):
                continue
            address = plan.frontends[slot]
            last = self._frontend_incarnations.get(address)
            if last is not None and not _newer_incarnation(incarnation, last):
                continue
            self._frontend_incarnations[address] = incarnation
            sock = self.frontend_socks.pop(address, None) if last is not None else None
            if sock is not None:
                log.info("%s: frontend at %s restarted (incarnation %d): connecting afresh",
                         self.name, address, incarnation)
                self.reactor.unwatch(sock)
                sock.close(linger=0)  # what it still queues is for the process that left

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)  # a strong reference until it is done (one task per batch)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ I/O

    def _send(self, sock: zmq.Socket[Any], msg: Message, identity: bytes | None = None) -> bool:
        """Non-blocking send; False (counted, logged) when ZeroMQ cannot take the message."""
        error = self.reactor.send_nowait(sock, msg, identity)
        if error is None:
            return True
        self.counters["send_dropped"] += 1
        log.warning("%s: dropped %s (%s)", self.name, type(msg).__name__, error)
        return False

    def _send_heartbeat(self, beat: Heartbeat) -> None:
        """To every scheduler: a standby learns this backend, and a superseded one hears the
        newest epoch and steps down."""
        for sock in self.rank_socks.values():
            self._send(sock, beat)

    def _run_event(self, event: Event) -> None:
        self.driver.run(event)

    def _on_bad(self, exc: ZServeError) -> None:
        self.counters["bad_messages"] += 1
        log.warning("%s: bad message: %s", self.name, exc)

    def _deliver(self, outbox: Outbox) -> None:
        """The driver's way out for the follower's outbox: start what it runs, send the rest,
        then empty it. An InputFetch ZeroMQ could not take is reported back to the follower
        (what that appends is delivered next)."""
        lost: list[tuple[int, str]] = []
        for (kind, where), msg in outbox:
            if kind == DEST_DEVICE:
                assert isinstance(msg, RunBatch)
                self._spawn(self._execute(msg))
            elif kind == DEST_FRONTEND:
                address = str(where)  # connected when the host learned it
                if not self._send(self.frontend_socks[address], msg) and isinstance(
                        msg, InputFetch):
                    lost.append((msg.plan_id, address))
            elif type(msg) is BatchStats:
                assert isinstance(msg, BatchStats)
                self._send_stats(msg)
            elif self.rank_sock is not None:
                self._send(self.rank_sock, msg)
        outbox.clear()
        for plan_id, address in lost:  # nothing will come: run without them
            self.follower.on_fetch_lost(self.clock.now(), plan_id, address, outbox)

    def _send_stats(self, stats: BatchStats) -> None:
        """A plan's report to the shard that sent it, with the acknowledgements held for that
        shard, and to the rank unless the shard's process hosts it (that shard hands it over)."""
        shard = self._plan_shards.pop(stats.plan_id, None)
        rank = self.rank_sock
        if shard is not None:  # best effort: a shard that left needs no report
            acked, _ = self.held_acks.take(shard)
            report = stats
            if acked:
                self.counters["acks_on_reports"] += len(acked)
                models, delays, rows = self._take_ready(shard)
                report = msgspec.structs.replace(stats, acked_plan_ids=acked, ready_models=models,
                                                 ready_delays=delays, ready_rows=rows)
                if not self.held_acks:
                    self._cancel_ack_flush()
            error = self.reactor.send_nowait(self.plan_sock, report, shard)
            if error is not None and acked:
                self.counters["send_dropped"] += 1
                log.warning("%s: dropped the BatchStats acknowledging %s (%s)", self.name,
                            acked, error)
            if rank is not None and self.rank_socks.get(shard.decode(errors="replace")) is rank:
                return
        if rank is not None:
            self._send(rank, stats)

    def _take_ready(self, shard: bytes) -> ReadySamples:
        """The ready-delay samples held for ``shard`` (those of the models it plans, see
        backends/ready_routing.py), now taken."""
        self.ready_routing.hold(self.follower.ready_samples)
        self.follower.ready_samples.clear()
        return self.ready_routing.take(shard)

    def _arm_ack_flush(self) -> None:
        if self.held_acks and self._ack_flush is None:
            self._ack_flush = self.loop.call_later(ACK_HOLD_S, self._flush_acks)

    def _cancel_ack_flush(self) -> None:
        if self._ack_flush is not None:
            self._ack_flush.cancel()
            self._ack_flush = None

    def _flush_acks(self) -> None:
        """The held acknowledgements no BatchStats took in time go alone, one PlanAck per
        shard, each with the ready-delay samples of that shard's models."""
        self._ack_flush = None
        for shard, plan_ids, received_at in self.held_acks.take_all():
            self.counters["acks_alone"] += len(plan_ids)
            self._send(self.plan_sock, PlanAck(plan_ids, received_at, *self._take_ready(shard)),
                       shard)

    # ------------------------------------------------------------------ messages in

    def _on_plan_chunk(self, messages: Chunk) -> None:
        outbox: Outbox = []
        now = self.clock.now()
        # Each plan is acknowledged to its shard (held a moment for the next BatchStats to ride,
        # ``held_acks``), unless the running batch is wedged: then, as with a stopped process,
        # no acknowledgement comes and the shard plans the requests elsewhere (this loop starts
        # the batches, so an acknowledgement from it says that they can start).
        wedged = self.liveness.wedged(now)
        for identity, msg in messages:
            if isinstance(msg, BatchPlan) and not self._admit_plan(msg):
                continue
            if isinstance(msg, BatchPlan):
                self.lifecycle.note_plan(msg.model, now)
                self._note_frontend_restarts(msg)
                for address in msg.frontends:  # learned here, before the follower fetches
                    self._connect_frontend(address)
                self.follower.on_plan(now, msg, outbox)
                self._claim_slot(msg)
                if identity is not None:
                    self._note_plan_shard(msg.plan_id, identity)
                    self.ready_routing.note_plan(msg.model, identity)
                    if not wedged:
                        self.held_acks.hold(identity, msg.plan_id, now)
            elif isinstance(msg, StatsRequest):
                assert identity is not None
                self._send(self.plan_sock, StatsReply(self.name, self.stats(msg.reset)), identity)
            elif not isinstance(msg, Hello | Heartbeat):
                log.warning("%s: unexpected %s on the plan socket", self.name, type(msg).__name__)
        self._arm_ack_flush()
        self.driver.flush(outbox)

    def _note_plan_shard(self, plan_id: int, identity: bytes) -> None:
        """Where plan ``plan_id``'s ``BatchStats`` goes besides the rank. Bounded: a plan that
        ends without one (a drain) is forgotten once PLAN_SHARDS_MAX newer ones came."""
        shards = self._plan_shards
        shards[plan_id] = identity
        if len(shards) > PLAN_SHARDS_MAX:
            del shards[next(iter(shards))]  # the oldest (insertion order)

    def _claim_slot(self, plan: BatchPlan) -> None:
        """A staging slot for a plan the follower now holds: its inputs are copied into their
        rows as they arrive (``zserve.backends.staging``)."""
        follower, staging = self.follower, self.runner.staging
        if (follower.holds(plan.plan_id) and staging.stages(plan.model)
                and not staging.claim(plan, follower.holds)):
            self.counters["plans_unstaged"] += 1

    def _admit_plan(self, plan: BatchPlan) -> bool:
        """The epoch fence: a plan of an older scheduler epoch than the newest seen never runs
        (its requests are the new epoch's to plan; nothing is answered for them here)."""
        if self.fence.admits(plan.epoch):
            self.fence.note(plan.epoch)
            self.plans_by_epoch[plan.epoch] = self.plans_by_epoch.get(plan.epoch, 0) + 1
            return True
        self.counters["stale_epoch"] += 1
        if plan.epoch not in self._stale_epochs_logged:
            self._stale_epochs_logged.add(plan.epoch)
            log.warning("%s: refused plan %d of scheduler epoch %d (the newest is %d)",
                        self.name, plan.plan_id, plan.epoch, self.fence.highest)
        return False

    def _on_rank_chunk(self, scheduler: str, messages: Chunk) -> None:
        sock = self.rank_socks[scheduler]
        for _, msg in messages:
            if not isinstance(msg, Hello):
                if not isinstance(msg, Heartbeat):
                    log.debug("%s: ignoring %s from rank", self.name, type(msg).__name__)
            elif msg.epoch == 0 or self.fence.observe(scheduler, msg.epoch):
                # A restarted scheduler asks who we are, or one announces a newer epoch (it
                # took over): register there, with when the device frees.
                if msg.epoch:
                    log.info("%s: scheduler %s is active in epoch %d", self.name, scheduler,
                             msg.epoch)
                self._register(sock)
            elif msg.epoch < self.fence.highest:
                self.counters["stale_epoch"] += 1

    def _on_data_chunk(self, address: str, messages: Chunk) -> None:
        outbox: Outbox = []
        for _, msg in messages:
            if isinstance(msg, InputReply):
                self.runner.staging.stage(address, msg, self.follower.fetching)
                self.follower.on_input_reply(self.clock.now(), address, msg, outbox)
            elif isinstance(msg, CancelFetched):
                self.follower.on_cancel_fetched(self.clock.now(), address, msg, outbox)
            elif isinstance(msg, StatsRequest):  # a frontend collecting its cluster's stats
                self._send(self.frontend_socks[address],
                           StatsReply(self.name, self.stats(msg.reset)))
            else:
                log.warning("%s: unexpected %s on a data socket", self.name, type(msg).__name__)
        self.driver.flush(outbox)

    # ------------------------------------------------------------------ the device

    async def _execute(self, run: RunBatch) -> None:
        """Run one batch, send the follower's answer to it (its outputs, or BACKEND_FAILED),
        and free the device."""
        result = await self.runner.run(run)
        if result.error:
            log.error("%s: batch %d of %s (%d requests) failed: %s", self.name,
                      run.plan.plan_id, run.plan.model, len(run.rows), result.error)
        follower = self.follower
        try:
            self.driver.run(lambda now, outbox: follower.on_batch_finished(
                now, run, result.outputs, result.error, finished_at=result.finished_at,
                outbox=outbox))
            follower.histograms["push"].observe(self.clock.now() - result.finished_at)
        finally:
            self.runner.staging.release(run.plan.plan_id)
            self.driver.run(lambda now, outbox: follower.on_batch_done(
                now, ok=not result.error, finished_at=result.finished_at, outbox=outbox))

    # ------------------------------------------------------------------ drain and close

    async def drain(self, drain_s: float) -> None:
        """Withdraw every model from the schedulers (``ModelLifecycle.withdraw_all``), then, in
        what is left of ``drain_s``: refuse new plans, run what can start in time, wait
        (bounded) for the running batch (``BackendLiveness.drain``)."""
        started = time.monotonic()
        if self.rank_socks:
            await self.lifecycle.withdraw_all(drain_s)
        await self.liveness.drain(max(0.0, drain_s - (time.monotonic() - started)))
        log.info("%s: drained; counters since start %s", self.name, self.counter_totals())

    async def close(self) -> None:
        # A batch still running now holds the executor's worker thread (it cannot be cancelled).
        self._stuck = self.follower.running is not None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._cancel_ack_flush()
        socks = [self.plan_sock, *self.frontend_socks.values(), *self.rank_socks.values()]
        for sock in socks:
            self.reactor.unwatch(sock)
            sock.close(linger=SOCKET_CLOSE_LINGER_MS)
        # Last: until the sockets close, what the follower answers (a plan refused after the
        # drain) still goes out. After a drain it holds nothing, so its timer is not armed.
        self.driver.close()
        if not self._stuck:
            self.executor.close()

    @property
    def stuck(self) -> bool:
        """True when a batch still ran at close: the executor's worker thread cannot be joined,
        so the process must exit without waiting for it."""
        return self._stuck

    # ------------------------------------------------------------------ stats

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """The backend's state, ``batch_sizes`` and ``samples`` (the batches' sizes and models,
        the device's ``busy_s``) and the ``zserve.core.stats`` snapshot (``counters``: the
        follower's and this host's; ``latency``/``histograms``: ``BACKEND_HISTOGRAMS``);
        ``reset`` starts a new window (``counters_total`` runs on)."""
        batches = self.follower.batches
        counters = self._counters()
        out: dict[str, Any] = {
            "role": ROLE,
            "name": self.name,
            "device": self.device,
            "kind": self.kind,
            "models": list(self.models),
            "warmed": {m: list(b) for m, b in self.warmed.items()},
            "profiles_ms": {m: p.latency_ms_list() for m, p in self.profiles.items()},
            "warm_s": self.warm_s,
            "warm_finished_at": self.warm_finished_at,
            "held_plans": self.follower.held_plans,
            "retiring": self.retiring,
            # a batch overran its plan WEDGED_FACTOR times (at least WEDGED_MIN_S): no
            # heartbeats to the rank and no plan acknowledgements while it lasts
            "wedged": self.liveness.wedged(self.clock.now()),
            "scheduler": {"active": self.fence.active, "epoch": self.fence.highest,
                          "plans_by_epoch": {str(e): n for e, n in self.plans_by_epoch.items()}},
            "counters_total": self.counter_totals(),
            "samples": {**batches.samples(),
                        "busy_s": self.runner.busy.take(self.clock.now(), reset)},
            "batch_sizes": {m: dict(h) for m, h in batches.batch_histogram.items()},
            "busy_total_s": self.runner.busy.total(self.clock.now()),
            # batches handed to the executor as one slice of a staging slot (no assembly copy)
            "staged_batches": self.runner.staged_batches,
            "clock": self.clock.stats(),
            **self.follower.stats.snapshot(reset),
            "counters": counters,
        }
        if reset:
            batches.clear()
            for key, value in counters.items():
                self._counted_before_reset[key] = self._counted_before_reset.get(key, 0) + value
            self._host_stats.reset()
        return out

    def _counters(self) -> dict[str, int]:
        return {**self.follower.counters, **self.counters, **self.lifecycle.counters}

    def counter_totals(self) -> dict[str, int]:
        """The counters since the process started (``stats(reset=True)`` zeroes the live ones)."""
        return {key: self._counted_before_reset.get(key, 0) + value
                for key, value in self._counters().items()}


# --------------------------------------------------------------------------- entry points


async def _main(config: RoleConfig, control_address: str | None) -> int:
    """Serve (``_serve``); then, if a batch still held the executor's worker thread when the
    host closed, leave at once (``_exit_stuck``), everything else being closed by then."""
    built: list[BackendHost] = []  # the host, once _serve built it
    try:
        return await _serve(config, control_address, built)
    finally:
        if built and built[0].stuck:
            _exit_stuck(config.name)


async def _serve(config: RoleConfig, control_address: str | None,
                 built: list[BackendHost]) -> int:
    """The backend's steps in ``RoleSession``'s order: bind, build and warm, Ready, clock,
    serve, drain. The host it builds is appended to ``built``."""
    name = config.name
    async with RoleSession.open(config, control_address, role=ROLE) as session:
        # Plain sockets on the reactor (the control link shadows the context with zmq.asyncio).
        reactor = SocketReactor(asyncio.get_running_loop())
        session.closing(reactor.close)
        plan_sock, plan_address = make_router(session.ctx, config.bind["plan"],
                                              name=f"{name} plan",
                                              advertise_host=config.advertise_host)
        reply_allowance_s = config.cluster.frontends.reply_allowance_ms / 1e3
        served = [m for m in config.models if config.serve is None or m.name in config.serve]
        groups = backend_groups(config.cluster.prefix_groups, served,
                                cache_dir() / "prefix-groups")
        host = BackendHost(name=name, device=config.device,
                           kind=config.kind,
                           executor=build_executor(config.device, groups.models,
                                                   config.cluster.backends.onnx_io, config.kind),
                           ctx=session.ctx, plan_sock=plan_sock, plan_address=plan_address,
                           reactor=reactor, shed_grace_s=SHED_GRACE_FRACTION * reply_allowance_s,
                           report=session.link.send)
        host.grouped = groups.grouped
        built.append(host)
        session.closing(host.close)
        session.serve_stats(host.stats)
        session.on_control(host.on_control_message)
        # Loading blocks the loop on purpose: nothing else may happen before Ready.
        host.load_and_warm(config.models)
        peers = {**config.peers, **await session.ready({"plan": plan_address})}
        if session.drain.requested:
            return EXIT_DRAINED
        # The plan timer and every timestamp use the cluster clock: estimate it before serving.
        if not await session.sync_clock(host.clock, peers):
            return session.exit_code
        ranks = peer_map.endpoints_of(peers, "rank")
        assert ranks, "no rank in the peer map"
        host.start(ranks, list(peer_map.endpoints_of(peers, "data").values()))
        drain = await session.drained()
        await host.drain(drain.drain_s)
        return 0


async def _no_report(report: ModelReport) -> None:
    """A backend without a supervisor: the log says what became of each command."""
    log.info("%s: %s is %s %s", report.name, report.model, report.state, report.message)


def _exit_stuck(name: str) -> None:
    """A wedged batch holds the executor's worker thread, which the interpreter would join at
    exit forever: leave now (sockets are closed; the frontends' deadline timers answer the
    batch's requests)."""
    log.error("%s: a batch is still running after the drain; exiting without it", name)
    logging.shutdown()
    os._exit(1)


def run_backend(config: RoleConfig, control_address: str | None) -> int:
    """Run one backend process until it is told to stop; returns the exit code."""
    return runner.run_role(_main(config, control_address), name=config.name)


def main(argv: list[str]) -> int:
    """``zserve backend``: run backend ``--index`` of a cluster.toml on its own."""
    parser = role_parser("zserve backend", main.__doc__)
    parser.add_argument("--bind", default=None, help="plan socket bind address")
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="cpu, cuda:N or emulated (overrides backends.device; a pod with "
                             "one GPU: cuda:0)")
    args = parser.parse_args(argv)
    config = role_config_from_args(args, ROLE)
    if args.bind:
        config.bind["plan"] = args.bind
    if args.device:
        if not DEVICE_RE.match(args.device) or args.device == "cuda":
            parser.error(f"--device: must be cpu, emulated or cuda:N, got {args.device!r}")
        config.device = args.device
    return run_backend(config, args.control)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["INPUT_WAIT_S", "BackendHost", "BusyMeter", "build_executor", "configured_profile",
           "main", "run_backend", "shed_late_rows"]
