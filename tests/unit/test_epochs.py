"""The pure fencing logic of scheduler epochs (zserve.core.epochs): the fence and the pair's
watch."""

from __future__ import annotations

import math

import numpy as np

from zserve.cluster.preflight import check_cluster
from zserve.config.cluster import parse_config
from zserve.core.epochs import HANDOVER_FRESH_S, EpochFence, SchedulerWatch, next_epoch
from zserve.core.hosting import Outbox
from zserve.frontend.core import FrontendCore
from zserve.transport.messages import InferError, InferRequest, InputFetch, RequestMetaBatch

TIMEOUT_S = 1.0


def test_next_epoch_outranks_everything_seen_and_the_wall_clock() -> None:
    assert next_epoch(0, 1_000) == 1_000
    assert next_epoch(5_000, 1_000) == 5_001  # a clock stepped back never reuses an epoch
    assert next_epoch(999, 1_000) == 1_000


def test_fence_follows_the_newest_active_scheduler() -> None:
    fence = EpochFence()
    assert fence.admits(0) and fence.is_current("shard-0")  # nothing heard yet: admit all
    assert fence.observe("shard-0", 10)
    assert fence.active == "shard-0" and fence.highest == 10
    assert not fence.observe("shard-0", 10)  # the same announcement again: no switch
    assert not fence.observe("shard-0b", 0)  # a standby makes no claim
    assert fence.observe("shard-0b", 11)  # took over
    assert fence.active == "shard-0b"
    assert not fence.is_current("shard-0") and fence.is_current("shard-0b")
    assert not fence.observe("shard-0", 10)  # the superseded one cannot win back
    assert fence.active == "shard-0b" and fence.highest == 11


def test_fence_refuses_anything_of_an_older_epoch_once_a_newer_one_is_seen() -> None:
    fence = EpochFence()
    fence.note(10)  # a plan of epoch 10 arrived
    assert fence.admits(10) and fence.admits(12)
    fence.observe("shard-0b", 12)
    assert not fence.admits(10)  # a resumed old scheduler's plan: never run
    assert not fence.admits(11)
    fence.note(5)  # an older plan does not lower the fence
    assert fence.highest == 12 and not fence.admits(11)


def test_standby_takes_over_only_after_the_active_one_is_silent_for_the_timeout() -> None:
    watch = SchedulerWatch(active=False, epoch=77, takeover_timeout_s=TIMEOUT_S, now=0.0)
    assert watch.epoch == 0 and not watch.active
    assert not watch.on_ping(0.5, 100, active=True)
    assert watch.takeover_at == 1.5
    assert watch.take_over(1.4, wall_ms=50) is None
    assert not watch.active
    assert not watch.on_ping(1.0, 0, active=False)  # a standby's ping proves nothing
    assert watch.takeover_at == 1.5
    epoch = watch.take_over(1.5, wall_ms=50)
    assert epoch == 101  # above the active one's, although the wall clock is behind
    assert watch.active and watch.epoch == 101 and watch.takeover_at == math.inf


def test_active_steps_down_on_a_newer_epoch_from_its_partner_or_any_peer() -> None:
    watch = SchedulerWatch(active=True, epoch=100, takeover_timeout_s=TIMEOUT_S, now=0.0)
    assert watch.takeover_at == math.inf
    assert not watch.on_epoch(100)  # its own epoch, echoed by a peer
    assert not watch.on_epoch(0)
    assert not watch.on_ping(0.1, 0, active=False)  # its standby
    assert watch.on_ping(0.2, 101, active=True)  # the standby took over while it hung
    assert watch.superseded and not watch.active
    assert watch.take_over(100.0, wall_ms=10**9) is None  # never active again

    other = SchedulerWatch(active=True, epoch=100, takeover_timeout_s=TIMEOUT_S, now=0.0)
    assert other.on_epoch(101)  # e.g. a backend's heartbeat carrying the newest epoch
    assert other.superseded


def test_a_dead_active_partner_is_taken_over_at_once_a_dead_standby_never() -> None:
    watch = SchedulerWatch(active=False, epoch=0, takeover_timeout_s=TIMEOUT_S, now=0.0)
    watch.on_partner_gone(0.05)  # a standby partner that never said it was active: nothing
    assert watch.takeover_at == TIMEOUT_S
    watch.on_ping(0.1, 300, active=True)
    watch.on_partner_gone(0.2)  # its connection closed: it died
    assert watch.take_over(0.2, wall_ms=1) == 301


def test_the_timeout_counts_from_the_link_start_not_the_process_start() -> None:
    watch = SchedulerWatch(active=False, epoch=0, takeover_timeout_s=TIMEOUT_S, now=0.0)
    watch.start(5.0)  # the cluster took 5 s to hand out the peer map
    assert watch.take_over(5.5, wall_ms=1) is None
    assert watch.take_over(6.0, wall_ms=1) == 1


def test_a_takeover_outranks_every_epoch_the_standby_heard_of() -> None:
    watch = SchedulerWatch(active=False, epoch=0, takeover_timeout_s=TIMEOUT_S, now=0.0)
    watch.on_epoch(500)  # from a peer's heartbeat
    watch.on_ping(0.1, 300, active=True)
    assert watch.take_over(5.0, wall_ms=1) == 501


# --------------------------------------------------------------------------- the frontend's re-send


