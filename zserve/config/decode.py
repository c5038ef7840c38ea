"""Typed decoding of configuration documents (cluster.toml, workload and profile files).

Each file format is a tree of ``msgspec.Struct`` types declared with ``forbid_unknown_fields``;
:func:`decode` converts a parsed TOML/JSON document into it and turns msgspec's errors into one
message style shared by every format: the key's path first, then what was expected and what was
found (``models[0].max_batch: must be an integer, got '8'``), the allowed values where there is a
fixed set, and a "did you mean" for a misspelt key. Checks a type cannot express (finite numbers,
cross-field rules) raise :class:`FieldError` from a Struct's ``__post_init__``; msgspec adds the
path of the table and :func:`decode` the key named in the error.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_LOCATION_RE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_EXPECTED_RE = re.compile(r"^Expected `(?P<type>[^`]+)`(?P<bound>.*?)(?:, got `[^`]+`)?$")
_FIELD_RE = re.compile(r"^Object (?P<kind>missing required|contains unknown) field `(?P<key>.+)`$")
_TRAILING_ZERO_RE = re.compile(r"(\d)\.0\b")
_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "array": "a list",
    "object": "a table",
}


class SchemaError(ValueError):
    """A document does not fit its schema; the message starts with the key's path."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path or '<root>'}: {problem}")
        self.path = path
        self.problem = problem


class FieldError(ValueError):
    """Raised by a Struct's ``__post_init__``: ``key`` (relative to the Struct, "" for the
    Struct itself) and what is wrong with it."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"\x00{key}\x00{problem}")


def join_path(path: str, key: str) -> str:
    """``models[1]`` + ``slo_ms`` -> ``models[1].slo_ms``; ``""`` + ``x`` -> ``x``."""
    if not key:
        return path
    if not path:
        return key
    return f"{path}{key}" if key.startswith("[") else f"{path}.{key}"


def decode(document: Any, schema: type[T], *, path: str = "") -> T:
    """Convert ``document`` (the dict a TOML/JSON parser gave) into ``schema``, raising
    SchemaError in the shared message style; ``path`` is where ``document`` sits in its file
    (``models.resnet50``), prefixed to every key path."""
    try:
        return msgspec.convert(document, schema)
    except msgspec.ValidationError as exc:
        error = _schema_error(str(exc), document, schema)
        raise SchemaError(join_path(path, error.path), error.problem) from None


def _schema_error(message: str, document: Any, schema: type[Any]) -> SchemaError:
    match = _LOCATION_RE.match(message)
    assert match is not None  # the pattern matches any text
    what, path = match["what"], (match["path"] or "").lstrip(".")
    if what.startswith("\x00"):
        _, key, problem = what.split("\x00", 2)
        return SchemaError(join_path(path, key), problem)
    field_match = _FIELD_RE.match(what)
    if field_match is not None:
        key = field_match["key"]
        if field_match["kind"] == "missing required":
            return SchemaError(join_path(path, key), "required")
        known = struct_fields(_type_at(msgspec.inspect.type_info(schema), path))
        return SchemaError(join_path(path, key), unknown_key_problem(key, known))
    value = value_at(document, path)
    expected = _EXPECTED_RE.match(what)
    if expected is not None:
        return SchemaError(path, _expected_problem(expected, value))
    literal = _type_at(msgspec.inspect.type_info(schema), path)
    if what.startswith("Invalid enum value") and isinstance(literal, msgspec.inspect.LiteralType):
        return SchemaError(path, choice_problem(value, tuple(map(str, literal.values))))
    return SchemaError(path, what)


def _expected_problem(expected: re.Match[str], value: Any) -> str:
    bound = expected["bound"].strip()
    if bound:
        # The type was right and a bound failed; msgspec writes ``> 0.0``: print ``> 0``.
        bound = _TRAILING_ZERO_RE.sub(r"\1", bound)
        return f"must be {bound}, got {value!r}"
    # ``float | null``: an optional key is never given as null in TOML, so name the type only.
    parts = [p for p in expected["type"].split(" | ") if p != "null"]
    words = " or ".join(_TYPE_WORDS.get(part, part) for part in parts)
    return f"must be {words}, got {value!r}"


def unknown_key_problem(key: str, known: list[str]) -> str:
    """``unknown key`` with the closest known key, or the allowed keys when none is close."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    if known:
        return f"unknown key; allowed: {', '.join(sorted(known))}"
    return "unknown key"


def struct_fields(struct: msgspec.inspect.Type | None) -> list[str]:
    """The keys a Struct's table accepts (none for a path that is no Struct)."""
    if not isinstance(struct, msgspec.inspect.StructType):
        return []
    return [f.encode_name for f in struct.fields]


def _type_at(info: msgspec.inspect.Type, path: str) -> msgspec.inspect.Type | None:
    """The type found at ``path`` (``models[1].emulated``) of a schema's type tree."""
    current: msgspec.inspect.Type | None = info
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        current = _unwrap(current)
        if part.startswith("["):
            current = getattr(current, "item_type", None)
        elif isinstance(current, msgspec.inspect.StructType):
            by_name = {f.encode_name: f.type for f in current.fields}
            current = by_name.get(part)
        elif isinstance(current, msgspec.inspect.DictType):
            current = current.value_type
        else:
            return None
    return _unwrap(current)


def _unwrap(info: msgspec.inspect.Type | None) -> msgspec.inspect.Type | None:
    """``X | None`` -> ``X`` (the one non-null member of a union)."""
    if isinstance(info, msgspec.inspect.UnionType):
        members = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        return members[0] if len(members) == 1 else None
    return info


def value_at(document: Any, path: str) -> Any:
    """The value at ``models[1].slo_ms`` in ``document`` (None where there is none)."""
    value = document
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            index = int(part[1:-1])
            value = value[index] if isinstance(value, list) and index < len(value) else None
        else:
            value = value.get(part) if isinstance(value, dict) else None
    return value


def choice_problem(value: Any, choices: tuple[str, ...]) -> str:
    return f"must be one of {', '.join(choices)}, got {value!r}"


def check_finite(key: str, value: float | None, *, positive: bool = False) -> None:
    """A number the file gives must be finite and >= 0 (> 0 with ``positive``)."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise FieldError(key, f"must be a finite number {bound}, got {value}")
