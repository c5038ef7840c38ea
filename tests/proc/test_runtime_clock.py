"""The cluster clock (``zserve.runtime.clock``): the estimator fed synthetic samples (pure), the
refresh rule, and ``ClockSync`` against a stand-in rank over real sockets whose clock is shifted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio
from hypothesis import given
from hypothesis import strategies as st
from runtime_helpers import wait_until_async

from zserve.runtime.clock import (
    SLEW_MAX_S,
    ClockSample,
    ClockSync,
    ClusterClock,
    adjust_offset,
    best_sample,
    host_identity,
)
from zserve.transport.messages import ClockProbe, ClockReply, Message
from zserve.transport.reactor import SocketReactor
from zserve.transport.sockets import LOOPBACK_TCP_ANY_PORT, make_router

TRUE_OFFSET_S = 1000.0  # rank clock - local clock in the synthetic samples


def _sample(sent_at: float, outbound_s: float, inbound_s: float,
            offset_s: float = TRUE_OFFSET_S) -> ClockSample:
    """A probe sent at ``sent_at`` that takes ``outbound_s`` to reach a rank whose clock is
    ``offset_s`` ahead, and ``inbound_s`` to come back."""
    return ClockSample(sent_at, sent_at + outbound_s + offset_s, sent_at + outbound_s + inbound_s)


# --------------------------------------------------------------------------- the estimator


def test_sample_offset_error_and_rtt() -> None:
    sample = _sample(10.0, 0.001, 0.003)
    assert sample.rtt_s == pytest.approx(0.004)
    assert sample.error_s == pytest.approx(0.002)
    # The rank read its clock 1 ms after the send, not half-way (2 ms): the estimate is 1 ms low,
    # within the bound.
    assert sample.offset_s == pytest.approx(TRUE_OFFSET_S - 0.001)


@given(sent_at=st.floats(0.0, 1e6), outbound_s=st.floats(0.0, 1.0),
       inbound_s=st.floats(0.0, 1.0), offset_s=st.floats(-1e5, 1e5))
def test_true_offset_is_always_within_the_bound(sent_at: float, outbound_s: float,
                                                inbound_s: float, offset_s: float) -> None:
    sample = _sample(sent_at, outbound_s, inbound_s, offset_s)
    assert abs(sample.offset_s - offset_s) <= sample.error_s + 1e-6  # float rounding at 1e6 s


def test_best_sample_has_the_smallest_round_trip() -> None:
    samples = [_sample(1.0, 0.004, 0.0005), _sample(2.0, 0.0002, 0.0001),
               _sample(3.0, 0.0001, 0.009)]
    best = best_sample(samples)
    assert best is samples[1]
    assert abs(best.offset_s - TRUE_OFFSET_S) <= 0.00005 + 1e-12
    assert best_sample([]) is None
    # A negative round trip (a broken sample) is never chosen.
    broken = ClockSample(5.0, 1005.0, 4.9)
    assert best_sample([broken, samples[0]]) is samples[0]
    assert best_sample([broken]) is None


def test_refresh_rule_slews_agreeing_estimates_and_steps_disagreeing_ones() -> None:
    # Agreeing (intervals overlap), within the slew limit: taken whole.
    offset, error, stepped = adjust_offset(10.0, 0.001, 10.0003, 0.0002)
    assert not stepped and offset == pytest.approx(10.0003) and error == pytest.approx(0.0002)
    # Agreeing but further than the slew limit (a noisy estimate): moves by SLEW_MAX_S only, and
    # the bound says how far the offset may now be from the truth.
    offset, error, stepped = adjust_offset(10.0, 0.004, 10.003, 0.001)
    assert not stepped and offset == pytest.approx(10.0 + SLEW_MAX_S)
    assert error == pytest.approx(0.003 - SLEW_MAX_S + 0.001)
    offset, _, stepped = adjust_offset(10.0, 0.004, 9.997, 0.001)
    assert not stepped and offset == pytest.approx(10.0 - SLEW_MAX_S)
    # Disagreeing (disjoint intervals): the clocks moved apart; step.
    offset, error, stepped = adjust_offset(10.0, 0.0001, 10.01, 0.0002)
    assert stepped and offset == 10.01 and error == 0.0002


def test_cluster_clock_applies_estimates() -> None:
    clock = ClusterClock()
    assert clock.offset_s == 0.0 and not clock.same_host and not clock.reference
    assert clock.apply(_sample(1.0, 0.0001, 0.0001)) is False  # the first one is set, not a step
    assert clock.offset_s == pytest.approx(TRUE_OFFSET_S) and clock.error_s == pytest.approx(1e-4)
    local_now = time.monotonic()
    assert clock.now() - local_now == pytest.approx(TRUE_OFFSET_S, abs=0.1)
    assert clock.to_local(clock.offset_s + 5.0) == pytest.approx(5.0)
    # A later agreeing estimate slews; a disagreeing one steps (counted).
    assert clock.apply(_sample(2.0, 0.0001, 0.0001, TRUE_OFFSET_S + 0.0001)) is False
    assert clock.offset_s == pytest.approx(TRUE_OFFSET_S + 0.0001)
    assert clock.apply(_sample(3.0, 0.0001, 0.0001, TRUE_OFFSET_S + 7.0)) is True
    assert clock.offset_s == pytest.approx(TRUE_OFFSET_S + 7.0) and clock.steps == 1
    # The rank turns out to share this clock: exactly 0 (a step from 1007 s).
    assert clock.use_own_clock() is True
    assert clock.offset_s == 0.0 and clock.same_host and clock.steps == 2
    assert clock.stats()["same_host"] is True
    # ... and then moved to another host: a step again.
    assert clock.apply(_sample(4.0, 0.0001, 0.0001)) is True
    assert clock.offset_s == pytest.approx(TRUE_OFFSET_S) and not clock.same_host
    assert clock.steps == 3


def test_host_identity_names_boot_and_time_namespace() -> None:
    identity = host_identity()
    assert identity == host_identity()  # stable within a process
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert identity.startswith(f.read().strip())


# --------------------------------------------------------------------------- ClockSync


class StandInRank:
    """A ROUTER answering ClockProbes with ``time.monotonic() + shift_s`` and ``host``."""

    def __init__(self, ctx: zmq.asyncio.Context, shift_s: float, host: str,
                 answer: Callable[[int], bool] = lambda seq: True) -> None:
        # A plain socket on the reactor, as the real rank process has.
        sync_ctx: zmq.Context[Any] = zmq.Context.shadow(ctx.underlying)
        self.sock, self.address = make_router(sync_ctx, LOOPBACK_TCP_ANY_PORT,
                                              name="stand-in rank")
        self.shift_s = shift_s
        self.host = host
        self.answer = answer
        self.probes = 0
        self.reactor = SocketReactor(asyncio.get_running_loop())
        self.reactor.watch(self.sock, router=True, on_chunk=self._on_chunk)

    def _on_chunk(self, chunk: list[tuple[bytes | None, Message]]) -> None:
        for identity, msg in chunk:
            if isinstance(msg, ClockProbe):
                self.probes += 1
                if self.answer(msg.seq):
                    reply = ClockReply(msg.seq, time.monotonic() + self.shift_s, self.host)
                    self.reactor.send_nowait(self.sock, reply, identity)

    async def close(self) -> None:
        self.reactor.close()
        self.sock.close(linger=0)


@pytest.fixture
async def clock_ctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_clock_sync_estimates_a_shifted_rank(clock_ctx: zmq.asyncio.Context) -> None:
    # The stand-in leaves one probe of the first burst unanswered (lost): the estimate goes on
    # without it.
    rank = StandInRank(clock_ctx, 1234.5, "another-host", answer=lambda seq: seq != 2)
    sync = ClockSync(clock_ctx, rank.address, name="t", refresh_interval_s=0.05)
    try:
        assert await asyncio.wait_for(sync.start(), 20.0)
        clock = sync.clock
        # (A loaded machine may also give up on a slow answer: at least the one dropped.)
        assert not clock.same_host and clock.estimates == 1 and clock.lost_probes >= 1
        assert abs(clock.offset_s - 1234.5) <= clock.error_s + 1e-6
        assert clock.error_s < 0.1  # loopback: even a starved process answers well within that
        # Refreshes keep it there (the same clocks: nothing to step).
        async def refreshed() -> bool:
            return clock.estimates >= 3

        await wait_until_async(refreshed, "two refreshes of the estimate")
        assert abs(clock.offset_s - 1234.5) <= clock.error_s + 1e-6 and clock.steps == 0
    finally:
        await sync.close()
        await rank.close()


async def test_clock_sync_on_the_rank_clock_is_exactly_zero(
    clock_ctx: zmq.asyncio.Context,
) -> None:
    rank = StandInRank(clock_ctx, 0.0, host_identity())
    sync = ClockSync(clock_ctx, rank.address, name="t")
    try:
        assert await asyncio.wait_for(sync.start(), 20.0)
        assert sync.clock.offset_s == 0.0 and sync.clock.same_host
        assert rank.probes == 1  # one probe to learn the host; no sampling
    finally:
        await sync.close()
        await rank.close()


async def test_clock_sync_start_gives_up_when_told_to_stop(
    clock_ctx: zmq.asyncio.Context,
) -> None:
    rank = StandInRank(clock_ctx, 0.0, "x", answer=lambda seq: False)  # never answers
    sync = ClockSync(clock_ctx, rank.address, name="t")
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, stop.set)
    try:
        assert not await asyncio.wait_for(sync.start(stop), 20.0)
        assert sync.clock.estimates == 0
    finally:
        await sync.close()
        await rank.close()
