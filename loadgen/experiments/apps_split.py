"""The apps' SLO splitters compared: which one ``[[apps]] splitter`` defaults to, and why.

Two measures, on an app with uneven stage costs and a skewed fan-out (``SKEWED_MODELS``: a
detector whose batch of one costs as much as twelve more requests, four classify requests per
detection, a light tracker):

- **replay** (deterministic, any host): the real ``AppDriver`` plays one app request on a
  virtual clock with each splitter's weights at the stages' steady rates (the rates the frontend
  measures in a period: app rate x instances per request); each stage answers when the deferred
  scheduler would finish it (its scheduler deadline less ``jitter``). Each stage's time to run
  then gives the GPU time a second its rate needs at the largest batch that fits it
  (``zserve.frontend.app_split.batch_cost``, d_ctrl and d_data counted), and the
  **capacity** is the highest app rate on a grid whose GPU time fits the cluster's GPUs.
- **live** (the full run only): the app on the same two emulated GPUs at ``LIVE_RATE_RPS``,
  each splitter in turn, re-split every ``LIVE_RESPLIT_EVERY_S``: the fraction answered late or
  with an error.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Sequence
from typing import Any

import numpy as np

from zserve.config.apps import DEFAULT_SPLITTER, SPLITTERS, AppGraph
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.core.errors import ErrorKind
from zserve.core.hosting import Outbox
from zserve.frontend.app_split import (
    batch_cost,
    latency_tables_s,
    scheduling_allowances_s,
    split_weights,
    with_allowances,
)
from zserve.frontend.apps import AppDriver
from zserve.loadgen.experiments import apps as pipeline
from zserve.loadgen.experiments.common import Check, Options, Table
from zserve.transport.messages import InferRequest

SPLITTER_NAMES = SPLITTERS
# (model, alpha ms, beta ms, output shape), as apps.MODELS; classify runs FAN_OUT per detection.
SKEWED_MODELS = (("detector", 0.5, 12.0, 4), ("classifier", 0.5, 3.0, 4),
                 ("tracker", 0.2, 1.0, 1))
SKEWED_FAN_OUT = 4
REPLAY_STEP_RPS = 10.0
# The default must replay at least this fraction of the best splitter's capacity on each app
# (nexus, the best on the skewed app, refuses an app with a join: it cannot be the default).
DEFAULT_CAPACITY_FRACTION = 0.85
REPLAY_RATES_RPS = tuple(REPLAY_STEP_RPS * k for k in range(1, 41))
LIVE_RATE_RPS = 80.0
LIVE_DURATION_S = 12.0
LIVE_RESPLIT_EVERY_S = 2.0


class _Recorder:
    """The driver's sink: the stage requests it submits, answers recorded."""

    def __init__(self) -> None:
        self.submitted: list[tuple[float, InferRequest]] = []
        self.answered = False

    def submit_stage(self, now: float, stage: InferRequest, outbox: Outbox, *,
                     expire_at: float) -> None:
        self.submitted.append((now, stage))

    def cancel_stage(self, stage_rid: int) -> None:
        raise AssertionError("a replayed app request cancels nothing")

    def answer_app(self, client: bytes, client_rid: int, outputs: dict[str, Any] | None,
                   error: tuple[ErrorKind, str] | None, outbox: Outbox) -> None:
        assert error is None, error
        self.answered = True


