"""The orchestrator's decisions on a virtual clock (``zserve.orchestrator.replanner``): on-demand
loads by unmet demand, one at a time; LRU eviction under a memory budget, the load after the
evictions; idle unloads; rates over a window; re-plans every plan period within the disruption
budget, turned into moves."""

from __future__ import annotations

import pytest

from zserve.orchestrator.memory import ModelMemory
from zserve.orchestrator.replanner import (
    ACTION_RETRY_S,
    SPREAD,
    Load,
    Move,
    Replanner,
    ReplanSettings,
    Unload,
)

MB = 1 << 20


def _memory(**static_mb: int) -> dict[str, ModelMemory]:
    return {name: ModelMemory(name, mb * MB, 0) for name, mb in static_mb.items()}


def test_the_model_with_the_most_unmet_demand_loads_first_one_at_a_time() -> None:
    core = Replanner(ReplanSettings(), _memory(a=1, b=1, c=1), now=0.0)
    core.note_usage(1.0, "frontend-0", {}, {"a": 2, "b": 5})
    core.note_usage(1.0, "frontend-1", {}, {"a": 2, "c": 1})
    assert core.unmet("a") == 4 and core.unmet("b") == 5
    assert core.step(1.0, loaded={}, busy=()) == [Load("b", 0, 5)]
    # b's load is under way: nothing else starts, though a and c wait
    assert core.step(1.5, loaded={"b": 0}, busy={"b"}) == []
    # b is served and its frontends hold nothing for it any more: a (4 waiting) is next
    core.note_usage(2.0, "frontend-0", {"b": 2}, {"a": 2})
    core.note_usage(2.0, "frontend-1", {}, {"a": 2, "c": 1})
    assert core.step(2.0, loaded={"b": 0}, busy=()) == [Load("a", 0, 4)]


def test_a_frontends_report_replaces_its_previous_one() -> None:
    core = Replanner(ReplanSettings(), _memory(a=1), now=0.0)
    core.note_usage(1.0, "frontend-0", {}, {"a": 3})
    core.note_usage(2.0, "frontend-0", {}, {})  # its requests were answered (deadline, cancel)
    assert core.unmet("a") == 0
    assert core.step(2.0, loaded={}, busy=()) == []


def test_memory_short_evicts_the_least_recently_used_then_loads() -> None:
    settings = ReplanSettings(memory_budget_bytes=3 * MB)
    core = Replanner(settings, _memory(old=1, recent=1, middle=1, new=2), now=0.0)
    core.note_usage(1.0, "f", {"old": 1}, {})
    core.note_usage(2.0, "f", {"middle": 1}, {})
    core.note_usage(3.0, "f", {"recent": 1}, {})
    core.note_usage(4.0, "f", {}, {"new": 7})
    loaded = {"old": 0, "middle": 0, "recent": 0}
    # 3 MB resident, 2 more needed in a 3 MB budget: the two least recently used go
    assert core.step(4.0, loaded, busy=()) == [
        Unload("old", "evicted (least recently used) to load 'new'"),
        Unload("middle", "evicted (least recently used) to load 'new'")]
    # while they unload (still resident, busy) nothing else is evicted or loaded
    assert core.step(4.5, loaded, busy={"old", "middle"}) == []
    assert core.step(5.0, {"recent": 0}, busy=()) == [Load("new", 0, 7)]


def test_a_model_larger_than_the_budget_is_unservable() -> None:
    core = Replanner(ReplanSettings(memory_budget_bytes=MB), _memory(huge=2, small=1), now=0.0)
    core.note_usage(1.0, "f", {}, {"huge": 9, "small": 1})
    assert core.step(1.0, loaded={}, busy=()) == [Load("small", 0, 1)]
    assert "huge" in core.unservable and "budget" in core.unservable["huge"]


def test_a_model_idle_for_idle_unload_s_is_unloaded() -> None:
    core = Replanner(ReplanSettings(idle_unload_s=10.0), _memory(a=1, b=1), now=0.0)
    loaded = {"a": 0, "b": 0}
    core.note_usage(5.0, "f", {"a": 3}, {})
    assert core.step(9.9, loaded, busy=()) == []
    # b never had a request: idle since the start; a had one at 5 s
    assert core.wake_at(loaded) == pytest.approx(10.0)
    assert core.step(10.0, loaded, busy=()) == [Unload("b", "idle for 10 s")]
    assert core.step(14.9, {"a": 0}, busy=()) == []
    assert core.wake_at({"a": 0}) == pytest.approx(15.0)
    core.note_usage(14.9, "f", {}, {}, pending={"a": 1})  # one still unanswered: in use
    assert core.step(24.8, {"a": 0}, busy=()) == []
    assert core.step(25.0, {"a": 0}, busy=()) == [Unload("a", "idle for 10 s")]


def test_idle_time_counts_from_the_load() -> None:
    core = Replanner(ReplanSettings(idle_unload_s=10.0), _memory(a=1, b=1), now=0.0)
    assert core.step(1.0, {}, busy=()) == []
    assert core.step(20.0, {"b": 0}, busy={"b"}) == []  # loading since 20 s
    assert core.step(29.9, {"b": 0}, busy=()) == []
    assert core.step(30.0, {"b": 0}, busy=()) == [Unload("b", "idle for 10 s")]


