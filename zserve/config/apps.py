"""``[[apps]]`` of cluster.toml: applications (DAGs of the cluster's models under one SLO).

An app names its stages; each stage runs one model of the cluster, follows the stages named in
``after`` (each with its fan-out factor: the stage runs that many requests per upstream answer),
and maps each of its model's inputs (``inputs``) from an app input (``"app.<name>"``) or an
output of a stage it follows (``"<stage>.<output>"``). An app ends in exactly one stage (one that
no stage follows): the app's answer is its outputs. ``splitter`` names how its SLO is split over
its stages, recomputed every ``resplit_every_s`` from the measured rates
(``zserve.frontend.app_split``). ``check_apps``
validates the apps against the models at load; every problem is a one-line error naming the key
path. ``AppGraph`` is the validated form the frontend drives (``zserve.frontend.apps``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from zserve.config.decode import FieldError, SchemaError, check_finite
from zserve.config.signature import ModelSignature, TensorSpec

APP_INPUT = "app"  # the source prefix naming the app's own inputs: "app.<name>"
FanOut = Annotated[int, msgspec.Meta(ge=1)]
SplitterName = Literal["proportional", "nexus", "harpagon"]
SPLITTERS: tuple[SplitterName, ...] = ("proportional", "nexus", "harpagon")
DEFAULT_SPLITTER: SplitterName = "harpagon"  # docs/apps.md, "Choosing a splitter"
DEFAULT_RESPLIT_EVERY_S = 5.0
# The part of an app's SLO kept for the client's side of the call, outside the frontend's
# clock: the request's parse before admission (HTTP/gRPC decoding), the answer's encoding and
# travel after (docs/apps.md, "How the frontend drives it"). Measured on the shared development VM
# at a load average of 7 over tritonclient HTTP: the client's latency less the frontend's
# admission -> answer (its ``app_answered``) was 1.4-1.7 ms at p50 and 3-4 ms at p99.
DEFAULT_CLIENT_ALLOWANCE_MS = 5.0


class _AppError(ValueError):
    """A problem of one app: ``key`` relative to the app's table."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class StageConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[apps.stages]]``: one stage: its model, the stages it follows with the fan-out factor
    of each edge, and where each of its model's inputs comes from."""

    name: str
    model: str
    after: dict[str, FanOut] = {}
    inputs: dict[str, str] = {}


class AppConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[apps]]``: one application: its name (clients call it like a model), its end-to-end
    SLO, its stages, the splitter of its SLO over them and how often the split is recomputed
    from the measured rates."""

    name: str
    slo_ms: float
    stages: tuple[StageConfig, ...]
    splitter: SplitterName = DEFAULT_SPLITTER
    resplit_every_s: float = DEFAULT_RESPLIT_EVERY_S
    client_allowance_ms: float = DEFAULT_CLIENT_ALLOWANCE_MS

    def __post_init__(self) -> None:
        check_finite("slo_ms", self.slo_ms, positive=True)
        check_finite("resplit_every_s", self.resplit_every_s, positive=True)
        check_finite("client_allowance_ms", self.client_allowance_ms)
        if self.client_allowance_ms >= self.slo_ms:
            raise FieldError("client_allowance_ms", f"must be below slo_ms ({self.slo_ms:g}), "
                             f"got {self.client_allowance_ms:g}")
        if not self.stages:
            raise FieldError("stages", "an app needs at least one stage")


@dataclass(frozen=True, slots=True)
class AppGraph:
    """A validated app: stages in an order where each follows the ones it names (``order``),
    each stage's instances per app request (``count``: the product of fan-outs on its way),
    the downstream stages of each (``next``), its last stage, and its signature as a model
    (inputs of its first stages, outputs of its last; None where a model's is not known at
    load)."""

    config: AppConfig
    order: tuple[str, ...]
    stages: Mapping[str, StageConfig]
    count: Mapping[str, int]
    next: Mapping[str, tuple[str, ...]]
    last: str
    signature: ModelSignature | None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def slo_s(self) -> float:
        return self.config.slo_ms / 1e3

    @property
    def client_allowance_s(self) -> float:
        """The part of the SLO the client's side of the call uses (``client_allowance_ms``)."""
        return self.config.client_allowance_ms / 1e3

    @property
    def stages_slo_s(self) -> float:
        """The part of the SLO the stages share: the SLO less the client allowance."""
        return (self.config.slo_ms - self.config.client_allowance_ms) / 1e3


def check_apps(apps: tuple[AppConfig, ...],
               models: Mapping[str, ModelSignature | None]) -> dict[str, AppGraph]:
    """Each app's plan; ``models``: each model's signature where the config fixes it (None: it
    is known once a backend loads the model). Raises ``SchemaError`` naming the key path."""
    plans: dict[str, AppGraph] = {}
    for i, app in enumerate(apps):
        if app.name in models:
            raise SchemaError(f"apps[{i}].name", f"a model is named {app.name!r} too")
        if app.name in plans:
            raise SchemaError(f"apps[{i}].name", f"duplicate app {app.name!r}")
        try:
            plans[app.name] = _plan(app, models)
        except _AppError as exc:
            raise SchemaError(f"apps[{i}].{exc.key}", exc.problem) from None
    return plans


