"""Open-loop arrival processes and model popularity.

- ``constant``: gaps of exactly 1/rate, starting at a random offset U*(1/rate) so models do not
  fire in lockstep.
- ``poisson``: exponential gaps with mean 1/rate.
- ``gamma:K``: Gamma(shape K, scale 1/(K*rate)) gaps: mean 1/rate, CV 1/sqrt(K) (K < 1 is bursty;
  K = 1 is Poisson).

Model i's generator is the i-th child of ``numpy.random.SeedSequence(seed)`` (spawn key ``(i,)``):
independent streams per model and per seed, and adding a model leaves the others' arrivals
unchanged. (The authors' load generator seeds model i with ``seed + 31*i``, so seed 32's model 0
replayed seed 1's model 1: two "independent" runs shared arrival streams.)

Popularity: ``equal``; ``zipf:S`` (model i gets weight 1/(i+1)^S); or explicit shares (a list in
the workload, or per-model ``share``), normalized to sum to 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class _HasShare(Protocol):
    @property
    def share(self) -> float | None: ...


def popularity_shares(
    popularity: str | Sequence[float], models: Sequence[_HasShare]
) -> list[float]:
    """Each model's share of the total rate (sums to 1). Per-model ``share`` wins when every
    model sets one."""
    count = len(models)
    explicit = [m.share for m in models]
    weights: list[float]
    if count and all(s is not None for s in explicit):
        weights = [float(s) for s in explicit if s is not None]
    elif isinstance(popularity, str):
        base, _, arg = popularity.partition(":")
        if base == "equal" and not arg:
            weights = [1.0] * count
        elif base == "zipf":
            try:
                exponent = float(arg)
            except ValueError:
                raise ValueError(f"zipf needs an exponent: zipf:1.0, got {popularity!r}") from None
            weights = [1.0 / (i + 1) ** exponent for i in range(count)]
        else:
            raise ValueError(f"popularity must be equal | zipf:S | [shares], got {popularity!r}")
    else:
        weights = [float(w) for w in popularity]
        if len(weights) != count:
            raise ValueError(f"{len(weights)} shares for {count} models")
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError("shares must be finite, >= 0, and not all 0")
    total = sum(weights)
    return [w / total for w in weights]


def model_rng(seed: int, model_index: int) -> np.random.Generator:
    """Model ``model_index``'s arrival generator for run seed ``seed``: the model's own child of
    ``SeedSequence(seed)`` (what ``SeedSequence(seed).spawn(n)[model_index]`` gives, without
    spawning the others), so streams never repeat across models or seeds."""
    if seed < 0 or model_index < 0:
        raise ValueError(f"seed and model index must be >= 0, got {seed}, {model_index}")
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(model_index,)))


def arrival_times(  # noqa: PLR0917
    kind: str, shape: float, rate: float, duration_s: float, rng: np.random.Generator,
    start_s: float = 0.0,
) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Sorted arrival times in ``[start_s, start_s + duration_s)`` at mean ``rate`` r/s."""
    if rate <= 0 or duration_s <= 0:
        return np.empty(0)
    mean_gap = 1.0 / rate
    if kind == "constant":
        offset = rng.uniform(0.0, mean_gap)
        count = max(0, math.ceil((duration_s - offset) / mean_gap))
        times = offset + mean_gap * np.arange(count, dtype=np.float64)
        return start_s + times[times < duration_s]
    expected = rate * duration_s
    chunks: list[np.ndarray[Any, np.dtype[np.float64]]] = []
    t = 0.0
    while t < duration_s:
        size = int(expected * 1.05 + 6 * math.sqrt(expected + 1) / min(1.0, shape) + 16)
        if kind == "poisson":
            gaps = rng.exponential(mean_gap, size)
        elif kind == "gamma":
            gaps = rng.gamma(shape, mean_gap / shape, size)
        else:
            raise ValueError(f"unknown arrival kind {kind!r}")
        times = t + np.cumsum(gaps)
        chunks.append(times)
        t = float(times[-1])
    out = np.concatenate(chunks)
    return start_s + out[out < duration_s]
