"""RankThread rules: model timer, GPU timer, consolidation, ignore-until-answer, GPU set changes."""

from __future__ import annotations

import math

import pytest

from zserve.config.policy_names import GRANT_EARLIEST_DEADLINE, GRANT_FIRST_DUE, GRANT_LEAST_SLACK
from zserve.core.hosting import Outbox
from zserve.scheduler.policy import RESCUE_CONTENTION, RESCUE_SPACING_S_PER_CANDIDATE
from zserve.scheduler.rank_thread import _IDLE as IDLE
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import CandidateUpdate, GrantAnswer, GrantGpu


def _cand(model: str, bs: int, exec_at: float, latest: float, delay: float = 0.0
          ) -> CandidateUpdate:
    return CandidateUpdate(model, bs, exec_at, latest, delay)


def _grants(out: Outbox) -> list[GrantGpu]:
    return [m for _, m in out if isinstance(m, GrantGpu)]


def _busy(rank: RankThread, now: float, gpu_id: int, until: float) -> None:
    """Occupy ``gpu_id`` until ``until`` through a grant/answer round trip."""
    out: Outbox = []
    rank.on_candidate(now, _cand(f"fill{gpu_id}", 1, now, now + 10), out)
    (grant,) = _grants(out)
    assert grant.gpu_id == gpu_id
    rank.on_grant_answer(now, GrantAnswer(grant.model, gpu_id, grant.grant_id, True, until), out)


def test_model_timer_grants_lowest_free_gpu_id_at_exec_minus_delay() -> None:
    rank = RankThread([3, 1, 2], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 4, exec_at=1.0, latest=2.0, delay=0.25), out)
    assert out == []
    assert rank.wake_at == pytest.approx(0.75)  # exec - delay(bs)
    rank.on_timer(0.75, out)
    ((dest, grant),) = out
    assert dest == ("model", "a")
    assert isinstance(grant, GrantGpu)
    assert grant.gpu_id == 1  # consolidation: the lowest id among the free GPUs
    assert rank.gpu_free_at(1) == math.inf  # granted: unavailable until answered


def test_model_timer_takes_busy_gpu_that_frees_by_exec() -> None:
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=0.9)
    _busy(rank, 0.0, 1, until=0.8)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 4, exec_at=1.0, latest=2.0, delay=0.3), out)
    rank.on_timer(0.7, out)  # both busy now; GPU 1 frees first, by exec
    (grant,) = _grants(out)
    assert grant.gpu_id == 1 and grant.free_at == pytest.approx(0.8)


def test_no_gpu_by_exec_makes_candidate_schedulable_then_gpu_timer_grants_smallest_latest() -> None:
    rank = RankThread([0], 0.0)
    _busy(rank, 0.0, 0, until=5.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 4, exec_at=1.0, latest=6.0, delay=0.1), out)
    rank.on_candidate(0.0, _cand("b", 2, exec_at=2.0, latest=5.5, delay=0.3), out)
    rank.on_candidate(0.0, _cand("c", 2, exec_at=2.0, latest=4.0, delay=0.2), out)
    rank.on_timer(0.9, out)
    rank.on_timer(1.7, out)
    rank.on_timer(1.8, out)
    assert _grants(out) == []
    assert rank.pending_models() == ["a", "b", "c"]
    # GPU timer at free_at - max pending delay = 5.0 - 0.3
    assert rank.wake_at == pytest.approx(4.7)
    rank.on_timer(4.7, out)
    (grant,) = _grants(out)
    # c (latest 4.0 < 5.0) is purged; b has the smallest latest of the rest
    assert grant.model == "b" and grant.gpu_id == 0 and grant.free_at == pytest.approx(5.0)
    assert rank.pending_models() == ["a"]
    assert rank.n_purged == 1


@pytest.mark.parametrize(("order", "first"), [(GRANT_FIRST_DUE, "long"),
                                              (GRANT_LEAST_SLACK, "long"),
                                              (GRANT_EARLIEST_DEADLINE, "short")])
