"""Scheduler epochs: which scheduler process may dispatch, and the fence against the others.

A scheduler process that is *active* dispatches in an *epoch*: an integer that grows with every
takeover and every restart. It travels with everything the scheduler makes that others act on
(``BatchPlan.epoch``, ``GrantGpu.epoch``, ``BackendTable.epoch``, ``Hello.epoch``).

- ``next_epoch(seen, now_ms)``: the epoch a scheduler takes when it becomes active: above every
  epoch it has seen, and at least the wall-clock millisecond (``time.time_ns() // 10**6``), so a
  restarted scheduler that has seen nothing still outranks its previous process (the frontend's
  incarnation uses the same clock for the same reason: ``zserve.core.request_ids``).
- ``EpochFence`` (backends and frontends): the newest epoch seen and the scheduler active in it.
  ``admits(epoch)`` is False for anything of an older epoch: a backend never runs such a plan,
  a frontend ignores such a table or drop. That is what makes "a superseded scheduler never
  dispatches" hold by construction, whatever the superseded process still believes.
- ``SchedulerWatch`` (each process of an active/standby pair): the pure core of the watch link.
  Each process pings the other every ``PING_INTERVAL_S`` (``SchedulerPing``); a standby whose
  active partner has been silent for ``takeover_timeout_s`` takes over with ``next_epoch``, and
  an active process that hears a newer epoch (from its partner or any peer) steps down.
"""

from __future__ import annotations

import math
import time

__all__ = (
    "PING_INTERVAL_S",
    "REBUILD_MAX_S",
    "EpochFence",
    "SchedulerWatch",
    "next_epoch",
    "now_ms",
)

# How often the two scheduler processes of a pair ping each other.
PING_INTERVAL_S = 0.1
# After becoming active, a scheduler waits for the backends to register (their device state)
# before it announces itself to the frontends, at most this long.
REBUILD_MAX_S = 1.5
# An active scheduler hands over on a drain only to a partner that answered this recently (five
# pings): one that died moments ago could not take the queue.
HANDOVER_FRESH_S = 0.5


def now_ms() -> int:
    """The wall clock in milliseconds (an epoch floor; see ``next_epoch``)."""
    return time.time_ns() // 1_000_000


def next_epoch(seen: int, wall_ms: int) -> int:
    """The epoch of a scheduler that becomes active having seen epochs up to ``seen``."""
    return max(seen + 1, wall_ms)


class EpochFence:
    """What a backend or frontend knows of the schedulers: the newest epoch, who is active."""

    __slots__ = ("active", "epoch_of", "highest")

    def __init__(self) -> None:
        self.highest = 0
        self.active = ""  # the scheduler process active in ``highest`` ("" before any)
        self.epoch_of: dict[str, int] = {}  # scheduler name -> the epoch it last announced

    def observe(self, name: str, epoch: int) -> bool:
        """Scheduler ``name`` says it is active in ``epoch`` (0: it is a standby, no claim).
        True when that is a newer epoch than any seen: ``name`` is now the active one."""
        if epoch <= 0:
            return False
        if epoch > self.epoch_of.get(name, 0):
            self.epoch_of[name] = epoch
        if epoch <= self.highest:
            return False
        self.highest = epoch
        self.active = name
        return True

    def note(self, epoch: int) -> None:
        """Something made in ``epoch`` arrived (a plan): no older epoch is admitted after it."""
        self.highest = max(self.highest, epoch)

    def admits(self, epoch: int) -> bool:
        """False for something made in an older epoch than the newest seen."""
        return epoch >= self.highest

    def is_current(self, name: str) -> bool:
        """True while ``name`` is the scheduler of the newest epoch (or none is known yet)."""
        return self.highest == 0 or self.active == name


class SchedulerWatch:
    """One scheduler process's side of the watch link (pure: ``now`` is passed in)."""

    def __init__(self, *, active: bool, epoch: int, takeover_timeout_s: float,
                 now: float, primary: bool = False) -> None:
        self.active = active
        # A pair's primary (``shard-0``) starts as a standby that takes over as soon as its
        # partner answers as a standby (the cluster's start), else as any standby does: a
        # primary restarted while its partner is active joins as the standby instead of
        # superseding a healthy active one (whose plans in flight would be lost).
        self.joining = primary and not active
        self.epoch = epoch if active else 0
        self.seen = epoch  # the newest epoch seen anywhere
        self.takeover_timeout_s = takeover_timeout_s
        self.partner_active_at = now  # the last ping of an active partner (or the start)
        self.partner_active = False  # the partner's last ping said it was active
        self.partner_seen_at = -math.inf  # the partner's last ping or answer, active or not
        self.superseded = False  # stepped down: never active again in this process

    @property
    def takeover_at(self) -> float:
        """When a standby takes over unless its active partner pings (inf: not a standby)."""
        if self.active or self.superseded:
            return math.inf
        if self.joining and self.partner_seen_at > -math.inf and not self.partner_active:
            return self.partner_seen_at  # the partner said it is a standby: take over now
        return self.partner_active_at + self.takeover_timeout_s

    def start(self, now: float) -> None:
        """The link is up (the peer map came): the timeout counts from now, not from the
        process's start (the cluster's start-up may take longer than the timeout)."""
        self.partner_active_at = max(self.partner_active_at, now)

    def on_ping(self, now: float, epoch: int, active: bool) -> bool:
        """The partner pinged; True when this (active) process must step down."""
        self.partner_seen_at = now
        if active:
            self.partner_active_at = now
            self.joining = False  # the partner is active: this one is its standby
        self.partner_active = active
        return self.on_epoch(epoch if active else 0)

    def can_hand_over(self, now: float) -> bool:
        """Whether this active process may leave its queue to its partner: the partner's
        connection is up and it answered within ``HANDOVER_FRESH_S`` (or the takeover timeout,
        if shorter), so it takes over once this one's connection closes and the frontends
        re-send what they still hold to it. Else the process drains."""
        fresh_s = min(HANDOVER_FRESH_S, self.takeover_timeout_s)
        return self.active and not self.superseded and now - self.partner_seen_at < fresh_s

    def on_partner_gone(self, now: float) -> None:
        """The link to the partner dropped (its process died: a hung one keeps its sockets).
        If it was the active one, take over now instead of after the timeout."""
        self.partner_seen_at = -math.inf  # nobody to hand over to until it answers again
        if self.partner_active:
            self.partner_active = False
            self.partner_active_at = min(self.partner_active_at, now - self.takeover_timeout_s)

    def on_epoch(self, epoch: int) -> bool:
        """A peer has seen ``epoch``; True when this active process is superseded by it."""
        self.seen = max(self.seen, epoch)
        if self.active and epoch > self.epoch:
            self.active = False
            self.superseded = True
            return True
        return False

    def take_over(self, now: float, wall_ms: int) -> int | None:
        """At or after ``takeover_at``: become active; the new epoch (None: not due)."""
        if now < self.takeover_at:
            return None
        return self.claim(wall_ms)

    def claim(self, wall_ms: int) -> int:
        """Become active now (a primary with no partner to ask, or a takeover that is due);
        the new epoch."""
        self.active = True
        self.joining = False
        self.epoch = self.seen = next_epoch(self.seen, wall_ms)
        return self.epoch
