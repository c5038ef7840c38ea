"""Precise timers (zserve.runtime.timers): never early, in deadline order, cancellable; timerfd and
the polling fallback alike. Lateness is not asserted (a shared machine); earliness is, exactly."""

from __future__ import annotations

import asyncio
import functools
import sys
import time

import pytest
import uvloop

from zserve.runtime.timers import PreciseTimers, sleep_until, timers_for


async def _fire_all(timers: PreciseTimers, offsets_s: list[float]) -> list[tuple[int, float]]:
    """Schedule one callback per offset; return (index, fired at - deadline) in firing order."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    fired: list[tuple[int, float]] = []
    base = time.monotonic()

    def callback(index: int, when: float) -> None:
        fired.append((index, time.monotonic() - when))
        if len(fired) == len(offsets_s) - 1 and not done.done():
            done.set_result(None)

    handles = []
    for index, offset in enumerate(offsets_s):
        when = base + offset
        handles.append(timers.call_at(when, functools.partial(callback, index, when)))
    handles[1].cancel()  # one cancelled timer: it must never fire
    await done
    return fired


@pytest.mark.parametrize("use_timerfd", [True, False])
def test_timers_fire_in_order_never_early(use_timerfd: bool) -> None:
    if use_timerfd and not sys.platform.startswith("linux"):
        pytest.skip("timerfd is Linux's")
    # Sub-millisecond spacings: what uvloop's own millisecond timers cannot keep apart.
    offsets = [0.0042, 0.0031, 0.0025, 0.0026, 0.0001, 0.0057, 0.0034]

    async def main() -> list[tuple[int, float]]:
        timers = PreciseTimers(asyncio.get_running_loop(), use_timerfd=use_timerfd)
        assert timers.uses_timerfd == use_timerfd
        try:
            return await _fire_all(timers, offsets)
        finally:
            timers.close()

    fired = uvloop.run(main())
    expected = sorted((i for i in range(len(offsets)) if i != 1), key=lambda i: offsets[i])
    assert [i for i, _ in fired] == expected
    assert min(late for _, late in fired) >= 0.0, "a timer fired before its deadline"


def test_sleep_until_and_one_instance_per_loop() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        assert timers_for(loop) is timers_for()
        target = time.monotonic() + 0.0023
        await sleep_until(target)
        await sleep_until(target - 1.0)  # a moment already past returns at once
        return time.monotonic() - target

    assert uvloop.run(main()) >= 0.0
