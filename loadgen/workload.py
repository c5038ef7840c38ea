"""The workload file: the one module that parses and validates it (simulator and live load
generator alike).

A workload is a TOML file. Paths inside it are relative to the file. Unknown keys are errors that
name the key path (``workload.arival``, ``models[2].slo``)::

    [workload]
    name = "table2-resnet50"   # optional; defaults to the file stem
    gpus = 8                   # GPUs (simulator) / expected GPUs (live)
    seed = 1                   # model i's arrivals: child i of numpy SeedSequence(seed)
    rate = 5000.0              # total offered rate in requests/s (--rate overrides)
    arrival = "poisson"        # "constant" | "poisson" | "gamma:K" (CV = 1/sqrt(K))
    popularity = "equal"       # "equal" | "zipf:S" | [share, share, ...] (one per model)
    warmup_s = 2.0             # not counted
    measure_s = 10.0           # counted: bad rate, latency, goodput
    cooldown_s = 1.0           # load keeps flowing, not counted
    policy = "deferred"        # deferred | frontrun | latest | eager | eager-edf | eager-lsf
                               # | timeout:F; simulator only: nexus | nexus:F | shepherd-flex
    drop = "window"            # window | suffix | alone | fcfs
    d_ctrl_ms = 0.0            # plan delivery allowance before a batch can start
    d_data_ms = 0.0            # per-request input-fetch allowance
    reply_ms = 0.0             # reply allowance: deadline = arrival + SLO - reply_ms
    jitter_ms = 0.0            # timer lateness allowance: deferred/latest aim this much earlier
    sim_tick_ms = 0.0          # simulator only: the simulated frontend's tick (0: one per instant)
    zoo_csv = "../profiles/model_zoo_a100.csv"   # optional: one model per CSV row
    max_batch = 0              # optional cap on every model's batch size (0: none)
    keep_tolerance = 0.05      # window drop: keep a head that still allows a batch whose
                               # per-request cost l(b)/b is within this fraction of the target's
                               # (0: the authors' exact rule)
    request_rows = { dist = "constant", rows = 1 }   # rows per request (its inputs' leading
                               # dimension): "constant" (rows), "uniform" (min, max: integers,
                               # both included) or "choice" (values, optional weights); every
                               # value 1..each model's max_batch

    [[models]]                 # zero or more, after the zoo rows
    name = "ResNet50"
    slo_ms = 25.0
    alpha_ms = 1.053           # linear profile l(b) = alpha*b + beta ...
    beta_ms = 5.072
    max_batch = 64             # optional (default: the largest b with l(b) <= SLO)
    # profile = "../profiles/cpu.json"   # ... or a zserve-profile/1 file (JSON/TOML)
    # profile_model = "resnet50"          # the entry in that file (default: name)
    # share = 2.0                         # optional popularity weight (overrides popularity)

Every model needs ``slo_ms`` and either alpha_ms/beta_ms or ``profile``.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from zserve.config.decode import FieldError, SchemaError, check_finite, decode
from zserve.config.policy_names import (
    DEFAULT_KEEP_TOLERANCE,
    SchedulePolicy,
    sim_baseline_frontends,
)
from zserve.config.profiles import LatencyProfile, load_profiles
from zserve.loadgen.arrivals import popularity_shares
from zserve.loadgen.zoo import load_zoo_csv


class WorkloadError(ValueError):
    """The workload file is invalid; the message names the file and the key path."""


# --------------------------------------------------------------------------- the file's schema
# Types, required and unknown keys; value checks are in _validate, which overrides go through too.


_ROWS_STRUCT: dict[str, Any] = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True,
                                 "tag_field": "dist"}


class ConstantRows(msgspec.Struct, tag="constant", **_ROWS_STRUCT):
    """``request_rows = { dist = "constant", rows = N }``: every request holds N rows."""

    rows: Annotated[int, msgspec.Meta(ge=1)] = 1

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray[Any, Any]:
        return np.full(count, self.rows, dtype=np.int64)

    @property
    def largest(self) -> int:
        return self.rows

    @property
    def mean(self) -> float:
        return float(self.rows)

    def __str__(self) -> str:
        return f"constant:{self.rows}"


class UniformRows(msgspec.Struct, tag="uniform", **_ROWS_STRUCT):
    """``request_rows = { dist = "uniform", min = A, max = B }``: A..B rows, equally likely."""

    max: Annotated[int, msgspec.Meta(ge=1)]
    min: Annotated[int, msgspec.Meta(ge=1)] = 1

    def __post_init__(self) -> None:
        if self.max < self.min:
            raise FieldError("max", f"must be >= min ({self.min}), got {self.max}")

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray[Any, Any]:
        return rng.integers(self.min, self.max, size=count, endpoint=True, dtype=np.int64)

    @property
    def largest(self) -> int:
        return self.max

    @property
    def mean(self) -> float:
        return (self.min + self.max) / 2

    def __str__(self) -> str:
        return f"uniform:{self.min}-{self.max}"


class ChoiceRows(msgspec.Struct, tag="choice", **_ROWS_STRUCT):
    """``request_rows = { dist = "choice", values = [...], weights = [...] }``: one of
    ``values`` rows, with ``weights`` (relative; default equal)."""

    values: Annotated[list[Annotated[int, msgspec.Meta(ge=1)]], msgspec.Meta(min_length=1)]
    weights: list[Annotated[float, msgspec.Meta(ge=0)]] | None = None

    def __post_init__(self) -> None:
        if self.weights is not None:
            if len(self.weights) != len(self.values):
                raise FieldError("weights", f"needs one weight per value ({len(self.values)}), "
                                 f"got {len(self.weights)}")
            if not math.isfinite(sum(self.weights)) or sum(self.weights) <= 0:
                raise FieldError("weights", "must be finite and add up to more than 0")

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray[Any, Any]:
        weights = None
        if self.weights is not None:
            weights = np.asarray(self.weights, dtype=np.float64) / sum(self.weights)
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=count, p=weights)

    @property
    def largest(self) -> int:
        return max(self.values)

    @property
    def mean(self) -> float:
        weights = self.weights or [1.0] * len(self.values)
        return sum(v * w for v, w in zip(self.values, weights, strict=True)) / sum(weights)

    def __str__(self) -> str:
        return "choice:" + ",".join(map(str, self.values))


RequestRows = ConstantRows | UniformRows | ChoiceRows
"""How many rows each request of a workload holds (``[workload] request_rows``)."""
ONE_ROW = ConstantRows()


def draw_request_rows(spec: RequestRows, seed: int, count: int) -> np.ndarray[Any, Any] | None:
    """Each of ``count`` requests' rows, from a stream of its own (``seed``: the arrivals'
    draws are unchanged); None when every request holds one row."""
    if isinstance(spec, ConstantRows) and spec.rows == 1:
        return None
    return spec.draw(np.random.default_rng([seed, ROWS_STREAM]), count)


ROWS_STREAM = 0x524F5753  # "ROWS": the request-rows draws' own random stream


class WorkloadTable(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[workload]`` (see the module docstring)."""

    name: str | None = None  # None: the file's stem
    gpus: int = 1
    seed: int = 1
    rate: float = 100.0
    arrival: str = "poisson"
    popularity: str | list[float] = "equal"
    warmup_s: float = 2.0
    measure_s: float = 10.0
    cooldown_s: float = 1.0
    policy: str = "deferred"
    drop: str = "window"
    d_ctrl_ms: float = 0.0
    d_data_ms: float = 0.0
    reply_ms: float = 0.0
    jitter_ms: float = 0.0
    sim_tick_ms: float = 0.0
    zoo_csv: str | list[str] | None = None
    max_batch: int = 0  # cap on every model's batch size (0: none)
    keep_tolerance: float = DEFAULT_KEEP_TOLERANCE
    request_rows: RequestRows = ONE_ROW

    def zoo_paths(self) -> list[str]:
        if self.zoo_csv is None:
            return []
        return [self.zoo_csv] if isinstance(self.zoo_csv, str) else list(self.zoo_csv)


class WorkloadModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[models]]``: an SLO and either a linear profile or an entry of a profile file."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    slo_ms: float
    alpha_ms: float | None = None
    beta_ms: float | None = None
    max_batch: int | None = None
    profile: str | None = None
    profile_model: str | None = None  # the entry in the profile file (default: name)
    share: float | None = None  # explicit popularity weight
    d_data_ms: float | None = None  # this model's allowance per row (None: workload.d_data_ms)

    def __post_init__(self) -> None:
        check_finite("d_data_ms", self.d_data_ms)
        linear = self.alpha_ms is not None or self.beta_ms is not None
        if self.profile is not None and linear:
            raise FieldError("", "give either profile or alpha_ms/beta_ms, not both")
        if self.profile is None:
            for key in ("alpha_ms", "beta_ms"):
                if getattr(self, key) is None:
                    raise FieldError(key, "required (or give profile)")


class WorkloadFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole document."""

    workload: WorkloadTable = WorkloadTable()
    models: list[WorkloadModel] = []


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    """``kind`` is constant | poisson | gamma; ``shape`` is Gamma's k (1 for poisson)."""

    kind: str
    shape: float = 1.0

    @classmethod
    def parse(cls, text: str) -> ArrivalSpec:
        base, _, arg = text.strip().partition(":")
        if base == "constant" and not arg:
            return cls("constant", math.inf)
        if base == "poisson" and not arg:
            return cls("poisson", 1.0)
        if base == "gamma":
            try:
                shape = float(arg)
            except ValueError:
                raise ValueError(f"gamma needs a shape: gamma:0.5, got {text!r}") from None
            if not shape > 0:
                raise ValueError(f"gamma shape must be > 0, got {shape}")
            return cls("gamma", shape)
        raise ValueError(f"arrival must be constant | poisson | gamma:K, got {text!r}")

    def __str__(self) -> str:
        return self.kind if self.kind != "gamma" else f"gamma:{self.shape:g}"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    slo_ms: float
    profile: LatencyProfile
    share: float | None = None  # explicit popularity weight
    d_data_ms: float | None = None  # its own allowance per row (None: the workload's)

    @property
    def slo_s(self) -> float:
        return self.slo_ms / 1e3


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    gpus: int
    seed: int
    rate: float
    arrival: ArrivalSpec
    popularity: str | list[float]
    warmup_s: float
    measure_s: float
    cooldown_s: float
    policy: str
    drop: str
    d_ctrl_ms: float
    d_data_ms: float
    reply_ms: float
    sim_tick_ms: float
    models: list[ModelSpec]
    keep_tolerance: float = DEFAULT_KEEP_TOLERANCE
    jitter_ms: float = 0.0
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    request_rows: RequestRows = ONE_ROW

    @property
    def duration_s(self) -> float:
        return self.warmup_s + self.measure_s + self.cooldown_s

    def d_data_ms_of(self, model: ModelSpec) -> float:
        """``model``'s data allowance per row: its own, else the workload's."""
        return self.d_data_ms if model.d_data_ms is None else model.d_data_ms

    def with_overrides(self, **changes: Any) -> Workload:
        """A copy with fields replaced (e.g. ``rate=...``, ``policy=...``), validated again."""
        out = replace(self, **changes)
        _validate(out, out.source or "<workload>")
        return out

    def shares(self) -> list[float]:
        """Each model's fraction of the total rate (sums to 1)."""
        shares: list[float] = popularity_shares(self.popularity, self.models)
        return shares

    def model_rates(self) -> list[float]:
        return [self.rate * share for share in self.shares()]


