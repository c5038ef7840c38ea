"""The cluster clock: the rank process's CLOCK_MONOTONIC, which every other process estimates.

Every time on the wire (deadlines, ``exec_at``, batch start and finish, ...) is an absolute time,
so the processes of one cluster must agree on a clock. Hosts do not share CLOCK_MONOTONIC, so the
cluster uses the rank's: a process reads the cluster clock as ``ClusterClock.now()`` =
``time.monotonic() + offset_s``, and converts back to its own clock only where it arms a local
timer (``ClusterClock.to_local``; ``zserve.runtime.timers`` and the event loop take local time).

How the offset is estimated (``ClockSync``), NTP-style, over a DEALER of its own (identity
``<name>.clock``) to the rank's ``rank`` ROUTER, which answers each ``ClockProbe`` at once with a
``ClockReply`` carrying its clock reading and ``host_identity()``:

- A sample is one probe: sent at local ``t_send``, answered with rank time ``T``, received at local
  ``t_recv``. The rank read ``T`` somewhere between the two, so the offset lies within
  ``T - (t_send + t_recv) / 2 +- rtt / 2``: the estimate and its error bound (``ClockSample``).
- An estimate takes ``SAMPLES_PER_ESTIMATE`` probes one after another and keeps the sample with the
  smallest round trip (the least queueing, so the tightest bound; ``best_sample``).
- Start-up: a process estimates before it serves (it probes until the rank answers, or until it is
  told to stop), and logs the result. Then it refreshes every ``REFRESH_INTERVAL_S``.
- Refresh rule (``adjust_offset``): if the new estimate's interval overlaps the current one
  (``|new - current| <= new error + current error``) the offset *slews*: it moves toward the new
  estimate by at most ``SLEW_MAX_S``, so a timestamp never jumps by more than that and one noisy
  refresh cannot drag the clock far. If they do not overlap, the clocks really moved apart (e.g.
  the rank was restarted on another host): the offset *steps* to the new estimate (logged,
  counted in ``steps``). The reported error bound is the distance to the latest estimate plus
  that estimate's own bound.
- Same clock: when the rank answers with this process's own ``host_identity()`` (same boot id and
  same time namespace: the kernel's CLOCK_MONOTONIC is then the same clock) the offset is exactly
  0 and no samples are taken; later refreshes send one probe only, to notice a rank that moved.

Hot path cost: ``now()`` is one ``time.monotonic()`` and one float add.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import zmq
import zmq.asyncio

from zserve.core.errors import ZServeError
from zserve.transport.codec import decode, encode
from zserve.transport.messages import ClockProbe, ClockReply
from zserve.transport.sockets import make_dealer

log = logging.getLogger(__name__)

# How often a process re-estimates its offset. CLOCK_MONOTONIC of two NTP-disciplined hosts
# drifts apart by at most a few hundred ppm (usually far less): well under a millisecond per
# refresh.
REFRESH_INTERVAL_S = 5.0
# Probes per estimate; the one with the smallest round trip is kept.
SAMPLES_PER_ESTIMATE = 8
# A probe not answered within this is given up (lost, or the rank is busy); the next is sent.
PROBE_TIMEOUT_S = 0.25
# At start-up the rank may not be up yet: probe this often while waiting for it.
STARTUP_PROBE_TIMEOUT_S = 1.0
# While waiting for the rank at start-up, log this often.
STARTUP_LOG_INTERVAL_S = 5.0
# Largest change of the offset per refresh while estimates agree (a slew, not a step).
SLEW_MAX_S = 0.0005
# Closing the probe socket never waits for unsent probes.
CLOSE_LINGER_MS = 0

# Bound once: ``ClusterClock.now`` is on every hot path.
_monotonic = time.monotonic

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_TIME_NAMESPACE_PATH = "/proc/self/ns/time"


@functools.cache
def host_identity() -> str:
    """What identifies this process's CLOCK_MONOTONIC: the kernel's boot id (one per boot of one
    host) and the time namespace (a child of ``unshare --time`` sees a shifted CLOCK_MONOTONIC).
    Two processes with equal identities read the same clock. Where the boot id cannot be read
    (not Linux) the identity is unique to this process, so it never claims a shared clock."""
    try:
        with open(_BOOT_ID_PATH) as f:
            boot_id = f.read().strip()
    except OSError:
        return f"unknown-{uuid.uuid4()}"
    try:
        namespace = os.readlink(_TIME_NAMESPACE_PATH)
    except OSError:  # kernels before 5.6 have no time namespaces: one clock per boot
        namespace = ""
    return f"{boot_id}/{namespace}"


# --------------------------------------------------------------------------- the estimator (pure)


@dataclass(frozen=True, slots=True)
class ClockSample:
    """One probe: local send and receive times around the rank's reading of its clock."""

    sent_at: float  # local CLOCK_MONOTONIC
    rank_time: float  # the rank's CLOCK_MONOTONIC, read between the two
    received_at: float  # local CLOCK_MONOTONIC

    @property
    def rtt_s(self) -> float:
        return self.received_at - self.sent_at

    @property
    def offset_s(self) -> float:
        """rank clock - local clock, assuming the rank read its clock half-way."""
        return self.rank_time - (self.sent_at + self.received_at) / 2.0

    @property
    def error_s(self) -> float:
        """The true offset lies within ``offset_s +- error_s``."""
        return self.rtt_s / 2.0


