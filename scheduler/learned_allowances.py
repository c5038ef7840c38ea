"""The scheduler's learned allowances: ``d_ctrl`` and ``jitter`` from the hops they cover.

:class:`ShardAllowances` is a part of ``zserve.scheduler.core.SchedulerCore`` (set as its
``allowances`` when ``[scheduler] allowances = "learned"``, the default). It keeps one
``zserve.core.allowances.LearnedAllowance`` per allowance and hands the values to every
ModelThread (``ModelThread.set_allowances``) when one moved by more than ``APPLY_STEP_S``:

- ``d_ctrl`` (plan delivery + input fetch, the part of ``delay(b) = d_ctrl + d_data*b`` that does
  not grow with the batch): each sample is a started batch's *ready delay*, from the plan's send
  (``BatchPlan.sent_at``) to its last input's arrival at the backend, less the model's ``d_data``
  times its rows. Backends report them on their next ``PlanAck`` (``ready_*`` fields), so no
  message is added. ``d_data`` stays the configured per-row figure: it is a property of the
  model's input size, and the tail of the residual is what the plan must cover, whichever of
  the two terms a slow fetch is put down to.
- ``jitter`` (lateness): each time the core's timer fires, how long after its moment it ran
  (``SchedulerCore.on_timer``); with a rank of its own, how long after the candidate's aim (or
  the GPU's free time, when later) a grant reached the shard (``SchedulerCore.on_grant``); and
  for each ready delay, how far it overran the ``d_ctrl`` planned with (learned apart, as
  ``overrun``: the jitter planned with is the larger of the two). The jitter is the slack
  a batch keeps before its last moment, and it absorbs late inputs too: on a host whose fetch
  tail exceeds ``d_ctrl``'s cap, learning the timers alone would take that slack away (the
  simulator, ready p99 11 ms: 55 r/s instead of the fixed allowances' 594).

Pure logic (no clock, no I/O): the shard process and the simulator (``zserve sim
--learned-allowances``) host the same part.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zserve.core.allowances import (
    FLOOR_D_CTRL_S,
    FLOOR_JITTER_S,
    MARGIN_D_CTRL_S,
    MARGIN_JITTER_S,
    AllowanceRule,
    LearnedAllowance,
)
from zserve.core.hosting import Outbox
from zserve.scheduler.model_thread import ModelThread

# The threads are told again only when an allowance moved this much since they last were: each
# telling recomputes every candidate.
APPLY_STEP_S = 0.02e-3


class ShardAllowances:
    """A shard's learned ``d_ctrl`` and ``jitter``; the configured values are the start and the
    cap (``AllowanceRule.from_configured``)."""

    __slots__ = ("_applied", "d_ctrl", "jitter", "overrun")

    def __init__(self, now: float, d_ctrl_s: float, jitter_s: float) -> None:
        self.d_ctrl = LearnedAllowance(
            AllowanceRule.from_configured(d_ctrl_s, FLOOR_D_CTRL_S, MARGIN_D_CTRL_S), now)
        jitter_rule = AllowanceRule.from_configured(jitter_s, FLOOR_JITTER_S, MARGIN_JITTER_S)
        # the jitter is the larger of the timers' tail and the inputs' overrun tail, each
        # learned on its own (mixed in one window, the many timer samples would hide the few
        # batches that overran)
        self.jitter = LearnedAllowance(jitter_rule, now)
        self.overrun = LearnedAllowance(jitter_rule, now)
        self._applied = (d_ctrl_s, jitter_s)

    def note_ready(self, now: float, delay_s: float, rows: int, d_data_s: float) -> None:
        """A batch's ready delay (plan sent -> last input at the backend) of ``rows`` rows: a
        ``d_ctrl`` sample, and what it overran the ``d_ctrl`` planned with is a lateness
        (``jitter``) sample: a ``d_ctrl`` held at its cap leaves the rest of the tail to the
        jitter's slack, as the configured values do."""
        residual = delay_s - d_data_s * rows
        self.d_ctrl.observe(now, residual)
        self.overrun.observe(now, residual - self._applied[0])

    def note_late(self, now: float, lateness_s: float) -> None:
        """A timer or a grant ``lateness_s`` after its moment."""
        self.jitter.observe(now, lateness_s)

    def apply(self, now: float, threads: Iterable[ModelThread], outbox: Outbox) -> bool:
        """Tell ``threads`` the current values when one moved by ``APPLY_STEP_S`` or more since
        they last heard; True when told."""
        d_ctrl_s = self.d_ctrl.value(now)
        jitter_s = max(self.jitter.value(now), self.overrun.value(now))
        old_ctrl, old_jitter = self._applied
        if abs(d_ctrl_s - old_ctrl) < APPLY_STEP_S and abs(jitter_s - old_jitter) < APPLY_STEP_S:
            return False
        self._applied = (d_ctrl_s, jitter_s)
        for thread in threads:
            thread.set_allowances(now, d_ctrl_s, jitter_s, outbox)
        return True

    @property
    def applied(self) -> tuple[float, float]:
        """``(d_ctrl_s, jitter_s)`` the threads plan with now."""
        return self._applied

    def summary(self, now: float) -> dict[str, Any]:
        """For the shard's stats: each allowance's ``LearnedAllowance.summary``."""
        jitter = self.jitter.summary(now)
        jitter["value_ms"] = round(self._applied[1] * 1e3, 4)  # the larger of the two
        return {"mode": "learned", "d_ctrl": self.d_ctrl.summary(now), "jitter": jitter,
                "overrun": self.overrun.summary(now)}


__all__ = ["APPLY_STEP_S", "ShardAllowances"]
