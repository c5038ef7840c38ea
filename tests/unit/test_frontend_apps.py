"""Apps driven by the real FrontendCore on a virtual clock: stage deadlines from the SLO split,
fan-out, slack passed on, outputs chained through the emulated executor's real arithmetic, one
answer per app request, and a failing stage's typed error naming it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zserve.backends.emulated import EmulatedExecutor, EmulatedModel
from zserve.config.apps import DEFAULT_CLIENT_ALLOWANCE_MS
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.core.hosting import Outbox
from zserve.frontend.apps import APP_CLIENT
from zserve.frontend.core import TO_SHARD, FrontendCore
from zserve.frontend.metrics import cluster_families
from zserve.transport.messages import (
    BatchFailed,
    BatchOutputs,
    CancelRequest,
    InferError,
    InferReply,
    InferRequest,
    InputFetch,
    InputReply,
    RequestMetaBatch,
)

CLIENT = b"client-1"
APP_SLO_MS = 100.0
REPLY_ALLOWANCE_S = 0.003
JITTER_S = 0.001
# What every stage's share adds to its part of the time the stages use: only the last stage's
# reply uses the allowance, and each batch is planned to end the jitter before its deadline.
OVERHEAD_S = REPLY_ALLOWANCE_S + JITTER_S
# The app's default client allowance: the stages share the SLO less it (the client's side of
# the call is outside the frontend's clock).
CLIENT_ALLOWANCE_S = DEFAULT_CLIENT_ALLOWANCE_MS / 1e3
STAGES_SLO_S = APP_SLO_MS / 1e3 - CLIENT_ALLOWANCE_S
# l(1) of each stage's model, ms: the split gives stage k a share l_k / (sum of l on the rest).
L1_MS = {"det": 10.0, "cls": 20.0, "trk": 10.0}
SHAPES = {"det": [4], "cls": [4], "trk": [1]}  # output shapes: each chains into the next's x


def _cluster(fan_out: int = 2) -> ClusterConfig:
    models = [{"name": name, "emulated": {"alpha_ms": 0.0, "beta_ms": l1, "input_shape": [4],
                                          "output_shape": SHAPES[name]},
               "slo_ms": 1000.0, "max_batch": 8}
              for name, l1 in L1_MS.items()]
    app = {"name": "pipe", "slo_ms": APP_SLO_MS, "stages": [
        {"name": "detect", "model": "det", "inputs": {"x": "app.image"}},
        {"name": "classify", "model": "cls", "after": {"detect": fan_out},
         "inputs": {"x": "detect.y"}},
        {"name": "track", "model": "trk", "after": {"classify": 1},
         "inputs": {"x": "classify.y"}}]}
    return parse_config({"backends": {"count": 1, "device": "emulated"},
                         "frontends": {"reply_allowance_ms": REPLY_ALLOWANCE_S * 1e3},
                         "scheduler": {"jitter_ms": JITTER_S * 1e3},
                         "models": models, "apps": [app]})


class _Harness:
    """A FrontendCore with the scheduler's and a backend's side played by hand: each stage
    request's metadata is read from the tick, and its outputs are the emulated executor's."""

    def __init__(self, fan_out: int = 2, cluster: ClusterConfig | None = None) -> None:
        cluster = _cluster(fan_out) if cluster is None else cluster
        self.core = FrontendCore(name="frontend-0", cluster=cluster, index=0,
                                 data_address="ipc://data", profiles={})
        self.executor = EmulatedExecutor([EmulatedModel.from_config(m) for m in cluster.models])
        self.answers: list[Any] = []
        self.deadlines: dict[int, tuple[str, float]] = {}  # queued rid -> model, deadline

    def submit(self, now: float, request_id: int, inputs: dict[str, Any] | None = None) -> None:
        image = {"image": np.full((1, 4), 1.0, np.float32)} if inputs is None else inputs
        self._run(lambda outbox: self.core.on_client_message(
            now, CLIENT, InferRequest(request_id, "pipe", image), outbox))

    def _run(self, call: Any) -> None:
        outbox: Outbox = []
        call(outbox)
        self.core.end_tick(outbox)
        for destination, msg in outbox:
            if destination[0] == TO_SHARD and isinstance(msg, RequestMetaBatch):
                for rid, model, deadline in zip(msg.request_ids, msg.models, msg.deadlines,
                                                strict=True):
                    self.deadlines[rid] = (model, deadline)
            elif isinstance(msg, InferReply | InferError):
                assert destination == ("client", CLIENT)
                self.answers.append(msg)

    def finish(self, now: float, model: str | None = None) -> list[int]:
        """Run every queued request (of ``model``) to completion at ``now``; the ids of those
        whose inputs the frontend still held (the others were answered or withdrawn)."""
        rids = [rid for rid, (m, _) in self.deadlines.items() if model in {None, m}]
        ran: list[int] = []
        for rid in rids:
            model_of = self.deadlines.pop(rid)[0]
            outbox: Outbox = []
            self.core.on_fetch(now, "backend-0", InputFetch(rid, [rid]), outbox)
            reply = outbox[0][1]
            assert isinstance(reply, InputReply)
            inputs = reply.inputs
            if not inputs:
                continue
            ran.append(rid)
            outputs = [self.executor.expected_outputs(model_of, i) for i in inputs]
            self._run(lambda o, r=rid, out=outputs: self.core.on_outputs(
                now, BatchOutputs(r, [r], out), o))
        return ran

    def timer(self, now: float) -> None:
        self._run(lambda outbox: self.core.on_timer(now, outbox))


def _stage_deadlines(h: _Harness, model: str) -> list[float]:
    return [d for m, d in h.deadlines.values() if m == model]


def test_a_three_stage_app_chains_outputs_with_fan_out_and_answers_once() -> None:
    h = _Harness(fan_out=2)
    h.submit(0.0, 7)
    assert [m for m, _ in h.deadlines.values()] == ["det"]
    h.finish(0.010, "det")
    assert sorted(m for m, _ in h.deadlines.values()) == ["cls", "cls"]  # fan-out 2
    h.finish(0.030, "cls")
    assert len(_stage_deadlines(h, "trk")) == 2
    h.finish(0.040, "trk")
    assert len(h.answers) == 1 and isinstance(h.answers[0], InferReply)
    reply = h.answers[0]
    assert reply.request_id == 7
    # What the three models compute, one after the other, client-side.
    x = np.full((1, 4), 1.0, np.float32)
    for model in ("det", "cls", "trk"):
        x = h.executor.expected_outputs(model, {"x": x})["y"]
    np.testing.assert_array_equal(reply.outputs["y"], np.concatenate([x, x]))
    assert not h.core.pending and h.core.apps.in_flight == 0
    assert h.core.stats()["counters"]["app_replied"] == 1  # stage requests count apart
    # and the Prometheus endpoint reads them
    families = {f.name: f for f in cluster_families("frontend-0", h.core.stats(),
                                                    frozenset(L1_MS))}
    steps = {s.labels["step"]: s.value for s in families["zserve_app_requests"].samples}
    assert steps["received"] == steps["admitted"] == steps["replied"] == 1
    assert steps["failed"] == steps["rejected"] == 0


def test_each_stage_gets_its_share_of_the_slo_and_early_finish_passes_slack_on() -> None:
    h = _Harness(fan_out=1)
    h.submit(0.0, 1)
    answer_by = STAGES_SLO_S  # the SLO less the client allowance
    # detect: 10 / (10 + 20 + 10) of that less the overhead, plus the overhead (less the
    # reply allowance: the scheduler's deadline).
    (det,) = _stage_deadlines(h, "det")
    assert det == pytest.approx(OVERHEAD_S + (answer_by - OVERHEAD_S) * 10 / 40
                                - REPLY_ALLOWANCE_S)
    h.finish(0.005, "det")  # 20 ms before its deadline
    (cls,) = _stage_deadlines(h, "cls")
    assert cls == pytest.approx(0.005 + OVERHEAD_S + (answer_by - 0.005 - OVERHEAD_S) * 20 / 30
                                - REPLY_ALLOWANCE_S)
    budget_s = cls + REPLY_ALLOWANCE_S - 0.005
    # more than its static share: detect's slack
    assert budget_s > OVERHEAD_S + (answer_by - OVERHEAD_S) * 20 / 40
    h.finish(0.020, "cls")
    (trk,) = _stage_deadlines(h, "trk")  # the last stage gets all that is left
    assert trk == pytest.approx(answer_by - REPLY_ALLOWANCE_S)
    # ... and the client's side of the call keeps its allowance before the client's SLO
    assert trk + REPLY_ALLOWANCE_S + CLIENT_ALLOWANCE_S == pytest.approx(APP_SLO_MS / 1e3)


def test_a_stage_that_misses_its_deadline_fails_the_app_once_naming_the_stage() -> None:
    """A stage request with no answer is answered DEADLINE by the frontend's timer at the app's
    answer-by (not at its own deadline: a stage answered late still serves its app), and the
    app fails once, naming the stage."""
    h = _Harness(fan_out=3)
    h.submit(0.0, 3)
    h.finish(0.010, "det")
    assert len(_stage_deadlines(h, "cls")) == 3
    # classify's share: 0.01 + o + (left - o) * 20 / 30, left = what the stages share less the
    # 10 ms detect took; its deadline passes with the app still waiting ...
    left = STAGES_SLO_S - 0.010
    h.timer(0.010 + OVERHEAD_S + (left - OVERHEAD_S) * 20 / 30 + 0.001)
    assert h.answers == []
    # ... until the app's own answer-by, where its three instances fail it once.
    h.timer(STAGES_SLO_S - 0.0001)
    assert h.answers == []
    h.timer(STAGES_SLO_S + 0.0001)
    assert len(h.answers) == 1
    error = h.answers[0]
    assert isinstance(error, InferError) and error.request_id == 3
    assert error.error == "DEADLINE" and "stage 'classify'" in error.message
    h.finish(0.2)  # nothing runs: the stage requests were answered
    assert len(h.answers) == 1 and not h.core.pending
    assert h.core.apps.counters["app_failed"] == 1


def test_a_stage_answered_past_its_deadline_still_serves_its_app() -> None:
    """detect's outputs come 10 ms past its deadline (a batch a host stall made late): the next
    stages get what is left of the app's SLO, and the app is answered with outputs."""
    h = _Harness(fan_out=1)
    h.submit(0.0, 5)
    (det,) = _stage_deadlines(h, "det")
    h.timer(det + REPLY_ALLOWANCE_S + 0.005)  # past the stage's own answer-by: still waiting
    assert h.answers == []
    h.finish(det + REPLY_ALLOWANCE_S + 0.010, "det")
    assert h.answers == [] and len(_stage_deadlines(h, "cls")) == 1
    h.finish(0.060, "cls")
    h.finish(0.070, "trk")
    assert len(h.answers) == 1 and isinstance(h.answers[0], InferReply)
    assert h.core.apps.counters["app_replied"] == 1 and not h.core.pending