def best_sample(samples: Iterable[ClockSample]) -> ClockSample | None:
    """The sample with the smallest round trip (None for none; negative round trips, which a
    sane clock cannot produce, are ignored)."""
    valid = [s for s in samples if s.rtt_s >= 0.0]
    return min(valid, key=lambda s: s.rtt_s) if valid else None


def adjust_offset(
    current_s: float, current_error_s: float, estimate_s: float, estimate_error_s: float,
    *, slew_max_s: float = SLEW_MAX_S,
) -> tuple[float, float, bool]:
    """The refresh rule (module docstring): ``(new offset, its error bound, stepped)``."""
    change = estimate_s - current_s
    if abs(change) > estimate_error_s + current_error_s:
        return estimate_s, estimate_error_s, True
    offset = current_s + max(-slew_max_s, min(slew_max_s, change))
    return offset, abs(estimate_s - offset) + estimate_error_s, False


# --------------------------------------------------------------------------- the clock


class ClusterClock:
    """This process's view of the cluster clock; ``ClockSync`` keeps ``offset_s`` up to date.
    The default (offset 0) is right for the rank itself and for anything on the rank's clock."""

    __slots__ = ("error_s", "estimates", "lost_probes", "offset_s", "reference", "rtt_s",
                 "same_host", "steps")

    def __init__(self, offset_s: float = 0.0, *, reference: bool = False) -> None:
        self.offset_s = offset_s  # rank clock - local clock
        self.error_s = 0.0
        self.reference = reference  # True in the process whose clock is the cluster clock
        self.same_host = reference
        self.estimates = 0
        self.steps = 0
        self.lost_probes = 0
        self.rtt_s = 0.0  # round trip of the sample behind the latest estimate

    def now(self) -> float:
        """The cluster clock now (seconds)."""
        return _monotonic() + self.offset_s

    def to_local(self, cluster_time: float) -> float:
        """A cluster time on this process's CLOCK_MONOTONIC (to arm a local timer)."""
        return cluster_time - self.offset_s

    def use_own_clock(self) -> bool:
        """The rank reads this process's own clock: offset exactly 0. True when that is a step
        (the offset was not 0)."""
        stepped = self.offset_s != 0.0
        self.steps += stepped
        self.offset_s = 0.0
        self.error_s = 0.0
        self.rtt_s = 0.0
        self.same_host = True
        return stepped

    def apply(self, sample: ClockSample) -> bool:
        """Take a new estimate (the best sample of a burst); True when the offset stepped."""
        self.estimates += 1
        self.rtt_s = sample.rtt_s
        if self.estimates == 1 or self.same_host:
            # The first estimate sets the offset; one after a shared clock (the rank moved to
            # another host) steps it.
            stepped = self.same_host and self.offset_s != sample.offset_s
            self.offset_s, self.error_s = sample.offset_s, sample.error_s
        else:
            self.offset_s, self.error_s, stepped = adjust_offset(
                self.offset_s, self.error_s, sample.offset_s, sample.error_s
            )
        self.same_host = False
        self.steps += stepped
        return stepped

    def stats(self) -> dict[str, Any]:
        return {
            "offset_s": self.offset_s,
            "error_ms": self.error_s * 1e3,
            "rtt_ms": self.rtt_s * 1e3,
            "same_host": self.same_host,
            "reference": self.reference,
            "estimates": self.estimates,
            "steps": self.steps,
            "lost_probes": self.lost_probes,
        }

    def describe(self) -> str:
        if self.reference:
            return "this process's CLOCK_MONOTONIC is the cluster clock"
        if self.same_host:
            return "the rank shares this host's clock: offset 0"
        return (f"offset {self.offset_s:+.6f} s +- {self.error_s * 1e3:.3f} ms "
                f"(best round trip {self.rtt_s * 1e3:.3f} ms)")