def load_workload(path: str | Path) -> Workload:
    """Parse and validate a workload TOML file (see the module docstring)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: invalid TOML: {exc}") from None
    return parse_workload(data, base_dir=path.parent, source=str(path), default_name=path.stem)


def parse_workload(
    data: dict[str, Any], base_dir: Path | str = ".", source: str = "<workload>",
    default_name: str = "workload",
) -> Workload:
    """Validate a parsed workload document; paths in it resolve against ``base_dir``."""
    base_dir = Path(base_dir)
    try:
        document = decode(data, WorkloadFile)
    except SchemaError as exc:
        raise WorkloadError(f"{source}: {exc}") from None
    table = document.workload
    try:
        arrival = ArrivalSpec.parse(table.arrival)
    except ValueError as exc:
        raise WorkloadError(f"{source}: workload.arrival: {exc}") from None
    models = _zoo_models(table, base_dir, source)
    models += _listed_models(document.models, table.max_batch, base_dir, source)
    workload = Workload(
        name=table.name if table.name is not None else default_name,
        gpus=table.gpus,
        seed=table.seed,
        rate=table.rate,
        arrival=arrival,
        popularity=table.popularity,
        warmup_s=table.warmup_s,
        measure_s=table.measure_s,
        cooldown_s=table.cooldown_s,
        policy=table.policy,
        drop=table.drop,
        d_ctrl_ms=table.d_ctrl_ms,
        d_data_ms=table.d_data_ms,
        reply_ms=table.reply_ms,
        sim_tick_ms=table.sim_tick_ms,
        models=models,
        keep_tolerance=table.keep_tolerance,
        jitter_ms=table.jitter_ms,
        source=source,
        request_rows=table.request_rows,
    )
    _validate(workload, source)
    return workload


def _zoo_models(table: WorkloadTable, base_dir: Path, source: str) -> list[ModelSpec]:
    """One linear-profile model per row of each ``zoo_csv`` file."""
    models: list[ModelSpec] = []
    for zoo_path in table.zoo_paths():
        try:
            rows = load_zoo_csv(base_dir / zoo_path)
        except (OSError, ValueError, KeyError) as exc:
            raise WorkloadError(f"{source}: workload.zoo_csv: {exc}") from None
        for row in rows:
            profile = LatencyProfile.linear_for_slo(row.alpha_ms, row.beta_ms, row.slo_ms,
                                                    table.max_batch or None)
            models.append(ModelSpec(row.name, row.slo_ms, profile))
    return models


def _listed_models(
    entries: list[WorkloadModel], cap: int, base_dir: Path, source: str
) -> list[ModelSpec]:
    """The ``[[models]]`` tables; each profile file is read once."""
    profile_files: dict[Path, dict[str, LatencyProfile]] = {}
    models: list[ModelSpec] = []
    for index, entry in enumerate(entries):
        where = f"{source}: models[{index}]"
        max_batch = entry.max_batch if entry.max_batch is not None else (cap or None)
        if entry.profile is not None:
            profile = _file_profile(entry, max_batch, base_dir / entry.profile, profile_files,
                                    where)
        else:
            assert entry.alpha_ms is not None and entry.beta_ms is not None  # __post_init__
            try:
                profile = LatencyProfile.linear_for_slo(entry.alpha_ms, entry.beta_ms,
                                                        entry.slo_ms, max_batch)
            except ValueError as exc:
                raise WorkloadError(f"{where}: {exc}") from None
        models.append(ModelSpec(entry.name, entry.slo_ms, profile, entry.share, entry.d_data_ms))
    return models


def _file_profile(
    entry: WorkloadModel, max_batch: int | None, path: Path,
    profile_files: dict[Path, dict[str, LatencyProfile]], where: str,
) -> LatencyProfile:
    """The model's entry of a profile file, cut at ``max_batch``."""
    path = path.resolve()
    if path not in profile_files:
        try:
            profile_files[path] = load_profiles(path)
        except (OSError, ValueError) as exc:
            raise WorkloadError(f"{where}.profile: {exc}") from None
    key = entry.profile_model or entry.name
    if key not in profile_files[path]:
        raise WorkloadError(f"{where}.profile: {path} has no model {key!r}")
    profile = profile_files[path][key]
    if max_batch is not None and max_batch < profile.max_batch:
        profile = LatencyProfile.from_table_ms(profile.latency_ms_list()[:max_batch])
    return profile


