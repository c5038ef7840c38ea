"""Zero-copy array frames: how one numpy array becomes a header descriptor plus a buffer frame,
and how a received frame becomes a read-only array over the very same memory.

An array travels as a descriptor ``[dtype_str, shape, frame_index]`` inside the msgpack header and
its bytes as frame ``frame_index`` of the multipart message. The sender hands ZeroMQ a memoryview
of the array (``send_multipart(copy=False)``), and the receiver wraps the received frame's buffer
with ``np.frombuffer``: no copy on either side for contiguous host arrays.

Device (CuPy) arrays cross to the host at exactly one place, ``stage_device_array``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zserve.errors import ProtocolError

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

_BOOL_DTYPE_STR = np.dtype(bool).str
_INT_ONLY = {int}

ArrayDescriptor = list[Any]  # [dtype_str, shape, frame_index]


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


def array_to_frame(value: Any, frames: list[Any]) -> ArrayDescriptor:
    """Append the bytes of ``value`` to ``frames`` (no copy when it is a contiguous host array)
    and return its header descriptor. The frame keeps the array alive until ZeroMQ sent it."""
    array = value if type(value) is np.ndarray else stage_device_array(value)
    dtype = array.dtype
    if dtype.str not in ALLOWED_DTYPES:
        native = dtype.newbyteorder("=")
        if native.str not in ALLOWED_DTYPES:
            raise ProtocolError(
                f"dtype {dtype} is not allowed on the wire "
                f"(allowed: {', '.join(ALLOWED_DTYPE_NAMES)})"
            )
        array = array.astype(native, order="C")  # big-endian: one copy, contiguous too
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)  # the one copy a strided view needs
    frames.append(array.data.cast("B") if array.size else b"")
    return [array.dtype.str, list(array.shape), len(frames) - 1]


def frame_to_array(descriptor: Any, buffers: list[memoryview], used: list[bool]) -> Any:
    """Rebuild the array named by ``descriptor`` over ``buffers[index - 1]`` without copying.

    The array is read-only and pins the received frame for as long as it lives; copy it
    (``array.copy()``) to keep a small part of a large message without keeping the whole frame.
    """
    if type(descriptor) is not list or len(descriptor) != 3:
        raise ProtocolError(
            f"array descriptor must be [dtype, shape, frame], got {descriptor!r:.80}"
        )
    dtype_str, shape, index = descriptor
    dtype = ALLOWED_DTYPES.get(dtype_str) if type(dtype_str) is str else None
    if dtype is None:
        raise ProtocolError(
            f"array dtype {dtype_str!r:.40} is not allowed "
            f"(allowed: {', '.join(ALLOWED_DTYPE_NAMES)}, native byte order)"
        )
    if (
        type(shape) is not list
        or len(shape) > MAX_ARRAY_NDIM
        or (
            shape
            and (set(map(type, shape)) != _INT_ONLY or min(shape) < 0 or max(shape) > MAX_ARRAY_DIM)
        )
    ):
        raise ProtocolError(
            f"array shape must be a list of at most {MAX_ARRAY_NDIM} sizes, got {shape!r:.80}"
        )
    if type(index) is not int or not 1 <= index <= len(buffers):
        raise ProtocolError(f"array frame index {index!r:.40} is outside frames 1..{len(buffers)}")
    if used[index - 1]:
        raise ProtocolError(f"array frame {index} is referenced twice")
    used[index - 1] = True
    buffer = buffers[index - 1]
    expected_bytes = dtype.itemsize * math.prod(shape)
    if buffer.nbytes != expected_bytes:
        raise ProtocolError(
            f"array frame {index} holds {buffer.nbytes} bytes but dtype {dtype} and shape "
            f"{shape} need {expected_bytes}"
        )
    array = np.frombuffer(buffer, dtype=dtype)
    if len(shape) != 1:
        array = array.reshape(shape)
    if not buffer.readonly:  # received zmq frames are read-only already; bytearrays are not
        array.flags.writeable = False
    if dtype_str == _BOOL_DTYPE_STR and expected_bytes and array.view(np.uint8).max() > 1:
        # numpy assumes bool bytes are 0 or 1; other values make comparisons inconsistent.
        raise ProtocolError(f"bool array frame {index} holds bytes other than 0 and 1")
    return array
