"""zserve: Symphony-style deferred batch scheduling for DNN inference serving.

``zserve.Client`` / ``zserve.AsyncClient`` (see ``zserve.client.async_client``) talk to a running
cluster; the typed errors they raise are exported here too. The client classes are imported on first
access, so ``import zserve`` stays light and creates no sockets or threads.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

from zserve.core.errors import (
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
    from zserve.client.async_client import AsyncClient, ClientClosedError, ConnectionLostError
    from zserve.client.sync_client import Client

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

_LAZY = {"AsyncClient", "Client", "ClientClosedError", "ConnectionLostError"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import zserve.client

        return getattr(zserve.client, name)
    raise AttributeError(f"module 'zserve' has no attribute {name!r}")
