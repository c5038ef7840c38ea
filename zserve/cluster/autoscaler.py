"""The supervisor's autoscaler: acts on the frontends' advice within ``[autoscale]``'s bounds.

While ``[autoscale] enabled`` and ``act``, the supervisor calls :meth:`BackendAutoscaler.tick`
on every turn of its loop. Every ``interval_s`` it asks frontend-0 for its stats, whose
``autoscale.advice_backends`` is the advice (``zserve.frontend.autoscale_advice``; the frontend's
own hysteresis and settle time apply), and brings the backends it keeps to that number, clamped
to ``min_backends .. max_backends``:

- **Adding**: a new child ``backend-<n>`` (the lowest free index) is spawned like a restart:
  on ``Ready`` the supervisor sends it the peer map, it registers with the rank after it loaded
  and warmed every model (``zserve.backends.host``), and only then does the rank grant its GPU
  (its index is its GPU id, ``zserve.scheduler.rank_backends``).
- **Releasing**: the highest-numbered backends first (deferred scheduling binds a batch to the
  first free GPU in id order, so they are the idlest). A released backend is drained, never
  killed with work: the rank gets ``RetireBackend`` (no new grants; the backend stays in the
  table, so the plans it holds run and are answered), and so does the backend, which says
  ``retiring`` in every registration from then on (a standby that takes over mid-release
  learns the release from it and grants it nothing), and once ``quiet_s`` has passed (longer
  than any plan in flight can take to arrive) and the backend reports no plan held, it gets
  ``Shutdown``. Its exit is announced like a death (``BackendGone``: the table drops it; it
  holds nothing to fail) and the supervisor does not restart it.

Per device kind (``[autoscale.kinds.<kind>]``): each kind is brought to its own advice (the
frontend's ``autoscale.kinds``) within its own bounds; a backend is added with its kind
(``RoleConfig.kind``) and, under ``[orchestration]``, joins the sub-cluster with most backends of
its kind and loads its models (``on_added``: ``OrchestratorHost.join``).

A backend is released once ready (its control link is up), whether or not the rank has its
registration yet: the backend itself hears ``RetireBackend`` and registers as retiring, so a
rank that had not heard of it yet grants it nothing either (or, if the registration raced
ahead, for the few milliseconds until it registers again; the plans it got run before the
release's quiet time ends). ``events`` records every change (monotonic s, what,
which backend) for the experiments' plots.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from zserve.cluster.child import SupervisedChild
from zserve.config.cluster import STANDBY_NAME, ClusterConfig, process_name, role_config
from zserve.core.liveness import HEARTBEAT_INTERVAL_S
from zserve.orchestrator.autoscale_kinds import kind_targets
from zserve.transport.messages import Message, RetireBackend, Shutdown

log = logging.getLogger(__name__)

ADVISING_FRONTEND = "frontend-0"
# A released backend waits at least this long, and twice the longest SLO, after RetireBackend
# before it is asked whether it holds plans: a plan granted just before is on its way.
RETIRE_QUIET_MIN_S = 1.0
RETIRE_DRAIN_S = 1.0
# After Shutdown, how long a released backend may take to exit before SIGKILL.
RETIRE_EXIT_GRACE_S = 5.0
# A stats request not answered within this long is asked again.
STATS_TIMEOUT_S = 5.0

ADD, RETIRE, EXIT = "add", "retire", "exit"


def rank_host_names(config: ClusterConfig) -> set[str]:
    """The children that host the rank (both of an active/standby pair)."""
    return {"rank"} if config.scheduler.shards > 0 else {"shard-0", STANDBY_NAME}


@dataclasses.dataclass
class _Retirement:
    child: SupervisedChild
    since: float
    stats: Future[dict[str, Any]] | None = None
    asked_at: float = 0.0
    shutdown_at: float | None = None


class BackendAutoscaler:
    """Starts and releases backends on the advice. ``children``: the supervisor's (it adds and
    removes backends there); ``spawn``/``send``/``stats``: the supervisor's ways to start a
    child, send it a control message and ask it for its stats; ``ipc_dir``: where generated ipc
    addresses go (None under tcp); ``on_released``: called once a released backend is gone."""

    def __init__(self, config: ClusterConfig, children: dict[str, SupervisedChild], *,
                 spawn: Callable[[SupervisedChild], None],
                 send: Callable[[SupervisedChild, Message], None],
                 stats: Callable[[str], Future[dict[str, Any]]],
                 ipc_dir: str | None,
                 on_released: Callable[[], None] = lambda: None,
                 on_added: Callable[[SupervisedChild], None] = lambda child: None,
                 on_gone: Callable[[str], None] = lambda name: None) -> None:
        self.config = config
        self.children = children
        self._spawn, self._send, self._stats = spawn, send, stats
        self._on_released = on_released  # `zserve up` rewrites its state file then
        # the orchestrator places an added backend in a sub-cluster (before it is spawned) and
        # forgets a released one
        self._on_added, self._on_gone = on_added, on_gone
        self.ipc_dir = ipc_dir
        self.min_backends, self.max_backends = config.autoscale.bounds(config.backends.total)
        # [autoscale.kinds]: each kind within its own bounds, on its own advice ({}: one kind)
        self.kind_bounds = config.autoscale.kind_bounds(config.backends)
        self.interval_s = config.autoscale.interval_s
        longest_slo_s = max((m.slo_ms for m in config.models), default=0.0) / 1e3
        self.quiet_s = max(RETIRE_QUIET_MIN_S, 2 * longest_slo_s + 2 * HEARTBEAT_INTERVAL_S)
        self._advice: Future[dict[str, Any]] | None = None
        self._asked_at = -float("inf")
        self._retiring: dict[str, _Retirement] = {}
        self.events: list[tuple[float, str, str]] = []
        self.last_advice: int | None = None

    def kept(self, kind: str | None = None) -> list[SupervisedChild]:
        """The backends not being released (of ``kind``, if given), in index order."""
        return sorted((c for c in self.children.values()
                       if c.role == "backend" and not c.retiring
                       and (kind is None or c.config.kind == kind)), key=lambda c: c.index)

    def tick(self, now: float) -> None:
        """One turn: read the advice when due, act on it, move every release along."""
        self._read_advice(now)
        for retirement in list(self._retiring.values()):
            self._advance(retirement, now)

    # ------------------------------------------------------------------ the advice

    def _read_advice(self, now: float) -> None:
        if self._advice is None:
            frontend = self.children.get(ADVISING_FRONTEND)
            if now - self._asked_at >= self.interval_s and frontend and frontend.ready:
                self._advice, self._asked_at = self._stats(ADVISING_FRONTEND), now
            return
        if not self._advice.done():
            if now - self._asked_at > STATS_TIMEOUT_S:
                self._advice = None
            return
        future, self._advice = self._advice, None
        if future.exception() is not None:
            return
        stats = future.result()
        autoscale = stats.get("autoscale") or {}
        advice = autoscale.get("advice_backends")
        if self.kind_bounds:
            kinds = autoscale.get("kinds") or {}
            by_kind = {kind: int(entry["advice_backends"]) for kind, entry in kinds.items()
                       if isinstance(entry.get("advice_backends"), int)}
            self.last_advice = sum(by_kind.values()) if by_kind else None
            self._act_by_kind(now, by_kind)
        elif isinstance(advice, int):
            self.last_advice = advice
            self._act(now, advice)

    def _act(self, now: float, advice: int) -> None:
        target = min(max(advice, self.min_backends), self.max_backends)
        self._move_to(now, target, self.kept(), "")

    def _act_by_kind(self, now: float, advice: dict[str, int]) -> None:
        """Each kind to its own advice within its bounds (``autoscale_kinds.kind_targets``)."""
        kept = {kind: [c.name for c in self.kept(kind)] for kind in self.kind_bounds}
        for kind, change in kind_targets(advice, kept, self.kind_bounds).items():
            have = self.kept(kind)
            self._move_to(now, len(have) + change, have, kind)

    def _move_to(self, now: float, target: int, kept: list[SupervisedChild], kind: str) -> None:
        """Add backends of ``kind`` up to ``target``, or release the highest-numbered of
        ``kept`` down to it: from the top, stopping at one still starting (it is released once
        ready, at a later turn), so a lower one that serves is never released in its place."""
        if target > len(kept):
            for _ in range(target - len(kept)):
                self._add(now, kind)
        elif target < len(kept):
            for child in kept[::-1][:len(kept) - target]:
                if not child.ready:
                    break
                self._retire(now, child)

    # ------------------------------------------------------------------ adding

    def _add(self, now: float, kind: str = "") -> None:
        index = next(i for i in range(len(self.children) + 1)
                     if process_name("backend", i) not in self.children)
        name = process_name("backend", index)
        config = role_config(self.config, "backend", index, ipc_dir=self.ipc_dir, name=name)
        config.kind = kind
        child = SupervisedChild("backend", name, index, config)
        self.children[name] = child
        log.warning("autoscaler: adding %s%s", name, f" ({kind})" if kind else "")
        self.events.append((now, ADD, name))
        self._on_added(child)
        self._spawn(child)

    # ------------------------------------------------------------------ releasing

    def release(self, now: float, name: str) -> None:
        """Release backend ``name`` now, as the advice releases one (an operator's choice of
        which; the advice's is the highest-numbered). Raises ValueError for a name that is not
        a serving backend this autoscaler keeps."""
        child = self.children.get(name)
        if child is None or child.role != "backend" or child.retiring or not child.ready:
            raise ValueError(f"{name} is not a serving backend (released already, or unknown)")
        self._retire(now, child)

    def _retire(self, now: float, child: SupervisedChild) -> None:
        """Tell every rank host and the backend itself: the backend says ``retiring`` in its
        registrations from then on, so a standby that takes over mid-release (or a restarted
        rank) grants it nothing either."""
        log.warning("autoscaler: releasing %s (draining it first)", child.name)
        child.retiring = True
        self._retiring[child.name] = _Retirement(child, now)
        self.events.append((now, RETIRE, child.name))
        notice = RetireBackend(name=child.name)
        self._send(child, notice)
        for host in rank_host_names(self.config):
            rank = self.children.get(host)
            if rank is not None and rank.ready and rank.alive:
                self._send(rank, notice)

    def _advance(self, retirement: _Retirement, now: float) -> None:
        """A released backend: asked whether it holds plans once quiet, shut down when it
        holds none, forgotten once it has exited (the supervisor announced its exit)."""
        child = retirement.child
        if child.process is None:
            del self._retiring[child.name]
            self.children.pop(child.name, None)
            self.events.append((now, EXIT, child.name))
            log.warning("autoscaler: %s released", child.name)
            self._on_gone(child.name)
            self._on_released()
        elif retirement.shutdown_at is not None:
            if now - retirement.shutdown_at > RETIRE_DRAIN_S + RETIRE_EXIT_GRACE_S:
                log.error("autoscaler: %s did not exit after Shutdown; SIGKILL", child.name)
                child.process.kill()
        elif now - retirement.since >= self.quiet_s:
            self._ask_held_plans(retirement, now)

    def _ask_held_plans(self, retirement: _Retirement, now: float) -> None:
        child = retirement.child
        future = retirement.stats
        if future is None or (not future.done() and now - retirement.asked_at > STATS_TIMEOUT_S):
            retirement.stats, retirement.asked_at = self._stats(child.name), now
            return
        if not future.done():
            return
        retirement.stats = None
        if future.exception() is None and int(future.result().get("held_plans", 1)) == 0:
            self._send(child, Shutdown(reason="released by the autoscaler",
                                       drain_s=RETIRE_DRAIN_S))
            retirement.shutdown_at = now


__all__ = ["ADD", "EXIT", "RETIRE", "BackendAutoscaler", "rank_host_names"]
