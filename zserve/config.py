"""``cluster.toml``: the schema, its strict validation, and what each process is started with.

The file format is documented in ``docs/cluster-toml.md``. Parsing is strict: an unknown key, a
missing required key, a wrong type or a bad value raises ``ConfigError`` naming the key's path
(``models[1].slo_ms: must be > 0``).

What a process gets: every role's entry point is ``run_<role>(config, control_address)`` where
``config`` is the *role config*, a plain dict (picklable for the spawn start method) built by
``role_config``::

    {
      "role": "backend",            # rank | shard | backend | frontend
      "name": "backend-1",          # also its DEALER identity everywhere
      "index": 1,                   # index within its role
      "bind": {"plan": "ipc:///tmp/zs-x/backend-1.plan"},  # socket name -> address to bind
      "peers": {...},               # peer map ("<name>/<socket>" -> address) for a role started
                                    # alone; {} under a supervisor (the Ready handshake gives it)
      "cluster": {...},             # ClusterConfig.to_dict(); ClusterConfig.from_dict() reads it
      # role-specific conveniences:
      "device": "emulated",         # backend: cpu | cuda:N | emulated
      "models": [...],              # every role: ModelConfig.to_dict() of the models it needs
                                    # (a shard: the models it owns; others: all of them)
      "shards": 2,                  # number of scheduler shard processes (0 = embedded rank)
      "embedded_rank": False,       # shard: True when shards == 0 (binds "rank" and "shard")
      "advertise_host": None,       # the host name peers are given for a socket bound to a
                                    # wildcard address (tcp://0.0.0.0:PORT); None: the host name
    }

Socket names in ``bind`` and in the peer map: rank ``rank``; shard ``shard`` (and ``rank`` when
embedded); backend ``plan``; frontend ``client`` and ``data``. With ``shards = 0`` the one
scheduler process is named ``shard-0`` and serves both ``shard-0/shard`` and ``shard-0/rank``.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zserve.scheduler.policy import SchedulePolicy

DEFAULT_HOST = "127.0.0.1"
DEFAULT_SLO_MS = 100.0
DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_QUEUE = 1024
# Scheduling allowances (docs/design-notes.md, "The shipped defaults").
DEFAULT_D_CTRL_MS = 2.0
DEFAULT_D_DATA_MS = 0.05
DEFAULT_REPLY_ALLOWANCE_MS = 3.0
DEFAULT_JITTER_MS = 1.0
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
DEFAULT_DRAIN_S = 5.0
DEFAULT_START_TIMEOUT_S = 120.0

TRANSPORTS = ("ipc", "tcp")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_ADDRESS_RE = re.compile(r"^(tcp://[^\s]+:\d+|ipc://[^\s]+|inproc://[^\s]+)$")
_DEVICE_RE = re.compile(r"^(cpu|emulated|cuda|cuda:\d+)$")
_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")


class ConfigError(ValueError):
    """A cluster.toml problem; the message starts with the offending key's path."""


def shard_for_model(model: str, shards: int) -> int:
    """The scheduler shard that owns ``model``: a stable rule (crc32 of the UTF-8 name) so every
    frontend, and every run, agrees. ``shards = 0`` (embedded rank) means the one shard 0."""
    if shards <= 1:
        return 0
    return zlib.crc32(model.encode("utf-8")) % shards


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class ModelConfig:
    name: str
    kind: str  # "onnx" | "builtin" | "emulated"
    onnx: str | None = None
    builtin: str | None = None
    alpha_ms: float | None = None
    beta_ms: float | None = None
    profile: str | None = None
    slo_ms: float = DEFAULT_SLO_MS
    max_batch: int = DEFAULT_MAX_BATCH
    max_queue: int = DEFAULT_MAX_QUEUE
    max_wait_ms: float | None = None  # admission bound on the predicted wait; None = slo_ms
    # Emulated models only (zserve.backends.emulated.EmulatedModel): per-sample tensor shapes.
    input_shape: tuple[int, ...] = (4,)
    input_dtype: str = "float32"
    output_shape: tuple[int, ...] = (1,)

    @property
    def wait_bound_ms(self) -> float:
        return self.slo_ms if self.max_wait_ms is None else self.max_wait_ms

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input_shape"] = list(self.input_shape)
        out["output_shape"] = list(self.output_shape)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["input_shape"] = tuple(data.get("input_shape", (4,)))
        data["output_shape"] = tuple(data.get("output_shape", (1,)))
        return cls(**data)


