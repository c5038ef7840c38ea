"""Nexus's pure cores: squishy bin packing (the paper's worked example, and the plan's
invariants over random session sets), the epoch controller's triggers, the sliding-window early
drop, a GPU's round robin, the frontends' deficit round robin, and the backup backends (a GPU's
utilization, the static backup lists, the relay rule, backup sessions in leftover time, and the
simulator relaying under overload)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from zserve.config.profiles import LatencyProfile
from zserve.loadgen.sim.baselines import simulate_baseline
from zserve.loadgen.workload import parse_workload
from zserve.scheduler.baselines.nexus_gpu import (
    BackupRelay,
    DropNexus,
    DrrRouter,
    NexusGpuCore,
    RunNexusBatch,
    backup_gpus,
    early_drop_batch,
)
from zserve.scheduler.baselines.nexus_plan import (
    EPOCH_PERIOD_S,
    HISTORY_SAMPLES,
    GpuPlan,
    NexusEpochs,
    NexusPlan,
    Session,
    Slot,
    plan_filling,
    plan_sessions,
)

MS = 1e-3


def _profile(l_small: tuple[int, float], l_large: tuple[int, float]) -> LatencyProfile:
    """The linear profile through two (batch, ms) points of the paper's example."""
    (b1, t1), (b2, t2) = l_small, l_large
    alpha = (t2 - t1) / (b2 - b1)
    return LatencyProfile.linear(alpha, t1 - alpha * b1, 64)


def test_paper_example_packs_a_with_b_and_c_alone() -> None:
    """Nexus section 4.1: A (200 ms, 64 r/s) at batch 8 in a 125 ms duty cycle takes B (250 ms,
    32 r/s) at batch 4 into its slack; C (its l(4) = 60 ms) does not fit and gets a GPU."""
    a = Session("A", _profile((8, 75.0), (16, 100.0)), 0.200, 64.0, reserve_s=0.0)
    b = Session("B", _profile((4, 50.0), (16, 125.0)), 0.250, 32.0, reserve_s=0.0)
    c = Session("C", _profile((4, 60.0), (16, 125.0)), 0.250, 32.0, reserve_s=0.0)
    plan = plan_sessions([a, b, c], gpus=4)
    assert not plan.unassigned_rps
    nodes = sorted(sorted((s.name, s.batch) for s in g.slots) for g in plan.gpus)
    assert nodes == [[("A", 8), ("B", 4)], [("C", 6)]]
    shared = next(g for g in plan.gpus if len(g.slots) == 2)
    assert shared.duty_cycle_s == pytest.approx(0.125)


def _random_sessions(rng: random.Random) -> list[Session]:
    sessions = []
    for i in range(rng.randint(1, 6)):
        alpha, beta = rng.uniform(0.2, 3.0), rng.uniform(1.0, 20.0)
        # SLO: the 2 ms reserve plus 2.5x to 8x l(1) (below 2 l(1) Nexus cannot serve it)
        slo_ms = 2.0 + rng.uniform(2.5, 8.0) * (alpha + beta)
        sessions.append(Session(f"m{i}", LatencyProfile.linear(alpha, beta, 128), slo_ms * MS,
                                rng.uniform(1.0, 2000.0)))
    return sessions


@pytest.mark.parametrize("seed", range(200))
def test_plan_invariants_hold(seed: int) -> None:
    """Every node: its batches fit its duty cycle, every request's worst case (duty cycle plus
    its batch) fits its budget; every fully placed session gets at least its rate; the GPUs used
    are at least the saturated lower bound."""
    rng = random.Random(seed)
    sessions = _random_sessions(rng)
    by_name = {s.name: s for s in sessions}
    plan = plan_sessions(sessions, gpus=10_000)
    assert not plan.unassigned_rps
    served = dict.fromkeys(by_name, 0.0)
    for gpu in plan.gpus:
        used = sum(by_name[s.name].profile.latency(s.batch) for s in gpu.slots)
        assert used <= gpu.duty_cycle_s + 1e-9
        for slot in gpu.slots:
            s = by_name[slot.name]
            assert gpu.duty_cycle_s + s.profile.latency(slot.batch) <= s.budget_s + 1e-9
            served[slot.name] += slot.batch / gpu.duty_cycle_s
    for name, s in by_name.items():
        assert served[name] >= s.rate_rps * (1 - 1e-6)
    lower = sum(s.rate_rps * s.profile.latency(b) / b for s in sessions
                for b in [max(1, s.profile.largest_batch_within(s.budget_s / 2))])
    assert len(plan.gpus) >= math.floor(lower + 1e-9)


