"""Helpers for the transport tests (tests/test_transport_*.py): sample messages built from the
wire annotations, a deep equality that understands arrays, and receives bounded by a timeout."""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import numpy as np
import zmq

from zserve.transport import codec, socket_io
from zserve.transport.messages import ALL_MESSAGES, Message

RECV_TIMEOUT_MS = 5_000


_SCALAR_SAMPLES: dict[Any, Any] = {
    bool: lambda seed: True,
    int: lambda seed: 7 + seed,
    float: lambda seed: 1.5 + seed,
    str: lambda seed: f"s{seed}",
    Any: lambda seed: {
        "count": 3, "ratio": 0.5, "tags": ["a", "b"], "nested": {"ok": True, "none": None}
    },
}


def sample_value(hint: Any, seed: int = 0) -> Any:
    """A deterministic value of the annotated type (arrays are small float32 grids)."""
    if hint is np.ndarray or typing.get_origin(hint) is np.ndarray:
        return np.arange(6, dtype=np.float32).reshape(2, 3) + seed
    if hint in _SCALAR_SAMPLES:
        return _SCALAR_SAMPLES[hint](seed)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return [sample_value(args[0], seed + i) for i in range(2)]
    if origin is dict:
        return {f"k{i}": sample_value(args[1], seed + i) for i in range(2)}
    raise TypeError(f"no sample for {hint!r}")


def sample_message(cls: type[Message]) -> Message:
    fields = msgspec.structs.fields(cls)
    values = [sample_value(f.type, i) for i, f in enumerate(fields)]
    return cls(*values)


SAMPLE_MESSAGES: list[Message] = [sample_message(cls) for cls in ALL_MESSAGES]


def assert_values_equal(received: Any, sent: Any, where: str = "message") -> None:
    if isinstance(sent, np.ndarray):
        assert isinstance(received, np.ndarray), where
        assert received.dtype == sent.dtype, where
        assert received.shape == sent.shape, where
        np.testing.assert_array_equal(received, sent, err_msg=where)
    elif isinstance(sent, dict):
        assert isinstance(received, dict) and list(received) == list(sent), where
        for key in sent:
            assert_values_equal(received[key], sent[key], f"{where}[{key!r}]")
    elif isinstance(sent, list):
        assert isinstance(received, list) and len(received) == len(sent), where
        for index, (got, want) in enumerate(zip(received, sent, strict=True)):
            assert_values_equal(got, want, f"{where}[{index}]")
    else:
        assert type(received) is type(sent) and received == sent, f"{where}: {received!r}"


def assert_messages_equal(received: Message, sent: Message) -> None:
    assert type(received) is type(sent)
    for f in msgspec.structs.fields(sent):
        assert_values_equal(
            getattr(received, f.name), getattr(sent, f.name), f"{type(sent).__name__}.{f.name}"
        )


def wait_readable(sock: zmq.Socket[Any], timeout_ms: int = RECV_TIMEOUT_MS) -> None:
    """Fail (rather than hang) when nothing arrives in time."""
    assert sock.poll(timeout_ms, zmq.POLLIN), f"nothing arrived within {timeout_ms} ms"


def recv_within(
    sock: zmq.Socket[Any], *, router: bool, limits: codec.DecodeLimits = codec.DEFAULT_LIMITS
) -> tuple[bytes | None, Message]:
    wait_readable(sock)
    return socket_io.sync_recv(sock, router=router, limits=limits)


def buffer_owner(array: np.ndarray[Any, Any]) -> Any:
    """The object at the bottom of an array's base chain (the memory's owner)."""
    base: Any = array
    while True:
        if isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        elif isinstance(base, memoryview):
            base = base.obj
        else:
            return base
