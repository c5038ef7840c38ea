"""Latency profiles l(b), their one file format, and the one rule for a model's configured profile.

A :class:`LatencyProfile` gives the execution latency of one batch of ``b`` requests, in seconds,
for ``b = 1..max_batch``. It comes from a linear model ``l(b) = alpha*b + beta`` or from a measured
table. Tables are forced monotone (``l(b) = max(l(1..b))``: a larger batch never finishes earlier,
which the batch-growing rules rely on) and batch sizes above ``max_batch`` are infeasible
(``l(b) = inf``).

Profile file (``zserve-profile/1``), JSON or TOML (by the ``.toml`` suffix) of the same shape::

    {"format": "zserve-profile/1",
     "device": "cpu",
     "models": {"resnet50": {"alpha_ms": 1.053, "beta_ms": 5.072, "max_batch": 64,
                             "latency_ms": [6.1, 7.2, ...]}}}

``latency_ms`` (optional) lists l(1)..l(max_batch) in milliseconds and wins over alpha/beta when
present; ``max_batch`` defaults to its length (a smaller ``max_batch`` truncates it). Without it,
``alpha_ms``, ``beta_ms`` and ``max_batch`` are required. :func:`load_profiles` reads a file,
:func:`write_profile_entries` writes (merging) one, and :func:`configured_profile` is what every
role uses to find the profile cluster.toml gives a model.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from zserve.config.cluster import ModelConfig
from zserve.config.decode import FieldError, SchemaError, check_finite, decode

PROFILE_FORMAT = "zserve-profile/1"
DEFAULT_MAX_BATCH = 1024
"""Cap for linear profiles that name no max_batch (the SLO usually caps the batch far below)."""


@dataclass(slots=True)
class LatencyProfile:
    """l(b) in seconds for b = 1..max_batch.

    ``table_s[b]`` is l(b) for ``1 <= b <= max_batch``; ``table_s[0]`` is 0 and
    ``table_s[max_batch + 1]`` is ``inf`` so that l(bs + 1) needs no bounds check on the hot path.
    """

    max_batch: int
    table_s: list[float]
    alpha_s: float
    beta_s: float
    measured: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction

    @classmethod
    def linear(cls, alpha_ms: float, beta_ms: float, max_batch: int) -> LatencyProfile:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if alpha_ms < 0 or beta_ms < 0:
            raise ValueError(f"alpha_ms and beta_ms must be >= 0, got {alpha_ms}, {beta_ms}")
        alpha_s, beta_s = alpha_ms / 1e3, beta_ms / 1e3
        table = [0.0] + [alpha_s * b + beta_s for b in range(1, max_batch + 1)] + [math.inf]
        return cls(max_batch, table, alpha_s, beta_s)

    @classmethod
    def from_table_ms(cls, latency_ms: list[float]) -> LatencyProfile:
        """A measured table l(1)..l(n) in ms, forced monotone; alpha/beta are a least-squares fit
        (used by the beta*lambda rule and the analytic bounds)."""
        if not latency_ms:
            raise ValueError("latency_ms must not be empty")
        table = [0.0]
        running = 0.0
        for value in latency_ms:
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"latency_ms entries must be positive and finite, got {value}")
            running = max(running, value / 1e3)
            table.append(running)
        table.append(math.inf)
        alpha_s, beta_s = _fit_linear(table[1:-1])
        return cls(len(latency_ms), table, alpha_s, beta_s, measured=True)

    @classmethod
    def linear_for_slo(
        cls, alpha_ms: float, beta_ms: float, slo_ms: float, max_batch: int | None = None
    ) -> LatencyProfile:
        """A linear profile whose max_batch defaults to the largest b with l(b) <= SLO."""
        if max_batch is None:
            fit = math.floor((slo_ms - beta_ms) / alpha_ms) if alpha_ms > 0 else DEFAULT_MAX_BATCH
            max_batch = max(1, min(DEFAULT_MAX_BATCH, fit))
        return cls.linear(alpha_ms, beta_ms, max_batch)

    # ------------------------------------------------------------------ queries

    def latency(self, batch_size: int) -> float:
        """l(b) in seconds; ``inf`` for unprofiled sizes (b > max_batch); 0 for b <= 0."""
        if batch_size <= 0:
            return 0.0
        if batch_size > self.max_batch:
            return math.inf
        return self.table_s[batch_size]

    def largest_batch_within(self, budget_s: float) -> int:
        """The largest b with l(b) <= budget_s (0 when even b = 1 does not fit)."""
        lo, hi = 0, self.max_batch
        table = self.table_s
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if table[mid] <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def latency_ms_list(self) -> list[float]:
        return [t * 1e3 for t in self.table_s[1 : self.max_batch + 1]]

    def truncated(self, max_batch: int) -> LatencyProfile:
        """The same l(b) for b <= ``max_batch`` only (itself when it is no larger)."""
        if max_batch >= self.max_batch:
            return self
        if self.measured:
            return LatencyProfile.from_table_ms(self.latency_ms_list()[:max_batch])
        return LatencyProfile.linear(self.alpha_s * 1e3, self.beta_s * 1e3, max_batch)

    def to_entry(self) -> ProfileEntry:
        """Its entry in a profile file (the table only when it was measured)."""
        return ProfileEntry(
            alpha_ms=self.alpha_s * 1e3,
            beta_ms=self.beta_s * 1e3,
            max_batch=self.max_batch,
            latency_ms=self.latency_ms_list() if self.measured else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return self.to_entry().to_dict()


def _fit_linear(values_s: list[float]) -> tuple[float, float]:
    """Least-squares alpha, beta for values_s[i] = l(i + 1)."""
    n = len(values_s)
    if n == 1:
        return 0.0, values_s[0]
    xs = range(1, n + 1)
    mean_x = (n + 1) / 2
    mean_y = sum(values_s) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, values_s, strict=True))
    alpha = max(0.0, sxy / sxx)
    beta = max(0.0, mean_y - alpha * mean_x)
    return alpha, beta


# --------------------------------------------------------------------------- the file format


class ProfileEntry(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """One ``models.NAME`` entry of a profile file (see the module docstring)."""

    alpha_ms: float | None = None
    beta_ms: float | None = None
    max_batch: Annotated[int, msgspec.Meta(ge=1)] | None = None
    latency_ms: list[float] | None = None

    def __post_init__(self) -> None:
        check_finite("alpha_ms", self.alpha_ms)
        check_finite("beta_ms", self.beta_ms)
        if self.latency_ms is not None:
            if not self.latency_ms:
                raise FieldError("latency_ms", "must not be empty")
            for value in self.latency_ms:
                if not (value > 0 and math.isfinite(value)):
                    raise FieldError("latency_ms", f"entries must be finite and > 0, got {value}")
            if self.max_batch is not None and self.max_batch > len(self.latency_ms):
                raise FieldError("", f"max_batch {self.max_batch} > len(latency_ms) "
                                 f"{len(self.latency_ms)}")
        elif self.alpha_ms is None or self.beta_ms is None:
            raise FieldError("", "needs alpha_ms and beta_ms, or latency_ms")
        elif self.max_batch is None:
            raise FieldError("max_batch", "required with alpha_ms/beta_ms")

    def to_dict(self) -> dict[str, Any]:
        """The entry as the file's JSON object holds it (unset keys left out)."""
        entry: dict[str, Any] = msgspec.to_builtins(self)
        return entry

    def to_profile(self) -> LatencyProfile:
        if self.latency_ms is not None:
            return LatencyProfile.from_table_ms(self.latency_ms[: self.max_batch])
        assert self.alpha_ms is not None and self.beta_ms is not None  # __post_init__
        assert self.max_batch is not None
        return LatencyProfile.linear(self.alpha_ms, self.beta_ms, self.max_batch)


class ProfileFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A whole profile file: the profiles of one device, by model name."""

    format: str
    models: dict[str, ProfileEntry]
    device: str = ""

    def profiles(self) -> dict[str, LatencyProfile]:
        return {name: entry.to_profile() for name, entry in self.models.items()}


class _ProfileDocument(msgspec.Struct, forbid_unknown_fields=True):
    """The file's top level; entries are decoded one by one so errors name the model."""

    format: str
    models: dict[str, Any]
    device: str = ""


def parse_profile_file(document: Any) -> ProfileFile:
    """Validate a parsed profile document; SchemaError names the key (``models.m.beta_ms``)."""
    top = decode(document, _ProfileDocument)
    if top.format != PROFILE_FORMAT:
        raise SchemaError("format", f"must be {PROFILE_FORMAT!r}, got {top.format!r}")
    models = {
        name: decode(entry, ProfileEntry, path=f"models.{name}")
        for name, entry in top.models.items()
    }
    return ProfileFile(format=top.format, models=models, device=top.device)


def read_profile_file(path: str | os.PathLike[str]) -> ProfileFile:
    """Read a ``zserve-profile/1`` file; every problem is a ValueError naming the file."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        document = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
        return parse_profile_file(document)
    except (ValueError, UnicodeDecodeError) as exc:  # JSON, TOML and schema errors alike
        raise ValueError(f"{path}: {exc}") from None


def load_profiles(path: str | os.PathLike[str]) -> dict[str, LatencyProfile]:
    """The profiles of a ``zserve-profile/1`` file, by model name."""
    return read_profile_file(path).profiles()


def write_profile_entries(
    path: str | os.PathLike[str], device: str, entries: Mapping[str, ProfileEntry], *,
    merge: bool = True,
) -> ProfileFile:
    """Write (atomically) a profile file of ``entries``. With ``merge`` and an existing file of
    the same device, its other models are kept. Returns what was written."""
    path = Path(path)
    models = dict(entries)
    if merge and path.is_file():
        existing = read_profile_file(path)
        if existing.device != device:
            raise ValueError(
                f"{path} holds profiles of device {existing.device!r}, not {device!r}; "
                "write the profiles of each device to their own file"
            )
        models = {**existing.models, **models}
    written = ProfileFile(format=PROFILE_FORMAT, models=models, device=device)
    _write_atomically(path, _render(path, written))
    return written


def save_profiles(path: str | os.PathLike[str], profiles: Mapping[str, LatencyProfile],
                  device: str) -> None:
    """Write ``profiles`` as a new profile file (replacing any file there)."""
    entries = {name: profile.to_entry() for name, profile in profiles.items()}
    write_profile_entries(path, device, entries, merge=False)


def profile_file_dict(written: ProfileFile) -> dict[str, Any]:
    """The file's JSON object, keys in file order (format, device, models)."""
    models = msgspec.to_builtins(written.models)
    return {"format": written.format, "device": written.device, "models": models}


