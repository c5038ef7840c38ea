"""The frontend's way to the supervisor's model repository: calls forwarded over the control link.

The OIP servers' repository endpoints (index, load, unload) call ``RepositoryLink.call``: it
sends a ``RepositoryRequest`` to the supervisor, which owns the repository
(``zserve.cluster.repository``), and waits for the ``RepositoryReply`` of the same id, which the
frontend host hands to ``on_reply``. A reply with an error raises it, typed
(``zserve.core.errors``); no reply within ``REPOSITORY_TIMEOUT_S`` (a backend that never
reports) is ``UNAVAILABLE``; a frontend started without a supervisor has no repository
(``UNAVAILABLE`` at once). Runs on the frontend's loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from zserve.core.errors import UnavailableError, error_from_wire
from zserve.transport.messages import RepositoryReply, RepositoryRequest

# The longest a repository call waits for the supervisor: a load opens and warms the model's
# sessions at every batch size on every backend (tens of seconds for a large model on a GPU).
REPOSITORY_TIMEOUT_S = 300.0

Send = Callable[[Any], Awaitable[bool]]


class RepositoryLink:
    """Repository calls to the supervisor (see the module docstring); ``send`` is the control
    link's (False: no supervisor)."""

    def __init__(self, send: Send, *, timeout_s: float = REPOSITORY_TIMEOUT_S) -> None:
        self._send = send
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[RepositoryReply]] = {}

    async def call(self, action: str, model: str = "") -> RepositoryReply:
        """``action`` (index, load, unload) of ``model``: the supervisor's reply, or its error
        raised."""
        request_id = next(self._ids)
        future: asyncio.Future[RepositoryReply] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            if not await self._send(RepositoryRequest(request_id, action, model)):
                raise UnavailableError("this frontend runs without a supervisor, which holds "
                                       "the model repository")
            reply = await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise UnavailableError(f"the model repository did not answer {action} "
                                   f"{model!r} within {self.timeout_s:.0f} s") from None
        finally:
            self._waiting.pop(request_id, None)
        if reply.error:
            raise error_from_wire(reply.error, reply.message)
        return reply

    def on_reply(self, reply: RepositoryReply) -> None:
        """The supervisor's answer to one call (ignored once that call gave up)."""
        future = self._waiting.pop(reply.request_id, None)
        if future is not None and not future.done():
            future.set_result(reply)


__all__ = ["REPOSITORY_TIMEOUT_S", "RepositoryLink"]
