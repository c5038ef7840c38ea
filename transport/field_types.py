"""What the declared field types of the wire messages mean to the codec.

msgspec reads and writes every field it knows; this module covers the rest, from the same
annotations: which fields hold numpy arrays and how to swap those for descriptors when encoding
(``array_field_encoders``), which hold msgpack-native ``Any`` values that need a walk after
decoding (``has_native_values``, ``is_native``), and, when a header failed to decode, which of
its fields is the first bad one (``first_problem``, the codec's slow path: it runs only for
malformed messages, so it favours a precise message over speed).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from zserve.core.errors import ProtocolError
from zserve.transport.arrays import EncodedFrames, decode_array, encode_array, encode_tensor_map
from zserve.transport.messages import MESSAGES_BY_KIND, Message

# Depth bound of msgpack-native values in ``dict[str, Any]`` fields.
MAX_NATIVE_DEPTH = 32

ArrayFieldEncoder = Callable[[Any, EncodedFrames], Any]  # (field value, frames) -> header value


def wire_fields(cls: type[Message]) -> tuple[msgspec.structs.FieldInfo, ...]:
    """The fields of ``cls`` in wire order, with their resolved types."""
    return msgspec.structs.fields(cls)


def _is_array_hint(hint: Any) -> bool:
    return hint is np.ndarray or typing.get_origin(hint) is np.ndarray


def _has_array(hint: Any) -> bool:
    return _is_array_hint(hint) or any(_has_array(arg) for arg in typing.get_args(hint))


def has_native_values(hint: Any) -> bool:
    """Whether ``hint`` holds ``Any`` somewhere (values msgspec does not type-check)."""
    if _is_array_hint(hint):  # np.ndarray[Any, Any]: its Any is numpy's, not ours
        return False
    return hint is Any or any(has_native_values(arg) for arg in typing.get_args(hint))


# --------------------------------------------------------------------------- encoding arrays


def _array_encoder(hint: Any) -> ArrayFieldEncoder:
    """Replace the arrays inside one field value by descriptors (appending the frames of the
    large ones to ``out.frames``), refusing a value whose containers do not fit ``hint``."""
    # Typed locals: under the project's mypy layout imports of zserve.* may resolve to Any.
    if _is_array_hint(hint):
        encode_one: ArrayFieldEncoder = encode_array
        return encode_one
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict and args[0] is str and _is_array_hint(args[1]):
        encode_map: ArrayFieldEncoder = encode_tensor_map
        return encode_map
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


def array_field_encoders(cls: type[Message]) -> tuple[tuple[int, ArrayFieldEncoder], ...]:
    """``(header position, encoder)`` of each field of ``cls`` that holds arrays; the header is
    ``[KIND, field0, ...]``, so field i sits at position i + 1."""
    return tuple(
        (index + 1, _array_encoder(info.type))
        for index, info in enumerate(wire_fields(cls))
        if _has_array(info.type)
    )


# --------------------------------------------------------------------------- native values


def is_native(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is msgpack-native only (what ``Any`` means on our wire): no extension
    types (msgspec decodes the timestamp one to a datetime), str map keys, bounded depth."""
    cls = type(value)
    if value is None or cls in (bool, int, float, str, bytes):
        return True
    if depth >= MAX_NATIVE_DEPTH:
        return False
    if cls is list:
        return all(is_native(item, depth + 1) for item in value)
    if cls is dict:
        return all(
            type(key) is str and is_native(item, depth + 1) for key, item in value.items()
        )
    return False


# --------------------------------------------------------------------------- the slow path


class _Frames:
    """The buffers of one message while its fields are checked one by one."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers
        self.used = [False] * len(buffers)

    def decode_array(self, hint: Any, descriptor: Any) -> Any:
        return decode_array(descriptor, self.buffers, self.used)


def _annotation(cls: type[Message], name: str) -> str:
    """The field's annotation as written (``list[int]``), for error messages."""
    for klass in cls.__mro__:
        written = vars(klass).get("__annotations__", {}).get(name)
        if written is not None:
            return written if isinstance(written, str) else repr(written)
    return "?"


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _field_problem(info: msgspec.structs.FieldInfo, value: Any, frames: _Frames) -> str | None:
    """What is wrong with one field's value (after "expected <annotation>"), or None."""
    try:
        msgspec.convert(value, info.type, strict=True, dec_hook=frames.decode_array)
    except ProtocolError as exc:  # a bad array descriptor
        return f": {exc.message}"
    except (msgspec.ValidationError, TypeError, ValueError):
        return f", got {_describe(value)}"
    if has_native_values(info.type) and not is_native(value):
        return f", got {_describe(value)}"
    return None


def _header_problem(items: Any, buffers: list[memoryview]) -> tuple[type[Message], str | None]:
    """The message class of a parsed header, and what is wrong with its shape, if anything."""
    if type(items) is not list or not items:
        raise ProtocolError(f"header must be a non-empty msgpack array, got {_describe(items)}")
    kind = items[0]
    cls = MESSAGES_BY_KIND.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r:.60}")
    arity = len(wire_fields(cls))
    if len(items) != arity + 1:
        return cls, f"has {arity} fields, the message carries {len(items) - 1}"
    if buffers and not array_field_encoders(cls):
        return cls, f"carries no arrays but came with {len(buffers)} frames"
    return cls, None


def first_problem(items: Any, buffers: list[memoryview], cause: Exception | None) -> ProtocolError:
    """The error for a header (parsed to plain values, ``items``) that failed to decode:
    its shape, then its first bad field, then stray frames and parallel lists, in that order.
    ``cause`` is what the fast path raised, reported when nothing more precise is found."""
    cls, problem = _header_problem(items, buffers)
    name = cls.__name__
    if problem is not None:
        return ProtocolError(f"{name} {problem}")
    frames = _Frames(buffers)
    fields = wire_fields(cls)
    for info, value in zip(fields, items[1:], strict=True):
        problem = _field_problem(info, value, frames)
        if problem is not None:
            expected = f"expected {_annotation(cls, info.name)}"
            return ProtocolError(f"{name}.{info.name}: {expected}{problem}")
    if False in frames.used:
        unused = [index + 1 for index, used in enumerate(frames.used) if not used]
        return ProtocolError(f"{name}: frames {unused} are not referenced by the header")
    values = dict(zip((info.name for info in fields), items[1:], strict=True))
    for group in cls.SAME_LENGTH:
        lengths = [len(values[field]) for field in group]
        if min(lengths) != max(lengths):
            listed = ", ".join(f"{f} {n}" for f, n in zip(group, lengths, strict=True))
            return ProtocolError(f"{name}: parallel lists differ in length ({listed})")
    detail = f": {cause}" if cause is not None else ""
    return ProtocolError(f"invalid {name}{detail}")
