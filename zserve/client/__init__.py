"""The embeddable client: ``AsyncClient`` (asyncio) and ``Client`` (sync, thread-safe).

Both are re-exported as ``zserve.AsyncClient`` and ``zserve.Client``.
"""

from zserve.client.async_client import AsyncClient, ClientClosedError, ConnectionLostError
from zserve.client.sync_client import Client

__all__ = ["AsyncClient", "Client", "ClientClosedError", "ConnectionLostError"]
