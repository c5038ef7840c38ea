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

- A request is a ``TensorMap`` (``dict[str, array]``) holding *n rows* (samples): every array
  has the same leading dimension n >= 1, i.e. shape ``(n, *sample_shape)``, the dtype the model
  declares, and exactly the model's input names. ``ModelSignature.validate_request`` checks this.
  A batch of b rows is the requests' rows concatenated along axis 0 (b = the sum of their n).
- ``run(model, inputs)`` takes either a list of such requests (the executor assembles the batch
  with one ``np.concatenate(..., out=batch_buffer[:b])`` per input, into a buffer preallocated at
  load time; a batch of one request is passed through with no copy at all) or one already
  stacked TensorMap whose arrays have leading dimension b (passed through with no copy).
- It returns one TensorMap per request, in order. Request i's outputs are the row views
  ``batch_output[s:s+n]`` of the batch's output arrays (its own n rows, no copy). A stacked
  TensorMap counts as b requests of one row each, unless ``request_rows`` says how many rows
  each request holds. The batch output arrays are fresh per run, so a caller may hold on to them
  (e.g. while ZeroMQ sends them with ``copy=False``) across later runs.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self, TypeVar

import numpy as np

from zserve.backends.profiler import LatencyMeasurement, measure_latency
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.core.errors import BadRequestError, InternalError

_T = TypeVar("_T")


class _Stopped(Exception):
    """A measurement on the worker thread, stopped because its caller was interrupted."""


Array = np.ndarray[Any, Any]
TensorMap = dict[str, Array]
# A batch as ``run`` accepts it: one TensorMap per request, or one stacked TensorMap.
BatchInputs = Sequence[Mapping[str, Any]] | Mapping[str, Any]


class ModelLoadError(BadRequestError):
    """A model could not be loaded: missing, truncated or corrupt file, no dynamic batch
    dimension, unsupported input types, or a device the runtime cannot use."""


# --------------------------------------------------------------------------- executor


class Executor(abc.ABC):
    """Runs batches of one or more models on one device. See the module docstring for the
    request convention, the concurrency rules and the errors."""

    # Whether its models hold a runtime's state (``zserve.backends.model_lifecycle``): a model
    # loaded at run time is then warmed at every batch size before it is served (first-run
    # costs), and an unload runs the collector and trims the C heap to give its memory back.
    holds_runtime_state = True

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
        pays for first-run allocations or kernel selection.

        On the worker thread that ``run_async`` serves batches from: a runtime's per-thread
        state (ONNX Runtime's CUDA provider creates its cuBLAS and cuDNN handles per thread)
        is then built here. Warmed on another thread, the first served batch of ResNet50 on an
        H200 took 7.1 ms against 2.7 for the next ones."""
        sizes = None if batch_sizes is None else sorted(set(batch_sizes))

        def warm_all(stop: threading.Event) -> None:
            for model in self.models:
                for b in sizes if sizes is not None else range(1, self.max_batch(model) + 1):
                    if stop.is_set():
                        return
                    self.run(model, self.synthetic_requests(model, b))

        self._on_worker(warm_all)

    def add_model(self, spec: Any, *, max_batch: int,
                  session_batch_sizes: Sequence[int] = ()) -> None:
        """Load one more model while serving the others (blocking; any thread). An executor
        that cannot raises ``ModelLoadError``."""
        raise ModelLoadError(f"model {getattr(spec, 'name', spec)!r}: a {type(self).__name__} "
                             "loads its models only at start")

    def remove_model(self, model: str) -> None:
        """Stop serving ``model`` and drop every reference to its sessions and buffers, after
        the batch running now (blocking; any thread)."""
        raise ModelLoadError(f"model {model!r}: a {type(self).__name__} unloads no model")

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

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        """A zeroed host buffer for batch rows (an executor on a GPU pins it, so that the copy
        to the device runs at full bus speed)."""
        return np.zeros(shape, dtype)

    def validate_request(self, model: str, inputs: Any) -> None:
        """Raise ``BadRequestError`` unless ``inputs`` is one valid request for ``model``."""
        self.signature(model).validate_request(inputs)

    # -- running

    @abc.abstractmethod
    def run(self, model: str, inputs: BatchInputs,
            request_rows: Sequence[int] | None = None) -> list[TensorMap]:
        """Run one batch synchronously; return one TensorMap per request (row views).
        ``request_rows``: the rows of each request of a stacked batch (None: one each)."""

    async def run_async(self, model: str, inputs: BatchInputs,
                        request_rows: Sequence[int] | None = None) -> list[TensorMap]:
        """``run`` on the executor's single worker thread, awaited without blocking the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._get_worker(), functools.partial(self.run, model, inputs, request_rows)
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

        def measure(stop: threading.Event) -> LatencyMeasurement:
            def run_batch(b: int) -> None:
                if stop.is_set():
                    raise _Stopped
                self.run(model, batches[b])

            return measure_latency(model, self.device, run_batch, sizes, repeats=repeats,
                                   warmup=warmup)

        # On the worker thread, as batches are served (see ``warm``).
        return self._on_worker(measure)

    def _on_worker(self, work: Callable[[threading.Event], _T]) -> _T:
        """``work(stop)`` on the worker thread, waited for here. Interrupted while waiting
        (Ctrl-C), it sets ``stop`` so that ``work`` ends after the batch it is running, instead
        of the worker's shutdown waiting for all of it."""
        stop = threading.Event()
        try:  # the submit too: the work may start before it returns
            return self._get_worker().submit(work, stop).result()
        except BaseException:
            stop.set()
            raise

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

    def _check_batch(self, model: str, inputs: BatchInputs,
                     request_rows: Sequence[int] | None = None) -> tuple[int, list[int] | None]:
        """Validate a batch (requests or stacked) against the signature; return its rows and
        each request's rows (None: one row per request)."""
        signature = self.signature(model)
        rows: list[int] | None = None
        if isinstance(inputs, Mapping):
            batch_size = signature.validate_batch(inputs, where=" (stacked batch)")
            if request_rows is not None and len(request_rows) != batch_size:
                rows = list(request_rows)
                if sum(rows) != batch_size or min(rows, default=0) < 1:
                    raise InternalError(f"model {model!r}: request rows {rows} do not add up "
                                        f"to the batch's {batch_size} rows")
        else:
            rows = []
            for i, request in enumerate(inputs):
                try:
                    rows.append(signature.validate_request(request))
                except BadRequestError as exc:
                    raise BadRequestError(f"request {i} of the batch: {exc.message}") from None
            batch_size = sum(rows)
            if batch_size == len(rows):
                rows = None
        limit = self.max_batch(model)
        if not 1 <= batch_size <= limit:
            raise InternalError(
                f"model {model!r}: batch of {batch_size} outside 1..{limit} (max_batch)"
            )
        return batch_size, rows

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


def split_rows(outputs: Mapping[str, Any], batch_size: int,
               request_rows: Sequence[int] | None = None) -> list[TensorMap]:
    """One TensorMap per request: the row views ``out[s:s+n]`` of each batch output, request
    i holding ``request_rows[i]`` rows (None: one row each)."""
    if request_rows is None:
        return [{name: out[i : i + 1] for name, out in outputs.items()}
                for i in range(batch_size)]
    parts: list[TensorMap] = []
    start = 0
    for rows in request_rows:
        stop = start + rows
        parts.append({name: out[start:stop] for name, out in outputs.items()})
        start = stop
    return parts
