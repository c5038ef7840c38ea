"""Symphony section 3.3: 3 GPUs, l(b) = b + 5, SLO 12, a request every 0.75 (1 unit = 1 ms)."""

from __future__ import annotations

import numpy as np
import pytest

from zserve.loadgen.sim.simulator import SimConfig, Simulator
from zserve.loadgen.workload import parse_workload

GAP_S = 0.00075
MS = 1e-3


def _run(policy: str, skip: tuple[int, ...] = (), count: int = 60) -> Simulator:
    workload = parse_workload(
        {
            "workload": {
                "gpus": 3, "rate": 1333.0, "warmup_s": 0.0, "measure_s": 0.1, "cooldown_s": 0.0,
                "policy": policy,
            },
            "models": [{"name": "m", "slo_ms": 12.0, "alpha_ms": 1.0, "beta_ms": 5.0}],
        }
    )
    # R_i arrives at 0.75 * (i - 1); `skip` holds paper indexes i that never arrive
    times = np.array([GAP_S * (i - 1) for i in range(1, count + 1) if i not in skip])
    sim = Simulator(workload, SimConfig(record_plans=True), arrivals=[times])
    sim.run()
    return sim


def _arrivals_of(sim: Simulator, ids: list[int]) -> list[float]:
    """The arrival times (ms) of the requests a plan names by their frontend's request ids."""
    return [round(float(sim.arrival_all[i]) / MS, 6) for i in sim.request_indexes(ids)]


def test_first_batch_holds_first_four_requests_dispatched_at_2_25() -> None:
    sim = _run("deferred")
    first = sim.plans[0]
    assert _arrivals_of(sim, first.request_ids) == [0.0, 0.75, 1.5, 2.25]
    assert first.exec_at == pytest.approx(2.25 * MS)
    assert first.gpu_id == 0


def test_gpus_settle_into_the_staggered_pattern() -> None:
    sim = _run("deferred")
    assert int(np.count_nonzero(sim.status == 3)) == 0
    assert all(len(p.request_ids) == 4 for p in sim.plans)
    # batch k starts at 2.25 + 3k on GPU k mod 3: each GPU runs l(4) = 9 back to back,
    # the three offset by l(4)/3 = 3
    for k, plan in enumerate(sim.plans):
        assert plan.exec_at == pytest.approx((2.25 + 3 * k) * MS)
        assert plan.gpu_id == k % 3


def test_three_missing_requests_deferred_recovers_eager_degrades() -> None:
    skip = (13, 14, 15)
    deferred = _run("deferred", skip)
    eager = _run("eager", skip)
    assert int(np.count_nonzero(deferred.status == 3)) == 0
    sizes = [len(p.request_ids) for p in deferred.plans]
    # every batch but the final leftover is back to 4, the staggered batch size
    assert sizes[:-1] == [4] * (len(sizes) - 1)
    # after the gap the three GPUs are staggered again by 3 units
    late = [p.exec_at for p in deferred.plans[4:-1]]
    assert np.allclose(np.diff(late), 3 * MS)
    eager_drops = int(np.count_nonzero(eager.status == 3))
    eager_sizes = [len(p.request_ids) for p in eager.plans]
    assert eager_drops >= 10
    assert np.median(eager_sizes) < 4
