"""The scheduler's per-request structures stay bounded by the requests in flight (issue 16,
defect 2): a ModelThread driven through 200,000 requests in steady state, every one granted
(no drops), keeps its queue's lists within a small multiple of the live queue."""

from __future__ import annotations

from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.core.hosting import Outbox
from zserve.scheduler.model_thread import COMPACT_AT, ModelThread
from zserve.scheduler.sent_plans import SentPlans
from zserve.transport.messages import BatchPlan, GrantGpu

MS = 1e-3
PROFILE = LatencyProfile.linear(1.0, 5.0, 32)
STEADY_REQUESTS = 200_000
CHUNK = 4  # requests per arrival chunk: one frontend tick


def _queue_list_lengths(mt: ModelThread) -> list[int]:
    return [len(mt._deadlines), len(mt._ids), len(mt._frontend_indexes), len(mt._arrivals)]


def test_queue_lists_bounded_when_every_request_is_granted() -> None:
    """Grants alone (no drops) advance the head: the popped prefix must be compacted too. The
    bound: compaction waits for COMPACT_AT popped entries (amortised O(1) per request), so the
    lists hold at most the live queue plus 2 * COMPACT_AT."""
    mt = ModelThread("m", PROFILE, 50 * MS, SchedulePolicy.parse("eager", "window"),
                     publish_lead_s=None)
    mt.set_gpus(0.0, [0], [])
    now = 0.0
    rid = 0
    grant_id = 0
    planned = 0
    longest_live = 0
    worst = 0
    while rid < STEADY_REQUESTS:
        now += 0.5 * MS
        outbox: Outbox = []
        ids = list(range(rid, rid + CHUNK))
        rid += CHUNK
        mt.on_arrivals(now, "fe", ids, [now] * CHUNK, [now + 50 * MS] * CHUNK, outbox)
        grant_id += 1
        mt.on_grant(now, GrantGpu("m", 0, grant_id, now), outbox)
        planned += sum(len(m.request_ids) for _, m in outbox if isinstance(m, BatchPlan))
        longest_live = max(longest_live, mt.queue_length)
        worst = max(worst, *_queue_list_lengths(mt))
    assert mt.n_dropped == 0
    assert planned >= STEADY_REQUESTS - longest_live
    assert worst <= longest_live + 2 * COMPACT_AT, (worst, longest_live)


def test_sent_plans_are_bounded_by_the_plans_within_one_slo() -> None:
    """The shard's SentPlans holds a plan until exec_at + SLO: in steady state, the plans sent
    within one SLO (here 100 plans a second, SLO 50 ms: about 5), never all ever sent."""
    sent = SentPlans()
    slo_s = 50 * MS
    now = 0.0
    most_held = 0
    for plan_id in range(1, STEADY_REQUESTS // CHUNK + 1):
        now += 10 * MS
        plan = BatchPlan(plan_id=plan_id, model="m", gpu_id=plan_id % 4, exec_at=now,
                         expected_finish_at=now + 5 * MS, frontends=["fe"],
                         request_frontend=[0] * CHUNK,
                         request_ids=list(range(plan_id * CHUNK, (plan_id + 1) * CHUNK)))
        sent.remember(now, plan.gpu_id, plan, slo_s)
        most_held = max(most_held, len(sent), len(sent._expiry))
    assert most_held <= slo_s / (10 * MS) + 1
