"""The wire codec: typed messages <-> ZeroMQ multipart frames, with zero-copy arrays.

Layout of one message (after the identity frame a ROUTER adds or strips)::

    [header, buf0, buf1, ...]
    header = msgpack [KIND, field0, field1, ...]   # the Struct's fields in order
    array  = [dtype_str, shape, frame_index]       # in the header, where the array was
           | [dtype_str, shape, bytes]             # a small array, inline (arrays.INLINE_MAX_BYTES)

The messages are tagged ``array_like`` msgspec Structs (``messages``), so msgspec writes and
reads headers in C against the declared field types. Arrays are the one thing it does not know:
the encoder swaps them for descriptors before packing (``arrays.encode_tensor_map``), the decoder
rebuilds them in its ``dec_hook`` over the received frames. What msgspec does not check is
checked after it: the arity of classes with defaulted fields, parallel lists
(``Message.SAME_LENGTH``), msgpack-native values under ``Any``, and that every frame is used.
Decoding trusts nothing; every failure is a ``ProtocolError`` (``MessageTooLargeError`` for size
limits, which is both a ``ProtocolError`` and a ``TooLargeError``), so a receive loop needs one
``except``. A failed decode is explained by ``field_types.first_problem``, which names the first bad
field.

Decoded arrays are read-only views over the received frames or the header's inline bytes (no
copy) and keep them alive. Sending and receiving on sockets is ``zserve.transport.socket_io``.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
import numpy as np
import zmq

from zserve.core.errors import ProtocolError, TooLargeError, WireVersionError
from zserve.transport import field_types
from zserve.transport.arrays import INLINE_BUDGET_BYTES, EncodedFrames, decode_array
from zserve.transport.field_types import ArrayFieldEncoder, array_field_encoders, wire_fields
from zserve.transport.messages import (
    ALL_MESSAGES,
    HANDSHAKES,
    InferRequest,
    InferRequests,
    Message,
    protocol_mismatch,
)

Frames = list[bytes | memoryview]
FrameLike = zmq.Frame | bytes | bytearray | memoryview

# Decode limits (defaults of DecodeLimits). The message bound covers header plus all buffers;
# it matches the socket's MAXMSGSIZE so that whatever ZeroMQ accepts the codec can decode.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_FRAMES = 65_536
MAX_STR_BYTES = 1024 * 1024
MAX_BIN_BYTES = 1024 * 1024
MAX_ARRAY_ITEMS = 1 << 20
# A map entry takes at least 2 bytes, so this bound admits no more entries than a 1 MiB header
# can hold anyway: headers up to 1 MiB (arrays.INLINE_BUDGET_BYTES) then break no length limit
# and are decoded in one parse (see DecodeLimits.short_header_bytes).
MAX_MAP_ITEMS = 1 << 19


class MessageTooLargeError(TooLargeError, ProtocolError):
    """A received message exceeds a size limit. It is a ``TooLargeError`` (wire kind TOO_LARGE)
    and also a ``ProtocolError``, so a receive loop that catches ProtocolError catches it too."""


@dataclass(frozen=True)
class DecodeLimits:
    """Size bounds applied while decoding; the defaults suit every message zserve sends."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_header_bytes: int = MAX_HEADER_BYTES
    max_frames: int = MAX_FRAMES
    max_str_bytes: int = MAX_STR_BYTES
    max_bin_bytes: int = MAX_BIN_BYTES
    max_array_items: int = MAX_ARRAY_ITEMS
    max_map_items: int = MAX_MAP_ITEMS
    # msgpack's options for the bounded parse (``bounded_parse``).
    unpack_options: dict[str, Any] = field(init=False, repr=False, compare=False, hash=False)
    # A header up to this size cannot break a length limit (see ``decode``).
    short_header_bytes: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        options = {
            "raw": False,  # str stays str; invalid UTF-8 is an error
            "strict_map_key": True,  # map keys must be str or bytes
            "use_list": True,
            "max_str_len": self.max_str_bytes,
            "max_bin_len": self.max_bin_bytes,
            "max_array_len": self.max_array_items,
            "max_map_len": self.max_map_items,
            "max_ext_len": 0,  # no extension types on our wire
            "ext_hook": _refuse_ext,
        }
        object.__setattr__(self, "unpack_options", options)
        # In msgpack a string of L bytes takes at least L + 1 bytes, a bin L + 2, an array of
        # n items n + 1 and a map of n entries 2n + 1, so a header no longer than this cannot
        # break a length limit and needs no bounded parse.
        short = min(
            self.max_str_bytes + 1,
            self.max_bin_bytes + 2,
            self.max_array_items + 1,
            2 * self.max_map_items + 1,
        )
        object.__setattr__(self, "short_header_bytes", short)


