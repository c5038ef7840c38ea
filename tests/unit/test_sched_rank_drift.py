"""RankThread drift correction: a backend's ``device_free_at`` report moves a GPU's free time
later (never earlier; never while the GPU is granted and unanswered), and matching and the GPU
timer follow the corrected time."""

from __future__ import annotations

import math

import pytest

from zserve.core.hosting import Outbox
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


def test_later_report_moves_a_busy_gpu_later_and_a_candidate_gets_it_at_the_new_time() -> None:
    rank = RankThread([0], 0.0)
    _busy(rank, 0.0, 0, until=1.0)
    out: Outbox = []
    assert rank.on_device_free_at(0.5, 0, 1.3, out)
    assert out == [] and rank.gpu_free_at(0) == pytest.approx(1.3)
    # exec 1.1: the GPU planned free at 1.0 would match it, the corrected one (1.3) does not.
    rank.on_candidate(0.5, _cand("a", 2, exec_at=1.1, latest=2.0, delay=0.1), out)
    rank.on_timer(1.0, out)
    assert _grants(out) == [] and rank.pending_models() == ["a"]
    # GPU timer at the corrected free time minus the pending delay, not at 1.0 - 0.1.
    assert rank.wake_at == pytest.approx(1.2)
    rank.on_timer(1.2, out)
    (grant,) = _grants(out)
    assert grant.model == "a" and grant.free_at == pytest.approx(1.3)
    assert rank.n_drift_corrections == 1
    assert rank.drift_corrected_s == pytest.approx(0.3)


def test_later_report_rearms_a_pending_gpu_timer() -> None:
    rank = RankThread([0], 0.0)
    _busy(rank, 0.0, 0, until=5.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 2, exec_at=1.0, latest=8.0, delay=0.2), out)
    rank.on_timer(0.8, out)
    assert rank.pending_models() == ["a"] and rank.wake_at == pytest.approx(4.8)
    rank.on_device_free_at(2.0, 0, 6.0, out)
    assert _grants(out) == [] and rank.wake_at == pytest.approx(5.8)
    rank.on_timer(4.8, out)  # the old GPU timer moment: nothing happens any more
    assert _grants(out) == []
    rank.on_timer(5.8, out)
    (grant,) = _grants(out)
    assert grant.free_at == pytest.approx(6.0)


def test_later_report_can_purge_a_pending_candidate_that_no_longer_fits() -> None:
    rank = RankThread([0], 0.0)
    _busy(rank, 0.0, 0, until=5.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 2, exec_at=1.0, latest=5.5, delay=0.2), out)
    rank.on_timer(0.8, out)
    assert rank.pending_models() == ["a"]
    rank.on_device_free_at(2.0, 0, 6.0, out)  # latest 5.5 < 6.0: the candidate cannot make it
    rank.on_timer(rank.wake_at, out)
    assert _grants(out) == [] and rank.pending_models() == [] and rank.n_purged == 1


def test_report_for_an_idle_gpu_makes_it_busy_and_consolidation_skips_it() -> None:
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=1.0)  # answered; idle again from 1.0 on
    out: Outbox = []
    rank.on_timer(2.0, out)
    rank.on_device_free_at(2.0, 0, 2.5, out)  # it really frees at 2.5
    assert rank.gpu_free_at(0) == pytest.approx(2.5)
    rank.on_candidate(2.0, _cand("a", 1, exec_at=2.1, latest=3.0), out)
    rank.on_timer(2.1, out)
    (grant,) = _grants(out)
    assert grant.gpu_id == 1  # GPU 0 is busy until 2.5, GPU 1 is free
    out.clear()
    rank.on_grant_answer(2.1, GrantAnswer("a", 1, grant.grant_id, True, 4.0), out)
    rank.on_candidate(2.6, _cand("b", 1, exec_at=2.6, latest=3.5), out)
    (second,) = _grants(out)
    assert second.gpu_id == 0 and second.free_at == pytest.approx(2.5)


def test_earlier_report_never_moves_a_gpu_earlier() -> None:
    rank = RankThread([0], 0.0)
    _busy(rank, 0.0, 0, until=2.0)
    out: Outbox = []
    assert not rank.on_device_free_at(0.5, 0, 1.5, out)
    assert not rank.on_device_free_at(0.5, 0, 2.0, out)
    assert rank.gpu_free_at(0) == pytest.approx(2.0)
    rank.on_candidate(0.5, _cand("a", 1, exec_at=1.6, latest=3.0), out)
    rank.on_timer(1.6, out)
    assert _grants(out) == []  # still busy until 2.0, not 1.5
    assert rank.n_drift_corrections == 0 and rank.drift_corrected_s == 0.0


def test_report_while_granted_and_unanswered_is_ignored() -> None:
    rank = RankThread([0], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 1, exec_at=0.0, latest=1.0), out)
    (grant,) = _grants(out)
    assert not rank.on_device_free_at(0.0, 0, 5.0, out)
    assert rank.gpu_free_at(0) == math.inf
    rank.on_grant_answer(0.1, GrantAnswer("a", 0, grant.grant_id, True, 0.5), out)
    assert rank.gpu_free_at(0) == pytest.approx(0.5)  # the answer decides, not the report
    assert rank.n_drift_corrections == 0


def test_report_for_unknown_removed_or_non_finite_gpu_is_ignored() -> None:
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=1.0)
    out: Outbox = []
    assert not rank.on_device_free_at(0.0, 7, 3.0, out)
    rank.remove_gpu(0.0, 1, out)
    assert not rank.on_device_free_at(0.0, 1, 3.0, out)
    assert not rank.on_device_free_at(0.0, 0, math.inf, out)
    assert not rank.on_device_free_at(0.0, 0, math.nan, out)
    assert rank.gpu_free_at(0) == pytest.approx(1.0)
    assert rank.gpu_ids == [0] and rank.n_drift_corrections == 0


def test_counters_sum_every_correction() -> None:
    rank = RankThread([0, 1], 0.0)
    _busy(rank, 0.0, 0, until=1.0)
    _busy(rank, 0.0, 1, until=2.0)
    out: Outbox = []
    rank.on_device_free_at(0.1, 0, 1.25, out)
    rank.on_device_free_at(0.2, 0, 1.5, out)
    rank.on_device_free_at(0.2, 0, 1.4, out)  # earlier than the corrected time: ignored
    rank.on_device_free_at(0.3, 1, 2.5, out)
    assert rank.n_drift_corrections == 3
    assert rank.drift_corrected_s == pytest.approx(0.25 + 0.25 + 0.5)
    assert rank.gpu_free_at(0) == pytest.approx(1.5) and rank.gpu_free_at(1) == pytest.approx(2.5)
