"""What the frontend core knows per model: admission bounds and request shapes.

``ModelAdmission`` holds one model's admission state (queued count, the predicted-wait bound from
its ``zserve.config.profiles.LatencyProfile``, its ``CapacityGate`` past the capacity, the
signature its backends registered); ``RequestSpec`` is the one exact input form a signature may fix,
checked in a few comparisons before the full validation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zserve.config.cluster import ModelConfig
from zserve.config.profiles import LatencyProfile
from zserve.config.signature import ModelSignature
from zserve.core.errors import BadRequestError, TooLargeError

# Admission measures each model's offered rate over windows of this length (docs/runtime.md
# "Admission"); long against a Poisson burst, short against the time a queue takes to overflow.
RATE_WINDOW_S = 1.0
# ... and at least this many run times of the model's capacity batch: for a slow model, a burst
# that one batch absorbs (two requests to a 3 s model) is not a rate past its capacity.
RATE_WINDOW_BATCHES = 2
# Past the capacity, this frontend admits the model's rows at a rate (a token bucket) that starts
# at its share of the capacity and follows the model's answers once per rate window: a window
# whose answers missed their deadline more often than GATE_MISS_TARGET cuts it by the excess, at
# least GATE_MIN_CUT and at most GATE_MAX_CUT; a window that stayed under the target while the
# gate refused raises it, by GATE_RECOVER of the gap below the capacity, by GATE_PROBE_UP above.
# It stays within GATE_FLOOR_FRACTION and GATE_CEILING_FRACTION of the share. A rate, unlike a
# bound on the rows waiting to be planned, does not depend on how long the scheduler holds rows
# back for their batch: deferral holds them on purpose. The misses show a window after the rate
# that caused them, so above the capacity the probe is small and the cut deep: the rate saws
# between the rate at which misses start and GATE_MIN_CUT below it (docs/runtime.md,
# "Admission").
GATE_MISS_TARGET = 0.002
GATE_MIN_ANSWERS = 20  # fewer: the miss fraction is noise; windows add up until there are as many
GATE_MIN_CUT = 0.05
GATE_MAX_CUT = 0.10
GATE_PROBE_UP = 0.01
# Below the capacity, a clean window in which the gate refused closes this fraction of the gap
# to it: one window of misses (a host's stall: 114 of 323 answers in one second, live) cut the
# rate by GATE_MAX_CUT, and 1% a window took half a minute to give it back.
GATE_RECOVER = 0.25
GATE_FLOOR_FRACTION = 0.25
SURGE_DEVIATIONS = 3.0
GATE_CEILING_FRACTION = 2.0

RequestSpec = tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]


class CapacityGate:
    """One model's admission past its capacity, at one frontend: whether the offered rate is past
    ``capacity_rps`` (over the last rate window, or already within the current one), and then a
    token bucket of ``burst_rows`` rows refilled at an adaptive rate that starts at
    ``capacity_rps`` and follows the model's answers (``note_answer``): see GATE_MISS_TARGET.
    Pure and O(1) per request: the clock is the one it is called with."""

    __slots__ = (
        "_answers",
        "_burst_rows",
        "_ceiling_rps",
        "_floor_rps",
        "_last_refill",
        "_misses",
        "_refused",
        "_surge_rows",
        "_tokens",
        "_window_rows",
        "_window_s",
        "_window_start",
        "capacity_rps",
        "overloaded",
        "rate_rps",
    )

    def __init__(self, capacity_rps: float, burst_rows: float, window_s: float) -> None:
        self.capacity_rps = capacity_rps
        self.rate_rps = capacity_rps
        self._floor_rps = GATE_FLOOR_FRACTION * capacity_rps
        self._ceiling_rps = GATE_CEILING_FRACTION * capacity_rps
        self._burst_rows = burst_rows
        self._tokens = burst_rows
        self._last_refill = -math.inf
        self._window_s = window_s
        self._surge_rows = _surge_rows(capacity_rps, burst_rows, window_s)
        # Offered rows since ``_window_start`` (None: no window yet); answers, misses and
        # refusals in it. ``overloaded``: the last window's offered rate exceeded the capacity
        # (True until one has been measured: the safe start).
        self._window_start: float | None = None
        self._window_rows = 0
        self._answers = 0
        self._misses = 0
        self._refused = 0
        self.overloaded = True

    def rescale(self, capacity_rps: float) -> None:
        """The model's GPUs changed: the rate keeps its place relative to the capacity."""
        if capacity_rps == self.capacity_rps:
            return
        scale = capacity_rps / self.capacity_rps if self.capacity_rps > 0 else 1.0
        self.capacity_rps = capacity_rps
        self.rate_rps *= scale
        self._floor_rps = GATE_FLOOR_FRACTION * capacity_rps
        self._ceiling_rps = GATE_CEILING_FRACTION * capacity_rps
        self._surge_rows = _surge_rows(capacity_rps, self._burst_rows, self._window_s)

    def set_burst(self, burst_rows: float) -> None:
        """A new bucket size (the reply allowance it was sized with moved): the tokens held
        stay, up to the new size."""
        self._burst_rows = burst_rows
        self._tokens = min(self._tokens, burst_rows)
        self._surge_rows = _surge_rows(self.capacity_rps, burst_rows, self._window_s)

    def admit(self, now: float, rows: int) -> bool:
        """Whether a request of ``rows`` rows offered at ``now`` may be admitted."""
        start = self._window_start
        if start is None:
            start = self._window_start = now
        elif now - start >= self._window_s:
            self._end_window(now, start)
            start = now
        self._window_rows += rows
        # Past it already within the window: more rows than the capacity serves since it began,
        # by more than a Poisson stream's surge (a step up in load is caught in a fraction of
        # the window, before it has filled the scheduler with what it cannot serve in time).
        if self._window_rows > self.capacity_rps * (now - start) + self._surge_rows:
            self.overloaded = True
        tokens = min(self._burst_rows,
                     self._tokens + max(0.0, now - self._last_refill) * self.rate_rps)
        self._last_refill = now
        needed = min(float(rows), self._burst_rows)  # a request larger than the bucket fits empty
        if not self.overloaded:
            # The bucket follows what is admitted meanwhile: a burst that brings the overload
            # has spent it already.
            self._tokens = max(0.0, tokens - needed)
            return True
        if tokens < needed:
            self._tokens = tokens
            self._refused += 1
            return False
        self._tokens = tokens - needed
        return True

    def note_answer(self, deadline_missed: bool) -> None:
        """An admitted request was answered: ``DEADLINE`` (``deadline_missed``) or with outputs."""
        self._answers += 1
        self._misses += deadline_missed

    def _end_window(self, now: float, start: float) -> None:
        was_overloaded = self.overloaded
        self.overloaded = self._window_rows > self.capacity_rps * (now - start)
        self._window_start = now
        self._window_rows = 0
        if not was_overloaded:
            self._answers = self._misses = self._refused = 0
            return
        if self._answers < GATE_MIN_ANSWERS:
            return  # a slow model: its answers add up over several windows
        missed = self._misses / self._answers
        if missed > GATE_MISS_TARGET:
            self.rate_rps *= 1.0 - min(GATE_MAX_CUT,
                                       max(GATE_MIN_CUT, missed - GATE_MISS_TARGET))
        elif self._refused:
            # back towards the capacity quickly (a cut may have answered a passing stall), and
            # past it by small probes
            self.rate_rps += max(GATE_RECOVER * (self.capacity_rps - self.rate_rps),
                                 GATE_PROBE_UP * self.rate_rps)
        self.rate_rps = min(max(self.rate_rps, self._floor_rps), self._ceiling_rps)
        self._answers = self._misses = self._refused = 0


