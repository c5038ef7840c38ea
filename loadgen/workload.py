"""The workload file: the one module that parses and validates it (simulator and live load
generator alike).

A workload is a TOML file. Paths inside it are relative to the file. Unknown keys are errors that
name the key path (``workload.arival``, ``models[2].slo``)::

    [workload]
    name = "table2-resnet50"   # optional; defaults to the file stem
    gpus = 8                   # GPUs (simulator) / expected GPUs (live)
    seed = 1                   # per-model arrival seeds are seed + 31 * model_index
    rate = 5000.0              # total offered rate in requests/s (--rate overrides)
    arrival = "poisson"        # "constant" | "poisson" | "gamma:K" (CV = 1/sqrt(K))
    popularity = "equal"       # "equal" | "zipf:S" | [share, share, ...] (one per model)
    warmup_s = 2.0             # not counted
    measure_s = 10.0           # counted: bad rate, latency, goodput
    cooldown_s = 1.0           # load keeps flowing, not counted
    policy = "deferred"        # deferred | deferred-bl | latest | eager | timeout:F
    drop = "window"            # window | alone | fcfs
    d_ctrl_ms = 0.0            # plan delivery allowance before a batch can start
    d_data_ms = 0.0            # per-request input-fetch allowance
    reply_ms = 0.0             # reply allowance: deadline = arrival + SLO - reply_ms
    jitter_ms = 0.0            # timer lateness allowance: deferred/latest aim this much earlier
    sim_tick_ms = 0.0          # simulator only: coalesce each model's arrivals per tick
    zoo_csv = "../profiles/model_zoo_a100.csv"   # optional: one model per CSV row
    max_batch = 0              # optional cap on every model's batch size (0: none)
    keep_tolerance = 0.05      # window drop: keep a head that still allows a batch whose
                               # per-request cost l(b)/b is within this fraction of the target's
                               # (0: the authors' exact rule)

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
from typing import Any

from zserve.scheduler.policy import DEFAULT_KEEP_TOLERANCE, SchedulePolicy
from zserve.scheduler.profiles import LatencyProfile, load_profiles, load_zoo_csv


class WorkloadError(ValueError):
    """The workload file is invalid; the message names the file and the key path."""


WORKLOAD_KEYS = {
    "name", "gpus", "seed", "rate", "arrival", "popularity", "warmup_s", "measure_s",
    "cooldown_s", "policy", "drop", "d_ctrl_ms", "d_data_ms", "reply_ms", "sim_tick_ms",
    "zoo_csv", "max_batch", "keep_tolerance", "jitter_ms",
}
MODEL_KEYS = {
    "name", "slo_ms", "alpha_ms", "beta_ms", "max_batch", "profile", "profile_model", "share",
}


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

    @property
    def duration_s(self) -> float:
        return self.warmup_s + self.measure_s + self.cooldown_s

    def with_overrides(self, **changes: Any) -> Workload:
        """A copy with fields replaced (e.g. ``rate=...``, ``policy=...``), validated again."""
        out = replace(self, **changes)
        _validate(out, out.source or "<workload>")
        return out

    def shares(self) -> list[float]:
        """Each model's fraction of the total rate (sums to 1)."""
        from zserve.loadgen.arrivals import popularity_shares

        return popularity_shares(self.popularity, self.models)

    def model_rates(self) -> list[float]:
        return [self.rate * share for share in self.shares()]


