"""The simulator's report: outcomes counted by the frontends' answers, and its own keys.

``simulation_report`` turns a finished :class:`~zserve.loadgen.sim.simulator.Simulator` run into
the report schema of ``zserve.loadgen.report`` (shared with ``zserve bench``);
``workload_bound_rps`` is the
analytic bound the report compares the goodput with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from zserve.loadgen.report import ModelOutcome, build_report
from zserve.loadgen.sim.frontends import DROPPED, ERROR, GOOD, LATE, PENDING
from zserve.loadgen.workload import Workload
from zserve.scheduler.bounds import staggered_bound_rps

if TYPE_CHECKING:
    from zserve.loadgen.sim.simulator import Simulator


def workload_bound_rps(w: Workload) -> float:
    """The staggered bound of a workload (DESIGN section 3) under its allowances, in
    requests/s: the bound in rows/s over the mean rows per request (``request_rows``)."""
    shares = w.shares()
    models = [
        (m.profile, (m.slo_ms - w.reply_ms - w.d_ctrl_ms) / 1e3, share)
        for m, share in zip(w.models, shares, strict=True)
    ]
    bound_rows: float = staggered_bound_rps(models, w.gpus,
                                            [w.d_data_ms_of(m) / 1e3 for m in w.models])
    return bound_rows / w.request_rows.mean


def simulation_report(sim: Simulator, wall_s: float) -> dict[str, Any]:
    """The report of ``sim``'s run, which took ``wall_s`` seconds."""
    w = sim.w
    lo_w, hi_w = measured_window(sim)
    in_window = (sim.arrival_all >= lo_w) & (sim.arrival_all < hi_w)
    if sim.bailed:  # only what was decided before the run stopped
        in_window &= sim.status != PENDING
    batches = np.array(sim.batches, dtype=np.float64).reshape(-1, 5)
    outcomes = [_outcome(sim, i, in_window, batches) for i in range(len(w.models))]
    busy = 0.0
    if len(batches) and hi_w > lo_w:
        starts = np.clip(batches[:, 2], lo_w, hi_w)
        ends = np.clip(batches[:, 3], lo_w, hi_w)
        busy = float(np.sum(ends - starts)) / (w.gpus * (hi_w - lo_w))
    try:
        bound = workload_bound_rps(w)
    except (ValueError, ZeroDivisionError):
        bound = None
    report: dict[str, Any] = build_report(
        outcomes, source="sim", workload=w.name, policy=sim.policy.name,
        drop=sim.policy.drop_name, seed=w.seed, gpus=w.gpus,
        measure_s=hi_w - lo_w if hi_w > lo_w else w.measure_s,
        gpu_busy_fraction=busy, bound_rps=bound, extra=_extra(sim, wall_s),
    )
    return report


def measured_window(sim: Simulator) -> tuple[float, float]:
    """The part of the measure window the report counts: all of it, or after a bailed run the
    part before the run stopped (requests after that never arrived, and counting them as bad
    reported 84-99% bad where the truth was 3-4%)."""
    lo_w, hi_w = sim.window
    hi_w = min(hi_w, sim.bailed_at)
    return lo_w, max(lo_w, hi_w)


