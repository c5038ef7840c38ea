"""What the frontend core knows per model: admission bounds and request shapes.

``ModelAdmission`` holds one model's admission state (queued count, the predicted-wait bound from
its ``zserve.profiles.LatencyProfile``, the signature its backends registered); ``RequestSpec``
is the one exact input form a signature may fix, checked in a few comparisons before the full
validation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zserve.config import ModelConfig
from zserve.errors import BadRequestError, TooLargeError
from zserve.profiles import LatencyProfile
from zserve.signature import ModelSignature

RequestSpec = tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]


class ModelAdmission:
    """Per-model admission state: the queued bound, the predicted-wait bound, the signature.
    ``pending`` and ``max_queue`` count rows (a request of n rows is n of them)."""

    __slots__ = (
        "_capacity",
        "_profile",
        "config",
        "max_queue",
        "pending",
        "request_spec",
        "shard",
        "signature",
        "signature_wire",
        "slo_s",
        "wait_bound_s",
    )

    def __init__(self, config: ModelConfig, shard: int, profile: LatencyProfile | None) -> None:
        self.config = config
        self.shard = shard
        self.max_queue = config.max_queue
        self.wait_bound_s = config.wait_bound_ms / 1e3
        self.slo_s = config.slo_ms / 1e3
        self.pending = 0
        # None until a backend of the model registered one: then the backend validates.
        self.signature: ModelSignature | None = None
        self.signature_wire: dict[str, Any] | None = None
        # (name, dtype, shape) of every input of a valid request, when the signature fixes them.
        self.request_spec: RequestSpec | None = None
        self._capacity: dict[int, float] = {}
        self._profile = profile

    @property
    def profile(self) -> LatencyProfile | None:
        return self._profile

    @profile.setter
    def profile(self, value: LatencyProfile | None) -> None:
        self._profile = value
        self._capacity.clear()

    def set_signature(self, wire: dict[str, Any], max_request_bytes: int) -> None:
        """Validate requests against the signature of wire form ``wire`` from now on (a
        malformed one raises ValueError and changes nothing)."""
        if wire == self.signature_wire:
            return
        self.signature = ModelSignature.from_dict(wire)
        self.signature_wire = wire
        self.request_spec = request_spec(self.signature, max_request_bytes)

    @property
    def max_rows(self) -> int:
        """The most rows one request may hold: the model's max batch (a request is never split
        across batches), the smaller of the configured one and its profile's."""
        limit = self.config.max_batch
        if self._profile is not None and self._profile.max_batch < limit:
            limit = self._profile.max_batch
        return limit

    def request_rows(self, inputs: dict[str, Any], max_request_bytes: int) -> int:
        """The rows of request ``inputs`` if its inputs may be admitted (size bound, signature,
        rows within ``max_rows``); raises ``TooLargeError`` or ``BadRequestError`` otherwise."""
        spec = self.request_spec
        if spec is not None and matches_spec(inputs, spec):
            return 1  # the one-row form the model takes: every input check passes
        nbytes = sum(int(a.nbytes) for a in inputs.values())
        if nbytes > max_request_bytes:
            raise TooLargeError(f"inputs of {nbytes} bytes exceed {max_request_bytes}")
        if self.signature is not None:
            return self.signature.validate_request(inputs, max_rows=self.max_rows)
        # No signature registered yet (the backend validates): the rows must still agree.
        leading = {tuple(getattr(a, "shape", (1,))[:1]) or (0,) for a in inputs.values()}
        leading = leading or {(1,)}  # no inputs at all: the backend judges them
        rows = leading.pop()[0] if len(leading) == 1 else -1
        if not 1 <= rows <= self.max_rows:
            raise BadRequestError(f"model {self.config.name!r}: inputs must share one leading "
                                  f"dimension of 1..{self.max_rows} rows")
        return int(rows)

    def capacity_rps(self, gpus: int) -> float:
        """The analytic throughput of ``gpus`` coordinated GPUs at this model's SLO (DESIGN
        section 3): b = the largest batch with l(b) * (1 + 1/N) <= SLO; N * b / l(b)."""
        capacity = self._capacity.get(gpus)
        if capacity is None:
            capacity = math.inf
            if self._profile is not None and gpus > 0:
                budget = self.config.slo_ms / 1e3 / (1.0 + 1.0 / gpus)
                batch = max(1, self._profile.largest_batch_within(budget))
                capacity = gpus * batch / self._profile.latency(batch)
            self._capacity[gpus] = capacity
        return capacity


def request_spec(signature: ModelSignature, max_request_bytes: int) -> RequestSpec | None:
    """The exact ``(name, dtype, shape)`` of every input of a request that ``signature`` accepts,
    when it fixes every dimension and such a request is within ``max_request_bytes``; else None.
    A request that matches it passes every input check of admission (size bound, signature),
    checked in a few comparisons (``matches_spec``); any other takes the full checks, which
    name the problem."""
    spec = []
    total_bytes = 0
    for tensor in signature.inputs:
        if any(dim is None for dim in tensor.shape):
            return None
        dtype = np.dtype(tensor.dtype)
        shape = (1, *(int(dim) for dim in tensor.shape if dim is not None))
        total_bytes += dtype.itemsize * math.prod(shape)
        spec.append((tensor.name, dtype, shape))
    if not spec or total_bytes > max_request_bytes:
        return None
    return tuple(spec)


def matches_spec(inputs: dict[str, Any], spec: RequestSpec) -> bool:
    if len(inputs) != len(spec):
        return False
    for name, dtype, shape in spec:
        array = inputs.get(name)
        if array is None or array.dtype != dtype or array.shape != shape:
            return False
    return True
