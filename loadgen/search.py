"""Goodput search: the highest offered rate whose worst per-model bad rate stays within a bound.

Generic over a probe ``probe(rate) -> report`` (the simulator and the live load generator both
return a ``zserve.loadgen.report`` dict with ``bad_rate``). Procedure:

1. Start at ``start_rps``; double (pass) or halve (fail) until a passing ``lo`` and a failing ``hi``
   bracket the goodput.
2. Bisect until ``hi - lo <= rel_precision * lo`` (default 1%: the reported goodput is within 1%
   below the true threshold of this workload and seed).

The probe may stop a doomed run early (the simulator bails out once the bad rate is clearly above
the bound); ``on_probe(rate, report)`` is called after each probe, and returning True from it stops
the search (early-stop hook, e.g. a time budget). The result is the best passing report with
``goodput_rps`` and a ``search`` record of every probe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Report = dict[str, Any]


def passes(report: Report, max_bad_rate: float) -> bool:
    return bool(report["bad_rate"] <= max_bad_rate and not report.get("bailed", False))


def search_goodput(
    probe: Callable[[float], Report],
    start_rps: float,
    *,
    max_bad_rate: float = 0.01,
    rel_precision: float = 0.01,
    max_probes: int = 40,
    on_probe: Callable[[float, Report], bool] | None = None,
) -> Report:
    if start_rps <= 0:
        raise ValueError("start_rps must be > 0")
    history: list[dict[str, Any]] = []
    best: Report | None = None
    lo: float | None = None
    hi: float | None = None

    def run(rate: float) -> bool:
        nonlocal best
        report = probe(rate)
        ok = passes(report, max_bad_rate)
        history.append({"rate": round(rate, 3), "bad_rate": report["bad_rate"], "pass": ok})
        if ok and (best is None or rate > best["_rate"]):
            best = dict(report)
            best["_rate"] = rate
        stop = on_probe(rate, report) if on_probe is not None else False
        return ok if not stop else _Stop.raise_(ok)

    try:
        rate = start_rps
        while (lo is None or hi is None) and len(history) < max_probes:
            if run(rate):
                lo = rate
                rate = rate * 2 if hi is None else rate
            else:
                hi = rate
                rate = rate / 2 if lo is None else rate
            if lo is not None and hi is not None:
                break
        while lo is not None and hi is not None and hi - lo > rel_precision * lo:
            if len(history) >= max_probes:
                break
            mid = (lo + hi) / 2
            if run(mid):
                lo = mid
            else:
                hi = mid
    except _Stop:
        pass
    result: Report = dict(best) if best is not None else {"bad_rate": 1.0}
    result.pop("_rate", None)
    result["goodput_rps"] = round(lo, 3) if lo is not None else 0.0
    result["search"] = {
        "max_bad_rate": max_bad_rate,
        "rel_precision": rel_precision,
        "lo_rps": lo,
        "hi_rps": hi,
        "probes": history,
    }
    return result


class _Stop(Exception):
    @staticmethod
    def raise_(ok: bool) -> bool:
        raise _Stop(ok)
