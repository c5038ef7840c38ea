"""The frontend's application driver: one app request in, its DAG of stage requests, one answer.

Pure (no I/O, no clock): ``FrontendCore`` composes one ``AppDriver`` and is its ``StageSink``.
An app request (a client's ``InferRequest`` naming an ``[[apps]]`` app) is admitted once here;
each stage instance becomes an internal request of the core, admitted under the reserved client
``APP_CLIENT`` with a request id of this driver's, so the scheduler and backends see an ordinary
request of the stage's model. When a stage instance answers, its outputs become the inputs of the
stage instances that follow it (a fan-out f gives the downstream stage f requests per upstream
answer; instance i of a stage takes instance i // f of each stage it follows), without a round
trip to the client. The app request ends with exactly one answer: the last stage's outputs (its
instances' outputs joined along the batch dimension), or the first failing stage's typed error
naming that stage; the other stage requests still in flight are then cancelled.

Deadlines: the app's ``answer_by`` is its admission plus its SLO less the app's client allowance
(the client's side of the call, outside the frontend's clock); a stage instance submitted at
``now`` gets ``(answer_by - now - o) * w / W + o``
where ``w`` is its stage's weight, ``W`` the heaviest weighted path from it to the app's last
stage and ``o`` the stage overhead (the reply allowance and the scheduler's jitter: a stage's
batch is planned to end that much before its deadline, and only the last stage's reply uses the
allowance), so the time the stages use is split by weight, a stage that finishes early passes
its slack on and the last stage gets all that is left. The weights are the app's splitter's
(``zserve.frontend.app_split``, which the core re-runs every period from the measured rates and
hands here with ``set_split``); a run keeps the weights it was admitted under. A stage request's
deadline is its share, but the frontend waits for its outputs until the app's own answer-by: a
stage answered late (a batch a host stall delayed) leaves the next stages less, not the app failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from zserve.config.apps import APP_INPUT, AppGraph
from zserve.config.signature import named_list
from zserve.core.errors import ErrorKind
from zserve.core.hosting import Outbox
from zserve.transport.messages import InferRequest

# The client identity the core admits stage requests under (never a ZeroMQ peer's: those are
# five bytes, and the OIP bridge's is another name).
APP_CLIENT = b"\x00zserve-app-stages"

APP_COUNTERS = ("app_received", "app_admitted", "app_replied", "app_failed", "app_rejected",
                "app_cancelled", "app_abandoned")
"""App requests received, admitted, answered with outputs or a stage's error, refused, cancelled
by their client and abandoned (its connection closed). Each stage request is also counted as a
model request in the core's own counters (``received``, ``replied``, ``error_<KIND>``, ...)."""


class StageSink(Protocol):
    """What the driver asks of the core it is composed into."""

    def submit_stage(self, now: float, stage: InferRequest, outbox: Outbox, *,
                     expire_at: float) -> None: ...

    def cancel_stage(self, stage_rid: int) -> None: ...

    def answer_app(self, client: bytes, client_rid: int, outputs: dict[str, Any] | None,
                   error: tuple[ErrorKind, str] | None, outbox: Outbox) -> None: ...


class _Run:
    """One admitted app request: its inputs, each stage instance's outputs, its live stage
    requests."""

    __slots__ = ("admitted", "answer_by", "client", "client_rid", "done", "inputs", "live",
                 "outputs", "path", "plan", "weight")

    def __init__(self, plan: AppGraph, client: bytes, client_rid: int, inputs: dict[str, Any],
                 *, answer_by: float, admitted: float,
                 split: tuple[dict[str, float], dict[str, float]]) -> None:
        self.plan = plan
        self.weight, self.path = split  # the app's split when it was admitted
        self.client = client
        self.client_rid = client_rid
        self.inputs = inputs
        self.answer_by = answer_by
        self.admitted = admitted
        self.outputs: dict[str, list[dict[str, Any] | None]] = {
            name: [None] * plan.count[name] for name in plan.order}
        self.live: set[int] = set()  # stage request ids in flight
        self.done = False


