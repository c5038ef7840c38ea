"""ModelThread tells CandidateSizing whether a grant came late (the candidate waited for a GPU):
the ``deferred`` policy's window-loss estimate decays only on batches that found a GPU free."""

from __future__ import annotations

import pytest

from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.core.hosting import Outbox
from zserve.scheduler.model_thread import GRANT_WAITED_S, ModelThread
from zserve.scheduler.policy import DEFER_LOSS_DECAY
from zserve.transport.messages import GrantGpu

MS = 1e-3
PROFILE = LatencyProfile.linear(1.0, 5.0, 32)  # l(b) = b + 5 ms


def _at_once_thread(now: float) -> ModelThread:
    """A ``deferred`` thread (d_ctrl 1 ms) whose candidate starts at once (deferral paused by
    its yield), one request queued at ``now``, its loss estimate at 0.5."""
    mt = ModelThread("m", PROFILE, 50 * MS, SchedulePolicy.parse("deferred", "window"),
                     d_ctrl_s=1 * MS, publish_lead_s=None)
    mt.set_gpus(0.0, [0], [])
    mt.sizing.deferral_yield.paused_for = 10
    mt.sizing.defer_loss = 0.5
    mt.on_arrivals(now, "fe", [1], [now], [now + 50 * MS], [])
    assert mt.cand_exec == pytest.approx(now + 1 * MS)  # at once: now plus d_ctrl
    return mt


def test_a_grant_on_time_decays_the_loss_estimate_and_a_late_one_does_not() -> None:
    outbox: Outbox = []
    on_time = _at_once_thread(0.0)
    on_time.on_grant(0.0, GrantGpu("m", 0, 1, 0.0), outbox)  # asked at exec - d_ctrl = 0
    assert on_time.n_batches == 1
    assert on_time.sizing.defer_loss == pytest.approx(0.5 * (1 - DEFER_LOSS_DECAY))
    late = _at_once_thread(0.0)
    at = 2 * GRANT_WAITED_S  # every GPU was busy when it asked
    late.on_grant(at, GrantGpu("m", 0, 1, at), outbox)
    assert late.n_batches == 1
    assert late.sizing.defer_loss == 0.5