def test_plan_caps_at_the_gpus_and_fill_spreads_over_them() -> None:
    """ResNet50 of Table 2 at 2,000 r/s on 8 GPUs: the rate-sized plan uses 4 GPUs (3 at batch
    6, one residual); the filling plan puts batch 6 on all 8. At 10,000 r/s the GPUs run out
    and the rest is unassigned."""
    r50 = LatencyProfile.linear(1.053, 5.072, 64)
    plan = plan_sessions([Session("r", r50, 0.025, 2000.0)], gpus=8)
    assert [s.batch for g in plan.gpus for s in g.slots] == [6, 6, 6, 5]
    filled = plan_filling([Session("r", r50, 0.025, 2000.0)], gpus=8)
    assert [s.batch for g in filled.gpus for s in g.slots] == [6] * 8
    over = plan_sessions([Session("r", r50, 0.025, 10_000.0)], gpus=8)
    assert len(over.gpus) == 8
    assert over.unassigned_rps["r"] == pytest.approx(10_000.0 - 8 * 6 / r50.latency(6))


def test_epochs_trigger_on_a_rate_step_and_run_periodically() -> None:
    r50 = LatencyProfile.linear(1.053, 5.072, 64)
    epochs = NexusEpochs([Session("r", r50, 0.025, 1000.0)], gpus=16)
    allocated = epochs.plan.allocated_rps("r")
    assert allocated == pytest.approx(1000.0)
    for t in range(1, int(EPOCH_PERIOD_S)):  # steady: no epoch before the period
        assert epochs.on_beacon(float(t), {"r": 1000}) is None
    assert epochs.on_beacon(EPOCH_PERIOD_S, {"r": 1000}) is not None
    assert epochs.epochs[-1][1] == "period"
    fired = None
    for t in range(31, 60):  # the rate doubles: EWMA crosses 1.1x, then the 10 s gate
        if epochs.on_beacon(float(t), {"r": 2000}) is not None:
            fired = t
            break
    assert fired == 40  # 2 s to cross 1.1x, held until 10 s after the last epoch
    assert epochs.plan.allocated_rps("r") > 1100.0
    cold = NexusEpochs([Session("r", r50, 0.025, 1000.0)], gpus=16, warm=False)
    assert all(cold.on_beacon(float(t), {"r": 1000}) is None for t in range(1, HISTORY_SAMPLES))


def test_early_drop_window_semantics() -> None:
    """l(b) = b + 5 ms. Window 3, finish 8 ms: the head (5 ms) drops, the next three run. A
    queue too short for its window shrinks it: [5, 7.5] at window 2 (finish 7) drops the head,
    then window 1 (finish 6) keeps 7.5."""
    profile = LatencyProfile.linear(1.0, 5.0, 16)
    from collections import deque

    queue = deque([(0, 5 * MS), (1, 9 * MS), (2, 20 * MS), (3, 20 * MS), (4, 20 * MS)])
    assert early_drop_batch(queue, profile, 3, 0.0) == ([1, 2, 3], [0])
    assert list(queue) == [(4, 20 * MS)]
    short = deque([(0, 5 * MS), (1, 7.5 * MS)])
    assert early_drop_batch(short, profile, 3, 0.0) == ([1], [0])


def test_gpu_round_robin_takes_turns_and_is_work_conserving() -> None:
    from zserve.scheduler.baselines.nexus_plan import Slot

    profile = LatencyProfile.linear(1.0, 5.0, 16)
    core = NexusGpuCore({"a": profile, "b": profile})
    out: list[object] = []
    core.load_table(0.0, [Slot("a", 2, 100.0), Slot("b", 2, 100.0)], out)
    assert out == [] and core.wake_at == math.inf
    core.on_request(0.0, "a", 1, 1.0, out)  # idle GPU: runs at once, batch of 1
    assert out == [RunNexusBatch("a", [1], 0.006)] and core.wake_at == 0.006
    out.clear()
    for rid in (2, 3, 4):
        core.on_request(0.001, "a", rid, 1.0, out)
    core.on_request(0.002, "b", 10, 1.0, out)
    assert out == []  # busy
    core.on_timer(0.006, out)  # b's turn, although a has more waiting
    assert out == [RunNexusBatch("b", [10], 0.012)]
    out.clear()
    core.on_timer(0.012, out)  # a's turn: its assigned batch of 2
    assert out == [RunNexusBatch("a", [2, 3], 0.019)]
    out.clear()
    core.on_timer(0.019, out)  # b is empty: a again, no time spent on b
    assert out == [RunNexusBatch("a", [4], 0.025)]
    out.clear()
    core.on_request(0.020, "b", 11, 0.021, out)  # cannot finish by 0.021 at 0.025 + l(1)
    core.on_timer(0.025, out)
    assert out == [DropNexus("b", [11])] and core.wake_at == math.inf


def test_drr_shares_are_exact_per_cycle() -> None:
    router = DrrRouter({0: 300.0, 1: 200.0, 2: 100.0})
    picks = [router.pick() for _ in range(6000)]
    assert [picks.count(g) for g in (0, 1, 2)] == [3000, 2000, 1000]
    assert sorted(picks[:6]) == [0, 0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="positive weight"):
        DrrRouter({0: 0.0})


def _queued(core: NexusGpuCore, model: str, count: int, now: float = 0.0) -> None:
    for rid in range(count):
        core.on_request(now, model, 100 + rid, 1.0, [])