def _render(path: Path, written: ProfileFile) -> str:
    data = profile_file_dict(written)
    if path.suffix != ".toml":
        return json.dumps(data, indent=1) + "\n"
    lines = [f"format = {json.dumps(data['format'])}", f"device = {json.dumps(data['device'])}",
             ""]
    for name, entry in data["models"].items():
        lines.append(f"[models.{json.dumps(name)}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in entry.items()]
        lines.append("")
    return "\n".join(lines)


def _write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as tmp:
            tmp.write(text)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- configured profile


def configured_profile(model: ModelConfig, kind: str | None = None) -> LatencyProfile | None:
    """The profile cluster.toml gives ``model`` on a device of ``kind``, by one rule every role
    follows:

    1. its ``profiles`` file for ``kind``, when it names one for that kind;
    2. else its ``profile`` file, when it names one: the file's entry for the model (a
       measured l(b) beats a configured line);
    3. else its emulated ``alpha_ms``/``beta_ms``: the line up to the model's ``max_batch``;
    4. else None: the backends measure l(b) when they load the model.

    A file that cannot be read or has no entry for the model is a ValueError/OSError, never a
    silent fallback to another l(b). ``kind`` None (a role that plans or admits for every
    GPU: a shard before its first table, a frontend) gets the slowest of every profile the
    model is given, element-wise (``slowest_profile``): safe on any kind.
    """
    if kind is not None and model.profiles and kind in model.profiles:
        return profile_from_file(model, model.profiles[kind])
    if model.profile:
        base: LatencyProfile | None = profile_from_file(model, model.profile)
    elif model.alpha_ms is not None and model.beta_ms is not None:
        base = LatencyProfile.linear(model.alpha_ms, model.beta_ms, model.max_batch)
    else:
        base = None
    if kind is not None or not model.profiles:
        return base
    every = [profile_from_file(model, path) for path in model.profiles.values()]
    return slowest_profile(every + ([base] if base is not None else []))


def profile_from_file(model: ModelConfig, path: str) -> LatencyProfile:
    """The entry for ``model`` of the profile file at ``path`` (ValueError when it has none)."""
    profiles = load_profiles(path)
    if model.name not in profiles:
        raise ValueError(f"profile file {path} has no entry for {model.name!r} "
                         f"(it has {', '.join(sorted(profiles)) or 'none'})")
    return profiles[model.name]


def slowest_profile(profiles: list[LatencyProfile]) -> LatencyProfile:
    """The slowest of ``profiles`` (at least one) at every batch size, up to the smallest max
    batch: a profile no device of theirs runs slower than. Where one of them is that, it is
    returned as it is (a linear profile stays linear)."""
    size = min(p.max_batch for p in profiles)
    for candidate in profiles:  # one of them is the slowest already: itself, as it is
        if candidate.max_batch == size and all(
                candidate.table_s[b] >= other.table_s[b]
                for other in profiles for b in range(1, size + 1)):
            return candidate
    return LatencyProfile.from_table_ms(
        [max(p.table_s[b] for p in profiles) * 1e3 for b in range(1, size + 1)])
