"""Emulated executor: batches complete l(b) after they start, by timer, with real outputs.

Timing, asserted as logic a busy host cannot break. A batch must never complete EARLY:
``finish - start >= l(b)`` by ``time.monotonic()`` (the clock of every zserve timestamp) is
asserted exactly; a loaded host only makes a batch later. That it is not LATE, i.e. that it
waits for ``start + l(b)`` and not a later deadline (l(b) in ms taken as seconds, batches of one
device run one after another when they could overlap, or devices that block each other), is
asserted by order instead of by a wall-clock bound: a reference timer armed at ``l(b)`` after
the batch started, on the same precise timers (``zserve.runtime.timers``), which fire in
deadline order however late the loop gets to them, must fire after the batch finished. How late
a batch completes on a given host is a measurement (``zserve bench-wakeup``), not a test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvloop

from zserve.backends.emulated import EmulatedExecutor, EmulatedModel
from zserve.backends.executor import TensorMap
from zserve.backends.profiler import LatencyMeasurement, write_profile_file
from zserve.core.errors import BadRequestError, InternalError
from zserve.runtime.timers import timers_for

# Float rounding between start + l(b) computed by the executor and by the reference.
ROUNDING_S = 1e-9


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


async def _finish_before_reference(
    batches: Sequence[Awaitable[list[TensorMap]]], reference_after_s: float, *,
    suspended: bool = False,
) -> list[tuple[float, list[TensorMap]]]:
    """Run ``batches`` (``run_async`` calls) as tasks; once each has read its start time, arm a
    reference timer ``reference_after_s`` later on the loop's precise timers, and assert that
    every batch finished before the reference fired. Returns, per batch, when it finished
    (``time.monotonic()``) and its outputs. ``suspended``: also assert that every batch was
    waiting on the loop after its first step (a batch that blocks the loop is done by then).

    Why the order cannot depend on how busy the host is: a batch's timer is due no later than
    the reference (its start was read before the reference's), timers fire in deadline order
    (ties in the order armed) however late, and each resolves a future whose waiting task the
    loop wakes through ``call_soon``, in order."""
    loop = asyncio.get_running_loop()
    order: list[int | str] = []

    async def one(index: int, batch: Awaitable[list[TensorMap]]) -> tuple[float, list[TensorMap]]:
        outputs = await batch
        order.append(index)
        return time.monotonic(), outputs

    tasks = [asyncio.ensure_future(one(i, b)) for i, b in enumerate(batches)]
    await asyncio.sleep(0)  # each task's first step (call_soon order): it read its start
    if suspended:
        assert order == [], f"batches {order} blocked the loop until they were done"
    fired: asyncio.Future[None] = loop.create_future()

    async def reference() -> None:
        await fired
        order.append("reference")

    waiter = asyncio.ensure_future(reference())
    timers_for(loop).call_at(time.monotonic() + reference_after_s + ROUNDING_S,
                             lambda: fired.set_result(None))
    finished = await asyncio.gather(*tasks)
    await waiter
    assert order[-1] == "reference", f"a batch finished after its deadline: {order}"
    return finished


async def test_batch_completes_after_exactly_l_b_by_the_monotonic_clock() -> None:
    executor = _executor()
    for batch_size in (1, 4, 16):
        latency_s = executor.latency_s("resnet", batch_size)
        assert latency_s == pytest.approx((2.0 * batch_size + 10.0) / 1e3)
        start = time.monotonic()
        [(finished, outputs)] = await _finish_before_reference(
            [executor.run_async("resnet", _requests(batch_size))], latency_s)
        assert finished - start >= latency_s, "completed early"
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
    # overlap: each waits on the loop once started (a batch would have to take 200 ms to compute
    # its outputs to be done by then), and all finish before a reference timer 200 ms after the
    # last one started (one after another they would take 10 s).
    latency_s = 0.2
    executors = [_executor(EmulatedModel("slow", 0.0, latency_s * 1e3)) for _ in range(50)]
    start = time.monotonic()
    finished = await _finish_before_reference(
        [e.run_async("slow", _requests(3)) for e in executors], latency_s, suspended=True)
    assert min(at for at, _ in finished) - start >= latency_s


async def test_one_device_runs_one_batch_at_a_time() -> None:
    executor = _executor()
    start = time.monotonic()
    # resnet l(1) = 12 ms, then bert l(2) = 7 ms on the same device: the second starts when the
    # first finishes, so both are done 19 ms after they were submitted, not before, not later.
    [(first_done, _), (second_done, _)] = await _finish_before_reference(
        [executor.run_async("resnet", _requests(1)),
         executor.run_async("bert", _requests(2, (2, 3)))], 0.012 + 0.007)
    assert first_done - start >= 0.012
    assert second_done - start >= 0.012 + 0.007, "the second batch started before the first ended"
    assert second_done >= first_done


def test_uvloop_timers_never_complete_early() -> None:
    # uvloop (the loop zserve processes run) has millisecond timers that may round a deadline
    # down; the executor's precise timers must still never finish early, nor wait past l(b).
    # l(3) of "odd" is 2.35 ms: not a whole number of uvloop's 1 ms timer ticks.
    executor = _executor(EmulatedModel("odd", alpha_ms=0.3, beta_ms=1.45, max_batch=4))

    async def measure(model: str, requests: list[dict[str, Any]]) -> list[float]:
        gaps = []
        for _ in range(5):
            start = time.monotonic()
            [(finished, _)] = await _finish_before_reference(
                [executor.run_async(model, requests)], executor.latency_s(model, len(requests)))
            gaps.append(finished - start)
        return gaps

    for model, batch, shape in (("bert", 3, (2, 3)), ("odd", 3, (4,))):
        gaps = uvloop.run(measure(model, _requests(batch, shape)))
        assert min(gaps) >= executor.latency_s(model, batch), "completed early on uvloop"


def test_synchronous_run_sleeps_l_b() -> None:
    executor = _executor()
    start = time.monotonic()
    outputs = executor.run("resnet", _requests(2))
    # Never early. (Not late is the async tests' order check: ``run`` sleeps to the same
    # ``start + l(b)``, and a sleeping thread has no ordering a busy host cannot break.)
    assert time.monotonic() - start >= executor.latency_s("resnet", 2)
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


def test_an_emulated_model_loads_and_unloads_at_run_time() -> None:
    from zserve.backends.executor import ModelLoadError
    from zserve.backends.model_lifecycle import model_spec
    from zserve.config.cluster import parse_config

    config = parse_config({"backends": {"count": 1, "device": "emulated"}, "models": [
        {"name": "a", "emulated": {"alpha_ms": 1.0, "beta_ms": 4.0}, "max_batch": 8},
        {"name": "b", "emulated": {"alpha_ms": 2.0, "beta_ms": 3.0}, "max_batch": 4}]})
    executor = EmulatedExecutor([EmulatedModel.from_config(config.models[0])])
    assert not executor.holds_runtime_state  # nothing to warm, nothing to collect
    spec = model_spec(config.models[1], executor)
    assert isinstance(spec, EmulatedModel)
    executor.add_model(spec, max_batch=4)
    assert executor.models == ["a", "b"] and executor.max_batch("b") == 4
    assert executor.latency_s("b", 2) == pytest.approx(0.007)  # its profile: 2 * 2 + 3 ms
    with pytest.raises(ModelLoadError, match="loaded already"):
        executor.add_model(spec, max_batch=4)
    executor.remove_model("b")
    assert executor.models == ["a"]
    with pytest.raises(BadRequestError, match="unknown model 'b'"):
        executor.max_batch("b")
