"""The frontend's part in on-demand loading: requests held for a model no backend serves, and the
per-model counts the supervisor's orchestrator plans with (pure).

``OnDemandHolds`` is a part of ``zserve.frontend.core.FrontendCore``. With ``[orchestration]
load_on_demand`` (docs/orchestration.md, "On-demand loading"), a request for a model that no
backend serves is admitted and held here instead of being sent to its scheduler shard: its
deadline timer runs as any pending request's does (so it ends with one answer: outputs once the
model is loaded and its batch runs, else ``DEADLINE``, or ``CANCELLED``). The frontend reports
what it holds to the supervisor (``ModelUsage.waiting``), whose orchestrator loads the model
with the most held requests first; once the rank's table lists the model on a backend, the
core releases its held requests to the shard (``release``). A model already holding
``max_queue`` requests here refuses more ``OVERLOADED``. Without ``[orchestration]`` nothing is
held: a model no backend serves is refused ``UNAVAILABLE`` at once, as before.

It also counts the requests admitted per model since the last report (``ModelUsage.requests``):
the orchestrator's rates and idle times.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple


class Usage(NamedTuple):
    """One report for the orchestrator (``ModelUsage``'s fields)."""

    requests: dict[str, int]
    waiting: dict[str, int]
    pending: dict[str, int]


class OnDemandHolds:
    """See the module docstring. ``enabled``: hold requests for a model no backend serves;
    ``report``: count admitted requests for the orchestrator (it runs)."""

    __slots__ = ("_admitted", "_held", "_held_rids", "_reported_waiting", "enabled", "report")

    def __init__(self, *, enabled: bool, report: bool) -> None:
        self.enabled = enabled
        self.report = report
        self._held: dict[str, list[int]] = {}  # model -> request ids, in arrival order
        self._held_rids: set[int] = set()
        self._admitted: dict[str, int] = {}  # since the last report
        self._reported_waiting: dict[str, int] = {}

    def note_admitted(self, model: str) -> None:
        if self.report:
            self._admitted[model] = self._admitted.get(model, 0) + 1

    def full(self, model: str, limit: int, pending: Collection[int]) -> bool:
        """Whether ``model`` holds ``limit`` live requests already (answered ones are
        forgotten here: ``pending`` is the core's pending request ids)."""
        held = self._held.get(model)
        if held is None or len(held) < limit:
            return False
        held[:] = [rid for rid in held if rid in pending]
        self._held_rids.intersection_update(pending)
        return len(held) >= limit

    def hold(self, model: str, rid: int) -> None:
        self._held.setdefault(model, []).append(rid)
        self._held_rids.add(rid)

    def is_held(self, rid: int) -> bool:
        return rid in self._held_rids

    def waiting_models(self) -> list[str]:
        return list(self._held)

    def release(self, model: str) -> list[int]:
        """The ids held for ``model`` (some may have been answered since), in arrival order;
        none is held any more."""
        rids = self._held.pop(model, [])
        self._held_rids.difference_update(rids)
        return rids

    def usage(self, pending: Collection[int], pending_by_model: dict[str, int]
              ) -> Usage | None:
        """What to report now: the admitted counts since the last report, the live held counts
        and ``pending_by_model`` (the unanswered requests); None when there is nothing new (no
        admission, the same held counts, nothing pending)."""
        waiting = {}
        for model, rids in self._held.items():
            live = sum(1 for rid in rids if rid in pending)
            if live:
                waiting[model] = live
        if not self._admitted and waiting == self._reported_waiting and not pending_by_model:
            return None
        admitted, self._admitted = self._admitted, {}
        self._reported_waiting = waiting
        return Usage(admitted, waiting, pending_by_model)


__all__ = ["OnDemandHolds", "Usage"]
