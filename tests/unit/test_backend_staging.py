"""Input staging (zserve.backends.staging) with a real ONNX Runtime session: requests copied into
their rows on arrival run as one slice of the slot, with the outputs of the copying path."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from zserve.backends.batch_runner import BatchRunner
from zserve.backends.follower import PlanFollower
from zserve.backends.onnx_executor import OnnxExecutor
from zserve.backends.staging import StagingSlots
from zserve.runtime.clock import ClusterClock
from zserve.transport.messages import BatchPlan, InputReply

FRONTEND = "ipc://frontend-a"


def every_plan_fetching(plan_id: int) -> bool:
    """The follower's answer while every plan still waits for its inputs."""
    return plan_id >= 0

OTHER = "ipc://frontend-b"


@pytest.fixture(scope="module")
def runner() -> Iterator[BatchRunner]:
    executor = OnnxExecutor(["mlp"], max_batch=8)
    executor.load()
    runner = BatchRunner(executor, ClusterClock(), PlanFollower("b").stats)
    runner.staging.min_row_bytes = 0  # mlp's 256-byte rows, staged here all the same
    runner.allocate("mlp")
    yield runner
    executor.close()


def plan(plan_id: int, request_ids: list[int], rows: list[int] | None = None,
         frontends: list[int] | None = None) -> BatchPlan:
    return BatchPlan(plan_id, "mlp", 0, 0.0, 0.01, [FRONTEND, OTHER],
                     frontends or [0] * len(request_ids), request_ids, rows=rows or [])


def reply(plan_id: int, request_ids: list[int], rows: int = 1, seed: int = 0) -> InputReply:
    rng = np.random.default_rng(seed)
    inputs = [{"features": rng.standard_normal((rows, 64)).astype(np.float32)}
              for _ in request_ids]
    return InputReply(plan_id, request_ids, inputs, [])


def test_staged_rows_run_as_one_slice_with_the_copying_path_outputs(runner: BatchRunner) -> None:
    staging = runner.staging
    assert staging.claim(plan(1, [10, 11, 12]), lambda _: True)
    message = reply(1, [10, 11, 12])
    originals = [dict(r) for r in message.inputs]
    assert staging.stage(FRONTEND, message, every_plan_fetching) == 3
    before = runner.staged_batches
    batch = runner.assemble("mlp", message.inputs)
    assert runner.staged_batches == before + 1
    assert np.shares_memory(batch["features"], message.inputs[0]["features"])
    got = runner.executor.run("mlp", batch)
    want = runner.executor.run("mlp", originals)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g["logits"], w["logits"])
    staging.release(1)
    assert staging.claimed == 0


def test_a_gap_or_another_order_is_copied_not_sliced(runner: BatchRunner) -> None:
    staging = runner.staging
    assert staging.claim(plan(2, [1, 2, 3]), lambda _: True)
    message = reply(2, [1, 2, 3], seed=1)
    staging.stage(FRONTEND, message, every_plan_fetching)
    before = runner.staged_batches
    kept = [message.inputs[0], message.inputs[2]]  # row 1 missing
    batch = runner.assemble("mlp", kept)
    assert runner.staged_batches == before
    np.testing.assert_array_equal(batch["features"][1], message.inputs[2]["features"][0])
    swapped = runner.assemble("mlp", [message.inputs[1], message.inputs[0]])
    np.testing.assert_array_equal(swapped["features"][0], message.inputs[1]["features"][0])
    assert runner.staged_batches == before
    staging.release(2)


def test_requests_of_several_rows_and_frontends_land_in_plan_order(runner: BatchRunner) -> None:
    staging = runner.staging
    assert staging.claim(plan(3, [5, 6, 7], rows=[2, 1, 3], frontends=[0, 1, 0]),
                         lambda _: True)
    first = reply(3, [5, 7], rows=2, seed=2)  # wrong rows for request 7 (it holds 3)
    assert staging.stage(FRONTEND, first, every_plan_fetching) == 1
    assert not np.shares_memory(first.inputs[1]["features"], first.inputs[0]["features"])
    fixed = reply(3, [7], rows=3, seed=3)
    assert staging.stage(FRONTEND, fixed, every_plan_fetching) == 1
    other = reply(3, [6], seed=4)
    assert staging.stage(OTHER, other, every_plan_fetching) == 1
    batch = runner.assemble("mlp", [first.inputs[0], other.inputs[0], fixed.inputs[0]], 6)
    np.testing.assert_array_equal(batch["features"][2], other.inputs[0]["features"][0])
    np.testing.assert_array_equal(batch["features"][3:], fixed.inputs[0]["features"])
    staging.release(3)


def test_full_slots_free_the_plans_no_longer_held() -> None:
    executor = OnnxExecutor(["mlp"], max_batch=4)
    executor.load()
    try:
        staging = StagingSlots(slots_per_model=2, min_row_bytes=0)
        staging.allocate("mlp", executor.signature("mlp"), 4, executor.host_buffer)
        held = {1, 2}
        assert staging.claim(plan(1, [1]), held.__contains__)
        assert staging.claim(plan(2, [2]), held.__contains__)
        assert not staging.claim(plan(3, [3]), held.__contains__)  # both still held
        held.discard(1)  # the follower dropped plan 1 (skipped, refused)
        assert staging.claim(plan(3, [3]), held.__contains__)
        assert staging.claimed == 2
        assert not staging.claim(plan(4, [1, 2, 3, 4, 5]), lambda _: False)  # > max_batch
        message = reply(9, [1])
        assert staging.stage(FRONTEND, message, every_plan_fetching) == 0  # no slot: as it came
    finally:
        executor.close()


def test_a_reply_once_its_batch_started_is_not_written_into_the_slot(
        runner: BatchRunner) -> None:
    staging = runner.staging
    assert staging.claim(plan(4, [1, 2]), lambda _: True)
    first = reply(4, [1], seed=7)
    assert staging.stage(FRONTEND, first, every_plan_fetching) == 1
    running = first.inputs[0]["features"].copy()
    late = reply(4, [1, 2], seed=8)  # the batch started (the follower says so): leave the slot
    assert staging.stage(FRONTEND, late, lambda _: False) == 0
    np.testing.assert_array_equal(first.inputs[0]["features"], running)
    assert not np.shares_memory(late.inputs[1]["features"], first.inputs[0]["features"])
    staging.release(4)


def test_models_with_small_rows_get_no_slots() -> None:
    with OnnxExecutor(["mlp"], max_batch=4) as executor:
        staging = StagingSlots()  # mlp's rows are 256 bytes: below STAGING_MIN_ROW_BYTES
        staging.allocate("mlp", executor.signature("mlp"), 4, executor.host_buffer)
        assert not staging.stages("mlp")
        assert not staging.claim(plan(1, [1]), lambda _: True)
