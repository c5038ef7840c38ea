"""The Executor interface: what a backend process needs from whatever runs its batches.

An executor serves one device (``"cpu"``, ``"cuda:0"``, or an emulated GPU) and one or more
models on it. The backend process drives it like this::

    executor.load()                       # sessions, batch buffers; raises ModelLoadError
    executor.warm()                       # every batch size 1..max_batch of every model
    profiles = {m: executor.profile(m) for m in executor.models}   # optional, or read a file
    ...
    outputs = await executor.run_async(model, request_inputs)      # one batch, per plan
    ...
    executor.close()

Request convention (the one format every part of zserve uses for a request's tensors):

- A request is a ``TensorMap`` (``dict[str, array]``) holding *one sample*: every array has a
  leading batch dimension of size 1, i.e. shape ``(1, *sample_shape)``, the dtype the model
  declares, and exactly the model's input names. ``ModelSignature.validate_request`` checks this.
- ``run(model, inputs)`` takes either a list of such requests (the executor assembles the batch
  with one ``np.concatenate(..., out=batch_buffer[:b])`` per input, into a buffer preallocated at
  load time; a batch of one is passed through with no copy at all) or one already stacked
  TensorMap whose arrays have leading dimension b (passed through with no copy).
- It returns one TensorMap per request, in order. Request i's outputs are the row views
  ``batch_output[i:i+1]`` of the batch's output arrays (leading dimension 1, no copy). The batch
  output arrays are fresh per run, so a caller may hold on to them (e.g. while ZeroMQ sends them
  with ``copy=False``) across later runs.

Concurrency: ``run`` is synchronous and CPU/GPU-bound. Runs on one executor never overlap: ``run``
holds a lock, and ``run_async`` hands the batch to the executor's single worker thread, so batches
execute one at a time in call order, as on a device. Cancelling a ``run_async`` awaiter does not
stop a batch that has started; the next batch waits for it.

Errors: ``run`` raises ``BadRequestError`` for an unknown model or inputs that do not match the
signature (names the request index), ``InternalError`` for a batch size outside 1..max_batch (a
plan the scheduler should never have made) and ``BackendFailedError`` when the runtime itself
fails. ``load`` raises ``ModelLoadError``.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

from zserve.backends.profiler import LatencyMeasurement, measure_latency
from zserve.errors import BadRequestError, InternalError

Array = np.ndarray[Any, Any]
TensorMap = dict[str, Array]
# A batch as ``run`` accepts it: one TensorMap per request, or one stacked TensorMap.
BatchInputs = Sequence[Mapping[str, Any]] | Mapping[str, Any]


class ModelLoadError(BadRequestError):
    """A model could not be loaded: missing, truncated or corrupt file, no dynamic batch
    dimension, unsupported input types, or a device the runtime cannot use."""


# --------------------------------------------------------------------------- signatures


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
        dims = ", ".join("?" if d is None else str(d) for d in (1, *self.shape))
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

    def validate_request(self, inputs: Any, where: str = "") -> None:
        """Raise ``BadRequestError`` unless ``inputs`` is one request for this model: a mapping
        of exactly the input names to arrays (numpy, CuPy, anything with ``dtype`` and
        ``shape``) of the declared dtype and shape ``(1, *sample_shape)``. ``where`` is added
        to the message after the model name (e.g. ``" (from client 7)"``)."""
        self._validate(inputs, where, 1)

    def validate_batch(self, inputs: Any, where: str = "") -> int:
        """Like ``validate_request`` for one stacked batch (every array of shape
        ``(b, *sample_shape)`` with the same b >= 1); returns b."""
        return self._validate(inputs, where, None)

    def _validate(self, inputs: Any, where: str, leading: int | None) -> int:
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
                parts.append(f"missing input(s) {', '.join(map(repr, missing))}")
            if unexpected:
                parts.append(f"unexpected input(s) {', '.join(map(repr, unexpected))}")
            raise BadRequestError(
                f"model {self.model!r}{where}: {'; '.join(parts)} "
                f"(the model takes {self._describe_inputs()})"
            )
        for name, (dtype, sample_shape) in expected.items():
            array = inputs[name]
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
            if leading is None and len(got_shape) > 0 and got_shape[0] >= 1:
                leading = got_shape[0]  # a stacked batch: the first input fixes b
            shape = (leading, *sample_shape)
            if got_shape != shape and not _shape_matches(got_shape, shape):
                hint = ""
                if got_shape == shape[1:]:
                    hint = " (add a leading batch dimension of size 1: one request is one sample)"
                raise BadRequestError(
                    f"model {self.model!r}{where}: input {name!r} has shape "
                    f"{got_shape}, expected {_format_shape(shape)}{hint}"
                )
        return leading or 0

    def _describe_inputs(self) -> str:
        return ", ".join(s.describe() for s in self.inputs)


def _shape_matches(got: tuple[int, ...], expected: tuple[int | None, ...]) -> bool:
    return len(got) == len(expected) and all(
        e is None or g == e for g, e in zip(got, expected, strict=True)
    )


def _format_shape(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


# --------------------------------------------------------------------------- executor


class Executor(abc.ABC):
    """Runs batches of one or more models on one device. See the module docstring for the
    request convention, the concurrency rules and the errors."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._run_lock = threading.Lock()
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._worker_lock = threading.Lock()

    # -- lifecycle

    @abc.abstractmethod
    def load(self) -> None:
        """Load every model (idempotent). Raises ``ModelLoadError``."""

    def warm(self, batch_sizes: Iterable[int] | None = None) -> None:
        """Run every model once at each batch size (default 1..max_batch), so that no request
        pays for first-run allocations or kernel selection."""
        sizes = None if batch_sizes is None else sorted(set(batch_sizes))
        for model in self.models:
            for b in sizes if sizes is not None else range(1, self.max_batch(model) + 1):
                self.run(model, self.synthetic_requests(model, b))

    def close(self) -> None:
        """Release the worker thread and any runtime resources (idempotent)."""
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)

    def __enter__(self) -> Self:
        self.load()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- description

    @property
    @abc.abstractmethod
    def models(self) -> list[str]:
        """The names of the models this executor serves."""

    @abc.abstractmethod
    def signature(self, model: str) -> ModelSignature:
        """The model's input names, dtypes and per-sample shapes, and its outputs."""

    @abc.abstractmethod
    def max_batch(self, model: str) -> int:
        """The largest batch this executor runs for ``model``."""

    @abc.abstractmethod
    def memory_bytes(self, model: str) -> int:
        """Bytes of device memory ``model`` holds (see each executor for what is counted)."""

    def validate_request(self, model: str, inputs: Any) -> None:
        """Raise ``BadRequestError`` unless ``inputs`` is one valid request for ``model``."""
        self.signature(model).validate_request(inputs)

    # -- running

    @abc.abstractmethod
    def run(self, model: str, inputs: BatchInputs) -> list[TensorMap]:
        """Run one batch synchronously; return one TensorMap per request (row views)."""

    async def run_async(self, model: str, inputs: BatchInputs) -> list[TensorMap]:
        """``run`` on the executor's single worker thread, awaited without blocking the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._get_worker(), functools.partial(self.run, model, inputs)
        )

    def profile(
        self,
        model: str,
        batch_sizes: Sequence[int] | None = None,
        *,
        repeats: int = 10,
        warmup: int = 2,
    ) -> LatencyMeasurement:
        """Measure l(b) of ``model`` at each batch size (default 1..max_batch) and fit
        ``alpha*b + beta``. Batch sizes are interleaved across repeats, so that a slow stretch
        of the machine spreads over every size instead of bending the curve."""
        sizes = list(batch_sizes or range(1, self.max_batch(model) + 1))
        batches = {b: self.synthetic_requests(model, b) for b in sizes}
        return measure_latency(
            model,
            self.device,
            lambda b: self.run(model, batches[b]),
            sizes,
            repeats=repeats,
            warmup=warmup,
        )

    # -- helpers for subclasses and tests

    def synthetic_requests(self, model: str, batch_size: int, seed: int = 0) -> list[TensorMap]:
        """``batch_size`` valid requests for ``model`` with seeded contents."""
        rng = np.random.default_rng(seed)
        return [
            {s.name: _synthetic_array(rng, s, 1) for s in self.signature(model).inputs}
            for _ in range(batch_size)
        ]

    def synthetic_batch(self, model: str, batch_size: int, seed: int = 0) -> TensorMap:
        """One stacked batch of ``batch_size`` samples for ``model``, seeded."""
        rng = np.random.default_rng(seed)
        return {s.name: _synthetic_array(rng, s, batch_size) for s in self.signature(model).inputs}

    def _check_batch(self, model: str, inputs: BatchInputs) -> int:
        """Validate a batch (requests or stacked) against the signature; return its size."""
        signature = self.signature(model)
        if isinstance(inputs, Mapping):
            batch_size = signature.validate_batch(inputs, where=" (stacked batch)")
        else:
            batch_size = len(inputs)
            for i, request in enumerate(inputs):
                try:
                    signature.validate_request(request)
                except BadRequestError as exc:
                    raise BadRequestError(f"request {i} of the batch: {exc.message}") from None
        limit = self.max_batch(model)
        if not 1 <= batch_size <= limit:
            raise InternalError(
                f"model {model!r}: batch of {batch_size} outside 1..{limit} (max_batch)"
            )
        return batch_size

    def _get_worker(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._worker_lock:
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"zserve-exec-{self.device}"
                )
            return self._worker


def _synthetic_array(rng: np.random.Generator, spec: TensorSpec, batch_size: int) -> Array:
    if any(d is None for d in spec.shape):
        raise InternalError(f"input {spec.name!r} has a dynamic non-batch dimension")
    shape = (batch_size, *(int(d) for d in spec.shape if d is not None))
    dtype = np.dtype(spec.dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    # Zeros are a valid value for every integer and boolean input (indices, masks, ids).
    return np.zeros(shape, dtype)


def split_rows(outputs: Mapping[str, Any], batch_size: int) -> list[TensorMap]:
    """One TensorMap per request: the row views ``out[i:i+1]`` of each batch output."""
    return [{name: out[i : i + 1] for name, out in outputs.items()} for i in range(batch_size)]
