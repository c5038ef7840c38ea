"""Goodput search: the highest offered rate whose worst per-model bad rate stays within a bound.

Generic over a probe ``probe(rate) -> report`` (the simulator and the live load generator both
return a ``zserve.loadgen.report`` dict with ``bad_rate``). Procedure:

1. Start at ``start_rps``; double (pass) or halve (fail) until a passing ``lo`` and a failing ``hi``
   bracket the goodput.
2. Bisect until ``hi - lo <= rel_precision * lo`` (default 1%: the reported goodput is within 1%
   below the true threshold of this workload and seed).

The probe may stop a doomed run early (the simulator bails out once the bad rate is clearly above
the bound); ``on_probe(rate, report)`` is called after each probe, and returning True from it stops
the search (early-stop hook, e.g. a time budget). A probe that stops the search still counts: the
headline ``goodput_rps`` and the details of the result always come from the same probe, the
highest passing one. The result is that probe's report with ``goodput_rps`` and a ``search``
record of every probe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Report = dict[str, Any]
Probe = Callable[[float], Report]
OnProbe = Callable[[float, Report], bool]


def passes(report: Report, max_bad_rate: float) -> bool:
    return bool(report["bad_rate"] <= max_bad_rate and not report.get("bailed", False))


@dataclass
class _Bracket:
    """The search's state: the highest passing rate ``lo`` (with its report), the lowest failing
    rate ``hi``, and every probe so far."""

    probe: Probe
    max_bad_rate: float
    max_probes: int
    on_probe: OnProbe | None
    lo: float | None = None
    hi: float | None = None
    best: Report | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped: bool = False

    @property
    def bracketed(self) -> bool:
        return self.lo is not None and self.hi is not None

    @property
    def can_probe(self) -> bool:
        return not self.stopped and len(self.history) < self.max_probes

    def run(self, rate: float) -> bool:
        """Probe ``rate`` and record the verdict in the bracket *before* asking ``on_probe``
        whether to stop, so a passing last probe is never lost."""
        report = self.probe(rate)
        ok = passes(report, self.max_bad_rate)
        self.history.append({"rate": round(rate, 3), "bad_rate": report["bad_rate"], "pass": ok})
        if ok and (self.lo is None or rate > self.lo):
            self.lo = rate
            self.best = dict(report)
        if not ok and (self.hi is None or rate < self.hi):
            self.hi = rate
        if self.on_probe is not None and self.on_probe(rate, report):
            self.stopped = True
        return ok


def _find_bracket(state: _Bracket, start_rps: float) -> None:
    """Double after a pass, halve after a fail, until one passing and one failing rate."""
    rate = start_rps
    while not state.bracketed and state.can_probe:
        rate = rate * 2 if state.run(rate) else rate / 2


def _bisect(state: _Bracket, rel_precision: float) -> None:
    while state.lo is not None and state.hi is not None and state.can_probe:
        if state.hi - state.lo <= rel_precision * state.lo:
            return
        state.run((state.lo + state.hi) / 2)


def search_goodput(
    probe: Probe,
    start_rps: float,
    *,
    max_bad_rate: float = 0.01,
    rel_precision: float = 0.01,
    max_probes: int = 40,
    on_probe: OnProbe | None = None,
) -> Report:
    if start_rps <= 0:
        raise ValueError("start_rps must be > 0")
    state = _Bracket(probe, max_bad_rate, max_probes, on_probe)
    _find_bracket(state, start_rps)
    _bisect(state, rel_precision)
    result: Report = dict(state.best) if state.best is not None else {"bad_rate": 1.0}
    result["goodput_rps"] = round(state.lo, 3) if state.lo is not None else 0.0
    result["search"] = {
        "max_bad_rate": max_bad_rate,
        "rel_precision": rel_precision,
        "lo_rps": state.lo,
        "hi_rps": state.hi,
        "probes": state.history,
    }
    return result
