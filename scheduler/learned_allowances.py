"""The scheduler's learned allowances: ``d_ctrl`` and ``jitter`` from the hops they cover, and
the frontends' reply allowance for the planning budget.

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
  the two terms a slow fetch is put down to. It plans with the p95 (``QUANTILE``); the p99 of
  the fetch is the overrun's (below), and ``d_ctrl`` never goes below that p99 less the
  jitter's cap, so the two still cover it where its tail is long (a loaded host).
- ``jitter`` (lateness): each time the core's timer fires, how long after its moment it ran
  (``SchedulerCore.on_timer``); with a rank of its own, how long after the candidate's aim (or
  the GPU's free time, when later) a grant reached the shard (``SchedulerCore.on_grant``); and
  for each ready delay, how far it overran the ``d_ctrl`` planned with (learned apart, as
  ``overrun``, at the p99: the jitter planned with is the larger of the two). The jitter is
  the slack a batch keeps before its last moment, and it absorbs late inputs too: on a host
  whose fetch tail exceeds ``d_ctrl``'s cap, learning the timers alone would take that slack
  away (the simulator, ready p99 11 ms: 55 r/s instead of the fixed allowances' 594).

- ``reply`` (the shard's planning budget, ``slo - reply - d_ctrl``, which sizes the target
  batch): the frontends learn the reply allowance (``zserve.frontend.core``) and plan each
  request's deadline with it (``arrival + SLO - reply``), so a chunk of metadata says it without
  a message of its own: the model's SLO less the chunk's longest ``deadline - arrival`` (a
  client's shorter SLO only shortens a deadline, which reads as a larger, safer allowance). The
  budget plans with the largest allowance of the frontends heard in the last ``WINDOW_S``,
  between the reply floor and the configured value.

Pure logic (no clock, no I/O): the shard process and the simulator (``zserve sim
--learned-allowances``) host the same part.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

from zserve.core.allowances import (
    FLOOR_D_CTRL_S,
    FLOOR_JITTER_S,
    FLOOR_REPLY_S,
    MARGIN_D_CTRL_S,
    MARGIN_JITTER_S,
    SLICE_S,
    TAIL_QUANTILE,
    WINDOW_S,
    AllowanceRule,
    LearnedAllowance,
)
from zserve.core.hosting import Outbox
from zserve.scheduler.model_thread import ModelThread

# The threads are told again only when an allowance moved this much since they last were: each
# telling recomputes every candidate.
APPLY_STEP_S = 0.02e-3


class FrontendReplies:
    """The reply allowance each frontend plans its deadlines with, as its metadata shows it;
    the budget plans with the largest of those heard in the last ``WINDOW_S`` (the configured
    value before any, or once all fell silent), clamped to ``[floor, configured]``."""

    __slots__ = ("_by_frontend", "configured_s", "floor_s")

    def __init__(self, configured_s: float) -> None:
        self.configured_s = configured_s
        self.floor_s = min(FLOOR_REPLY_S, configured_s)
        self._by_frontend: dict[str, tuple[float, float]] = {}  # frontend -> (reply s, heard at)

    def note(self, now: float, frontend: str, reply_s: float) -> None:
        """``frontend``'s deadlines leave ``reply_s`` of the SLO for the reply path. A larger
        value than the one held replaces it only once that is ``SLICE_S`` old: a chunk whose
        every request has a client's shorter SLO reads larger, and must not move the budget."""
        held = self._by_frontend.get(frontend)
        if held is None or reply_s <= held[0] or now - held[1] > SLICE_S:
            self._by_frontend[frontend] = (reply_s, now)

    def value(self, now: float) -> float:
        """The reply allowance the planning budget keeps at ``now``."""
        heard = [reply for reply, at in self._by_frontend.values() if now - at <= WINDOW_S]
        if not heard:
            return self.configured_s
        return min(self.configured_s, max(self.floor_s, *heard))


class ShardAllowances:
    """A shard's learned ``d_ctrl`` and ``jitter``, and the frontends' reply allowance; the
    configured values are the start and the cap (``AllowanceRule.from_configured``)."""

    __slots__ = ("_applied", "d_ctrl", "jitter", "overrun", "replies")

    def __init__(self, now: float, d_ctrl_s: float, jitter_s: float, reply_s: float) -> None:
        self.d_ctrl = LearnedAllowance(
            AllowanceRule.from_configured(d_ctrl_s, FLOOR_D_CTRL_S, MARGIN_D_CTRL_S), now)
        jitter_rule = AllowanceRule.from_configured(jitter_s, FLOOR_JITTER_S, MARGIN_JITTER_S)
        # the jitter is the larger of the timers' tail and the inputs' overrun tail, each
        # learned on its own (mixed in one window, the many timer samples would hide the few
        # batches that overran)
        self.jitter = LearnedAllowance(jitter_rule, now)
        self.overrun = LearnedAllowance(AllowanceRule.from_configured(
            jitter_s, FLOOR_JITTER_S, MARGIN_JITTER_S, TAIL_QUANTILE), now)
        self.replies = FrontendReplies(reply_s)
        self._applied = (d_ctrl_s, jitter_s, reply_s)

    def note_deadlines(self, now: float, frontend: str, slo_s: float,
                       arrivals: Sequence[float], deadlines: Sequence[float]) -> None:
        """A chunk of ``frontend``'s metadata of a model of SLO ``slo_s``: the reply allowance
        its deadlines were planned with (the SLO less the longest ``deadline - arrival``)."""
        if arrivals:
            self.replies.note(now, frontend, slo_s - max(map(operator.sub, deadlines, arrivals)))

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
        values = (self._d_ctrl_value(now),
                  max(self.jitter.value(now), self.overrun.value(now)), self.replies.value(now))
        if all(abs(new - old) < APPLY_STEP_S for new, old in zip(values, self._applied,
                                                                  strict=True)):
            return False
        self._applied = values
        d_ctrl_s, jitter_s, reply_s = values
        for thread in threads:
            thread.set_allowances(now, d_ctrl_s, jitter_s, outbox, reply_s)
        return True

    def _d_ctrl_value(self, now: float) -> float:
        """``d_ctrl`` plans with its quantile (p95), but no lower than what leaves the fetch's
        p99 to the jitter's cap: where the overrun's tail is past what the jitter may cover (a
        loaded host), ``d_ctrl`` covers the rest of it, up to its own cap, as with the p99."""
        d_ctrl = self.d_ctrl
        value = d_ctrl.value(now)
        beyond_jitter = d_ctrl.tail_s - self.overrun.rule.cap_s  # nan: too few samples
        if beyond_jitter > value:
            return min(d_ctrl.rule.cap_s, beyond_jitter)
        return value

    @property
    def applied(self) -> tuple[float, float, float]:
        """``(d_ctrl_s, jitter_s, reply_s)`` the threads plan with now."""
        return self._applied

    def summary(self, now: float) -> dict[str, Any]:
        """For the shard's stats: each allowance's ``LearnedAllowance.summary``."""
        jitter = self.jitter.summary(now)
        jitter["value_ms"] = round(self._applied[1] * 1e3, 4)  # the larger of the two
        return {"mode": "learned", "d_ctrl": self.d_ctrl.summary(now), "jitter": jitter,
                "overrun": self.overrun.summary(now),
                "budget_reply_ms": round(self._applied[2] * 1e3, 4)}


__all__ = ["APPLY_STEP_S", "FrontendReplies", "ShardAllowances"]
