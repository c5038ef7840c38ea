"""The frontend core's view of the backends: who they are, what they serve, and their failures.

``FrontendBackends`` is the part of ``zserve.frontend.core.FrontendCore`` that follows the
backends: the rank's ``BackendTable`` (which backends serve which models; the signatures
requests are validated against; the profiles of models with none configured), each backend's
``Hello`` (its pid: a new pid is a restarted backend) and the supervisor's ``BackendGone``. A
backend that leaves the table, restarts or dies holds none of the requests it fetched any more:
they are answered ``BACKEND_FAILED`` at once, not at their deadline.

The core owns the request table and the answers (``_answer_error``); this mixin declares what it
uses of them. Pure, like the core: no sockets, no loop, no clock.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.core.hosting import Outbox
from zserve.frontend.admission import ModelAdmission
from zserve.frontend.requests import Pending, RequestTable
from zserve.transport.messages import BackendGone, BackendTable, Hello, protocol_mismatch

log = logging.getLogger("zserve.frontend")


class FrontendBackends:
    """The backends as a ``FrontendCore`` knows them (mixed into it; see the module docstring)."""

    # Set by FrontendCore.__init__.
    name: str
    max_request_bytes: int
    models: dict[str, ModelAdmission]
    requests: RequestTable
    backend_pids: dict[str, int]
    backend_models: dict[str, list[str]] | None
    gpus_for_model: dict[str, int]

    # Provided by FrontendCore.
    def _answer_error(self, now: float, p: Pending, kind: ErrorKind, message: str,
                      outbox: Outbox) -> None:
        raise NotImplementedError

    def on_backend_hello(self, now: float, msg: Hello, outbox: Outbox) -> None:
        """A backend says hello with its pid: a new pid means a new incarnation, which holds
        none of the requests the old one fetched. One of another wire protocol is ignored."""
        refusal = protocol_mismatch(f"{msg.role} {msg.name}", msg.protocol)
        if refusal is not None:
            log.error("%s: ignoring %s", self.name, refusal)
            return
        previous = self.backend_pids.get(msg.name)
        self.backend_pids[msg.name] = msg.pid
        if previous is not None and previous != msg.pid:
            self._backend_failed(now, msg.name, "backend restarted", outbox)

    def on_backend_gone(self, now: float, msg: BackendGone, outbox: Outbox) -> None:
        """The supervisor says a backend's process died: the requests it had fetched are
        answered ``BACKEND_FAILED`` now, not at their deadline."""
        if self.backend_pids.pop(msg.name, None) is not None:
            self._backend_failed(now, msg.name, "backend process died", outbox)

    def on_backend_table(self, now: float, msg: BackendTable, outbox: Outbox) -> None:
        table = dict(zip(msg.names, msg.models, strict=False))
        previous = self.backend_models or {}
        self.backend_models = table
        for name in previous:
            if name not in table:
                self._backend_failed(now, name, "backend left the cluster", outbox)
        counts: dict[str, int] = dict.fromkeys(self.models, 0)
        for models in table.values():
            for model in models:
                if model in counts:
                    counts[model] += 1
        self.gpus_for_model = counts
        self._learn_signatures(msg.signatures)
        self._learn_profiles(msg.profiles_ms)

    def _learn_signatures(self, per_backend: list[dict[str, dict[str, Any]]]) -> None:
        """Validate requests against the signatures the backends registered."""
        for signatures in per_backend:
            for model, wire in signatures.items():
                state = self.models.get(model)
                if state is None:
                    continue
                try:
                    state.set_signature(wire, self.max_request_bytes)
                except ValueError as exc:
                    log.warning("%s: bad signature for %s: %s", self.name, model, exc)

    def _learn_profiles(self, per_backend: list[dict[str, list[float]]]) -> None:
        """Models without a configured profile use the one their backends measured."""
        for profiles in per_backend:
            for model, table_ms in profiles.items():
                state = self.models.get(model)
                if state is not None and state.profile is None and table_ms:
                    with contextlib.suppress(ValueError):
                        state.profile = LatencyProfile.from_table_ms(table_ms)

    def _backend_failed(self, now: float, backend: str, why: str, outbox: Outbox) -> None:
        for p in self.requests.fetched_requests(backend):
            self._answer_error(now, p, ErrorKind.BACKEND_FAILED, f"{backend}: {why}", outbox)

    def backend_names(self) -> set[str]:
        """Every backend this frontend knows of (the table's, and live ones that said hello)."""
        return set(self.backend_models or {}) | {
            name for name, pid in self.backend_pids.items() if pid}