def replay_budgets_s(plan: AppGraph, weights: dict[str, float], reply_allowance_s: float,
                     jitter_s: float) -> dict[str, float]:
    """Each stage's time to run in one app request played through the real ``AppDriver``:
    from its start to when the deferred scheduler plans its batch to end (``jitter`` before its
    scheduler deadline, which is the reply allowance before the stage's), when it answers."""
    sink = _Recorder()
    driver = AppDriver({plan.name: plan}, {plan.name: weights}, sink,
                       overhead_s=reply_allowance_s + jitter_s)
    wanted = {source.partition(".")[2] for stage in plan.stages.values()
              for source in stage.inputs.values() if source.startswith("app.")}
    driver.on_infer(0.0, b"replay", InferRequest(
        0, plan.name, {name: np.zeros((1, 1), np.float32) for name in wanted}), [])
    model_stage = {plan.stages[s].model: s for s in plan.order}
    budgets: dict[str, float] = {}
    while sink.submitted:
        now, stage = sink.submitted.pop(0)
        budget_s = stage.slo_ms / 1e3 - reply_allowance_s - jitter_s
        name = model_stage[stage.model]
        budgets[name] = min(budgets.get(name, budget_s), budget_s)
        outputs = {out.partition(".")[2]: np.zeros((1, 1), np.float32)
                   for s in plan.order for out in plan.stages[s].inputs.values()}
        driver.on_stage_outputs(now + budget_s, stage.request_id,
                                {**outputs, "y": np.zeros((1, 1), np.float32)}, [])
    assert sink.answered
    return budgets


def gpu_time(config: ClusterConfig, app: str, rate_rps: float) -> tuple[float, dict[str, float]]:
    """GPU seconds a second that ``app`` at ``rate_rps`` needs under its splitter (inf when a
    stage's budget fits not even a batch of one), and each stage's scheduler budget (ms)."""
    plan = config.app_graphs()[app]
    latency, delays = latency_tables_s(config, {}), scheduling_allowances_s(config)
    tables = {s: latency[plan.stages[s].model] or [1.0] for s in plan.order}
    delay = {s: delays[plan.stages[s].model] for s in plan.order}
    rates = {s: rate_rps * plan.count[s] for s in plan.order}
    allowance_s, jitter_s = (config.frontends.reply_allowance_ms / 1e3,
                             config.scheduler.jitter_ms / 1e3)
    weights, _ = split_weights(plan, tables, rates, allowance_s + jitter_s, delay)
    budgets = replay_budgets_s(plan, weights, allowance_s, jitter_s)
    total = sum(batch_cost(with_allowances(tables[s], delay[s]), rates[s], budgets[s])
                for s in plan.order)
    return total, {s: round(1e3 * b, 1) for s, b in budgets.items()}


def capacity_rps(config: ClusterConfig, app: str, gpus: int,
                 rates: Sequence[float] = REPLAY_RATES_RPS) -> float:
    """The highest rate of ``rates`` whose GPU time fits ``gpus`` (0 when none does)."""
    return max((r for r in rates if gpu_time(config, app, r)[0] <= gpus), default=0.0)


VARIANTS = (("pipeline", pipeline.MODELS, pipeline.FAN_OUT),
            ("skewed", SKEWED_MODELS, SKEWED_FAN_OUT))
TABLE_RATES_RPS = (20.0, 60.0, 120.0)


def _config(models: pipeline.Models, fan_out: int, splitter: str,
            resplit_every_s: float | None = None) -> tuple[str, ClusterConfig]:
    toml = pipeline.apps_cluster_toml(models, fan_out, splitter, resplit_every_s)
    return toml, parse_config(tomllib.loads(toml))


def replay_table() -> tuple[Table, dict[str, dict[str, float]]]:
    """GPU time and capacity of each splitter on each app (module docstring, "replay")."""
    table = Table(f"SLO splitters replayed through the AppDriver: GPU s/s the stages need at "
                  f"each app rate, the capacity on {pipeline.GPUS} GPUs (grid "
                  f"{REPLAY_RATES_RPS[0]:g}-{REPLAY_RATES_RPS[-1]:g} r/s) and each stage's "
                  f"time to run at {TABLE_RATES_RPS[1]:g} r/s",
                  ["app", "splitter", *(f"GPU s/s @{r:g}" for r in TABLE_RATES_RPS),
                   "capacity r/s", "detect/classify/track ms"])
    capacity: dict[str, dict[str, float]] = {}
    for label, models, fan_out in VARIANTS:
        for splitter in SPLITTER_NAMES:
            _, config = _config(models, fan_out, splitter)
            need = [gpu_time(config, pipeline.APP, r)[0] for r in TABLE_RATES_RPS]
            budgets = gpu_time(config, pipeline.APP, TABLE_RATES_RPS[1])[1]
            cap = capacity_rps(config, pipeline.APP, pipeline.GPUS)
            capacity.setdefault(label, {})[splitter] = cap
            table.rows.append([f"{label} (fan-out {fan_out})", splitter, *need, cap,
                               "/".join(f"{budgets[s]:g}" for s in ("detect", "classify",
                                                                    "track"))])
    return table, capacity