@dataclass(frozen=True)
class SchedulerConfig:
    shards: int = 0
    policy: str = "deferred"  # zserve.scheduler.policy.SchedulePolicy.parse names
    drop: str = "window"
    d_ctrl_ms: float = DEFAULT_D_CTRL_MS
    d_data_ms: float = DEFAULT_D_DATA_MS
    jitter_ms: float = DEFAULT_JITTER_MS
    rank_address: str | None = None
    shard_addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrontendsConfig:
    count: int = 1
    addresses: tuple[str, ...] = ()  # client ROUTER bind addresses, one per frontend
    data_addresses: tuple[str, ...] = ()  # data ROUTER bind addresses, one per frontend
    reply_allowance_ms: float = DEFAULT_REPLY_ALLOWANCE_MS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


@dataclass(frozen=True)
class BackendsConfig:
    count: int = 1
    device: str = "cpu"
    devices: tuple[str, ...] = ()  # per-backend devices; overrides count and device
    host: str = DEFAULT_HOST
    plan_addresses: tuple[str, ...] = ()

    def device_of(self, index: int) -> str:
        if self.devices:
            return self.devices[index]
        if self.device == "cuda":
            return f"cuda:{index}"
        return self.device

    @property
    def total(self) -> int:
        return len(self.devices) if self.devices else self.count


@dataclass(frozen=True)
class ClusterConfig:
    name: str = "zserve"
    transport: str = "ipc"
    host: str = DEFAULT_HOST
    ipc_dir: str | None = None
    drain_s: float = DEFAULT_DRAIN_S
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    # Keep the CPUs awake while the cluster runs (zserve.idle_poll): off by default, since it
    # shows every CPU busy; the benchmark clusters turn it on.
    idle_poll: bool = False
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    frontends: FrontendsConfig = field(default_factory=FrontendsConfig)
    backends: BackendsConfig = field(default_factory=BackendsConfig)
    models: tuple[ModelConfig, ...] = ()

    # ------------------------------------------------------------------ conversions

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["models"] = [m.to_dict() for m in self.models]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        data = dict(data)
        sched = dict(data.pop("scheduler"))
        sched["shard_addresses"] = tuple(sched.get("shard_addresses", ()))
        fronts = dict(data.pop("frontends"))
        fronts["addresses"] = tuple(fronts.get("addresses", ()))
        fronts["data_addresses"] = tuple(fronts.get("data_addresses", ()))
        backs = dict(data.pop("backends"))
        backs["devices"] = tuple(backs.get("devices", ()))
        backs["plan_addresses"] = tuple(backs.get("plan_addresses", ()))
        models = tuple(ModelConfig.from_dict(m) for m in data.pop("models"))
        return cls(
            scheduler=SchedulerConfig(**sched),
            frontends=FrontendsConfig(**fronts),
            backends=BackendsConfig(**backs),
            models=models,
            **data,
        )

    # ------------------------------------------------------------------ layout

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def scheduler_processes(self) -> int:
        """Shard processes to start: ``shards``, or 1 (the embedded rank) when it is 0."""
        return max(1, self.scheduler.shards)

    def process_names(self) -> list[tuple[str, str, int]]:
        """``(role, name, index)`` of every process, in start-up dependency order."""
        names: list[tuple[str, str, int]] = []
        if self.scheduler.shards > 0:
            names.append(("rank", "rank", 0))
        names += [("shard", f"shard-{i}", i) for i in range(self.scheduler_processes)]
        names += [("backend", f"backend-{i}", i) for i in range(self.backends.total)]
        names += [("frontend", f"frontend-{i}", i) for i in range(self.frontends.count)]
        return names

    def bind_addresses(self, role: str, index: int, ipc_dir: str | None) -> dict[str, str]:
        """Socket name -> bind address of one process: what cluster.toml names, else
        ``ipc://<ipc_dir>/<name>.<socket>`` (transport ipc) or ``tcp://<host>:0``."""
        name = process_name(role, index)
        sockets: dict[str, str | None]
        if role == "rank":
            sockets = {"rank": self.scheduler.rank_address}
        elif role == "shard":
            explicit = self.scheduler.shard_addresses
            sockets = {"shard": explicit[index] if index < len(explicit) else None}
            if self.scheduler.shards == 0:
                sockets["rank"] = self.scheduler.rank_address
        elif role == "backend":
            plans = self.backends.plan_addresses
            sockets = {"plan": plans[index] if index < len(plans) else None}
        elif role == "frontend":
            clients, datas = self.frontends.addresses, self.frontends.data_addresses
            sockets = {
                "client": clients[index] if index < len(clients) else None,
                "data": datas[index] if index < len(datas) else None,
            }
        else:
            raise ValueError(f"unknown role {role!r}")
        host = self.backends.host if role == "backend" else self.host
        out: dict[str, str] = {}
        for sock, explicit_address in sockets.items():
            if explicit_address:
                out[sock] = explicit_address
            elif self.transport == "ipc" and ipc_dir:
                out[sock] = f"ipc://{ipc_dir}/{name}.{sock}"
            else:
                out[sock] = f"tcp://{host}:0"
        return out

    def static_peers(self, ipc_dir: str | None) -> dict[str, str]:
        """The peer map computable without running anything: every address that is explicit in
        cluster.toml or deterministic (ipc with a known ``ipc_dir``); tcp port-0 binds left out.
        A role started alone uses it, overridden by its command line."""
        peers: dict[str, str] = {}
        for role, name, index in self.process_names():
            for sock, address in self.bind_addresses(role, index, ipc_dir).items():
                if not address.endswith(":0"):
                    peers[f"{name}/{sock}"] = address
        return peers


