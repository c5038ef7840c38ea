"""The emulated executor: a GPU that takes exactly l(b) per batch, by timer.

A batch of b requests of model m "runs" for ``l(b) = alpha*b + beta`` milliseconds (or the
model's measured table ``latency_ms[b-1]``, e.g. from a profile file). ``run_async`` computes the
outputs, then sleeps on the event loop until ``start + l(b)``: a precise timer
(``zserve.runtime.timers``), not a busy loop, so one small machine hosts many emulated GPUs.
``start`` is when the batch got the (emulated) device: ``time.monotonic()`` at the call, or when the
previous batch on this executor finishes if that is later, because one device runs one batch at a
time.
A batch never completes before ``start + l(b)`` by ``time.monotonic()`` (the clock of every
zserve timestamp); it completes later only by the timer's lateness (tens of microseconds on an
idle core) or when computing the outputs took longer than l(b).

``run`` (synchronous) does the same with ``time.sleep`` against ``time.monotonic()``; a backend
process should use ``run_async``.

Outputs are real arrays and a deterministic function of each request's inputs, so end-to-end
tests can check that every request got its own answer: every output of request i is filled with
``2 * (sum of all its input elements, in float64) + model_constant``, where ``model_constant`` is
``EmulatedModel.constant`` (by default a number derived from the model name). Output shapes are
per model (``output_shape``, default ``(1,)`` per sample). ``expected_outputs`` computes the
answer for one request.

Models load and unload at run time (``add_model`` with an ``EmulatedModel``, ``remove_model``):
an emulated model is only its latency profile and signature, so a load takes no time and needs
no warming and frees nothing (``holds_runtime_state`` is False: warm batches would only take
device time from the models it serves, and a full collection stalls the loop that runs them).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zserve.backends.executor import (
    BatchInputs,
    Executor,
    ModelLoadError,
    TensorMap,
    split_rows,
)
from zserve.backends.profiler import LatencyMeasurement
from zserve.config.cluster import ModelConfig
from zserve.config.profiles import PROFILE_FORMAT, configured_profile
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.core.errors import BadRequestError
from zserve.runtime.timers import sleep_until


@dataclass(frozen=True, slots=True)
class EmulatedModel:
    """One emulated model. ``latency_ms``, when given, is l(1..max_batch) and overrides the
    linear profile; ``max_batch`` then defaults to its length."""

    name: str
    alpha_ms: float
    beta_ms: float
    max_batch: int = 32
    input_shape: tuple[int, ...] = (4,)
    input_dtype: str = "float32"
    output_shape: tuple[int, ...] = (1,)
    constant: float | None = None
    latency_ms: tuple[float, ...] | None = None
    memory_bytes: int = 0
    signature: ModelSignature = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.latency_ms is not None and len(self.latency_ms) != self.max_batch:
            raise ValueError(
                f"emulated model {self.name!r}: latency_ms has {len(self.latency_ms)} entries "
                f"for max_batch {self.max_batch}"
            )
        if self.max_batch < 1 or self.alpha_ms < 0 or self.beta_ms < 0:
            raise ValueError(
                f"emulated model {self.name!r}: needs max_batch >= 1 and alpha, beta >= 0"
            )
        signature = ModelSignature(
            self.name,
            (TensorSpec("x", self.input_dtype, tuple(self.input_shape)),),
            (TensorSpec("y", "float32", tuple(self.output_shape)),),
        )
        object.__setattr__(self, "signature", signature)

    @classmethod
    def from_profile_entry(
        cls, name: str, entry: Mapping[str, Any], **kwargs: Any
    ) -> EmulatedModel:
        """From one model entry of a profile file (``zserve-profile/1``)."""
        table = tuple(float(x) for x in entry["latency_ms"])
        return cls(
            name,
            float(entry["alpha_ms"]),
            float(entry["beta_ms"]),
            max_batch=int(entry["max_batch"]),
            latency_ms=table,
            **kwargs,
        )

    @classmethod
    def from_config(cls, model: ModelConfig, kind: str = "") -> EmulatedModel:
        """From a cluster file's model: its configured profile on a device of ``kind`` (its
        ``profiles`` file for the kind, else its profile file or emulated alpha/beta), input and
        output shapes."""
        profile = configured_profile(model, kind)
        if profile is None:
            raise ValueError(f"model {model.name!r} on an emulated device needs emulated "
                             "alpha_ms/beta_ms or a profile file")
        return cls(model.name, profile.alpha_s * 1e3, profile.beta_s * 1e3,
                   max_batch=profile.max_batch, latency_ms=tuple(profile.latency_ms_list()),
                   input_shape=tuple(model.input_shape), input_dtype=model.input_dtype,
                   output_shape=tuple(model.output_shape))

    @property
    def model_constant(self) -> float:
        if self.constant is not None:
            return self.constant
        return float(zlib.crc32(self.name.encode()) % 1000)

    def latency_s(self, batch_size: int) -> float:
        if self.latency_ms is not None:
            return self.latency_ms[batch_size - 1] / 1e3
        return (self.alpha_ms * batch_size + self.beta_ms) / 1e3


class EmulatedExecutor(Executor):
    """Emulated device serving ``models`` (see the module docstring)."""

    holds_runtime_state = False

    def __init__(self, models: Sequence[EmulatedModel], device: str = "emulated") -> None:
        super().__init__(device)
        self._models = {m.name: m for m in models}
        if len(self._models) != len(models):
            raise ValueError("duplicate emulated model names")
        # When the device becomes free, on the loop clock (run_async) or time.monotonic() (run).
        self._busy_until = 0.0

    @classmethod
    def from_profile_file(
        cls,
        path: str | Path,
        models: Sequence[str] | None = None,
        device: str = "emulated",
        **model_options: Any,
    ) -> EmulatedExecutor:
        """Emulate the models of a ``zserve-profile/1`` file (all, or those named), each with
        its measured table l(1..max_batch). ``model_options`` go to every EmulatedModel
        (``input_shape``, ``output_shape``, ...)."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{path}: not a {PROFILE_FORMAT} profile file")
        entries: dict[str, Any] = data.get("models", {})
        names = list(entries) if models is None else list(models)
        missing = [n for n in names if n not in entries]
        if missing:
            raise ValueError(f"{path} has no profile for {missing} (it has {sorted(entries)})")
        return cls(
            [EmulatedModel.from_profile_entry(n, entries[n], **model_options) for n in names],
            device,
        )

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def load(self) -> None:
        """Nothing to load."""

    def add_model(self, spec: Any, *, max_batch: int,
                  session_batch_sizes: Sequence[int] = ()) -> None:
        """Serve one more model: ``spec`` is its ``EmulatedModel`` (its own ``max_batch``)."""
        if not isinstance(spec, EmulatedModel):
            raise ModelLoadError(f"an emulated device loads an EmulatedModel, not {spec!r}")
        if spec.name in self._models:
            raise ModelLoadError(f"emulated model {spec.name!r} is loaded already")
        self._models = {**self._models, spec.name: spec}  # a new dict: readers see one or other

    def remove_model(self, model: str) -> None:
        """Serve ``model`` no more (nothing to free but its entry)."""
        self._models = {k: v for k, v in self._models.items() if k != model}

    def warm(self, batch_sizes: Iterable[int] | None = None) -> None:
        """Nothing to warm (an emulated device has no first-run costs)."""

    def model(self, name: str) -> EmulatedModel:
        try:
            return self._models[name]
        except KeyError:
            raise BadRequestError(
                f"unknown model {name!r} (serving {', '.join(self._models)})"
            ) from None

    def signature(self, model: str) -> ModelSignature:
        return self.model(model).signature

    def max_batch(self, model: str) -> int:
        return self.model(model).max_batch

    def memory_bytes(self, model: str) -> int:
        return self.model(model).memory_bytes

    def profile(
        self,
        model: str,
        batch_sizes: Sequence[int] | None = None,
        *,
        repeats: int = 10,
        warmup: int = 2,
    ) -> LatencyMeasurement:
        """The configured profile, exactly (nothing is measured)."""
        m = self.model(model)
        sizes = sorted(set(batch_sizes or range(1, m.max_batch + 1)))
        latency = [m.latency_s(b) * 1e3 for b in sizes]
        return LatencyMeasurement.from_measurements(
            model, self.device, {b: [x] for b, x in zip(sizes, latency, strict=True)}
        )

    def latency_s(self, model: str, batch_size: int) -> float:
        return self.model(model).latency_s(batch_size)

    def compute(self, model: str, inputs: BatchInputs,
                request_rows: Sequence[int] | None = None) -> list[TensorMap]:
        """The outputs of a batch, at once (no emulated delay): each row's output is a
        function of that row's own inputs (twice the sum of its values plus the model's
        constant), so a request's outputs do not depend on the batch it ran in."""
        m = self.model(model)
        batch_size, rows = self._check_batch(model, inputs, request_rows)
        if isinstance(inputs, Mapping):
            totals = _row_sums(inputs.values(), batch_size)
        else:
            totals = np.concatenate([
                _row_sums(r.values(), int(next(iter(r.values())).shape[0])) for r in inputs])
        values = (2.0 * np.asarray(totals, dtype=np.float64) + m.model_constant).astype(np.float32)
        out = np.empty((batch_size, *m.output_shape), np.float32)
        out.reshape(batch_size, -1)[:] = values[:, None]
        return split_rows({"y": out}, batch_size, rows)

    def expected_outputs(self, model: str, request: Mapping[str, Any]) -> TensorMap:
        """The outputs ``run`` gives one request (for tests)."""
        return self.compute(model, [request])[0]

    async def run_async(self, model: str, inputs: BatchInputs,
                        request_rows: Sequence[int] | None = None) -> list[TensorMap]:
        start = max(time.monotonic(), self._busy_until)
        batch_size, _ = self._check_batch(model, inputs, request_rows)
        finish = start + self.latency_s(model, batch_size)
        self._busy_until = finish
        outputs = self.compute(model, inputs, request_rows)
        # A precise timer (zserve.runtime.timers): uvloop's own timers tick in whole milliseconds,
        # and a batch that sleeps in whole ticks finishes up to ~2 ms late, which a deferred batch
        # (planned to end alpha before its deadline) cannot afford.
        await sleep_until(finish)
        return outputs

    def run(self, model: str, inputs: BatchInputs,
            request_rows: Sequence[int] | None = None) -> list[TensorMap]:
        with self._run_lock:
            start = max(time.monotonic(), self._busy_until)
            batch_size, _ = self._check_batch(model, inputs, request_rows)
            finish = start + self.latency_s(model, batch_size)
            self._busy_until = finish
            outputs = self.compute(model, inputs, request_rows)
            while (remaining := finish - time.monotonic()) > 0:
                time.sleep(remaining)
        return outputs


def _row_sums(arrays: Iterable[Any], rows: int) -> Any:
    """The sum of every value of each of ``rows`` rows, over all of ``arrays`` (float64)."""
    return sum(np.asarray(a).reshape(rows, -1).sum(axis=1, dtype=np.float64) for a in arrays)