def test_a_freed_gpu_goes_to_least_slack_or_to_the_earliest_deadline(
    order: str, first: str
) -> None:
    """"long" (a 2 s batch) has the earlier latest start, "short" (0.1 s) the earlier deadline:
    least slack first (eager-lsf, every other policy's pending order) grants "long", earliest
    deadline first (eager-edf, the paper's Clockwork baseline) grants "short"."""
    rank = RankThread([0], 0.0, grant_order=order)
    _busy(rank, 0.0, 0, until=5.0)
    out: Outbox = []
    rank.on_candidate(0.0, CandidateUpdate("long", 8, 1.0, 6.0, 0.1, duration=2.0), out)
    rank.on_candidate(0.0, CandidateUpdate("short", 1, 1.0, 6.5, 0.1, duration=0.1), out)
    rank.on_timer(0.9, out)
    assert _grants(out) == [] and rank.pending_models() == ["long", "short"]
    rank.on_timer(rank.wake_at, out)
    (grant,) = _grants(out)
    assert grant.model == first


def test_stale_candidate_is_not_granted() -> None:
    rank = RankThread([0], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 4, exec_at=1.0, latest=1.05, delay=0.1), out)
    rank.on_timer(1.0, out)  # fired late: now + delay > latest
    assert _grants(out) == [] and rank.n_stale == 1


def test_candidates_are_ignored_until_the_grant_is_answered() -> None:
    rank = RankThread([0, 1], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 4, exec_at=0.0, latest=1.0), out)
    (grant,) = _grants(out)
    out.clear()
    rank.on_candidate(0.0, _cand("a", 5, exec_at=0.0, latest=1.0), out)  # stale: ignored
    assert out == [] and rank.candidate("a") is None
    rank.on_grant_answer(0.0, GrantAnswer("a", grant.gpu_id, grant.grant_id, True, 0.5), out)
    assert rank.gpu_free_at(grant.gpu_id) == pytest.approx(0.5)
    rank.on_candidate(0.0, _cand("a", 3, exec_at=0.0, latest=1.0), out)
    (second,) = _grants(out)
    assert second.gpu_id == 1  # GPU 0 is busy until 0.5


def test_unused_grant_returns_gpu_untouched() -> None:
    rank = RankThread([0], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 1, exec_at=0.0, latest=1.0), out)
    (grant,) = _grants(out)
    rank.on_grant_answer(0.1, GrantAnswer("a", 0, grant.grant_id, False, grant.free_at), out)
    assert rank.gpu_free_at(0) == grant.free_at


def test_unknown_grant_answer_is_rejected() -> None:
    rank = RankThread([0], 0.0)
    with pytest.raises(ValueError, match="unknown grant"):
        rank.on_grant_answer(0.0, GrantAnswer("a", 0, 42, True, 1.0), [])


def test_withdrawn_candidate_cancels_its_timer() -> None:
    rank = RankThread([0], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 2, exec_at=1.0, latest=2.0), out)
    rank.on_candidate(0.5, _cand("a", 0, 0.0, 0.0), out)
    assert rank.wake_at == math.inf
    rank.on_timer(1.0, out)
    assert out == []


def test_added_gpu_serves_pending_candidate_and_removed_gpu_gets_nothing_new() -> None:
    rank = RankThread([0], 0.0)
    _busy(rank, 0.0, 0, until=10.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 2, exec_at=1.0, latest=5.0), out)
    rank.on_timer(1.0, out)
    assert rank.pending_models() == ["a"]
    rank.add_gpu(2.0, 1, out)
    (grant,) = _grants(out)
    assert grant.gpu_id == 1
    rank.on_grant_answer(2.0, GrantAnswer("a", 1, grant.grant_id, True, 3.0), out)
    out.clear()
    # remove GPU 1 while idle, and GPU 0 while it is busy: it finishes but gets nothing new
    rank.remove_gpu(4.0, 1, out)
    rank.remove_gpu(4.0, 0, out)
    assert rank.gpu_ids == []
    rank.on_candidate(11.0, _cand("b", 2, exec_at=11.0, latest=20.0), out)
    rank.on_timer(11.0, out)
    assert _grants(out) == []
    rank.add_gpu(12.0, 0, out)
    assert _grants(out)[0].gpu_id == 0
    # the idle count the at-risk rescue reads follows every state change above
    assert rank._n_idle == sum(state == IDLE for state in rank._state.values())