def _frontend() -> FrontendCore:
    cluster = parse_config({
        "frontends": {"reply_allowance_ms": 10.0},
        "backends": {"count": 1, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0},
                    "slo_ms": 100.0}]})
    return FrontendCore(name="frontend-0", cluster=cluster, index=0, data_address="ipc://d",
                        profiles={})


def _metadata(core: FrontendCore) -> list[RequestMetaBatch]:
    outbox: Outbox = []
    core.end_tick(outbox)
    return [msg for _, msg in outbox if isinstance(msg, RequestMetaBatch)]


def test_a_new_epoch_gets_the_requests_still_queued_and_late_ones_are_answered() -> None:
    core = _frontend()
    core.epoch = 10
    outbox: Outbox = []
    for client_rid in (1, 2, 3):
        core.on_client_message(0.0, b"c", InferRequest(client_rid, "m",
                                                       {"x": np.zeros((1, 4), np.float32)}),
                               outbox)
    first = _metadata(core)
    assert len(first) == 1 and first[0].epoch == 10
    rids = first[0].request_ids
    core.on_fetch(0.01, "backend-0", InputFetch(7, [rids[0]]), outbox)  # one is running
    core.epoch = 11  # a standby took over
    core.requeue_queued(0.05, outbox)
    again = _metadata(core)
    assert [m.request_ids for m in again] == [rids[1:]] and again[0].epoch == 11
    assert again[0].deadlines == first[0].deadlines[1:]  # the same deadlines, not new ones
    assert core.counters["requeued"] == 2
    core.epoch = 12  # and again, after the scheduler deadline (100 - 10 ms) of both passed
    outbox.clear()
    core.requeue_queued(0.095, outbox)
    core.end_tick(outbox)
    errors = [msg for _, msg in outbox if isinstance(msg, InferError)]
    assert sorted(e.request_id for e in errors) == [2, 3]
    assert {e.error for e in errors} == {"DEADLINE"}
    assert not [msg for _, msg in outbox if isinstance(msg, RequestMetaBatch)]
    assert list(core.pending) == [rids[0]]  # the running one is its backend's to answer


def test_preflight_refuses_a_standby_with_shards() -> None:
    config = parse_config({"scheduler": {"shards": 2, "standby": True},
                           "backends": {"device": "emulated"},
                           "models": [{"name": "m", "emulated": {"alpha_ms": 1.0,
                                                                 "beta_ms": 2.0}}]})
    problems = check_cluster(config)
    assert [p.key for p in problems] == ["scheduler.standby"]
    assert "shards = 0" in problems[0].problem


def test_an_active_scheduler_hands_over_only_to_a_partner_heard_within_the_timeout() -> None:
    watch = SchedulerWatch(active=True, epoch=10, takeover_timeout_s=TIMEOUT_S, now=0.0)
    assert not watch.can_hand_over(0.5)  # never heard from a partner: drain instead
    watch.on_ping(1.0, 0, active=False)  # the standby answers
    assert watch.can_hand_over(1.0 + HANDOVER_FRESH_S / 2)
    assert not watch.can_hand_over(1.0 + HANDOVER_FRESH_S)  # silent for five pings: drain
    watch.on_ping(2.0, 0, active=False)
    watch.on_partner_gone(2.1)  # its connection closed: it died
    assert not watch.can_hand_over(2.1)
    standby = SchedulerWatch(active=False, epoch=0, takeover_timeout_s=TIMEOUT_S, now=0.0)
    standby.on_ping(1.0, 10, active=True)
    assert not standby.can_hand_over(1.1)  # a standby has nothing to hand over


def test_a_primary_takes_over_at_once_from_a_standby_partner_at_the_clusters_start() -> None:
    primary = SchedulerWatch(active=False, epoch=0, takeover_timeout_s=TIMEOUT_S, now=0.0,
                             primary=True)
    primary.start(0.0)
    assert primary.take_over(0.05, 1_000) is None  # nobody heard yet: not before the timeout
    primary.on_ping(0.1, 0, active=False)  # the partner answers: a standby
    assert primary.takeover_at == 0.1
    assert primary.take_over(0.15, 1_000) == 1_000 and primary.active
    assert not primary.joining


def test_a_primary_restarted_while_its_partner_is_active_joins_as_its_standby() -> None:
    primary = SchedulerWatch(active=False, epoch=0, takeover_timeout_s=TIMEOUT_S, now=0.0,
                             primary=True)
    primary.start(0.0)
    assert not primary.on_ping(0.1, 500, active=True)  # the partner took over: it is active
    assert not primary.joining and not primary.active
    assert primary.take_over(0.1 + TIMEOUT_S / 2, 2_000) is None  # never supersedes it
    # from now on an ordinary standby: it takes over only once the active one falls silent
    assert primary.take_over(0.1 + TIMEOUT_S, 2_000) == 2_000


def test_a_primary_whose_partner_is_silent_takes_over_after_the_timeout() -> None:
    primary = SchedulerWatch(active=False, epoch=0, takeover_timeout_s=TIMEOUT_S, now=0.0,
                             primary=True)
    primary.start(0.0)
    assert primary.take_over(TIMEOUT_S - 0.01, 3_000) is None
    assert primary.take_over(TIMEOUT_S, 3_000) == 3_000