def _refuse_ext(code: int, data: bytes | memoryview) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


DEFAULT_LIMITS = DecodeLimits()


def bounded_parse(header: bytes | memoryview, limits: DecodeLimits) -> Any:
    """Parse the header with ``limits`` into plain values; every failure becomes a typed error
    (``MessageTooLargeError`` for a length limit)."""
    try:
        return msgpack.unpackb(header, **limits.unpack_options)
    except ValueError as exc:
        text = str(exc) or type(exc).__name__
        if "max_ext_len" in text or "extension type" in text:
            raise ProtocolError("header holds a msgpack extension type; none is allowed") from None
        if "exceeds max" in text:
            raise MessageTooLargeError(f"header: {text}") from None
        raise ProtocolError(f"header is not valid msgpack: {text}") from None
    except Exception as exc:  # msgpack raises assorted types for garbage; none may escape raw
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None


# --------------------------------------------------------------------------- encode


def _encode_scalar(value: Any) -> Any:
    """msgspec's fallback for types it does not know: numpy scalars become Python scalars."""
    if isinstance(value, np.generic) and not isinstance(value, np.void | np.object_):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} in a msgpack field")


# Thread-safe: each call packs into a buffer of its own.
_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_scalar)
_pack = _ENCODER.encode

# Per class, the header positions of its array-holding fields and how to encode each (empty:
# msgspec packs the message as it is). A class missing here is not a wire message.
_ARRAY_FIELDS: dict[type[Message], tuple[tuple[int, ArrayFieldEncoder], ...]] = {
    cls: array_field_encoders(cls) for cls in ALL_MESSAGES
}


def encode(message: Message) -> Frames:
    """``[header, buf0, ...]`` for ``message``; send with ``send_multipart(frames, copy=False)``.

    Small arrays ride inside the header (``arrays.INLINE_MAX_BYTES``). Array frames are
    memoryviews of the arrays themselves (no copy); a non-contiguous or big-endian array is
    converted once, a CuPy array is staged to host once. Because the bytes are not copied, do not
    write into a sent array afterwards: ZeroMQ's I/O thread may still be reading it after
    ``send`` returns (the frame keeps the array alive, not unchanged).
    """
    array_fields = _ARRAY_FIELDS.get(type(message))
    if array_fields is None:
        raise ProtocolError(f"{type(message).__name__} is not a registered wire message")
    try:
        if not array_fields:
            return [_pack(message)]
        out = EncodedFrames()
        # [KIND, field0, ...] with each array-holding field replaced by its descriptors; the
        # header is packed last, once the array frames are appended.
        values = [message.KIND, *msgspec.structs.astuple(message)]
        for position, encode_field in array_fields:
            values[position] = encode_field(values[position], out)
        frames: Frames = out.frames
        frames[0] = _pack(values)
        return frames
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {type(message).__name__}: {exc}") from exc


