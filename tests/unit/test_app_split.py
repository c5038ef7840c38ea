"""The apps' live SLO split on a virtual clock: each splitter re-run every period from the rates
the real FrontendCore measured, a stage whose model's rate rises getting more of the SLO, every
path's budgets within the SLO, and the ``[[apps]]`` keys' one-line errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from zserve.config.apps import AppGraph
from zserve.config.cluster import ClusterConfig, ConfigError, parse_config
from zserve.core.hosting import Outbox
from zserve.frontend.app_split import (
    AppSplits,
    batch_cost,
    heaviest_paths,
    split_weights,
)
from zserve.frontend.core import TO_SHARD, FrontendCore
from zserve.transport.messages import InferRequest, RequestMetaBatch

APP_SLO_MS = 100.0
REPLY_ALLOWANCE_MS = 5.0
JITTER_MS = 2.0
OVERHEAD_S = (REPLY_ALLOWANCE_MS + JITTER_MS) / 1e3  # what every stage's share adds
PERIOD_S = 1.0
# (alpha ms, beta ms) of each model: batching pays more the larger beta is against alpha.
MODELS = {"det": (1.0, 4.0), "cls": (0.5, 3.0), "trk": (0.5, 2.0)}
CLIENT = b"client-1"


def _app(splitter: str, *, join: bool = False) -> dict[str, Any]:
    stages: list[dict[str, Any]] = [
        {"name": "detect", "model": "det", "inputs": {"x": "app.image"}},
        {"name": "classify", "model": "cls", "after": {"detect": 2},
         "inputs": {"x": "detect.y"}},
        {"name": "track", "model": "trk", "after": {"classify": 1},
         "inputs": {"x": "classify.y"}}]
    if join:  # track follows both: a DAG that is not a tree
        stages[2] = {"name": "track", "model": "trk", "after": {"classify": 1, "detect": 2},
                     "inputs": {"x": "classify.y"}}
    # no client allowance: the whole SLO is split (its part is the frontend tests')
    return {"name": "pipe", "slo_ms": APP_SLO_MS, "splitter": splitter,
            "resplit_every_s": PERIOD_S, "client_allowance_ms": 0.0, "stages": stages}


def _cluster(app: dict[str, Any], frontends: int = 1) -> ClusterConfig:
    models = [{"name": name, "emulated": {"alpha_ms": a, "beta_ms": b, "input_shape": [4],
                                          "output_shape": [1] if name == "trk" else [4]},
               "slo_ms": 1000.0, "max_batch": 16} for name, (a, b) in MODELS.items()]
    return parse_config({"backends": {"count": 1, "device": "emulated"},
                         "scheduler": {"jitter_ms": JITTER_MS},
                         "frontends": {"count": frontends,
                                       "reply_allowance_ms": REPLY_ALLOWANCE_MS},
                         "models": models, "apps": [app]})


def _paths(plan: AppGraph) -> Iterator[list[str]]:
    """Every source-to-last-stage path of ``plan``."""
    def walk(stage: str) -> Iterator[list[str]]:
        if not plan.next[stage]:
            yield [stage]
        for nxt in plan.next[stage]:
            for rest in walk(nxt):
                yield [stage, *rest]
    for source in plan.order:
        if not plan.stages[source].after:
            yield from walk(source)


def _tables(plan: AppGraph) -> dict[str, list[float]]:
    return {s: [(MODELS[plan.stages[s].model][0] * b + MODELS[plan.stages[s].model][1]) / 1e3
                for b in range(1, 17)] for s in plan.order}


@pytest.mark.parametrize("splitter", ["nexus", "harpagon"])
def test_a_stage_whose_rate_rises_gets_more_of_the_slo_and_every_path_fits(
        splitter: str) -> None:
    plan = _cluster(_app(splitter)).app_graphs()["pipe"]
    delays = {s: (0.003, 0.00005) for s in plan.order}  # d_ctrl, d_data
    split = {}
    for classify_rps in (50.0, 800.0):  # below max_batch (16) at 800 r/s in ~20 ms
        rates = {"detect": 100.0, "classify": classify_rps, "track": 200.0}
        weights, used = split_weights(plan, _tables(plan), rates, OVERHEAD_S, delays)
        assert used  # the splitter's own split, not the fallback
        sums = [sum(weights[s] for s in path) for path in _paths(plan)]
        # the budgets fit the time the stages use, and the time no cost needs is shared out
        assert max(sums) == pytest.approx(plan.stages_slo_s - OVERHEAD_S)
        for stage, weight in weights.items():  # each stage's batch of one fits its budget
            assert weight >= _tables(plan)[stage][0] + 0.003 + 0.00005 - 1e-9
        split[classify_rps] = weights
    assert split[800.0]["classify"] > split[50.0]["classify"]



def test_the_cost_of_a_stage_is_its_gpu_time_at_the_largest_batch_its_budget_allows() -> None:
    table = [0.004 + 0.001 * b for b in range(1, 9)]  # l(b) = 4 + b ms
    assert batch_cost(table, 100.0, 0.004) == float("inf")  # not even l(1) = 5 ms fits
    assert batch_cost(table, 100.0, 0.005) == pytest.approx(100.0 * 0.005)  # batch 1
    # batch 3 waits 2 / 100 s for its last request and runs 7 ms: 27 ms.
    assert batch_cost(table, 100.0, 0.027) == pytest.approx(100.0 * 0.007 / 3)


class _Frontend:
    """A FrontendCore on a virtual clock; each stage request's scheduler deadline read from
    the tick's metadata (no backend answers: the split only needs admissions)."""

    def __init__(self, cluster: ClusterConfig) -> None:
        self.core = FrontendCore(name="frontend-0", cluster=cluster, index=0,
                                 data_address="ipc://data", profiles={})
        self.deadlines: dict[str, list[float]] = {}
        self.next_id = 0

    def send(self, now: float, model: str) -> None:
        """One request of ``model`` (the app's name or a model's) at ``now``."""
        inputs = {"image" if model == "pipe" else "x": np.zeros((1, 4), np.float32)}
        self.next_id += 1
        self._tick(lambda outbox: self.core.on_client_message(
            now, CLIENT, InferRequest(self.next_id, model, inputs), outbox))

    def timer(self, now: float) -> None:
        assert self.core.wake_at <= now
        self._tick(lambda outbox: self.core.on_timer(now, outbox))

    def _tick(self, call: Any) -> None:
        outbox: Outbox = []
        call(outbox)
        self.core.end_tick(outbox)
        for destination, msg in outbox:
            if destination[0] == TO_SHARD and isinstance(msg, RequestMetaBatch):
                for model, deadline in zip(msg.models, msg.deadlines, strict=True):
                    self.deadlines.setdefault(model, []).append(deadline)