def test_gpu_removed_while_granted_is_dropped_on_answer() -> None:
    rank = RankThread([0, 1], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 2, exec_at=0.0, latest=5.0), out)
    (grant,) = _grants(out)
    rank.remove_gpu(0.0, grant.gpu_id, out)
    rank.on_grant_answer(0.0, GrantAnswer("a", grant.gpu_id, grant.grant_id, True, 1.0), out)
    assert rank.gpu_ids == [1]
    with pytest.raises(ValueError):
        rank.remove_gpu(0.0, grant.gpu_id, out)


def test_many_gpus_consolidate_on_low_ids() -> None:
    rank = RankThread(list(range(1000)), 0.0)
    out: Outbox = []
    used = set()
    now = 0.0
    for step in range(50):
        now = step * 1.0
        rank.on_candidate(now, _cand("a", 4, exec_at=now, latest=now + 5), out)
        (grant,) = _grants(out)
        used.add(grant.gpu_id)
        rank.on_grant_answer(now, GrantAnswer("a", grant.gpu_id, grant.grant_id, True,
                                              now + 1.5), out)
        out.clear()
        assert rank._n_idle == sum(state == IDLE for state in rank._state.values())
    assert used == {0, 1}  # batches of 1.5 every 1.0: two GPUs suffice


def _deferring(model: str, exec_at: float, latest: float, early_ok: bool = True
               ) -> CandidateUpdate:
    return CandidateUpdate(model, 3, exec_at, latest, 0.0, duration=0.5, early_ok=early_ok)


def _contend(rank: RankThread, now: float, times: int, *, shared: bool = True) -> None:
    """``times`` candidates of models that share GPUs (``shared``) reach their exec time with
    every GPU busy (then withdraw)."""
    out: Outbox = []
    for i in range(times):
        rank.on_candidate(now, CandidateUpdate(f"contender{i}", 1, now, now + 100.0, 0.0,
                                               shared=shared), out)
        rank.on_candidate(now, _cand(f"contender{i}", 0, 0.0, 0.0), out)
    assert _grants(out) == []


def test_a_staggered_models_busy_gpus_are_not_contention() -> None:
    # a staggered model finds its GPUs busy at many of its aims by design: that is no reason
    # to start other models' deferring candidates early
    rank = RankThread([0], 0.0)
    _busy(rank, 0.0, 0, until=10.0)
    _contend(rank, 0.0, 6, shared=False)
    assert rank.contention == 0.0
    _contend(rank, 0.0, 6)
    assert rank.contention > RESCUE_CONTENTION


def test_without_contention_an_idle_gpu_waits_for_the_deferring_candidates_aim() -> None:
    rank = RankThread([0], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _deferring("a", exec_at=5.0, latest=6.0), out)
    assert _grants(out) == [] and rank.wake_at == pytest.approx(5.0)
    rank.on_timer(5.0, out)
    (grant,) = _grants(out)
    assert grant.model == "a" and not grant.early and rank.n_rescues == 0