def reply_to_probe(probe: ClockProbe) -> ClockReply:
    """The rank's answer to a probe: its clock now and its host identity."""
    return ClockReply(probe.seq, time.monotonic(), host_identity())


# --------------------------------------------------------------------------- the estimator's loop


class ClockSync:
    """Keeps a ``ClusterClock`` in step with the rank's clock over a DEALER of its own."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        rank_address: str,
        *,
        name: str,
        clock: ClusterClock | None = None,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        samples_per_estimate: int = SAMPLES_PER_ESTIMATE,
    ) -> None:
        self.clock = clock if clock is not None else ClusterClock()
        self.name = name
        self.rank_address = rank_address
        self.refresh_interval_s = refresh_interval_s
        self.samples_per_estimate = max(1, samples_per_estimate)
        self._sock = make_dealer(ctx, rank_address, identity=f"{name}.clock".encode(),
                                 peer_role="rank")
        self._seq = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self, stop: asyncio.Event | None = None) -> bool:
        """Estimate the offset (probing until the rank answers) and log it, then keep refreshing
        in the background. Returns False, without an estimate, if ``stop`` is set first."""
        first = asyncio.ensure_future(self._first_estimate())
        waiters: list[asyncio.Future[Any]] = [first]
        stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
        if stopper is not None:
            waiters.append(stopper)
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stopper is not None:
                stopper.cancel()
        if not first.done():
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            return False
        first.result()
        log.info("%s: cluster clock from the rank at %s: %s", self.name, self.rank_address,
                 self.clock.describe())
        self._task = asyncio.create_task(self._refresh_loop(), name="clock-refresh")
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        self._sock.close(linger=CLOSE_LINGER_MS)

    # ------------------------------------------------------------------ internals

    async def _first_estimate(self) -> None:
        waiting_since = time.monotonic()
        logged_at = waiting_since
        while True:
            answer = await self._probe(STARTUP_PROBE_TIMEOUT_S)
            if answer is not None:
                await self._estimate(*answer)
                return
            now = time.monotonic()
            if now - logged_at >= STARTUP_LOG_INTERVAL_S:
                logged_at = now
                log.warning("%s: no clock reply from the rank at %s for %.0f s; still asking",
                            self.name, self.rank_address, now - waiting_since)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            answer = await self._probe(PROBE_TIMEOUT_S)
            if answer is not None:
                was = self.clock.describe()
                if await self._estimate(*answer):
                    log.warning("%s: cluster clock stepped: was %s, now %s", self.name, was,
                                self.clock.describe())

    async def _estimate(self, first: ClockSample, rank_host: str) -> bool:
        """Finish an estimate begun with ``first``; True if the offset stepped."""
        if rank_host == host_identity():
            return self.clock.use_own_clock()
        samples = [first]
        for _ in range(self.samples_per_estimate - 1):
            answer = await self._probe(PROBE_TIMEOUT_S)
            if answer is not None and answer[1] == rank_host:
                samples.append(answer[0])
        best = best_sample(samples)
        return best is not None and self.clock.apply(best)

    async def _probe(self, timeout_s: float) -> tuple[ClockSample, str] | None:
        """One probe: its sample and the rank's host identity, or None (no answer in time)."""
        self._seq += 1
        seq = self._seq
        sent_at = time.monotonic()
        if _send_nowait(self._sock, ClockProbe(seq)) is not None:  # queue full: rank unreachable
            await asyncio.sleep(timeout_s)
            self.clock.lost_probes += 1
            return None
        deadline = sent_at + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not await self._sock.poll(max(1, int(remaining * 1e3))):
                break
            frames = await self._sock.recv_multipart(copy=False)
            received_at = time.monotonic()
            try:
                msg = decode(frames)
            except ZServeError as exc:
                log.warning("%s: bad clock reply: %s", self.name, exc)
                continue
            if type(msg) is ClockReply and msg.seq == seq:
                return ClockSample(sent_at, msg.rank_time, received_at), msg.rank_host
            # else: the late answer to an earlier probe that was given up
        self.clock.lost_probes += 1
        return None


def _send_nowait(sock: zmq.asyncio.Socket, msg: Any) -> BaseException | None:
    """A NOBLOCK send on the probe's own asyncio socket (it is awaited for replies, so the send
    goes through zmq.asyncio too); the error (EAGAIN: rank unreachable) instead of raising."""
    future = cast("asyncio.Future[Any]",
                  sock.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False))
    return future.exception() if future.done() else None
