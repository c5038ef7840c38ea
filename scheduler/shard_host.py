"""A scheduler shard: ``ShardHost`` hosts the ModelThreads of the models hashed to it.

Its process (``zserve.scheduler.shard_process.run_shard``, ``zserve scheduler``) binds the
``shard`` ROUTER, to which frontends connect (DEALER identity = frontend name). Model ``m`` lives
on shard ``zserve.config.cluster.shard_for_model(m, shards)``; frontends send its requests' metadata
straight there.

- Frontend -> shard: ``RequestMetaBatch`` (one per frontend per loop tick). The shard drains every
  queued message, then feeds each (model, frontend) chunk to its ModelThread in one call. The
  frontend's ``data`` address -- where backends fetch inputs -- is ``RequestMetaBatch.frontend``
  (a bare frontend name is looked up in the peer map as ``<frontend>/data``); it is the key under
  which the ModelThread knows the frontend, so a BatchPlan names data addresses, and drops go back
  to the DEALER identity that sent the metadata.
- Shard <-> rank: ``CandidateUpdate``, ``GrantAnswer`` out, ``GrantGpu``, ``BackendTable`` in, over
  a DEALER (identity = shard name); nothing waits for an answer. A restarted rank's first tables
  lack backends not yet registered again: ``scheduler.rank_rejoin`` keeps those for a grace.
- Shard -> backends: ``BatchPlan`` over a DEALER per backend ``plan`` address from the table
  (connected when a backend appears, closed when it leaves).
- Frontend -> shard: ``CancelQueued`` (one per frontend per tick, after its RequestMetaBatch):
  cancelled requests leave their ModelThread's queue before a batch takes them (``cancelled``).
- Shard -> frontends: ``DropNotice`` (``DEADLINE`` from the ModelThread; ``UNAVAILABLE`` for a model
  no live backend serves; ``SHUTTING_DOWN`` while draining; ``BACKEND_FAILED`` for the requests of
  the plans it sent to a backend that then left the ``BackendTable``: the frontends fail the
  requests a backend had fetched, but only the shard knows those planned onto it and not yet
  fetched, e.g. plans queued for a backend that died).
- Backends -> shard: ``BatchStats`` of each plan the shard sent, once the batch's answer went
  out (its ModelThread learns when the batch really ended: ``AnswerEchoes``; with the rank
  embedded the shard hands it to the rank too, as the backend sends it only once), and each
  plan's acknowledgement over the same DEALERs, from each backend's batch loop: on its next
  ``BatchStats`` to this shard (``acked_plan_ids``) or alone (``PlanAck``) once held
  ``zserve.backends.held_acks.ACK_HOLD_S``. A plan not
  acknowledged within d_ctrl + ``PLAN_ACK_MARGIN_S`` makes the shard
  suspect that backend (stopped or wedged): it sends ``BackendSuspect`` to the rank (which stops
  granting the GPU and broadcasts the table without it), takes the GPU out of its ModelThreads,
  and puts the requests of every plan the backend never acknowledged back into their queue
  (``replanned``; ``UNAVAILABLE`` when no live backend serves the model any more). Only those of
  plans it acknowledged (it holds their inputs) are answered ``BACKEND_FAILED``; the same split
  applies when a backend leaves the table. (That bookkeeping is the part
  ``zserve.scheduler.shard_acks.ShardPlanAcks``.)

The scheduling itself is ``zserve.scheduler.core.SchedulerCore`` (the ModelThreads, the refusals,
the metadata split), the core the simulator and ``bench-scheduler`` host too; ``ShardHost`` feeds
it what comes off the sockets and delivers what it emits through one
``zserve.runtime.driver.CoreDriver``, whose one precise timer is armed at the core's ``wake_at``.

Time: every time this process handles (arrivals, deadlines, ``exec_at``, ``now``) is on the cluster
clock (``zserve.runtime.clock``: the rank's CLOCK_MONOTONIC); a shard apart from the rank estimates
its offset before it takes requests, and arms the core's timer at the local time of its
``wake_at``.

Latency profiles: a ModelThread uses the model's configured profile (profile file or emulated
alpha/beta) until backends register, then the slowest registered profile of those serving the
model (element-wise maximum of l(b), up to the smallest max batch), as the authors merge them.

With ``embedded_rank`` (``shards = 0``) the process also binds ``rank`` and hosts the RankThread
(``rank_host.RankHost``); ModelThread <-> RankThread messages are then handed over in-process
(shard -> rank synchronously as the outbox is delivered, rank -> shard through a queue drained on
the next loop iteration, so neither side re-enters the other). For the core the rank is remote
either way: its messages for the rank stay in the outbox.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import zmq

from zserve.config.cluster import ClusterConfig, ModelConfig, shard_for_model
from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile, configured_profile
from zserve.core.allowances import LEARNED
from zserve.core.errors import ErrorKind, ProtocolError, ZServeError
from zserve.core.groups import group_by_frontend
from zserve.core.hosting import DEST_BACKEND, DEST_FRONTEND, TO_RANK, Outbox
from zserve.core.stats import Stats
from zserve.runtime import control_link
from zserve.runtime.clock import ClusterClock
from zserve.runtime.driver import CoreDriver
from zserve.runtime.runner import cancel_all, spawn
from zserve.runtime.session import SOCKET_CLOSE_LINGER_MS
from zserve.runtime.timers import WakeTimer
from zserve.scheduler.core import SchedulerCore
from zserve.scheduler.kind_profiles import served_profiles
from zserve.scheduler.learned_allowances import ShardAllowances
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.rank_host import RankHost
from zserve.scheduler.rank_rejoin import RankRejoin
from zserve.scheduler.sent_plans import PLAN_ACK_MARGIN_S
from zserve.scheduler.shard_acks import ShardPlanAcks
from zserve.transport.messages import (
    BackendTable,
    BatchPlan,
    BatchStats,
    CancelQueued,
    DropNotice,
    GrantGpu,
    Heartbeat,
    Hello,
    Message,
    PlanAck,
    RequestMetaBatch,
    StatsReply,
    StatsRequest,
)
from zserve.transport.reactor import Chunk, SocketReactor
from zserve.transport.sockets import make_dealer

log = logging.getLogger(__name__)

ROLE = "shard"
# While draining, how often the shard checks whether its queues are empty.
DRAIN_POLL_S = 0.01
SHARD_COUNTERS = (
    "meta_batches", "requests", "plans", "planned_requests", "dropped", "unavailable",
    "shutting_down", "send_dropped", "bad_messages", "unknown_model", "backend_failed",
    "cancelled", "replanned", "suspects", "plan_acks", "gpus_kept",
    # the ack timer ran late by a stall of this process, credited to the awaited acknowledgements
    "ack_stall_credits",
    # a standby's: metadata it ignored (the frontends re-send it to the active scheduler);
    # a superseded one's: plans it made but never sent (zserve.core.epochs)
    "standby_ignored", "fenced_plans",
    # metadata of an older scheduler epoch than this one's: its frontend re-sends what is
    # still queued once it hears this epoch (zserve.core.epochs)
    "stale_epoch",
)
# meta_delay: request admitted -> its metadata handled here (frontend tick + hop); grant_slack:
# what was left of the candidate's grant window when the grant came (negative: too late).
SHARD_HISTOGRAMS = {"meta_delay": "signed", "grant_slack": "signed"}
# A ModelThread holds a candidate back until this long before the rank needs it (its model
# timer at exec - delay(bs)): well above the shard -> rank hop (0.1 ms p50, ~0.3 ms p99 idle;
# see docs/performance.md, "Hops one message at a time"), and the rank counts candidates that
# still come late (``late_candidates``).
PUBLISH_LEAD_S = 0.002
# Plan ids carry the shard index in their low bits (plan_id = seq * MAX_SHARDS + index).
MAX_SHARDS = 1024


class ShardHost:
    """The SchedulerCore of one shard on its sockets; see the module docstring."""

    # The rank's latest table (a model added later is served from it).
    _last_table: BackendTable | None = None
    # GPU id -> its backend's name as the rank knows it (for an embedded rank's BatchStats)
    backend_names: Mapping[int, bytes] = MappingProxyType({})

    def __init__(
        self,
        *,
        name: str,
        ctx: zmq.Context[zmq.Socket[bytes]],
        sock: zmq.Socket[Any],
        reactor: SocketReactor,
        cluster: ClusterConfig,
        models: list[ModelConfig],
        peers: dict[str, str],
        index: int = 0,
        clock: ClusterClock | None = None,
        plan_ack_margin_s: float = PLAN_ACK_MARGIN_S,
    ) -> None:
        self.name = name
        self.plan_ack_margin_s = plan_ack_margin_s
        self.clock = clock if clock is not None else ClusterClock()
        self.identity = name.encode()
        self.ctx = ctx
        self.sock = sock
        self.reactor = reactor
        self.loop = asyncio.get_running_loop()
        self.peers = peers
        self._read_scheduling(cluster)
        self.models = {m.name: m for m in models}
        self._stats = Stats(SHARD_COUNTERS, SHARD_HISTOGRAMS)
        self.counters = self._stats.counters
        self.core = self._make_core(name, cluster)
        self.driver = CoreDriver(self.core, loop=self.loop, clock=self.clock,
                                 deliver=self._deliver)
        self.frontends: dict[str, bytes] = {}  # frontend data address -> DEALER identity
        # Plans out, PlanAcks and BatchStats in (outputs go to the frontends, not here).
        self.backend_socks: dict[int, tuple[str, zmq.Socket[Any]]] = {}
        # so that a backend leaving the table fails the requests planned onto it, and one that
        # does not acknowledge a plan in time is suspected (its timer: the earliest ack due)
        self.acks = ShardPlanAcks(self.ack_allowance_s, self.counters)
        self._ack_timer = WakeTimer(self.loop, self.acks, self._on_ack_timer, self.clock)
        self.rank_sock: zmq.Socket[Any] | None = None
        self.rank_local: RankHost | None = None
        self.index = index
        # One plan-id counter for all of this shard's ModelThreads: seq * MAX_SHARDS + index
        # (seq = 1, 2, ...), unique in the cluster (see ModelThread, "Plan ids").
        self._plan_ids = itertools.count(MAX_SHARDS + index, MAX_SHARDS)
        self._from_rank: deque[Message] = deque()
        self._pump_scheduled = False
        self._tasks: list[asyncio.Task[None]] = []
        # active: False while the standby of a pair; fenced: superseded, it sends no plan
        # again (zserve.core.epochs); first_plan_at: its first plan (a takeover's end).
        self.active, self.fenced, self.first_plan_at = True, False, 0.0
        self._table_epoch = 0  # the newest epoch of the rank's tables (a rank of its own)
        self._rejoin = RankRejoin(self.counters)  # a restarted rank's first tables lack backends
        self._meta_delay = self._stats.histograms["meta_delay"]
        self._grant_slack = self._stats.histograms["grant_slack"]
        now = self.clock.now()
        outbox: Outbox = []
        for model in models:
            profile = configured_profile(model)
            if profile is not None:
                self._make_thread(model, profile, now, outbox)
        self.driver.flush(outbox)

    @property
    def threads(self) -> dict[str, ModelThread]:
        """The core's ModelThreads by model (read-only use: stats, tests)."""
        return self.core.threads

    # ------------------------------------------------------------------ set-up

    def _read_scheduling(self, cluster: ClusterConfig) -> None:
        """The cluster's scheduling settings every ModelThread of this shard gets (seconds)."""
        sched = cluster.scheduler
        self.policy = SchedulePolicy.parse(sched.policy, sched.drop)
        self.d_ctrl_s = sched.d_ctrl_ms / 1e3
        self.jitter_s = sched.jitter_ms / 1e3
        # A plan's acknowledgement is due this long after the shard sent it: its delivery
        # allowance (the ModelThreads plan with it) and the margin of sent_plans.
        self.ack_allowance_s = self.d_ctrl_s + self.plan_ack_margin_s
        self.reply_allowance_s = cluster.frontends.reply_allowance_ms / 1e3
        self.cluster = cluster

    def _make_core(self, name: str, cluster: ClusterConfig) -> SchedulerCore:
        """The scheduling core, learning its allowances unless ``allowances = "fixed"``."""
        core = SchedulerCore(name, self.models, counters=self.counters)
        if cluster.scheduler.allowances == LEARNED:
            core.allowances = ShardAllowances(self.clock.now(), self.d_ctrl_s, self.jitter_s,
                                              self.reply_allowance_s)
        return core

    def _make_thread(self, model: ModelConfig, profile: LatencyProfile, now: float,
                     outbox: Outbox) -> None:
        slo_s = model.slo_ms / 1e3
        # a model added late plans with the allowances learned so far
        learned = self.core.allowances
        d_ctrl_s, jitter_s, reply_s = ((self.d_ctrl_s, self.jitter_s, self.reply_allowance_s)
                                       if learned is None else learned.applied)
        thread = ModelThread(
            model.name, profile, slo_s, self.policy, d_ctrl_s=d_ctrl_s,
            d_data_s=self.cluster.d_data_ms_of(model) / 1e3,
            jitter_s=jitter_s,
            budget_s=slo_s - reply_s - d_ctrl_s,
            plan_ids=self._plan_ids, publish_lead_s=PUBLISH_LEAD_S,
        )
        self.core.add_thread(now, thread, outbox)

    def connect_rank(self, address: str) -> None:
        self.rank_sock = make_dealer(self.ctx, address, identity=self.identity, peer_role="rank")
        self.reactor.watch(self.rank_sock, router=False, on_chunk=self._on_rank_chunk,
                           on_bad=self._on_bad)
        self._send(self.rank_sock, Hello(role=ROLE, name=self.name, pid=os.getpid()))
        spawn(self._tasks, self._rank_heartbeat_loop())

    async def _rank_heartbeat_loop(self) -> None:
        """Heartbeats let a restarted rank discover this shard (it answers an unknown peer's
        heartbeat with Hello)."""
        seq = 0
        while self.rank_sock is not None:
            seq += 1
            self._send(self.rank_sock, Heartbeat(self.name, seq, self.clock.now()))
            await asyncio.sleep(control_link.HEARTBEAT_INTERVAL_S)

    def embed_rank(self, host: RankHost) -> None:
        self.rank_local = host

    def deliver_from_rank(self, msg: Message) -> None:
        """The embedded RankHost's way in: queue, handle on the next loop iteration."""
        self._from_rank.append(msg)
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self.loop.call_soon(self._pump_from_rank)

    def _pump_from_rank(self) -> None:
        self._pump_scheduled = False
        messages = list(self._from_rank)
        self._from_rank.clear()
        self._on_rank_chunk([(None, m) for m in messages])

    def start(self) -> None:
        self.reactor.watch(self.sock, router=True, on_chunk=self._on_frontend_chunk,
                           on_bad=self._on_bad)

    async def close(self) -> None:
        """Stop receiving and the timers; close the DEALERs (the caller closes ``sock``)."""
        self.driver.close()
        self._ack_timer.cancel()
        self.reactor.unwatch(self.sock)
        await cancel_all(self._tasks)
        for _, sock in self.backend_socks.values():
            self.reactor.unwatch(sock)
            sock.close(linger=SOCKET_CLOSE_LINGER_MS)
        self.backend_socks.clear()
        if self.rank_sock is not None:
            self.reactor.unwatch(self.rank_sock)
            self.rank_sock.close(linger=SOCKET_CLOSE_LINGER_MS)
            self.rank_sock = None

    # ------------------------------------------------------------------ frontends

    def _on_bad(self, exc: ZServeError) -> None:
        self.counters["bad_messages"] += 1
        log.warning("%s: bad message: %s", self.name, exc)

    def _on_frontend_chunk(self, chunk: Chunk) -> None:
        now = self.clock.now()
        outbox: Outbox = []
        metas: list[RequestMetaBatch] = []  # merged per (model, frontend) by the core
        # (model, data address) -> cancelled ids, applied after the arrivals (a request may be
        # admitted and cancelled in one frontend tick: its metadata comes first)
        cancels: dict[tuple[str, str], list[int]] = {}
        for identity, msg in chunk:
            assert identity is not None
            if self._ignored(msg):
                continue
            if type(msg) is RequestMetaBatch:
                assert isinstance(msg, RequestMetaBatch)
                if self._take_meta(now, identity, msg):
                    metas.append(msg)
            elif type(msg) is CancelQueued:
                assert isinstance(msg, CancelQueued)
                for rid, model in zip(msg.request_ids, msg.models, strict=True):
                    cancels.setdefault((model, msg.frontend), []).append(rid)
            elif type(msg) is StatsRequest:
                assert isinstance(msg, StatsRequest)
                self._send(self.sock, StatsReply(self.name, self.stats(msg.reset)), identity)
            elif type(msg) not in (Hello, Heartbeat):
                log.warning("%s: unexpected %s from %r", self.name, type(msg).__name__, identity)
        self.core.on_metas(now, metas, outbox)
        # one already planned is the frontend's to handle (its backend finds no inputs, or
        # gets CancelFetched)
        for (model, address), ids in cancels.items():
            self.core.on_cancel(now, model, address, ids, outbox)
        self.driver.flush(outbox)

    def _take_meta(self, now: float, identity: bytes, msg: RequestMetaBatch) -> bool:
        """Count a frontend's RequestMetaBatch and note its route; False: malformed."""
        if msg.rows and len(msg.rows) != len(msg.request_ids):
            self._on_bad(ProtocolError(f"RequestMetaBatch: {len(msg.rows)} rows for "
                                       f"{len(msg.request_ids)} requests"))
            return False
        self.counters["meta_batches"] += 1
        self.counters["requests"] += len(msg.request_ids)
        if msg.arrivals:  # admission of the tick's last request -> here
            self._meta_delay.observe(now - max(msg.arrivals))
        self.frontends[msg.frontend] = identity
        return True

    def _drop_now(self, address: str, ids: list[int], kind: ErrorKind, why: str) -> None:
        identity = self.frontends.get(address)
        if identity is not None:
            self._send(self.sock, DropNotice(ids, kind.value, why), identity)

    # ------------------------------------------------------------------ rank

    def _on_rank_chunk(self, chunk: Chunk) -> None:
        now = self.clock.now()
        outbox: Outbox = []
        for _, msg in chunk:
            if type(msg) is GrantGpu:
                assert isinstance(msg, GrantGpu)
                thread = self.core.threads.get(msg.model)
                if thread is None:
                    log.error("%s: grant for model %r, which it does not host", self.name,
                              msg.model)
                    continue
                # How much of the candidate's grant window was left when the grant came
                # (negative: too late for this batch; the ModelThread shrinks or drops it).
                window_left = thread.grant_window_left(now)
                if window_left is not None:
                    self._grant_slack.observe(window_left)
                self.core.on_grant(now, msg, outbox)
            elif type(msg) is BackendTable:
                assert isinstance(msg, BackendTable)
                self._on_backend_table(now, self._rejoin.on_table(now, msg), outbox)
            elif type(msg) is Hello and self.rank_sock is not None:
                # A restarted rank asks who we are; our candidates reach it on their next change.
                spawn(self._tasks, self._rejoin_grace(self._rejoin.on_rank_hello(now) - now))
                self._send(self.rank_sock, Hello(role=ROLE, name=self.name, pid=os.getpid()))
            elif type(msg) is not Heartbeat:
                log.warning("%s: unexpected %s from rank", self.name, type(msg).__name__)
        self.driver.flush(outbox)

    def _ignored(self, msg: Message) -> bool:
        """Requests a standby ignores, and metadata of an older epoch than this embedded
        scheduler's (sent to a process that died or was superseded): either way the frontend
        re-sends what is still queued once it hears the active epoch. (Epoch 0: a frontend that
        has heard of none yet. Shards of their own keep their queues across a rank restart:
        nothing is re-sent to them.)"""
        if type(msg) in (RequestMetaBatch, CancelQueued) and not self.active:
            self.counters["standby_ignored"] += 1
            return True
        if type(msg) is RequestMetaBatch and self.rank_local is not None and (
                0 < msg.epoch < self.rank_local.epoch):
            self.counters["stale_epoch"] += 1
            return True
        return False

    @property
    def epoch(self) -> int:
        """The scheduler epoch this shard plans in (its rank's)."""
        return self.rank_local.epoch if self.rank_local is not None else self._table_epoch

    async def _rejoin_grace(self, grace_s: float) -> None:
        """Then the restarted rank's latest table applies as it is (``rank_rejoin``)."""
        await asyncio.sleep(grace_s)
        if (table := self._rejoin.on_grace_over(self.clock.now())) is not None:
            outbox: Outbox = []
            self._on_backend_table(self.clock.now(), table, outbox)
            self.driver.flush(outbox)

    def _on_backend_table(self, now: float, table: BackendTable, outbox: Outbox) -> None:
        self._table_epoch = max(self._table_epoch, table.epoch)
        live = dict(zip(table.gpu_ids, table.addresses, strict=True))
        self.backend_names = {g: n.encode() for g, n in zip(table.gpu_ids, table.names,
                                                             strict=True)}
        departed: list[tuple[int, str]] = []
        for gpu_id in list(self.backend_socks):
            address, sock = self.backend_socks[gpu_id]
            if live.get(gpu_id) != address:
                self.reactor.unwatch(sock)
                sock.close(linger=SOCKET_CLOSE_LINGER_MS)
                del self.backend_socks[gpu_id]
                departed.append((gpu_id, address))
        for gpu_id, address in live.items():
            if gpu_id not in self.backend_socks:
                sock = make_dealer(self.ctx, address, identity=self.identity,
                                   peer_role="backend")
                self.backend_socks[gpu_id] = (address, sock)
                self.reactor.watch(sock, router=False, on_bad=self._on_bad,
                                   on_chunk=functools.partial(self._on_backend_chunk, gpu_id))
        self._serve_table(now, table, outbox)
        # After the ModelThreads know the GPUs that are left: a plan put back is not granted to
        # a departed GPU again, and a model nobody serves any more answers UNAVAILABLE.
        for gpu_id, address in departed:
            self._release_plans(now, gpu_id, f"GPU {gpu_id} ({address}) left the cluster",
                                outbox)

    def add_model(self, config: ModelConfig) -> None:
        """A model added after start (``ModelAdded``), if this shard owns it: scheduled once a
        backend registers it (the latest table may list it already)."""
        if config.name in self.models or shard_for_model(
                config.name, self.cluster.scheduler.shards) != self.index:
            return
        self.models[config.name] = config
        self.core.known.add(config.name)
        log.info("%s: model %s added", self.name, config.name)
        if self._last_table is not None:
            outbox: Outbox = []
            self._serve_table(self.clock.now(), self._last_table, outbox)
            self.driver.flush(outbox)

    def _serve_table(self, now: float, table: BackendTable, outbox: Outbox) -> None:
        """The GPUs serving each model and its profiles, from the table: its own (the slowest
        backend's, element-wise) and, for GPUs of another announced kind, that kind's
        (``zserve.scheduler.kind_profiles``)."""
        self._last_table = table
        found = served_profiles(table, {n: c.max_batch for n, c in self.models.items()})
        self.core.set_served(now, found.served, outbox)
        for name, config in self.models.items():
            profile = found.own.get(name)
            if name in self.core.threads:
                if profile is not None:
                    self.core.set_profile(name, profile)
            else:
                profile = profile or configured_profile(config)
                if profile is None:
                    continue
                self._make_thread(config, profile, now, outbox)
            if name in self.core.threads:
                self.core.threads[name].set_gpu_profiles(found.by_gpu.get(name, {}))

    # ------------------------------------------------------------------ acknowledgements

    def _release_plans(self, now: float, gpu_id: int, why: str, outbox: Outbox) -> None:
        """The backend of ``gpu_id`` is gone or suspect: its acknowledged plans' requests are
        answered BACKEND_FAILED, the others go back to their ModelThreads (``ShardPlanAcks``)."""
        for plan in self.acks.release(now, gpu_id, why, outbox):
            self.core.replan(now, plan, why, outbox)

    def _on_backend_chunk(self, gpu_id: int, chunk: Chunk) -> None:
        """Acknowledgements and batch reports from the backend of ``gpu_id``. An embedded rank
        reads the chunk's reports first (the backend sent them to this process only): when the
        device really frees reaches it before what the reports make the ModelThreads ask."""
        backend = self.backend_names.get(gpu_id)
        if self.rank_local is not None and backend is not None:
            reports: list[Message] = [m for _, m in chunk if type(m) is BatchStats]
            if reports:
                self.rank_local.on_backend_reports(backend, reports)
        outbox: Outbox = []
        for _, msg in chunk:
            if type(msg) is PlanAck:
                assert isinstance(msg, PlanAck)
                self._acknowledge(msg.plan_ids, msg, outbox)
            elif type(msg) is BatchStats:
                assert isinstance(msg, BatchStats)
                if msg.acked_plan_ids:
                    self._acknowledge(msg.acked_plan_ids, msg, outbox)
                self.core.on_batch_stats(self.clock.now(), msg, outbox)
            elif type(msg) is not Hello:
                log.warning("%s: unexpected %s from GPU %d", self.name, type(msg).__name__,
                            gpu_id)
        self.driver.flush(outbox)
        self._ack_timer.sync()

    def _acknowledge(self, plan_ids: list[int], ready: PlanAck | BatchStats,
                     outbox: Outbox) -> None:
        """A backend acknowledged these plans; ``ready`` carries its ready-delay samples (the
        learned d_ctrl; those of other shards' models are ignored by the core; what they send
        goes out with the chunk's other replies)."""
        self.acks.acknowledge(plan_ids)
        if not ready.ready_models or self.core.allowances is None:
            return
        now = self.clock.now()
        for model, delay_s, rows in zip(ready.ready_models, ready.ready_delays, ready.ready_rows,
                                        strict=True):
            self.core.note_ready(now, model, delay_s, rows, outbox)

    def _on_ack_timer(self) -> None:
        """A plan's acknowledgement is due. Read what the backends sent before judging: after a
        stall of this process the timer and an acknowledgement that came meanwhile are ready
        together, and the timer may run first. A timer that ran late by a stall credits it to
        the backends first (``ShardPlanAcks.credit_stall``)."""
        now = self.clock.now()
        if self.acks.credit_stall(now) > 0.0:
            self.counters["ack_stall_credits"] += 1
        for gpu_id, _, _ in self.acks.overdue(now):
            entry = self.backend_socks.get(gpu_id)
            if entry is not None:
                self.reactor.kick(entry[1])
        self.loop.call_soon(self._judge_acks)

    def _judge_acks(self) -> None:
        """Suspect the backend of each plan still unacknowledged: the rank told first, then the
        GPU out of the ModelThreads, then its plans released."""
        now = self.clock.now()
        outbox: Outbox = []
        for gpu_id, plan_id, sent_at in self.acks.overdue(now):
            address = self.backend_socks[gpu_id][0] if gpu_id in self.backend_socks else "?"
            why = self.acks.suspect(now, gpu_id, plan_id, sent_at, address, outbox)
            log.warning("%s: %s: suspect", self.name, why)
            self.core.remove_gpu(now, gpu_id, outbox)
            self._release_plans(now, gpu_id, why, outbox)
        self.driver.flush(outbox)
        self._ack_timer.sync()

    # ------------------------------------------------------------------ output

    def _deliver(self, outbox: Outbox) -> None:
        """The core's outbox: plans to the backends, drops to the frontends, and the rank's
        messages to it (the embedded RankHost, or over the rank DEALER) last."""
        to_rank: list[Message] = []
        for (kind, key), msg in outbox:
            if (kind, key) == TO_RANK:
                to_rank.append(msg)
            elif kind == DEST_BACKEND:
                assert isinstance(msg, BatchPlan)
                self._send_plan(int(key), msg)
            elif kind == DEST_FRONTEND:
                self._send_to_frontend(str(key), msg)
            else:
                log.error("%s: message for unknown destination %r", self.name, (kind, key))
        outbox.clear()
        if to_rank:
            if self.rank_local is not None:
                self.rank_local.on_local(to_rank)
            elif self.rank_sock is not None:
                for msg in to_rank:
                    self._send(self.rank_sock, msg)

    def _send_to_frontend(self, address: str, msg: Message) -> None:
        if isinstance(msg, DropNotice) and msg.error == ErrorKind.DEADLINE.value:
            # a ModelThread's drop (the core's refusals and released plans count on their own)
            self.counters["dropped"] += len(msg.request_ids)
        identity = self.frontends.get(address)
        if identity is None:
            log.error("%s: no route to frontend %r", self.name, address)
        else:
            self._send(self.sock, msg, identity)

    def _send_plan(self, gpu_id: int, plan: BatchPlan) -> None:
        if self.fenced:  # superseded: the backends would refuse it anyway
            self.counters["fenced_plans"] += 1
            return
        entry = self.backend_socks.get(gpu_id)
        if entry is not None and self._send(entry[1], plan):
            if not self.first_plan_at:
                self.first_plan_at = self.clock.now()
            self.counters["plans"] += 1
            self.counters["planned_requests"] += len(plan.request_ids)
            model = self.models.get(plan.model)
            slo_s = model.slo_ms / 1e3 if model is not None else 0.0
            self.acks.remember(self.clock.now(), gpu_id, plan, slo_s)
            self._ack_timer.sync()
            return
        # The backend left (or cannot take it): its requests will not run.
        for f, ids in group_by_frontend(plan.request_ids, plan.request_frontend).items():
            self._drop_now(plan.frontends[f], ids, ErrorKind.UNAVAILABLE,
                           f"GPU {gpu_id} is gone; the batch was not sent")

    def _send(self, sock: zmq.Socket[Any], msg: Message, identity: bytes | None = None) -> bool:
        error = self.reactor.send_nowait(sock, msg, identity)
        if error is None:
            return True
        self.counters["send_dropped"] += 1
        log.warning("%s: dropped %s to %r: %s", self.name, type(msg).__name__, identity, error)
        return False

    # ------------------------------------------------------------------ drain and stats

    def queued(self) -> int:
        return self.core.queued()

    async def drain(self, drain_s: float) -> None:
        """Refuse new requests; keep scheduling the queued ones for up to ``drain_s``; answer
        what is still queued then ``SHUTTING_DOWN``."""
        self.core.draining = True
        deadline = time.monotonic() + drain_s
        while self.queued() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self.driver.run(self.core.shed_queued)

    def stats(self, reset: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": ROLE,
            "name": self.name,
            "clock": self.clock.stats(),
            "active": self.active and not self.fenced,
            "epoch": self.epoch,
            "first_plan_at": self.first_plan_at,
            "sent_plans_held": len(self.acks),
            "models": {
                name: {
                    "queued": t.queue_length,
                    "arrived": t.n_arrived,
                    "dropped": t.n_dropped,
                    "cancelled": t.n_cancelled,
                    "replanned": t.n_replanned,
                    "planned": t.n_planned,
                    "batches": t.n_batches,
                    "window_misses": t.n_window_misses,
                    "miss_margin_ms": t.miss_margin_s * 1e3,
                    "defer_loss": round(t.defer_loss, 4),
                    # deferred: why each batch started when it did (candidate_sizing.py)
                    "decisions": {k: n for k, n in t.sizing.decisions.items() if n},
                    "deferred_wait_ms": round(t.sizing.deferred_wait_s * 1e3, 3),
                    # the mean time its requests had from arrival to deadline (an app stage's:
                    # its share of what was left of the app's SLO)
                    "mean_budget_ms": (round(t.budget_sum_s / t.n_arrived * 1e3, 3)
                                       if t.n_arrived else None),
                    "target": t.target,
                    "rate_rps": t.meter.rate(),  # the rate meter's; None before its first bucket
                    "max_batch": t.profile.max_batch,
                    "gpus": list(self.core.served.get(name, [])),
                    # l(1) of its own profile, and of its profile on GPUs of another kind
                    "l1_ms": t.profile.latency(1) * 1e3,
                    "gpu_l1_ms": {str(g): p.latency(1) * 1e3
                                  for g, p in t.gpu_profiles.items()},
                }
                for name, t in self.core.threads.items()
            },
        }
        if self.rank_local is not None:
            out["rank"] = self.rank_local.stats(reset)
        out["allowances"] = self._allowances_summary()
        out.update(self._stats.snapshot(reset))
        return out

    def _allowances_summary(self) -> dict[str, Any]:
        """The allowances the ModelThreads plan with (ms), learned or fixed."""
        learned = self.core.allowances
        if learned is None:
            return {"mode": "fixed", "d_ctrl": {"value_ms": self.d_ctrl_s * 1e3},
                    "jitter": {"value_ms": self.jitter_s * 1e3}}
        return learned.summary(self.clock.now())