def _outcome(sim: Simulator, i: int, in_window: np.ndarray[Any, Any],
             batches: np.ndarray[Any, Any]) -> ModelOutcome:
    """Model ``i``'s requests counted in the measured window (``in_window``: after a bailed run,
    the ones that arrived before it stopped and were answered by then), by their frontend's
    answer, and its batches that started in it."""
    spec = sim.w.models[i]
    lo_w, hi_w = measured_window(sim)
    base = sim.offsets[i]
    sl = slice(base, base + len(sim.arrivals[i]))
    mask = in_window[sl]
    status = sim.status[sl][mask]
    a = sim.arrival_all[sl][mask]
    served = (status == GOOD) | (status == LATE)
    # with drawn hops the answer already includes the reply's draw (hops.py); else its allowance
    reply_s = 0.0 if sim.config.hops is not None else sim.w.reply_ms / 1e3
    latencies = (sim.answers.answered_at[sl][mask][served] + reply_s - a[served]) * 1e3
    queueing = (sim.exec[sl][mask][served] - a[served]) * 1e3
    mine = batches[(batches[:, 0] == i) & (batches[:, 2] >= lo_w) & (batches[:, 2] < hi_w)]
    window_mask = np.zeros(sim.n_requests, dtype=np.bool_)
    window_mask[sl] = mask
    error_kinds = sim.answers.error_counts(window_mask)
    return ModelOutcome(
        name=spec.name,
        slo_ms=spec.slo_ms,
        total=int(mask.sum()),
        good=int(np.count_nonzero(status == GOOD)),
        late=int(np.count_nonzero(status == LATE)),
        dropped=int(np.count_nonzero(status == DROPPED)),
        latencies_ms=latencies,
        queueing_ms=queueing,
        batch_sizes=mine[:, 4].astype(np.int64),
        extra={"errors": int(np.count_nonzero(status == ERROR)),
               "error_kinds": error_kinds},
    )


def _extra(sim: Simulator, wall_s: float) -> dict[str, Any]:
    """The simulator's own report keys."""
    w = sim.w
    rank = sim.rank
    return {
        "rate_rps": w.rate,
        "arrival": str(w.arrival),
        "bailed": sim.bailed,
        "wall_s": round(wall_s, 3),
        "sim_requests": sim.n_requests,
        **_rows_extra(sim),
        "sim_rps_wall": round(sim.n_requests / wall_s, 1) if wall_s > 0 else None,
        "rank": {
            "grants": rank.n_grants,
            "model_matches": rank.n_model_matches,
            "rescues": rank.n_rescues,
            "holds": rank.n_holds,
            "gpu_matches": rank.n_gpu_matches,
            "stale": rank.n_stale,
            "purged": rank.n_purged,
        },
        "keep_tolerance": sim.keep_tolerance,
        "backends": {
            "late_starts": sim.late_starts,
            "answered": dict(sim.backend_failed),
            "drift_corrections": rank.n_drift_corrections,
        },
        "frontends": _frontends_extra(sim),
        "allowances_ms": {"d_ctrl": w.d_ctrl_ms, "d_data": w.d_data_ms, "reply": w.reply_ms,
                          "jitter": w.jitter_ms},
    }


def _rows_extra(sim: Simulator) -> dict[str, Any]:
    """Rows per request and the measure window's rows/s: offered, and answered by the
    deadline (goodput itself counts requests: a request's rows are answered as one)."""
    lo_w, hi_w = sim.window
    in_window = (sim.arrival_all >= lo_w) & (sim.arrival_all < hi_w)
    rows = sim.rows_all if sim.rows_all is not None else np.ones(sim.n_requests, np.int64)
    good = in_window & (sim.status == GOOD)
    measure_s = sim.w.measure_s
    return {
        "request_rows": str(sim.w.request_rows),
        "mean_rows": round(float(rows[in_window].mean()), 3) if in_window.any() else None,
        "offered_rows_per_s": round(float(rows[in_window].sum()) / measure_s, 3),
        "good_rows_per_s": round(float(rows[good].sum()) / measure_s, 3),
    }


def _frontends_extra(sim: Simulator) -> dict[str, Any]:
    """What the frontends admitted by, and every request's answer (whole run), by kind."""
    status = sim.status
    answers = {"outputs": int(np.count_nonzero((status == GOOD) | (status == LATE))),
               **sim.answers.error_counts(np.ones(sim.n_requests, dtype=np.bool_))}
    bounded = sim.config.frontend is not None
    models = sim.frontend_cluster.models
    return {
        "count": len(sim.frontends),
        # Without a cluster file no admission bound applies (null).
        "max_queue": {m.name: m.max_queue if bounded else None for m in models},
        "wait_bound_ms": {m.name: m.wait_bound_ms if bounded else None for m in models},
        "answers": answers,
    }
