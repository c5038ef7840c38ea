"""Every malformed message is rejected with a typed error, and the receiving loop goes on: a raw
socket sends garbage, then a good message, and the good one arrives. Plus a Hypothesis fuzz of
decode: arbitrary frames raise only ProtocolError (MessageTooLargeError is one)."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transport_helpers import SAMPLE_MESSAGES, assert_messages_equal, recv_within, wait_readable

from zserve.core.errors import ProtocolError, TooLargeError
from zserve.transport import codec, socket_io
from zserve.transport.messages import WIRE_PROTOCOL_VERSION, CancelRequest
from zserve.transport.sockets import make_dealer, make_router

Pair = tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
GOOD = CancelRequest(request_id=42)


def _pack(*items: Any) -> bytes:
    return msgpack.packb(list(items))


def _array_header(descriptor: Any) -> bytes:
    return _pack("reply", 1, {"y": descriptor})


_VALID_HEADER = bytes(codec.encode(CancelRequest(5))[0])
_FOUR_FLOATS = np.zeros(4, dtype=np.float32).tobytes()

# name -> (frames after the identity, expected error type, message fragment)
MALFORMED: dict[str, tuple[list[bytes], type[Exception], str]] = {
    "truncated-msgpack": ([_VALID_HEADER[:-1]], ProtocolError, "not valid msgpack"),
    "not-msgpack": ([b"\xc1"], ProtocolError, "not valid msgpack"),
    "empty-header": ([b""], ProtocolError, "not valid msgpack"),
    "trailing-bytes": ([_VALID_HEADER + b"\x00"], ProtocolError, "not valid msgpack"),
    "header-not-array": ([msgpack.packb({"kind": "cancel"})], ProtocolError, "msgpack array"),
    "header-empty-array": ([_pack()], ProtocolError, "msgpack array"),
    "unknown-kind": ([_pack("nope", 1)], ProtocolError, "unknown message kind"),
    "kind-not-str": ([_pack(1, 1)], ProtocolError, "unknown message kind"),
    "too-few-fields": ([_pack("cancel")], ProtocolError, "has 1 fields"),
    "too-many-fields": ([_pack("cancel", 1, 2)], ProtocolError, "has 1 fields"),
    "str-for-int": ([_pack("cancel", "1")], ProtocolError, "CancelRequest.request_id"),
    "bool-for-int": ([_pack("cancel", True)], ProtocolError, "expected int"),
    "float-for-int": ([_pack("cancel", 1.0)], ProtocolError, "expected int"),
    "str-in-int-list": ([_pack("drop", [1, "2"], "E", "m")], ProtocolError, "list[int]"),
    "int-for-str": ([_pack("error", 1, 2, "m")], ProtocolError, "InferError.error"),
    "str-for-float": ([_pack("hb", "n", 1, "x", 0)], ProtocolError, "Heartbeat.sent_at"),
    "int-for-bool": ([_pack("statsreq", 1)], ProtocolError, "expected bool"),
    "nested-list-wrong": (
        [_pack("btable", [1], ["a"], ["x"], [["m", 2]], [], [], 0, [])],
        ProtocolError,
        "BackendTable.models",
    ),
    "int-map-key": ([b"\x93\xa5ready" + b"\x81\x01\x02"], ProtocolError, "not valid msgpack"),
    "bytes-map-key": ([_pack("ready", "r", "n", 1, {b"k": "v"}, WIRE_PROTOCOL_VERSION)],
                      ProtocolError, "endpoints"),
    "non-native-stats": (
        [_pack("stats", "n", {"x": msgpack.ExtType(1, b"z")})],
        ProtocolError,
        "extension type",
    ),
    "timestamp-ext": (
        [_pack("stats", "n", {"t": msgpack.Timestamp(1, 0)})],
        ProtocolError,
        "extension type",
    ),
    "array-for-scalar-field": (
        [_pack("cancel", ["<f4", [1], 1]), b"\x00" * 4],
        ProtocolError,
        "no arrays",
    ),
    "descriptor-not-list": ([_array_header("<f4"), _FOUR_FLOATS], ProtocolError, "descriptor"),
    "descriptor-short": ([_array_header(["<f4", [4]]), _FOUR_FLOATS], ProtocolError, "descriptor"),
    "dtype-complex": ([_array_header(["<c8", [2], 1]), _FOUR_FLOATS], ProtocolError, "not allowed"),
    "dtype-object": ([_array_header(["|O", [2], 1]), _FOUR_FLOATS], ProtocolError, "not allowed"),
    "dtype-big-endian": (
        [_array_header([">f4", [4], 1]), _FOUR_FLOATS],
        ProtocolError,
        "not allowed",
    ),
    "dtype-not-str": ([_array_header([5, [4], 1]), _FOUR_FLOATS], ProtocolError, "not allowed"),
    "shape-negative": ([_array_header(["<f4", [-4], 1]), _FOUR_FLOATS], ProtocolError, "shape"),
    "shape-not-list": ([_array_header(["<f4", 4, 1]), _FOUR_FLOATS], ProtocolError, "shape"),
    "shape-float": ([_array_header(["<f4", [4.0], 1]), _FOUR_FLOATS], ProtocolError, "shape"),
    "shape-too-many-dims": (
        [_array_header(["<f4", [1] * 40, 1]), b"\x00" * 4],
        ProtocolError,
        "shape",
    ),
    "shape-huge-dims": ([_array_header(["<f4", [0, 2**62], 1]), b""], ProtocolError, "shape"),
    "size-mismatch-short": (
        [_array_header(["<f4", [5], 1]), _FOUR_FLOATS],
        ProtocolError,
        "need 20",
    ),
    "size-mismatch-long": (
        [_array_header(["<f4", [3], 1]), _FOUR_FLOATS],
        ProtocolError,
        "need 12",
    ),
    "missing-frame": ([_array_header(["<f4", [4], 1])], ProtocolError, "outside frames"),
    "extra-frame": (
        [_array_header(["<f4", [4], 1]), _FOUR_FLOATS, b"x"],
        ProtocolError,
        "not referenced",
    ),
    "frame-index-zero": (
        [_array_header(["<f4", [4], 0]), _FOUR_FLOATS],
        ProtocolError,
        "outside frames",
    ),
    "frame-index-past-end": (
        [_array_header(["<f4", [4], 2]), _FOUR_FLOATS],
        ProtocolError,
        "outside frames",
    ),
    "frame-used-twice": (
        [_pack("reply", 1, {"a": ["<f4", [4], 1], "b": ["<f4", [4], 1]}), _FOUR_FLOATS],
        ProtocolError,
        "referenced twice",
    ),
    "bool-bytes-not-0-or-1": (
        [_array_header(["|b1", [2], 1]), b"\x01\x07"],
        ProtocolError,
        "other than 0 and 1",
    ),
    "tensor-map-not-dict": (
        [_pack("reply", 1, [["<f4", [4], 1]]), _FOUR_FLOATS],
        ProtocolError,
        "InferReply.outputs",
    ),
    # Small arrays travel inline: [dtype, shape, bytes] instead of a frame index.
    "inline-size-mismatch": (
        [_array_header(["<f4", [5], _FOUR_FLOATS])],
        ProtocolError,
        "inline array holds 16 bytes but dtype float32 and shape [5] need 20",
    ),
    "inline-data-float": ([_array_header(["<f4", [4], 1.0])], ProtocolError, "frame index or"),
    "inline-data-str": ([_array_header(["<f4", [1], "abcd"])], ProtocolError, "frame index or"),
    "inline-data-bool": ([_array_header(["<f4", [4], True])], ProtocolError, "frame index or"),
    "inline-bool-not-0-or-1": (
        [_array_header(["|b1", [2], b"\x01\x07"])],
        ProtocolError,
        "other than 0 and 1",
    ),
    "inline-with-stray-frame": (
        [_array_header(["<f4", [4], _FOUR_FLOATS]), _FOUR_FLOATS],
        ProtocolError,
        "not referenced",
    ),
    "inline-bad-shape": ([_array_header(["<f4", [-4], b""])], ProtocolError, "shape"),
    "answers-outputs-shorter": (
        [_pack("answers", [1, 2], [{}], [], [], [])],
        ProtocolError,
        "parallel lists differ in length (request_ids 2, outputs 1)",
    ),
    "answers-messages-shorter": (
        [_pack("answers", [], [], [4], ["DEADLINE"], [])],
        ProtocolError,
        "parallel lists differ in length (error_ids 1, errors 1, messages 0)",
    ),
    "answers-output-not-map": (
        [_pack("answers", [1], [5], [], [], [])],
        ProtocolError,
        "InferAnswers.outputs",
    ),
    "answers-error-not-str": (
        [_pack("answers", [], [], [1], [7], ["m"])],
        ProtocolError,
        "InferAnswers.errors",
    ),
    "answers-too-few-fields": (
        [_pack("answers", [1], [{}])],
        ProtocolError,
        "has 5 fields",
    ),
    "client-hello-not-list": (
        [_pack("chello", "answers", WIRE_PROTOCOL_VERSION)], ProtocolError,
        "ClientHello.accepts"),
}

TIGHT = codec.DecodeLimits(
    max_message_bytes=1024, max_header_bytes=512, max_frames=4, max_str_bytes=64,
    max_array_items=16, max_map_items=8,
)  # fmt: skip
# name -> (frames, limits): exceeding a codec size limit raises MessageTooLargeError.
OVERSIZED: dict[str, list[bytes]] = {
    "message-bytes": [_array_header(["|u1", [2000], 1]), b"\x00" * 2000],
    "header-bytes": [_pack("stats", "n", {"k": ["v" * 40] * 15})],
    "frame-count": [_pack("reply", 1, {}), b"", b"", b"", b""],
    "str-length": [_pack("cancel", "x" * 100)],
    "array-length": [_pack("drop", list(range(17)), "E", "m")],
    "map-length": [_pack("ready", "r", "n", 1, {f"k{i}": "v" for i in range(9)})],
}


def _send_raw(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    sock.send_multipart(frames)


@pytest.mark.parametrize("case", MALFORMED, ids=str)
def test_malformed_message_is_rejected_and_the_loop_goes_on(
    transport_pair: Pair, case: str
) -> None:
    frames, error, fragment = MALFORMED[case]
    router, dealer = transport_pair
    _send_raw(dealer, frames)
    socket_io.sync_send(dealer, GOOD)
    with pytest.raises(error, match=re.escape(fragment)):
        recv_within(router, router=True)
    identity, message = recv_within(router, router=True)
    assert identity == b"peer-0" and message == GOOD


@pytest.mark.parametrize("case", MALFORMED, ids=str)
def test_malformed_message_to_a_dealer_is_rejected(transport_pair: Pair, case: str) -> None:
    frames, error, fragment = MALFORMED[case]
    router, dealer = transport_pair
    socket_io.sync_send(dealer, GOOD)  # the router learns the dealer's identity
    recv_within(router, router=True)
    _send_raw(router, [b"peer-0", *frames])
    socket_io.sync_send(router, GOOD, identity=b"peer-0")
    with pytest.raises(error, match=re.escape(fragment)):
        recv_within(dealer, router=False)
    assert recv_within(dealer, router=False) == (None, GOOD)


@pytest.mark.parametrize("case", OVERSIZED, ids=str)
def test_codec_size_limits_raise_too_large(transport_pair: Pair, case: str) -> None:
    router, dealer = transport_pair
    _send_raw(dealer, OVERSIZED[case])
    socket_io.sync_send(dealer, GOOD)
    with pytest.raises(codec.MessageTooLargeError) as caught:
        recv_within(router, router=True, limits=TIGHT)
    # One except clause catches every decode failure; the wire kind says TOO_LARGE.
    assert isinstance(caught.value, ProtocolError) and isinstance(caught.value, TooLargeError)
    assert caught.value.kind == "TOO_LARGE"
    assert recv_within(router, router=True, limits=TIGHT) == (b"peer-0", GOOD)


def test_router_message_without_header_frame_is_rejected(transport_pair: Pair) -> None:
    router, dealer = transport_pair
    socket_io.sync_send(dealer, GOOD)
    recv_within(router, router=True)
    # A one-frame message read as routed has an identity and no header. A real ROUTER never
    # delivers that, so read a one-frame message arriving at the dealer as if it were routed.
    router.send_multipart([b"peer-0", b"only-one-frame"])
    wait_readable(dealer)
    with pytest.raises(ProtocolError, match="identity frame and a header frame"):
        socket_io.sync_recv(dealer, router=True)


def test_oversized_frame_is_dropped_by_maxmsgsize_and_the_router_goes_on(
    transport_ctx: zmq.Context[zmq.Socket[bytes]], transport_bind: str
) -> None:
    router, endpoint = make_router(transport_ctx, transport_bind, max_message_bytes=4096)
    hog = make_dealer(transport_ctx, endpoint, identity=b"hog")
    good = make_dealer(transport_ctx, endpoint, identity=b"good")
    try:
        # ZMQ drops the hog's connection on the oversized frame; nothing of it is delivered.
        hog.send_multipart([_array_header(["|u1", [8192], 1]), b"\x00" * 8192])
        socket_io.sync_send(good, GOOD)
        assert recv_within(router, router=True) == (b"good", GOOD)
        assert not router.poll(200, zmq.POLLIN)  # the oversized message never arrives
    finally:
        for sock in (hog, good, router):
            sock.close(linger=0)


# --------------------------------------------------------------------------- fuzzing

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # deterministic: the same examples on every run
    suppress_health_check=[HealthCheck.too_slow],
)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)
kinds = st.sampled_from([type(m).KIND for m in SAMPLE_MESSAGES] + ["", "bogus"])


def _decode_or_protocol_error(frames: list[Any]) -> None:
    """Decoding may succeed or raise ProtocolError; any other exception fails the test."""
    with contextlib.suppress(ProtocolError):
        codec.decode(frames)


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=5))
def test_decode_of_arbitrary_frames_raises_only_protocol_errors(frames: list[bytes]) -> None:
    _decode_or_protocol_error(frames)


@FUZZ
@given(kinds, st.lists(msgpack_values, max_size=9), st.lists(st.binary(max_size=64), max_size=3))
def test_decode_of_well_formed_msgpack_raises_only_protocol_errors(
    kind: str, fields: list[Any], buffers: list[bytes]
) -> None:
    _decode_or_protocol_error([msgpack.packb([kind, *fields]), *buffers])


@FUZZ
@given(st.sampled_from(SAMPLE_MESSAGES), st.data())
def test_decode_of_corrupted_messages_raises_only_protocol_errors(
    message: Any, data: st.DataObject
) -> None:
    frames = [bytearray(frame) for frame in codec.encode(message)]
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        frame = frames[data.draw(st.integers(min_value=0, max_value=len(frames) - 1))]
        if frame:
            position = data.draw(st.integers(min_value=0, max_value=len(frame) - 1))
            frame[position] = data.draw(st.integers(min_value=0, max_value=255))
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(min_value=0, max_value=len(frames[0])))
        frames[0] = frames[0][:cut]
    _decode_or_protocol_error([bytes(frame) for frame in frames])


def test_decoded_corruptions_still_satisfy_the_annotations() -> None:
    # A corruption that decodes must still give a well-typed message (spot check on one class).
    header = bytearray(codec.encode(CancelRequest(5))[0])
    header[-1] = 0x2A
    decoded = codec.decode([bytes(header)])
    assert decoded == CancelRequest(42)


def test_sample_round_trip_through_decode_only() -> None:
    for message in SAMPLE_MESSAGES:
        frames = [bytes(frame) for frame in codec.encode(message)]
        assert_messages_equal(codec.decode(frames), message)


def test_array_message_rejects_arrays_of_wrong_container() -> None:
    with pytest.raises(ProtocolError):
        codec.decode([_pack("reply", 1, {"y": 5})])
    with pytest.raises(ProtocolError):
        codec.decode([_pack("reply", 1, {"y": ["<f4", [1], 1]})], limits=TIGHT)
