"""The ONNX Runtime executor: one InferenceSession per model on one device.

Devices:

- ``"cpu"``: the CPU execution provider. The batch is assembled into a host buffer preallocated
  at load time (one copy per request; none for a batch of one or an already stacked batch) and
  handed to ``InferenceSession.run``, which reads it in place.
- ``"cuda"`` / ``"cuda:N"`` (needs ``onnxruntime-gpu``; CuPy optional): the CUDA execution
  provider, driven through IOBinding so that ONNX Runtime makes no copy of its own:

  * host (numpy) inputs are assembled into a host buffer (pinned when CuPy is present) and bound
    as CPU inputs: ONNX Runtime copies them to the device once;
  * CuPy inputs are assembled on the device (or bound directly when already stacked) and bound
    by device pointer;
  * outputs are bound too, to fresh arrays of the batch's output shape: numpy arrays for host
    inputs (ONNX Runtime copies device -> host straight into them) and CuPy arrays for CuPy
    inputs (outputs stay on the device). Outputs whose per-sample shape the model does not fix
    are left to ONNX Runtime to allocate and are then copied to the host (or wrapped as CuPy
    arrays without a copy).

Batch sizes on a GPU: ONNX Runtime's CUDA provider rebuilds every convolution's cuDNN plan when
a session's input shape changes, and keeps only the last shape's plan. A deferred scheduler changes
the batch size from batch to batch, so one session per model paid 40-125 ms per batch for
ResNet50 on an H200 against 1.4-7.8 ms at a fixed size, whatever ``cudnn_conv_algo_search`` said
(docs/performance.md, "On a GPU"). A CUDA model therefore gets one session per batch size of
``SessionConfig.session_batch_sizes`` (default ``default_cuda_batch_sizes``: 1, 2, 3, 4, 6, 8,
12, 16, 24, 32, ... up to ``max_batch``); a batch runs in the smallest session that holds it, with
the rows past the batch left as padding (zeroed at load; past a staged batch, the staging slot's
next rows, read in place with no copy; their outputs are never read). Each session
holds its own copy of the weights: the price is GPU memory (about ten copies for a max_batch of
32) and load time; the padding costs at most a third of a batch's rows. CPU models get one
session for every size unless ``session_batch_sizes`` is set.

A CUDA session whose provider fails to initialise is an error at load time, never a silent fall
back to the CPU. Before the first CUDA session, ``onnxruntime.preload_dlls()`` loads the CUDA and
cuDNN libraries that ``onnxruntime-gpu[cuda,cudnn]`` (the ``gpu`` extra) installs as ``nvidia-*``
wheels beside it; without that, the provider's ``dlopen`` finds them only on
``LD_LIBRARY_PATH``. Libraries installed system-wide are found either way.

Load-time checks (``ModelLoadError`` with a message that names the model, the file and the
input): the file must exist and parse (a truncated or corrupt file is reported as such, not as a
raw ONNX Runtime traceback); every input and output must be a tensor with a *dynamic* first
dimension (the batch, e.g. ``"N"``); every other input dimension must be fixed, because zserve
batches requests by concatenating them along the first dimension.

``SessionConfig`` (``zserve.backends.onnx_session``, with the device parse, the CUDA batch sizes
and the library preload) holds every session option zserve sets; its defaults suit one backend
per device: one intra-op thread on the CPU (so several CPU backends do not fight over cores, and
l(b) is reproducible), full graph optimisation, memory arena and memory patterns on.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zserve.backends.builtin import ModelSpec, resolve_model_spec
from zserve.backends.executor import (
    Array,
    BatchInputs,
    Executor,
    ModelLoadError,
    TensorMap,
    split_rows,
)
from zserve.backends.onnx_session import (
    SessionConfig,
    default_cuda_batch_sizes,
    parse_device,
    preload_cuda_libraries,
    tensorrt_provider_options,
)
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.core.errors import BackendFailedError, BadRequestError

# ONNX Runtime's tensor type names -> numpy dtype names.
_ORT_DTYPES: dict[str, str] = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int8)": "int8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(uint8)": "uint8",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
    "tensor(bool)": "bool",
}

DEFAULT_MAX_BATCH = 32


def read_signature(path: str | Path, model: str | None = None) -> ModelSignature:
    """The signature of an ONNX file, read with the ``onnx`` package (no ONNX Runtime, weights
    stored externally are not loaded). Applies the same checks as loading it into the executor."""
    import onnx
    from onnx import helper

    path = Path(path)
    name = model or path.stem
    _check_file(name, path)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # the protobuf decoder raises its own error types
        raise ModelLoadError(
            f"model {name!r}: {path} is not a valid ONNX model (truncated or corrupt?): {exc}"
        ) from None
    initializers = {init.name for init in proto.graph.initializer}

    def raw(value_info: Any) -> tuple[str, str, list[int | str | None] | None]:
        tensor_type = value_info.type.tensor_type
        if not value_info.type.HasField("tensor_type"):
            return value_info.name, "non-tensor", None
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).name
        if not tensor_type.HasField("shape"):
            return value_info.name, dtype, None
        dims: list[int | str | None] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(int(dim.dim_value))
            else:
                dims.append(dim.dim_param or None)
        return value_info.name, dtype, dims

    inputs = [raw(v) for v in proto.graph.input if v.name not in initializers]
    outputs = [raw(v) for v in proto.graph.output]
    return _signature(name, path, inputs, outputs)


def _check_file(name: str, path: Path) -> None:
    if not path.is_file():
        raise ModelLoadError(f"model {name!r}: no such model file {path}")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"model {name!r}: model file {path} is empty")


def _signature(
    name: str,
    path: Path,
    inputs: Sequence[tuple[str, str, list[int | str | None] | None]],
    outputs: Sequence[tuple[str, str, list[int | str | None] | None]],
) -> ModelSignature:
    """Check that a model can be batched by zserve and build its signature. Raw shapes hold an
    int (fixed size), a str (named dynamic dimension) or None (unknown size)."""

    def spec(kind: str, tensor: str, dtype: str, dims: list[int | str | None] | None) -> TensorSpec:
        where = f"model {name!r} ({path}): {kind} {tensor!r}"
        if dtype not in _ORT_DTYPES.values():
            raise ModelLoadError(f"{where} has unsupported type {dtype}; zserve serves tensors")
        if not dims:
            raise ModelLoadError(
                f"{where} has no batch dimension (shape {dims}); zserve needs a dynamic first "
                "dimension to batch requests"
            )
        if isinstance(dims[0], int):
            raise ModelLoadError(
                f"{where} has a fixed batch dimension: shape {dims}. zserve batches requests "
                "along the first dimension, so it must be dynamic (e.g. 'N'): export with "
                "dynamic_axes={...: {0: 'N'}}, or rewrite the first dim of every input and "
                "output as a dim_param"
            )
        sample: list[int | None] = []
        for axis, dim in enumerate(dims[1:], start=1):
            if isinstance(dim, int):
                sample.append(dim)
            elif kind == "input":
                raise ModelLoadError(
                    f"{where} has a dynamic dimension {dim!r} at axis {axis} (shape {dims}); "
                    "zserve batches by concatenating requests along axis 0, so every other "
                    "input dimension must be fixed (e.g. python -m onnxruntime.tools."
                    "make_dynamic_shape_fixed)"
                )
            else:
                sample.append(None)
        return TensorSpec(tensor, dtype, tuple(sample))

    return ModelSignature(
        name,
        tuple(spec("input", n, t, d) for n, t, d in inputs),
        tuple(spec("output", n, t, d) for n, t, d in outputs),
    )


def _is_cupy(array: Any) -> bool:
    return type(array).__module__.startswith("cupy")


def _same_memory(a: Any, b: Any) -> bool:
    """Whether two arrays of one kind (numpy or CuPy) start at the same address."""
    if _is_cupy(a) != _is_cupy(b):
        return False
    if _is_cupy(a):
        return bool(a.data.ptr == b.data.ptr)
    return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _grown_in_place(array: Array, rows: int) -> Array | None:
    """``array``'s first ``rows`` rows read on past its end within the buffer it slices, or None
    when it is no row slice of a C-contiguous buffer holding that many rows from its start."""
    base = array.base
    if (not isinstance(base, np.ndarray) or not base.flags.c_contiguous
            or not array.flags.c_contiguous or base.dtype != array.dtype
            or base.shape[1:] != array.shape[1:] or base.ndim == 0):
        return None
    row_bytes = base.strides[0]
    offset = (array.__array_interface__["data"][0] - base.__array_interface__["data"][0])
    if row_bytes <= 0 or offset < 0 or offset % row_bytes:
        return None
    start = offset // row_bytes
    if start + rows > base.shape[0]:
        return None
    grown: Array = base[start:start + rows]
    return grown


@dataclass(slots=True)
class _LoadedModel:
    spec: ModelSpec
    max_batch: int
    session: Any  # onnxruntime.InferenceSession of the largest batch size
    # Batch size -> its own session, ascending; empty: ``session`` runs every size.
    sized_sessions: dict[int, Any]
    signature: ModelSignature
    output_names: list[str]
    host_buffers: dict[str, Array]  # input name -> (max_batch, *sample_shape)
    device_buffers: dict[str, Any]  # input name -> CuPy array, allocated on first CuPy batch
    static_outputs: bool  # every output's per-sample shape is fixed
    file_bytes: int
    # Batch size -> its session bound to preallocated buffers (SessionConfig.bound_buffers).
    bound_sessions: dict[int, Any] = field(default_factory=dict)


class OnnxExecutor(Executor):
    """ONNX Runtime executor for ``models`` on ``device``.

    ``models``: ModelSpecs or model spec strings (``cnn``, ``NAME=PATH.onnx``, ``PATH.onnx``).
    ``max_batch``: the largest batch, for every model or per model name (a model missing from
    the mapping gets DEFAULT_MAX_BATCH).
    ``session_batch_sizes``: per model name, the batch sizes that get a session of their own,
    in place of ``config.session_batch_sizes`` (module docstring).
    """

    def __init__(
        self,
        models: Sequence[ModelSpec | str],
        *,
        device: str = "cpu",
        max_batch: int | Mapping[str, int] = DEFAULT_MAX_BATCH,
        config: SessionConfig | None = None,
        session_batch_sizes: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        super().__init__(device)
        self._kind, self._device_id = parse_device(device)
        self.config = config or SessionConfig()
        self._specs = [m if isinstance(m, ModelSpec) else resolve_model_spec(m) for m in models]
        names = [s.name for s in self._specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model names in {names}")
        if isinstance(max_batch, int):
            self._max_batch = {s.name: max_batch for s in self._specs}
        else:
            self._max_batch = {s.name: int(max_batch.get(s.name, DEFAULT_MAX_BATCH))
                               for s in self._specs}
        for name, limit in self._max_batch.items():
            if limit < 1:
                raise ValueError(f"model {name!r}: max_batch must be >= 1, got {limit}")
        self._session_sizes = {name: tuple(sizes)
                               for name, sizes in (session_batch_sizes or {}).items()}
        for name, sizes in self._session_sizes.items():
            if any(size < 1 for size in sizes):
                raise ValueError(f"model {name!r}: session batch sizes must be >= 1, got {sizes}")
        self._loaded: dict[str, _LoadedModel] = {}
        self._load_lock = threading.Lock()

    # -- Executor

    @property
    def models(self) -> list[str]:
        return [s.name for s in self._specs]

    def load(self) -> None:
        with self._load_lock:
            for spec in self._specs:
                if spec.name not in self._loaded:
                    self._loaded[spec.name] = self._load_model(spec)

    def add_model(self, spec: ModelSpec, *, max_batch: int = DEFAULT_MAX_BATCH,
                  session_batch_sizes: Sequence[int] = ()) -> None:
        """Load ``spec`` (its sessions and batch buffers) while the other models serve: it joins
        ``models`` only once loaded. Raises ``ModelLoadError``, or ``ValueError`` for a model
        it serves already or a max batch below 1."""
        if max_batch < 1:
            raise ValueError(f"model {spec.name!r}: max_batch must be >= 1, got {max_batch}")
        with self._load_lock:
            if spec.name in self._max_batch:
                raise ValueError(f"model {spec.name!r} is loaded already")
            self._max_batch[spec.name] = max_batch
            if session_batch_sizes:
                self._session_sizes[spec.name] = tuple(session_batch_sizes)
            try:
                loaded = self._load_model(spec)
            except BaseException:
                self._forget(spec.name)
                raise
            self._loaded[spec.name] = loaded
            self._specs.append(spec)

    def remove_model(self, model: str) -> None:
        """Drop ``model``'s sessions and buffers (after the batch running now): once nothing
        else holds them, ONNX Runtime frees their memory."""
        with self._run_lock, self._load_lock:
            if model not in self._max_batch:
                raise BadRequestError(f"unknown model {model!r} (serving "
                                      f"{', '.join(self.models)})")
            self._forget(model)

    def _forget(self, model: str) -> None:
        self._loaded.pop(model, None)
        self._max_batch.pop(model, None)
        self._session_sizes.pop(model, None)
        self._specs = [s for s in self._specs if s.name != model]

    def close(self) -> None:
        super().close()
        with self._load_lock:
            self._loaded.clear()

    def signature(self, model: str) -> ModelSignature:
        return self._model(model).signature

    def max_batch(self, model: str) -> int:
        if model not in self._max_batch:
            raise BadRequestError(f"unknown model {model!r} (serving {', '.join(self.models)})")
        return self._max_batch[model]

    def memory_bytes(self, model: str) -> int:
        """An estimate: the model file's size (its weights) plus zserve's batch buffers.
        Activation memory inside ONNX Runtime's arena is not counted."""
        loaded = self._model(model)
        buffers = sum(b.nbytes for b in loaded.host_buffers.values())
        buffers += sum(int(b.nbytes) for b in loaded.device_buffers.values())
        return loaded.file_bytes * max(1, len(loaded.sized_sessions)) + buffers

    @property
    def providers(self) -> list[str]:
        """The execution providers the sessions use (from the first loaded model)."""
        for loaded in self._loaded.values():
            return list(loaded.session.get_providers())
        return []

    def run(self, model: str, inputs: BatchInputs,
            request_rows: Sequence[int] | None = None) -> list[TensorMap]:
        loaded = self._model(model)
        batch_size, rows = self._check_batch(model, inputs, request_rows)
        with self._run_lock:
            feed = self._assemble(loaded, inputs, batch_size)
            session, rows_run = self._session_for(loaded, batch_size)
            if rows_run != batch_size:
                feed = self._padded(loaded, feed, batch_size, rows_run)
            bound = loaded.bound_sessions.get(rows_run)
            if bound is not None and any(_is_cupy(a) for a in feed.values()):
                bound = None  # device inputs: the CuPy path below
            try:
                if bound is not None:
                    outputs = bound.run(feed, batch_size)
                elif self._kind == "cuda":
                    outputs = self._run_cuda(loaded, session, feed, rows_run)
                else:
                    values = session.run(loaded.output_names, feed)
                    outputs = dict(zip(loaded.output_names, values, strict=True))
                if rows_run != batch_size:
                    outputs = {name: value[:batch_size] for name, value in outputs.items()}
            except Exception as exc:  # ONNX Runtime raises its own pybind error types
                raise BackendFailedError(
                    f"model {model!r}: batch of {batch_size} failed in ONNX Runtime: {exc}"
                ) from exc
        return split_rows(outputs, batch_size, rows)

    # -- internals

    def _model(self, model: str) -> _LoadedModel:
        try:
            return self._loaded[model]
        except KeyError:
            if model in self._max_batch:
                raise BadRequestError(f"model {model!r} is not loaded (call load())") from None
            raise BadRequestError(
                f"unknown model {model!r} (serving {', '.join(self.models)})"
            ) from None

    def _load_model(self, spec: ModelSpec) -> _LoadedModel:
        _check_file(spec.name, spec.path)
        limit = self._max_batch[spec.name]
        sizes = self._session_sizes.get(spec.name) or self.config.session_batch_sizes
        if not sizes and self._kind == "cuda":
            sizes = default_cuda_batch_sizes(limit)
        sizes = tuple(sorted({size for size in sizes if size < limit} | {limit})) if sizes else ()
        sessions = self._open_sessions(spec, sizes or (limit,))
        session = sessions[limit]

        def raw(arg: Any) -> tuple[str, str, list[int | str | None] | None]:
            dtype = _ORT_DTYPES.get(arg.type, arg.type)
            return arg.name, dtype, None if arg.shape is None else list(arg.shape)

        signature = _signature(
            spec.name,
            spec.path,
            [raw(a) for a in session.get_inputs()],
            [raw(a) for a in session.get_outputs()],
        )
        host_buffers = {
            s.name: self._host_buffer((limit, *(int(d) for d in s.shape if d is not None)),
                                      np.dtype(s.dtype))
            for s in signature.inputs
        }
        bound: dict[int, Any] = {}
        if self.config.bound_buffers and sizes:
            from zserve.backends.onnx_binding import BoundSession

            bound = {size: BoundSession(session_of_size, signature, size, device=self._kind,
                                        device_id=self._device_id)
                     for size, session_of_size in sessions.items()}
        return _LoadedModel(
            bound_sessions=bound,
            spec=spec,
            max_batch=limit,
            session=session,
            sized_sessions=sessions if sizes else {},
            signature=signature,
            output_names=signature.output_names,
            host_buffers=host_buffers,
            device_buffers={},
            static_outputs=all(None not in s.shape for s in signature.outputs),
            file_bytes=spec.path.stat().st_size,
        )

    def _providers(self, ort: Any, spec: ModelSpec) -> list[Any]:
        if self._kind != "cuda":
            return ["CPUExecutionProvider"]
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise ModelLoadError(
                f"model {spec.name!r}: device {self.device} needs onnxruntime-gpu, but this "
                f"onnxruntime has only {available} (pip uninstall onnxruntime && "
                "pip install 'zserve[gpu]')"
            )
        preload_cuda_libraries(ort)
        providers: list[Any] = [
            ("CUDAExecutionProvider", self.config.cuda_provider_options(self._device_id)),
            "CPUExecutionProvider",
        ]
        if self.config.tensorrt:
            if "TensorrtExecutionProvider" not in available:
                raise ModelLoadError(f"model {spec.name!r}: tensorrt is set but this "
                                     f"onnxruntime has only {available}")
            providers.insert(0, ("TensorrtExecutionProvider",
                                 tensorrt_provider_options(self._device_id)))
        return providers

    def _open_sessions(self, spec: ModelSpec, sizes: Sequence[int]) -> dict[int, Any]:
        """One InferenceSession per batch size in ``sizes``."""
        import onnxruntime as ort

        providers = self._providers(ort, spec)
        sessions: dict[int, Any] = {}
        for size in sizes:
            try:
                sessions[size] = ort.InferenceSession(
                    str(spec.path), sess_options=self.config.session_options(),
                    providers=providers
                )
            except Exception as exc:  # ONNX Runtime raises its own pybind error types
                raise ModelLoadError(_describe_load_failure(spec, exc)) from None
            cuda_missing = "CUDAExecutionProvider" not in sessions[size].get_providers()
            if self._kind == "cuda" and cuda_missing:
                raise ModelLoadError(
                    f"model {spec.name!r}: the CUDA execution provider failed to initialise on "
                    f"{self.device} (CUDA/cuDNN libraries missing?); refusing to run on the CPU"
                )
        return sessions

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        return self._host_buffer(shape, dtype)

    def _host_buffer(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        if self._kind == "cuda":
            try:
                import cupy

                # Pinned host memory: the host -> device copy runs at full bus speed.
                size = int(np.prod(shape)) * dtype.itemsize
                memory = cupy.cuda.alloc_pinned_memory(size)
                pinned = np.frombuffer(memory, dtype, int(np.prod(shape))).reshape(shape)
                pinned.fill(0)  # rows past a batch are a padded session's input (module docstring)
                return pinned
            except ImportError:
                pass
        return np.zeros(shape, dtype)

    @staticmethod
    def _session_for(loaded: _LoadedModel, batch_size: int) -> tuple[Any, int]:
        """The session that runs a batch of ``batch_size`` rows, and the rows it runs."""
        for size, session in loaded.sized_sessions.items():
            if size >= batch_size:
                return session, size
        return loaded.session, batch_size

    def _padded(self, loaded: _LoadedModel, feed: TensorMap, batch_size: int,
                rows: int) -> TensorMap:
        """``feed`` grown to ``rows`` rows: a host batch that is a row slice of a larger buffer
        with ``rows`` rows from its start (a staged batch: ``zserve.backends.staging``) grows in
        place, whatever those rows hold (padding); otherwise the batch buffer's first ``rows``
        rows, the batch copied in unless it was assembled there."""
        padded: TensorMap = {}
        for name, array in feed.items():
            grown = None if _is_cupy(array) else _grown_in_place(array, rows)
            if grown is not None:
                padded[name] = grown
                continue
            if _is_cupy(array):
                buffer = self._device_buffer(loaded, name)
            else:
                buffer = loaded.host_buffers[name]
            head = buffer[:batch_size]
            if not _same_memory(array, head):
                head[...] = array
            padded[name] = buffer[:rows]
        return padded

    def _assemble(self, loaded: _LoadedModel, inputs: BatchInputs, batch_size: int) -> TensorMap:
        """The batch as one array per input: at most one copy per request and input."""
        if isinstance(inputs, Mapping):
            return {name: self._contiguous(name, a) for name, a in inputs.items()}
        if len(inputs) == 1:
            return {name: self._contiguous(name, a) for name, a in inputs[0].items()}
        feed: TensorMap = {}
        for name in loaded.signature.input_names:
            parts = [request[name] for request in inputs]
            if any(_is_cupy(p) for p in parts):
                feed[name] = self._assemble_on_device(loaded, name, parts)
            else:
                out = loaded.host_buffers[name][:batch_size]
                np.concatenate(parts, axis=0, out=out)
                feed[name] = out
        return feed

    def _contiguous(self, name: str, array: Any) -> Any:
        if _is_cupy(array):
            if self._kind != "cuda":
                raise BadRequestError(
                    f"input {name!r} is a CuPy array but this executor runs on {self.device}"
                )
            import cupy

            return cupy.ascontiguousarray(array)
        return np.ascontiguousarray(array)

    def _assemble_on_device(self, loaded: _LoadedModel, name: str, parts: list[Any]) -> Any:
        if self._kind != "cuda":
            raise BadRequestError(
                f"input {name!r} holds CuPy arrays but this executor runs on {self.device}"
            )
        import cupy

        out = self._device_buffer(loaded, name)[: sum(int(p.shape[0]) for p in parts)]
        if all(_is_cupy(p) for p in parts):
            cupy.concatenate(parts, axis=0, out=out)
        else:
            # Mixed host and device requests (rare): copy request by request.
            start = 0
            for part in parts:
                stop = start + int(part.shape[0])
                out[start:stop] = cupy.asarray(part)
                start = stop
        return out

    def _device_buffer(self, loaded: _LoadedModel, name: str) -> Any:
        """The model's device batch buffer of input ``name`` (zeroed, allocated on first use)."""
        import cupy

        buffer = loaded.device_buffers.get(name)
        if buffer is None:
            host = loaded.host_buffers[name]
            with cupy.cuda.Device(self._device_id):
                buffer = cupy.zeros(host.shape, host.dtype)
            loaded.device_buffers[name] = buffer
        return buffer

    def _run_cuda(self, loaded: _LoadedModel, session: Any, feed: TensorMap,
                  batch_size: int) -> TensorMap:
        binding = session.io_binding()
        on_device = False
        for name, array in feed.items():
            if _is_cupy(array):
                on_device = True
                device_array: Any = array  # a CuPy array: its .data is a device pointer
                binding.bind_input(name, "cuda", self._device_id, array.dtype.type,
                                   tuple(array.shape), device_array.data.ptr)
            else:
                binding.bind_cpu_input(name, array)
        if on_device:
            import cupy

            # Inputs were assembled on CuPy's stream; ONNX Runtime runs on its own stream.
            cupy.cuda.get_current_stream().synchronize()

        if loaded.static_outputs:
            outputs: TensorMap = {}
            for spec in loaded.signature.outputs:
                shape = (batch_size, *(int(d) for d in spec.shape if d is not None))
                dtype = np.dtype(spec.dtype)
                if on_device:
                    import cupy

                    with cupy.cuda.Device(self._device_id):
                        out = cupy.empty(shape, dtype)
                    binding.bind_output(spec.name, "cuda", self._device_id, dtype.type, shape,
                                        out.data.ptr)
                else:
                    out = np.empty(shape, dtype)
                    binding.bind_output(spec.name, "cpu", 0, dtype.type, shape, out.ctypes.data)
                outputs[spec.name] = out
            # Run synchronises the provider's stream before returning, so the outputs are ready.
            session.run_with_iobinding(binding)
            return outputs

        for name in loaded.output_names:
            binding.bind_output(name, "cuda", self._device_id)
        session.run_with_iobinding(binding)
        if not on_device:
            values = binding.copy_outputs_to_cpu()
            return dict(zip(loaded.output_names, values, strict=True))
        import cupy

        device_outputs: TensorMap = {}
        for name, value in zip(loaded.output_names, binding.get_outputs(), strict=True):
            dtype = np.dtype(_ORT_DTYPES[value.data_type()])
            shape = tuple(value.shape())
            nbytes = int(np.prod(shape)) * dtype.itemsize
            # Wrap ONNX Runtime's buffer without a copy; the OrtValue stays alive as its owner.
            memory = cupy.cuda.UnownedMemory(value.data_ptr(), nbytes, value, self._device_id)
            pointer = cupy.cuda.MemoryPointer(memory, 0)
            device_outputs[name] = cupy.ndarray(shape, dtype, pointer)
        return device_outputs


def _describe_load_failure(spec: ModelSpec, exc: Exception) -> str:
    """A one-paragraph message for an ONNX Runtime load failure (no traceback)."""
    text = str(exc).strip()
    kind = type(exc).__name__
    if kind == "InvalidProtobuf" or "INVALID_PROTOBUF" in text or "Protobuf parsing" in text:
        reason = "the file is not a valid ONNX model (truncated or corrupt?)"
    elif kind == "NoSuchFile":
        reason = "the file cannot be read"
    else:
        reason = "ONNX Runtime rejected the model (corrupt file, or unsupported operators/opset?)"
    return f"model {spec.name!r}: cannot load {spec.path}: {reason}. ONNX Runtime said: {text}"
