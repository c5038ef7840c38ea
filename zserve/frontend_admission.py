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

# Admission measures each model's offered rate over windows of this length (docs/runtime.md
# "Admission"); long against a Poisson burst, short against the time a queue takes to overflow.
RATE_WINDOW_S = 1.0
# Past the capacity, the bound on queued rows adapts between its floor and ``max_wait_ms`` x the
# capacity: each DEADLINE answer of the model cuts it by QUEUE_LIMIT_CUT, each answer with outputs
# raises it by QUEUE_LIMIT_GROW, so it settles where about GROW / CUT (0.1%) of admitted requests
# miss their deadline.
QUEUE_LIMIT_CUT = 0.05
QUEUE_LIMIT_GROW = 0.00005

RequestSpec = tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]


class ModelAdmission:
    """Per-model admission state: the queued bound, the predicted-wait bound, the signature.
    ``pending`` and ``max_queue`` count rows (a request of n rows is n of them)."""

    __slots__ = (
        "_bounds_gpus",
        "_capacity",
        "_ceiling",
        "_floor",
        "_limit",
        "_profile",
        "_window_capacity_rows",
        "_window_rows",
        "_window_start",
        "config",
        "max_queue",
        "overloaded",
        "pending",
        "predicted_wait_bound_s",
        "queued",
        "reply_allowance_s",
        "request_spec",
        "shard",
        "signature",
        "signature_wire",
        "slo_s",
        "wait_bound_s",
    )

    def __init__(self, config: ModelConfig, shard: int, profile: LatencyProfile | None,
                 reply_allowance_s: float = 0.0) -> None:
        self.config = config
        self.shard = shard
        self.max_queue = config.max_queue
        self.wait_bound_s = config.wait_bound_ms / 1e3  # the waiting rows' ceiling, as wait
        # The predicted-wait bound on every pending row: only where max_wait_ms is set.
        self.predicted_wait_bound_s = (math.inf if config.max_wait_ms is None
                                       else config.max_wait_ms / 1e3)
        self.slo_s = config.slo_ms / 1e3
        self.pending = 0
        self.queued = 0  # rows admitted whose inputs no backend has fetched: not yet planned
        self.reply_allowance_s = reply_allowance_s
        # The queued-rows bound for ``_bounds_gpus`` GPUs (set on first use).
        self._bounds_gpus = -1
        self._floor = math.inf
        self._ceiling = math.inf
        self._limit = 0.0  # raised to the floor on first use
        # Offered rows since ``_window_start`` (None: no window yet); ``overloaded``: the last
        # window's offered rate exceeded the capacity (True until one has been measured).
        self._window_start: float | None = None
        self._window_rows = 0
        self._window_capacity_rows = math.inf  # what the capacity serves in one window
        self.overloaded = True
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
        self._bounds_gpus = -1

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

    def overload(self, now: float, rows: int, gpus: int) -> str | None:
        """Why a request of ``rows`` rows that arrives at ``now`` is refused ``OVERLOADED`` (the
        queue bound, the predicted wait, the rows waiting to be planned), or None to admit it;
        ``gpus``: the GPUs that serve the model."""
        if self.pending + rows > self.max_queue:
            return f"model {self.config.name!r}: {self.pending} rows queued (limit " \
                   f"{self.max_queue})"
        predicted_wait_s = self.pending / self.capacity_rps(gpus)
        if predicted_wait_s > self.predicted_wait_bound_s:
            return f"model {self.config.name!r}: predicted wait {predicted_wait_s * 1e3:.1f} " \
                   f"ms exceeds {self.predicted_wait_bound_s * 1e3:.1f} ms"
        limit = self.queue_limit(now, rows, gpus)
        if self.queued >= limit:
            return f"model {self.config.name!r}: offered past its capacity, and " \
                   f"{self.queued} rows wait to be planned (limit {limit:.0f})"
        return None

    def queue_limit(self, now: float, rows: int, gpus: int) -> float:
        """How many rows may wait to be planned when a request of ``rows`` rows arrives at
        ``now``: unbounded while the model's offered rate is within its capacity at ``gpus``
        GPUs; past it (over the last ``RATE_WINDOW_S`` window, or already in this one), the
        adaptive limit of ``note_answer``: it starts where the last of them still finishes within
        the SLO at capacity, and stays within 1 row and ``max_wait_ms`` x capacity."""
        if gpus != self._bounds_gpus:
            self._set_floor(gpus)
        start = self._window_start
        if start is None:
            self._window_start = now
        elif now - start >= RATE_WINDOW_S:
            self.overloaded = self._window_rows > self.capacity_rps(gpus) * (now - start)
            self._window_start = now
            self._window_rows = 0
        self._window_rows += rows
        if self._window_rows > self._window_capacity_rows:  # past it before the window ends
            self.overloaded = True
        return self._limit if self.overloaded else math.inf

    def note_answer(self, deadline_missed: bool) -> None:
        """An admitted request was answered: DEADLINE (``deadline_missed``) or with outputs."""
        if deadline_missed:
            self._limit = max(self._floor, self._limit * (1.0 - QUEUE_LIMIT_CUT))
        else:
            self._limit = min(self._ceiling, self._limit * (1.0 + QUEUE_LIMIT_GROW))

    def _set_floor(self, gpus: int) -> None:
        capacity = self.capacity_rps(gpus)
        floor = ceiling = math.inf  # no profile: no bound
        if self.config.shed_past_capacity and self._profile is not None and capacity < math.inf:
            # b*: the capacity batch. With ``start`` rows waiting, the last starts within
            # start / C + l(b*) / N (at capacity a GPU frees every l(b*) / N) and finishes l(b*)
            # later: within the SLO less the reply allowance, with one more l(b*) / N of margin
            # for the hosts' timing. The bound starts there (at least one batch of b*) and may
            # fall to 1 row.
            batch = max(1, self._profile.largest_batch_within(self.slo_s / (1.0 + 1.0 / gpus)))
            run_s = self._profile.latency(batch) * (1.0 + 2.0 / gpus)
            start = capacity * (self.slo_s - self.reply_allowance_s - run_s)
            floor = max(1.0, start)
            start = max(float(batch), start)
            ceiling = max(start, capacity * self.wait_bound_s)
        else:
            start = floor
        self._bounds_gpus = gpus
        self._window_capacity_rows = capacity * RATE_WINDOW_S
        self._floor = floor
        self._ceiling = ceiling
        if self._limit == 0.0:
            self._limit = start
        self._limit = min(max(self._limit, floor), ceiling)

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
