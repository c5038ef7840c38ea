"""The supervisor's model repository: which backend serves which model, and the repository calls
waiting on them (pure logic).

``ModelRepository`` is a part of the supervisor (``zserve.cluster.supervisor``). It keeps, per
model and backend, the state the backend last reported (``READY``) or was asked for
(``LOADING``, ``UNLOADING``; absent: not loaded there), and answers the Open Inference Protocol's
repository calls that frontends forward over their control links (``RepositoryRequest``):

- ``index(call)``: every model of the cluster with its state (``READY`` where some backend
  serves it; ``LOADING`` / ``UNLOADING`` while a command is under way; else ``UNAVAILABLE``,
  with why: not loaded, unloaded, or the last load's failure), answered at once;
- ``load(call, model)``, in two phases: ``LoadModel`` without ``announce`` to every live
  backend that does not serve it yet; once each has reported it ``WARM``, ``LoadModel`` with
  ``announce`` to all of them at once, so the backends list it in the rank's table within a
  control hop of each other (a model listed on some backends and not others costs the rank
  grants its thread declines). If any failed, the warm ones unload it instead (no half-loaded
  model stays behind) and the call is answered with the failures; at once when every live
  backend serves it already;
- ``unload(call, model)``: ``UnloadModel`` to every backend that serves or loads it; answered
  once each has reported it unloaded;
- ``move(call, model, to)``, make-before-break: the model is loaded and warmed on the backends
  of ``to`` that do not serve it yet and announced there (the two phases of a load), so the
  rank's table lists it on the old and the new backends at once; only then are the old ones
  (those not in ``to``) told to unload it, which each does after the plans of it already sent
  have run. The model is served throughout and no request is lost to a move. A failed load
  leaves it where it was (the warm ones unload it again). Answered once the old ones have
  freed it;
- ``on_report`` (a backend's ``ModelReport``), ``on_backend_gone`` (its process died: what it
  loaded is gone, a load under way there failed) and ``on_backend_started`` (a restarted
  backend serves the models it was started with, and loads those loaded elsewhere since) move
  the states and settle the calls.

Where a model should be is its ``placement``: every live backend (None; ``load``, and a model
every backend serves at start), or the backends a ``move`` named (or that serve it at start): a
backend that restarts loads it again only where it is placed. Each method returns
``Effects``: the commands for the supervisor to send and the answers for the frontends. No I/O,
no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from zserve.core.errors import ErrorKind
from zserve.transport.messages import LoadModel, ModelUnservable, RepositoryReply, UnloadModel

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
# What a backend reports for a load that failed, and for one loaded and warmed but not announced
# (``zserve.backends.model_lifecycle``).
FAILED, WARM = "FAILED", "WARM"
# Asked to announce a model it holds warm (the second phase of a load).
ANNOUNCING = "ANNOUNCING"
# The states of a command under way: the model's calls wait until none is left.
_BUSY = (LOADING, ANNOUNCING, UNLOADING)
ACTIONS = ("index", "load", "unload")
MOVE = "move"


@dataclass(frozen=True, slots=True)
class Call:
    """One repository call: the frontend that forwarded it and its id there."""

    frontend: str
    request_id: int


@dataclass(slots=True)
class Effects:
    """What a step asks of the supervisor: ``commands`` (backend name, message) to send,
    ``answers`` (frontend name, reply) to send, and ``notices`` for every frontend."""

    commands: list[tuple[str, LoadModel | UnloadModel]] = field(default_factory=list)
    answers: list[tuple[str, RepositoryReply]] = field(default_factory=list)
    notices: list[ModelUnservable] = field(default_factory=list)

    def answer(self, call: Call, error: ErrorKind | None = None, message: str = "") -> None:
        self.answers.append((call.frontend, RepositoryReply(
            call.request_id, error.value if error is not None else "", message)))


@dataclass(slots=True)
class _Waiting:
    call: Call
    action: str
    failures: list[str] = field(default_factory=list)
    # a move: the backends it moves the model to, and whether the old ones were told to unload
    to: frozenset[str] = frozenset()
    breaking: bool = False


class ModelRepository:
    """The cluster's models and where each is loaded (see the module docstring). ``models``:
    name -> the wire form of its ``ModelConfig`` (``to_dict``), in index order; ``backends``:
    each backend's name and the models it loads at start."""

    def __init__(self, models: dict[str, dict[str, Any]],
                 backends: dict[str, Iterable[str]]) -> None:
        self.models = dict(models)
        self.states: dict[str, dict[str, str]] = {name: {} for name in self.models}
        self.reasons: dict[str, str] = {name: "not loaded" for name in self.models}
        self.backends: set[str] = set()
        self._waiting: dict[str, list[_Waiting]] = {}
        for backend, served in backends.items():  # at start: what each loads
            self.backends.add(backend)
            for model in served:
                if model in self.states:
                    self.states[model][backend] = READY
        # model -> the backends it is placed on (None: every live backend)
        self.placement: dict[str, frozenset[str] | None] = {
            name: None if set(states) in (set(), self.backends) else frozenset(states)
            for name, states in self.states.items()}

    def add_model(self, name: str, wire: dict[str, Any]) -> None:
        """A model found in the repository folder after start: known, loaded nowhere."""
        if name in self.models:
            return
        self.models[name] = wire
        self.states[name] = {}
        self.reasons[name] = "not loaded"
        self.placement[name] = None

    # ------------------------------------------------------------------ what it tells

    def state(self, model: str) -> tuple[str, str]:
        """``model``'s state in the index, and why it is not READY ("" when it is)."""
        states = {LOADING if s in (WARM, ANNOUNCING) else s for s in self.states[model].values()}
        for state in (LOADING, UNLOADING, READY):
            if state in states:
                return state, ""
        return UNAVAILABLE, self.reasons[model]

    def busy(self, model: str) -> bool:
        """Whether a call of ``model`` is under way (or a command on a backend)."""
        return bool(self._waiting.get(model)) or any(
            s != READY for s in self.states[model].values())

    def served_by(self, backend: str) -> list[str]:
        """The models READY on ``backend`` (what a restart of it should load at start)."""
        return [m for m, states in self.states.items() if states.get(backend) == READY]

    def index(self, call: Call) -> Effects:
        effects = Effects()
        models = list(self.models)
        states = [self.state(m) for m in models]
        effects.answers.append((call.frontend, RepositoryReply(
            call.request_id, "", "", models, [s for s, _ in states], [r for _, r in states])))
        return effects

    # ------------------------------------------------------------------ calls

    def call(self, call: Call, action: str, model: str) -> Effects:
        """A forwarded ``RepositoryRequest``; an unknown action or model is answered
        ``BAD_REQUEST`` at once."""
        if action == "index":
            return self.index(call)
        effects = Effects()
        if action not in ACTIONS:
            effects.answer(call, ErrorKind.BAD_REQUEST,
                           f"unknown repository action {action!r} (one of {', '.join(ACTIONS)})")
        elif model not in self.models:
            effects.answer(call, ErrorKind.BAD_REQUEST,
                           f"no model {model!r} in the repository (it holds "
                           f"{', '.join(self.models) or 'none'})")
        elif self._moving(model):
            effects.answer(call, ErrorKind.UNAVAILABLE,
                           f"model {model!r} is being moved; try again when the move is done")
        elif action == "load":
            self._load(call, model, effects)
        else:
            self._unload(call, model, effects)
        return effects

    def _moving(self, model: str) -> bool:
        return any(w.action == MOVE for w in self._waiting.get(model, []))

    def move(self, call: Call, model: str, to: Iterable[str]) -> Effects:
        """Move ``model`` onto the backends ``to``, make-before-break (see the module
        docstring). Refused at once (``BAD_REQUEST``) for an unknown model or a backend that is
        not live, and (``UNAVAILABLE``) while another call of the model is under way."""
        effects = Effects()
        targets = frozenset(to)
        if model not in self.models:
            effects.answer(call, ErrorKind.BAD_REQUEST, f"no model {model!r} in the repository")
        elif not targets or not targets <= self.backends:
            effects.answer(call, ErrorKind.BAD_REQUEST,
                           f"cannot move {model!r} to {', '.join(sorted(targets)) or 'nothing'}:"
                           f" the live backends are {', '.join(sorted(self.backends)) or 'none'}")
        elif self._waiting.get(model) or any(s != READY for s in self.states[model].values()):
            effects.answer(call, ErrorKind.UNAVAILABLE,
                           f"a call of {model!r} is under way; try again when it is done")
        else:
            states = self.states[model]
            self.placement[model] = targets
            for backend in sorted(targets):
                if states.get(backend) != READY:
                    effects.commands.append((backend, LoadModel(model, self.models[model],
                                                                announce=False)))
                    states[backend] = LOADING
            self._waiting[model] = [_Waiting(call, MOVE, to=targets)]
            self._settle(model, effects)
        return effects

    def _break(self, model: str, move: _Waiting, effects: Effects) -> bool:
        """The move's second half, once every new backend serves the model: the old ones
        unload it (each after its plans of it have run). True when any was told."""
        move.breaking = True
        states = self.states[model]
        if move.failures:  # the load failed: the model stays where it was
            self.placement[model] = frozenset(b for b, s in states.items() if s == READY)
            return False
        old = sorted(b for b, s in states.items() if s == READY and b not in move.to)
        for backend in old:
            effects.commands.append((backend, UnloadModel(model)))
            states[backend] = UNLOADING
        return bool(old)

    def _load(self, call: Call, model: str, effects: Effects) -> None:
        """Load ``model`` on every live backend, or on the live ones of those its config names
        (``[[models]] backends``)."""
        named = self.models[model].get("backends")
        self.placement[model] = frozenset(named) if named else None
        states = self.states[model]
        live = self.backends & set(named) if named else self.backends
        targets = sorted(b for b in live if states.get(b) != READY)
        if not live:
            effects.answer(call, ErrorKind.UNAVAILABLE, "no live backend to load it on" + (
                f" (it names {', '.join(sorted(named))})" if named else ""))
            return
        if not targets:
            effects.answer(call)
            return
        for backend in targets:
            if states.get(backend) not in (LOADING, WARM, ANNOUNCING):
                effects.commands.append((backend, LoadModel(model, self.models[model],
                                                            announce=False)))
                states[backend] = LOADING
        self._waiting.setdefault(model, []).append(_Waiting(call, "load"))

    def _unload(self, call: Call, model: str, effects: Effects) -> None:
        states = self.states[model]
        targets = sorted(b for b, state in states.items() if state != UNLOADING)
        for backend in targets:
            effects.commands.append((backend, UnloadModel(model)))
            states[backend] = UNLOADING
        if not states:
            effects.answer(call)
            return
        self.reasons[model] = "unloaded"
        self._waiting.setdefault(model, []).append(_Waiting(call, "unload"))

    # ------------------------------------------------------------------ what backends say

    def on_report(self, backend: str, model: str, state: str, message: str = "") -> Effects:
        """A backend's ``ModelReport``: READY, UNAVAILABLE (unloaded) or FAILED."""
        effects = Effects()
        states = self.states.get(model)
        if states is None:
            return effects
        # A report answers the oldest command under way there: a later one (an unload after
        # a load, a load after an unload) keeps its state until its own report comes.
        current = states.get(backend)
        if state == READY and current != UNLOADING:
            states[backend] = READY
        elif state == WARM and current == LOADING:
            states[backend] = WARM
        elif (state == UNAVAILABLE and current not in (LOADING, ANNOUNCING)) or (
                state == FAILED and current == LOADING):
            states.pop(backend, None)
        if state == FAILED:
            why = f"{backend}: {message}"
            self.reasons[model] = f"load failed on {why}"
            for waiting in self._waiting.get(model, []):
                waiting.failures.append(why)
        self._settle(model, effects)
        return effects

    def on_backend_gone(self, backend: str) -> Effects:
        """``backend``'s process died: it serves nothing now, and a load there failed."""
        effects = Effects()
        self.backends.discard(backend)
        for model, states in self.states.items():
            if states.pop(backend, None) in (LOADING, WARM, ANNOUNCING):
                for waiting in self._waiting.get(model, []):
                    waiting.failures.append(f"{backend}: its process died")
            self._settle(model, effects)
        return effects

    def on_backend_started(self, backend: str, served: Iterable[str]) -> Effects:
        """``backend`` (re)started serving ``served``; a model loaded elsewhere meanwhile (after
        its start-up list was fixed) is loaded there too, so every backend serves it again."""
        self.backends.add(backend)
        served = set(served)
        effects = Effects()
        for model, states in self.states.items():
            placement = self.placement[model]
            if model in served:
                states[backend] = READY
            elif (READY in states.values() and backend not in states
                  and (placement is None or backend in placement)):
                effects.commands.append((backend, LoadModel(model, self.models[model],
                                                            announce=False)))
                states[backend] = LOADING
        return effects

    def _settle(self, model: str, effects: Effects) -> None:
        """Once no command of ``model`` is under way: announce it where it is warm (or unload
        it there, if a load failed), then answer its calls."""
        states = self.states[model]
        if any(s in _BUSY for s in states.values()):
            return
        warm = sorted(b for b, s in states.items() if s == WARM)
        if warm:
            failed = any(w.failures for w in self._waiting.get(model, []))
            for backend in warm:
                if failed:
                    effects.commands.append((backend, UnloadModel(model)))
                    states[backend] = UNLOADING
                else:
                    effects.commands.append((backend, LoadModel(model, self.models[model])))
                    states[backend] = ANNOUNCING
            return
        waiting = self._waiting.get(model, [])
        if (waiting and waiting[0].action == MOVE and not waiting[0].breaking
                and self._break(model, waiting[0], effects)):
            return  # the old backends unload it; their reports settle the move
        self._answer(model, effects)

    def _answer(self, model: str, effects: Effects) -> None:
        """Every call of ``model`` is done: answer each."""
        ready = READY in self.states[model].values()
        for waiting in self._waiting.pop(model, []):
            if waiting.failures:
                effects.answer(waiting.call, ErrorKind.BAD_REQUEST,
                               f"failed to {waiting.action} {model!r}: "
                               + "; ".join(waiting.failures))
            elif waiting.action == "load" and not ready:
                effects.answer(waiting.call, ErrorKind.UNAVAILABLE,
                               f"{model!r} was unloaded before its load finished")
            else:
                effects.answer(waiting.call)


__all__ = ["FAILED", "LOADING", "MOVE", "READY", "UNAVAILABLE", "UNLOADING", "Call", "Effects",
           "ModelRepository"]
