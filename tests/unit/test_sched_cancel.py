"""ModelThread.on_cancel (issue 16, defect 4): cancelled requests leave the queue and the
candidate, and no batch planned afterwards holds them."""

from __future__ import annotations

from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.core.hosting import TO_RANK, Outbox
from zserve.scheduler.model_thread import ModelThread
from zserve.transport.messages import BatchPlan, CandidateUpdate, GrantGpu

MS = 1e-3
PROFILE = LatencyProfile.linear(1.0, 5.0, 32)  # l(b) = b + 5 ms


def _mt() -> ModelThread:
    mt = ModelThread("m", PROFILE, 50 * MS, SchedulePolicy.parse("deferred", "window"),
                     publish_lead_s=None)
    mt.set_gpus(0.0, [0], [])
    return mt


def _arrive(mt: ModelThread, now: float, frontend: str, ids: list[int]) -> None:
    count = len(ids)
    mt.on_arrivals(now, frontend, ids, [now] * count, [now + 50 * MS] * count, [])


def _plans(outbox: Outbox) -> list[BatchPlan]:
    return [msg for _, msg in outbox if isinstance(msg, BatchPlan)]


def test_cancelled_requests_leave_the_queue_and_no_later_batch_holds_them() -> None:
    mt = _mt()
    _arrive(mt, 0.0, "fe-a", list(range(10)))
    _arrive(mt, 0.0, "fe-b", list(range(100, 110)))
    assert mt.cand_bs == 20
    outbox: Outbox = []
    # fe-b's ids under fe-a's name, and ids never queued, are not fe-a's queued requests
    removed = mt.on_cancel(0.001, "fe-a", [*range(0, 10, 2), 100, 999], outbox)
    assert removed == 5 and mt.n_cancelled == 5 and mt.queue_length == 15
    # the candidate shrank with the queue, and the rank hears of it
    assert mt.cand_bs == 15
    (update,) = [msg for dest, msg in outbox if dest == TO_RANK]
    assert isinstance(update, CandidateUpdate) and update.batch_size == 15
    assert mt.on_cancel(0.001, "fe-c", [1], outbox) == 0  # a frontend it never heard of
    outbox.clear()
    mt.on_grant(0.002, GrantGpu("m", 0, 1, 0.002), outbox)
    (plan,) = _plans(outbox)
    planned = {(plan.frontends[f], rid)
               for f, rid in zip(plan.request_frontend, plan.request_ids, strict=True)}
    assert planned == {("fe-a", rid) for rid in range(1, 10, 2)} | {
        ("fe-b", rid) for rid in range(100, 110)}
    assert mt.queue_length == 0 and mt.n_planned == 15


def test_cancelling_the_whole_queue_withdraws_the_candidate() -> None:
    mt = _mt()
    _arrive(mt, 0.0, "fe", [1, 2, 3])
    outbox: Outbox = []
    assert mt.on_cancel(0.001, "fe", [3, 1, 2], outbox) == 3
    assert mt.cand_bs == 0 and mt.wake_at == float("inf") and mt.queue_length == 0
    assert [msg for _, msg in outbox] == [CandidateUpdate("m", 0, 0.0, 0.0, 0.0)]
    mt.on_grant(0.002, GrantGpu("m", 0, 1, 0.002), outbox)
    assert _plans(outbox) == []
