"""Shared pytest fixtures. Each area adds only its own, clearly named fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from zserve.transport.sockets import LOOPBACK_TCP_ANY_PORT, IpcDir, make_dealer, make_router

# --------------------------------------------------------------------------- backends


@pytest.fixture(scope="session", autouse=True)
def zserve_model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Built-in models are cached in a per-test-session folder ($ZSERVE_CACHE_DIR), never in
    ~/.cache. Autouse so that every test (and every subprocess it starts) shares it."""
    path = tmp_path_factory.mktemp("zserve-models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZSERVE_CACHE_DIR", str(path))
        yield path


# --------------------------------------------------------------------------- transport


class _KeepingContext(zmq.Context[zmq.Socket[bytes]]):
    """A context that holds every socket it made until ``destroy``. A plain context tracks its
    sockets weakly: one a test left in a local would be collected (and warn ResourceWarning,
    an error in this suite) when the test returns, before the fixture could close it."""

    _made: list[zmq.Socket[bytes]]

    def socket(self, *args: Any, **kwargs: Any) -> zmq.Socket[bytes]:
        sock = super().socket(*args, **kwargs)
        self._made.append(sock)
        return sock


class _KeepingAsyncContext(zmq.asyncio.Context):
    """The asyncio twin of ``_KeepingContext``."""

    _made: list[zmq.asyncio.Socket]

    def socket(self, *args: Any, **kwargs: Any) -> zmq.asyncio.Socket:
        sock = super().socket(*args, **kwargs)
        self._made.append(sock)
        return sock


@pytest.fixture
def transport_ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A sync ZMQ context; every socket made from it is closed (linger 0) at teardown."""
    ctx = _KeepingContext()
    ctx._made = []
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def transport_async_ctx() -> Iterator[zmq.asyncio.Context]:
    """An asyncio ZMQ context; every socket made from it is closed (linger 0) at teardown."""
    ctx = _KeepingAsyncContext()
    ctx._made = []
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def transport_ipc_dir() -> Iterator[IpcDir]:
    """A private 0700 directory for ipc:// endpoints, removed at teardown."""
    with IpcDir() as ipc_dir:
        yield ipc_dir


@pytest.fixture(params=["ipc", "tcp"])
def transport_bind(request: pytest.FixtureRequest, transport_ipc_dir: IpcDir) -> str:
    """Where a test ROUTER binds: an ipc:// endpoint, or loopback TCP port 0 (never a guess)."""
    if request.param == "ipc":
        return transport_ipc_dir.endpoint("router")
    return LOOPBACK_TCP_ANY_PORT


@pytest.fixture
def transport_pair(
    transport_ctx: zmq.Context[zmq.Socket[bytes]], transport_bind: str
) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """(router, dealer): sync sockets from the factory, the dealer connected as b"peer-0"."""
    router, endpoint = make_router(transport_ctx, transport_bind, name="test router")
    dealer = make_dealer(transport_ctx, endpoint, identity=b"peer-0")
    yield router, dealer
    dealer.close(linger=0)
    router.close(linger=0)


@pytest.fixture
def transport_async_pair(
    transport_async_ctx: zmq.asyncio.Context, transport_bind: str
) -> Iterator[tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]]:
    """(router, dealer): asyncio sockets from the factory, the dealer connected as b"peer-0"."""
    router, endpoint = make_router(transport_async_ctx, transport_bind, name="test router")
    dealer = make_dealer(transport_async_ctx, endpoint, identity=b"peer-0")
    yield router, dealer
    dealer.close(linger=0)
    router.close(linger=0)
