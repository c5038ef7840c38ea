"""Malformed and oversized frames sent to every ROUTER socket of every role of a running cluster
(F14, F15): the frontend's ``client`` and ``data``, the shard's ``shard``, the rank's ``rank``,
every backend's ``plan`` and the supervisor's ``control``. Each role stays up (same pid, no
restart), counts what it refused (``malformed`` or ``bad_messages``), and a normal request gets
its own outputs afterwards. A frame past ``MAX_FRAME_BYTES`` never reaches the process: ZeroMQ
drops the sender's connection (``MAXMSGSIZE``), so it is sent, but not counted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from fault_harness import Ledger, Load, drive, fault_cluster
from runtime_helpers import wait_until

from zserve.cluster.supervisor import Cluster
from zserve.transport import codec
from zserve.transport.messages import CancelRequest, Heartbeat
from zserve.transport.sockets import MAX_FRAME_BYTES, make_dealer

WAIT_S = 20.0


def _pack(*items: Any) -> bytes:
    return bytes(msgpack.packb(list(items)))


_VALID = bytes(codec.encode(CancelRequest(5))[0])
_FOUR_FLOATS = np.zeros(4, dtype=np.float32).tobytes()
# Each refused by decoding, so counted by the receiving role.
REFUSED: dict[str, list[bytes]] = {
    "not-msgpack": [b"\xc1"],
    "empty-header": [b""],
    "truncated": [_VALID[:-1]],
    "unknown-kind": [_pack("nope", 1)],
    "wrong-type": [_pack("cancel", "1")],
    "wrong-arity": [_pack("hb", "n")],
    "missing-frame": [_pack("reply", 1, {"y": ["<f4", [4], 1]})],
    "extra-frame": [_pack("reply", 1, {"y": ["<f4", [4], 1]}), _FOUR_FLOATS, b"x"],
    "huge-shape": [_pack("reply", 1, {"y": ["<f4", [0, 2**62], 1]}), b""],
    "random-frames": [bytes(range(256)) * 4, b"\x00" * 7, b"\xff" * 33],
    # Oversized inside a frame ZeroMQ accepts: a 2 MiB string, past the codec's 1 MiB bound.
    "oversized-string": [_pack("cancel", "x" * (2 << 20))],
}
# Where each role counts what it refused.
COUNTER = {"frontend": "malformed", "shard": "bad_messages", "rank": "bad_messages",
           "backend": "bad_messages"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(fault_cluster(), ipc_base=tmp_path_factory.mktemp("frames")) as running:
        yield running


def _router_sockets(cluster: Cluster) -> dict[str, str]:
    """Every ROUTER of the running cluster: ``process/socket`` -> address."""
    assert cluster.supervisor is not None
    sockets = dict(cluster.supervisor.peers)
    sockets["supervisor/control"] = cluster.supervisor.control_address
    return sockets


def _refused(cluster: Cluster, process: str) -> int:
    if process == "supervisor":
        return cluster.supervisor_counters()["malformed"]
    role = process.split("-", maxsplit=1)[0]
    return int(cluster.stats(process)["counters"][COUNTER[role]])


def _send_all(address: str, identity: bytes) -> None:
    """Every refused message, then one frame past MAXMSGSIZE on a connection of its own."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = make_dealer(ctx, address, identity=identity)
        for frames in REFUSED.values():
            sock.send_multipart(frames)
        hog = make_dealer(ctx, address, identity=identity + b"-hog")
        # np.zeros maps zero pages lazily: 256 MiB costs almost nothing until it is read.
        huge = np.zeros(MAX_FRAME_BYTES + 1, np.uint8)
        hog.send_multipart([_pack("cancel", 1), huge.data], copy=False)
        sock.close(linger=5_000)  # delivered before the context goes
        hog.close(linger=0)
    finally:
        ctx.term()


def test_cluster_has_the_expected_routers(cluster: Cluster) -> None:
    assert sorted(_router_sockets(cluster)) == [
        "backend-0/plan", "backend-1/plan", "frontend-0/client", "frontend-0/data",
        "rank/rank", "shard-0/shard", "supervisor/control"]


@pytest.mark.parametrize("socket_name", [
    "frontend-0/client", "frontend-0/data", "shard-0/shard", "rank/rank", "backend-0/plan",
    "supervisor/control"])
def test_malformed_and_oversized_frames_leave_the_role_up(
        cluster: Cluster, socket_name: str) -> None:
    process = socket_name.split("/", maxsplit=1)[0]
    address = _router_sockets(cluster)[socket_name]
    pids = cluster.pids()
    incarnations = {name: cluster.incarnation(name) for name in pids}
    before = _refused(cluster, process)
    _send_all(address, b"fuzz-" + socket_name.replace("/", "-").encode())
    counted = [0]

    def all_refused() -> bool:
        counted[0] = _refused(cluster, process) - before
        return counted[0] >= len(REFUSED)

    wait_until(all_refused, lambda: f"{process} to count {len(REFUSED)} refused, not {counted[0]}",
               timeout_s=WAIT_S)
    assert counted[0] == len(REFUSED)  # the frame past MAXMSGSIZE never reached it
    assert cluster.pids() == pids
    assert {name: cluster.incarnation(name) for name in pids} == incarnations
    # A valid message of a kind this socket never gets is no reason to fall over either.
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        stray = make_dealer(ctx, address, identity=b"stray-" + socket_name.encode())
        stray.send_multipart(codec.encode(Heartbeat("stray", 1, 0.0)))
        stray.close(linger=5_000)
    finally:
        ctx.term()
    ledger = Ledger(cluster.config)
    load = Load(rate_rps=100.0, count=20)
    run = asyncio.run(drive(cluster.client_address, ledger, load))
    assert run.counts == {"OK": 20}, run.counts
    assert cluster.pids() == pids
