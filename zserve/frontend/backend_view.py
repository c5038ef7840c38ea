"""The frontend core's view of the backends: who they are, what they serve, and which of them lost
the requests they had fetched.

``FrontendBackends`` is a part of ``zserve.frontend.core.FrontendCore``. It follows the rank's
``BackendTable`` (which backends serve which models; the signatures requests are validated
against; the profiles of models with none configured), each backend's ``Hello`` (its pid: a new
pid is a restarted backend) and the supervisor's ``BackendGone``. Each of these events returns
the backends that hold none of the requests they fetched any more (one that left the table,
restarted or died), with why; the core answers those requests ``BACKEND_FAILED`` at once, not at
their deadline. Pure, like the core: no sockets, no loop, no clock.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from zserve.config.profiles import LatencyProfile
from zserve.frontend.admission import ModelAdmission
from zserve.transport.messages import BackendGone, BackendTable, Hello, protocol_mismatch

log = logging.getLogger("zserve.frontend")

# (backend name, why): a backend whose fetched requests are lost.
LostBackends = list[tuple[str, str]]


class FrontendBackends:
    """The backends as one frontend knows them (see the module docstring).

    ``pids``: each backend's pid, from its ``Hello`` (removed when the supervisor says it died);
    ``table``: each backend's models, from the rank's latest ``BackendTable`` (None before the
    first); ``gpus_for_model``: how many backends of that table serve each configured model.
    Signatures and measured profiles are learned into the models' ``ModelAdmission``.
    """

    __slots__ = ("_max_request_bytes", "_models", "_name", "_profiles", "_signatures",
                 "gpus_for_model", "pids", "table")

    def __init__(self, *, name: str, models: dict[str, ModelAdmission],
                 max_request_bytes: int) -> None:
        """``name``: the frontend's (for the log); ``models``: the core's admission state per
        configured model; ``max_request_bytes``: the bound a learned signature is checked
        against."""
        self._name = name
        self._models = models
        self._max_request_bytes = max_request_bytes
        self.pids: dict[str, int] = {}
        self.table: dict[str, list[str]] | None = None
        self.gpus_for_model: dict[str, int] = {}
        # the latest table's, per backend
        self._signatures: list[dict[str, dict[str, Any]]] = []
        self._profiles: list[dict[str, list[float]]] = []

    def on_hello(self, msg: Hello) -> LostBackends:
        """A backend says hello with its pid: a new pid means a new incarnation, which holds
        none of the requests the old one fetched. One of another wire protocol is ignored."""
        refusal = protocol_mismatch(f"{msg.role} {msg.name}", msg.protocol)
        if refusal is not None:
            log.error("%s: ignoring %s", self._name, refusal)
            return []
        previous = self.pids.get(msg.name)
        self.pids[msg.name] = msg.pid
        if previous is not None and previous != msg.pid:
            return [(msg.name, "backend restarted")]
        return []

    def on_gone(self, msg: BackendGone) -> LostBackends:
        """The supervisor says a backend's process died: the requests it fetched are lost."""
        if self.pids.pop(msg.name, None) is not None:
            return [(msg.name, "backend process died")]
        return []

    def on_table(self, msg: BackendTable) -> LostBackends:
        """The rank's table of backends: the ones no longer in it lost their requests."""
        table = dict(zip(msg.names, msg.models, strict=False))
        previous = self.table or {}
        self.table = table
        self._signatures, self._profiles = msg.signatures, msg.profiles_ms
        self.recount()
        return [(name, "backend left the cluster") for name in previous if name not in table]

    def recount(self) -> None:
        """The backends serving each configured model, and what they registered of it, from the
        latest table (again after a model was added: the table may list it already)."""
        counts: dict[str, int] = dict.fromkeys(self._models, 0)
        for models in (self.table or {}).values():
            for model in models:
                if model in counts:
                    counts[model] += 1
        self.gpus_for_model = counts
        self._learn_signatures(self._signatures)
        self._learn_profiles(self._profiles)

    def names(self) -> set[str]:
        """Every backend this frontend knows of (the table's, and live ones that said hello)."""
        return set(self.table or {}) | {name for name, pid in self.pids.items() if pid}

    def _learn_signatures(self, per_backend: list[dict[str, dict[str, Any]]]) -> None:
        """Validate requests against the signatures the backends registered."""
        for signatures in per_backend:
            for model, wire in signatures.items():
                state = self._models.get(model)
                if state is None:
                    continue
                try:
                    state.set_signature(wire, self._max_request_bytes)
                except ValueError as exc:
                    log.warning("%s: bad signature for %s: %s", self._name, model, exc)

    def _learn_profiles(self, per_backend: list[dict[str, list[float]]]) -> None:
        """Models without a configured profile use the one their backends measured."""
        for profiles in per_backend:
            for model, table_ms in profiles.items():
                state = self._models.get(model)
                if state is not None and state.profile is None and table_ms:
                    with contextlib.suppress(ValueError):
                        state.profile = LatencyProfile.from_table_ms(table_ms)