def live_table(opts: Options) -> tuple[Table, dict[str, Any]]:
    """The skewed app live, each splitter in turn (module docstring, "live")."""
    rate = LIVE_RATE_RPS
    table = Table(f"the skewed app (fan-out {SKEWED_FAN_OUT}) live on {pipeline.GPUS} emulated "
                  f"GPUs, Poisson {rate:g} r/s for {LIVE_DURATION_S:g} s per splitter, "
                  f"re-split every {LIVE_RESPLIT_EVERY_S:g} s",
                  ["splitter", "sent", "answered", "errors", "wrong outputs", "bad", "bad %",
                   "p50 ms", "p99 ms", "load avg"])
    points: dict[str, Any] = {}
    for splitter in SPLITTER_NAMES:
        toml, _ = _config(SKEWED_MODELS, SKEWED_FAN_OUT, splitter, LIVE_RESPLIT_EVERY_S)
        opts.say(f"apps: the skewed app live with splitter {splitter!r} at {rate:g} r/s")
        run = pipeline.measure(rate, LIVE_DURATION_S, toml, SKEWED_MODELS, SKEWED_FAN_OUT)
        bad = pipeline.bad_count(run)
        latencies = run["latencies_s"]
        table.rows.append([splitter, run["sent"], len(latencies) + len(run["errors"]),
                           len(run["errors"]), run["wrong"], bad,
                           round(100.0 * bad / max(run["sent"], 1), 1),
                           pipeline.percentile_ms(latencies, 0.5),
                           pipeline.percentile_ms(latencies, 0.99),
                           round(os.getloadavg()[0], 1)])
        points[splitter] = {"sent": run["sent"], "bad": bad, "wrong": run["wrong"],
                            "answered": len(latencies) + len(run["errors"]),
                            "errors": sorted(set(run["errors"]))[:5]}
    return table, points


def compare_splitters(opts: Options) -> tuple[list[Table], list[Check], dict[str, Any]]:
    """The replay always; the live comparison in the full run (``--quick`` skips it)."""
    replay, capacity = replay_table()
    checks = [Check(f"the default splitter ({DEFAULT_SPLITTER!r}) replays within "
                    f"{1 - DEFAULT_CAPACITY_FRACTION:.0%} of the best capacity on each app",
                    all(caps[DEFAULT_SPLITTER] >= DEFAULT_CAPACITY_FRACTION * max(caps.values())
                        for caps in capacity.values()),
                    "; ".join(f"{app}: " + ", ".join(f"{k} {v:g} r/s" for k, v in caps.items())
                              for app, caps in capacity.items()))]
    points: dict[str, Any] = {"capacity_rps": capacity}
    tables = [replay]
    if not opts.quick:
        live, points["live"] = live_table(opts)
        tables.append(live)
        checks.append(Check("the skewed app live: every request answered once, right outputs",
                            all(p["answered"] == p["sent"] and not p["wrong"]
                                for p in points["live"].values()),
                            "; ".join(f"{k}: {p['answered']} of {p['sent']}, {p['wrong']} "
                                      "wrong" for k, p in points["live"].items())))
    return tables, checks, points


__all__ = ["DEFAULT_SPLITTER", "LIVE_DURATION_S", "LIVE_RATE_RPS", "LIVE_RESPLIT_EVERY_S",
           "REPLAY_RATES_RPS", "SKEWED_FAN_OUT", "SKEWED_MODELS", "SPLITTER_NAMES", "capacity_rps",
           "compare_splitters", "gpu_time", "live_table", "replay_budgets_s", "replay_table"]