def test_the_frontend_resplits_every_period_from_the_rates_it_measured() -> None:
    f = _Frontend(_cluster(_app("harpagon")))
    f.send(0.0, "pipe")
    start_split = f.core.stats()["app_splits"]["pipe"]
    assert start_split["rates_rps"] == {}  # proportional to l(1) until a period is measured
    assert f.core.app_splits.next_at == pytest.approx(PERIOD_S)
    # Period 1: few app requests, classify's model busy with other clients' requests.
    for i in range(1, 10):
        f.send(i * 0.1, "pipe")
    for i in range(200):
        f.send(i * 0.005, "cls")
    f.send(0.5, "trk")
    f.timer(PERIOD_S)
    first = f.core.stats()["app_splits"]["pipe"]
    assert f.core.counters["app_resplits"] == 1 and first["by_splitter"]
    assert first["rates_rps"] == pytest.approx({"detect": 10.0, "classify": 200.0,
                                                "track": 1.0})
    assert first["budgets_ms"] != start_split["budgets_ms"]
    # Period 2: classify's model quiet, detect's busy: the split moves with the rates.
    for i in range(200):
        f.send(PERIOD_S + i * 0.005, "det")
    for model in ("cls", "trk", "pipe"):
        f.send(PERIOD_S + 0.5, model)
    f.timer(2 * PERIOD_S)
    second = f.core.stats()["app_splits"]["pipe"]
    assert f.core.counters["app_resplits"] == 2
    assert second["budgets_ms"]["classify"] < first["budgets_ms"]["classify"]
    # A new app request's detect stage gets its share of the new split.
    f.deadlines.clear()
    f.send(2 * PERIOD_S, "pipe")
    (det,) = f.deadlines["det"]
    share_s = second["budgets_ms"]["detect"] / 1e3  # of the SLO less the overhead
    assert det == pytest.approx(2 * PERIOD_S + share_s + OVERHEAD_S - REPLY_ALLOWANCE_MS / 1e3,
                                abs=1e-5)
    for path in _paths(f.core.apps.plans["pipe"]):  # budgets_ms is rounded to 1 us
        assert (sum(second["budgets_ms"][s] for s in path)
                <= APP_SLO_MS - 1e3 * OVERHEAD_S + 0.003)


