"""Readiness: when a frontend may tell a load balancer or a probe that it serves.

One rule, kept pure so that every reporter of health (the OIP health endpoints, ``zserve status``,
the metrics) says the same thing: a frontend is ready when it admits requests (it is not
draining) and every configured model has at least one live backend in the rank's backend table.
That table holds only backends that finished warming (a backend registers after loading and
warming every model at every batch size) and loses a backend the rank finds silent for its
heartbeat timeout (``scheduler.rank_backends.BACKEND_TIMEOUT_S``): a wedged backend makes its
models unready within that timeout, and a frontend that never received the table is not ready.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

BackendModels = Mapping[str, Sequence[str]]
"""The rank's backend table as a frontend holds it: backend name -> the models it serves."""


def model_ready(model: str, backend_models: BackendModels | None) -> bool:
    """``model`` has at least one live, warmed backend in the table."""
    if backend_models is None:
        return False
    return any(model in models for models in backend_models.values())


def unready_models(models: Iterable[str], backend_models: BackendModels | None) -> list[str]:
    """The configured models that no live, warmed backend serves, in the order given."""
    return [model for model in models if not model_ready(model, backend_models)]


def frontend_ready(admitting: bool, models: Iterable[str],
                   backend_models: BackendModels | None) -> bool:
    """Admitting, and every model in ``models`` served by a live, warmed backend."""
    return admitting and not unready_models(models, backend_models)
