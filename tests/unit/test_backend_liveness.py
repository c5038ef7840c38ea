"""BackendLiveness, built alone around a real PlanFollower: the wedged rule, the heartbeats it
hands its host (none while a batch is wedged) and the drain, driven through a real CoreDriver.
The test is the host: it passes ``now``, collects what would go out and finishes batches."""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np
import pytest

from zserve.backends.follower import DEST_DEVICE, PlanFollower, RunBatch
from zserve.backends.liveness import WEDGED_FACTOR, WEDGED_MIN_S, BackendLiveness
from zserve.config.profiles import LatencyProfile
from zserve.core.epochs import EpochFence
from zserve.core.errors import ErrorKind
from zserve.core.hosting import Outbox
from zserve.runtime.clock import ClusterClock
from zserve.runtime.driver import CoreDriver, Event
from zserve.transport.messages import BatchFailed, BatchPlan, Heartbeat, InputReply

NAME = "backend-0"
MODEL = "m"
FRONTEND = "ipc://frontend-0.data"
PROFILE = LatencyProfile.linear(1.0, 10.0, 8)  # l(b) = b + 10 ms
# Bounds a test's wait on an event that the code under test sets at once; never reached.
EVENT_BOUND_S = 10.0
# A drain's grace period far longer than EVENT_BOUND_S: a drain that returns in time did not
# wait it out.
DRAIN_S = 3600.0


def make_follower() -> PlanFollower:
    follower = PlanFollower(NAME)
    follower.add_model(MODEL, PROFILE.table_s, PROFILE.max_batch)
    return follower


def make_plan(plan_id: int, exec_at: float, planned_s: float) -> BatchPlan:
    return BatchPlan(plan_id, MODEL, 0, exec_at, exec_at + planned_s, [FRONTEND], [0],
                     [plan_id], [exec_at + planned_s + 1.0])


def hold(follower: PlanFollower, now: float, plan: BatchPlan) -> Outbox:
    """A plan and its inputs at ``now``; the outbox (a RunBatch when it starts now)."""
    outbox: Outbox = []
    follower.on_plan(now, plan, outbox)
    inputs = [{"x": np.zeros((1, 2), np.float32)}]
    follower.on_input_reply(now, FRONTEND, InputReply(plan.plan_id, [plan.plan_id], inputs, []),
                            outbox)
    return outbox


def started(outbox: Outbox) -> list[int]:
    """The plan ids of the batches ``outbox`` starts."""
    return [msg.plan.plan_id for dest, msg in outbox
            if dest[0] == DEST_DEVICE and isinstance(msg, RunBatch)]


def alone(follower: PlanFollower, fence: EpochFence | None = None) -> BackendLiveness:
    """The part on its own, for its pure rules: no drain, no heartbeat loop."""
    def no_run(event: Event) -> None:
        raise AssertionError("no follower event expected")

    def no_send(beat: Heartbeat) -> None:
        raise AssertionError("no heartbeat sent expected")

    return BackendLiveness(NAME, follower, ClusterClock(), fence or EpochFence(), run=no_run,
                           send_beat=no_send)


def test_a_batch_is_wedged_past_its_factor_and_never_before_the_floor() -> None:
    follower = make_follower()
    liveness = alone(follower)
    assert not liveness.wedged(1e6)  # nothing runs
    short_s = 0.011  # 10 x 11 ms is far below the floor
    assert started(hold(follower, 0.0, make_plan(1, 0.0, short_s))) == [1]
    assert not liveness.wedged(WEDGED_MIN_S)
    assert liveness.wedged(WEDGED_MIN_S + 1e-6)
    follower.on_batch_done(0.5, ok=True, finished_at=0.5, outbox=[])
    assert not liveness.wedged(1e6)

    long_s = 0.5  # a long batch: WEDGED_FACTOR x its plan, well past the floor
    assert started(hold(follower, 10.0, make_plan(2, 10.0, long_s))) == [2]
    assert not liveness.wedged(10.0 + WEDGED_FACTOR * long_s)
    assert liveness.wedged(10.0 + WEDGED_FACTOR * long_s + 1e-6)


