"""What the scheduler's pure objects (ModelThread, RankThread) and their hosts share beyond the
hosting contract of ``zserve.hosting``: timer slack, the feasibility tolerance, and the cut of a
RequestMetaBatch into the per-model chunks every host feeds the ModelThreads.
"""

from __future__ import annotations

from zserve.transport.messages import RequestMetaBatch

TIMER_SLACK_S = 1e-6
"""A ModelThread re-evaluates its candidate this long *after* the candidate's last grantable
moment (``latest - delay(bs)``), so the re-evaluation sees the candidate as infeasible and moves on
instead of waking again at the same instant."""

FEASIBILITY_EPS_S = 1e-9
"""Float tolerance for "finishes by its deadline" in invariant checks (times are ~1e5 s live)."""


def split_meta_by_model(
    meta: RequestMetaBatch,
) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """Cut a RequestMetaBatch into ``{model: (request_ids, arrivals, deadlines)}``."""
    models = meta.models
    if models and models.count(models[0]) == len(models):
        return {models[0]: (list(meta.request_ids), list(meta.arrivals), list(meta.deadlines))}
    out: dict[str, tuple[list[int], list[float], list[float]]] = {}
    for model, rid, arrival, deadline in zip(
        models, meta.request_ids, meta.arrivals, meta.deadlines, strict=True
    ):
        entry = out.get(model)
        if entry is None:
            entry = out[model] = ([], [], [])
        entry[0].append(rid)
        entry[1].append(arrival)
        entry[2].append(deadline)
    return out
