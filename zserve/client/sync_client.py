"""``zserve.Client``: the synchronous, thread-safe client.

It hosts one ``zserve.client.async_client.AsyncClient`` on an event loop in its own I/O thread
(started on first use, stopped by ``close()``), so any number of threads may call ``infer`` and
``submit`` at once over one connection; every promise of ``AsyncClient``
(``zserve/client/async_client.py``:
timeouts, no
future left pending, retries, typed errors) holds for it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from zserve.client.async_client import (
    DEFAULT_BACKOFF_MAX_S,
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_S,
    AsyncClient,
    ClientClosedError,
    Outputs,
)


def _copy_outcome(
    source: asyncio.Future[Outputs], target: concurrent.futures.Future[Outputs]
) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


class Client:
    """A synchronous, thread-safe client: any number of threads may call ``infer`` and
    ``submit`` at once over one connection. It runs one I/O thread with an event loop hosting
    an ``AsyncClient``, started on first use and stopped by ``close()``. ``server_key`` and
    ``client_key``: CURVE keys for a frontend on tcp with ``[security]`` (``AsyncClient``)."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
        seed: int | None = None,
        server_key: str | bytes | os.PathLike[str] | None = None,
        client_key: str | os.PathLike[str] | tuple[bytes, bytes] | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._async = AsyncClient(
            address,
            timeout=timeout,
            max_retries=max_retries,
            backoff_s=backoff_s,
            backoff_max_s=backoff_max_s,
            seed=seed,
            server_key=server_key,
            client_key=client_key,
        )
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The I/O thread's loop (started on first use). Call with ``self._lock`` held, and
        schedule on the loop before releasing it: ``close()`` then runs after what was scheduled,
        so nothing scheduled is left behind a stopped loop."""
        if self._closed:
            raise ClientClosedError(f"the zserve client of {self.address} is closed")
        if self._loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            thread = threading.Thread(target=run, name="zserve-client-io", daemon=True)
            thread.start()
            ready.wait()
            self._loop, self._thread = loop, thread
        return self._loop

    def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        timeout: float | None = None,
        slo_ms: float = 0.0,
        max_retries: int | None = None,
    ) -> Outputs:
        """Run ``model`` on ``inputs`` and return its outputs (see ``AsyncClient.infer``)."""
        coro = self._async.infer(
            model, inputs, timeout=timeout, slo_ms=slo_ms, max_retries=max_retries
        )
        with self._lock:
            try:
                loop = self._ensure_loop()
            except ClientClosedError:
                coro.close()
                raise
            outcome = asyncio.run_coroutine_threadsafe(coro, loop)
        return outcome.result()

    def submit(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        slo_ms: float = 0.0,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[Outputs]:
        """Send one request (one attempt); returns a ``concurrent.futures.Future`` (see
        ``AsyncClient.submit``)."""
        result: concurrent.futures.Future[Outputs] = concurrent.futures.Future()

        sent = threading.Event()

        def send() -> None:
            try:
                inner = self._async.submit(model, inputs, slo_ms=slo_ms, timeout=timeout)
                result.inner = inner  # type: ignore[attr-defined]
                inner.add_done_callback(lambda done: _copy_outcome(done, result))
            except BaseException as exc:
                result.set_exception(exc)
            finally:
                sent.set()

        with self._lock:
            self._ensure_loop().call_soon_threadsafe(send)
        sent.wait()
        return result

    def cancel(self, future: concurrent.futures.Future[Outputs]) -> bool:
        """Ask the frontend to cancel a request from ``submit`` (see ``AsyncClient.cancel``)."""
        inner = getattr(future, "inner", None)
        outcome: concurrent.futures.Future[bool] = concurrent.futures.Future()
        with self._lock:
            if inner is None or self._loop is None or self._closed:
                return False
            self._loop.call_soon_threadsafe(
                lambda: outcome.set_result(self._async.cancel(inner))
            )
        return outcome.result()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._close_async(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    async def _close_async(self) -> None:
        await self._async.close()
        # Calls in flight end now: answered by the close, or ClientClosedError at their next
        # attempt after a backoff. Wait for them: none may be left behind the stopped loop.
        calls = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        await asyncio.gather(*calls, return_exceptions=True)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
