"""ModelThread batches in rows: a request of n rows is n rows of its batch, never split across
batches, and a batch never holds more than max_batch rows (``RequestMetaBatch.rows``)."""

from __future__ import annotations

import random
from typing import Any

from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.core.hosting import Outbox
from zserve.scheduler.common import extend_chunk, split_meta_by_model
from zserve.scheduler.model_thread import ModelThread
from zserve.transport.messages import (
    BatchPlan,
    CandidateUpdate,
    DropNotice,
    GrantGpu,
    RequestMetaBatch,
)

MS = 1e-3
PROFILE = LatencyProfile.linear(1.0, 5.0, 32)  # l(b) = b + 5 ms, b <= 32 rows


def _mt(policy: str = "eager", drop: str = "window", slo_s: float = 0.2,
        **kw: Any) -> ModelThread:
    return ModelThread("m", PROFILE, slo_s, SchedulePolicy.parse(policy, drop),
                       publish_lead_s=None, **kw)


def _arrive(mt: ModelThread, now: float, rows: list[int], *, first_id: int,
            slo_s: float = 0.2, frontend: str = "fe", one_row_list: bool = False) -> Outbox:
    """Requests ``first_id, first_id + 1, ...`` holding ``rows[i]`` rows, arriving at ``now``.
    ``one_row_list``: pass the rows even when every request holds one row."""
    out: Outbox = []
    ids = list(range(first_id, first_id + len(rows)))
    sizes = rows if one_row_list or any(r != 1 for r in rows) else []
    mt.on_arrivals(now, frontend, ids, [now] * len(ids), [now + slo_s] * len(ids), out,
                   rows=sizes)
    return out


def _grant(mt: ModelThread, now: float, gpu: int = 0, free_at: float = 0.0) -> BatchPlan | None:
    out: Outbox = []
    mt.on_grant(now, GrantGpu("m", gpu, gpu + 1, free_at), out)
    plans = [m for _, m in out if isinstance(m, BatchPlan)]
    assert len(plans) <= 1
    return plans[0] if plans else None


def _plan_rows(plan: BatchPlan) -> list[int]:
    return plan.rows or [1] * len(plan.request_ids)


def test_a_batch_of_32_rows_holds_one_request_of_20_and_twelve_of_1() -> None:
    mt = _mt()
    _arrive(mt, 0.0, [20], first_id=1)
    out = _arrive(mt, 0.0, [1] * 15, first_id=2)
    cands = [m for _, m in out if isinstance(m, CandidateUpdate)]
    assert cands[-1].batch_size == 32  # rows, not requests
    plan = _grant(mt, 0.0)
    assert plan is not None
    assert plan.request_ids == list(range(1, 14))
    assert plan.rows == [20] + [1] * 12
    assert plan.expected_finish_at - plan.exec_at == PROFILE.latency(32)
    assert mt.queue_length == 3 and mt.queued_rows == 3
    assert mt.n_planned == 13  # requests


def test_a_request_that_does_not_fit_waits_with_everything_behind_it() -> None:
    mt = _mt()
    _arrive(mt, 0.0, [10, 25, 1], first_id=1)
    first = _grant(mt, 0.0)
    assert first is not None and first.request_ids == [1] and first.rows == [10]
    assert mt.cand_bs == 26 and mt.cand_count == 2  # the 25 leads the next batch, whole
    second = _grant(mt, 0.001, gpu=1)
    assert second is not None and second.request_ids == [2, 3] and second.rows == [25, 1]
    assert mt.queue_length == 0


def test_the_head_of_n_rows_goes_when_n_alone_fits_even_above_the_target() -> None:
    # SLO 40 ms: before a rate is known the target is the largest b with l(b) <= 20 ms (15);
    # a head of 25 rows (l = 30 ms) is above it but fits alone: it is kept, and runs alone.
    mt = _mt(policy="deferred", slo_s=0.04)
    assert mt.sizing.keep_min <= 15
    out = _arrive(mt, 0.0, [25], first_id=1, slo_s=0.04)
    assert not [m for _, m in out if isinstance(m, DropNotice)]
    assert mt.cand_bs == 25
    plan = _grant(mt, 0.001)
    assert plan is not None and plan.rows == [25]


def test_a_head_that_cannot_finish_alone_is_dropped_and_the_rows_behind_it_go() -> None:
    mt = _mt()
    out = _arrive(mt, 0.0, [30], first_id=1, slo_s=0.031)  # l(30) = 35 ms > 31 ms
    out += _arrive(mt, 0.0, [2], first_id=2)
    drops = [m for _, m in out if isinstance(m, DropNotice)]
    assert [d.request_ids for d in drops] == [[1]]
    assert drops[0].error == ErrorKind.DEADLINE.value
    plan = _grant(mt, 0.0)
    assert plan is not None and plan.request_ids == [2] and plan.rows == [2]