def encoder_for_ids(template: Message) -> Callable[[int], Frames]:
    """An encoder of ``template`` with its first field, an int id, replaced: ``encode_id(7)``
    gives the frames ``encode(replace(template, <first field>=7))`` gives, for the cost of packing
    one int. For a sender that sends one message many times with only its id changing (the load
    generator's requests): the rest of the header is packed once, array frames are shared (so
    the template's arrays must not be written to while it is in use)."""
    cls = type(template)
    fields = wire_fields(cls)
    if not fields or fields[0].type is not int:
        raise TypeError(f"{cls.__name__}: the first field is not an int id")
    frames = encode(template)
    header = bytes(frames[0])
    # The header is [KIND, id, rest...] in msgpack: everything after the id is the same bytes
    # whatever the id is. The array prefix is that of an array of as many one-byte Nones.
    arity = len(fields) + 1
    prefix = _pack([None] * arity)[:-arity] + _pack(cls.KIND)
    first = _pack(getattr(template, fields[0].name))
    if not header.startswith(prefix + first):
        raise AssertionError(f"{cls.__name__}: unexpected header layout")
    rest = header[len(prefix) + len(first) :]
    array_frames = frames[1:]

    def encode_id(value: int) -> Frames:
        if type(value) is not int:
            raise ProtocolError(f"cannot encode {cls.__name__}: id {value!r:.40} is not an int")
        try:
            return [prefix + _pack(value) + rest, *array_frames]
        except OverflowError as exc:  # an int beyond msgpack's 64 bits
            raise ProtocolError(f"cannot encode {cls.__name__}: {exc}") from exc

    return encode_id


RequestBatchEncoder = Callable[[list[int], list[int]], Frames]


def _array_prefix(length: int) -> bytes:
    """The msgpack header of an array of ``length`` items (what precedes its items)."""
    return _pack([None] * length)[:-length] if length else _pack([])


_ARRAY_PREFIXES = [_array_prefix(n) for n in range(128)]
_INT_TYPE = {int}


def encoder_for_request_batches(templates: Sequence[InferRequest]) -> RequestBatchEncoder:
    """An encoder of ``InferRequests`` built from request templates: ``encode_batch(ids,
    which)`` gives the frames ``encode`` gives for the requests ``replace(templates[which[i]],
    request_id=ids[i])``, for the cost of packing the ids and joining bytes packed once per
    template (the load generator sends the same few requests over and over). A template whose
    arrays would not all ride inline, or a batch whose inline bytes would exceed one header's
    budget, is encoded by ``encode``."""
    models, inputs, slos, inline_bytes = [], [], [], []
    for template in templates:
        out = EncodedFrames()
        descriptors = _ARRAY_FIELDS[InferRequest][0][1](template.inputs, out)
        models.append(_pack(template.model))
        inputs.append(_pack(descriptors) if len(out.frames) == 1 else b"")  # b"": has frames
        slos.append(_pack(float(template.slo_ms)))
        inline_bytes.append(INLINE_BUDGET_BYTES - out.inline_left if len(out.frames) == 1
                            else INLINE_BUDGET_BYTES + 1)
    head = _array_prefix(5) + _pack(InferRequests.KIND)

    def encode_batch(request_ids: list[int], which: list[int]) -> Frames:
        count = len(which)
        if len(request_ids) != count or set(map(type, request_ids)) - _INT_TYPE:
            raise ProtocolError("cannot encode InferRequests: ids must be ints, one per request")
        if sum([inline_bytes[t] for t in which]) > INLINE_BUDGET_BYTES:
            return encode(InferRequests(
                list(request_ids), [templates[t].model for t in which],
                [templates[t].inputs for t in which], [templates[t].slo_ms for t in which]))
        try:
            parts = [head, _pack(request_ids)]
        except OverflowError as exc:  # an int beyond msgpack's 64 bits
            raise ProtocolError(f"cannot encode InferRequests: {exc}") from exc
        prefix = _ARRAY_PREFIXES[count] if count < len(_ARRAY_PREFIXES) else _array_prefix(count)
        for column in (models, inputs, slos):
            parts.append(prefix)
            parts.extend([column[t] for t in which])
        return [b"".join(parts)]

    return encode_batch


# --------------------------------------------------------------------------- decode


class _ReceivedFrames:
    """The buffer frames of the message a thread is decoding, for the decoder's ``dec_hook``;
    one per thread, since the hook runs Python code, during which another thread may decode."""

    __slots__ = ("buffers", "decoder", "used")

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.used: list[bool] = []
        self.decoder = _make_decoder(self.decode_array)

    def decode_array(self, hint: Any, descriptor: Any) -> Any:
        return decode_array(descriptor, self.buffers, self.used)


