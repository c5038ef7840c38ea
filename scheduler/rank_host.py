"""The rank process: hosts the RankThread (GPU free times, one candidate per model, matching).

``run_rank(config, control_address)`` (``zserve rank``) binds the ``rank`` ROUTER. Its peers, all
DEALERs whose identity is their process name:

- shards send ``Hello`` on connect, then ``CandidateUpdate`` and ``GrantAnswer``; they receive
  ``GrantGpu`` (for the models whose candidates they sent) and ``BackendTable``;
- backends send ``BackendRegister`` (device, plan address, models, profiles), ``Heartbeat`` and
  ``BatchStats``; a backend's GPU id is its index in the cluster config, so a restarted rank
  gives every backend the id it had whatever order they register in (a backend that registers
  again under the same name keeps its id); the rank removes a backend that has not heartbeated for
  ``BACKEND_TIMEOUT_S``. A BatchStats' ``device_free_at`` (when the backend projects its device
  free, having started batches later than planned) moves the GPU's free time in the RankThread
  later, never earlier (``RankThread.on_device_free_at``; counted in ``rank_thread`` stats as
  ``drift_corrections`` / ``drift_corrected_ms``): without it the rank's belief, built from
  planned finishes only, falls behind the device under saturation and every batch starts later;
- frontends send ``Hello`` and receive ``BackendTable`` (so they can fail the requests a removed
  backend held);
- every other process's clock DEALER (identity ``<name>.clock``) sends ``ClockProbe``; the rank
  answers each at once with a ``ClockReply`` (its CLOCK_MONOTONIC is the cluster clock, see
  ``zserve.runtime.clock``).

A backend leaves the table when it stops heartbeating for ``BACKEND_TIMEOUT_S``, or at once when
the supervisor says its process died (``BackendGone(name)`` on the control link), or when a shard
suspects it (``BackendSuspect``: it did not acknowledge a plan within the plan's allowance, so its
batch loop is stopped or wedged): the shards then plan again the requests of the plans it never
acknowledged and answer those of the plans it did ``BACKEND_FAILED``. A suspect backend comes
back with the first heartbeat it sends after the rank heard of the suspicion (``revivals``); a
removed one with its next heartbeat.

A restarted rank knows nobody: when a peer it does not know heartbeats (backends, shards and
frontends heartbeat to the rank), it answers ``Hello`` (epoch 0), and the peer introduces itself
again (a backend re-registers, a shard or frontend says Hello and gets the table).

Epochs (``zserve.core.epochs``): the rank is active in an epoch, which its grants, tables and hellos
carry. With a ``SchedulerWatch`` (the embedded scheduler) it may be a standby: it then records
who its peers are and tells them nothing; ``activate`` makes it active in a newer epoch. An
active rank tells a frontend its epoch (``Hello``) and table only once the backends it expects
have registered (``begin_rebuild``), so the requests the frontend re-sends find the GPUs; it
steps down (``on_superseded``) when a ping, heartbeat or hello carries a newer epoch.

Every ``BackendTable`` change is broadcast to every shard and frontend that said hello, and a new
peer gets the current table at once. The rank never waits on a peer: sends are non-blocking (a
message ZeroMQ cannot queue is dropped and counted) and nothing is a request/response.

Hosting, shared with every role: a ``zserve.runtime.driver.CoreDriver`` drives the RankThread
(its outbox delivered, its one timer kept at its ``wake_at``); the ``rank`` socket is drained per
loop tick by the process's ``zserve.transport.reactor.SocketReactor`` (plain ZeroMQ sockets on
the event loop) and its messages handled as one chunk, then the outbox is delivered once with
non-blocking sends (``SocketReactor.send_nowait``). The process starts and stops in the order of
``zserve.runtime.session.RoleSession``.

The backend table itself (registration, GPU ids, suspicion, revival, liveness, the
``BackendTable``) is a part of its own, ``zserve.scheduler.rank_backends.RankBackends``, which
``RankHost`` builds and calls; the host keeps the loop around it (its liveness check every
``check_interval_s``) and tells the peers when a call says the table changed.

With ``shards = 0`` the shard process embeds a ``RankHost``
(``zserve.scheduler.shard_process``): the same class, with the local shard's messages delivered
in-process instead of over a socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import zmq

from zserve.config.cluster import RoleConfig
from zserve.config.policy_names import GRANT_FIRST_DUE, SchedulePolicy
from zserve.core.epochs import REBUILD_MAX_S, SchedulerWatch, next_epoch, now_ms
from zserve.core.errors import ZServeError
from zserve.core.hosting import DEST_MODEL, Outbox
from zserve.core.liveness import stall_credit_s
from zserve.core.stats import Stats
from zserve.runtime import peer_map, runner
from zserve.runtime.args import role_config_from_args, role_parser
from zserve.runtime.clock import ClusterClock, reply_to_probe
from zserve.runtime.driver import CoreDriver
from zserve.runtime.runner import cancel_all, spawn
from zserve.runtime.session import SOCKET_CLOSE_LINGER_MS, RoleSession
from zserve.scheduler.rank_backends import BACKEND_TIMEOUT_S, RankBackends
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import (
    BackendGone,
    BackendRegister,
    BackendSuspect,
    BackendTable,
    BatchStats,
    CandidateUpdate,
    ClockProbe,
    GrantAnswer,
    Heartbeat,
    Hello,
    Message,
    RetireBackend,
    SchedulerPing,
    StatsReply,
    StatsRequest,
)
from zserve.transport.reactor import Chunk, SocketReactor
from zserve.transport.sockets import make_router

log = logging.getLogger(__name__)

ROLE = "rank"
# Before judging the backends' silence the liveness loop lets the reactor drain the rank socket
# this many times (each pass reads up to a chunk): a stall's backlog of heartbeats is read first.
LIVENESS_DRAIN_PASSES = 4
RANK_COUNTERS = (
    "candidates", "late_candidates", "grants", "grant_answers", "batches", "batches_failed",
    "late_batches", "registrations", "removals", "send_dropped", "bad_messages",
    "unroutable_grants", "deaths_announced", "clock_probes", "grants_released", "suspects",
    "revivals", "retirements",
    # scheduler epochs (zserve.core.epochs): taking over, stepping down, what a standby ignored
    "takeovers", "superseded", "standby_ignored",
)
# lateness: batch start - planned exec_at; candidate_slack: how long before its model timer
# (exec - delay) a candidate came (negative: late).
RANK_HISTOGRAMS = {"lateness": "signed", "candidate_slack": "signed"}


# --------------------------------------------------------------------------- the rank host


class RankHost:
    """The RankThread on a ROUTER, with its backend table (``backends``). ``local`` (embedded
    mode) is ``(name, deliver)``: messages for the peer ``name`` are handed to ``deliver``
    instead of the socket, and that shard's messages come in through ``on_local``."""

    def __init__(
        self,
        *,
        name: str,
        sock: zmq.Socket[Any],
        reactor: SocketReactor,
        backend_timeout_s: float = BACKEND_TIMEOUT_S,
        local: tuple[str, Callable[[Message], None]] | None = None,
        watch: SchedulerWatch | None = None,
        grant_order: str = GRANT_FIRST_DUE,
    ) -> None:
        self.name = name
        self.sock = sock
        self.reactor = reactor
        self.loop = asyncio.get_running_loop()
        # The rank's own CLOCK_MONOTONIC is the cluster clock (offset 0 by definition).
        self.clock = ClusterClock(reference=True)
        self.rank = RankThread([], self.clock.now(), grant_order=grant_order)
        self.driver = CoreDriver(self.rank, loop=self.loop, clock=self.clock,
                                 deliver=self._deliver)
        self._local_identity = local[0].encode() if local else None
        self._deliver_local = local[1] if local else None
        self.peers: dict[bytes, str] = {}  # identity -> role, for shards and frontends
        self.peer_pids: dict[bytes, int] = {}  # identity -> the pid its last Hello gave
        self.model_owner: dict[str, bytes] = {}
        # Epochs (zserve.core.epochs): None: always active (a rank process of its own).
        self.watch = watch
        self.epoch = watch.epoch if watch is not None else next_epoch(0, now_ms())
        self.rank.epoch = self.epoch
        self.on_superseded: Callable[[], None] | None = None
        # Backends still to register before the frontends hear of this epoch (None: rebuilt;
        # an empty set: waiting for ``begin_rebuild``).
        self._rebuilding: set[str] | None = set()
        self._rebuild_handle: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stats = Stats(RANK_COUNTERS, RANK_HISTOGRAMS)
        self.counters = self._stats.counters
        self._lateness = self._stats.histograms["lateness"]
        self._candidate_slack = self._stats.histograms["candidate_slack"]
        self.backends = RankBackends(self.rank, self.counters, name=name,
                                     timeout_s=backend_timeout_s)
        if self._local_identity is not None:
            self.peers[self._local_identity] = "shard"
        # Handlers by message type (the type test is the dispatch: no isinstance per message).
        self._handlers: dict[type, Callable[[float, bytes, Any, Outbox], None]] = {
            CandidateUpdate: self._on_candidate,
            GrantAnswer: self._on_grant_answer,
            Heartbeat: self._on_heartbeat,
            BatchStats: self._on_batch_stats,
            BackendRegister: self._on_register,
            Hello: self._on_hello,
            ClockProbe: self._on_clock_probe,
            BackendSuspect: self._on_suspect,
            StatsRequest: self._on_stats_request,
            SchedulerPing: self._on_ping,
        }

    def start(self) -> None:
        self.reactor.watch(self.sock, router=True, on_chunk=self.on_chunk, on_bad=self._on_bad)
        spawn(self._tasks, self._liveness_loop())

    async def close(self) -> None:
        """Stop receiving and the timers; the caller closes the socket."""
        self.driver.close()
        if self._rebuild_handle is not None:
            self._rebuild_handle.cancel()
        self.reactor.unwatch(self.sock)
        await cancel_all(self._tasks)

    # ------------------------------------------------------------------ input

    def _on_bad(self, exc: ZServeError) -> None:
        self.counters["bad_messages"] += 1
        log.warning("%s: bad message: %s", self.name, exc)

    def on_chunk(self, chunk: Chunk) -> None:
        now = self.clock.now()
        outbox: Outbox = []
        for identity, msg in chunk:
            assert identity is not None
            self._handle(now, identity, msg, outbox)
        self.driver.flush(outbox)

    def on_local(self, messages: list[Message]) -> None:
        """Messages from the embedded shard (in order)."""
        assert self._local_identity is not None
        now = self.clock.now()
        outbox: Outbox = []
        for msg in messages:
            self._handle(now, self._local_identity, msg, outbox)
        self.driver.flush(outbox)

    def on_backend_reports(self, backend: bytes, reports: list[Message]) -> None:
        """The ``BatchStats`` backend ``backend`` sent the embedded shard: a backend reports once
        to a process that hosts both, and the shard hands the reports over before reading them."""
        now = self.clock.now()
        outbox: Outbox = []
        for msg in reports:
            self._handle(now, backend, msg, outbox)
        self.driver.flush(outbox)

    def _handle(self, now: float, identity: bytes, msg: Message, outbox: Outbox) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("%s: unexpected %s from %r", self.name, type(msg).__name__, identity)
        else:
            handler(now, identity, msg, outbox)

    def _on_candidate(self, now: float, identity: bytes, msg: CandidateUpdate,
                      outbox: Outbox) -> None:
        if not self.active:
            self.counters["standby_ignored"] += 1
            return
        self.counters["candidates"] += 1
        self.model_owner[msg.model] = identity
        if msg.batch_size > 0:
            # How long before its model timer (exec - delay) the candidate came; negative: the
            # timer is already late (a publish lead shorter than the shard -> rank hop, or a
            # candidate the ModelThread recomputed after that moment).
            slack = msg.exec_at - msg.send_delay - now
            self._candidate_slack.observe(slack)
            if slack < 0:
                self.counters["late_candidates"] += 1
        self.rank.on_candidate(now, msg, outbox)

    def _on_grant_answer(self, now: float, identity: bytes, msg: GrantAnswer,
                         outbox: Outbox) -> None:
        self.counters["grant_answers"] += 1
        try:
            self.rank.on_grant_answer(now, msg, outbox)
        except ValueError as exc:
            log.warning("%s: %s", self.name, exc)

    def _on_heartbeat(self, now: float, identity: bytes, msg: Heartbeat, outbox: Outbox) -> None:
        if self._superseded_by(msg.epoch):
            return
        self.backends.note_heard(now, identity)
        # a backend that came back before re-registering (a suspect one: from a heartbeat sent
        # after the suspicion) is taken back
        revived = self.backends.on_heartbeat(now, identity, msg.sent_at, outbox)
        if revived:
            self._broadcast_table()
        elif (revived is None and identity not in self.peers
              and identity not in self.backends.identities):
            # A peer this rank does not know (the rank restarted): ask it to introduce itself
            # again (epoch 0: "who are you"): a backend registers again, a shard or a frontend
            # says Hello.
            self._send(Hello(role=ROLE, name=self.name, pid=os.getpid()), identity)

    def _on_hello(self, now: float, identity: bytes, msg: Hello, outbox: Outbox) -> None:
        if self._superseded_by(msg.epoch):
            return
        previous_pid = self.peer_pids.get(identity)
        self.peer_pids[identity] = msg.pid
        if previous_pid is not None and previous_pid != msg.pid:
            # A restarted process under the same name: what its predecessor was granted will
            # never be answered.
            self._release_grants_of(now, identity, outbox)
        if msg.role == "backend":
            self.backends.on_hello(identity)
            if self.active:  # it registers on hearing the active epoch
                self._send(self._epoch_hello(), identity)
            return
        self._new_peer(identity, msg.role)

    def _release_grants_of(self, now: float, identity: bytes, outbox: Outbox) -> None:
        models = [model for model, owner in self.model_owner.items() if owner == identity]
        released = self.rank.release_grants(now, models, outbox)
        if released:
            self.counters["grants_released"] += released
            log.warning("%s: %s restarted: %d unanswered grant(s) released", self.name,
                        identity.decode(errors="replace"), released)

    def _on_clock_probe(self, now: float, identity: bytes, msg: ClockProbe, outbox: Outbox) -> None:
        self.counters["clock_probes"] += 1
        self._send(reply_to_probe(msg), identity)  # read the clock as late as possible

    def _on_stats_request(self, now: float, identity: bytes, msg: StatsRequest,
                          outbox: Outbox) -> None:
        self._send(StatsReply(self.name, self.stats(msg.reset)), identity)

    def on_control_message(self, msg: Message) -> None:
        """From the supervisor: ``BackendGone(name)`` says that backend's
        process died. Remove it now rather than after BACKEND_TIMEOUT_S of silence, so the shards
        answer the requests planned onto it BACKEND_FAILED at once. (A restarted backend
        registers again and gets its GPU back.) ``RetireBackend(name)``: the autoscaler releases
        it; its GPU gets no new grants, the table keeps it until its process exits."""
        outbox: Outbox = []
        if type(msg) is BackendGone:
            if self.backends.on_gone(self.clock.now(), msg.name, outbox):
                self._broadcast_table()
        elif type(msg) is RetireBackend:
            self.backends.on_retire(self.clock.now(), msg.name, outbox)
        self.driver.flush(outbox)

    # ------------------------------------------------------------------ the backend table

    def _on_register(self, now: float, identity: bytes, msg: BackendRegister,
                     outbox: Outbox) -> None:
        if not self.backends.on_register(now, identity, msg, outbox, active=self.active):
            return
        # Told before the outbox goes out: a shard knows a GPU's plan address before its first
        # grant for it.
        self._broadcast_table()
        if self._rebuilding:
            self._rebuilding.discard(msg.name)
            if not self._rebuilding and self._rebuild_handle is not None:
                self._end_rebuild()

    def _on_suspect(self, now: float, identity: bytes, msg: BackendSuspect,
                    outbox: Outbox) -> None:
        if self.backends.on_suspect(now, msg, outbox):
            self._broadcast_table()
        else:  # it changes nothing: the table answers the shard, which serves from it again
            self._send(self.table(), identity)

    async def _liveness_loop(self) -> None:
        interval_s = self.backends.check_interval_s
        while True:
            asked_at = self.clock.now() + interval_s
            await asyncio.sleep(interval_s)
            # Read what the backends sent before judging: after a stall of this process the
            # timer and the heartbeats that came meanwhile are ready together, and the timer
            # may run first. Its own stall is credited to them (``stall_credit_s``).
            stalled_s = stall_credit_s(self.clock.now() - asked_at)
            for _ in range(LIVENESS_DRAIN_PASSES):
                self.reactor.kick(self.sock)
                await asyncio.sleep(0)
            outbox: Outbox = []
            if self.backends.expire(self.clock.now(), outbox, stalled_s):
                self._broadcast_table()
            self.driver.flush(outbox)

    def table(self) -> BackendTable:
        return self.backends.table(self.epoch)

    # ------------------------------------------------------------------ membership

    def _new_peer(self, identity: bytes, role: str) -> None:
        self.peers[identity] = role
        if self._tells(role):
            self._introduce(identity, role)

    def _tells(self, role: str) -> bool:
        """Whether a peer of ``role`` hears from this rank now: never from a standby, and a
        frontend only once the backends have registered (it re-sends its queued requests on
        hearing a new epoch, and they must find the GPUs)."""
        return self.active and (role != "frontend" or self._rebuilding is None)

    def _introduce(self, identity: bytes, role: str) -> None:
        if role == "frontend":
            self._send(self._epoch_hello(), identity)
        self._send(self.table(), identity)

    def _epoch_hello(self) -> Hello:
        return Hello(role=ROLE, name=self.name, pid=os.getpid(), epoch=self.epoch)

    # ------------------------------------------------------------------ epochs

    @property
    def active(self) -> bool:
        return self.watch is None or self.watch.active

    def _on_ping(self, now: float, identity: bytes, msg: SchedulerPing, outbox: Outbox) -> None:
        """The partner's ping: answered at once from this loop (its proof of life)."""
        self.on_partner(now, msg)
        if not msg.reply and self.watch is not None:
            self._send(SchedulerPing(self.name, self.watch.epoch, self.watch.active, True),
                       identity)

    def on_partner(self, now: float, msg: SchedulerPing) -> None:
        """What the partner scheduler said of itself (a ping, or the answer to this one's)."""
        if self.watch is not None and self.watch.on_ping(now, msg.epoch, msg.active):
            self._step_down(msg.epoch)

    def _superseded_by(self, epoch: int) -> bool:
        """A peer has seen ``epoch``: True (after stepping down) if it supersedes this rank."""
        if self.watch is None or not self.watch.on_epoch(epoch):
            return False
        self._step_down(epoch)
        return True

    def _step_down(self, epoch: int) -> None:
        self.counters["superseded"] += 1
        log.error("%s: superseded by scheduler epoch %d (this one's is %d): stepping down",
                  self.name, epoch, self.epoch)
        self.driver.close()  # it grants nothing more
        if self.on_superseded is not None:
            self.on_superseded()

    def activate(self, epoch: int, expected_backends: set[str], *, takeover: bool = True
                 ) -> None:
        """Become the active scheduler in ``epoch`` (a standby taking over, or, ``takeover``
        False, a pair's primary starting): the known backends hear the epoch and re-register;
        the frontends hear it once they have. Those expected are the ones named (the peer map)
        and the ones heard lately: roles started alone (Kubernetes) name no backend, and a
        frontend told the new epoch before any had registered would have its re-sent requests
        answered UNAVAILABLE."""
        if takeover:
            self.counters["takeovers"] += 1
        self.epoch = self.rank.epoch = epoch
        self._rebuilding = set()
        for identity in self.backends.identities:
            self._send(self._epoch_hello(), identity)
        heard = self.backends.recently_heard(self.clock.now())
        self.begin_rebuild(set(expected_backends) | heard)

    def begin_rebuild(self, expected_backends: set[str]) -> None:
        """Wait for these backends to register (at most REBUILD_MAX_S), then tell the
        frontends this epoch and its table."""
        if self._rebuilding is None:
            return
        self._rebuilding = set(expected_backends) - self.backends.alive_names()
        if not self._rebuilding:
            self._end_rebuild()
        elif self._rebuild_handle is None:
            self._rebuild_handle = self.loop.call_later(REBUILD_MAX_S, self._end_rebuild)

    def _end_rebuild(self) -> None:
        if self._rebuilding is None or not self.active:
            return
        if self._rebuilding:
            log.warning("%s: epoch %d: %s did not register in time", self.name, self.epoch,
                        sorted(self._rebuilding))
        self._rebuilding = None
        if self._rebuild_handle is not None:
            self._rebuild_handle.cancel()
            self._rebuild_handle = None
        for identity, role in list(self.peers.items()):
            self._introduce(identity, role)

    def _broadcast_table(self) -> None:
        table = self.table()
        for identity, role in list(self.peers.items()):
            if self._tells(role):
                self._send(table, identity)

    # ------------------------------------------------------------------ output

    def _deliver(self, outbox: Outbox) -> None:
        """The driver's way out: each grant to the shard that sent its model's candidate."""
        messages = outbox[:]
        outbox.clear()
        # Grants that cannot reach their shard are never answered: give them back at once
        # (appended to the outbox; a new grant needs a new candidate, so this ends).
        undelivered: list[str] = []
        for (kind, key), msg in messages:
            if kind == DEST_MODEL:
                owner = self.model_owner.get(str(key))
                if owner is None:
                    self.counters["unroutable_grants"] += 1
                    log.error("%s: no shard known for model %r", self.name, key)
                    undelivered.append(str(key))
                    continue
                self.counters["grants"] += 1
                if not self._send(msg, owner):
                    undelivered.append(str(key))
            else:
                log.error("%s: RankThread produced a message for %r", self.name, (kind, key))
        if undelivered:
            self.counters["grants_released"] += self.rank.release_grants(
                self.clock.now(), undelivered, outbox)

    def _send(self, msg: Message, identity: bytes) -> bool:
        if identity == self._local_identity and self._deliver_local is not None:
            self._deliver_local(msg)
            return True
        error = self.reactor.send_nowait(self.sock, msg, identity)
        if error is not None:
            self.counters["send_dropped"] += 1
            log.warning("%s: dropped %s to %r: %s", self.name, type(msg).__name__, identity, error)
            return False
        return True

    # ------------------------------------------------------------------ stats

    def _on_batch_stats(self, now: float, identity: bytes, msg: BatchStats, outbox: Outbox) -> None:
        if not self.active:  # a plan of another epoch's: not this standby's to count
            return
        if msg.device_free_at > 0.0:
            # Drift correction: the backend's device frees later than the grants planned (it
            # started batches late).
            self.backends.on_device_free_at(now, identity, msg.gpu_id, msg.device_free_at,
                                            outbox)
        if msg.batch_size == 0:
            return
        self.counters["batches"] += 1
        if not msg.ok:
            self.counters["batches_failed"] += 1
        lateness = msg.started_at - msg.exec_at
        self._lateness.observe(lateness)
        if lateness > 1e-3:
            self.counters["late_batches"] += 1

    def stats(self, reset: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": ROLE,
            "name": self.name,
            "clock": self.clock.stats(),
            "active": self.active,
            "epoch": self.epoch,
            "rebuilding": self._rebuilding is not None,
            "gpus": self.backends.stats(),
            "rank_thread": {
                "grants": self.rank.n_grants,
                "model_matches": self.rank.n_model_matches,
                "rescues": self.rank.n_rescues,
                "holds": self.rank.n_holds,
                "gpu_matches": self.rank.n_gpu_matches,
                "stale": self.rank.n_stale,
                "purged": self.rank.n_purged,
                "drift_corrections": self.rank.n_drift_corrections,
                "drift_corrected_ms": self.rank.drift_corrected_s * 1e3,
            },
        }
        out.update(self._stats.snapshot(reset))
        # who hears of table changes (a frontend absent here never learns of a backend change)
        out["peers"] = {i.decode(errors="replace"): role for i, role in self.peers.items()}
        return out