def _surge_rows(capacity_rps: float, burst_rows: float, window_s: float) -> float:
    """How far a window's offered rows may run ahead of the capacity before the window is read as
    past it: three standard deviations of a Poisson stream at the capacity over the window, and
    at least the bucket (the burst served in time)."""
    return max(burst_rows, SURGE_DEVIATIONS * math.sqrt(capacity_rps * window_s))


class ModelAdmission:
    """Per-model admission state: the queued bound, the predicted-wait bound, the signature.
    ``pending`` and ``max_queue`` count rows (a request of n rows is n of them)."""

    __slots__ = (
        "_capacity",
        "_gate",
        "_gate_gpus",
        "_profile",
        "config",
        "frontend_share",
        "max_queue",
        "pending",
        "predicted_wait_bound_s",
        "queued",
        "reply_allowance_s",
        "request_spec",
        "shard",
        "signature",
        "signature_wire",
        "slo_s",
    )

    def __init__(self, config: ModelConfig, shard: int, profile: LatencyProfile | None,
                 reply_allowance_s: float = 0.0, frontend_share: float = 1.0) -> None:
        self.config = config
        self.shard = shard
        self.max_queue = config.max_queue
        # The predicted-wait bound on every pending row: only where max_wait_ms is set.
        self.predicted_wait_bound_s = (math.inf if config.max_wait_ms is None
                                       else config.max_wait_ms / 1e3)
        self.slo_s = config.slo_ms / 1e3
        self.pending = 0
        self.queued = 0  # rows admitted whose inputs no backend has fetched: not yet planned
        self.reply_allowance_s = reply_allowance_s
        # This frontend's share of the model's offered load (1 / the frontends): the capacity
        # its gate admits past the capacity is that share of the model's.
        self.frontend_share = frontend_share
        # The gate past the capacity, for ``_gate_gpus`` GPUs (made on first use; None: off).
        self._gate: CapacityGate | None = None
        self._gate_gpus = -1
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
        self._gate_gpus = -1

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
        queue bound, the predicted wait, the rate past the capacity), or None to admit it;
        ``gpus``: the GPUs that serve the model."""
        if self.pending + rows > self.max_queue:
            return f"model {self.config.name!r}: {self.pending} rows queued (limit " \
                   f"{self.max_queue})"
        predicted_wait_s = self.pending / self.capacity_rps(gpus)
        if predicted_wait_s > self.predicted_wait_bound_s:
            return f"model {self.config.name!r}: predicted wait {predicted_wait_s * 1e3:.1f} " \
                   f"ms exceeds {self.predicted_wait_bound_s * 1e3:.1f} ms"
        gate = self.gate(gpus)
        if gate is not None and not gate.admit(now, rows):
            return f"model {self.config.name!r}: offered past its capacity; admitting " \
                   f"{gate.rate_rps:.1f} rows/s here"
        return None

    def gate(self, gpus: int) -> CapacityGate | None:
        """The gate past the model's capacity at ``gpus`` GPUs; None where there is none
        (``shed_past_capacity = false``, no profile, no capacity)."""
        if gpus == self._gate_gpus:
            return self._gate
        self._gate_gpus = gpus
        capacity = self.capacity_rps(gpus) * self.frontend_share
        if not (self.config.shed_past_capacity and self._profile is not None
                and 0 < capacity < math.inf):
            self._gate = None
            return None
        if self._gate is not None:
            self._gate.rescale(capacity)
            return self._gate
        batch = self._capacity_batch(gpus)
        window_s = max(RATE_WINDOW_S, RATE_WINDOW_BATCHES * self._profile.latency(batch))
        self._gate = CapacityGate(capacity, self._burst_rows(capacity, gpus), window_s)
        return self._gate

    def _capacity_batch(self, gpus: int) -> int:
        """b*: the capacity batch (see capacity_rps)."""
        assert self._profile is not None
        return max(1, self._profile.largest_batch_within(self.slo_s / (1.0 + 1.0 / gpus)))

    def _burst_rows(self, capacity: float, gpus: int) -> float:
        """The gate's bucket: the burst the model's share serves in time from idle, the rows
        that, waiting at capacity, still finish within the SLO less the reply allowance with
        one l(b*)/N to spare, and at least one b* and the largest batch one idle GPU finishes
        within it. A rate window spans two of b*'s runs at least."""
        assert self._profile is not None
        batch = self._capacity_batch(gpus)
        budget_s = self.slo_s - self.reply_allowance_s
        one_batch = self._profile.largest_batch_within(budget_s)
        waiting = capacity * (budget_s - self._profile.latency(batch) * (1.0 + 2.0 / gpus))
        return max(float(batch), float(one_batch), waiting)

    def set_reply_allowance(self, reply_s: float) -> None:
        """The frontend's learned reply allowance moved: the gate's bucket follows it."""
        self.reply_allowance_s = reply_s
        if self._gate is not None:
            self._gate.set_burst(self._burst_rows(self._gate.capacity_rps, self._gate_gpus))

    def note_answer(self, deadline_missed: bool) -> None:
        """An admitted request was answered: DEADLINE (``deadline_missed``) or with outputs."""
        if self._gate is not None:
            self._gate.note_answer(deadline_missed)

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