def test_a_period_without_a_request_of_some_stage_keeps_the_split() -> None:
    f = _Frontend(_cluster(_app("nexus")))
    f.send(0.0, "pipe")  # det only: classify and track have no request yet
    before = f.core.stats()["app_splits"]["pipe"]["budgets_ms"]
    f.timer(PERIOD_S)
    assert f.core.counters["app_resplits"] == 0
    assert f.core.stats()["app_splits"]["pipe"]["budgets_ms"] == before
    assert f.core.wake_at == pytest.approx(2 * PERIOD_S)  # the next period is still timed


def test_rates_are_scaled_by_the_frontends_that_share_the_clients() -> None:
    plans = _cluster(_app("harpagon"), frontends=4).app_graphs()
    splits = AppSplits(plans, {m: [1e-3 * (a * b + c) for b in range(1, 17)]
                               for m, (a, c) in MODELS.items()},
                       frontends=4, overhead_s=OVERHEAD_S)
    splits.start(10.0)
    for model, count in (("det", 5), ("cls", 10), ("trk", 10)):
        for _ in range(count):
            splits.note(model)
    assert splits.on_timer(10.0 + PERIOD_S / 2) == []  # not due yet
    assert splits.on_timer(10.0 + PERIOD_S) == ["pipe"]
    assert splits.rates_rps["pipe"] == {"detect": 20.0, "classify": 40.0, "track": 40.0}
    plan = plans["pipe"]
    path = heaviest_paths(plan, splits.weights["pipe"])
    assert max(path.values()) == pytest.approx(sum(splits.weights["pipe"].values()))


@pytest.mark.parametrize(("change", "message"), [
    ({"splitter": "dp"}, "apps[0].splitter: "),
    ({"resplit_every_s": 0.0}, "apps[0].resplit_every_s: "),
    ({"client_allowance_ms": -1.0}, "apps[0].client_allowance_ms: "),
    ({"client_allowance_ms": APP_SLO_MS}, "apps[0].client_allowance_ms: must be below slo_ms"),
])
def test_a_bad_splitter_key_is_one_line_naming_it(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _cluster({**_app("harpagon"), **change})
    text = str(caught.value)
    assert message in text and "\n" not in text


def test_nexus_refuses_an_app_that_is_not_a_tree_and_harpagon_splits_it() -> None:
    with pytest.raises(ConfigError, match=r"apps\[0\]\.splitter: 'nexus' .* 'track' follows 2"):
        _cluster(_app("nexus", join=True))
    plan = _cluster(_app("harpagon", join=True)).app_graphs()["pipe"]
    rates = {"detect": 100.0, "classify": 200.0, "track": 200.0}
    weights, used = split_weights(plan, _tables(plan), rates, OVERHEAD_S)
    assert used
    for path in _paths(plan):
        assert sum(weights[s] for s in path) <= plan.stages_slo_s - OVERHEAD_S + 1e-9


def test_rates_within_a_rate_step_keep_the_split_and_a_larger_change_moves_it() -> None:
    plans = _cluster(_app("harpagon")).app_graphs()
    splits = AppSplits(plans, {m: [1e-3 * (a * b + c) for b in range(1, 17)]
                               for m, (a, c) in MODELS.items()},
                       frontends=1, overhead_s=OVERHEAD_S)
    splits.start(0.0)
    seen = []
    for period, classify_count in enumerate((400, 404, 100), start=1):  # +1%, then / 4
        for model, count in (("det", 100), ("cls", classify_count), ("trk", 200)):
            for _ in range(count):
                splits.note(model)
        assert splits.on_timer(period * PERIOD_S) == ["pipe"]
        seen.append(dict(splits.weights["pipe"]))
    assert seen[1] == seen[0]  # the same split: a period's noise does not make it flap
    assert seen[2] != seen[0]


def test_an_app_of_an_unprofiled_model_is_re_split_once_its_profile_is_learnt() -> None:
    plans = _cluster(_app("harpagon")).app_graphs()
    tables = {m: [1e-3 * (a * b + c) for b in range(1, 17)] for m, (a, c) in MODELS.items()}
    splits = AppSplits(plans, {**tables, "cls": None}, frontends=1, overhead_s=OVERHEAD_S)
    assert splits.weights["pipe"] == {"detect": 1.0, "classify": 1.0, "track": 1.0}
    splits.start(0.0)

    def period(at: float) -> list[str]:
        for model, count in (("det", 100), ("cls", 200), ("trk", 200)):
            for _ in range(count):
                splits.note(model)
        return splits.on_timer(at)

    assert period(PERIOD_S) == []  # nothing to weigh the rates against: kept
    splits.learn("cls", tables["cls"])
    assert period(2 * PERIOD_S) == ["pipe"] and splits.splitter_used["pipe"]
    assert splits.weights["pipe"]["classify"] != 1.0
