"""zserve: Symphony-style deferred batch scheduling for DNN inference serving.

``zserve.Client`` / ``zserve.AsyncClient`` (see ``zserve.client``) talk to a running cluster;
the typed errors they raise are exported here too. The client classes are imported on first
access, so ``import zserve`` stays light and creates no sockets or threads.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

from zserve.errors import (
    BackendFailedError,
    BadRequestError,
    CancelledError,
    DeadlineError,
    ErrorKind,
    InternalError,
    OverloadedError,
    ProtocolError,
    ShuttingDownError,
    TooLargeError,
    UnavailableError,
    ZServeError,
)

# The installed distribution's version (pyproject.toml), the one ``zserve --version`` prints.
__version__ = metadata.version("zserve")

if TYPE_CHECKING:
    from zserve.client import AsyncClient, ClientClosedError, ConnectionLostError
    from zserve.sync_client import Client

__all__ = [
    "AsyncClient",
    "BackendFailedError",
    "BadRequestError",
    "CancelledError",
    "Client",
    "ClientClosedError",
    "ConnectionLostError",
    "DeadlineError",
    "ErrorKind",
    "InternalError",
    "OverloadedError",
    "ProtocolError",
    "ShuttingDownError",
    "TooLargeError",
    "UnavailableError",
    "ZServeError",
    "__version__",
]

_LAZY = {"AsyncClient", "ClientClosedError", "ConnectionLostError"}


def __getattr__(name: str) -> Any:
    if name == "Client":
        from zserve import sync_client

        return sync_client.Client
    if name in _LAZY:
        from zserve import client

        return getattr(client, name)
    raise AttributeError(f"module 'zserve' has no attribute {name!r}")