def test_under_contention_an_idle_gpu_starts_the_most_urgent_deferring_candidate_early() -> None:
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=10.0)
    _busy(rank, 0.0, 1, until=2.0)
    _contend(rank, 0.0, 6)  # 6 of 6 found no GPU: the estimate passes RESCUE_CONTENTION
    assert rank.contention > RESCUE_CONTENTION
    out: Outbox = []
    rank.on_candidate(0.5, _deferring("late", exec_at=8.0, latest=9.0), out)
    rank.on_candidate(0.5, _deferring("urgent", exec_at=4.0, latest=4.5), out)
    rank.on_candidate(0.5, _deferring("not-ok", exec_at=6.0, latest=8.5, early_ok=False), out)
    rank.on_timer(rank.wake_at, out)  # the rescue's look at the last two (its spacing)
    assert _grants(out) == [] and rank.wake_at == pytest.approx(2.0)  # GPU 1 frees
    rank.on_timer(2.0, out)
    (grant,) = _grants(out)
    # the most urgent by latest start goes first ("not-ok" is never started early)
    assert grant.model == "urgent" and grant.gpu_id == 1 and grant.early
    assert rank.n_rescues == 1


def test_the_rescue_starts_nobody_ahead_of_a_more_urgent_candidate_that_is_not_early_ok() -> None:
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=10.0)
    _busy(rank, 0.0, 1, until=2.0)
    _contend(rank, 0.0, 6)
    out: Outbox = []
    rank.on_candidate(0.5, _deferring("ok", exec_at=4.0, latest=4.5), out)
    rank.on_candidate(0.5, _deferring("not-ok", exec_at=3.0, latest=3.5, early_ok=False), out)
    rank.on_timer(2.0, out)
    assert _grants(out) == []  # GPU 1 waits for "not-ok"'s exec time, when it wants it
    rank.on_timer(3.0, out)
    (grant,) = _grants(out)
    assert grant.model == "not-ok" and not grant.early


@pytest.mark.parametrize("due_duration", [0.0, 2.0])
def test_under_contention_a_freeing_gpu_goes_to_a_more_urgent_deferring_candidate_unless_shorter(
        due_duration: float) -> None:
    # the deferring candidate (batch 0.5 long) is more urgent than the pending "due". It takes
    # the GPU ahead of a batch as short as its own or shorter; a longer batch keeps it: passed
    # over, that one would find every GPU busy when its window closes
    rank = RankThread([0], 0.0)
    _busy(rank, 0.0, 0, until=5.0)
    _contend(rank, 0.0, 6)
    out: Outbox = []
    rank.on_candidate(1.0, CandidateUpdate("due", 2, 1.0, 9.0, 0.0, duration=due_duration), out)
    rank.on_candidate(1.0, _deferring("deferring", exec_at=6.0, latest=7.0), out)
    assert rank.pending_models() == ["due"]
    rank.on_timer(5.0, out)
    (grant,) = _grants(out)
    if due_duration <= 0.5:
        assert grant.model == "deferring" and grant.early
        assert rank.pending_models() == ["due"]
    else:
        assert grant.model == "due" and not grant.early and rank.n_rescues == 0


def test_the_rescue_looks_again_only_after_its_spacing() -> None:
    # one idle GPU; "a" alone is no risk. "b" makes one: "a" would hold the GPU past b's latest
    # start. The update comes right after the rescue's last look, so the rank looks again once
    # the spacing (per candidate held) has passed, not at every update.
    rank = RankThread([0], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _deferring("a", exec_at=1.0, latest=1.2), out)
    assert _grants(out) == [] and rank.wake_at == pytest.approx(1.0)
    rank.on_candidate(0.0, _deferring("b", exec_at=1.1, latest=1.3), out)
    assert _grants(out) == []
    assert rank.wake_at == pytest.approx(RESCUE_SPACING_S_PER_CANDIDATE * 1)
    rank.on_timer(rank.wake_at, out)
    (grant,) = _grants(out)
    assert grant.model == "a" and grant.early and rank.n_rescues == 1