def test_siblings_of_a_failed_stage_instance_are_withdrawn() -> None:
    h = _Harness(fan_out=2)
    h.submit(0.0, 4)
    h.finish(0.010, "det")
    first, _ = [rid for rid, (m, _) in h.deadlines.items() if m == "cls"]
    outbox: Outbox = []
    h.core.on_fetch(0.011, "backend-0", InputFetch(1, [first]), outbox)
    h._run(lambda o: h.core.on_batch_failed(0.012, BatchFailed(
        1, [first], "BACKEND_FAILED", "the device fell off the bus"), o))
    assert len(h.answers) == 1 and h.answers[0].error == "BACKEND_FAILED"
    assert "stage 'classify'" in h.answers[0].message
    assert not h.core.pending  # the other classify request was withdrawn, unanswered


def test_cancel_disconnect_and_bad_inputs_each_end_an_app_request_once() -> None:
    h = _Harness()
    h.submit(0.0, 1)
    h._run(lambda o: h.core.on_client_message(0.001, CLIENT, CancelRequest(1), o))
    assert [a.error for a in h.answers] == ["CANCELLED"]
    assert not h.core.pending
    h.submit(0.002, 2, {"picture": np.zeros((1, 4), np.float32)})
    assert h.answers[-1].error == "BAD_REQUEST" and "image" in h.answers[-1].message
    h.submit(0.003, 3)
    h.core.client_gone(CLIENT)
    h._run(lambda o: None)
    assert not h.core.pending and h.core.apps.in_flight == 0
    assert h.finish(0.01) == [] and len(h.answers) == 2
    assert APP_CLIENT not in h.core.requests.by_client