def test_heartbeats_carry_the_newest_epoch_and_stop_while_a_batch_is_wedged(
        caplog: pytest.LogCaptureFixture) -> None:
    follower = make_follower()
    fence = EpochFence()
    liveness = alone(follower, fence=fence)
    first = liveness.heartbeat(0.0)
    assert first == Heartbeat(NAME, 1, 0.0, 0)
    fence.note(7)
    assert started(hold(follower, 1.0, make_plan(1, 1.0, 0.011))) == [1]
    assert liveness.heartbeat(1.5) == Heartbeat(NAME, 2, 1.5, 7)  # running, not wedged yet
    wedged_at = 1.0 + WEDGED_MIN_S + 0.1
    with caplog.at_level(logging.ERROR, logger="zserve.backends.liveness"):
        assert liveness.heartbeat(wedged_at) is None
        assert liveness.heartbeat(wedged_at + 0.5) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{NAME}: batch 1 is wedged; heartbeats to the rank stop"]  # once per wedge
    follower.on_batch_done(wedged_at + 1.0, ok=True, finished_at=wedged_at + 1.0, outbox=[])
    assert liveness.heartbeat(wedged_at + 1.0) == Heartbeat(NAME, 3, wedged_at + 1.0, 7)


async def test_the_heartbeat_loop_hands_its_host_a_beat_at_once() -> None:
    beats: list[Heartbeat] = []
    sent = asyncio.Event()

    def send_beat(beat: Heartbeat) -> None:
        beats.append(beat)
        sent.set()

    liveness = BackendLiveness(NAME, make_follower(), ClusterClock(), EpochFence(),
                               run=lambda event: None, send_beat=send_beat)
    task = asyncio.create_task(liveness.heartbeat_loop())
    try:
        # The first beat goes out before the loop's first sleep (HEARTBEAT_INTERVAL_S).
        await asyncio.wait_for(sent.wait(), EVENT_BOUND_S)
        assert [beat.seq for beat in beats] == [1]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


class DrainHost:
    """The liveness's host for the drain: a real CoreDriver around the follower; what it
    delivers is kept, and ``first_delivery`` is set once the drain's first event went out."""

    def __init__(self) -> None:
        self.clock = ClusterClock()
        self.follower = make_follower()
        self.delivered: Outbox = []
        self.first_delivery = asyncio.Event()
        self.liveness = BackendLiveness(NAME, self.follower, self.clock, EpochFence(),
                                        run=self.run, send_beat=lambda beat: None)
        self.driver = CoreDriver(self.follower, loop=asyncio.get_running_loop(),
                                 clock=self.clock, deliver=self.deliver,
                                 after=self.liveness.note_delivered)

    def run(self, event: Event) -> None:
        self.driver.run(event)
        self.first_delivery.set()

    def deliver(self, outbox: Outbox) -> None:
        self.delivered.extend(outbox)
        outbox.clear()



async def test_a_drain_answers_what_cannot_start_and_waits_for_the_running_batch() -> None:
    host = DrainHost()
    follower = host.follower
    now = host.clock.now()
    host.driver.flush(hold(follower, now, make_plan(1, now, 0.011)))  # runs at once
    far = make_plan(2, now + 2 * DRAIN_S, 0.011)  # cannot start within the drain
    host.driver.flush(hold(follower, now, far))
    assert started(host.delivered) == [1]
    drain = asyncio.create_task(host.liveness.drain(drain_s=DRAIN_S))
    await asyncio.wait_for(host.first_delivery.wait(), EVENT_BOUND_S)
    # The drain now waits for the running batch: plan 2 was answered, new plans are refused.
    refused = [msg for _, msg in host.delivered if isinstance(msg, BatchFailed)]
    assert [(m.plan_id, m.error) for m in refused] == [(2, ErrorKind.SHUTTING_DOWN.value)]
    assert follower.draining and not drain.done()
    host.driver.run(lambda at, outbox: follower.on_batch_done(at, ok=True, finished_at=at,
                                                               outbox=outbox))
    await asyncio.wait_for(drain, EVENT_BOUND_S)  # returns as soon as the follower is idle
    assert follower.idle and follower.wake_at == math.inf
    host.driver.close()


async def test_a_drain_with_nothing_held_returns_at_once() -> None:
    host = DrainHost()
    await asyncio.wait_for(host.liveness.drain(drain_s=DRAIN_S), EVENT_BOUND_S)
    assert host.follower.draining and host.delivered == []
    host.driver.close()