def _validate_policy(w: Workload, source: str) -> None:
    """The policy and drop names: the scheduler's, or a simulator baseline's (``nexus`` ...)."""
    try:
        if sim_baseline_frontends(w.policy) is None:
            SchedulePolicy.parse(w.policy, w.drop)
    except ValueError as exc:
        raise WorkloadError(f"{source}: workload.policy/drop: {exc}") from None


def _validate(w: Workload, source: str) -> None:
    if w.gpus < 1:
        raise WorkloadError(f"{source}: workload.gpus must be >= 1")
    if not w.rate > 0:
        raise WorkloadError(f"{source}: workload.rate must be > 0")
    # (seed: numpy's SeedSequence takes non-negative entropy only)
    for key in ("seed", "warmup_s", "cooldown_s", "d_ctrl_ms", "d_data_ms", "reply_ms",
                "sim_tick_ms", "keep_tolerance", "jitter_ms"):
        if getattr(w, key) < 0:
            raise WorkloadError(f"{source}: workload.{key} must be >= 0")
    if not w.measure_s > 0:
        raise WorkloadError(f"{source}: workload.measure_s must be > 0")
    if not w.models:
        raise WorkloadError(f"{source}: no models (add [[models]] or workload.zoo_csv)")
    names = [m.name for m in w.models]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise WorkloadError(f"{source}: duplicate model name(s) {sorted(dup)}")
    for m in w.models:
        if not m.slo_ms > w.reply_ms:
            raise WorkloadError(f"{source}: model {m.name}: slo_ms must exceed reply_ms")
        if w.request_rows.largest > m.profile.max_batch:
            raise WorkloadError(
                f"{source}: workload.request_rows: a request of {w.request_rows.largest} rows "
                f"exceeds model {m.name}'s max_batch of {m.profile.max_batch}")
    _validate_policy(w, source)
    try:
        w.shares()
    except ValueError as exc:
        raise WorkloadError(f"{source}: workload.popularity: {exc}") from None