class AppDriver:
    """Every app request in flight at one frontend; see the module docstring."""

    def __init__(self, plans: Mapping[str, AppGraph], weights: Mapping[str, Mapping[str, float]],
                 sink: StageSink, *, overhead_s: float = 0.0,
                 counters: dict[str, int] | None = None,
                 observe_answered: Callable[[float], None] | None = None) -> None:
        """``weights``: each app's stages' weights (``zserve.frontend.app_split``);
        ``overhead_s``: each stage's overhead (module docstring); ``counters``: where
        ``APP_COUNTERS`` are counted (the core's, so they reach its stats);
        ``observe_answered``: given each app request's admission -> answer (s) when it is
        answered with outputs."""
        self.plans = dict(plans)
        self.overhead_s = overhead_s
        self.names = frozenset(plans)
        self.sink = sink
        self.counters = dict.fromkeys(APP_COUNTERS, 0) if counters is None else counters
        self.observe_answered = observe_answered
        self._split: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
        for plan in self.plans.values():
            self.set_split(plan.name, weights[plan.name])
        self._runs: dict[bytes, dict[int, _Run]] = {}  # client -> its request id -> run
        self._stage_of: dict[int, tuple[_Run, str, int]] = {}  # stage rid -> run, stage, instance
        self._next_rid = 0
        self._owed_cancels: list[int] = []

    def set_split(self, app: str, weights: Mapping[str, float]) -> None:
        """``app``'s stages' weights from now on (requests admitted before keep theirs); with
        each stage, the heaviest weighted path from it to the end."""
        plan = self.plans[app]
        weight = {s: max(float(weights[s]), 1e-9) for s in plan.order}
        path: dict[str, float] = {}
        for stage in reversed(plan.order):
            path[stage] = weight[stage] + max((path[d] for d in plan.next[stage]), default=0.0)
        self._split[app] = (weight, path)

    def budget_s(self, app: str, stage: str, remaining_s: float) -> float:
        """The share of ``remaining_s`` that ``stage`` of ``app`` gets when it starts now."""
        weight, path = self._split[app]
        return self._share(remaining_s, weight[stage] / path[stage])

    def _share(self, remaining_s: float, fraction: float) -> float:
        """``fraction`` of the time the stages use (``remaining_s`` less the overhead), plus
        the overhead; never past the app's answer."""
        overhead_s = self.overhead_s
        return min(remaining_s, max(remaining_s - overhead_s, 0.0) * fraction + overhead_s)

    @property
    def in_flight(self) -> int:
        return sum(len(runs) for runs in self._runs.values())

    # ------------------------------------------------------------------ app requests

    def on_infer(self, now: float, client: bytes, req: InferRequest, outbox: Outbox) -> None:
        """Admit one app request and submit its first stages (or answer why not)."""
        self.counters["app_received"] += 1
        plan = self.plans[req.model]
        refusal = self._refusal(plan, client, req)
        if refusal is not None:
            self.counters["app_rejected"] += 1
            self.sink.answer_app(client, req.request_id, None,
                                 (ErrorKind.BAD_REQUEST, refusal), outbox)
            return
        slo_s = plan.slo_s if req.slo_ms <= 0 else min(plan.slo_s, req.slo_ms / 1e3)
        # the client's side of the call (its parse before now, the answer's way back) is
        # outside this clock: the stages share what it leaves
        run = _Run(plan, client, req.request_id, req.inputs,
                   answer_by=now + max(slo_s - plan.client_allowance_s, 0.0),
                   admitted=now, split=self._split[plan.name])
        self._runs.setdefault(client, {})[req.request_id] = run
        self.counters["app_admitted"] += 1
        for stage in plan.order:
            if not plan.stages[stage].after and not run.done:
                self._submit(now, run, stage, 0, outbox)

    def _refusal(self, plan: AppGraph, client: bytes, req: InferRequest) -> str | None:
        if req.request_id in self._runs.get(client, {}):
            return f"request id {req.request_id} is already in flight on this connection"
        if not 0.0 <= req.slo_ms < float("inf"):
            return f"slo_ms must be >= 0, got {req.slo_ms}"
        wanted = {source.partition(".")[2] for stage in plan.stages.values()
                  for source in stage.inputs.values() if source.startswith(APP_INPUT + ".")}
        given = set(req.inputs) if isinstance(req.inputs, dict) else set()
        if given != wanted:
            return (f"app {plan.name!r} takes inputs {named_list(sorted(wanted))}, got "
                    f"{named_list(sorted(given, key=str))}")
        return None

    def _submit(self, now: float, run: _Run, stage: str, instance: int,
                outbox: Outbox) -> None:
        """Submit one stage instance with its share of what is left of the app's SLO."""
        plan = run.plan
        config = plan.stages[stage]
        budget_s = self._share(run.answer_by - now, run.weight[stage] / run.path[stage])
        if budget_s <= 0.0:
            self._fail(run, stage, ErrorKind.DEADLINE, "no time left of the app's SLO",
                       outbox)
            return
        inputs: dict[str, Any] = {}
        for name, source in config.inputs.items():
            origin, _, tensor = source.partition(".")
            if origin == APP_INPUT:
                inputs[name] = run.inputs[tensor]
            else:
                upstream = run.outputs[origin][instance // config.after[origin]]
                assert upstream is not None  # submitted once every upstream instance answered
                inputs[name] = upstream[tensor]
        rid = self._next_rid
        self._next_rid += 1
        self._stage_of[rid] = (run, stage, instance)
        run.live.add(rid)
        # The stage's deadline is its share; its outputs are still taken until the app's own
        # answer-by (a batch a host stall made late leaves the next stages less, not nothing).
        self.sink.submit_stage(now, InferRequest(rid, config.model, inputs, budget_s * 1e3), outbox,
                               expire_at=run.answer_by)

    # ------------------------------------------------------------------ stage answers

    def on_stage_outputs(self, now: float, stage_rid: int, outputs: dict[str, Any],
                         outbox: Outbox) -> None:
        """A stage instance answered: start what it unblocks, or answer the app."""
        found = self._stage_of.pop(stage_rid, None)
        if found is None:
            return
        run, stage, instance = found
        run.live.discard(stage_rid)
        if run.done:
            return
        plan = run.plan
        run.outputs[stage][instance] = outputs
        if stage == plan.last:
            if all(o is not None for o in run.outputs[stage]):
                if self.observe_answered is not None:
                    self.observe_answered(now - run.admitted)
                self._answer(run, outbox)
            return
        for downstream in plan.next[stage]:
            fan_out = plan.stages[downstream].after[stage]
            for j in range(instance * fan_out, (instance + 1) * fan_out):
                if not run.done and self._ready(run, downstream, j):
                    self._submit(now, run, downstream, j, outbox)

    @staticmethod
    def _ready(run: _Run, stage: str, instance: int) -> bool:
        after = run.plan.stages[stage].after
        return all(run.outputs[up][instance // fan] is not None for up, fan in after.items())

    def on_stage_error(self, stage_rid: int, kind: ErrorKind, message: str,
                       outbox: Outbox) -> None:
        """A stage instance failed: the app request fails with its error, naming the stage."""
        found = self._stage_of.pop(stage_rid, None)
        if found is None:
            return
        run, stage, _ = found
        run.live.discard(stage_rid)
        if not run.done:
            self._fail(run, stage, kind, message, outbox)

    def _answer(self, run: _Run, outbox: Outbox) -> None:
        parts = [o for o in run.outputs[run.plan.last] if o is not None]
        outputs = parts[0] if len(parts) == 1 else {
            name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        self._end(run)
        self.counters["app_replied"] += 1
        self.sink.answer_app(run.client, run.client_rid, outputs, None, outbox)

    def _fail(self, run: _Run, stage: str, kind: ErrorKind, message: str,
              outbox: Outbox) -> None:
        """Answer the app with ``stage``'s error kind, the message naming the stage."""
        model = run.plan.stages[stage].model
        self._end(run)
        self.counters["app_failed"] += 1
        self.sink.answer_app(run.client, run.client_rid, None, (kind, (
            f"app {run.plan.name!r} stage {stage!r} (model {model!r}) failed: {message}")),
            outbox)

    def _end(self, run: _Run) -> None:
        """Forget ``run``; its stage requests still in flight are cancelled (at the end of the
        core's tick: never from inside a loop of the core over its requests)."""
        run.done = True
        runs = self._runs.get(run.client)
        if runs is not None and runs.get(run.client_rid) is run:
            del runs[run.client_rid]
            if not runs:
                del self._runs[run.client]
        for rid in run.live:
            self._stage_of.pop(rid, None)
            self._owed_cancels.append(rid)
        run.live.clear()

    # ------------------------------------------------------------------ cancellations

    def on_cancel(self, client: bytes, client_rid: int, outbox: Outbox) -> bool:
        """The client cancels app request ``client_rid`` (answered ``CANCELLED``; True), or
        with ``client_rid`` < 0 abandons every app request it has (unanswered; False, so that
        the core cancels its model requests too)."""
        runs = self._runs.get(client)
        if not runs:
            return False
        if client_rid < 0:
            self.client_gone(client)
            return False
        run = runs.get(client_rid)
        if run is None:
            return False
        self._end(run)
        self.counters["app_cancelled"] += 1
        self.sink.answer_app(client, client_rid, None,
                             (ErrorKind.CANCELLED, "cancelled by the client"), outbox)
        return True

    def client_gone(self, client: bytes) -> None:
        """``client``'s connection closed: its app requests end unanswered."""
        for run in list(self._runs.get(client, {}).values()):
            self.counters["app_abandoned"] += 1
            self._end(run)

    def take_cancels(self) -> list[int]:
        """The stage requests to withdraw (their app has its answer), once each."""
        owed, self._owed_cancels = self._owed_cancels, []
        return owed
