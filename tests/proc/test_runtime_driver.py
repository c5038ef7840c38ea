"""The one host drive loop (``zserve.runtime.driver.CoreDriver``) and the role start-up order
(``zserve.runtime.session.RoleSession``), on a real event loop and real ZeroMQ contexts.

The core here is a small real one written to the hosting contract (a countdown that emits at
moments it asks for), so that each promise of the driver is visible: outbox delivered in order,
the timer at ``wake_at`` and never before it, what ``deliver`` and ``after`` append delivered too,
nothing after ``close``.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from runtime_helpers import emulated_cluster

from zserve.config.cluster import role_config
from zserve.core.hosting import DEST_FRONTEND, Destination, Outbox
from zserve.runtime.clock import ClusterClock
from zserve.runtime.driver import CoreDriver
from zserve.runtime.session import EXIT_NO_CLOCK, RoleSession
from zserve.transport.messages import DropNotice

TO_F: Destination = (DEST_FRONTEND, "f")


def _notice(tag: int) -> DropNotice:
    return DropNotice(request_ids=[tag], error="deadline", message=str(tag))


class Countdown:
    """Asks to be woken at each moment of ``moments`` and emits one notice at each."""

    def __init__(self) -> None:
        self.moments: list[float] = []
        self.woken_at: list[float] = []

    @property
    def wake_at(self) -> float:
        return self.moments[0] if self.moments else math.inf

    def add(self, now: float, outbox: Outbox, at: float, tag: int) -> None:
        self.moments = sorted([*self.moments, at])
        outbox.append((TO_F, _notice(tag)))

    def on_timer(self, now: float, outbox: Outbox) -> None:
        while self.moments and self.moments[0] <= now:
            self.moments.pop(0)
            self.woken_at.append(now)
            outbox.append((TO_F, _notice(-1)))


async def test_the_driver_delivers_in_order_and_wakes_the_core_at_its_moments() -> None:
    loop = asyncio.get_running_loop()
    clock = ClusterClock()
    core = Countdown()
    delivered: list[int] = []
    all_woken = asyncio.Event()

    def deliver(outbox: Outbox) -> None:
        for _, msg in outbox:
            assert isinstance(msg, DropNotice)
            delivered.append(msg.request_ids[0])
        outbox.clear()
        if len(core.woken_at) == 2:
            all_woken.set()

    driver = CoreDriver(core, loop=loop, clock=clock, deliver=deliver)
    start = clock.now()
    moments = [start + 0.02, start + 0.01]
    driver.run(lambda now, out: core.add(now, out, moments[0], 1))
    driver.run(lambda now, out: core.add(now, out, moments[1], 2))
    assert delivered == [1, 2]
    await asyncio.wait_for(all_woken.wait(), timeout=10)
    assert delivered == [1, 2, -1, -1]
    # Never before the moment asked for (the contract's one hard promise).
    assert core.woken_at[0] >= min(moments) and core.woken_at[1] >= max(moments)
    driver.close()


@pytest.mark.parametrize("precise", [True, False])
async def test_what_deliver_and_after_append_goes_out_and_close_stops_the_timer(
        precise: bool) -> None:
    loop = asyncio.get_running_loop()
    clock = ClusterClock()
    core = Countdown()
    delivered: list[int] = []
    after_calls: list[int] = []

    def deliver(outbox: Outbox) -> None:
        batch = [msg.request_ids[0] for _, msg in outbox if isinstance(msg, DropNotice)]
        outbox.clear()
        delivered.extend(batch)
        if 1 in batch:  # a failed send answered by the core: appended while delivering
            outbox.append((TO_F, _notice(10)))

    def after(outbox: Outbox) -> None:
        after_calls.append(len(delivered))
        if len(after_calls) == 1:  # an end-of-tick answer
            outbox.append((TO_F, _notice(20)))

    driver = CoreDriver(core, loop=loop, clock=clock, deliver=deliver, after=after,
                        precise=precise)
    driver.run(lambda now, out: core.add(now, out, now + 0.005, 1))
    assert delivered == [1, 10, 20]
    assert after_calls == [2, 3]  # again after its own answer went out, then quiet
    driver.close()
    driver.run(lambda now, out: core.add(now, out, now + 0.001, 2))
    assert delivered == [1, 10, 20]  # closed: nothing goes out
    await asyncio.sleep(0.05)  # past both moments: a timer left armed would have fired
    assert core.woken_at == []


async def test_a_role_session_closes_in_reverse_order_and_reports_a_missing_rank(
        tmp_path: Path) -> None:
    config = role_config(emulated_cluster(), "frontend", 0, ipc_dir=str(tmp_path))
    closed: list[str] = []

    async def close_async() -> None:
        closed.append("async")

    async with RoleSession.open(config, None, role="frontend") as session:
        session.closing(lambda: closed.append("first"))
        session.closing(close_async)
        # Detached (no supervisor): Ready is logged and the configured peer map comes back.
        assert await session.ready({"client": "ipc://x"}) == config.peers
        assert await session.sync_clock(ClusterClock(), {}) is False
        assert session.exit_code == EXIT_NO_CLOCK
        session.drain.request("test")
        drain = await asyncio.wait_for(session.drained(), timeout=10)
        assert drain.reason == "test"
    assert closed == ["async", "first"]
    assert session.ctx.closed
