"""Emulated executor: batches complete l(b) after they start, by timer, with real outputs.

Timing assertions. A batch must never complete EARLY: ``finish - start >= l(b)`` by
``time.monotonic()`` (the clock of every zserve timestamp) is asserted exactly. How
LATE it completes depends on the event loop's timer lateness, which on a loaded 2-core machine
shared with other test runs can reach tens of milliseconds; the upper bound is therefore a
generous ``l(b) + LATENESS_BOUND_S`` (0.5 s), which is there to catch a batch that waits for the
wrong deadline (e.g. l(b) in ms taken as seconds), not to measure timer precision.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvloop

from zserve.backends.emulated import EmulatedExecutor, EmulatedModel
from zserve.backends.profiler import LatencyMeasurement, write_profile_file
from zserve.core.errors import BadRequestError, InternalError

LATENESS_BOUND_S = 0.5


def _executor(*extra: EmulatedModel) -> EmulatedExecutor:
    return EmulatedExecutor(
        [
            EmulatedModel("resnet", alpha_ms=2.0, beta_ms=10.0, max_batch=16),
            EmulatedModel("bert", alpha_ms=1.0, beta_ms=5.0, max_batch=8, input_shape=(2, 3),
                          output_shape=(4,), constant=0.5),
            *extra,
        ]
    )


def _requests(
    n: int, shape: tuple[int, ...] = (4,), offset: float = 0.0
) -> list[dict[str, np.ndarray[Any, Any]]]:
    return [{"x": np.full((1, *shape), i + offset, np.float32)} for i in range(n)]


async def test_batch_completes_after_exactly_l_b_by_the_monotonic_clock() -> None:
    executor = _executor()
    for batch_size in (1, 4, 16):
        latency_s = executor.latency_s("resnet", batch_size)
        assert latency_s == pytest.approx((2.0 * batch_size + 10.0) / 1e3)
        start = time.monotonic()
        outputs = await executor.run_async("resnet", _requests(batch_size))
        elapsed = time.monotonic() - start
        assert elapsed >= latency_s, "completed early"
        assert elapsed < latency_s + LATENESS_BOUND_S
        assert len(outputs) == batch_size


async def test_outputs_are_each_requests_own_answer() -> None:
    executor = _executor()
    requests = _requests(5, shape=(2, 3), offset=1.0)
    outputs = await executor.run_async("bert", requests)
    for i, (request, output) in enumerate(zip(requests, outputs, strict=True)):
        # 2 * sum(inputs) + constant, broadcast to the output shape, one row per request.
        expected = 2.0 * (i + 1.0) * 6 + 0.5
        assert output["y"].shape == (1, 4)
        np.testing.assert_array_equal(output["y"], np.full((1, 4), expected, np.float32))
        np.testing.assert_array_equal(output["y"], executor.expected_outputs("bert", request)["y"])
    stacked = {"x": np.concatenate([r["x"] for r in requests])}
    again = await executor.run_async("bert", stacked)
    for a, b in zip(outputs, again, strict=True):
        np.testing.assert_array_equal(a["y"], b["y"])


async def test_many_emulated_gpus_run_concurrently_on_one_loop() -> None:
    # 50 emulated GPUs, each running a 200 ms batch at once: timers, not busy loops, so they
    # overlap and all finish after ~200 ms instead of 10 s.
    latency_s = 0.2
    executors = [_executor(EmulatedModel("slow", 0.0, latency_s * 1e3)) for _ in range(50)]
    start = time.monotonic()
    finished: list[float] = []

    async def one(executor: EmulatedExecutor) -> None:
        await executor.run_async("slow", _requests(3))
        finished.append(time.monotonic() - start)

    await asyncio.gather(*(one(e) for e in executors))
    assert min(finished) >= latency_s
    assert max(finished) < latency_s + LATENESS_BOUND_S


async def test_one_device_runs_one_batch_at_a_time() -> None:
    executor = _executor()
    start = time.monotonic()
    first = asyncio.ensure_future(executor.run_async("resnet", _requests(1)))  # 12 ms
    second = asyncio.ensure_future(executor.run_async("bert", _requests(2, (2, 3))))  # 7 ms
    await first
    first_done = time.monotonic() - start
    await second
    second_done = time.monotonic() - start
    assert first_done >= 0.012
    assert second_done >= 0.012 + 0.007, "the second batch started before the first finished"
    assert second_done < 0.019 + LATENESS_BOUND_S


def test_uvloop_timers_never_complete_early() -> None:
    # uvloop (the loop zserve processes run) has millisecond timers that may round a deadline
    # down; the executor's precise timers must still never finish early.
    # l(3) of "odd" is 2.35 ms: not a whole number of uvloop's 1 ms timer ticks.
    executor = _executor(EmulatedModel("odd", alpha_ms=0.3, beta_ms=1.45, max_batch=4))

    async def measure(make: Callable[[], Awaitable[object]]) -> list[float]:
        gaps = []
        for _ in range(5):
            start = time.monotonic()
            await make()
            gaps.append(time.monotonic() - start)
        return gaps

    for model, batch, shape in (("bert", 3, (2, 3)), ("odd", 3, (4,))):
        latency_s = executor.latency_s(model, batch)
        requests = _requests(batch, shape)
        gaps = uvloop.run(measure(functools.partial(executor.run_async, model, requests)))
        assert min(gaps) >= latency_s, "completed early on uvloop"
        assert max(gaps) < latency_s + LATENESS_BOUND_S


def test_synchronous_run_sleeps_l_b() -> None:
    executor = _executor()
    start = time.monotonic()
    outputs = executor.run("resnet", _requests(2))
    elapsed = time.monotonic() - start
    assert elapsed >= executor.latency_s("resnet", 2)
    assert elapsed < executor.latency_s("resnet", 2) + LATENESS_BOUND_S
    assert [float(o["y"][0, 0]) for o in outputs] == [
        float(executor.expected_outputs("resnet", r)["y"][0, 0]) for r in _requests(2)
    ]


async def test_bad_batches_are_rejected_without_waiting() -> None:
    executor = _executor()
    with pytest.raises(BadRequestError, match="unknown model"):
        await executor.run_async("vgg", _requests(1))
    with pytest.raises(BadRequestError, match="request 1 of the batch"):
        await executor.run_async("resnet", [*_requests(1), {"x": np.zeros((1, 5), np.float32)}])
    with pytest.raises(InternalError, match=r"outside 1\.\.16"):
        await executor.run_async("resnet", _requests(17))


def test_profile_and_profile_file(tmp_path: Path) -> None:
    executor = _executor()
    profile = executor.profile("resnet")
    assert isinstance(profile, LatencyMeasurement)
    assert profile.alpha_ms == pytest.approx(2.0)
    assert profile.beta_ms == pytest.approx(10.0)
    assert profile.r2 == pytest.approx(1.0)
    entry = profile.to_file_entry().to_dict()
    model = EmulatedModel.from_profile_entry("resnet", entry)
    assert model.max_batch == 16
    assert model.latency_s(16) == pytest.approx(0.042)
    path = tmp_path / "profiles.json"
    write_profile_file(path, "cpu", [profile, executor.profile("bert")])
    emulated = EmulatedExecutor.from_profile_file(path, ["resnet"], output_shape=(3,))
    assert emulated.models == ["resnet"]
    assert emulated.latency_s("resnet", 5) == pytest.approx(0.020)
    assert emulated.compute("resnet", _requests(1))[0]["y"].shape == (1, 3)
    with pytest.raises(ValueError, match="no profile for"):
        EmulatedExecutor.from_profile_file(path, ["vgg"])
    with pytest.raises(ValueError, match="latency_ms has 2 entries"):
        EmulatedModel("m", 1.0, 1.0, max_batch=3, latency_ms=(1.0, 2.0))