def _number(value: Any, where: str, *, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WorkloadError(f"{where}: expected a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise WorkloadError(f"{where}: expected an integer, got {value!r}")
    return value


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
    base_dir = Path(base_dir)
    unknown_top = set(data) - {"workload", "models"}
    if unknown_top:
        raise WorkloadError(f"{source}: unknown top-level key(s) {sorted(unknown_top)}")
    section = data.get("workload", {})
    if not isinstance(section, dict):
        raise WorkloadError(f"{source}: [workload] must be a table")
    for key in section:
        if key not in WORKLOAD_KEYS:
            raise WorkloadError(
                f"{source}: unknown key workload.{key}; allowed: {sorted(WORKLOAD_KEYS)}"
            )

    def get(key: str, default: Any, *, integer: bool = False) -> float:
        value = section.get(key, default)
        return _number(value, f"{source}: workload.{key}", integer=integer)

    gpus = int(get("gpus", 1, integer=True))
    seed = int(get("seed", 1, integer=True))
    rate = float(get("rate", 100.0))
    try:
        arrival = ArrivalSpec.parse(str(section.get("arrival", "poisson")))
    except ValueError as exc:
        raise WorkloadError(f"{source}: workload.arrival: {exc}") from None
    popularity_raw = section.get("popularity", "equal")
    popularity: str | list[float]
    if isinstance(popularity_raw, list):
        popularity = [
            float(_number(v, f"{source}: workload.popularity[{i}]"))
            for i, v in enumerate(popularity_raw)
        ]
    elif isinstance(popularity_raw, str):
        popularity = popularity_raw
    else:
        raise WorkloadError(f"{source}: workload.popularity: expected a string or a list")
    policy = str(section.get("policy", "deferred"))
    drop = str(section.get("drop", "window"))
    cap = int(get("max_batch", 0, integer=True))

    models: list[ModelSpec] = []
    zoo = section.get("zoo_csv")
    zoo_paths = [] if zoo is None else (zoo if isinstance(zoo, list) else [zoo])
    for zi, zoo_path in enumerate(zoo_paths):
        if not isinstance(zoo_path, str):
            raise WorkloadError(f"{source}: workload.zoo_csv[{zi}]: expected a path string")
        try:
            rows = load_zoo_csv(base_dir / zoo_path)
        except (OSError, ValueError, KeyError) as exc:
            raise WorkloadError(f"{source}: workload.zoo_csv: {exc}") from None
        for row in rows:
            profile = LatencyProfile.linear_for_slo(row.alpha_ms, row.beta_ms, row.slo_ms,
                                                    cap or None)
            models.append(ModelSpec(row.name, row.slo_ms, profile))

    raw_models = data.get("models", [])
    if not isinstance(raw_models, list):
        raise WorkloadError(f"{source}: models must be an array of tables ([[models]])")
    profile_cache: dict[Path, dict[str, LatencyProfile]] = {}
    for index, entry in enumerate(raw_models):
        where = f"{source}: models[{index}]"
        if not isinstance(entry, dict):
            raise WorkloadError(f"{where}: expected a table")
        for key in entry:
            if key not in MODEL_KEYS:
                raise WorkloadError(f"{where}.{key}: unknown key; allowed: {sorted(MODEL_KEYS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise WorkloadError(f"{where}.name: required (a non-empty string)")
        if "slo_ms" not in entry:
            raise WorkloadError(f"{where}.slo_ms: required")
        slo_ms = float(_number(entry["slo_ms"], f"{where}.slo_ms"))
        max_batch = entry.get("max_batch")
        if max_batch is not None:
            max_batch = int(_number(max_batch, f"{where}.max_batch", integer=True))
        elif cap:
            max_batch = cap
        if "profile" in entry:
            if "alpha_ms" in entry or "beta_ms" in entry:
                raise WorkloadError(f"{where}: give either profile or alpha_ms/beta_ms, not both")
            profile_path = (base_dir / str(entry["profile"])).resolve()
            if profile_path not in profile_cache:
                try:
                    profile_cache[profile_path] = load_profiles(profile_path)
                except (OSError, ValueError) as exc:
                    raise WorkloadError(f"{where}.profile: {exc}") from None
            key = str(entry.get("profile_model", name))
            if key not in profile_cache[profile_path]:
                raise WorkloadError(f"{where}.profile: {profile_path} has no model {key!r}")
            profile = profile_cache[profile_path][key]
            if max_batch is not None and max_batch < profile.max_batch:
                profile = LatencyProfile.from_table_ms(profile.latency_ms_list()[:max_batch])
        else:
            for key in ("alpha_ms", "beta_ms"):
                if key not in entry:
                    raise WorkloadError(f"{where}.{key}: required (or give profile)")
            alpha = float(_number(entry["alpha_ms"], f"{where}.alpha_ms"))
            beta = float(_number(entry["beta_ms"], f"{where}.beta_ms"))
            try:
                profile = LatencyProfile.linear_for_slo(alpha, beta, slo_ms, max_batch)
            except ValueError as exc:
                raise WorkloadError(f"{where}: {exc}") from None
        share = entry.get("share")
        models.append(
            ModelSpec(name, slo_ms, profile,
                      None if share is None else float(_number(share, f"{where}.share")))
        )

    workload = Workload(
        name=str(section.get("name", default_name)),
        gpus=gpus,
        seed=seed,
        rate=rate,
        arrival=arrival,
        popularity=popularity,
        warmup_s=float(get("warmup_s", 2.0)),
        measure_s=float(get("measure_s", 10.0)),
        cooldown_s=float(get("cooldown_s", 1.0)),
        policy=policy,
        drop=drop,
        d_ctrl_ms=float(get("d_ctrl_ms", 0.0)),
        d_data_ms=float(get("d_data_ms", 0.0)),
        reply_ms=float(get("reply_ms", 0.0)),
        sim_tick_ms=float(get("sim_tick_ms", 0.0)),
        models=models,
        keep_tolerance=float(get("keep_tolerance", DEFAULT_KEEP_TOLERANCE)),
        jitter_ms=float(get("jitter_ms", 0.0)),
        source=source,
    )
    _validate(workload, source)
    return workload


def _validate(w: Workload, source: str) -> None:
    if w.gpus < 1:
        raise WorkloadError(f"{source}: workload.gpus must be >= 1")
    if not w.rate > 0:
        raise WorkloadError(f"{source}: workload.rate must be > 0")
    for key in ("warmup_s", "cooldown_s", "d_ctrl_ms", "d_data_ms", "reply_ms", "sim_tick_ms",
                "keep_tolerance", "jitter_ms"):
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
    try:
        SchedulePolicy.parse(w.policy, w.drop)
    except ValueError as exc:
        raise WorkloadError(f"{source}: workload.policy/drop: {exc}") from None
    try:
        w.shares()
    except ValueError as exc:
        raise WorkloadError(f"{source}: workload.popularity: {exc}") from None
