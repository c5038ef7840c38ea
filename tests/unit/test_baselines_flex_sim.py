"""Shepherd's Flex core (largest feasible batch first, preemption for a batch at least 3x
larger, drops of what cannot finish alone), and the baseline simulator that hosts it and
Nexus's cores: every request answered once, the policy names through ``zserve sim``'s path."""

from __future__ import annotations

import math

import numpy as np
import pytest

from zserve.config.profiles import LatencyProfile
from zserve.loadgen.sim.baselines import GOOD, LATE, PENDING, BaselineSimulator
from zserve.loadgen.sim.simulator import SimConfig, simulate
from zserve.loadgen.workload import Workload, WorkloadError, parse_workload
from zserve.scheduler.baselines.flex import (
    DropFlex,
    FlexCore,
    PreemptFlexBatch,
    StartFlexBatch,
)

MS = 1e-3


def _rounded(out: list[object]) -> list[object]:
    """The outbox with batch ends rounded to the nanosecond (l(b) sums are not exact)."""
    return [StartFlexBatch(m.gpu, m.model, m.request_ids, round(m.finish_at, 9))
            if isinstance(m, StartFlexBatch) else m for m in out]


def test_flex_starts_the_largest_feasible_batch() -> None:
    profile = LatencyProfile.linear(1.0, 5.0, 32)  # l(b) = b + 5 ms
    core = FlexCore({"a": profile, "b": profile}, gpus=1)
    out: list[object] = []
    core.on_request(0.0, "a", 1, 0.100, out)
    assert _rounded(out) == [StartFlexBatch(0, "a", [1], 0.006)] and core.wake_at == 0.006
    out.clear()
    core.on_request(0.001, "a", 2, 0.100, out)
    for rid in (10, 11):
        core.on_request(0.002, "b", rid, 0.100, out)
    assert out == []  # 2 < 3 x 1: no preemption
    core.on_timer(0.006, out)  # b's batch of 2 is the largest
    assert _rounded(out) == [StartFlexBatch(0, "b", [10, 11], 0.013)]
    out.clear()
    core.on_timer(core.wake_at, out)
    assert _rounded(out) == [StartFlexBatch(0, "a", [2], 0.019)]


def test_flex_preempts_for_a_batch_three_times_larger_and_requeues() -> None:
    profile = LatencyProfile.linear(1.0, 5.0, 32)
    core = FlexCore({"a": profile, "b": profile}, gpus=1)
    out: list[object] = []
    core.on_request(0.0, "a", 1, 0.100, out)
    out.clear()
    for rid in (10, 11, 12):
        core.on_request(0.001, "b", rid, 0.100, out)
    assert out[0] == PreemptFlexBatch(0, "a", [1])
    assert _rounded(out)[1] == StartFlexBatch(0, "b", [10, 11, 12], 0.009)
    assert core.preemptions == 1 and core.queues["a"] == [(0.100, 1)]


def test_flex_never_preempts_a_batch_started_at_this_instant() -> None:
    """The preempted request has the tightest deadline: rejoining the queue it shrinks the
    candidate to itself alone (l(1) = 6 ms of its 6.5 ms left). That batch, started now, is
    not preempted in turn for the three behind it, which would repeat forever."""
    profile = LatencyProfile.linear(1.0, 5.0, 32)
    core = FlexCore({"a": profile}, gpus=1)
    out: list[object] = []
    core.on_request(0.0, "a", 1, 0.0075, out)
    out.clear()
    for rid in (2, 3):
        core.on_request(0.001, "a", rid, 0.100, out)
    assert out == []
    core.on_request(0.001, "a", 4, 0.100, out)
    assert _rounded(out) == [PreemptFlexBatch(0, "a", [1]), StartFlexBatch(0, "a", [1], 0.007)]
    assert core.preemptions == 1 and [rid for _, rid in core.queues["a"]] == [2, 3, 4]


def test_flex_drops_what_cannot_finish_alone() -> None:
    profile = LatencyProfile.linear(1.0, 5.0, 32)
    core = FlexCore({"a": profile}, gpus=1)
    out: list[object] = []
    core.on_request(0.0, "a", 1, 0.100, out)
    out.clear()
    core.on_request(0.001, "a", 2, 0.010, out)  # must start by 0.004; the GPU frees at 0.006
    core.on_timer(0.006, out)
    assert out == [DropFlex("a", [2])] and core.wake_at == math.inf


def _workload(policy: str, rate: float) -> Workload:
    return parse_workload({
        "workload": {"name": "t", "gpus": 4, "policy": policy, "rate": rate,
                     "arrival": "poisson", "warmup_s": 0.5, "measure_s": 2.0,
                     "cooldown_s": 0.5},
        "models": [{"name": "r50", "slo_ms": 25.0, "alpha_ms": 1.053, "beta_ms": 5.072},
                   {"name": "irv2", "slo_ms": 70.0, "alpha_ms": 5.09, "beta_ms": 18.368}]},
        source="t")


@pytest.mark.parametrize("policy", ["nexus", "nexus:4", "nexus-fill", "shepherd-flex"])
def test_every_request_is_answered_once(policy: str) -> None:
    """Under 1.5x overload every request ends good, late or dropped (none pending); batches
    finish by their deadlines (Nexus's window and Flex's feasibility), so none is late."""
    w = _workload(policy, 1500.0)
    sim = BaselineSimulator(w)
    report = sim.run()
    assert not np.any(sim.status == PENDING)
    assert not np.any(sim.status == LATE)
    assert report["policy"] == policy and report["bad_rate"] > 0.0
    served = sim.status == GOOD
    assert np.all(sim.finish[served] <= sim.deadline[served] + 1e-9)
    assert report["frontends"]["count"] == (4 if policy == "nexus:4" else 1)


def test_simulate_dispatches_baselines_and_bails() -> None:
    light = simulate(_workload("nexus-fill", 300.0))
    assert light["bad_rate"] <= 0.01 and light["nexus"]["gpus_planned"] == 4
    heavy = simulate(_workload("shepherd-flex", 20_000.0),
                     SimConfig(bail_bad_rate=0.01))
    assert heavy["bailed"] and heavy["bad_rate"] > 0.01


@pytest.mark.parametrize("policy", ["nexus:0", "nexus:x", "shepherd-flex:2"])
def test_bad_baseline_names_are_typed_errors(policy: str) -> None:
    with pytest.raises(WorkloadError, match="policy"):
        _workload(policy, 100.0)
