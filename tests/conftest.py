"""Shared pytest fixtures. Each area adds only its own, clearly named fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from zserve.transport.sockets import LOOPBACK_TCP_ANY_PORT, IpcDir, make_dealer, make_router

# --------------------------------------------------------------------------- busy host

BUSY_HOST_OPTION = "--busy-host"
BUSY_HOST_ENV = "ZSERVE_BUSY_HOST"
BUSY_HOST_NICE = 19
# A spinner checks every ~20-50 ms of spinning that the pytest process that started it is still
# its parent, and exits when it is not: a session killed with SIGKILL leaves nothing spinning.
BUSY_HOST_SPINNER = f"""
import os, sys
os.nice({BUSY_HOST_NICE})
sys.stdout.write("spinning\\n")
sys.stdout.close()
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(500_000):
        pass
"""
BUSY_HOST_MARK = "zserve-busy-host"  # the spinners' last argument: how ps and tests tell them
BUSY_HOST_STOP_WAIT_S = 10.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        BUSY_HOST_OPTION, action="store_true",
        help=f"keep the host busy for the whole session: one spinning process per core at nice "
             f"{BUSY_HOST_NICE}, started and stopped by the session (also {BUSY_HOST_ENV}=1)")


def busy_host_requested(config: pytest.Config) -> bool:
    return bool(config.getoption(BUSY_HOST_OPTION)) or os.environ.get(BUSY_HOST_ENV) == "1"


def pytest_report_header(config: pytest.Config) -> str | None:
    if not busy_host_requested(config):
        return None
    return f"busy host: {os.cpu_count()} spinning processes at nice {BUSY_HOST_NICE}"


def start_spinners(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes that spin at nice 19 until stopped, or until this process is gone."""
    command = [sys.executable, "-c", BUSY_HOST_SPINNER, str(os.getpid()), BUSY_HOST_MARK]
    spinners = [subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
                for _ in range(count)]
    try:
        for spinner in spinners:  # each says so once it runs at nice 19: no test starts before
            assert spinner.stdout is not None
            with spinner.stdout:
                assert spinner.stdout.readline() == b"spinning\n", "a spinner did not start"
    except BaseException:
        stop_spinners(spinners)
        raise
    return spinners


def stop_spinners(spinners: list[subprocess.Popen[bytes]]) -> None:
    for spinner in spinners:
        spinner.kill()
    for spinner in spinners:
        spinner.wait(BUSY_HOST_STOP_WAIT_S)


@pytest.fixture(scope="session", autouse=True)
def busy_host(request: pytest.FixtureRequest) -> Iterator[list[subprocess.Popen[bytes]]]:
    """With ``--busy-host`` (or ZSERVE_BUSY_HOST=1): the session's spinners, one per core, from
    before the first test to after the last (stopped also when the session is interrupted);
    otherwise none. The cores are never idle, so every wake-up of the cluster's processes must
    first take a core back from a spinner."""
    spinners = start_spinners(os.cpu_count() or 1) if busy_host_requested(request.config) else []
    try:
        yield spinners
    finally:
        stop_spinners(spinners)


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