def process_name(role: str, index: int) -> str:
    return "rank" if role == "rank" else f"{role}-{index}"


def role_config(
    cluster: ClusterConfig,
    role: str,
    index: int,
    *,
    ipc_dir: str | None,
    bind: dict[str, str] | None = None,
    peers: dict[str, str] | None = None,
    advertise_host: str | None = None,
) -> dict[str, Any]:
    """The dict a process is started with (see the module docstring)."""
    shards = cluster.scheduler.shards
    models = list(cluster.models)
    if role == "shard":
        models = [m for m in models if shard_for_model(m.name, shards) == index]
    config: dict[str, Any] = {
        "role": role,
        "name": process_name(role, index),
        "index": index,
        "bind": dict(bind) if bind is not None else cluster.bind_addresses(role, index, ipc_dir),
        "peers": dict(peers or {}),
        "cluster": cluster.to_dict(),
        "models": [m.to_dict() for m in models],
        "shards": shards,
        "embedded_rank": role == "shard" and shards == 0,
        "advertise_host": advertise_host,
    }
    if role == "backend":
        config["device"] = cluster.backends.device_of(index)
    return config


# --------------------------------------------------------------------------- parsing


class _Table:
    """A TOML table being validated: every read key is consumed; leftovers are errors."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path or '<root>'}: must be a table")
        self.data = dict(data)
        self.path = path

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def take(self, key: str, default: Any = None) -> Any:
        return self.data.pop(key, default)

    def finish(self) -> None:
        if self.data:
            unknown = sorted(self.data)[0]
            raise ConfigError(f"{self.key_path(unknown)}: unknown key")

    def int_(self, key: str, default: int, *, minimum: int = 0) -> int:
        value = self.take(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.key_path(key)}: must be an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{self.key_path(key)}: must be >= {minimum}, got {value}")
        return value

    def bool_(self, key: str, default: bool) -> bool:
        value = self.take(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key_path(key)}: must be true or false, got {value!r}")
        return value

    def float_(
        self, key: str, default: float | None, *, positive: bool = False
    ) -> float | None:
        value = self.take(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.key_path(key)}: must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise ConfigError(f"{self.key_path(key)}: must be a finite number {bound}, got {value}")
        return value

    def req_float(self, key: str, *, positive: bool = False) -> float:
        if key not in self.data:
            raise ConfigError(f"{self.key_path(key)}: required")
        value = self.float_(key, None, positive=positive)
        assert value is not None
        return value

    def str_(self, key: str, default: str | None, choices: tuple[str, ...] = ()) -> str | None:
        value = self.take(key, default)
        if value is None:
            return None
        if not isinstance(value, str):
            raise ConfigError(f"{self.key_path(key)}: must be a string, got {value!r}")
        if choices and value not in choices:
            raise ConfigError(
                f"{self.key_path(key)}: must be one of {', '.join(choices)}, got {value!r}"
            )
        return value

    def address(self, key: str) -> str | None:
        value = self.str_(key, None)
        if value is not None:
            _check_address(value, self.key_path(key))
        return value

    def addresses(self, key: str) -> tuple[str, ...]:
        value = self.take(key, [])
        if not isinstance(value, list):
            raise ConfigError(f"{self.key_path(key)}: must be a list of addresses")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{self.key_path(key)}[{i}]: must be a string")
            _check_address(item, f"{self.key_path(key)}[{i}]")
        return tuple(value)


def _check_address(value: str, path: str) -> None:
    if not _ADDRESS_RE.match(value):
        raise ConfigError(
            f"{path}: not a ZeroMQ address (tcp://host:port, ipc://path), got {value!r}"
        )


def _shape(table: _Table, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
    value = table.take(key, list(default))
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value
    ):
        raise ConfigError(f"{table.key_path(key)}: must be a list of positive integers")
    return tuple(value)


def _parse_model(data: Any, path: str, base: Path) -> ModelConfig:
    t = _Table(data, path)
    name = t.str_("name", None)
    if name is None:
        raise ConfigError(f"{t.key_path('name')}: required")
    if not _NAME_RE.match(name):
        raise ConfigError(f"{t.key_path('name')}: must match {_NAME_RE.pattern}, got {name!r}")
    onnx = t.str_("onnx", None)
    builtin = t.str_("builtin", None)
    emulated_raw = t.take("emulated", None)
    sources = [k for k, v in (("onnx", onnx), ("builtin", builtin), ("emulated", emulated_raw))
               if v is not None]
    if len(sources) != 1:
        raise ConfigError(f"{path}: exactly one of onnx, builtin, emulated is required")
    kind = sources[0]
    alpha_ms = beta_ms = None
    input_shape: tuple[int, ...] = (4,)
    output_shape: tuple[int, ...] = (1,)
    input_dtype = "float32"
    if emulated_raw is not None:
        em = _Table(emulated_raw, t.key_path("emulated"))
        alpha_ms = em.req_float("alpha_ms")
        beta_ms = em.req_float("beta_ms")
        input_shape = _shape(em, "input_shape", input_shape)
        input_dtype = em.str_("input_dtype", input_dtype, _DTYPES) or input_dtype
        output_shape = _shape(em, "output_shape", output_shape)
        em.finish()
        if alpha_ms + beta_ms <= 0:
            raise ConfigError(f"{em.key_path('alpha_ms')}: alpha_ms + beta_ms must be > 0")
    if onnx is not None:
        onnx = str((base / onnx).resolve()) if not os.path.isabs(onnx) else onnx
    profile = t.str_("profile", None)
    if profile is not None and not os.path.isabs(profile):
        profile = str((base / profile).resolve())
    slo_ms = t.float_("slo_ms", DEFAULT_SLO_MS, positive=True)
    max_batch = t.int_("max_batch", DEFAULT_MAX_BATCH, minimum=1)
    max_queue = t.int_("max_queue", DEFAULT_MAX_QUEUE, minimum=1)
    max_wait_ms = t.float_("max_wait_ms", None, positive=True)
    t.finish()
    assert slo_ms is not None
    return ModelConfig(
        name=name,
        kind=kind,
        onnx=onnx,
        builtin=builtin,
        alpha_ms=alpha_ms,
        beta_ms=beta_ms,
        profile=profile,
        slo_ms=slo_ms,
        max_batch=max_batch,
        max_queue=max_queue,
        max_wait_ms=max_wait_ms,
        input_shape=input_shape,
        input_dtype=input_dtype,
        output_shape=output_shape,
    )


def parse_config(data: dict[str, Any], *, base_dir: str | Path = ".") -> ClusterConfig:
    """Validate a parsed TOML document (or an equivalent dict) into a ClusterConfig."""
    base = Path(base_dir)
    root = _Table(data, "")
    cluster = _Table(root.take("cluster", {}), "cluster")
    name = cluster.str_("name", "zserve")
    assert name is not None
    if not _NAME_RE.match(name):
        raise ConfigError(f"cluster.name: must match {_NAME_RE.pattern}, got {name!r}")
    transport = cluster.str_("transport", "ipc", TRANSPORTS)
    host = cluster.str_("host", DEFAULT_HOST)
    ipc_dir = cluster.str_("ipc_dir", None)
    drain_s = cluster.float_("drain_s", DEFAULT_DRAIN_S)
    start_timeout_s = cluster.float_("start_timeout_s", DEFAULT_START_TIMEOUT_S, positive=True)
    idle_poll = cluster.bool_("idle_poll", False)
    cluster.finish()

    sch = _Table(root.take("scheduler", {}), "scheduler")
    policy = sch.str_("policy", "deferred") or "deferred"
    drop = sch.str_("drop", "window") or "window"
    try:
        SchedulePolicy.parse(policy, drop)
    except ValueError as exc:
        key = "drop" if "drop" in str(exc) else "policy"
        raise ConfigError(f"scheduler.{key}: {exc}") from None
    scheduler = SchedulerConfig(
        shards=sch.int_("shards", 0, minimum=0),
        policy=policy,
        drop=drop,
        d_ctrl_ms=sch.float_("d_ctrl_ms", DEFAULT_D_CTRL_MS) or 0.0,
        d_data_ms=sch.float_("d_data_ms", DEFAULT_D_DATA_MS) or 0.0,
        jitter_ms=sch.float_("jitter_ms", DEFAULT_JITTER_MS) or 0.0,
        rank_address=sch.address("rank_address"),
        shard_addresses=sch.addresses("shard_addresses"),
    )
    sch.finish()
    if len(scheduler.shard_addresses) > max(1, scheduler.shards):
        raise ConfigError("scheduler.shard_addresses: more addresses than scheduler processes")

    fr = _Table(root.take("frontends", {}), "frontends")
    frontends = FrontendsConfig(
        count=fr.int_("count", 1, minimum=1),
        addresses=fr.addresses("addresses"),
        data_addresses=fr.addresses("data_addresses"),
        reply_allowance_ms=fr.float_("reply_allowance_ms", DEFAULT_REPLY_ALLOWANCE_MS) or 0.0,
        max_request_bytes=fr.int_("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES, minimum=1),
    )
    fr.finish()
    for key in ("addresses", "data_addresses"):
        if len(getattr(frontends, key)) > frontends.count:
            raise ConfigError(f"frontends.{key}: more addresses than frontends.count")

    be = _Table(root.take("backends", {}), "backends")
    count = be.int_("count", 1, minimum=1)
    device = be.str_("device", "cpu") or "cpu"
    if not _DEVICE_RE.match(device):
        raise ConfigError(
            f"backends.device: must be cpu, emulated, cuda or cuda:N, got {device!r}"
        )
    devices_raw = be.take("devices", [])
    if not isinstance(devices_raw, list):
        raise ConfigError("backends.devices: must be a list of devices")
    for i, dev in enumerate(devices_raw):
        if not isinstance(dev, str) or not _DEVICE_RE.match(dev) or dev == "cuda":
            raise ConfigError(
                f"backends.devices[{i}]: must be cpu, emulated or cuda:N, got {dev!r}"
            )
    backends = BackendsConfig(
        count=len(devices_raw) or count,
        device=device,
        devices=tuple(devices_raw),
        host=be.str_("host", host) or DEFAULT_HOST,
        plan_addresses=be.addresses("plan_addresses"),
    )
    be.finish()
    if len(backends.plan_addresses) > backends.total:
        raise ConfigError("backends.plan_addresses: more addresses than backends")

    models_raw = root.take("models", None)
    if not isinstance(models_raw, list) or not models_raw:
        raise ConfigError("models: at least one [[models]] table is required")
    models = tuple(_parse_model(m, f"models[{i}]", base) for i, m in enumerate(models_raw))
    seen: set[str] = set()
    for i, m in enumerate(models):
        if m.name in seen:
            raise ConfigError(f"models[{i}].name: duplicate model {m.name!r}")
        seen.add(m.name)
    root.finish()

    assert transport is not None and host is not None
    assert drain_s is not None and start_timeout_s is not None
    return ClusterConfig(
        name=name,
        transport=transport,
        host=host,
        ipc_dir=ipc_dir,
        drain_s=drain_s,
        start_timeout_s=start_timeout_s,
        idle_poll=idle_poll,
        scheduler=scheduler,
        frontends=frontends,
        backends=backends,
        models=models,
    )


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and validate a cluster.toml; relative model paths resolve against its folder."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return parse_config(data, base_dir=path.parent)