def test_utilization_is_queued_work_over_the_duty_cycle() -> None:
    """l(b) = b + 5 ms, batch 2, duty cycle 20 ms. A batch of 1 runs (6 ms); then 3 waiting are
    one batch of 2 (7 ms) and one of 1 (6 ms): (6 + 7 + 6) / 20 at time 0, less as it runs."""
    profile = LatencyProfile.linear(1.0, 5.0, 16)
    core = NexusGpuCore({"a": profile})
    core.load_table(0.0, [Slot("a", 2, 100.0)], [], duty_cycle_s=0.020)
    _queued(core, "a", 4)
    assert core.open_requests("a") == 3 and core.assigned_batch("a") == 2
    assert core.utilization(0.0) == pytest.approx(19 / 20)
    assert core.utilization(0.004) == pytest.approx(15 / 20)
    bare = NexusGpuCore({"a": profile})
    assert bare.utilization(0.0) == math.inf and bare.assigned_batch("a") is None


def test_relay_keeps_home_until_the_batch_is_held_then_picks_the_least_utilized() -> None:
    profile = LatencyProfile.linear(1.0, 5.0, 16)
    cores = [NexusGpuCore({"a": profile}) for _ in range(3)]
    for core in cores:
        core.load_table(0.0, [Slot("a", 2, 100.0)], [], duty_cycle_s=0.020)
    relay = BackupRelay({"a": [0, 1, 2]})
    _queued(cores[0], "a", 3)  # 1 running, 2 open: the assigned batch is held
    _queued(cores[1], "a", 2)  # 1 running (6 ms), 1 waiting: 12 / 20
    _queued(cores[2], "a", 1)  # 1 running: 6 / 20
    assert relay.place("a", 1, cores, 0.0) == 1  # 1 open + 1 fits GPU 1's batch of 2
    assert relay.place("a", 0, cores, 0.0) == 2 and relay.relayed == 1
    _queued(cores[2], "a", 30)
    _queued(cores[1], "a", 30)  # every backup full: the request stays home
    assert relay.place("a", 0, cores, 0.0) == 0 and relay.relayed == 1
    assert BackupRelay({}).place("a", 0, cores, 0.0) == 0  # no backups listed


def test_backup_lists_hold_the_other_holders_and_the_least_occupied_others() -> None:
    plan = NexusPlan([GpuPlan([Slot("a", 4, 100.0)], 0.02), GpuPlan([Slot("a", 2, 50.0)], 0.02),
                      GpuPlan([Slot("b", 8, 400.0)], 0.02), GpuPlan([Slot("c", 2, 10.0)], 0.02),
                      GpuPlan([Slot("d", 2, 20.0)], 0.02)])
    lists, runs = backup_gpus(plan, per_model=2)
    assert lists["a"] == [0, 1, 3, 4]  # c's and d's GPUs are the least occupied others
    assert lists["b"] == [2, 3, 4]
    assert runs[3] == [Slot("a", 4, 0.0), Slot("b", 8, 0.0), Slot("d", 2, 0.0)]


def test_backup_sessions_run_only_in_the_time_the_table_leaves() -> None:
    profile = LatencyProfile.linear(1.0, 5.0, 16)
    core = NexusGpuCore({"a": profile, "x": profile})
    out: list[object] = []
    core.load_table(0.0, [Slot("a", 2, 100.0)], out, duty_cycle_s=0.02,
                    backups=[Slot("x", 4, 0.0), Slot("a", 9, 0.0)])  # a is held: no backup
    assert [b.name for b in core.backups] == ["x"]
    core.on_request(0.0, "a", 1, 1.0, out)
    core.on_request(0.001, "x", 2, 1.0, out)
    core.on_request(0.001, "a", 3, 1.0, out)
    assert out == [RunNexusBatch("a", [1], 0.006)]
    out.clear()
    core.on_timer(0.006, out)  # the table's session first, although x waited longer
    assert out == [RunNexusBatch("a", [3], 0.012)]
    out.clear()
    core.on_timer(0.012, out)
    (run,) = out
    assert isinstance(run, RunNexusBatch) and (run.model, run.request_ids) == ("x", [2])
    assert run.finish_at == pytest.approx(0.018)


def _overloaded(policy: str) -> dict[str, Any]:
    data = {"workload": {"name": "nexus-backup", "policy": policy, "rate": 2500.0, "gpus": 8,
                         "arrival": "gamma:0.5", "warmup_s": 0.5, "measure_s": 1.5,
                         "cooldown_s": 0.3, "seed": 3},
            "models": [{"name": "ResNet50", "slo_ms": 25.0, "alpha_ms": 1.053,
                        "beta_ms": 5.072}]}
    return simulate_baseline(parse_workload(data, source="test"))


def test_the_simulator_relays_overflow_to_backups_and_answers_every_request() -> None:
    plain, backed = _overloaded("nexus"), _overloaded("nexus-backup")
    assert plain["nexus"]["relayed"] is None
    assert backed["nexus"]["relayed"] > 0
    assert backed["bad_rate"] < plain["bad_rate"]
    queueing = backed["queueing_ms"]
    assert sum(queueing["histogram"].values()) > 0
    assert queueing["max"] >= queueing["p99"]
