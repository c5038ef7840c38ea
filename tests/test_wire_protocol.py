"""The wire-protocol version in the handshakes (transport.messages.WIRE_PROTOCOL_VERSION): a
client whose ClientHello names another version has each request refused BAD_REQUEST with one
line naming both versions, over real sockets to a real frontend, and a current client on the
same frontend is served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import zmq

import zserve
from zserve.config import ClusterConfig, parse_config
from zserve.frontend_core import FrontendCore
from zserve.supervisor import Cluster
from zserve.transport import socket_io
from zserve.transport.messages import (
    WIRE_PROTOCOL_VERSION,
    ClientHello,
    Hello,
    InferError,
    InferRequest,
)
from zserve.transport.sockets import make_dealer

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
    assert core.backend_pids == {}
    core.on_backend_hello(0.0, Hello("backend", "backend-0", 100), [])
    assert core.backend_pids == {"backend-0": 100}
