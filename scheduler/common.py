"""What the scheduler's pure objects (ModelThread, RankThread) and their hosts share beyond the
hosting contract of ``zserve.core.hosting``: timer slack, the feasibility tolerance, and the cut of
a RequestMetaBatch into the per-model chunks every host feeds the ModelThreads.
"""

from __future__ import annotations

from zserve.transport.messages import RequestMetaBatch

TIMER_SLACK_S = 1e-6
"""A ModelThread re-evaluates its candidate this long *after* the candidate's last grantable
moment (``latest - delay(bs)``), so the re-evaluation sees the candidate as infeasible and moves on
instead of waking again at the same instant."""

FEASIBILITY_EPS_S = 1e-9
"""Float tolerance for "finishes by its deadline" in invariant checks (times are ~1e5 s live)."""


MetaChunk = tuple[list[int], list[float], list[float], list[int]]
"""One model's part of a RequestMetaBatch: ``(request_ids, arrivals, deadlines, rows)``, with
``rows`` empty when every request holds one row."""


def split_meta_by_model(meta: RequestMetaBatch) -> dict[str, MetaChunk]:
    """Cut a RequestMetaBatch into ``{model: (request_ids, arrivals, deadlines, rows)}``."""
    models = meta.models
    rows = meta.rows
    if models and models.count(models[0]) == len(models):
        return {models[0]: (list(meta.request_ids), list(meta.arrivals), list(meta.deadlines),
                            list(rows))}
    out: dict[str, MetaChunk] = {}
    for model, rid, arrival, deadline in zip(
        models, meta.request_ids, meta.arrivals, meta.deadlines, strict=True
    ):
        entry = out.get(model)
        if entry is None:
            entry = out[model] = ([], [], [], [])
        entry[0].append(rid)
        entry[1].append(arrival)
        entry[2].append(deadline)
    if rows:  # a second pass only when a request holds several rows
        for model, size in zip(models, rows, strict=True):
            out[model][3].append(size)
    return out


def extend_chunk(entry: MetaChunk, more: MetaChunk) -> None:
    """Append chunk ``more`` to ``entry`` (same model and frontend), rows included."""
    if more[3] and not entry[3]:
        entry[3].extend([1] * len(entry[0]))
    entry[0].extend(more[0])
    entry[1].extend(more[1])
    entry[2].extend(more[2])
    if entry[3]:
        entry[3].extend(more[3] or [1] * len(more[0]))