def _make_decoder(dec_hook: Callable[[Any, Any], Any]) -> msgspec.msgpack.Decoder[Message]:
    wire_union: Any = ALL_MESSAGES[0]
    for cls in ALL_MESSAGES[1:]:
        wire_union = wire_union | cls
    return msgspec.msgpack.Decoder(wire_union, dec_hook=dec_hook, ext_hook=_refuse_ext)


# The decoder of single-frame messages (the common case): their arrays are inline, so its hook
# needs no frames and it can be shared by every thread.
_NO_BUFFERS: list[memoryview] = []
_SINGLE_FRAME_DECODER = _make_decoder(
    lambda hint, descriptor: decode_array(descriptor, _NO_BUFFERS, [])
)
_received = threading.local()


def _frames_decoder(buffers: list[memoryview]) -> _ReceivedFrames:
    try:
        state: _ReceivedFrames = _received.state
    except AttributeError:
        state = _received.state = _ReceivedFrames()
    state.buffers = buffers
    state.used = [False] * len(buffers)
    return state


def _byte_view(frame: Any) -> memoryview:
    # memoryview(zmq.Frame) is zero-copy like Frame.buffer, and cheaper.
    try:
        view = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"a frame must be bytes-like, got {type(frame).__name__}") from None
    if view.ndim != 1 or view.format != "B":
        try:
            view = view.cast("B")
        except TypeError:
            raise ProtocolError("a frame must be a contiguous buffer") from None
    return view


_NBYTES = operator.attrgetter("nbytes")


def _split_frames(
    frames: Sequence[FrameLike], limits: DecodeLimits
) -> tuple[bytes | memoryview, list[memoryview]]:
    """The header and the buffer frames, with the frame-count and byte limits checked."""
    count = len(frames)
    if count == 0:
        raise ProtocolError("empty message: no header frame")
    if count > limits.max_frames:
        raise MessageTooLargeError(f"{count} frames exceed the limit of {limits.max_frames}")
    first = frames[0]
    header: bytes | memoryview
    if type(first) is bytes:  # what socket_io receives: msgspec reads bytes fastest
        header, header_bytes = first, len(first)
    else:
        header = _byte_view(first)
        header_bytes = header.nbytes
    if header_bytes > limits.max_header_bytes:
        raise MessageTooLargeError(
            f"header of {header_bytes} bytes exceeds the limit of {limits.max_header_bytes}"
        )
    if count == 1:
        return header, _NO_BUFFERS
    buffers = [_byte_view(frame) for frame in frames[1:]]
    total = header_bytes + sum(map(_NBYTES, buffers))
    if total > limits.max_message_bytes:
        raise MessageTooLargeError(
            f"message of {total} bytes exceeds the limit of {limits.max_message_bytes}"
        )
    return header, buffers


def decode(frames: Sequence[FrameLike], *, limits: DecodeLimits = DEFAULT_LIMITS) -> Message:
    """Validate ``[header, buf0, ...]`` and build its message; arrays are read-only zero-copy
    views that pin their frames. Raises ``ProtocolError`` (``MessageTooLargeError`` for sizes)."""
    header, buffers = _split_frames(frames, limits)
    if len(header) > limits.short_header_bytes:
        bounded_parse(header, limits)  # raises on a length limit; msgspec has none
    frames_unused = False
    try:
        if buffers:
            received = _frames_decoder(buffers)
            try:
                message = received.decoder.decode(header)
            finally:  # the thread's state must not pin this message's frames after it
                received.buffers = _NO_BUFFERS
            frames_unused = False in received.used
        else:
            message = _SINGLE_FRAME_DECODER.decode(header)
    except Exception as exc:  # msgspec's errors, a bad array descriptor (ProtocolError), ...
        raise _explain(header, buffers, limits, exc) from None
    check = _AFTER_DECODE.get(type(message))
    if frames_unused or (check is not None and not check(message, header)):
        raise _explain(header, buffers, limits, None)
    return message


