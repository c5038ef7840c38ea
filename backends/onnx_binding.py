"""Sessions bound once to preallocated buffers: ONNX Runtime's IOBinding with ``OrtValue``s.

``BoundSession`` wraps one InferenceSession of a fixed batch size (``rows``) and binds its inputs
and outputs to buffers allocated when it is built (``bind_ortvalue_input`` /
``bind_ortvalue_output``), so that a run allocates nothing and ONNX Runtime makes no copy of its
own:

- On the CPU the batch's own arrays are bound as inputs at each run (an ``OrtValue`` over numpy
  memory is a view, no copy; a staged batch is already one slice of its staging slot), and the
  outputs go to buffers bound once.
- On CUDA the inputs and outputs are device buffers bound once. Each run copies the batch's rows
  from host memory (the staging slot, pinned where CuPy is present) into the input buffers on a
  copy stream of their own (CuPy; else ``OrtValue.update_inplace``), waits for it, and runs. With
  ``cuda_graph`` the session was made with the CUDA provider's ``enable_cuda_graph``: its first
  run captures the graph and later runs replay it, which needs exactly these fixed addresses.

Outputs are returned as fresh host arrays of the batch's rows (a copy out of the bound buffers:
the executor's contract lets a caller keep them across later runs, e.g. while ZeroMQ sends them).
Rows past the batch are padding: whatever the last batch left there, their outputs never read.
``SessionConfig.bound_buffers`` turns this on for fixed-size sessions. It is off by default: a CPU
model has one session of every size unless ``session_batch_sizes`` is set (with sizes 1/8/16 the
built-in ``cnn`` took 3.4 / 5.8 / 8.6 ms of CPU per batch bound against 4.1 / 6.2 / 9.5 with
``session.run``, medians of 3 interleaved rounds at load average 17), and on a GPU
``backends/bench/gpu_check.sh`` is to decide.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zserve.backends.executor import Array, TensorMap
from zserve.config.signature import ModelSignature


class BoundSession:
    """One fixed-size session with its bound buffers (module docstring). Not thread-safe: the
    executor runs one batch at a time."""

    def __init__(self, session: Any, signature: ModelSignature, rows: int, *,
                 device: str = "cpu", device_id: int = 0) -> None:
        import onnxruntime as ort

        if device not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r}: expected 'cpu' or 'cuda'")
        if any(None in spec.shape for spec in signature.outputs):
            raise ValueError(f"model {signature.model!r}: an output with a dynamic per-sample "
                             "shape cannot be bound to a preallocated buffer")
        self.session, self.signature, self.rows = session, signature, rows
        self.device, self.device_id = device, device_id
        self.binding = session.io_binding()
        self._ort = ort
        self._outputs: dict[str, Any] = {}  # name -> bound OrtValue
        self._inputs: dict[str, Any] = {}  # name -> bound device OrtValue (CUDA)
        self._copy_stream: Any = None
        for spec in signature.outputs:
            value = self._allocate((rows, *(int(d or 0) for d in spec.shape)), spec.dtype)
            self.binding.bind_ortvalue_output(spec.name, value)
            self._outputs[spec.name] = value
        if device == "cuda":
            for spec in signature.inputs:
                value = self._allocate((rows, *(int(d or 0) for d in spec.shape)), spec.dtype)
                self.binding.bind_ortvalue_input(spec.name, value)
                self._inputs[spec.name] = value
            self._copy_stream = _cupy_stream(device_id)

    def _allocate(self, shape: tuple[int, ...], dtype: str) -> Any:
        if self.device == "cuda":
            return self._ort.OrtValue.ortvalue_from_shape_and_type(
                list(shape), np.dtype(dtype).type, "cuda", self.device_id)
        return self._ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype))

    def run(self, feed: TensorMap, batch_size: int) -> TensorMap:
        """Run one batch of ``batch_size <= rows`` rows; ``feed`` holds host arrays of at least
        ``batch_size`` rows (the first ``batch_size`` are the batch). Returns fresh host arrays
        of ``batch_size`` rows per output."""
        if not 1 <= batch_size <= self.rows:
            raise ValueError(f"batch of {batch_size} rows in a session of {self.rows}")
        if self.device == "cuda":
            self._copy_in(feed, batch_size)
        else:
            for name, array in feed.items():
                rows = np.ascontiguousarray(array[:self.rows])
                if rows.shape[0] != self.rows:
                    raise ValueError(f"input {name!r}: {rows.shape[0]} rows for a session of "
                                     f"{self.rows}")
                self.binding.bind_ortvalue_input(name, self._ort.OrtValue.ortvalue_from_numpy(rows))
        self.session.run_with_iobinding(self.binding)
        return {name: _host_rows(value, batch_size) for name, value in self._outputs.items()}

    def _copy_in(self, feed: TensorMap, batch_size: int) -> None:
        """The batch's rows into the bound device inputs, on the copy stream, waited for."""
        if self._copy_stream is None:
            for name, array in feed.items():
                value = self._inputs[name]
                padded = np.zeros(value.shape(), array.dtype)
                padded[:batch_size] = array[:batch_size]
                value.update_inplace(padded)
            return
        import cupy

        sources = []  # alive until the copies are done (a contiguous copy is a temporary)
        for name, array in feed.items():
            rows = np.ascontiguousarray(array[:batch_size])
            sources.append(rows)
            cupy.cuda.runtime.memcpyAsync(self._inputs[name].data_ptr(), rows.ctypes.data,
                                          rows.nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                          self._copy_stream.ptr)
        self._copy_stream.synchronize()
        sources.clear()


def _host_rows(value: Any, batch_size: int) -> Array:
    """The first ``batch_size`` rows of a bound output, as a fresh host array."""
    array: Array = value.numpy()  # a device buffer: copied to the host; a CPU one: its view
    return np.array(array[:batch_size], copy=True)


def _cupy_stream(device_id: int) -> Any:
    """A non-blocking CuPy stream on ``device_id`` for the input copies, or None without CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    with cupy.cuda.Device(device_id):
        return cupy.cuda.Stream(non_blocking=True)


__all__ = ["BoundSession"]