def test_a_busy_or_just_acted_on_model_is_left_alone() -> None:
    core = Replanner(ReplanSettings(idle_unload_s=1.0), _memory(a=1), now=0.0)
    assert core.step(2.0, {"a": 0}, busy={"a"}) == []
    assert core.step(2.0, {"a": 0}, busy=()) == [Unload("a", "idle for 1 s")]
    # the unload was refused at once (the model is still loaded): retried only after a while
    assert core.step(2.0 + ACTION_RETRY_S / 2, {"a": 0}, busy=()) == []
    assert core.step(2.0 + ACTION_RETRY_S, {"a": 0}, busy=()) == [Unload("a", "idle for 1 s")]


def test_wake_at_is_always_after_the_last_step() -> None:
    # a model past its idle time but busy (its unload under way) must not make the host spin
    core = Replanner(ReplanSettings(idle_unload_s=1.0, plan_period_s=100.0), _memory(a=1),
                     now=0.0)
    assert core.step(5.0, {"a": 0}, busy={"a"}) == []
    assert core.wake_at({"a": 0}) == pytest.approx(100.0)
    assert core.step(6.0, {"a": 0}, busy=()) == [Unload("a", "idle for 1 s")]
    assert core.wake_at({"a": 0}) == pytest.approx(6.0 + ACTION_RETRY_S)
    assert core.step(8.0, {"a": 0}, busy={"a"}) == []  # unloading, still resident
    assert core.wake_at({"a": 0}) > 8.0


def test_rates_are_requests_over_the_window() -> None:
    core = Replanner(ReplanSettings(rate_window_s=10.0), _memory(a=1), now=0.0)
    core.note_usage(1.0, "f", {"a": 50}, {})
    core.note_usage(6.0, "f", {"a": 30}, {})
    assert core.rate_rps(6.0, "a") == pytest.approx(8.0)
    assert core.rate_rps(11.5, "a") == pytest.approx(3.0)  # the first report left the window
    assert core.rate_rps(17.0, "a") == 0.0


def _loaded_rates(core: Replanner, now: float, rates: dict[str, int]) -> None:
    core.note_usage(now, "f", {m: r * 60 for m, r in rates.items()}, {})


def test_every_plan_period_a_replan_moves_models_within_the_budget() -> None:
    # a move costs twice a model's bytes: a budget of all the bytes lets two of four move
    settings = ReplanSettings(plan_period_s=300.0, subclusters=2, disruption_fraction=1.0)
    core = Replanner(settings, _memory(a=1, b=1, c=1, d=1), now=0.0)
    # every model in sub-cluster 0: all the load on one side
    loaded = {"a": 0, "b": 0, "c": 0, "d": 0}
    _loaded_rates(core, 250.0, {"a": 100, "b": 100, "c": 100, "d": 100})
    assert core.step(299.0, loaded, busy=()) == []  # not yet a plan period
    assert core.wake_at(loaded) == pytest.approx(300.0)
    moves = core.step(300.0, loaded, busy=())
    assert all(type(m) is Move and m.group == 1 for m in moves)
    assert len(moves) == 2  # balanced: two models each side
    assert core.plans == 1 and core.next_plan_at == pytest.approx(600.0)


def test_a_replan_moves_no_more_than_the_disruption_budget() -> None:
    # a move costs twice a model's bytes; 4 MB of 4: a budget of 0.5 lets one model move
    settings = ReplanSettings(plan_period_s=60.0, subclusters=2, disruption_fraction=0.5)
    core = Replanner(settings, _memory(a=1, b=1, c=1, d=1), now=0.0)
    _loaded_rates(core, 50.0, {"a": 100, "b": 100, "c": 100, "d": 100})
    moves = core.step(60.0, {"a": 0, "b": 0, "c": 0, "d": 0}, busy=())
    assert len(moves) == 1


def test_a_first_plan_places_spread_models_and_one_subcluster_never_replans() -> None:
    settings = ReplanSettings(plan_period_s=60.0, subclusters=2, disruption_fraction=0.0)
    core = Replanner(settings, _memory(a=1, b=1), now=0.0)
    _loaded_rates(core, 50.0, {"a": 10, "b": 10})
    moves = core.step(60.0, {"a": SPREAD, "b": SPREAD}, busy=())
    assert sorted(m.group for m in moves if type(m) is Move) == [0, 1]
    single = Replanner(ReplanSettings(plan_period_s=60.0), _memory(a=1, b=1), now=0.0)
    _loaded_rates(single, 50.0, {"a": 10, "b": 1})
    assert single.step(60.0, {"a": 0, "b": 0}, busy=()) == []


def test_on_demand_goes_to_the_least_loaded_subcluster_where_it_fits() -> None:
    settings = ReplanSettings(subclusters=2, memory_budget_bytes=2 * MB)
    core = Replanner(settings, _memory(hot=1, cold=1, big=2), now=0.0)
    _loaded_rates(core, 1.0, {"hot": 100, "cold": 1})
    core.note_usage(1.0, "f", {}, {"new": 1})
    core.add_model("new", ModelMemory("new", MB, 0))
    assert core.step(1.0, {"hot": 0, "cold": 1}, busy=()) == [Load("new", 1, 1)]
