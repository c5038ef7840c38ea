"""The wire codec over real ROUTER/DEALER sockets (ipc and tcp): every message class and every
allowed dtype round-trips, arrays arrive without a copy, and the codec's own contracts hold."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import zmq
from transport_helpers import (
    SAMPLE_MESSAGES,
    assert_messages_equal,
    assert_values_equal,
    buffer_owner,
    recv_within,
    wait_readable,
)

from zserve.core.errors import ProtocolError
from zserve.transport import codec, socket_io
from zserve.transport.arrays import ALLOWED_DTYPE_NAMES, INLINE_BUDGET_BYTES, INLINE_MAX_BYTES
from zserve.transport.messages import (
    ALL_MESSAGES,
    BatchOutputs,
    CandidateUpdate,
    ClientHello,
    InferAnswers,
    InferReply,
    InferRequest,
    InferRequests,
    InputReply,
    Message,
    RequestMetaBatch,
    StatsReply,
)

Pair = tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
MIB = 1024 * 1024
# Element counts of int16 arrays just above and at the inline bound: a frame of their own, inline.
FRAMED_INT16 = INLINE_MAX_BYTES // 2 + 1
INLINE_INT16 = INLINE_MAX_BYTES // 2


def _round_trip(pair: Pair, message: Message) -> Message:
    """dealer -> router -> dealer, decoding on each side; returns what the dealer got back."""
    router, dealer = pair
    socket_io.sync_send(dealer, message)
    identity, at_router = recv_within(router, router=True)
    assert identity == b"peer-0"
    assert_messages_equal(at_router, message)
    socket_io.sync_send(router, at_router, identity=identity)
    peer, at_dealer = recv_within(dealer, router=False)
    assert peer is None
    return at_dealer


def test_samples_cover_every_message_class() -> None:
    assert [type(m) for m in SAMPLE_MESSAGES] == list(ALL_MESSAGES)
    assert len({cls.KIND for cls in ALL_MESSAGES}) == len(ALL_MESSAGES)


@pytest.mark.parametrize("message", SAMPLE_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_class_round_trips(transport_pair: Pair, message: Message) -> None:
    assert_messages_equal(_round_trip(transport_pair, message), message)


def test_header_layout_is_kind_then_fields_in_order() -> None:
    import msgpack

    message = CandidateUpdate("m", 4, 1.0, 2.0, 0.5, 3.0, True)
    (header,) = codec.encode(message)
    assert msgpack.unpackb(header) == ["cand", "m", 4, 1.0, 2.0, 0.5, 3.0, True, False, 0.0,
                                       math.inf]

    array = np.ones((1, FRAMED_INT16), dtype=np.int16)
    frames = codec.encode(InferReply(3, {"y": array}))
    assert msgpack.unpackb(frames[0]) == ["reply", 3, {"y": ["<i2", [1, FRAMED_INT16], 1]}]
    assert len(frames) == 2

    # A small array rides inside the header: its bytes instead of a frame index.
    small = np.arange(4, dtype=np.int16).reshape(2, 2)
    frames = codec.encode(InferReply(3, {"y": small}))
    assert msgpack.unpackb(frames[0]) == ["reply", 3, {"y": ["<i2", [2, 2], small.tobytes()]}]
    assert len(frames) == 1


SHAPES: dict[str, tuple[int, ...]] = {
    "scalar": (),
    "empty": (0,),
    "empty_2d": (3, 0),
    "vector": (5,),
    "four_d": (2, 3, 4, 5),
}


def _array_of(dtype_name: str, shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype_name)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) > 0.5)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype_name", ALLOWED_DTYPE_NAMES)
def test_every_allowed_dtype_and_shape_round_trips(transport_pair: Pair, dtype_name: str) -> None:
    inputs = {
        name: _array_of(dtype_name, shape, i) for i, (name, shape) in enumerate(SHAPES.items())
    }
    sent = InferRequest(1, "model", inputs)
    received = _round_trip(transport_pair, sent)
    assert_messages_equal(received, sent)
    assert isinstance(received, InferRequest)
    for array in received.inputs.values():
        assert not array.flags.writeable


def test_received_arrays_are_views_of_the_received_frames(transport_pair: Pair) -> None:
    router, dealer = transport_pair
    array = np.arange(100_000, dtype=np.float32)
    socket_io.sync_send(dealer, InputReply(9, [1, 2], [{"x": array}, {"x": array[::-1]}], []))
    wait_readable(router)
    frames = router.recv_multipart(copy=False)
    message = codec.decode(frames[1:])
    assert isinstance(message, InputReply)
    for index, inputs in enumerate(message.inputs):
        received = inputs["x"]
        frame = frames[2 + index]
        assert np.shares_memory(received, np.frombuffer(frame.buffer, dtype=np.uint8))
        assert not received.flags.writeable
    np.testing.assert_array_equal(message.inputs[1]["x"], array[::-1])


def test_sync_recv_does_not_copy_arrays(transport_pair: Pair) -> None:
    router, dealer = transport_pair
    socket_io.sync_send(dealer, InferReply(1, {"y": np.zeros(4096, dtype=np.float64)}))
    _, message = recv_within(router, router=True)
    assert isinstance(message, InferReply)
    assert isinstance(buffer_owner(message.outputs["y"]), zmq.Frame)


def test_encode_hands_contiguous_arrays_to_zmq_without_copy() -> None:
    array = np.arange(10 * FRAMED_INT16, dtype=np.int32).reshape(10, -1)
    frames = codec.encode(InferReply(1, {"y": array}))
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), array)


@pytest.mark.parametrize("rows", [6, 6 * FRAMED_INT16], ids=["inline", "framed"])
def test_non_contiguous_arrays_are_made_contiguous_once(transport_pair: Pair, rows: int) -> None:
    base = np.arange(rows * 8, dtype=np.float64).reshape(rows, 8)
    strided = base[::2, 1::3]
    transposed = base.T
    frames = codec.encode(InferReply(1, {"a": strided, "b": transposed}))
    for frame in frames[1:]:
        assert not np.shares_memory(np.frombuffer(frame, dtype=np.uint8), base)
    received = _round_trip(transport_pair, InferReply(1, {"a": strided, "b": transposed}))
    assert isinstance(received, InferReply)
    np.testing.assert_array_equal(received.outputs["a"], strided)
    np.testing.assert_array_equal(received.outputs["b"], transposed)


def test_small_arrays_travel_inline_and_arrive_read_only(transport_pair: Pair) -> None:
    inputs: dict[str, np.ndarray[Any, Any]] = {
        "tiny": np.arange(4, dtype=np.float32).reshape(1, 4),
        "at_bound": np.ones(INLINE_INT16, dtype=np.int16),
        "empty": np.zeros((3, 0), dtype=np.uint8),
        "scalar": np.array(True),
    }
    sent = InferRequest(1, "m", inputs)
    assert len(codec.encode(sent)) == 1  # the header alone
    received = _round_trip(transport_pair, sent)  # equal values, dtypes and shapes
    assert isinstance(received, InferRequest)
    assert not any(array.flags.writeable for array in received.inputs.values())


def test_inline_bytes_per_message_are_bounded() -> None:
    # Many small arrays: the first INLINE_BUDGET_BYTES of them ride in the header, the rest
    # get frames, so the header stays far below the decoder's bound.
    count = INLINE_BUDGET_BYTES // INLINE_MAX_BYTES + 3
    outputs = [{"y": np.full(INLINE_INT16, i, dtype=np.int16)} for i in range(count)]
    frames = codec.encode(BatchOutputs(1, list(range(count)), outputs))
    assert len(frames) == 1 + 3
    assert len(frames[0]) < INLINE_BUDGET_BYTES + 64 * 1024
    decoded = codec.decode([bytes(frame) for frame in frames])
    assert isinstance(decoded, BatchOutputs)
    for i, output in enumerate(decoded.outputs):
        assert output["y"].shape == (INLINE_INT16,) and int(output["y"][0]) == i


def test_infer_answers_round_trip(transport_pair: Pair) -> None:
    answers = InferAnswers(
        request_ids=[3, 1],
        outputs=[{"y": np.array([[1.5]], np.float32)}, {"y": np.array([[2.5]], np.float32)}],
        error_ids=[2],
        errors=["DEADLINE"],
        messages=["too late"],
    )
    assert_messages_equal(_round_trip(transport_pair, answers), answers)
    hello = ClientHello(accepts=[InferAnswers.KIND])
    assert _round_trip(transport_pair, hello) == hello


def test_parallel_lists_must_agree_in_length() -> None:
    import msgpack

    good = ["answers", [1], [{}], [2], ["DEADLINE"], ["m"]]
    assert isinstance(codec.decode([msgpack.packb(good)]), InferAnswers)
    for bad, names in (
        (["answers", [1, 2], [{}], [], [], []], "request_ids 2, outputs 1"),
        (["answers", [], [], [2], ["E"], []], "error_ids 1, errors 1, messages 0"),
    ):
        with pytest.raises(ProtocolError, match=names):
            codec.decode([msgpack.packb(bad)])


def test_encoder_for_ids_matches_encode() -> None:
    small = {"x": np.arange(4, dtype=np.float32).reshape(1, 4)}
    large = {"x": np.arange(FRAMED_INT16, dtype=np.int16)}
    for inputs in (small, large):
        encode_id = codec.encoder_for_ids(InferRequest(0, "m", inputs, 25.0))
        for request_id in (0, 1, 127, 128, 2**16, 2**40, -1, -(2**40)):
            frames = encode_id(request_id)
            expected = codec.encode(InferRequest(request_id, "m", inputs, 25.0))
            assert [bytes(f) for f in frames] == [bytes(f) for f in expected]
            decoded = codec.decode([bytes(f) for f in frames])
            assert isinstance(decoded, InferRequest) and decoded.request_id == request_id
    with pytest.raises(ProtocolError):
        encode_id(2**70)
    with pytest.raises(ProtocolError):
        encode_id(True)
    with pytest.raises(TypeError):
        codec.encoder_for_ids(StatsReply("p", {}))


def test_request_batch_encoder_matches_encode() -> None:
    small = InferRequest(0, "m", {"x": np.arange(4, dtype=np.float32).reshape(1, 4)}, 25.0)
    rows = InferRequest(0, "r", {"x": np.ones((3, 4), np.float32), "k": np.arange(3)}, 0.0)
    large = InferRequest(0, "big", {"x": np.arange(FRAMED_INT16, dtype=np.int16)}, 5.0)
    templates = [small, rows, large]
    encode_batch = codec.encoder_for_request_batches(templates)
    for which in ([0], [0, 1, 0], [1, 1], [2, 0], [0] * 100):
        ids = [2**40 - k if k % 2 else k for k in range(len(which))]
        frames = encode_batch(ids, which)
        expected = codec.encode(InferRequests(ids, [templates[t].model for t in which],
                                              [templates[t].inputs for t in which],
                                              [templates[t].slo_ms for t in which]))
        assert [bytes(f) for f in frames] == [bytes(f) for f in expected]
        decoded = codec.decode([bytes(f) for f in frames])
        assert isinstance(decoded, InferRequests)
        for request, t, rid in zip(decoded.requests(), which, ids, strict=True):
            assert request.request_id == rid and request.model == templates[t].model
            assert_values_equal(request.inputs, templates[t].inputs)
    # The inline budget is per header: past it, the batch is encoded with frames.
    many = INLINE_BUDGET_BYTES // INLINE_MAX_BYTES + 1
    wide = InferRequest(0, "w", {"x": np.zeros(INLINE_MAX_BYTES // 4, np.float32)}, 0.0)
    frames = codec.encoder_for_request_batches([wide])(list(range(many)), [0] * many)
    assert len(frames) > 1 and len(codec.decode(frames).request_ids) == many  # type: ignore[attr-defined]
    for ids in ([1, True], [2**70], [1, 2, 3]):
        with pytest.raises(ProtocolError):
            encode_batch(ids, [0, 0])


def test_request_ids_are_recovered_from_a_batch_that_fails_to_decode() -> None:
    batch = codec.encode(InferRequests([4, 5], ["m", "m"], [{}, {}], [0.0, 0.0]))[0]
    assert codec.recover_request_ids(batch) == [4, 5]
    assert codec.recover_request_id(batch) is None  # not one request's id
    single = codec.encode(InferRequest(6, "m", {}))[0]
    assert codec.recover_request_ids(single) == [6] and codec.recover_request_id(single) == 6
    assert codec.recover_request_ids(b"\x92\xa1x\x92\x01\xa1y") == []  # a str among the ids
    assert codec.recover_request_ids(b"garbage") == []


def test_big_endian_arrays_are_sent_in_native_order(transport_pair: Pair) -> None:
    router, dealer = transport_pair
    array = np.arange(10, dtype=">i4")
    socket_io.sync_send(dealer, InferReply(1, {"y": array}))
    _, received = recv_within(router, router=True)
    assert isinstance(received, InferReply)
    assert received.outputs["y"].dtype == np.dtype("int32")
    np.testing.assert_array_equal(received.outputs["y"], array)


def test_64_mib_array_round_trips_without_copy(transport_pair: Pair) -> None:
    router, dealer = transport_pair
    array = np.random.default_rng(1).integers(0, 255, size=64 * MIB, dtype=np.uint8)
    socket_io.sync_send(dealer, InferRequest(5, "big", {"x": array}))
    wait_readable(router)
    frames = router.recv_multipart(copy=False)
    message = codec.decode(frames[1:])
    assert isinstance(message, InferRequest)
    received = message.inputs["x"]
    assert received.nbytes == 64 * MIB
    assert np.shares_memory(received, np.frombuffer(frames[2].buffer, dtype=np.uint8))
    assert np.array_equal(received, array)


def test_ints_in_float_fields_become_floats() -> None:
    message = RequestMetaBatch("f", [1, 2], ["m", "m"], [1, 2.5], [3, 4])
    decoded = codec.decode(codec.encode(message))
    assert isinstance(decoded, RequestMetaBatch)
    assert decoded.arrivals == [1.0, 2.5] and decoded.deadlines == [3.0, 4.0]
    assert all(type(x) is float for x in decoded.arrivals + decoded.deadlines)
    update = codec.decode(codec.encode(CandidateUpdate("m", 1, 2, 3, 0)))
    assert isinstance(update, CandidateUpdate) and type(update.exec_at) is float


def test_numpy_scalars_in_plain_fields_are_encoded_as_python_scalars() -> None:
    message = CandidateUpdate("m", np.int64(3), np.float32(1.5), np.float64(2.0), 0.0)  # type: ignore[arg-type]
    decoded = codec.decode(codec.encode(message))
    assert decoded == CandidateUpdate("m", 3, 1.5, 2.0, 0.0)


def test_stats_carry_msgpack_native_values_only() -> None:
    stats = {"n": 1, "hist": [0.5, 1.5], "by_model": {"m": {"ok": 3}}, "none": None, "raw": b"x"}
    decoded = codec.decode(codec.encode(StatsReply("p", stats)))
    assert decoded == StatsReply("p", stats)


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (InferReply(1, {"y": np.zeros(2, dtype=np.complex64)}), "not allowed"),
        (InferReply(1, {"y": np.array(["a"], dtype=object)}), "not allowed"),
        (InferReply(1, {"y": np.zeros(2, dtype="datetime64[s]")}), "not allowed"),
        (InferReply(1, {"y": [1.0, 2.0]}), "expected a numpy or cupy array"),  # type: ignore[dict-item]
        (InferReply(1, [np.zeros(1)]), "expected a dict"),  # type: ignore[arg-type]
        (BatchOutputs(1, [1], {"a": np.zeros(1)}), "expected a list"),  # type: ignore[arg-type]
        (StatsReply("p", {"x": object()}), "cannot encode"),
        (CandidateUpdate("m", 2**70, 0.0, 0.0, 0.0), "cannot encode"),
    ],
    ids=[
        "complex",
        "object",
        "datetime",
        "list-not-array",
        "list-not-map",
        "map-not-list",
        "object-in-stats",
        "int-overflow",
    ],
)
def test_unencodable_messages_raise_protocol_error(message: Message, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        codec.encode(message)


def test_unregistered_class_is_refused() -> None:
    class Stray(Message, frozen=True):
        pass

    with pytest.raises(ProtocolError, match="not a registered wire message"):
        codec.encode(Stray())


def test_decode_accepts_bytes_memoryview_and_frames() -> None:
    array = np.arange(FRAMED_INT16, dtype=np.uint16)
    header, buffer = codec.encode(InferReply(2, {"y": array}))
    variants: tuple[list[zmq.Frame | bytes | bytearray | memoryview], ...] = (
        [bytes(header), bytes(buffer)],
        [memoryview(bytes(header)), memoryview(bytearray(buffer))],
        [zmq.Frame(bytes(header)), zmq.Frame(bytes(buffer))],
        [bytearray(header), np.frombuffer(bytes(buffer), dtype=np.uint16).data],
    )
    for frames in variants:
        decoded = codec.decode(frames)
        assert isinstance(decoded, InferReply)
        np.testing.assert_array_equal(decoded.outputs["y"], array)
        assert not decoded.outputs["y"].flags.writeable


@pytest.mark.gpu
def test_cupy_arrays_are_staged_to_host() -> None:
    cupy = pytest.importorskip("cupy")
    try:
        device = cupy.arange(10, dtype=cupy.float32)
    except Exception as exc:  # cupy present but no usable GPU
        pytest.skip(f"no CUDA device: {exc}")
    decoded = codec.decode(codec.encode(InferReply(1, {"y": device})))
    assert isinstance(decoded, InferReply)
    np.testing.assert_array_equal(decoded.outputs["y"], np.arange(10, dtype=np.float32))
