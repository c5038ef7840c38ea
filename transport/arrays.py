"""Array descriptors: how one numpy array becomes a descriptor in the msgpack header (plus, for a
large array, a buffer frame of its own), and how a received descriptor becomes a read-only array
over the very same memory.

An array travels as a descriptor ``[dtype_str, shape, data]`` inside the msgpack header. ``data``
is either the array's bytes themselves (a msgpack bin: arrays of at most ``INLINE_MAX_BYTES``) or
the index of the frame of the multipart message that holds them (larger arrays). For a frame the
sender hands ZeroMQ a memoryview of the array (``copy=False``), and the receiver wraps the
received frame's buffer: no copy on either side for contiguous host arrays. An inline array is
copied once into the header and read in place from the parsed header's bytes.

Device (CuPy) arrays cross to the host at exactly one place, ``stage_device_array``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zserve.core.errors import ProtocolError

# The dtypes allowed on the wire, keyed by their native-byte-order ``dtype.str`` ('<f4', '|b1').
# Object, string, datetime, structured and complex dtypes are refused: a model tensor never
# needs them and some of them (object) cannot be received without executing code.
ALLOWED_DTYPE_NAMES: tuple[str, ...] = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
)
ALLOWED_DTYPES: dict[str, np.dtype[Any]] = {
    np.dtype(name).str: np.dtype(name) for name in ALLOWED_DTYPE_NAMES
}
# numpy itself supports 64 dimensions; nothing we serve needs more than a handful.
MAX_ARRAY_NDIM = 32
# Bounds each dimension so that a hostile shape like [0, 2**62] cannot make numpy overflow.
MAX_ARRAY_DIM = 1 << 40
# Arrays of at most this many bytes travel inside the header instead of as a frame of their own.
# ZeroMQ copies frames this small anyway (the codec sends frames under 64 KiB by copy), and every
# frame costs a send and a receive call plus a message part in libzmq on both sides, which for
# the few floats of a typical request or reply is most of the message's cost. Measured here
# (encode, send, receive and decode one reply over ipc, CPU time): inline is 15-25% cheaper from
# 16 bytes to 64 KiB; the bound stays well below 64 KiB so that headers stay small enough for the
# decoder's fast parse (codec.DecodeLimits.short_header_bytes) in the common case.
INLINE_MAX_BYTES = 16 * 1024
# At most this many array bytes are inlined into one header; the arrays past it go as frames. It
# keeps the header of a message with many small arrays (a large batch's inputs or outputs) far
# below the decoder's header bound (codec.MAX_HEADER_BYTES, 16 MiB), and, with the descriptors
# and ids around them, under 1 MiB, which the decoder parses once (DecodeLimits).
INLINE_BUDGET_BYTES = 960 * 1024

# dtype -> wire name: a dict lookup is several times cheaper than ``dtype.str``, which builds a
# new string on every call. numpy dtypes compare (and hash) by value, so an equivalent dtype
# ('longlong' for 'int64') finds its entry; a byte-swapped one does not.
_WIRE_DTYPE_STR: dict[np.dtype[Any], str] = {dtype: name for name, dtype in ALLOWED_DTYPES.items()}
_BOOL_DTYPE = ALLOWED_DTYPES[np.dtype(bool).str]

ArrayDescriptor = list[Any]  # [dtype_str, shape, inline bytes or frame_index]


class EncodedFrames:
    """The frames of one message being encoded: ``frames[0]`` is the header's place (filled
    last), array frames follow; ``inline_left`` is how many more array bytes may still ride
    inside the header (``INLINE_BUDGET_BYTES`` per message)."""

    __slots__ = ("frames", "inline_left")

    def __init__(self, inline_budget: int = INLINE_BUDGET_BYTES) -> None:
        self.frames: list[Any] = [b""]
        self.inline_left = inline_budget


def stage_device_array(array: Any) -> np.ndarray[Any, Any]:
    """The single device-to-host boundary: a CuPy array is copied to host memory here.

    This is the seam where CUDA IPC handles would go for peers on the same host (send a
    ``cupy.cuda.runtime.ipcGetMemHandle`` descriptor instead of the bytes); until then every
    device array is staged with ``cupy.asnumpy`` once, when its message is encoded.
    """
    module = type(array).__module__.partition(".")[0]
    if module == "cupy":
        import cupy  # deferred: importing CuPy initialises CUDA, which hosts without GPUs lack

        if isinstance(array, cupy.ndarray):
            host: np.ndarray[Any, Any] = cupy.asnumpy(array)
            return host
    if isinstance(array, np.ndarray | np.generic):  # a subclass (memmap) or a numpy scalar
        return np.asarray(array)
    raise ProtocolError(f"expected a numpy or cupy array, got {type(array).__name__}")


def encode_array(value: Any, out: EncodedFrames) -> ArrayDescriptor:
    """The header descriptor of ``value``: its bytes inline when it is small (see
    ``INLINE_MAX_BYTES``), else appended to ``out.frames`` as a frame of its own (no copy when it
    is a contiguous host array; the frame keeps the array alive until ZeroMQ sent it)."""
    array = value if type(value) is np.ndarray else stage_device_array(value)
    dtype_str = _WIRE_DTYPE_STR.get(array.dtype)
    if dtype_str is None:
        dtype = array.dtype
        native = dtype.newbyteorder("=")
        if native.str not in ALLOWED_DTYPES:
            raise ProtocolError(
                f"dtype {dtype} is not allowed on the wire "
                f"(allowed: {', '.join(ALLOWED_DTYPE_NAMES)})"
            )
        array = array.astype(native, order="C")  # big-endian: one copy, contiguous too
        dtype_str = native.str
    nbytes = array.nbytes
    if nbytes <= INLINE_MAX_BYTES and nbytes <= out.inline_left:
        out.inline_left -= nbytes
        return [dtype_str, list(array.shape), array.tobytes()]  # C order, strided or not
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)  # the one copy a strided view needs
    frames = out.frames
    frames.append(array.data.cast("B") if nbytes else b"")
    return [dtype_str, list(array.shape), len(frames) - 1]


def encode_tensor_map(value: Any, out: EncodedFrames) -> dict[str, ArrayDescriptor]:
    """``{name: descriptor}`` for a ``{name: array}`` map: ``encode_array`` on each, with the
    common case (a small host array of an allowed dtype, inlined) done in the loop itself, since
    every request and reply carries such a map."""
    if type(value) is not dict:
        raise ProtocolError(f"expected a dict, got {type(value).__name__}")
    descriptors: dict[str, ArrayDescriptor] = {}
    wire_dtype_str = _WIRE_DTYPE_STR
    for name, array in value.items():
        dtype_str = wire_dtype_str.get(array.dtype) if type(array) is np.ndarray else None
        if dtype_str is not None:
            nbytes = array.nbytes
            if nbytes <= INLINE_MAX_BYTES and nbytes <= out.inline_left:
                out.inline_left -= nbytes
                descriptors[name] = [dtype_str, list(array.shape), array.tobytes()]
                continue
        descriptors[name] = encode_array(array, out)
    return descriptors


def decode_array(descriptor: Any, buffers: list[memoryview], used: list[bool]) -> Any:
    """Rebuild the array named by ``descriptor``: over its inline bytes, or over
    ``buffers[index - 1]`` for a frame index, without copying either.

    The array is read-only and pins the received frame (or header value) for as long as it
    lives; copy it (``array.copy()``) to keep a small part of a large message without keeping
    the whole frame.
    """
    if type(descriptor) is not list or len(descriptor) != 3:
        raise ProtocolError(
            f"array descriptor must be [dtype, shape, frame or bytes], got {descriptor!r:.80}"
        )
    dtype_str, shape, data = descriptor
    dtype = ALLOWED_DTYPES.get(dtype_str) if type(dtype_str) is str else None
    if dtype is None:
        raise ProtocolError(
            f"array dtype {dtype_str!r:.40} is not allowed "
            f"(allowed: {', '.join(ALLOWED_DTYPE_NAMES)}, native byte order)"
        )
    count = _element_count(shape)
    if type(data) is bytes:  # inline: the header's own bytes (immutable, so read-only)
        if len(data) != dtype.itemsize * count:
            raise _size_error("inline array", len(data), dtype, shape)
        # The constructor takes the shape at once: cheaper than frombuffer plus reshape.
        array = np.ndarray(shape, dtype, data)
    elif type(data) is int:  # bool is an int subclass; it is refused here on purpose
        array = _array_over_frame(data, buffers, used, dtype=dtype, shape=shape, count=count)
    else:
        raise ProtocolError(
            f"array data must be a frame index or bytes, got {type(data).__name__}"
        )
    if dtype is _BOOL_DTYPE and count and array.view(np.uint8).max() > 1:
        # numpy assumes bool bytes are 0 or 1; other values make comparisons inconsistent.
        where = "inline array" if type(data) is bytes else f"array frame {data}"
        raise ProtocolError(f"bool {where} holds bytes other than 0 and 1")
    return array


def _element_count(shape: Any) -> int:
    """The element count of a received shape, which must be a short list of sane sizes."""
    # A plain loop: tensors have a handful of dimensions, for which it is cheaper than set(),
    # min() and max() over the shape; it yields the element count on the way.
    if type(shape) is list and len(shape) <= MAX_ARRAY_NDIM:
        count = 1
        for dim in shape:
            if type(dim) is not int or not 0 <= dim <= MAX_ARRAY_DIM:
                break
            count *= dim
        else:
            return count
    raise ProtocolError(
        f"array shape must be a list of at most {MAX_ARRAY_NDIM} sizes, got {shape!r:.80}"
    )


def _array_over_frame(
    index: int,
    buffers: list[memoryview],
    used: list[bool],
    *,
    dtype: np.dtype[Any],
    shape: list[int],
    count: int,
) -> np.ndarray[Any, Any]:
    """A read-only array over buffer frame ``index`` (1-based), which it marks as used."""
    if not 1 <= index <= len(buffers):
        raise ProtocolError(f"array frame index {index!r:.40} is outside frames 1..{len(buffers)}")
    if used[index - 1]:
        raise ProtocolError(f"array frame {index} is referenced twice")
    used[index - 1] = True
    buffer = buffers[index - 1]
    if buffer.nbytes != dtype.itemsize * count:
        raise _size_error(f"array frame {index}", buffer.nbytes, dtype, shape)
    array: np.ndarray[Any, Any] = np.ndarray(shape, dtype, buffer)
    if array.flags.writeable:  # a bytearray or a writable frame view: callers must not write
        array.flags.writeable = False
    return array


def _size_error(where: str, nbytes: int, dtype: np.dtype[Any], shape: list[int]) -> ProtocolError:
    expected = dtype.itemsize * math.prod(shape)
    return ProtocolError(
        f"{where} holds {nbytes} bytes but dtype {dtype} and shape {shape} need {expected}"
    )
