"""Autoscaling per device kind: the ``[autoscale.kinds.<kind>]`` schema, each kind's signals
and advice (zserve.orchestrator.autoscale_kinds), the frontend's per-kind advice and gauges,
and where an added backend of a kind goes (a sub-cluster of the orchestrator)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from zserve.cluster import status
from zserve.cluster.orchestrator_host import OrchestratorHost
from zserve.cluster.repository import ModelRepository
from zserve.config.cluster import ConfigError, OrchestrationConfig, parse_config
from zserve.frontend.autoscale_advice import AdviceTracker
from zserve.frontend.metrics import cluster_families
from zserve.orchestrator.autoscale import (
    ADD_BAD,
    BOUND,
    HOLD,
    RELEASE_IDLE,
    AutoscalePolicy,
    Signals,
)
from zserve.orchestrator.autoscale_kinds import (
    BackendSample,
    KindAutoscalers,
    group_for,
    kind_signals,
    kind_targets,
)

MODELS: list[dict[str, Any]] = [
    {"name": "big", "emulated": {"alpha_ms": 1.0, "beta_ms": 1.0}},
    {"name": "small", "emulated": {"alpha_ms": 1.0, "beta_ms": 1.0}}]
KINDS = ["a100", "a100", "t4", "t4"]


def document(**kinds: Any) -> dict[str, Any]:
    return {"models": copy.deepcopy(MODELS),
            "backends": {"count": 4, "device": "emulated", "kinds": list(KINDS)},
            "autoscale": {"enabled": True, "max_backends": 12, "up_window_s": 2.0,
                          "down_window_s": 4.0, "settle_s": 0.0, "down_hold_s": 0.0,
                          "min_requests": 10, "max_release_fraction": 1.0,
                          "kinds": kinds or {"a100": {"max_backends": 6},
                                             "t4": {"min_backends": 1, "max_backends": 4}}}}


def test_each_kind_has_its_bounds_and_a_kind_without_a_table_keeps_its_count() -> None:
    config = parse_config(document(a100={"min_backends": 2, "max_backends": 6}))
    assert config.autoscale.kind_bounds(config.backends) == {"a100": (2, 6), "t4": (2, 2)}
    assert config.backends.started_by_kind() == {"a100": 2, "t4": 2}
    assert parse_config({"models": MODELS}).autoscale.kind_bounds(
        parse_config({"models": MODELS}).backends) == {}


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["autoscale"]["kinds"]["a100"].update(max_backends=-1),
     "autoscale.kinds.a100.max_backends: must be >= 0"),
    (lambda d: d["autoscale"]["kinds"]["a100"].update(max_bakends=1),
     "autoscale.kinds.a100.max_bakends: unknown key (did you mean 'max_backends'?)"),
    (lambda d: d["autoscale"]["kinds"]["t4"].update(min_backends="2"),
     "autoscale.kinds.t4.min_backends: must be an integer, got '2'"),
    (lambda d: d["autoscale"]["kinds"]["t4"].update(min_backends=5),
     "autoscale.kinds.t4.min_backends: 5 is above max_backends 4"),
    (lambda d: d["autoscale"]["kinds"]["a100"].update(max_backends=1),
     "autoscale.kinds.a100: 2 backends of kind 'a100' start, outside min_backends"),
    (lambda d: d["autoscale"]["kinds"].update(h100={}),
     "autoscale.kinds.h100: no backend of kind 'h100' starts (backends.kinds has a100, t4)"),
    (lambda d: d["autoscale"]["kinds"].update({"a 1": {}}), "autoscale.kinds.a 1: a kind must"),
    (lambda d: d["autoscale"]["kinds"].update(t4=3), "autoscale.kinds.t4: must be a table"),
    (lambda d: d["autoscale"].update(max_backends=8),
     "autoscale.kinds: the kinds' bounds add up to 2..10 backends, outside the cluster's"),
    (lambda d: d["backends"].pop("kinds"), "autoscale.kinds: per-kind bounds need"),
    (lambda d: d["backends"].update(kinds=["a100"]),
     "backends.kinds: names one kind per backend: 1 kinds for 4 backends"),
])
def test_bad_kind_tables_are_one_line_errors_naming_the_key(change: Any, message: str) -> None:
    bad = document()
    change(bad)
    with pytest.raises(ConfigError) as caught:
        parse_config(bad)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_kinds_signals_are_its_backends_and_its_share_of_its_models_requests() -> None:
    backends = {
        "backend-0": BackendSample("a100", 0.9, ("big",)),
        "backend-1": BackendSample("a100", 0.7, ("big", "shared")),
        "backend-2": BackendSample("t4", 0.2, ("small", "shared")),
    }
    offered = {"big": 100, "small": 40, "shared": 10, "nowhere": 5}
    bad = {"big": 30, "shared": 4}
    signals = kind_signals(1.0, offered, bad, backends)
    # "shared" is on one a100 and one t4: half its requests each; "nowhere" counts for none
    assert signals["a100"] == Signals(1.0, 105, 32, signals["a100"].busy_s, 2)
    assert signals["t4"] == Signals(1.0, 45, 2, signals["t4"].busy_s, 1)
    assert signals["a100"].busy_s == pytest.approx(1.6) and signals["t4"].busy_s == 0.2


def test_an_overloaded_kind_grows_and_an_idle_one_shrinks_each_within_its_bounds() -> None:
    policy = AutoscalePolicy(min_backends=1, max_backends=100, up_window_s=2.0,
                             down_window_s=4.0, settle_s=0.0, down_hold_s=0.0,
                             min_requests=10, max_release_fraction=1.0, idle_floor=0.03)
    kinds = KindAutoscalers(policy, {"a100": (1, 3), "t4": (1, 4)}, {"a100": 2, "t4": 3}, 0.0)
    for t in range(1, 6):
        kinds.observe(float(t), {"a100": Signals(1.0, 1000, 500, 2.0, 2),
                                 "t4": Signals(1.0, 1000, 0, 0.6, 3)})
        advice = kinds.advise(float(t))
        if t == 1:
            first = advice
    # a100: 2 saturated GPUs (at most the peak's 97% busy) at 50% bad need 2 x 0.97 / (0.5 x
    # 0.97) = 4, beyond its max of 3
    assert first["a100"].reason == BOUND and first["a100"].backends == 3
    assert first["a100"].needed == pytest.approx(4.0)
    # t4: 20% busy; a release waits for a full down window, then goes to ceil(0.6 / 0.97) = 1
    assert first["t4"].reason == HOLD
    released = kinds.autoscalers["t4"].last_change
    assert released is not None and released.reason == RELEASE_IDLE
    assert advice["t4"].backends == 1 and kinds.autoscalers["t4"].changes[0][1] == -2
    assert kinds.serving == {"a100": 2, "t4": 3}


def test_a_kind_with_no_backend_serving_gets_an_empty_sample() -> None:
    kinds = KindAutoscalers(AutoscalePolicy(), {"a100": (1, 4), "t4": (1, 4)},
                            {"a100": 1, "t4": 1}, 0.0)
    kinds.observe(1.0, {"a100": Signals(1.0, 10, 0, 0.5, 1)})
    assert kinds.serving == {"a100": 1, "t4": 0}
    assert kinds.advise(1.0)["t4"].backends == 1  # nothing measured: it holds


def test_kind_targets_clamp_each_kind_and_leave_the_unadvised_alone() -> None:
    kept = {"a100": ["backend-0", "backend-1"], "t4": ["backend-2"], "h200": ["backend-3"]}
    bounds = {"a100": (1, 3), "t4": (2, 4), "h200": (1, 2)}
    assert kind_targets({"a100": 9, "t4": 1}, kept, bounds) == {"a100": 1, "t4": 1}
    assert kind_targets({"a100": 1, "t4": 2, "h200": 1}, kept, bounds) == {"a100": -1, "t4": 1}


def test_an_added_backend_joins_the_sub_cluster_of_its_kind() -> None:
    groups = [["backend-0", "backend-1"], ["backend-2", "backend-3"], ["backend-4"]]
    kind_of = {"backend-0": "a100", "backend-1": "a100", "backend-2": "t4",
               "backend-3": "a100", "backend-4": "t4"}
    assert group_for("a100", groups, kind_of) == 0
    assert group_for("t4", groups, kind_of) == 1  # tie of one t4 each: the lower index
    assert group_for("h200", groups, kind_of) == 2  # none of its kind: the smallest


def test_the_orchestrator_places_an_added_backend_with_its_kinds_models() -> None:
    models = {m["name"]: m for m in MODELS}
    repository = ModelRepository(models, {"backend-0": ["big"], "backend-1": ["big"],
                                          "backend-2": ["small"], "backend-3": ["small"]})
    repository.placement["small"] = frozenset({"backend-2", "backend-3"})
    config = parse_config(document())
    host = OrchestratorHost(OrchestrationConfig(subclusters=2), repository,
                            ["backend-0", "backend-1", "backend-2", "backend-3"], config.models,
                            0.0, kinds=dict(zip(host_names(4), KINDS, strict=True)))
    assert host.join("backend-4", "t4") == ["small"]
    assert host.groups == [["backend-0", "backend-1"], ["backend-2", "backend-3", "backend-4"]]
    assert repository.placement["small"] == frozenset({"backend-2", "backend-3", "backend-4"})
    assert repository.placement["big"] == frozenset({"backend-0", "backend-1"})  # not its group
    host.leave("backend-4")
    assert host.groups[1] == ["backend-2", "backend-3"] and "backend-4" not in host.kind_of


def host_names(n: int) -> list[str]:
    return [f"backend-{i}" for i in range(n)]


def stats(outcomes: dict[str, tuple[int, int]], busy: list[float]) -> dict[str, Any]:
    """A frontend's cluster stats answer: per model (ok, DEADLINE) counts; per backend busy
    seconds so far; backends 0-1 a100 serving big, 2-3 t4 serving small."""
    counters: dict[str, int] = {}
    for model, (ok, late) in outcomes.items():
        counters[f"outcome/{model}/ok"] = ok
        counters[f"outcome/{model}/DEADLINE"] = late
    return {"counters": counters, "backends": host_names(len(busy)),
            "cluster": {f"backend-{i}": {"role": "backend", "busy_total_s": b,
                                         "kind": KINDS[i],
                                         "models": ["big"] if i < 2 else ["small"]}
                        for i, b in enumerate(busy)}}


def test_the_frontend_advises_each_kind_and_exports_it_labelled(
        capsys: pytest.CaptureFixture[str]) -> None:
    tracker = AdviceTracker.for_cluster(parse_config(document()), 0.0)
    assert tracker is not None and tracker.kinds is not None
    for t in range(4):
        # big (a100) half bad on saturated GPUs; small (t4) all good on GPUs 30% busy
        tracker.observe(float(t), stats({"big": (500 * t, 500 * t), "small": (800 * t, 0)},
                                        [1.0 * t, 1.0 * t, 0.3 * t, 0.3 * t]))
    kinds = tracker.snapshot()["kinds"]
    assert kinds["a100"]["reason"] == ADD_BAD and kinds["a100"]["advice_backends"] == 5
    assert kinds["a100"]["bad_rate"] == pytest.approx(0.5) and kinds["a100"]["backends"] == 2
    assert kinds["t4"]["bad_rate"] == 0.0 and kinds["t4"]["max_backends"] == 4
    answer = stats({}, [0.0] * 4) | {"autoscale": tracker.snapshot()}
    families = {f.name: f for f in cluster_families("frontend-0", answer, frozenset())}
    samples = {s.labels["kind"]: s.value
               for s in families["zserve_autoscale_kind_backends_advice"].samples}
    assert samples == {"a100": 5.0, "t4": float(kinds["t4"]["advice_backends"])}
    status._print_autoscale(answer)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("autoscale: advice ")
    assert lines[1].startswith("  kind a100: advice 5 backends (serving 2, bounds 1..6)")