def _plan(app: AppConfig, models: Mapping[str, ModelSignature | None]) -> AppGraph:
    stages = {s.name: s for s in app.stages}
    for j, stage in enumerate(app.stages):
        if stage.model not in models:
            raise _AppError(f"stages[{j}].model", f"unknown model {stage.model!r}")
        if list(stages).count(stage.name) != 1 or stage.name == APP_INPUT:
            raise _AppError(f"stages[{j}].name", f"duplicate or reserved name {stage.name!r}")
        for up in stage.after:
            if up not in stages:
                raise _AppError(f"stages[{j}].after.{up}", f"no stage {up!r} in this app")
    order = _topological(app)
    count = _counts(app, order)
    following = {name: tuple(s.name for s in app.stages if name in s.after) for name in stages}
    last = [name for name in order if not following[name]]
    if len(last) != 1:
        raise _AppError("stages", f"an app ends in exactly one stage, got {', '.join(last)}")
    for j, stage in enumerate(app.stages):
        _check_inputs(j, stage, stages, models)
    joins = [s.name for s in app.stages if len(s.after) > 1]
    if app.splitter == "nexus" and joins:
        raise _AppError("splitter", f"'nexus' (a dynamic program over a tree) needs every stage "
                         f"to follow at most one stage; {joins[0]!r} follows "
                         f"{len(stages[joins[0]].after)}: use 'harpagon' or 'proportional'")
    plan = AppGraph(app, order, stages, count, following, last[0], None)
    return dataclasses.replace(plan, signature=app_signature(plan, models))


def _topological(app: AppConfig) -> tuple[str, ...]:
    """The stages in an order where each comes after the stages it follows; a cycle is an
    error naming one stage on it."""
    order: list[str] = []
    placed: set[str] = set()
    remaining = list(app.stages)
    while remaining:
        ready = [s for s in remaining if all(up in placed for up in s.after)]
        if not ready:
            j = app.stages.index(remaining[0])
            raise _AppError(f"stages[{j}].after", f"stage {remaining[0].name!r} is on a cycle "
                             "(or follows one)")
        for stage in ready:
            order.append(stage.name)
            placed.add(stage.name)
            remaining.remove(stage)
    return tuple(order)


def _counts(app: AppConfig, order: tuple[str, ...]) -> dict[str, int]:
    """Instances of each stage per app request: every edge into a stage must give it as many
    (instance i takes upstream instance i // fan-out)."""
    by_name = {s.name: s for s in app.stages}
    count: dict[str, int] = {}
    for name in order:
        stage = by_name[name]
        counts = {count[up] * fan for up, fan in stage.after.items()} or {1}
        if len(counts) != 1:
            j = app.stages.index(stage)
            raise _AppError(f"stages[{j}].after", "its edges give it different numbers of "
                             f"requests per app request ({sorted(counts)}): fan-outs must agree")
        count[name] = counts.pop()
    return count


def _check_inputs(j: int, stage: StageConfig, stages: Mapping[str, StageConfig],
                  models: Mapping[str, ModelSignature | None]) -> None:
    """Each mapping names an app input or an output of a stage this one follows; where the
    signatures are known, every model input is mapped, from a tensor of its dtype and shape."""
    if not stage.inputs:
        raise _AppError(f"stages[{j}].inputs", "map each model input from app.<name> or "
                         "<stage>.<output>")
    signature = models[stage.model]
    wanted = {t.name: t for t in signature.inputs} if signature is not None else None
    for name, source in stage.inputs.items():
        key = f"stages[{j}].inputs.{name}"
        if wanted is not None and name not in wanted:
            raise _AppError(key, f"model {stage.model!r} has no input {name!r} (it has "
                             f"{', '.join(wanted)})")
        origin, _, tensor = source.partition(".")
        if not tensor or (origin != APP_INPUT and origin not in stage.after):
            raise _AppError(key, f"{source!r} names nothing: use app.<name> or "
                             "<stage>.<output> of a stage in this stage's after")
        if origin == APP_INPUT or wanted is None:
            continue
        upstream = models[stages[origin].model]
        if upstream is None:
            continue
        outputs = {t.name: t for t in upstream.outputs}
        if tensor not in outputs:
            raise _AppError(key, f"stage {origin!r} has no output {tensor!r} (it has "
                             f"{', '.join(outputs)})")
        got, need = outputs[tensor], wanted[name]
        if (got.dtype, got.shape) != (need.dtype, need.shape):
            raise _AppError(key, f"{source} is {got.dtype}{list(got.shape)} but the input "
                             f"needs {need.dtype}{list(need.shape)}: the shapes cannot chain")
    if wanted is not None and (missing := sorted(set(wanted) - set(stage.inputs))):
        raise _AppError(f"stages[{j}].inputs", f"input {missing[0]!r} of model "
                         f"{stage.model!r} is not mapped")


def app_signature(plan: AppGraph, models: Mapping[str, ModelSignature | None]
                  ) -> ModelSignature | None:
    """The app as a model: its inputs (each with the spec of the stage input it feeds) and its
    last stage's outputs; None unless every stage that reads an app input is known."""
    app, stages, last = plan.config, plan.stages, plan.last
    inputs: dict[str, TensorSpec] = {}
    for stage in app.stages:
        for name, source in stage.inputs.items():
            origin, _, tensor = source.partition(".")
            if origin != APP_INPUT:
                continue
            signature = models[stage.model]
            if signature is None:
                return None
            spec = next((t for t in signature.inputs if t.name == name), None)
            if spec is None:  # a registered signature without it: the stage refuses requests
                return None
            inputs[tensor] = TensorSpec(tensor, spec.dtype, spec.shape)
    last_signature = models[stages[last].model]
    if last_signature is None:
        return None
    return ModelSignature(app.name, tuple(inputs.values()), last_signature.outputs)