def _explain(
    header: bytes | memoryview,
    buffers: list[memoryview],
    limits: DecodeLimits,
    cause: Exception | None,
) -> ProtocolError:
    """The error of a header that failed to decode or a check after it (the slow path)."""
    items = bounded_parse(header, limits)
    error: ProtocolError = (_version_problem(items)
                            or field_types.first_problem(items, buffers, cause))
    return error


# Where each handshake's header carries ``protocol`` (after the kind; fields are only appended).
_PROTOCOL_POSITION = {cls.KIND: (cls.__name__,
                                 1 + [f.name for f in wire_fields(cls)].index("protocol"))
                      for cls in HANDSHAKES}


def _version_problem(items: Any) -> WireVersionError | None:
    """A handshake that failed to decode and names another wire protocol version where this
    version has ``protocol`` (a later version appended fields): the line naming both versions.
    None for anything else (the usual error explains it)."""
    if not isinstance(items, list) or not items or not isinstance(items[0], str):
        return None
    name, position = _PROTOCOL_POSITION.get(items[0], ("", 0))
    if not position or len(items) <= position or type(items[position]) is not int:
        return None
    refusal = protocol_mismatch(f"a peer's {name}", items[position])
    return None if refusal is None else WireVersionError(refusal)


def recover_request_id(header: Any) -> int | None:
    """The request id of a message that failed to decode, if its header still names one (so a
    frontend can answer that request with a typed error)."""
    ids = recover_request_ids(header)
    return ids[0] if len(ids) == 1 and not _names_id_list(header) else None


def recover_request_ids(header: Any) -> list[int]:
    """The request ids a message that failed to decode still names: its int id
    (``InferRequest``) or its list of int ids (``InferRequests``); empty if none can be read."""
    value = _second_item(header)
    if type(value) is int:
        return [value]
    if type(value) is list and value and all(type(v) is int for v in value):
        return value
    return []


def _names_id_list(header: Any) -> bool:
    return type(_second_item(header)) is list


def _second_item(header: Any) -> Any:
    """The header's second item (a request's id field), read from its first 4 KiB; None when
    it cannot be read."""
    try:
        data = header.bytes if isinstance(header, zmq.Frame) else bytes(header)
        if len(data) > 4096:
            data = data[:4096]
        unpacker = msgpack.Unpacker(max_buffer_size=8192, raw=False, strict_map_key=False)
        unpacker.feed(data)
        size = unpacker.read_array_header()
        if size < 2:
            return None
        unpacker.skip()
        return unpacker.unpack()
    except Exception:
        return None


def _header_arity(header: bytes | memoryview) -> int:
    """The element count of the msgpack array that ``header`` starts with."""
    marker = header[0]
    if 0x90 <= marker <= 0x9F:
        return marker - 0x90
    width = 2 if marker == 0xDC else 4  # array16 or array32
    return int.from_bytes(header[1 : 1 + width], "big")


def _after_decode_check(cls: type[Message]) -> Callable[[Any, Any], bool] | None:
    """What ``cls`` needs checked beyond msgspec's decode, or None: the arity (msgspec fills
    missing trailing fields with their defaults; on our wire every field is sent), parallel
    lists' lengths and msgpack-native values under ``Any``."""
    fields = wire_fields(cls)
    arity = len(fields) + 1 if any(f.required is False for f in fields) else 0
    groups = cls.SAME_LENGTH
    native = tuple(f.name for f in fields if field_types.has_native_values(f.type))
    if not (arity or groups or native):
        return None

    def check(message: Any, header: Any) -> bool:
        if arity and _header_arity(header) != arity:
            return False
        for group in groups:
            lengths = {len(getattr(message, name)) for name in group}
            if len(lengths) > 1:
                return False
        return all(field_types.is_native(getattr(message, name)) for name in native)

    return check


_AFTER_DECODE: dict[type[Message], Callable[[Any, Any], bool]] = {
    cls: check for cls in ALL_MESSAGES if (check := _after_decode_check(cls)) is not None
}
