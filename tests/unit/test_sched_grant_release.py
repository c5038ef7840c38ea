"""A grant whose answer can never come (its shard restarted, or it could not be sent) is released:
the GPU goes back as it was and the model's candidates count again. Before, the RankThread
ignored every later candidate of the model while it awaited the lost answer, and the GPU stayed
granted: a shard SIGKILLed between GrantGpu and GrantAnswer left its models unserved for good
(tests/faults/test_faults_signals.py found it: every request DEADLINE for 60 s after the
restart)."""

from __future__ import annotations

import math

import pytest

from zserve.core.hosting import Outbox
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import CandidateUpdate, GrantAnswer, GrantGpu


def _grants(out: Outbox) -> list[GrantGpu]:
    return [m for _, m in out if isinstance(m, GrantGpu)]


def test_a_lost_grant_blocks_its_model_until_released() -> None:
    rank = RankThread([0], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, CandidateUpdate("m", 4, 0.0, 1.0, 0.0), out)
    (lost,) = _grants(out)
    assert rank.gpu_free_at(0) == math.inf
    out.clear()
    # The shard died with the grant: its successor's candidate is ignored while it awaits.
    rank.on_candidate(0.1, CandidateUpdate("m", 2, 0.1, 1.0, 0.0), out)
    assert _grants(out) == []
    assert rank.release_grants(0.1, ["m", "other"], out) == 1
    assert rank.gpu_free_at(0) == 0.0  # as it was before the grant
    rank.on_candidate(0.1, CandidateUpdate("m", 2, 0.1, 1.0, 0.0), out)
    (grant,) = _grants(out)
    assert grant.gpu_id == 0 and grant.grant_id != lost.grant_id
    # The lost grant's answer, should it come after all, is refused; the new one is taken.
    with pytest.raises(ValueError, match="unknown grant"):
        rank.on_grant_answer(0.2, GrantAnswer("m", 0, lost.grant_id, True, 0.5), out)
    rank.on_grant_answer(0.2, GrantAnswer("m", 0, grant.grant_id, True, 0.6), out)
    assert rank.gpu_free_at(0) == 0.6


def test_release_without_unanswered_grants_changes_nothing() -> None:
    rank = RankThread([0, 1], 0.0)
    out: Outbox = []
    assert rank.release_grants(0.0, ["m"], out) == 0
    assert out == [] and rank.gpu_free_at(0) == rank.gpu_free_at(1) == 0.0