def test_window_drop_checks_the_prefix_up_to_the_target_in_rows() -> None:
    # keep_min rows must fit with the head: a head of 2 rows whose prefix of keep_min rows
    # cannot finish by its deadline is dropped (as a one-row head would be), not planned.
    mt = _mt(policy="deferred", drop="window", slo_s=0.04)
    keep = mt.sizing.keep_min
    assert keep > 4
    # the head's deadline fits l(2) but not l(keep): it goes only in too small a batch
    slo = PROFILE.latency(keep) - 0.5 * MS
    _arrive(mt, 0.0, [2], first_id=1, slo_s=slo)
    out = _arrive(mt, 0.0, [keep], first_id=2, slo_s=1.0)
    assert [m.request_ids for _, m in out if isinstance(m, DropNotice)] == [[1]]
    plan = _grant(mt, 0.0)
    assert plan is not None and plan.request_ids == [2]


def test_one_row_lists_take_the_same_path_as_no_rows() -> None:
    plain, listed = _mt(), _mt()
    _arrive(plain, 0.0, [1] * 40, first_id=1)
    _arrive(listed, 0.0, [1] * 40, first_id=1, one_row_list=True)
    a, b = _grant(plain, 0.0), _grant(listed, 0.0)
    assert a is not None and b is not None
    assert a.request_ids == b.request_ids and len(a.request_ids) == 32
    assert a.rows == b.rows == []  # no rows list sent when every request holds one row


def test_frontrun_aims_at_the_moment_the_next_queued_request_could_still_join() -> None:
    mt = _mt(policy="frontrun")
    _arrive(mt, 0.0, [30, 4], first_id=1, slo_s=0.1)
    # the batch is the 30 (30 + 4 > 32): the next request cannot join at any moment
    assert mt.cand_count == 1 and mt.cand_bs == 30
    assert mt.cand_exec == 0.0  # l(30 + 4) is beyond max_batch: infinite, so at once
    mt2 = _mt(policy="frontrun")
    _arrive(mt2, 0.0, [4, 4], first_id=1, slo_s=0.1)
    _arrive(mt2, 0.0, [4], first_id=3, slo_s=0.2)
    assert mt2.cand_bs == 12
    # without a next request it would be d - l(13); the queued request is 4 rows: d - l(12 + 4)
    assert abs(mt2.cand_exec - (0.1 - PROFILE.latency(16))) < 1e-12


def test_cancel_and_out_of_order_chunks_keep_each_request_with_its_rows() -> None:
    mt = _mt()
    _arrive(mt, 0.0, [3, 5, 7], first_id=1, slo_s=0.2)
    _arrive(mt, 0.0, [2, 9], first_id=10, slo_s=0.1, frontend="fe2")  # earlier deadlines
    assert mt.on_cancel(0.0, "fe", [2], []) == 1
    plan = _grant(mt, 0.0)
    assert plan is not None
    by_id = dict(zip(plan.request_ids, _plan_rows(plan), strict=True))
    assert by_id == {10: 2, 11: 9, 1: 3, 3: 7}
    assert plan.request_ids[:2] == [10, 11]  # deadline order


def test_random_mixed_rows_are_planned_whole_once_within_max_batch() -> None:
    """Many chunks of mixed sizes, random grants: every request is planned once or dropped
    once, never split; every plan holds at most max_batch rows and is in deadline order."""
    rng = random.Random(7)
    mt = _mt(policy="deferred", slo_s=0.05)
    sizes: dict[int, int] = {}
    seen: list[int] = []
    rid = 1
    now = 0.0
    for _ in range(400):
        now += rng.uniform(0.0, 0.004)
        rows = [rng.choice([1, 1, 1, 2, 5, 8, 20]) for _ in range(rng.randint(1, 4))]
        out = _arrive(mt, now, rows, first_id=rid, slo_s=0.05)
        sizes.update(zip(range(rid, rid + len(rows)), rows, strict=True))
        rid += len(rows)
        if mt.wake_at <= now + 0.004:
            mt.on_timer(max(now, mt.wake_at), out)
        if mt.cand_bs and rng.random() < 0.5:
            plan = _grant(mt, now, gpu=rng.randint(0, 3))
            if plan is not None:
                rows_of = _plan_rows(plan)
                assert rows_of == [sizes[i] for i in plan.request_ids]
                assert sum(rows_of) <= PROFILE.max_batch
                assert plan.finish_by == sorted(plan.finish_by)
                seen.extend(plan.request_ids)
        seen.extend(i for _, m in out if isinstance(m, DropNotice) for i in m.request_ids)
    assert len(seen) == len(set(seen))
    assert len(seen) + mt.queue_length == rid - 1


def test_meta_rows_travel_per_model_and_merge_across_messages() -> None:
    meta = RequestMetaBatch("fe", [1, 2, 3], ["a", "b", "a"], [0.0] * 3, [1.0] * 3, [4, 1, 2])
    parts = split_meta_by_model(meta)
    assert parts["a"] == ([1, 3], [0.0, 0.0], [1.0, 1.0], [4, 2])
    assert parts["b"] == ([2], [0.0], [1.0], [1])
    one_row = split_meta_by_model(RequestMetaBatch("fe", [5], ["a"], [0.0], [1.0]))
    entry = one_row["a"]
    assert entry[3] == []
    extend_chunk(entry, parts["a"])
    assert entry == ([5, 1, 3], [0.0] * 3, [1.0] * 3, [1, 4, 2])