def test_one_model_alone_is_rescued_too() -> None:
    # one model sharing one GPU with its own batches: at saturation its deferring candidates
    # find the GPU busy, and a GPU that frees goes to its candidate at once instead of idling
    # until the aim
    rank = RankThread([0], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("m", 1, 0.0, 10.0), out)  # its own batch holds the GPU
    (busy,) = _grants(out)
    rank.on_grant_answer(0.0, GrantAnswer("m", 0, busy.grant_id, True, 2.0), out)
    out.clear()
    for i in range(6):
        rank.on_candidate(0.0, CandidateUpdate("m", 1, 0.0, 100.0 + i, 0.0, shared=True), out)
        rank.on_candidate(0.0, _cand("m", 0, 0.0, 0.0), out)
    assert rank.contention > RESCUE_CONTENTION and _grants(out) == []
    rank.on_candidate(0.5, _deferring("m", exec_at=6.0, latest=7.0), out)
    rank.on_timer(2.0, out)
    (grant,) = _grants(out)
    assert grant.model == "m" and grant.early and rank.n_rescues == 1


@pytest.mark.parametrize(("order", "first"), [(GRANT_FIRST_DUE, "late"),
                                              (GRANT_EARLIEST_DEADLINE, "urgent")])
def test_under_an_ordered_grant_a_busy_gpu_waits_for_the_most_urgent_candidate(
    order: str, first: str
) -> None:
    """Two eager candidates aim at the GPU's free time; "late"'s timer fires first (smaller
    delay comes later: exec - delay), "urgent" has the earlier deadline. First-due hands the GPU
    to the first timer; the ordered grant waits for the GPU to free and hands it to the most
    urgent."""
    rank = RankThread([0], 0.0, grant_order=order)
    _busy(rank, 0.0, 0, until=1.0)
    out: Outbox = []
    rank.on_candidate(0.0, CandidateUpdate("late", 4, 1.0, 3.0, 0.3, duration=0.5), out)
    rank.on_candidate(0.0, CandidateUpdate("urgent", 4, 1.0, 1.2, 0.1, duration=0.5), out)
    while not _grants(out) and rank.wake_at < 5.0:
        rank.on_timer(rank.wake_at, out)
    (grant,) = _grants(out)
    assert grant.model == first and grant.free_at == pytest.approx(1.0)


def _early(model: str, *, exec_at: float, aim_at: float, latest: float, lone_wait_s: float
           ) -> CandidateUpdate:
    """A shared model's candidate that starts at once for want of joiners (``exec_at`` before
    its ``aim_at``), its batch 3.0 long."""
    return CandidateUpdate(model, 1, exec_at, latest, 0.0, duration=3.0, shared=True,
                           aim_at=aim_at, lone_wait_s=lone_wait_s)


def _tight_model_known(rank: RankThread, lone_wait_s: float = 1.0) -> None:
    """A shared model whose lone request can wait ``lone_wait_s`` publishes a candidate far in
    the future and withdraws it: the rank remembers how tight it is."""
    out: Outbox = []
    rank.on_candidate(0.0, CandidateUpdate("tight", 1, 50.0, 60.0, 0.0, shared=True,
                                           lone_wait_s=lone_wait_s), out)
    rank.on_candidate(0.0, _cand("tight", 0, 0.0, 0.0), out)
    assert _grants(out) == []


def test_an_early_start_waits_for_its_aim_rather_than_take_the_last_gpu_from_a_tighter_model(
) -> None:
    # GPU 0 is busy until 10; "rich" would take GPU 1, the last free one, for 3.0 while a lone
    # request of "tight" can wait only 1.0: it waits for its aim (frontrun's moment) instead
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=10.0)
    _tight_model_known(rank)
    out: Outbox = []
    rank.on_candidate(0.0, _early("rich", exec_at=0.0, aim_at=5.0, latest=8.0, lone_wait_s=8.0),
                      out)
    assert _grants(out) == [] and rank.n_holds == 1 and rank.wake_at == pytest.approx(5.0)
    # "tight" arrives meanwhile and finds the GPU free
    rank.on_candidate(2.0, _cand("tight", 1, 2.0, 2.5), out)
    (grant,) = _grants(out)
    assert grant.model == "tight" and grant.gpu_id == 1
    rank.on_grant_answer(2.0, GrantAnswer("tight", 1, grant.grant_id, True, 2.5), out)
    out.clear()
    rank.on_timer(5.0, out)  # at its aim "rich" goes, held once
    (grant,) = _grants(out)
    assert grant.model == "rich" and grant.gpu_id == 1 and rank.n_holds == 1


