"""A model's signature: what it takes and returns per sample, and request validation against it.

A leaf module (numpy and ``zserve.core.errors`` only), so that every role can hold signatures: a
backend reads them from its models and sends their wire form (``ModelSignature.to_dict``, a
msgpack-native dict) in its ``BackendRegister``; the rank passes them on in the ``BackendTable``;
a frontend rebuilds them (``ModelSignature.from_dict``) and validates requests before admitting
them, without ONNX Runtime or any model file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zserve.core.errors import BadRequestError, TooLargeError

# The wire form of a signature (``ModelSignature.to_dict``), as it travels in registrations.
SignatureWire = dict[str, Any]
# An error message names at most this many of the items a request chose (its unexpected input
# names, say), and at most this many characters of each: a request of 10,000 inputs, or one of a
# megabyte-long name, still gets a one-line answer that fits a client's limits.
MAX_NAMED_ITEMS = 5
MAX_NAME_CHARS = 64


def quoted(name: object) -> str:
    """``repr(name)`` for an error message, cut to ``MAX_NAME_CHARS`` (``...`` marks a cut);
    a container or a huge integer (a request's parameter, say) by its type and size alone: its
    repr could be of any length or depth."""
    if isinstance(name, list | tuple | dict | set | frozenset):
        return f"a {type(name).__name__} of {len(name)}"
    if isinstance(name, int) and name.bit_length() > 64:
        return f"an integer of {name.bit_length()} bits"
    # A long string's repr is cut from its head alone (the rest would be cut anyway).
    text = repr(name[:MAX_NAME_CHARS + 1] if isinstance(name, str) else name)
    return text if len(text) <= MAX_NAME_CHARS else text[:MAX_NAME_CHARS - 3] + "..."


def named_list(names: Sequence[object]) -> str:
    """The first ``MAX_NAMED_ITEMS`` of ``names``, quoted, then how many more there are."""
    shown = ", ".join(quoted(name) for name in names[:MAX_NAMED_ITEMS])
    more = len(names) - MAX_NAMED_ITEMS
    return f"{shown} and {more} more" if more > 0 else shown


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output of a model. ``shape`` is the per-sample shape (without the batch
    dimension); a ``None`` entry is a dimension whose size the model does not fix (only allowed
    for outputs). ``dtype`` is a numpy dtype name such as ``"float32"``."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorSpec:
        try:
            name, dtype, shape = data["name"], data["dtype"], data["shape"]
            if not isinstance(name, str) or not isinstance(dtype, str):
                raise TypeError("name and dtype must be strings")
            np.dtype(dtype)
            dims = tuple(None if d is None else int(d) for d in shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad tensor spec {data!r}: {exc}") from None
        return cls(name, dtype, dims)

    def describe(self) -> str:
        """``x: float32[batch, 32]``: the batch dimension first, the request's number of rows."""
        dims = ", ".join("?" if d is None else str(d) for d in ("batch", *self.shape))
        return f"{self.name}: {self.dtype}[{dims}]"


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """What a model takes and returns, per sample. Serializable to a msgpack-native dict, so a
    frontend can validate requests (``validate_request``) without loading any runtime."""

    model: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    # name -> (dtype, per-sample shape), precomputed so that validating a request costs a dict
    # lookup and two comparisons per input.
    _expected: dict[str, tuple[np.dtype[Any], tuple[int | None, ...]]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        expected = {s.name: (np.dtype(s.dtype), s.shape) for s in self.inputs}
        object.__setattr__(self, "_expected", expected)

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.outputs]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSignature:
        try:
            model = data["model"]
            if not isinstance(model, str):
                raise TypeError("model must be a string")
            inputs = tuple(TensorSpec.from_dict(s) for s in data["inputs"])
            outputs = tuple(TensorSpec.from_dict(s) for s in data["outputs"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad model signature {data!r}: {exc}") from None
        return cls(model, inputs, outputs)

    def validate_request(self, inputs: Any, where: str = "", max_rows: int | None = None) -> int:
        """Raise ``BadRequestError`` unless ``inputs`` is one request for this model: a mapping
        of exactly the input names to arrays (numpy, CuPy, anything with ``dtype`` and
        ``shape``) of the declared dtype and shape ``(n, *sample_shape)``, with the same n >= 1
        rows in every input; returns n. ``TooLargeError`` when n exceeds ``max_rows`` (the
        model's max batch: a request is never split across batches). ``where`` is added to the
        message after the model name (e.g. ``" (from client 7)"``)."""
        rows = self._validate(inputs, where)
        if max_rows is not None and rows > max_rows:
            raise TooLargeError(
                f"model {self.model!r}{where}: a request of {rows} rows exceeds the model's max "
                f"batch of {max_rows} rows (split it into several requests)"
            )
        return rows

    def validate_batch(self, inputs: Any, where: str = "") -> int:
        """Like ``validate_request`` for one stacked batch (every array of shape
        ``(b, *sample_shape)`` with the same b >= 1); returns b."""
        return self._validate(inputs, where)

    def _validate(self, inputs: Any, where: str) -> int:
        expected = self._expected
        # `type(...) is dict` first: isinstance against an ABC costs more than the whole check.
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise BadRequestError(
                f"model {self.model!r}{where}: inputs must be a map of input name to array, "
                f"got {type(inputs).__name__}"
            )
        if inputs.keys() != expected.keys():
            missing = sorted(set(expected) - set(inputs))
            unexpected = sorted(set(inputs) - set(expected), key=str)
            parts = []
            if missing:
                parts.append(f"missing input(s) {named_list(missing)}")
            if unexpected:
                parts.append(f"unexpected input(s) {named_list(unexpected)}")
            raise BadRequestError(
                f"model {self.model!r}{where}: {'; '.join(parts)} "
                f"(the model takes {self._describe_inputs()})"
            )
        rows = -1
        first = ""
        for name, (dtype, sample_shape) in expected.items():
            got_shape = self._checked_shape(inputs[name], name, dtype, sample_shape, where)
            if rows < 0:
                rows, first = got_shape[0], name
            elif got_shape[0] != rows:
                raise BadRequestError(
                    f"model {self.model!r}{where}: inputs disagree on the number of rows: "
                    f"{first!r} has {rows}, {name!r} has {got_shape[0]} (every input of one "
                    "request has the same leading dimension)"
                )
        if rows < 1:
            raise BadRequestError(
                f"model {self.model!r}{where}: input {first!r} has 0 rows (a request carries "
                "at least one row in its leading dimension)"
            )
        return rows

    def _checked_shape(self, array: Any, name: str, dtype: np.dtype[Any],
                       sample_shape: tuple[int | None, ...], where: str) -> tuple[int, ...]:
        """``array``'s shape, if it has ``dtype`` and shape ``(n, *sample_shape)``."""
        got_dtype = getattr(array, "dtype", None)
        got_shape = getattr(array, "shape", None)
        if got_dtype is None or got_shape is None:
            raise BadRequestError(
                f"model {self.model!r}{where}: input {name!r} must be an array, "
                f"got {type(array).__name__}"
            )
        if got_dtype != dtype:
            raise BadRequestError(
                f"model {self.model!r}{where}: input {name!r} has dtype {got_dtype}, "
                f"expected {dtype}"
            )
        if type(got_shape) is not tuple:
            got_shape = tuple(got_shape)
        if len(got_shape) == len(sample_shape) + 1 and (
            got_shape[1:] == sample_shape or _shape_matches(got_shape[1:], sample_shape)
        ):
            return got_shape
        hint = ""
        leading: int | str = "n"
        if _shape_matches(got_shape, sample_shape):
            hint = "; add a leading batch dimension"
        elif len(got_shape) == len(sample_shape) + 1:
            leading = got_shape[0]
        raise BadRequestError(
            f"model {self.model!r}{where}: input {name!r} has shape "
            f"{got_shape}, expected {_format_shape((leading, *sample_shape))}: "
            f"{accepted_shape(sample_shape)}{hint}"
        )

    def _describe_inputs(self) -> str:
        return ", ".join(s.describe() for s in self.inputs)


def accepted_shape(sample_shape: tuple[int | None, ...]) -> str:
    """What an input of per-row ``sample_shape`` accepts, batch dimension first, in the
    client's terms and the OIP metadata's: ``the model accepts (batch, 32) ([-1, 32] in its
    metadata), batch being the request's number of rows (1 or more)``."""
    oip = ", ".join(str(d) for d in (-1, *(-1 if d is None else d for d in sample_shape)))
    return (f"the model accepts {_format_shape(('batch', *sample_shape))} ([{oip}] in its "
            "metadata), batch being the request's number of rows (1 or more)")


def _shape_matches(got: tuple[int, ...], expected: tuple[int | None, ...]) -> bool:
    return len(got) == len(expected) and all(
        e is None or g == e for g, e in zip(got, expected, strict=True)
    )


def _format_shape(shape: tuple[int | str | None, ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
