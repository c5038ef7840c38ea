"""The wire-protocol version in the handshakes (transport.messages.WIRE_PROTOCOL_VERSION): a
client whose ClientHello names another version has each request refused BAD_REQUEST with one
line naming both versions, over real sockets to a real frontend, and a current client on the
same frontend is served; a later version's handshake with more fields fails to decode as
WireVersionError naming both versions (not an arity error), over real sockets too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.core.errors import ProtocolError, WireVersionError
from zserve.frontend.core import FrontendCore
from zserve.transport import codec, socket_io
from zserve.transport.field_types import wire_fields
from zserve.transport.messages import (
    HANDSHAKES,
    WIRE_PROTOCOL_VERSION,
    BackendRegister,
    ClientHello,
    Hello,
    InferError,
    InferRequest,
    Ready,
)
from zserve.transport.sockets import make_dealer, make_router

OTHER_VERSION = WIRE_PROTOCOL_VERSION + 98


def _config() -> ClusterConfig:
    return parse_config({
        "cluster": {"drain_s": 2.0},
        "scheduler": {"shards": 0, "jitter_ms": 50.0},  # room for a loaded host
        "backends": {"count": 1, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0,
                                              "input_shape": [4]},
                    "slo_ms": 2000.0}],
    })


def test_a_client_of_another_wire_protocol_is_refused_with_both_versions(
        tmp_path: Path) -> None:
    inputs = {"x": np.ones((1, 4), np.float32)}
    with Cluster(_config(), ipc_base=tmp_path) as cluster:
        ctx: zmq.Context[Any] = zmq.Context.instance()
        raw = make_dealer(ctx, cluster.client_address, identity=b"old-client")
        try:
            socket_io.sync_send(raw, ClientHello(accepts=[], protocol=OTHER_VERSION))
            socket_io.sync_send(raw, InferRequest(1, "m", inputs, 0.0))
            assert raw.poll(10_000), "no answer to a mismatched client"
            _, answer = socket_io.sync_recv(raw, router=False)
        finally:
            raw.close(linger=0)
        assert isinstance(answer, InferError) and answer.request_id == 1
        assert answer.error == "BAD_REQUEST"
        assert (f"wire protocol version {OTHER_VERSION}, this process speaks version "
                f"{WIRE_PROTOCOL_VERSION}") in answer.message
        with zserve.Client(cluster.client_address, timeout=20) as client:  # current: served
            assert client.infer("m", inputs)["y"].shape[0] == 1


def test_a_backend_hello_of_another_wire_protocol_is_ignored() -> None:
    core = FrontendCore(name="frontend-0", cluster=_config(), index=0, data_address="ipc://x",
                        profiles={"m": None})
    core.on_backend_hello(0.0, Hello("backend", "backend-0", 100, protocol=OTHER_VERSION), [])
    assert core.backends.pids == {}
    core.on_backend_hello(0.0, Hello("backend", "backend-0", 100), [])
    assert core.backends.pids == {"backend-0": 100}


def _later_version(cls: type[Any], extra: list[Any]) -> bytes:
    """The header of ``cls`` as a later version might send it: this version's fields up to and
    including ``protocol`` (sample values), then fields of its own."""
    values = {"role": "backend", "name": "backend-0", "pid": 100, "accepts": [], "models": [],
              "endpoints": {}}
    head: list[Any] = [cls.KIND]
    for info in wire_fields(cls):
        if info.name == "protocol":
            return msgpack.packb([*head, OTHER_VERSION, *extra])
        head.append(values.get(info.name, 0))
    raise AssertionError(f"{cls.__name__} carries no protocol field")


@pytest.mark.parametrize("cls", HANDSHAKES, ids=lambda cls: cls.__name__)
def test_a_later_handshake_with_more_fields_names_both_versions(cls: type[Any]) -> None:
    later = _later_version(cls, ["a field of its own", 7, 8])
    with pytest.raises(WireVersionError) as refused:
        codec.decode([later])
    assert str(refused.value) == (
        f"a peer's {cls.__name__} speaks wire protocol version {OTHER_VERSION}, this process "
        f"speaks version {WIRE_PROTOCOL_VERSION}: upgrade the older side")


def test_malformed_handshakes_of_this_version_keep_their_errors() -> None:
    # One field fewer (a peer from before the field): the arity error, not a version error.
    fields = len(wire_fields(Hello))
    with pytest.raises(ProtocolError, match=f"Hello has {fields} fields") as before:
        codec.decode([msgpack.packb([Hello.KIND, "frontend", "frontend-0", 42])])
    assert not isinstance(before.value, WireVersionError)
    # This version with a stray trailing field: malformed, whatever ``protocol`` says.
    stray = msgpack.packb([ClientHello.KIND, [], WIRE_PROTOCOL_VERSION, "stray"])
    with pytest.raises(ProtocolError) as same:
        codec.decode([stray])
    assert not isinstance(same.value, WireVersionError)
    # A non-handshake never gets a version reading.
    with pytest.raises(ProtocolError) as other:
        codec.decode([msgpack.packb([InferError.KIND, 1, "x", "y", OTHER_VERSION, 0])])
    assert not isinstance(other.value, WireVersionError)


def test_a_later_handshake_over_real_sockets_is_refused_and_the_next_message_served(
        tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    router, address = make_router(ctx, f"ipc://{tmp_path}/handshakes")
    dealer = make_dealer(ctx, address, identity=b"later-peer")
    try:
        for cls in (BackendRegister, Ready):
            dealer.send(_later_version(cls, [{"new": 1}]))
        socket_io.sync_send(dealer, Hello("backend", "backend-0", 100))
        for cls in (BackendRegister, Ready):
            assert router.poll(10_000), "nothing arrived"
            with pytest.raises(WireVersionError, match=f"{cls.__name__} speaks wire protocol "
                               f"version {OTHER_VERSION}, this process speaks version "
                               f"{WIRE_PROTOCOL_VERSION}"):
                socket_io.sync_recv(router, router=True)
        assert router.poll(10_000), "the current Hello did not arrive"
        identity, hello = socket_io.sync_recv(router, router=True)  # consumed whole before it
        assert identity == b"later-peer" and hello == Hello("backend", "backend-0", 100)
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