def test_a_join_stage_waits_for_every_stage_it_follows() -> None:
    models = [{"name": name, "emulated": {"alpha_ms": 0.0, "beta_ms": 5.0, "output_shape": [4]}}
              for name in ("m1", "m2", "m3", "m4")]
    stages = [{"name": "src", "model": "m1", "inputs": {"x": "app.image"}},
              {"name": "left", "model": "m2", "after": {"src": 1}, "inputs": {"x": "src.y"}},
              {"name": "right", "model": "m3", "after": {"src": 1}, "inputs": {"x": "src.y"}},
              {"name": "join", "model": "m4", "after": {"left": 1, "right": 1},
               "inputs": {"x": "right.y"}}]
    h = _Harness(cluster=parse_config({
        "backends": {"count": 1, "device": "emulated"}, "models": models,
        "frontends": {"reply_allowance_ms": REPLY_ALLOWANCE_S * 1e3},
        "scheduler": {"jitter_ms": JITTER_S * 1e3},
        "apps": [{"name": "pipe", "slo_ms": 100.0, "stages": stages}]}))
    h.submit(0.0, 1)
    h.finish(0.005, "m1")
    assert sorted(m for m, _ in h.deadlines.values()) == ["m2", "m3"]
    # Both branches weigh 5 ms: each gets 5 / (5 + 5) of what is left, as does the join after.
    (left,) = _stage_deadlines(h, "m2")
    assert left == pytest.approx(0.005 + OVERHEAD_S + (STAGES_SLO_S - 0.005 - OVERHEAD_S) / 2
                                 - REPLY_ALLOWANCE_S)
    h.finish(0.010, "m3")
    assert _stage_deadlines(h, "m4") == []  # still waiting for the left branch
    h.finish(0.020, "m2")
    assert len(_stage_deadlines(h, "m4")) == 1
    h.finish(0.030, "m4")
    assert len(h.answers) == 1 and isinstance(h.answers[0], InferReply)