@pytest.mark.parametrize(("case", "other_free_at", "tight_wait"), [
    ("two GPUs free", 0.0, 1.0),
    ("the other GPU frees within the tight model's wait", 0.5, 1.0),
    ("no model tighter than the batch", 10.0, 4.0),
    ("under contention", 10.0, 1.0),
])
def test_an_early_start_goes_at_once_where_it_leaves_the_tight_models_a_gpu(
    case: str, other_free_at: float, tight_wait: float
) -> None:
    rank = RankThread([0, 1], 0.0)
    if other_free_at > 0.0:
        _busy(rank, 0.0, 0, until=other_free_at)
    now = 0.0
    if case == "under contention":  # GPU 1 too is busy while 6 candidates find no GPU
        now = 0.1
        _busy(rank, 0.0, 1, until=now)
        _contend(rank, 0.0, 6)
        assert rank.contention > RESCUE_CONTENTION
    _tight_model_known(rank, tight_wait)
    out: Outbox = []
    rank.on_candidate(now, _early("rich", exec_at=now, aim_at=5.0, latest=8.0, lone_wait_s=8.0),
                      out)
    (grant,) = _grants(out)
    assert grant.model == "rich" and rank.n_holds == 0, case


def test_a_model_is_not_held_back_for_itself_nor_for_a_model_that_stopped_sharing() -> None:
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=10.0)
    out: Outbox = []
    # "tight" turned staggered (shared False): its lone wait no longer counts
    rank.on_candidate(0.0, CandidateUpdate("tight", 1, 50.0, 60.0, 0.0, shared=True,
                                           lone_wait_s=1.0), out)
    rank.on_candidate(0.0, CandidateUpdate("tight", 1, 50.0, 60.0, 0.0, shared=False,
                                           lone_wait_s=1.0), out)
    rank.on_candidate(0.0, _early("rich", exec_at=0.0, aim_at=5.0, latest=8.0, lone_wait_s=0.5),
                      out)
    (grant,) = _grants(out)
    assert grant.model == "rich" and rank.n_holds == 0


def test_a_held_back_start_waits_no_longer_than_leaves_it_the_tighter_models_wait() -> None:
    # aiming at 7.5 with its last start at 8, "rich" would be left less wait than "tight" has
    # (2.0): it waits only until 6.0, from where it is the tighter of the two
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=10.0)
    _tight_model_known(rank, lone_wait_s=2.0)
    out: Outbox = []
    rank.on_candidate(0.0, _early("rich", exec_at=0.0, aim_at=7.5, latest=8.0, lone_wait_s=8.0),
                      out)
    assert _grants(out) == [] and rank.wake_at == pytest.approx(6.0)
    rank.on_timer(6.0, out)
    (grant,) = _grants(out)
    assert grant.model == "rich" and rank.n_holds == 1


def test_a_held_back_start_goes_once_another_gpu_frees() -> None:
    # GPU 0 frees at 3.0: "rich" is held only until then, and goes there (on the lowest id),
    # the other GPU staying free for "tight"
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=3.0)
    _tight_model_known(rank)
    out: Outbox = []
    rank.on_candidate(0.0, _early("rich", exec_at=0.0, aim_at=5.0, latest=8.0, lone_wait_s=8.0),
                      out)
    assert _grants(out) == [] and rank.wake_at == pytest.approx(3.0)
    rank.on_timer(3.0, out)
    (grant,) = _grants(out)
    assert grant.model == "rich" and grant.gpu_id == 0 and rank.n_holds == 1
