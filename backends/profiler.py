"""Latency profiles: measure l(b) of a model, fit ``alpha*b + beta``, write the profile file.

``zserve profile MODEL [--device cpu|cuda:0] [--max-batch N] [--repeats R] [--warmup W]
[--threads T] [--out PROFILE.json] [--plot PNG]``

MODEL is a model spec (``cnn``, ``NAME=PATH.onnx`` or ``PATH.onnx``; see
``zserve.backends.builtin``). For each batch size b = 1..N the profiler runs the batch through the
same executor path a backend uses (per-request inputs assembled into the batch buffer, outputs
split into per-request row views), after ``W`` warm-up runs per size, ``R`` timed runs per size.
Sizes are interleaved (1, 2, ..., N, 1, 2, ...) so that a slow stretch of a shared machine hits
every size alike instead of bending the curve. It reports the median l(b) with its p10/p90
spread, the least-squares fit ``l(b) = alpha*b + beta``, its R^2 and the largest relative error
of the fit over the measured medians.

CPU profiles use ONE intra-op thread by default (``--threads``): a backend is one device, and on a
CPU "device" one thread per backend is what keeps backends from fighting over cores; it also
makes l(b) reproducible on a shared machine.

Profile file (the one format of ``zserve.config.profiles``, read by its ``load_profiles``)::

    {"format": "zserve-profile/1",
     "device": "cpu",
     "models": {"cnn": {"alpha_ms": 0.52, "beta_ms": 3.5, "max_batch": 32,
                        "latency_ms": [l(1), l(2), ..., l(max_batch)]}}}

``latency_ms`` is the measured median l(b), made non-decreasing (each entry is the largest median
at or below its batch size): the scheduler needs a monotone table, and a dip in the measurement
is noise, not a property of the model. If ``--out`` names an existing profile file of the same
device, the model's entry is added or replaced and the other models are kept.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zserve.config.profiles import (
    PROFILE_FORMAT,
    LatencyProfile,
    ProfileEntry,
    profile_file_dict,
    write_profile_entries,
)

__all__ = [
    "PROFILE_FORMAT",
    "LatencyMeasurement",
    "fit_linear",
    "main",
    "measure_latency",
    "plot_profile",
    "write_profile_file",
]


@dataclass(frozen=True, slots=True)
class LatencyMeasurement:
    """What profiling one model on one device measured: the spread of l(b) per batch size and
    the line fitted to it. Index i of each list is batch size ``batch_sizes[i]``. The scheduler's
    l(b) is :meth:`to_profile` (``zserve.config.profiles.LatencyProfile``)."""

    model: str
    device: str
    batch_sizes: list[int]
    latency_ms: list[float]  # median
    p10_ms: list[float]
    p90_ms: list[float]
    alpha_ms: float
    beta_ms: float
    r2: float
    max_rel_error: float

    def predict_ms(self, batch_size: int) -> float:
        return self.alpha_ms * batch_size + self.beta_ms

    @classmethod
    def from_measurements(
        cls, model: str, device: str, samples_ms: Mapping[int, Sequence[float]]
    ) -> LatencyMeasurement:
        sizes = sorted(samples_ms)
        median = [float(np.median(samples_ms[b])) for b in sizes]
        p10 = [float(np.percentile(samples_ms[b], 10)) for b in sizes]
        p90 = [float(np.percentile(samples_ms[b], 90)) for b in sizes]
        alpha, beta, r2, max_rel = fit_linear(sizes, median)
        return cls(model, device, sizes, median, p10, p90, alpha, beta, r2, max_rel)

    @classmethod
    def linear(cls, model: str, device: str, alpha_ms: float, beta_ms: float,
               max_batch: int) -> LatencyMeasurement:
        """An exact linear profile (what the emulated executor runs)."""
        sizes = list(range(1, max_batch + 1))
        latency = [alpha_ms * b + beta_ms for b in sizes]
        return cls(model, device, sizes, latency, latency, latency, alpha_ms, beta_ms, 1.0, 0.0)

    def table_ms(self) -> list[float]:
        """l(1..max_batch) for the profile file: monotone (running maximum of the medians).
        Requires the profile to cover every batch size 1..max_batch."""
        if self.batch_sizes != list(range(1, len(self.batch_sizes) + 1)):
            raise ValueError(
                f"profile of {self.model!r} covers batch sizes {self.batch_sizes}; "
                "the profile file needs every size 1..max_batch"
            )
        return [float(x) for x in np.maximum.accumulate(self.latency_ms)]

    def to_file_entry(self) -> ProfileEntry:
        """Its profile-file entry: the fitted line and the monotone table."""
        return ProfileEntry(
            alpha_ms=float(self.alpha_ms),
            beta_ms=float(self.beta_ms),
            max_batch=int(self.batch_sizes[-1]),
            latency_ms=self.table_ms(),
        )

    def to_profile(self) -> LatencyProfile:
        """The l(b) the scheduler uses: the monotone table of the medians."""
        return LatencyProfile.from_table_ms(self.table_ms())

    def report(self) -> str:
        lines = [
            f"model {self.model} on {self.device}:",
            "     b   median_ms    p10_ms    p90_ms    fit_ms",
        ]
        for b, med, lo, hi in zip(
            self.batch_sizes, self.latency_ms, self.p10_ms, self.p90_ms, strict=True
        ):
            lines.append(f"  {b:4d}  {med:10.3f} {lo:9.3f} {hi:9.3f} {self.predict_ms(b):9.3f}")
        ratio = self.beta_ms / self.alpha_ms if self.alpha_ms > 0 else math.inf
        lines.append(
            f"  fit: l(b) = {self.alpha_ms:.4f}*b + {self.beta_ms:.4f} ms   "
            f"(beta/alpha {ratio:.2f}, R^2 {self.r2:.4f}, "
            f"max rel error {self.max_rel_error * 100:.1f}%)"
        )
        return "\n".join(lines)


def fit_linear(
    batch_sizes: Sequence[int], latency_ms: Sequence[float]
) -> tuple[float, float, float, float]:
    """Least-squares ``l(b) = alpha*b + beta`` with ``alpha, beta >= 0``; returns (alpha, beta,
    R^2, max relative error).

    The bounds are the profile's contract (a batch never costs less than a smaller one, and no
    batch runs in negative time): a tiny model whose timings are all noise can fit a falling line,
    which the profile file would refuse. The bounded optimum is then on the edge: ``alpha = 0,
    beta = mean(l)``, or ``beta = 0`` and alpha through the origin. With a single batch size the
    fit is ``alpha = 0, beta = l``. R^2 is 1.0 when the data have no variance at all (every l equal
    and fitted exactly)."""
    b = np.asarray(batch_sizes, dtype=np.float64)
    y = np.asarray(latency_ms, dtype=np.float64)
    if b.size == 0 or b.size != y.size:
        raise ValueError("fit_linear needs as many latencies as batch sizes, at least one")
    if b.size == 1 or np.ptp(b) == 0:
        alpha, beta = 0.0, float(y.mean())
    else:
        design = np.stack([b, np.ones_like(b)], axis=1)
        (alpha, beta), *_ = np.linalg.lstsq(design, y, rcond=None)
        if alpha < 0:
            alpha, beta = 0.0, float(y.mean())
        elif beta < 0:
            alpha, beta = float(np.dot(b, y) / np.dot(b, b)), 0.0
    fitted = alpha * b + beta
    ss_res = float(np.sum((y - fitted) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    max_rel = float(np.max(np.abs(fitted - y) / np.maximum(np.abs(y), 1e-12)))
    return float(alpha), float(beta), r2, max_rel


def measure_latency(
    model: str,
    device: str,
    run_batch: Callable[[int], object],
    batch_sizes: Sequence[int],
    *,
    repeats: int = 10,
    warmup: int = 2,
) -> LatencyMeasurement:
    """Time ``run_batch(b)`` (synchronous: returns when the batch is done) for each size."""
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    for _ in range(warmup):
        for b in sizes:
            run_batch(b)
    samples: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(repeats):
        for b in sizes:
            start = time.perf_counter()
            run_batch(b)
            samples[b].append((time.perf_counter() - start) * 1e3)
    return LatencyMeasurement.from_measurements(model, device, samples)


# --------------------------------------------------------------------------- profile file


def write_profile_file(path: Path, device: str, profiles: Sequence[LatencyMeasurement],
                       *, merge: bool = True) -> dict[str, Any]:
    """Write (atomically) the profile file of ``profiles``, all of one device. With ``merge`` and
    an existing file of the same device, its other models are kept. Returns the written object."""
    entries = {p.model: p.to_file_entry() for p in profiles}
    return profile_file_dict(write_profile_entries(path, device, entries, merge=merge))


def plot_profile(profile: LatencyMeasurement, path: Path) -> None:
    """Plot measured l(b) (median with p10-p90 band) and the fit to a PNG. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "plotting needs matplotlib: pip install 'zserve[plot]' (or leave out --plot)"
        ) from None
    b = np.asarray(profile.batch_sizes)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.fill_between(b, profile.p10_ms, profile.p90_ms, alpha=0.25, label="p10-p90")
    ax.plot(b, profile.latency_ms, "o-", ms=3, label="measured median")
    ax.plot(b, profile.alpha_ms * b + profile.beta_ms, "--",
            label=f"fit {profile.alpha_ms:.3f}b + {profile.beta_ms:.3f} (R² {profile.r2:.3f})")
    ax.set_xlabel("batch size b")
    ax.set_ylabel("l(b) [ms]")
    ax.set_title(f"{profile.model} on {profile.device}")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str]) -> int:
    """``zserve profile``: measure l(b), fit, write the profile file, optionally plot."""
    parser = argparse.ArgumentParser(
        prog="zserve profile",
        description="Measure l(b) of an ONNX model for b = 1..max-batch, fit alpha*b + beta, and "
        "write the profile file the scheduler reads.",
    )
    parser.add_argument("model", help="cnn | mlp | NAME=PATH.onnx | PATH.onnx")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    parser.add_argument("--max-batch", type=int, default=32, help="largest batch (default 32)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per size (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up runs per size (default 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="ONNX Runtime intra-op threads (default 1: one core per CPU backend)")
    parser.add_argument("--out", type=Path, help="profile file to write (merged if it exists)")
    parser.add_argument("--plot", type=Path, help="PNG to plot l(b) and the fit into")
    args = parser.parse_args(list(argv))
    if args.max_batch < 1 or args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--max-batch, --repeats and --threads must be >= 1, --warmup >= 0")

    from zserve.backends.builtin import resolve_model_spec
    from zserve.backends.executor import ModelLoadError
    from zserve.backends.onnx_executor import OnnxExecutor
    from zserve.backends.onnx_session import SessionConfig

    try:
        spec = resolve_model_spec(args.model)
        config = SessionConfig(intra_op_threads=args.threads)
        with OnnxExecutor([spec], device=args.device, max_batch=args.max_batch,
                          config=config) as executor:
            profile = executor.profile(spec.name, repeats=args.repeats, warmup=args.warmup)
    except (ValueError, ModelLoadError) as exc:
        print(f"zserve profile: {exc}", file=sys.stderr)
        return 2
    print(profile.report())
    if args.out is not None:
        try:
            write_profile_file(args.out, args.device, [profile])
        except (ValueError, OSError) as exc:
            print(f"zserve profile: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}")
    if args.plot is not None:
        try:
            plot_profile(profile, args.plot)
        except RuntimeError as exc:
            print(f"zserve profile: {exc}", file=sys.stderr)
            return 2
        print(f"plotted {args.plot}")
    return 0