# --------------------------------------------------------------------------- entry points


async def _main(config: RoleConfig, control_address: str | None) -> int:
    name = config.name
    async with RoleSession.open(config, control_address, role=ROLE) as session:
        # Plain sockets on the reactor (the control link shadows the context with zmq.asyncio).
        reactor = SocketReactor(asyncio.get_running_loop())
        session.closing(reactor.close)
        sock, endpoint = make_router(session.ctx, config.bind["rank"], name=f"{name} rank",
                                     advertise_host=config.advertise_host)
        session.closing(lambda: sock.close(linger=SOCKET_CLOSE_LINGER_MS))
        sched = config.cluster.scheduler
        host = RankHost(name=name, sock=sock, reactor=reactor,
                        backend_timeout_s=config.backend_timeout_s or BACKEND_TIMEOUT_S,
                        grant_order=SchedulePolicy.parse(sched.policy, sched.drop).grant_order)
        session.closing(host.close)
        session.serve_stats(host.stats)
        session.on_control(host.on_control_message)
        host.start()
        log.info("%s: %s", name, host.clock.describe())
        # The rank is the cluster clock: no sync; it serves the others' probes from here on.
        peers = await session.ready({"rank": endpoint})
        host.begin_rebuild(set(peer_map.endpoints_of(peers, "plan")))
        await session.drained()
        return 0


def run_rank(config: RoleConfig, control_address: str | None) -> int:
    """Run the rank process until it is told to stop; returns the exit code."""
    return runner.run_role(_main(config, control_address), name=config.name)


def main(argv: list[str]) -> int:
    """``zserve rank``: run the rank process of a cluster.toml on its own."""
    parser = role_parser("zserve rank", main.__doc__, indexed=False, rank_flag=False)
    parser.add_argument("--bind", default=None, help="rank socket bind address")
    args = parser.parse_args(argv)
    config = role_config_from_args(args, ROLE)
    if args.bind:
        config.bind["rank"] = args.bind
    return run_rank(config, args.control)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
