"""The wire codec: typed messages <-> ZeroMQ multipart frames, with zero-copy arrays.

Layout of one message (after the identity frame a ROUTER adds or strips)::

    [header, buf0, buf1, ...]
    header = msgpack [KIND, field0, field1, ...]   # dataclass field order
    array  = [dtype_str, shape, frame_index]       # in the header, where the array was
           | [dtype_str, shape, bytes]             # a small array, inline (arrays.INLINE_MAX_BYTES)

Encoding and decoding are compiled once per message class at import time from the dataclass
annotations (``typing.get_type_hints``): no per-message reflection. Decoding trusts nothing: the
msgpack parser runs with bounded lengths and no extension types, the kind, the arity and every
field's type are checked against the annotation, parallel lists (``Message.SAME_LENGTH``) must
agree in length, and each array's dtype, shape and frame or inline size must agree. Every failure
is a ``ProtocolError`` (``MessageTooLargeError`` for size limits, which is both a
``ProtocolError`` and a ``TooLargeError``), so a receive loop needs one ``except``.

Decoded arrays are read-only views over the received frames or the header's inline bytes (no
copy) and keep them alive.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import threading
import types
import typing
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from zserve.errors import ProtocolError, TooLargeError
from zserve.transport.arrays import (
    INLINE_BUDGET_BYTES,
    NO_INLINE,
    EncodedFrames,
    decode_array,
    encode_array,
    encode_tensor_map,
)
from zserve.transport.messages import ALL_MESSAGES, Message
from zserve.transport.sockets import typed_send_error

log = logging.getLogger(__name__)

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
MAX_MAP_ITEMS = 1 << 16
# Depth bound of msgpack-native values in ``dict[str, Any]`` fields.
MAX_NATIVE_DEPTH = 32


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
    unpack_options: dict[str, Any] = field(init=False, repr=False, compare=False, hash=False)
    # Headers up to this size are parsed with two options instead of nine (see ``decode``).
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
        # A header no longer than every length limit is parsed with msgpack's default bounds,
        # which it derives from the header's own size: they are then at least as strict as
        # ours, and a complete object cannot declare more than that size anyway, so such a
        # parse accepts exactly the headers the full options accept, into the same values
        # (raw, strict_map_key and use_list are msgpack's defaults too). Only the ban on
        # extension types is passed. Two keyword options instead of nine halve the cost of
        # parsing a small header; a header it refuses is parsed again with every option, for
        # the precise error.
        short = min(
            self.max_str_bytes, self.max_bin_bytes, self.max_array_items, self.max_map_items
        )
        object.__setattr__(self, "short_header_bytes", short)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


DEFAULT_LIMITS = DecodeLimits()


# --------------------------------------------------------------------------- field validators

_Check = Callable[[Any, Any], Any]  # (value, array context) -> value to store; raises _Mismatch


class _Mismatch(Exception):
    """A field value does not fit its annotation (becomes a ProtocolError naming the field)."""


class _ArrayContext:
    """The buffers of one message while its header is validated."""

    __slots__ = ("buffers", "used")

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers
        self.used = [False] * len(buffers)


# The context of every message without buffer frames (all its arrays inline, the common case):
# shared, since nothing marks a frame of it as used (there is none to refer to).
_NO_FRAMES = _ArrayContext([])


def _check_int(value: Any, ctx: Any) -> Any:
    if type(value) is not int:  # bool is an int subclass; it is refused here on purpose
        raise _Mismatch
    return value


def _check_float(value: Any, ctx: Any) -> Any:
    cls = type(value)
    if cls is float:
        return value
    if cls is int:
        return float(value)
    raise _Mismatch


def _check_str(value: Any, ctx: Any) -> Any:
    if type(value) is not str:
        raise _Mismatch
    return value


def _check_bool(value: Any, ctx: Any) -> Any:
    if type(value) is not bool:
        raise _Mismatch
    return value


def _check_bytes(value: Any, ctx: Any) -> Any:
    if type(value) is not bytes:
        raise _Mismatch
    return value


def _check_native(value: Any, ctx: Any, depth: int = 0) -> Any:
    """msgpack-native values only (what ``Any`` means on our wire)."""
    cls = type(value)
    if value is None or cls in (bool, int, float, str, bytes):
        return value
    if depth >= MAX_NATIVE_DEPTH:
        raise _Mismatch
    if cls is list:
        for item in value:
            _check_native(item, ctx, depth + 1)
        return value
    if cls is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise _Mismatch
            _check_native(item, ctx, depth + 1)
        return value
    raise _Mismatch


_INT_ONLY = {int}
_FLOAT_ONLY = {float}
_STR_ONLY = {str}


def _check_list_of_int(value: Any, ctx: Any) -> Any:
    # set(map(type, ...)) runs in C: much faster than a Python loop for long id lists.
    if type(value) is not list or (value and set(map(type, value)) != _INT_ONLY):
        raise _Mismatch
    return value


def _check_list_of_str(value: Any, ctx: Any) -> Any:
    if type(value) is not list or (value and set(map(type, value)) != _STR_ONLY):
        raise _Mismatch
    return value


def _check_list_of_float(value: Any, ctx: Any) -> Any:
    if type(value) is not list:
        raise _Mismatch
    if not value:
        return value
    kinds = set(map(type, value))
    if kinds == _FLOAT_ONLY:
        return value
    if kinds <= {float, int}:
        return [float(item) for item in value]
    raise _Mismatch


def _check_array(value: Any, ctx: Any) -> Any:
    if ctx is None:
        raise _Mismatch
    return decode_array(value, ctx.buffers, ctx.used)


def _check_tensor_map(value: Any, ctx: Any) -> Any:
    # TensorMap is on the data path of every request: one loop, no nested checker calls.
    if type(value) is not dict or ctx is None:
        raise _Mismatch
    arrays = {}
    for name, descriptor in value.items():
        if type(name) is not str:
            raise _Mismatch
        arrays[name] = decode_array(descriptor, ctx.buffers, ctx.used)
    return arrays


_SCALAR_CHECKS: dict[Any, _Check] = {
    int: _check_int,
    float: _check_float,
    str: _check_str,
    bool: _check_bool,
    bytes: _check_bytes,
    Any: _check_native,
}
_LIST_CHECKS: dict[Any, _Check] = {
    int: _check_list_of_int,
    float: _check_list_of_float,
    str: _check_list_of_str,
}


def _is_array_hint(hint: Any) -> bool:
    return hint is np.ndarray or typing.get_origin(hint) is np.ndarray


def _has_array(hint: Any) -> bool:
    return _is_array_hint(hint) or any(_has_array(arg) for arg in typing.get_args(hint))


def _compile_check(hint: Any) -> _Check:
    """The validator for one annotation; unsupported annotations fail at import, not at runtime."""
    if _is_array_hint(hint):
        return _check_array
    if hint in _SCALAR_CHECKS:
        return _SCALAR_CHECKS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and len(args) == 1:
        if args[0] in _LIST_CHECKS:
            return _LIST_CHECKS[args[0]]
        item_check = _compile_check(args[0])

        def check_list(value: Any, ctx: Any) -> Any:
            if type(value) is not list:
                raise _Mismatch
            return [item_check(item, ctx) for item in value]

        return check_list
    if origin is dict and len(args) == 2 and args[0] is str and _is_array_hint(args[1]):
        return _check_tensor_map
    if origin is dict and len(args) == 2 and args[0] is str:
        value_check = _compile_check(args[1])

        def check_dict(value: Any, ctx: Any) -> Any:
            if type(value) is not dict:
                raise _Mismatch
            # strict_map_key admits bytes keys too; our dicts are keyed by str only.
            if value and set(map(type, value)) != _STR_ONLY:
                raise _Mismatch
            return {key: value_check(item, ctx) for key, item in value.items()}

        return check_dict
    if origin in (typing.Union, types.UnionType):
        checks = [_compile_check(arg) for arg in args if arg is not type(None)]
        optional = type(None) in args

        def check_union(value: Any, ctx: Any) -> Any:
            if value is None and optional:
                return None
            for check in checks:
                try:
                    return check(value, ctx)
                except _Mismatch:
                    pass
            raise _Mismatch

        return check_union
    raise TypeError(f"wire field annotation {hint!r} has no codec support")


# --------------------------------------------------------------------------- per-class codecs


def _pack_default(value: Any) -> Any:
    """msgpack fallback for types it does not know: numpy scalars become Python scalars."""
    if isinstance(value, np.generic) and not isinstance(value, np.void | np.object_):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} in a msgpack field")


_packers = threading.local()


def _thread_pack() -> Callable[[Any], bytes]:
    """This thread's ``Packer.pack``. A reused Packer is ~40% faster than msgpack.packb, which
    builds one per call; it is per thread because ``default`` runs Python code, during which
    another thread could take the GIL and write into the same Packer buffer."""
    try:
        pack: Callable[[Any], bytes] = _packers.pack
    except AttributeError:
        pack = _packers.pack = msgpack.Packer(use_bin_type=True, default=_pack_default).pack
    return pack


def _array_encoder(hint: Any) -> Callable[[Any, EncodedFrames], Any]:
    """Replace the arrays inside one field value by descriptors (appending the frames of the
    large ones to ``out.frames``)."""
    if _is_array_hint(hint):
        return encode_array
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict and args[0] is str and _is_array_hint(args[1]):
        return encode_tensor_map
    if origin is dict:
        encode_value = _array_encoder(args[1])

        def encode_dict(value: Any, out: EncodedFrames) -> Any:
            if type(value) is not dict:
                raise ProtocolError(f"expected a dict, got {type(value).__name__}")
            return {key: encode_value(item, out) for key, item in value.items()}

        return encode_dict
    if origin is list:
        encode_item = _array_encoder(args[0])

        def encode_list(value: Any, out: EncodedFrames) -> Any:
            if not isinstance(value, list | tuple):
                raise ProtocolError(f"expected a list, got {type(value).__name__}")
            return [encode_item(item, out) for item in value]

        return encode_list
    raise TypeError(f"cannot encode arrays inside {hint!r}")


Encoder = Callable[[Message, int], Frames]  # (message, inline budget in bytes) -> frames
Decoder = Callable[[list[Any], list[memoryview]], Message]


@dataclass(frozen=True)
class _ClassCodec:
    cls: type[Message]
    encode: Encoder
    decode: Decoder


# The per-class encoders and the fast decoders are generated Python source, compiled once at
# import: straight-line code with one attribute read or one inline type test per field costs
# about half of what generic loops over per-field callables cost, and small messages are
# bounded by exactly this per-message CPU. Names in the source are field positions (f0, f1...)
# and message attributes, which are identifiers by construction (dataclass fields).


def _compile_source(source: str, name: str, namespace: dict[str, Any]) -> Any:
    exec(compile(source, f"<zserve codec: {name}>", "exec"), namespace)
    return namespace[name.partition(" ")[0]]


def _compile_encode(cls: type[Message], hints: list[Any], names: list[str]) -> Encoder:
    """``[header]`` (or ``[header, buf0, ...]``) for one class: the header list is built in one
    expression, array fields replaced in place by descriptors as their frames are appended."""
    namespace: dict[str, Any] = {
        "_kind": cls.KIND,
        "_packers": _packers,
        "_thread_pack": _thread_pack,
        "_EncodedFrames": EncodedFrames,
    }
    values = ["_kind"]
    has_arrays = False
    for index, (hint, name) in enumerate(zip(hints, names, strict=True)):
        if _has_array(hint):
            has_arrays = True
            namespace[f"_encode{index}"] = _array_encoder(hint)
            values.append(f"_encode{index}(message.{name}, out)")
        else:
            values.append(f"message.{name}")
    header = f"[{', '.join(values)}]"
    if has_arrays:
        # The arrays are encoded while the header list is built, so the header is packed last.
        body = (
            "    out = _EncodedFrames(inline_budget)\n"
            "    frames = out.frames\n"
            f"    frames[0] = pack({header})\n"
            "    return frames\n"
        )
    else:
        body = f"    return [pack({header})]\n"
    source = (
        "def encode(message, inline_budget):\n"
        "    try:\n"
        "        pack = _packers.pack\n"
        "    except AttributeError:\n"
        "        pack = _thread_pack()\n"
        f"{body}"
    )
    encode: Encoder = _compile_source(source, f"encode {cls.__name__}", namespace)
    return encode


def _compile_class(cls: type[Message]) -> _ClassCodec:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = tuple(f.name for f in fields)
    labels = tuple(f"{cls.__name__}.{f.name}: expected {f.type}" for f in fields)
    checks = tuple(_compile_check(hints[name]) for name in names)
    has_arrays = any(_has_array(hints[name]) for name in names)
    arity = len(names) + 1
    same_length = _same_length_positions(cls, names, hints)

    def decode(header: list[Any], buffers: list[memoryview]) -> Message:
        if len(header) != arity:
            raise ProtocolError(
                f"{cls.__name__} has {arity - 1} fields, the message carries {len(header) - 1}"
            )
        ctx = _ArrayContext(buffers) if has_arrays else None
        if buffers and ctx is None:
            raise ProtocolError(
                f"{cls.__name__} carries no arrays but came with {len(buffers)} frames"
            )
        try:
            values = [check(value, ctx) for check, value in zip(checks, header[1:], strict=True)]
        except _Mismatch:
            raise ProtocolError(_first_mismatch(labels, checks, header, buffers)) from None
        except ProtocolError as exc:  # a bad array: find which field holds it
            raise ProtocolError(_first_mismatch(labels, checks, header, buffers, exc)) from None
        if ctx is not None and not all(ctx.used):
            unused = [i + 1 for i, used in enumerate(ctx.used) if not used]
            raise ProtocolError(f"{cls.__name__}: frames {unused} are not referenced by the header")
        for group in same_length:
            lengths = [len(values[index]) for index in group]
            if min(lengths) != max(lengths):
                listed = ", ".join(f"{names[i]} {n}" for i, n in zip(group, lengths, strict=True))
                raise ProtocolError(f"{cls.__name__}: parallel lists differ in length ({listed})")
        return cls(*values)

    hint_list = [hints[name] for name in names]
    return _ClassCodec(
        cls,
        _compile_encode(cls, hint_list, list(names)),
        _compile_fast_decode(
            cls, hint_list, checks, has_arrays, decode, same_length=same_length
        ),
    )


def _same_length_positions(
    cls: type[Message], names: tuple[str, ...], hints: dict[str, Any]
) -> tuple[tuple[int, ...], ...]:
    """``cls.SAME_LENGTH`` as field positions; a group that names no list field fails at
    import, not at runtime."""
    groups = []
    for group in cls.SAME_LENGTH:
        for name in group:
            if name not in names or typing.get_origin(hints[name]) is not list:
                raise TypeError(f"{cls.__name__}.SAME_LENGTH: {name!r} is not a list field")
        if len(group) < 2:
            raise TypeError(f"{cls.__name__}.SAME_LENGTH: a group needs two fields or more")
        groups.append(tuple(names.index(name) for name in group))
    return tuple(groups)


# Inline type tests for the generated fast path; a float field holding an int fails the inline
# test and takes the generic path, which converts it.
_INLINE_TESTS: dict[Any, str] = {
    int: "type({0}) is _int",
    float: "type({0}) is _float",
    str: "type({0}) is _str",
    bool: "type({0}) is _bool",
}
# The code object every dataclass-generated __init__ shares its file name with (``<string>``
# today); a class whose __init__ was written by hand does not match it.
_DATACLASS_INIT_FILE = DecodeLimits.__init__.__code__.co_filename


def _slot_setters(cls: type[Message]) -> list[Callable[[Any, Any], None]] | None:
    """The ``__set__`` of each field's slot descriptor, in field order, when storing into the
    slots of ``object.__new__(cls)`` is all that calling ``cls`` would do; else None.

    The frozen dataclass ``__init__`` stores each field through ``object.__setattr__``, which
    looks the slot descriptor up by name every time; calling the cached descriptors directly
    builds the same object in about 60% of the time."""
    init = cls.__dict__.get("__init__")
    code = getattr(init, "__code__", None)
    if (
        code is None
        or code.co_filename != _DATACLASS_INIT_FILE
        or hasattr(cls, "__post_init__")
        or cls.__new__ is not object.__new__
        or type(cls).__call__ is not type.__call__
    ):
        return None
    setters = []
    for f in dataclasses.fields(cls):
        descriptor = next((vars(k)[f.name] for k in cls.__mro__ if f.name in vars(k)), None)
        if not f.init or type(descriptor) is not types.MemberDescriptorType:
            return None
        setters.append(descriptor.__set__)
    return setters


def _compile_fast_decode(
    cls: type[Message],
    hints: list[Any],
    checks: tuple[_Check, ...],
    has_arrays: bool,
    generic: Decoder,
    *,
    same_length: tuple[tuple[int, ...], ...] = (),
) -> Decoder:
    """Generate the decoder of one class: one unpacking assignment, one boolean test of the
    scalar fields, a call of the checker of each container field, and the construction, with no
    per-field loop. Any failure (wrong arity, a wrong type, a bad array, stray frames) re-runs
    the generic decoder, which raises the precise error or converts ints in float fields."""
    names = [f"f{i}" for i in range(len(hints))]
    tests = [
        _INLINE_TESTS[h].format(n) for h, n in zip(hints, names, strict=True) if h in _INLINE_TESTS
    ]
    context = "ctx" if has_arrays else "None"
    values = [
        n if h in _INLINE_TESTS else f"_check{i}({n}, {context})"
        for i, (h, n) in enumerate(zip(hints, names, strict=True))
    ]
    checked = len(tests) < len(hints)  # some field calls a checker, which may raise
    setters = _slot_setters(cls)
    if setters is None:
        build = [f"message = _cls({', '.join(values)})"]
    else:
        build = ["message = _new(_cls)"] + [f"_set{i}(message, {v})" for i, v in enumerate(values)]
    if checked:
        build = [
            "try:",
            *(f"    {line}" for line in build),
            "except (_Mismatch, _ProtocolError):",
            "    return _generic(header, buffers)",
        ]
    # Parallel lists must agree in length (checked once every field passed its own check).
    final = [
        " == ".join(f"len({names[i]})" for i in group) for group in same_length
    ]
    if has_arrays:
        # Every frame must be claimed by exactly one descriptor (decode_array marks them).
        final.insert(0, "False not in ctx.used")
        build = ["ctx = _ArrayContext(buffers) if buffers else _NO_FRAMES", *build]
        guard = " and ".join(tests) or "True"
    else:
        guard = " and ".join(["not buffers", *tests])
    if final:
        build.append(f"if {' and '.join(final)}:")
    body = "".join(f"        {line}\n" for line in build)
    unpack_target = "".join(f"{n}, " for n in names)
    source = (
        "def decode(header, buffers):\n"
        "    try:\n"
        f"        _kind, {unpack_target}= header\n"
        "    except ValueError:\n"
        "        return _generic(header, buffers)\n"
        f"    if {guard}:\n"
        f"{body}"
        f"        {'    ' if final else ''}return message\n"
        "    return _generic(header, buffers)\n"
    )
    namespace: dict[str, Any] = {
        "_cls": cls,
        "_new": object.__new__,
        "_generic": generic,
        "_Mismatch": _Mismatch,
        "_ProtocolError": ProtocolError,
        "_ArrayContext": _ArrayContext,
        "_NO_FRAMES": _NO_FRAMES,
        "_int": int,
        "_float": float,
        "_str": str,
        "_bool": bool,
        **{f"_check{i}": check for i, check in enumerate(checks)},
        **{f"_set{i}": setter for i, setter in enumerate(setters or ())},
    }
    decode: Decoder = _compile_source(source, f"decode {cls.__name__}", namespace)
    return decode


def _first_mismatch(
    labels: tuple[str, ...],
    checks: tuple[_Check, ...],
    header: list[Any],
    buffers: list[memoryview],
    array_error: ProtocolError | None = None,
) -> str:
    """Slow path, run only after a check failed: name the first bad field."""
    ctx = _ArrayContext(buffers)
    for index, check in enumerate(checks, 1):
        try:
            check(header[index], ctx)
        except _Mismatch:
            return f"{labels[index - 1]}, got {_describe(header[index])}"
        except ProtocolError as exc:
            return f"{labels[index - 1]}: {exc.message}"
    return array_error.message if array_error is not None else "invalid field"


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


_CODECS_BY_CLASS: dict[type[Message], _ClassCodec] = {
    cls: _compile_class(cls) for cls in ALL_MESSAGES
}
_ENCODERS_BY_CLASS: dict[type[Message], Encoder] = {
    cls: codec.encode for cls, codec in _CODECS_BY_CLASS.items()
}
_DECODERS_BY_KIND: dict[str, Decoder] = {
    cls.KIND: codec.decode for cls, codec in _CODECS_BY_CLASS.items()
}
_NBYTES = operator.attrgetter("nbytes")


# --------------------------------------------------------------------------- encode / decode


def encode(message: Message, *, inline_arrays: bool = True) -> Frames:
    """``[header, buf0, ...]`` for ``message``; send with ``send_multipart(frames, copy=False)``.

    Small arrays ride inside the header (``arrays.INLINE_MAX_BYTES``); ``inline_arrays=False``
    sends every array as a frame of its own, for a peer that may predate inline arrays (the
    frontend's answers to a client that did not say ``ClientHello``). Array frames are
    memoryviews of the arrays themselves (no copy); a non-contiguous or big-endian array is
    converted once, a CuPy array is staged to host once. Because the bytes are not copied, do not
    write into a sent array afterwards: ZeroMQ's I/O thread may still be reading it after
    ``send`` returns (the frame keeps the array alive, not unchanged).
    """
    encoder = _ENCODERS_BY_CLASS.get(type(message))
    if encoder is None:
        raise ProtocolError(f"{type(message).__name__} is not a registered wire message")
    try:
        return encoder(message, INLINE_BUDGET_BYTES if inline_arrays else NO_INLINE)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {type(message).__name__}: {exc}") from exc


def encoder_for_ids(template: Message) -> Callable[[int], Frames]:
    """An encoder of ``template`` with its first field, an int id, replaced: ``encode_id(7)``
    gives the frames ``encode(replace(template, <first field>=7))`` gives, for the cost of packing
    one int. For a sender that sends one message many times with only its id changing (the load
    generator's requests): the rest of the header is packed once, array frames are shared (so
    the template's arrays must not be written to while it is in use)."""
    cls = type(template)
    fields = dataclasses.fields(cls)
    if not fields or typing.get_type_hints(cls)[fields[0].name] is not int:
        raise TypeError(f"{cls.__name__}: the first field is not an int id")
    frames = encode(template)
    header = bytes(frames[0])
    packer = msgpack.Packer(use_bin_type=True)
    prefix = packer.pack_array_header(len(fields) + 1) + packer.pack(cls.KIND)
    first = packer.pack(getattr(template, fields[0].name))
    # The header is [KIND, id, rest...] in msgpack: everything after the id is the same bytes
    # whatever the id is.
    if not header.startswith(prefix + first):
        raise AssertionError(f"{cls.__name__}: unexpected header layout")
    rest = header[len(prefix) + len(first) :]
    array_frames = frames[1:]

    def encode_id(value: int) -> Frames:
        if type(value) is not int:
            raise ProtocolError(f"cannot encode {cls.__name__}: id {value!r:.40} is not an int")
        try:
            pack = _packers.pack
        except AttributeError:
            pack = _thread_pack()
        try:
            return [prefix + pack(value) + rest, *array_frames]
        except (TypeError, OverflowError) as exc:  # an int beyond msgpack's 64 bits
            raise ProtocolError(f"cannot encode {cls.__name__}: {exc}") from exc

    return encode_id


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


def _unpack_header(header: bytes | memoryview, limits: DecodeLimits) -> Any:
    """Parse the header with ``limits``; every failure becomes a typed error."""
    try:
        return msgpack.unpackb(header, **limits.unpack_options)
    except ValueError as exc:
        text = str(exc) or type(exc).__name__
        if "max_ext_len" in text:
            raise ProtocolError("header holds a msgpack extension type; none is allowed") from None
        if "exceeds max" in text:
            raise MessageTooLargeError(f"header: {text}") from None
        raise ProtocolError(f"header is not valid msgpack: {text}") from None
    except Exception as exc:  # msgpack raises assorted types for garbage; none may escape raw
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None


def decode(frames: Sequence[FrameLike], *, limits: DecodeLimits = DEFAULT_LIMITS) -> Message:
    """Validate ``[header, buf0, ...]`` and build its message; arrays are read-only zero-copy
    views that pin their frames. Raises ``ProtocolError`` (``MessageTooLargeError`` for sizes)."""
    count = len(frames)
    if count == 0:
        raise ProtocolError("empty message: no header frame")
    if count > limits.max_frames:
        raise MessageTooLargeError(f"{count} frames exceed the limit of {limits.max_frames}")
    first = frames[0]
    header: bytes | memoryview
    if type(first) is bytes:
        header, header_bytes = first, len(first)
    else:
        header = _byte_view(first)
        header_bytes = header.nbytes
    if header_bytes > limits.max_header_bytes:
        raise MessageTooLargeError(
            f"header of {header_bytes} bytes exceeds the limit of {limits.max_header_bytes}"
        )
    buffers = [_byte_view(frame) for frame in frames[1:]] if count > 1 else []
    if buffers:
        total = header_bytes + sum(map(_NBYTES, buffers))
        if total > limits.max_message_bytes:
            raise MessageTooLargeError(
                f"message of {total} bytes exceeds the limit of {limits.max_message_bytes}"
            )
    if header_bytes <= limits.short_header_bytes:
        try:
            # Keywords written out: a ``**options`` call costs more than the parse.
            items = msgpack.unpackb(header, max_ext_len=0, ext_hook=_refuse_ext)
        except Exception:  # parse it again with every option, for the precise error
            items = _unpack_header(header, limits)
    else:
        items = _unpack_header(header, limits)
    if type(items) is not list or not items:
        raise ProtocolError(f"header must be a non-empty msgpack array, got {_describe(items)}")
    kind = items[0]
    decode_class = _DECODERS_BY_KIND.get(kind) if type(kind) is str else None
    if decode_class is None:
        raise ProtocolError(f"unknown message kind {kind!r:.60}")
    return decode_class(items, buffers)


# --------------------------------------------------------------------------- socket helpers
#
# These send and receive frame by frame with plain ``send``/``recv`` instead of
# ``send_multipart``/``recv_multipart``: for small messages that halves pyzmq's per-message cost
# (no per-part type checks, and the header arrives as ``bytes``, which msgpack reads fastest,
# while buffer frames arrive as zero-copy ``zmq.Frame``s). A multipart message is atomic in ZMQ:
# once its first frame can be sent or received, so can the rest, so only the first call may block.


# Frames smaller than this are sent by copy. For a small buffer pyzmq's zero-copy path (a Frame
# object, a memoryview, a release callback from the I/O thread) costs more than copying the
# bytes; zero-copy pays off only for large buffers. It equals pyzmq's own default copy threshold
# (zmq.COPY_THRESHOLD), but deciding here skips the memoryview pyzmq builds to apply it. For the
# frames ``encode`` makes (bytes, 1-D byte memoryviews) ``len`` is the byte count.
ZERO_COPY_MIN_BYTES = 64 * 1024
# Plain ints: pyzmq's constants are enum members, and ``flags | zmq.SNDMORE`` or
# ``getsockopt(zmq.RCVMORE)`` would run Python-level enum code on every frame.
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def _send_frames(sock: zmq.Socket[Any], frames: list[Any], first_flags: int) -> None:
    """Send ``frames`` as one message; only the first send can raise ``zmq.Again``."""
    last = len(frames) - 1
    if last == 0:
        sock.send(frames[0], first_flags)
        return
    send = sock.send
    frame = frames[0]
    send(frame, first_flags | _SNDMORE, copy=len(frame) < ZERO_COPY_MIN_BYTES)
    for index in range(1, last):
        frame = frames[index]
        send(frame, _SNDMORE, copy=len(frame) < ZERO_COPY_MIN_BYTES)
    frame = frames[last]
    send(frame, 0, copy=len(frame) < ZERO_COPY_MIN_BYTES)


def _recv_frames(
    sock: zmq.Socket[Any], first_flags: int, router: bool, limits: DecodeLimits
) -> tuple[bytes | None, Message]:
    """Receive one whole message (the first recv may raise ``zmq.Again``), then decode it.
    Every frame is consumed before decoding, so a bad message never desynchronises the socket."""
    identity: bytes | None = None
    first = sock.recv(first_flags)
    if router:
        if not sock.getsockopt(_RCVMORE):
            raise ProtocolError("a routed message needs an identity frame and a header frame")
        identity, first = first, sock.recv()
    if not sock.getsockopt(_RCVMORE):
        return identity, decode((first,), limits=limits)
    frames: list[Any] = [first]
    while True:
        frames.append(sock.recv(copy=False))
        if not sock.getsockopt(_RCVMORE):
            break
    return identity, decode(frames, limits=limits)


def send_frames_nowait(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send already-encoded ``frames`` as one message on a sync socket without blocking: raises
    ``zmq.Again`` at the peer's HWM (nothing was sent) and ``zmq.ZMQError`` EHOSTUNREACH for a
    ROUTER peer that is gone. The hot-path send of every process; same copy rule as
    ``sync_send``."""
    _send_frames(sock, frames, _NOBLOCK)


def sync_send(sock: zmq.Socket[Any], message: Message, *, identity: bytes | None = None) -> None:
    """Encode and send ``message``; ``identity`` addresses a ROUTER's peer. Array frames of
    ``ZERO_COPY_MIN_BYTES`` (64 KiB) and more go zero-copy, smaller frames are copied. Blocks
    while the peer's queue is at its HWM. Raises ``UnroutableError`` when that peer is not
    connected, ``ProtocolError`` when the message cannot be encoded."""
    frames: list[Any] = encode(message)
    if identity is not None:
        frames.insert(0, identity)
    try:
        _send_frames(sock, frames, 0)
    except zmq.ZMQError as exc:
        raise typed_send_error(exc, identity) from exc


def sync_recv(
    sock: zmq.Socket[Any], *, router: bool, limits: DecodeLimits = DEFAULT_LIMITS
) -> tuple[bytes | None, Message]:
    """Receive one message: ``(peer identity or None, message)``; ``router`` says whether a
    ROUTER's identity frame leads. A malformed message is consumed whole and raises
    ``ProtocolError``, so the caller's loop can log it and receive the next one."""
    return _recv_frames(sock, 0, router, limits)


# A sync twin of each asyncio socket (same underlying ZMQ socket) for the non-blocking first try.
_SYNC_TWINS: weakref.WeakKeyDictionary[zmq.asyncio.Socket, zmq.Socket[bytes]] = (
    weakref.WeakKeyDictionary()
)


def _sync_twin(sock: zmq.asyncio.Socket) -> zmq.Socket[bytes]:
    if sock.closed:  # the twin does not own the ZMQ socket and must not touch a closed one
        raise zmq.ZMQError(zmq.ENOTSOCK, "socket is closed")
    twin = _SYNC_TWINS.get(sock)
    if twin is None:
        twin = _SYNC_TWINS[sock] = zmq.Socket.shadow(sock.underlying)
    return twin


async def async_send(
    sock: zmq.asyncio.Socket, message: Message, *, identity: bytes | None = None
) -> None:
    """``sync_send`` for a ``zmq.asyncio`` socket.

    It first tries a plain non-blocking send, which succeeds unless the peer's queue is at its
    HWM and skips the future and callbacks of pyzmq's asyncio path; only then does it await.
    Like pyzmq's own path, a send that succeeds at once does not yield to the event loop."""
    frames: list[Any] = encode(message)
    if identity is not None:
        frames.insert(0, identity)
    try:
        try:
            _send_frames(_sync_twin(sock), frames, _NOBLOCK)
        except zmq.Again:
            await sock.send_multipart(frames, copy=False)
    except zmq.ZMQError as exc:
        raise typed_send_error(exc, identity) from exc


async def async_recv(
    sock: zmq.asyncio.Socket, *, router: bool, limits: DecodeLimits = DEFAULT_LIMITS
) -> tuple[bytes | None, Message]:
    """``sync_recv`` for a ``zmq.asyncio`` socket. A queued message is taken at once through
    the sync twin (no future, no callbacks); otherwise it awaits pyzmq's asyncio receive."""
    try:
        return _recv_frames(_sync_twin(sock), _NOBLOCK, router, limits)
    except zmq.Again:
        pass  # nothing queued; the first recv raised, so no frame was consumed
    received: list[Any] = await sock.recv_multipart(copy=False)
    identity: bytes | None = None
    if router:
        if len(received) < 2:
            raise ProtocolError("a routed message needs an identity frame and a header frame")
        identity = received[0].bytes
        del received[0]
    return identity, decode(received, limits=limits)


# The asyncio helpers under their design names: every zserve process runs on asyncio.
send_message = async_send
recv_message = async_recv


# --------------------------------------------------------------------------- non-blocking receive


def recv_nowait(
    sock: zmq.Socket[Any], *, router: bool, limits: DecodeLimits = DEFAULT_LIMITS
) -> tuple[bytes | None, Message]:
    """``sync_recv`` that never blocks, for a plain socket driven by an event loop
    (``zserve.transport.reactor``): raises ``zmq.Again`` when nothing is queued (nothing was
    consumed). A malformed message is consumed whole and raises ``ProtocolError``."""
    return _recv_frames(sock, _NOBLOCK, router, limits)
