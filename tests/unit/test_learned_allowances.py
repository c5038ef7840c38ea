"""The learned allowances (zserve.core.allowances, scheduler.learned_allowances) on a virtual
clock: the start, the floor and the cap, fast increase and slow decrease, the window, and the
scheduler core planning with what it learned."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from zserve.config.cluster import ClusterConfig, ConfigError, SchedulerConfig, parse_config
from zserve.config.profiles import LatencyProfile
from zserve.core.allowances import (
    DECREASE_FRACTION_PER_S,
    FLOOR_JITTER_S,
    MIN_SAMPLES,
    RECOMPUTE_S,
    TAIL_QUANTILE,
    WINDOW_S,
    AllowanceRule,
    LearnedAllowance,
)
from zserve.core.hosting import Outbox
from zserve.loadgen.sim.hops import HopLatencies
from zserve.scheduler.core import SchedulerCore
from zserve.scheduler.learned_allowances import ShardAllowances
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.rank_thread import RankThread

MS = 1e-3
# planning with the p99: a stall of 2% of the samples moves it
RULE = AllowanceRule(start_s=3 * MS, floor_s=0.3 * MS, cap_s=3 * MS, margin_s=0.1 * MS,
                     quantile=TAIL_QUANTILE)


def feed(allowance: LearnedAllowance, start: float, seconds: float, sample_s: float,
         per_s: int = 200) -> float:
    """``per_s`` samples a second of ``sample_s`` from ``start`` for ``seconds``, reading the
    value after each (as a host does); returns the end time."""
    now = start
    step = 1.0 / per_s
    for _ in range(round(seconds * per_s)):
        allowance.observe(now, sample_s)
        allowance.value(now)
        now += step
    return now


def test_keeps_its_start_until_the_window_holds_enough_samples() -> None:
    allowance = LearnedAllowance(RULE, 0.0)
    for i in range(MIN_SAMPLES - 1):
        allowance.observe(i * 0.01, 0.1 * MS)
    assert allowance.value(1.0) == RULE.start_s
    assert math.isnan(allowance.target_s)


def test_a_quiet_hop_brings_it_down_slowly_to_its_p99_plus_margin() -> None:
    allowance = LearnedAllowance(RULE, 0.0)
    now = feed(allowance, 0.0, 1.0, 0.5 * MS)
    # after one second it has fallen by at most the decrease rate
    assert allowance.value(now) >= RULE.start_s * (1 - DECREASE_FRACTION_PER_S * 1.3)
    now = feed(allowance, now, 30.0, 0.5 * MS)
    assert allowance.value(now) == pytest.approx(0.6 * MS, rel=0.07)  # histogram: within ~6%


def test_the_floor_and_the_cap_bound_it() -> None:
    allowance = LearnedAllowance(RULE, 0.0)
    now = feed(allowance, 0.0, 40.0, 0.0)
    assert allowance.value(now) == RULE.floor_s
    now = feed(allowance, now, 2.0, 50 * MS)
    assert allowance.value(now) == RULE.cap_s


def test_a_stall_raises_it_at_once_and_it_decays_only_after_the_window() -> None:
    allowance = LearnedAllowance(RULE, 0.0)
    now = feed(allowance, 0.0, 40.0, 0.5 * MS)
    low = allowance.value(now)
    assert low < 1 * MS
    # a 0.1 s stall: 2% of the samples at 2 ms (above the p99 by themselves)
    now = feed(allowance, now, 0.1, 2.0 * MS)
    raised = allowance.value(now + RECOMPUTE_S)
    assert raised == pytest.approx(2.1 * MS, rel=0.07)  # up within one recompute
    # it stays up while the stall is in the window, then comes down slowly (never at once)
    now = feed(allowance, now, WINDOW_S - 2.5, 0.5 * MS)
    assert allowance.value(now) == pytest.approx(raised, rel=0.07)
    now = feed(allowance, now, 4.0, 0.5 * MS)
    after = allowance.value(now)
    assert low < after < raised
    now = feed(allowance, now, 30.0, 0.5 * MS)
    assert allowance.value(now) == pytest.approx(low, rel=0.07)


def test_a_rarely_read_allowance_decreases_at_most_one_second_at_a_time() -> None:
    allowance = LearnedAllowance(RULE, 0.0)
    feed(allowance, 0.0, 1.0, 0.1 * MS)
    before = allowance.value(1.0)
    for i in range(MIN_SAMPLES):
        allowance.observe(600.0 + i * 0.01, 0.1 * MS)
    assert allowance.value(601.0) >= before * (1 - DECREASE_FRACTION_PER_S) - 1e-12


def test_configured_values_are_start_and_cap_and_a_small_one_is_not_raised() -> None:
    rule = AllowanceRule.from_configured(0.1 * MS, 0.3 * MS)
    assert (rule.start_s, rule.floor_s, rule.cap_s) == (0.1 * MS, 0.1 * MS, 0.1 * MS)
    with pytest.raises(ValueError, match="floor"):
        AllowanceRule(start_s=1.0, floor_s=2.0, cap_s=1.0)


def test_the_mode_is_checked() -> None:
    assert SchedulerConfig().allowances == "learned"
    assert ClusterConfig().scheduler.allowances == "learned"
    model = {"name": "m", "slo_ms": 25.0,
             "emulated": {"alpha_ms": 1.0, "beta_ms": 5.0, "input_shape": [4],
                          "output_shape": [1]}}
    with pytest.raises(ConfigError,
                       match=r"^scheduler\.allowances: must be one of learned, fixed, got "):
        parse_config({"models": [model], "scheduler": {"allowances": "guessed"}})


def _core(now: float) -> tuple[SchedulerCore, ModelThread]:
    profile = LatencyProfile.linear(alpha_ms=1.053, beta_ms=5.072, max_batch=32)
    thread = ModelThread("m", profile, 25 * MS, "deferred", d_ctrl_s=3 * MS, d_data_s=0.02 * MS,
                         jitter_s=3 * MS, budget_s=(25 - 3 - 3) * MS)
    core = SchedulerCore("shard-0", ["m"], rank=RankThread([0, 1]))
    core.allowances = ShardAllowances(now, 3 * MS, 3 * MS, 3 * MS)
    outbox: Outbox = []
    core.add_thread(now, thread, outbox)
    return core, thread


def test_the_scheduler_core_plans_with_what_it_learned() -> None:
    core, thread = _core(0.0)
    outbox: Outbox = []
    now = 0.0
    budget = thread.sizing.budget_s
    for _ in range(4000):  # 20 s of batches ready 0.4 ms + 0.02 ms a row after their grant
        core.note_ready(now, "m", 0.4 * MS + 0.02 * MS * 8, 8, outbox)
        core.note_ready(now, "other-shards-model", 9.0, 8, outbox)  # not this shard's: ignored
        now += 0.005
    assert core.allowances is not None
    d_ctrl_s, jitter_s, _ = core.allowances.applied
    assert d_ctrl_s == pytest.approx(0.5 * MS, rel=0.07)
    # no input came later than the d_ctrl planned with (still coming down from 3 ms) ...
    assert FLOOR_JITTER_S <= core.allowances.overrun.value_s < 0.5 * MS
    assert jitter_s == 3 * MS  # ... but no timer fired yet: the timers' part keeps its start
    assert thread.sizing.d_ctrl_s == d_ctrl_s
    # the budget keeps its reply part and gives back what d_ctrl no longer takes
    assert thread.sizing.budget_s == pytest.approx(budget + 3 * MS - d_ctrl_s)


def test_a_fetch_tail_over_the_d_ctrl_cap_keeps_the_jitter_slack() -> None:
    core, thread = _core(0.0)
    outbox: Outbox = []
    now = 0.0
    for i in range(8000):  # 2% of the batches ready 8 ms after their grant, over the 3 ms cap
        core.note_ready(now, "m", 8 * MS if i % 50 == 0 else 0.4 * MS, 1, outbox)
        now += 0.005
    assert core.allowances is not None
    assert core.allowances.applied[:2] == (3 * MS, 3 * MS)  # both held at their caps
    assert (thread.sizing.d_ctrl_s, thread.sizing.jitter_s) == (3 * MS, 3 * MS)


def test_late_timers_teach_the_jitter() -> None:
    core, thread = _core(0.0)
    outbox: Outbox = []
    now = 0.0
    for _ in range(8000):  # 40 s: from 3 ms down by 10% a second at most
        core.allowances.note_late(now, 0.2 * MS)  # type: ignore[union-attr]
        core.note_ready(now, "m", 0.1 * MS, 1, outbox)  # inputs never later than planned
        now += 0.005
    assert thread.sizing.jitter_s == pytest.approx(0.3 * MS, rel=0.07)  # p99 + margin
    # until the inputs have been seen, their overrun keeps the jitter at its start
    core, thread = _core(0.0)
    for i in range(8000):
        core.allowances.note_late(i * 0.005, 0.2 * MS)  # type: ignore[union-attr]
        core.apply_allowances(i * 0.005, outbox)
    assert thread.sizing.jitter_s == 3 * MS


def test_a_few_overrunning_batches_are_not_hidden_by_many_timer_samples() -> None:
    core, thread = _core(0.0)
    outbox: Outbox = []
    for i in range(8000):  # 20 timer samples per batch; 2% of the batches overrun by 2 ms
        now = i * 0.005
        for _ in range(20):
            core.allowances.note_late(now, 0.05 * MS)  # type: ignore[union-attr]
        core.note_ready(now, "m", 0.4 * MS if i % 50 else 5 * MS, 1, outbox)
    # the p99 (5 ms) is past what the jitter's 3 ms cap covers beyond d_ctrl's p95 (0.4 ms):
    # d_ctrl takes the rest, and the two cover the p99 together
    assert 1.5 * MS < thread.sizing.d_ctrl_s < 2.2 * MS
    assert thread.sizing.jitter_s == pytest.approx(3 * MS, rel=0.02)  # the overrun's p99
    assert core.allowances is not None
    covered = thread.sizing.d_ctrl_s + thread.sizing.jitter_s
    assert covered == pytest.approx(core.allowances.d_ctrl.tail_s, rel=0.02)  # the fetch's p99


def test_hop_spec_parses_and_draws_its_quantiles() -> None:
    import numpy as np

    hops = HopLatencies.parse("ready=0.2/1.0, reply=0.3/0.9")
    rng = np.random.default_rng(1)
    draws = np.array([hops.ready.draw(rng) for _ in range(20000)])
    assert np.quantile(draws, 0.5) == pytest.approx(0.2 * MS, rel=0.05)
    assert np.quantile(draws, 0.99) == pytest.approx(1.0 * MS, rel=0.1)
    assert hops.late.draw(rng) == 0.0
    for bad in ("ready=1", "ready=2/1", "fetch=1/2"):
        with pytest.raises(ValueError, match="--hops"):
            HopLatencies.parse(bad)


def _sim_workload() -> Any:
    from zserve.loadgen.workload import parse_workload

    return parse_workload({
        "workload": {"gpus": 2, "rate": 600.0, "warmup_s": 12.0, "measure_s": 2.0,
                     "cooldown_s": 0.1, "d_ctrl_ms": 3.0, "jitter_ms": 3.0, "reply_ms": 3.0,
                     "d_data_ms": 0.02},
        "models": [{"name": "m", "slo_ms": 25.0, "alpha_ms": 1.053, "beta_ms": 5.072}]})


def test_the_simulator_replays_the_rule_on_drawn_hops() -> None:
    from zserve.loadgen.sim.simulator import SimConfig, Simulator

    hops = HopLatencies.parse("ready=0.2/0.6,late=0.05/0.3,reply=0.2/0.5")
    fixed = Simulator(_sim_workload(), SimConfig(hops=hops)).run()  # invariants checked
    assert "learned_allowances" not in fixed
    learned = Simulator(_sim_workload(), SimConfig(hops=hops, learned_allowances=True)).run()
    values = learned["learned_allowances"]
    # 14 s of quiet hops: every allowance well under its 3 ms start, at its floor or p99 + margin
    assert 0.3 <= values["d_ctrl"]["value_ms"] < 1.2
    assert 0.3 <= values["jitter"]["value_ms"] < 1.2
    assert 0.5 <= values["reply"][0]["value_ms"] < 1.2
    # and the batches grow with what the allowances gave back
    assert learned["batch_size"]["mean"] >= fixed["batch_size"]["mean"]


# ---------------------------------------------------------------- the quantiles (issue 31)


def test_d_ctrl_plans_with_the_p95_and_the_inputs_overrun_keeps_the_p99() -> None:
    core, thread = _core(0.0)
    outbox: Outbox = []
    for i in range(8000):  # 4% of the batches ready 2 ms after their plan, the rest 0.4 ms
        now = i * 0.005
        core.allowances.note_late(now, 0.05 * MS)  # type: ignore[union-attr]
        core.note_ready(now, "m", 2 * MS if i % 25 == 0 else 0.4 * MS, 1, outbox)
    # d_ctrl covers 95% of the fetches (p95 0.4 ms + margin) ...
    assert thread.sizing.d_ctrl_s == pytest.approx(0.5 * MS, rel=0.07)
    # ... and the jitter's slack the rest: the p99 of what they overran it by (1.5 ms + margin)
    assert thread.sizing.jitter_s == pytest.approx(1.6 * MS, rel=0.07)
    assert thread.sizing.d_ctrl_s + thread.sizing.jitter_s >= 2 * MS


def test_a_rule_checks_its_quantile() -> None:
    with pytest.raises(ValueError, match="quantile"):
        AllowanceRule(start_s=1.0, floor_s=0.0, cap_s=1.0, quantile=1.0)


# ---------------------------------------------------------------- the learned reply, shard side


def _arrive(core: SchedulerCore, now: float, frontend: str, reply_s: float, *, n: int = 4,
            slo_s: float = 25 * MS) -> None:
    """``n`` requests of ``m`` from ``frontend`` whose deadlines keep ``reply_s`` (SLO
    ``slo_s``; shorter than the model's 25 ms: a client's own)."""
    ids = [int(now * 1e6) * 10 + i for i in range(n)]
    core.on_arrivals(now, "m", frontend, ids, [now] * n, [now + slo_s - reply_s] * n, [])


def test_the_target_batch_budget_plans_with_the_frontends_learned_reply() -> None:
    core, thread = _core(0.0)
    assert core.allowances is not None
    d_ctrl_s = thread.sizing.d_ctrl_s
    # the frontend's deadlines keep 1.2 ms for the reply; one client asked for a 10 ms SLO
    _arrive(core, 0.0, "fe-0", 1.2 * MS)
    _arrive(core, 0.0, "fe-0", 1.2 * MS, slo_s=10 * MS)
    core.apply_allowances(0.0, [])
    assert thread.sizing.reply_s == pytest.approx(1.2 * MS)
    assert thread.sizing.budget_s == pytest.approx((25 - 1.2) * MS - d_ctrl_s)
    # a second frontend that keeps more: the budget keeps the larger
    _arrive(core, 1.0, "fe-1", 2.0 * MS)
    core.apply_allowances(1.0, [])
    assert thread.sizing.budget_s == pytest.approx((25 - 2.0) * MS - d_ctrl_s)
    # once fe-1 has been silent for a window, fe-0's allowance is the budget's again
    _arrive(core, 1.0 + WINDOW_S + 1.0, "fe-0", 1.2 * MS)
    core.apply_allowances(1.0 + WINDOW_S + 1.0, [])
    assert thread.sizing.reply_s == pytest.approx(1.2 * MS)
    # never above the configured allowance, never under the reply floor
    _arrive(core, 30.0, "fe-0", 9.0 * MS)
    core.apply_allowances(30.0, [])
    assert thread.sizing.reply_s == pytest.approx(3.0 * MS)


def test_a_plan_carries_its_reply_allowance_and_the_backend_grace_stays_inside_it() -> None:
    from zserve.backends.follower import SHED_GRACE_FRACTION, PlanFollower
    from zserve.transport.messages import BatchPlan, GrantGpu

    core, thread = _core(0.0)
    _arrive(core, 0.0, "fe-0", 1.0 * MS)
    core.apply_allowances(0.0, [])
    outbox: Outbox = []
    thread.on_grant(0.001, GrantGpu("m", 0, 1, 0.0), outbox)
    plans = [m for _, m in outbox if isinstance(m, BatchPlan)]
    assert plans and plans[0].reply_allowance == pytest.approx(1.0 * MS)
    follower = PlanFollower("gpu-0", shed_grace_s=SHED_GRACE_FRACTION * 3 * MS)
    assert follower.grace_s(plans[0]) == pytest.approx(SHED_GRACE_FRACTION * 1.0 * MS)
    # a plan that does not say keeps the configured grace
    unsaid = msgspec.structs.replace(plans[0], reply_allowance=0.0)
    assert follower.grace_s(unsaid) == pytest.approx(SHED_GRACE_FRACTION * 3 * MS)


def test_a_kind_sizing_added_after_learning_plans_with_the_learned_values() -> None:
    core, thread = _core(0.0)
    outbox: Outbox = []
    _arrive(core, 0.0, "fe-0", 1.0 * MS)
    for i in range(8000):
        now = i * 0.005
        core.allowances.note_late(now, 0.05 * MS)  # type: ignore[union-attr]
        core.note_ready(now, "m", 0.4 * MS, 1, outbox)
    own = thread.sizing
    assert own.d_ctrl_s < 1 * MS and own.jitter_s < 1 * MS
    slower = LatencyProfile.linear(alpha_ms=2.0, beta_ms=6.0, max_batch=32)
    thread.set_gpu_profiles({1: slower})
    sibling = thread._kind_sizing[1]  # type: ignore[index]  # the part planning GPU 1
    assert (sibling.d_ctrl_s, sibling.jitter_s, sibling.reply_s, sibling.budget_s) == (
        own.d_ctrl_s, own.jitter_s, own.reply_s, own.budget_s)


# ---------------------------------------------------------------- several shards (backend side)


def test_every_shard_hears_the_ready_samples_of_its_own_models() -> None:
    from zserve.backends.ready_routing import SHARD_SAMPLES_MAX, ReadyRouting

    routing = ReadyRouting()
    routing.note_plan("a", b"shard-0")
    routing.note_plan("b", b"shard-1")
    # batches of both models started; this chunk of plans acknowledges only shard-1
    routing.hold([("a", 0.4 * MS, 8), ("b", 0.5 * MS, 4), ("a", 0.6 * MS, 8)])
    assert routing.take(b"shard-1") == (["b"], [0.5 * MS], [4])
    assert routing.held(b"shard-0") == 2  # kept for shard-0's next acknowledgement
    assert routing.take(b"shard-0") == (["a", "a"], [0.4 * MS, 0.6 * MS], [8, 8])
    assert routing.take(b"shard-0") == ([], [], [])
    # a model a new shard plans (a move, a takeover) reports there; unplanned models nowhere
    routing.note_plan("a", b"shard-2")
    routing.hold([("a", 0.4 * MS, 8), ("c", 0.4 * MS, 8)])
    assert routing.take(b"shard-2")[0] == ["a"]
    # a shard whose plans stopped holds a bounded sample
    routing.hold([("b", 0.4 * MS, 1)] * (SHARD_SAMPLES_MAX + 10))
    assert routing.held(b"shard-1") == SHARD_SAMPLES_MAX


def test_a_shard_learns_from_samples_acknowledged_to_it_alone() -> None:
    """Two shards, one backend: the shard of model a learns a's d_ctrl although most chunks
    acknowledge only the other shard's plans."""
    from zserve.backends.ready_routing import ReadyRouting

    routing = ReadyRouting()
    routing.note_plan("m", b"shard-0")
    routing.note_plan("other", b"shard-1")
    core, thread = _core(0.0)
    outbox: Outbox = []
    for i in range(8000):
        now = i * 0.005
        core.allowances.note_late(now, 0.05 * MS)  # type: ignore[union-attr]
        routing.hold([("m", 0.4 * MS, 1), ("other", 0.4 * MS, 1)])
        routing.take(b"shard-1")  # every chunk acknowledges shard-1
        if i % 10 == 0:  # one in ten also shard-0 (the shard of m)
            models, delays, rows = routing.take(b"shard-0")
            for model, delay_s, n in zip(models, delays, rows, strict=True):
                core.note_ready(now, model, delay_s, n, outbox)
    assert thread.sizing.d_ctrl_s == pytest.approx(0.5 * MS, rel=0.07)
