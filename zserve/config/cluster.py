"""``cluster.toml``: the schema, its strict validation, and what each process is started with.

The file format is documented in ``docs/cluster-toml.md``. The schema is a tree of msgspec Structs
(``ClusterFile`` and the tables under it), decoded by ``zserve.config.decode``: an unknown key
(with a "did you mean"), a missing required key, a wrong type or a bad value raises ``ConfigError``
naming the key's path (``models[1].slo_ms: must be a finite number > 0, got 0.0``).
``ClusterConfig`` is
the validated file with the ``[cluster]`` table's keys at its top and relative paths resolved.

What a process gets: every role's entry point is ``run_<role>(config, control_address)`` where
``config`` is its :class:`RoleConfig` (a Struct, picklable for spawn), built by
:func:`role_config`.

Socket names in ``bind`` and in the peer map: rank ``rank``; shard ``shard`` (and ``rank`` when
embedded); backend ``plan``; frontend ``client`` and ``data``, and ``http`` / ``grpc``
(``host:port``) where its Open Inference Protocol servers are configured. With ``shards = 0``
the one scheduler process is named ``shard-0`` and serves both ``shard-0/shard`` and
``shard-0/rank``.
"""

from __future__ import annotations

import os
import re
import tomllib
import zlib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from zserve.config.apps import AppConfig, AppGraph, check_apps
from zserve.config.decode import FieldError, SchemaError, check_finite, decode
from zserve.config.policy_names import PolicyError, SchedulePolicy
from zserve.config.prefix_groups import (
    PrefixGroupConfig,
    check_prefix_groups,
    group_heads,
    scheduled_models,
)
from zserve.config.repository import scan_repository
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.core.allowances import ALLOWANCE_MODES

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
# Limits of the frontend's OIP servers (docs/security.md, "Request limits" says why these).
DEFAULT_HTTP_HEADER_TIMEOUT_S = 10.0
DEFAULT_HTTP_BODY_TIMEOUT_S = 60.0
DEFAULT_HTTP_IDLE_TIMEOUT_S = 75.0
DEFAULT_HTTP_MAX_CONNECTIONS = 1024
DEFAULT_GRPC_MAX_CONCURRENT_RPCS = 1024
DEFAULT_DRAIN_S = 5.0
DEFAULT_START_TIMEOUT_S = 120.0
# A standby scheduler takes over after this long without a ping from the active one (10 pings).
DEFAULT_TAKEOVER_TIMEOUT_MS = 1000.0
# The second scheduler process of an active/standby pair (``[scheduler] standby = true``).
STANDBY_NAME = "shard-0b"

TRANSPORTS = ("ipc", "tcp")
Transport = Literal["ipc", "tcp"]
DType = Literal["float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
Count = Annotated[int, msgspec.Meta(ge=1)]
Dimension = Annotated[int, msgspec.Meta(ge=1)]
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_ADDRESS_RE = re.compile(r"^(tcp://[^\s]+:\d+|ipc://[^\s]+|inproc://[^\s]+)$")
ONNX_IO_MODES = ("iobinding", "bound", "graph", "tensorrt")
DEVICE_RE = re.compile(r"^(cpu|emulated|cuda|cuda:\d+)$")
_HOST_PORT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):(\d{1,5})$")


class ConfigError(SchemaError):
    """A cluster.toml problem; the message starts with the offending key's path."""


def shard_for_model(model: str, shards: int) -> int:
    """The scheduler shard that owns ``model``: a stable rule (crc32 of the UTF-8 name) so every
    frontend, and every run, agrees. ``shards = 0`` (embedded rank) means the one shard 0."""
    if shards <= 1:
        return 0
    return zlib.crc32(model.encode("utf-8")) % shards


def _check_name(key: str, name: str) -> None:
    if not _NAME_RE.match(name):
        raise FieldError(key, f"must match {_NAME_RE.pattern}, got {name!r}")


_HTTP_ADDRESS_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


def _check_addresses(key: str, addresses: tuple[str, ...], limit: int, limit_name: str) -> None:
    for i, address in enumerate(addresses):
        _check_address(f"{key}[{i}]", address)
    if len(addresses) > limit:
        raise FieldError(key, f"more addresses than {limit_name}")


def _check_address(key: str, address: str | None) -> None:
    if address is not None and not _ADDRESS_RE.match(address):
        raise FieldError(
            key, f"not a ZeroMQ address (tcp://host:port, ipc://path), got {address!r}"
        )


# --------------------------------------------------------------------------- schema


class EmulatedConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[models.emulated]``: l(b) = alpha*b + beta and per-sample tensor shapes
    (zserve.backends.emulated.EmulatedModel)."""

    alpha_ms: float
    beta_ms: float
    input_shape: tuple[Dimension, ...] = (4,)
    input_dtype: DType = "float32"
    output_shape: tuple[Dimension, ...] = (1,)

    def __post_init__(self) -> None:
        check_finite("alpha_ms", self.alpha_ms)
        check_finite("beta_ms", self.beta_ms)
        if self.alpha_ms + self.beta_ms <= 0:
            raise FieldError("alpha_ms", "alpha_ms + beta_ms must be > 0")


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[models]]``: one model; exactly one of ``onnx``, ``builtin``, ``emulated``."""

    name: str
    onnx: str | None = None
    builtin: str | None = None
    emulated: EmulatedConfig | None = None
    profile: str | None = None
    # A profile file per device kind (kind -> path): a backend announcing one of these kinds
    # runs and registers that file's l(b); a backend of another kind, ``profile``'s (or the
    # emulated line, or its measurement). docs/orchestration.md, "Device kinds and prices".
    # (Values typed Any: a wrong one is refused by __post_init__ naming its kind's key, which
    # msgspec's own error, ``profiles[...]``, would not.)
    profiles: dict[str, Any] | None = None
    slo_ms: float = DEFAULT_SLO_MS
    max_batch: Count = DEFAULT_MAX_BATCH
    max_queue: Count = DEFAULT_MAX_QUEUE
    # Admission: refuse past this predicted wait (None: no such bound). docs/runtime.md.
    max_wait_ms: float | None = None
    # Past the model's capacity, admit at a rate that follows the answers (docs/runtime.md).
    shed_past_capacity: bool = True
    # ONNX Runtime models: the batch sizes that get a session of their own (empty: on a GPU
    # 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ...; on a CPU one session). backends/onnx_executor.py.
    session_batch_sizes: tuple[Count, ...] = ()
    # The scheduler's allowance per request row for fetching this model's inputs (None: the
    # cluster's ``[scheduler] d_data_ms``): one cluster may serve 600 KB images and 4 KB vectors.
    d_data_ms: float | None = None
    # Its memory on a backend, checked against ``[backends] memory``: weights (None: an onnx
    # file's size) and the peak activations of its largest batch (None: 0).
    memory_mib: float | None = None
    activation_mib: float | None = None
    # The backends that load it at start, by name ("backend-0"); None: every backend.
    backends: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _check_name("name", self.name)
        sources = [s for s in (self.onnx, self.builtin, self.emulated) if s is not None]
        if len(sources) != 1:
            raise FieldError("", "exactly one of onnx, builtin, emulated is required")
        check_finite("slo_ms", self.slo_ms, positive=True)
        _check_kind_profiles(self.profiles)
        check_finite("max_wait_ms", self.max_wait_ms, positive=True)
        check_finite("d_data_ms", self.d_data_ms)
        check_finite("memory_mib", self.memory_mib)
        check_finite("activation_mib", self.activation_mib)
        for i, size in enumerate(self.session_batch_sizes):
            if size > self.max_batch:
                raise FieldError(f"session_batch_sizes[{i}]",
                                 f"{size} is above max_batch ({self.max_batch})")

    def served_at_start_by(self, backend: str) -> bool:
        """Whether backend ``backend`` (its process name) loads this model at start."""
        return self.backends is None or backend in self.backends

    @property
    def kind(self) -> Literal["onnx", "builtin", "emulated"]:
        if self.onnx is not None:
            return "onnx"
        return "builtin" if self.builtin is not None else "emulated"

    @property
    def wait_bound_ms(self) -> float:
        return self.slo_ms if self.max_wait_ms is None else self.max_wait_ms

    # An emulated model's l(b) and tensors; the defaults of EmulatedConfig for the others.
    @property
    def alpha_ms(self) -> float | None:
        return None if self.emulated is None else self.emulated.alpha_ms

    @property
    def beta_ms(self) -> float | None:
        return None if self.emulated is None else self.emulated.beta_ms

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (4,) if self.emulated is None else self.emulated.input_shape

    @property
    def input_dtype(self) -> str:
        return "float32" if self.emulated is None else self.emulated.input_dtype

    @property
    def output_shape(self) -> tuple[int, ...]:
        return (1,) if self.emulated is None else self.emulated.output_shape

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return msgspec.convert(data, cls)

    def resolved(self, base: Path) -> ModelConfig:
        """Relative ``onnx`` and ``profile`` paths made absolute against ``base``."""

        def resolve(path: str | None) -> str | None:
            if path is None or os.path.isabs(path):
                return path
            return str((base / path).resolve())

        profiles = None if self.profiles is None else {
            kind: str(resolve(path)) for kind, path in self.profiles.items()}
        return msgspec.structs.replace(self, onnx=resolve(self.onnx),
                                       profile=resolve(self.profile), profiles=profiles)


def _check_kind_profiles(profiles: dict[str, Any] | None) -> None:
    """A model's ``profiles``: at least one, each keyed by a kind name, each a path."""
    if profiles is None:
        return
    if not profiles:
        raise FieldError("profiles", "name at least one device kind (leave the key out: one "
                         "profile for every kind)")
    for kind, path in profiles.items():
        _check_name(f"profiles.{kind}", kind)
        if not isinstance(path, str) or not path:
            raise FieldError(f"profiles.{kind}", f"must be a profile file's path, got {path!r}")


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[scheduler]``."""

    shards: Annotated[int, msgspec.Meta(ge=0)] = 0
    policy: str = "deferred"  # zserve.config.policy_names.SchedulePolicy.parse names
    drop: str = "window"
    d_ctrl_ms: float = DEFAULT_D_CTRL_MS
    d_data_ms: float = DEFAULT_D_DATA_MS
    jitter_ms: float = DEFAULT_JITTER_MS
    # "learned": d_ctrl, jitter and the frontends' reply allowance follow the hops' measured
    # p99, started at and capped by the values above (zserve.core.allowances); "fixed": the
    # values above as they are.
    allowances: str = "learned"
    rank_address: str | None = None
    shard_addresses: tuple[str, ...] = ()
    # A hot-spare scheduler process (``shards = 0`` only; docs/runtime.md, "Hot spare").
    standby: bool = False
    takeover_timeout_ms: float = DEFAULT_TAKEOVER_TIMEOUT_MS
    # Where the standby binds its rank and shard sockets (None: allocated). Named for roles
    # started alone, which learn the standby's addresses from the file (a Kubernetes Service).
    standby_rank_address: str | None = None
    standby_shard_address: str | None = None

    def __post_init__(self) -> None:
        check_finite("takeover_timeout_ms", self.takeover_timeout_ms, positive=True)
        for key in ("standby_rank_address", "standby_shard_address"):
            _check_address(key, getattr(self, key))
            if getattr(self, key) and not self.standby:
                raise FieldError(key, "needs standby = true")
        try:
            SchedulePolicy.parse(self.policy, self.drop)
        except PolicyError as exc:
            raise FieldError(exc.key, str(exc)) from None
        for key in ("d_ctrl_ms", "d_data_ms", "jitter_ms"):
            check_finite(key, getattr(self, key))
        if self.allowances not in ALLOWANCE_MODES:
            raise FieldError("allowances", f"must be one of {', '.join(ALLOWANCE_MODES)}, got "
                             f"{self.allowances!r}")
        _check_address("rank_address", self.rank_address)
        _check_addresses("shard_addresses", self.shard_addresses, max(1, self.shards),
                         "scheduler processes")


def _check_host_ports(key: str, addresses: tuple[str, ...], limit: int) -> None:
    """``host:port`` addresses (port 0: the kernel picks), at most ``limit``, no port twice."""
    ports: set[tuple[str, int]] = set()
    for i, address in enumerate(addresses):
        match = _HOST_PORT_RE.match(address)
        if match is None or int(match.group(2)) > 65535:
            raise FieldError(f"{key}[{i}]", f"must be host:port (e.g. 127.0.0.1:8000; port 0 "
                             f"picks a free one), got {address!r}")
        host_port = (match.group(1), int(match.group(2)))
        if host_port[1] and host_port in ports:
            raise FieldError(f"{key}[{i}]", f"{address} is already another frontend's: each "
                             "frontend needs its own port")
        ports.add(host_port)
    if len(addresses) > limit:
        raise FieldError(key, "more addresses than frontends.count")


class FrontendsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[frontends]``."""

    count: Count = 1
    addresses: tuple[str, ...] = ()  # client ROUTER bind addresses, one per frontend
    data_addresses: tuple[str, ...] = ()  # data ROUTER bind addresses, one per frontend
    # Open Inference Protocol servers (zserve.frontend.oip.servers), host:port per frontend; none:
    # off.
    http_addresses: tuple[str, ...] = ()
    grpc_addresses: tuple[str, ...] = ()
    reply_allowance_ms: float = DEFAULT_REPLY_ALLOWANCE_MS
    max_request_bytes: Count = DEFAULT_MAX_REQUEST_BYTES
    # Prometheus endpoints (HOST:PORT, port 0: any free one), one per frontend; none: off.
    metrics_addresses: tuple[str, ...] = ()
    # Request limits of the OIP servers (zserve.frontend.oip.http_server,
    # zserve.frontend.oip.servers). The body and
    # message bounds default to what the served models accept (None: derived).
    http_max_body_bytes: Count | None = None
    http_header_timeout_s: float = DEFAULT_HTTP_HEADER_TIMEOUT_S
    http_body_timeout_s: float = DEFAULT_HTTP_BODY_TIMEOUT_S
    http_idle_timeout_s: float = DEFAULT_HTTP_IDLE_TIMEOUT_S
    http_max_connections: Count = DEFAULT_HTTP_MAX_CONNECTIONS
    grpc_max_message_bytes: Count | None = None
    grpc_max_concurrent_rpcs: Count = DEFAULT_GRPC_MAX_CONCURRENT_RPCS

    def __post_init__(self) -> None:
        check_finite("reply_allowance_ms", self.reply_allowance_ms)
        for key in ("http_header_timeout_s", "http_body_timeout_s", "http_idle_timeout_s"):
            check_finite(key, getattr(self, key), positive=True)
        if self.http_header_timeout_s > self.http_idle_timeout_s:
            # A connection waiting for a request's head is closed at the idle timeout.
            raise FieldError("http_header_timeout_s", f"must be <= http_idle_timeout_s "
                             f"({self.http_idle_timeout_s:g}), got {self.http_header_timeout_s:g}")
        _check_addresses("addresses", self.addresses, self.count, "frontends.count")
        _check_addresses("data_addresses", self.data_addresses, self.count, "frontends.count")
        _check_host_ports("http_addresses", self.http_addresses, self.count)
        _check_host_ports("grpc_addresses", self.grpc_addresses, self.count)
        for i, address in enumerate(self.metrics_addresses):
            if not _HTTP_ADDRESS_RE.match(address):
                raise FieldError(f"metrics_addresses[{i}]",
                                 f"not HOST:PORT (e.g. 127.0.0.1:9464), got {address!r}")
        if len(self.metrics_addresses) > self.count:
            raise FieldError("metrics_addresses", "more addresses than frontends.count")


class BackendsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[backends]``."""

    count: Count = 1
    device: str = "cpu"
    devices: tuple[str, ...] = ()  # per-backend devices; overrides count and device
    host: str | None = None  # None: cluster.host
    plan_addresses: tuple[str, ...] = ()
    # Model memory each backend may use: a device kind ("a100", "gtx1080ti": its budget,
    # zserve.orchestrator.memory) or GiB; None: not checked. Preflight refuses the models
    # started on every backend if their weights + largest activations exceed it.
    memory: str | float | None = None
    # How ONNX Runtime models run (zserve.backends.onnx_session.SessionConfig): "iobinding" (the
    # default), "bound" (fixed-size sessions bound once to preallocated buffers), "graph" (bound,
    # plus CUDA graphs) or "tensorrt" (the TensorRT provider, fp16, before the CUDA one).
    onnx_io: str = "iobinding"
    # The device kind each backend announces to the rank ("a100"): ``kinds`` per started
    # backend, else ``kind`` for all (and for those the autoscaler adds); none: no kind (every
    # GPU plans with one profile per model). The autoscaler scales each kind within
    # [autoscale.kinds.<kind>].
    kind: str | None = None
    kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.onnx_io not in ONNX_IO_MODES:
            raise FieldError("onnx_io", f"must be one of {', '.join(ONNX_IO_MODES)}, got "
                                        f"{self.onnx_io!r}")
        if not isinstance(self.memory, str):
            check_finite("memory", self.memory, positive=True)
        if self.kinds and len(self.kinds) != self.total:
            raise FieldError("kinds", f"names one kind per backend: {len(self.kinds)} kinds "
                             f"for {self.total} backends")
        for i, kind in enumerate(self.kinds):
            _check_name(f"kinds[{i}]", kind)
        if not DEVICE_RE.match(self.device):
            raise FieldError("device",
                             f"must be cpu, emulated, cuda or cuda:N, got {self.device!r}")
        for i, device in enumerate(self.devices):
            if not DEVICE_RE.match(device) or device == "cuda":
                raise FieldError(f"devices[{i}]",
                                 f"must be cpu, emulated or cuda:N, got {device!r}")
        _check_addresses("plan_addresses", self.plan_addresses, self.total, "backends")
        if self.kind is not None:
            _check_name("kind", self.kind)

    def device_of(self, index: int) -> str:
        if self.devices:
            return self.devices[index]
        if self.device == "cuda":
            return f"cuda:{index}"
        return self.device

    @property
    def total(self) -> int:
        return len(self.devices) if self.devices else self.count

    def kind_of(self, index: int) -> str:
        """The device kind backend ``index`` announces ("": none; one past ``kinds``, such as
        one the autoscaler adds, announces ``kind``)."""
        if index < len(self.kinds):
            return self.kinds[index]
        return self.kind or ""

    def started_by_kind(self) -> dict[str, int]:
        """How many backends of each kind start, in the order the kinds first appear."""
        counts: dict[str, int] = {}
        for index in range(self.total):
            kind = self.kind_of(index)
            counts[kind] = counts.get(kind, 0) + 1
        return counts


class ClusterTable(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[cluster]``."""

    name: str = "zserve"
    transport: Transport = "ipc"
    host: str = DEFAULT_HOST
    ipc_dir: str | None = None
    drain_s: float = DEFAULT_DRAIN_S
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    # Keep the CPUs awake while the cluster runs (zserve.transport.idle_poll): off by default,
    # since it shows every CPU busy; the benchmark clusters turn it on.
    idle_poll: bool = False

    def __post_init__(self) -> None:
        _check_name("name", self.name)
        check_finite("drain_s", self.drain_s)
        check_finite("start_timeout_s", self.start_timeout_s, positive=True)


class SecurityConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[security]``: CURVE on every tcp link (docs/security.md). ``keys_dir`` is the folder
    ``zserve keys init`` wrote (each role's key pair); ``authorized_clients`` the folder of the
    client public keys (``*.key``) a frontend's client socket accepts (None: ``<keys_dir>/
    clients``); ``insecure = true`` allows binding a non-loopback tcp address without keys."""

    keys_dir: str | None = None
    authorized_clients: str | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.authorized_clients is not None and self.keys_dir is None:
            raise FieldError("authorized_clients", "needs keys_dir (the roles' keys)")

    @property
    def curve(self) -> bool:
        """True when the tcp links use CURVE."""
        return self.keys_dir is not None

    @property
    def clients_dir(self) -> str | None:
        if self.keys_dir is None:
            return None
        return self.authorized_clients or os.path.join(self.keys_dir, "clients")

    def resolved(self, base: Path) -> SecurityConfig:
        """Relative folders made absolute against ``base`` (the cluster file's folder)."""

        def resolve(path: str | None) -> str | None:
            return path if path is None or os.path.isabs(path) else str((base / path).resolve())

        return msgspec.structs.replace(self, keys_dir=resolve(self.keys_dir),
                                       authorized_clients=resolve(self.authorized_clients))


class RepositoryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[repository]``: a model repository folder (``zserve.config.repository``) whose models
    join the cluster's, and the ones of them loaded at start (``load``; ``["*"]``: all). The
    others wait, known to every role but served by no backend, for the Open Inference
    Protocol's repository ``load`` (docs/orchestration.md, "Model repository")."""

    path: str | None = None
    load: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.load and self.path is None:
            raise FieldError("load", "needs path (the repository folder)")

    def resolved(self, base: Path) -> RepositoryConfig:
        if self.path is None or os.path.isabs(self.path):
            return self
        return msgspec.structs.replace(self, path=str((base / self.path).resolve()))


class AutoscaleKindConfig(msgspec.Struct, frozen=True, kw_only=True,
                          forbid_unknown_fields=True):
    """``[autoscale.kinds.<kind>]``: the bounds of one device kind's backends."""

    min_backends: Count = 1
    max_backends: int = 0  # 0: as many as start of this kind

    def __post_init__(self) -> None:
        if self.max_backends < 0:
            raise FieldError("max_backends", "must be >= 0 (0: the backends of this kind "
                             "that start)")

    def bounds(self, started: int) -> tuple[int, int]:
        return self.min_backends, self.max_backends or started


class AutoscaleConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[autoscale]``: the autoscaling advice (``zserve.orchestrator.autoscale``; the frontends
    compute and export it while ``enabled``) and the bounds ``zserve up`` acts within
    (docs/cluster-toml.md)."""

    enabled: bool = False
    # `zserve up` starts and releases backends on the advice (zserve.cluster.autoscaler); false:
    # the advice is only exported (for an outside scaler such as KEDA).
    act: bool = True
    min_backends: Count = 1
    max_backends: int = 0  # 0: backends.count (the advice may not exceed what was started)
    interval_s: float = 1.0
    up_window_s: float = 10.0
    down_window_s: float = 60.0
    add_bad_rate: float = 0.01
    idle_floor: float = 0.03
    release_margin: float = 0.1
    headroom: float = 0.03
    settle_s: float = 5.0
    down_hold_s: float = 600.0
    max_release_fraction: float = 0.25
    min_requests: Count = 200
    # Per device kind (backends.kinds): each kind is advised and scaled on its own, within its
    # bounds; {}: the cluster as one.
    kinds: dict[str, AutoscaleKindConfig] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("interval_s", "up_window_s", "down_window_s"):
            check_finite(key, getattr(self, key), positive=True)
        for key in ("settle_s", "down_hold_s"):
            check_finite(key, getattr(self, key))
            if getattr(self, key) < 0:
                raise FieldError(key, "must be >= 0")
        for key in ("add_bad_rate", "idle_floor", "release_margin", "headroom"):
            value = getattr(self, key)
            check_finite(key, value)
            if not 0.0 <= value < 1.0:
                raise FieldError(key, f"must be in [0, 1), got {value}")
        if not 0.0 < self.max_release_fraction <= 1.0:
            raise FieldError("max_release_fraction", "must be in (0, 1]")
        if self.max_backends < 0:
            raise FieldError("max_backends", "must be >= 0 (0: backends.count)")

    def bounds(self, backends: int) -> tuple[int, int]:
        """(min, max) backends, ``max_backends = 0`` meaning ``backends`` (the count started)."""
        return self.min_backends, self.max_backends or backends

    def kind_bounds(self, backends: BackendsConfig) -> dict[str, tuple[int, int]]:
        """(min, max) backends of each kind that starts: its table's, else as many as start
        (a kind without a table keeps its count). {} without ``kinds``."""
        if not self.kinds:
            return {}
        started = backends.started_by_kind()
        return {kind: (self.kinds[kind].bounds(count) if kind in self.kinds
                       else (count, count)) for kind, count in started.items()}


def _check_autoscale_kinds(autoscale: AutoscaleConfig, backends: BackendsConfig) -> None:
    """``[autoscale.kinds.<kind>]``: each names a kind that starts, its bounds hold what starts,
    and the cluster's bounds hold the kinds' together."""
    if not autoscale.kinds:
        return
    if not backends.kinds:
        raise FieldError("autoscale.kinds", "per-kind bounds need backends.kinds (one kind "
                         "per backend)")
    started = backends.started_by_kind()
    for kind, limits in autoscale.kinds.items():
        key = f"autoscale.kinds.{kind}"
        if kind not in started:
            raise FieldError(key, f"no backend of kind {kind!r} starts (backends.kinds has "
                             f"{', '.join(sorted(started))})")
        low, high = limits.bounds(started[kind])
        if low > high:
            raise FieldError(f"{key}.min_backends", f"{low} is above max_backends {high}")
        if not low <= started[kind] <= high:
            raise FieldError(key, f"{started[kind]} backends of kind {kind!r} start, outside "
                             f"min_backends..max_backends ({low}..{high})")
    bounds = autoscale.kind_bounds(backends).values()
    low, high = autoscale.bounds(backends.total)
    if sum(b[1] for b in bounds) > high or sum(b[0] for b in bounds) < low:
        raise FieldError("autoscale.kinds", f"the kinds' bounds add up to "
                         f"{sum(b[0] for b in bounds)}..{sum(b[1] for b in bounds)} backends, "
                         f"outside the cluster's min_backends..max_backends ({low}..{high})")


def _check_autoscale(autoscale: AutoscaleConfig, backends: BackendsConfig) -> None:
    _check_autoscale_kinds(autoscale, backends)
    low, high = autoscale.bounds(backends.total)
    if low > high:
        raise FieldError("autoscale.min_backends",
                         f"{low} is above max_backends {high}")
    if autoscale.enabled and not low <= backends.total <= high:
        raise FieldError("backends.count", f"{backends.total} backends start, outside "
                         f"[autoscale] min_backends..max_backends ({low}..{high})")
    if autoscale.enabled and backends.devices:
        raise FieldError("backends.devices", "[autoscale] starts backends of one device "
                         "(backends.device), not a list")


class OrchestrationConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[orchestration]``: the supervisor's orchestrator (docs/orchestration.md,
    "Re-planning", "On-demand loading"): every ``plan_period_s`` it re-partitions the loaded
    models over ``subclusters`` groups of backends by their rates over ``rate_window_s``, moving
    at most ``disruption_budget`` of their bytes; a request for a model loaded nowhere loads it
    (``load_on_demand``), evicting the least recently used where ``memory_budget_mb`` (per
    backend) is short; a model with no request for ``idle_unload_s`` is unloaded."""

    plan_period_s: float = 300.0
    rate_window_s: float = 60.0
    subclusters: Count = 1
    disruption_budget: float = 0.05
    load_on_demand: bool = True
    idle_unload_s: float | None = None
    memory_budget_mb: float | None = None

    def __post_init__(self) -> None:
        for key in ("plan_period_s", "rate_window_s", "idle_unload_s", "memory_budget_mb"):
            check_finite(key, getattr(self, key), positive=True)
        check_finite("disruption_budget", self.disruption_budget)
        if not 0.0 <= self.disruption_budget <= 1.0:
            raise FieldError("disruption_budget", "must be a fraction in 0..1 (of the loaded "
                             f"models' bytes), got {self.disruption_budget}")


def _check_models(models: tuple[ModelConfig, ...], backends: BackendsConfig, *,
                  repository: bool = False) -> None:
    if not models and not repository:
        raise FieldError("models", "at least one [[models]] table (or a [repository]) is "
                         "required")
    seen: set[str] = set()
    for i, model in enumerate(models):
        if model.name in seen:
            raise FieldError(f"models[{i}].name", f"duplicate model {model.name!r}")
        seen.add(model.name)
        problem = model_backends_problem(model.backends, backends.total)
        if problem is not None:
            raise FieldError(f"models[{i}].backends{problem[0]}", problem[1])
        problem = model_kinds_problem(model.profiles, backends)
        if problem is not None:
            raise FieldError(f"models[{i}].profiles{problem[0]}", problem[1])


def model_kinds_problem(profiles: dict[str, Any] | None,
                        backends: BackendsConfig) -> tuple[str, str] | None:
    """What is wrong with a model's per-kind ``profiles`` against the kinds the backends
    announce (``backends.kinds``, ``backends.kind``): a kind none announces is a typo or a
    profile no GPU would run. As (the key below ``profiles``: "" or ".<kind>", the problem)."""
    if profiles is None:
        return None
    announced = set(backends.kinds) | ({backends.kind} if backends.kind else set())
    if not announced:
        return "", "per-kind profiles need backends that announce a kind (backends.kind or " \
            "backends.kinds)"
    for kind in profiles:
        if kind not in announced:
            return f".{kind}", (f"no backend announces kind {kind!r} (the backends announce "
                                f"{', '.join(sorted(announced))})")
    return None


def model_backends_problem(names: tuple[str, ...] | None,
                           backends: int) -> tuple[str, str] | None:
    """What is wrong with a model's ``backends`` (at least one, each a configured backend's
    name, no repeats), as (the key below ``backends``: "" or "[j]", the problem), or None."""
    if names is None:
        return None
    if not names:
        return "", "name at least one backend (leave the key out: every backend)"
    known = [process_name("backend", i) for i in range(backends)]
    for j, name in enumerate(names):
        if name not in known:
            shown = f"{known[0]} .. {known[-1]}" if len(known) > 1 else known[0]
            return f"[{j}]", f"no backend named {name!r} (the backends are {shown})"
        if name in names[:j]:
            return f"[{j}]", f"backend {name!r} named twice"
    return None


class ClusterFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole document, as written."""

    cluster: ClusterTable = ClusterTable()
    scheduler: SchedulerConfig = SchedulerConfig()
    frontends: FrontendsConfig = FrontendsConfig()
    backends: BackendsConfig = BackendsConfig()
    models: tuple[ModelConfig, ...] = ()
    security: SecurityConfig = SecurityConfig()
    repository: RepositoryConfig = RepositoryConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()
    orchestration: OrchestrationConfig | None = None
    apps: tuple[AppConfig, ...] = ()
    prefix_groups: tuple[PrefixGroupConfig, ...] = ()

    def __post_init__(self) -> None:
        _check_models(self.models, self.backends,
                      repository=self.repository.path is not None)
        _check_autoscale(self.autoscale, self.backends)
        groups = self.orchestration.subclusters if self.orchestration is not None else 1
        if groups > self.backends.total:
            raise FieldError("orchestration.subclusters",
                             f"{groups} sub-clusters need at least as many backends "
                             f"(backends.count is {self.backends.total})")


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A validated cluster.toml: ``[cluster]``'s keys at the top, the other tables below."""

    name: str = "zserve"
    transport: Transport = "ipc"
    host: str = DEFAULT_HOST
    ipc_dir: str | None = None
    drain_s: float = DEFAULT_DRAIN_S
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    idle_poll: bool = False
    scheduler: SchedulerConfig = SchedulerConfig()
    frontends: FrontendsConfig = FrontendsConfig()
    backends: BackendsConfig = BackendsConfig()
    models: tuple[ModelConfig, ...] = ()
    security: SecurityConfig = SecurityConfig()
    repository: RepositoryConfig = RepositoryConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()
    # None: no orchestrator (no on-demand loads, idle unloads or re-plans).
    orchestration: OrchestrationConfig | None = None
    # The models of ``[repository]`` not loaded at start (no backend serves them until a
    # repository load); every other model is loaded by every backend at start.
    unloaded_at_start: tuple[str, ...] = ()
    # The names of the models the ``[repository]`` folder holds (its index lists them).
    repository_models: tuple[str, ...] = ()
    # ``[[apps]]``: applications over the models (zserve.config.apps), validated at load.
    apps: tuple[AppConfig, ...] = ()
    # ``[[prefix_groups]]``: models scheduled and run as one group (zserve.config.prefix_groups).
    prefix_groups: tuple[PrefixGroupConfig, ...] = ()

    # ------------------------------------------------------------------ conversions

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        return msgspec.convert(data, cls)

    # ------------------------------------------------------------------ layout

    def app_graphs(self) -> dict[str, AppGraph]:
        """Each ``[[apps]]`` app's validated plan, by name (``parse_config`` checked them)."""
        return check_apps(self.apps, {m.name: declared_signature(m) for m in self.models})

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def scheduled_models(self) -> tuple[ModelConfig, ...]:
        """The models the scheduler plans: each prefix group's models as the group."""
        return scheduled_models(self.prefix_groups, self.models)

    @property
    def group_heads(self) -> dict[str, tuple[str, int]]:
        """Each model of a prefix group -> (the group's name, its head's index)."""
        return group_heads(self.prefix_groups)

    @property
    def startup_models(self) -> tuple[ModelConfig, ...]:
        """The models some backend loads at start (each on its ``backends``, else on all)."""
        return tuple(m for m in self.models if m.name not in self.unloaded_at_start)

    def startup_models_of(self, backend: str) -> tuple[ModelConfig, ...]:
        """The models backend ``backend`` (its process name) loads at start."""
        return tuple(m for m in self.startup_models if m.served_at_start_by(backend))

    def d_data_ms_of(self, model: ModelConfig) -> float:
        """``model``'s data allowance per request row: its own ``d_data_ms``, else the
        scheduler's."""
        return self.scheduler.d_data_ms if model.d_data_ms is None else model.d_data_ms

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
        if self.scheduler.standby:
            names.append(("shard", STANDBY_NAME, 0))
        names += [("backend", f"backend-{i}", i) for i in range(self.backends.total)]
        names += [("frontend", f"frontend-{i}", i) for i in range(self.frontends.count)]
        return names

    def bind_addresses(self, role: str, index: int, ipc_dir: str | None,
                       name: str | None = None) -> dict[str, str]:
        """Socket name -> bind address of one process: what cluster.toml names, else
        ``ipc://<ipc_dir>/<name>.<socket>`` (transport ipc) or ``tcp://<host>:0``. The standby
        scheduler (``name`` STANDBY_NAME) binds ``standby_shard_address`` and
        ``standby_rank_address`` where named."""
        if name == STANDBY_NAME:
            sockets: dict[str, str | None] = {"shard": self.scheduler.standby_shard_address,
                                              "rank": self.scheduler.standby_rank_address}
            return self._generated(sockets, name, self.host, ipc_dir)
        name = process_name(role, index)
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
            # The OIP servers listen only where configured (host:port, not a ZeroMQ address).
            for server in ("http", "grpc"):
                oip = getattr(self.frontends, f"{server}_addresses")
                if index < len(oip):
                    sockets[server] = oip[index]
        else:
            raise ValueError(f"unknown role {role!r}")
        host = (self.backends.host or self.host) if role == "backend" else self.host
        return self._generated(sockets, name, host, ipc_dir)

    def _generated(self, sockets: dict[str, str | None], name: str, host: str,
                   ipc_dir: str | None) -> dict[str, str]:
        out: dict[str, str] = {}
        for sock, explicit_address in sockets.items():
            if explicit_address:
                out[sock] = explicit_address
            elif self.transport == "ipc" and ipc_dir:
                out[sock] = f"ipc://{ipc_dir}/{name}.{sock}"
            else:
                out[sock] = f"tcp://{host}:0"
        return out

    def explicit_bind_keys(self) -> list[tuple[str, str]]:
        """``(key path, address)`` of every bind address cluster.toml names and a process uses,
        e.g. ``("frontends.addresses[0]", "tcp://0.0.0.0:7000")``."""
        keyed: list[tuple[str, str]] = []
        for key in ("rank_address", "standby_rank_address", "standby_shard_address"):
            if getattr(self.scheduler, key):
                keyed.append((f"scheduler.{key}", getattr(self.scheduler, key)))
        tables = (
            ("scheduler.shard_addresses", self.scheduler.shard_addresses,
             self.scheduler_processes),
            ("frontends.addresses", self.frontends.addresses, self.frontends.count),
            ("frontends.data_addresses", self.frontends.data_addresses, self.frontends.count),
            ("backends.plan_addresses", self.backends.plan_addresses, self.backends.total),
        )
        for key, addresses, used in tables:
            keyed += [(f"{key}[{i}]", address) for i, address in enumerate(addresses[:used])]
        return keyed

    def static_peers(self, ipc_dir: str | None) -> dict[str, str]:
        """The peer map computable without running anything: every address that is explicit in
        cluster.toml or deterministic (ipc with a known ``ipc_dir``); tcp port-0 binds left out.
        A role started alone uses it, overridden by its command line."""
        peers: dict[str, str] = {}
        for role, name, index in self.process_names():
            for sock, address in self.bind_addresses(role, index, ipc_dir, name).items():
                if not address.endswith(":0"):
                    peers[f"{name}/{sock}"] = address
        return peers


def process_name(role: str, index: int) -> str:
    return "rank" if role == "rank" else f"{role}-{index}"


class RoleConfig(msgspec.Struct, kw_only=True):
    """What a process is started with: picklable for the spawn start method. ``bind`` and
    ``peers`` stay mutable, so a role started alone can apply its command-line overrides."""

    role: str  # rank | shard | backend | frontend
    name: str  # also its DEALER identity everywhere
    index: int  # index within its role
    cluster: ClusterConfig
    # Socket name -> address to bind ({"plan": "ipc:///tmp/zs-x/backend-1.plan"}).
    bind: dict[str, str]
    # Peer map ("<name>/<socket>" -> address) for a role started alone; {} under a supervisor
    # (the Ready handshake gives it).
    peers: dict[str, str] = msgspec.field(default_factory=dict)
    # The models it needs: a shard the models it owns, every other role all of them.
    models: tuple[ModelConfig, ...] = ()
    shards: int = 0  # scheduler shard processes (0 = embedded rank)
    embedded_rank: bool = False  # shard: True when shards == 0 (binds "rank" and "shard")
    # The host name peers are given for a socket bound to a wildcard address
    # (tcp://0.0.0.0:PORT); None: the host name.
    advertise_host: str | None = None
    device: str = "cpu"  # backend: cpu | cuda:N | emulated
    kind: str = ""  # backend: its device kind (backends.kinds; "": one kind)
    # rank and shard: how long a silent backend stays registered (None: the role's default).
    backend_timeout_s: float | None = None
    # shard: how long past d_ctrl a plan may go unacknowledged before its backend is suspect
    # (None: zserve.scheduler.sent_plans.PLAN_ACK_MARGIN_S; tests that play a backend slowly
    # raise it).
    plan_ack_margin_s: float | None = None
    # shard with ``[scheduler] standby``: start as the standby of the pair (the supervisor
    # starts STANDBY_NAME so, and every scheduler it restarts).
    standby: bool = False
    # backend: the names of the models it loads at start (None: every model of ``models``); the
    # supervisor keeps it current as models are loaded and unloaded, so a restarted backend
    # serves what its last incarnation did.
    serve: tuple[str, ...] | None = None


def role_config(
    cluster: ClusterConfig,
    role: str,
    index: int,
    *,
    ipc_dir: str | None,
    bind: dict[str, str] | None = None,
    peers: dict[str, str] | None = None,
    advertise_host: str | None = None,
    name: str | None = None,
) -> RoleConfig:
    """The RoleConfig of process ``index`` of ``role`` (binding what cluster.toml names, else
    what ``bind_addresses`` allocates under ``ipc_dir``)."""
    shards = cluster.scheduler.shards
    models = cluster.models
    if role == "shard":
        models = tuple(m for m in cluster.scheduled_models
                       if shard_for_model(m.name, shards) == index)
    name = name or process_name(role, index)
    return RoleConfig(
        role=role,
        name=name,
        index=index,
        cluster=cluster,
        bind=dict(bind) if bind is not None else cluster.bind_addresses(role, index, ipc_dir,
                                                                        name),
        peers=dict(peers or {}),
        models=models,
        shards=shards,
        embedded_rank=role == "shard" and shards == 0,
        advertise_host=advertise_host,
        device=cluster.backends.device_of(index) if role == "backend" else "cpu",
        kind=cluster.backends.kind_of(index) if role == "backend" else "",
        standby=name == STANDBY_NAME,
        serve=tuple(m.name for m in cluster.startup_models_of(name)) if role == "backend"
        else None,
    )


# --------------------------------------------------------------------------- parsing


def _decode_kind_tables(data: dict[str, Any]) -> None:
    """Each ``[autoscale.kinds.<kind>]`` on its own first, so that an error names its kind
    (``autoscale.kinds.a100.max_backends: ...``): msgspec's paths leave a table's keys out."""
    autoscale = data.get("autoscale")
    kinds = autoscale.get("kinds") if isinstance(autoscale, dict) else None
    if not isinstance(kinds, dict):
        return
    for kind, table in kinds.items():
        path = f"autoscale.kinds.{kind}"
        if not isinstance(kind, str) or not _NAME_RE.match(kind):
            raise SchemaError(path, f"a kind must match {_NAME_RE.pattern}")
        decode(table, AutoscaleKindConfig, path=path)


def parse_config(data: dict[str, Any], *, base_dir: str | Path = ".") -> ClusterConfig:
    """Validate a parsed TOML document (or an equivalent dict) into a ClusterConfig; relative
    model paths resolve against ``base_dir``."""
    try:
        _decode_kind_tables(data)
        document = decode(data, ClusterFile)
    except SchemaError as exc:
        raise ConfigError(exc.path, exc.problem) from None
    base = Path(base_dir)
    repository = document.repository.resolved(base)
    models = tuple(model.resolved(base) for model in document.models)
    unloaded: tuple[str, ...] = ()
    found: tuple[ModelConfig, ...] = ()
    if repository.path is not None:
        try:
            found = tuple(scan_repository(repository.path, ModelConfig))
        except SchemaError as exc:
            raise ConfigError(exc.path, exc.problem) from None
        models, unloaded = _with_repository(models, found, repository.load)
        for model in found:
            problem = model_backends_problem(model.backends, document.backends.total)
            if problem is not None:
                raise ConfigError(f"repository.models.{model.name}.backends{problem[0]}",
                                  problem[1])
            problem = model_kinds_problem(model.profiles, document.backends)
            if problem is not None:
                raise ConfigError(f"repository.models.{model.name}.profiles{problem[0]}",
                                  problem[1])
    return _checked_groups(ClusterConfig(
        **msgspec.structs.asdict(document.cluster),
        scheduler=document.scheduler,
        frontends=document.frontends,
        backends=document.backends,
        models=models,
        security=document.security.resolved(base),
        repository=repository,
        autoscale=document.autoscale,
        orchestration=document.orchestration,
        unloaded_at_start=unloaded,
        repository_models=tuple(m.name for m in found),
        apps=document.apps,
        prefix_groups=document.prefix_groups,
    ))


def _checked_groups(config: ClusterConfig) -> ClusterConfig:
    """``config`` once its apps and prefix groups fit its models (``ConfigError`` naming the
    key otherwise)."""
    try:
        check_prefix_groups(config.prefix_groups, config.models,
                            orchestrated=config.orchestration is not None,
                            unloaded=config.unloaded_at_start)
    except SchemaError as exc:
        raise ConfigError(exc.path, exc.problem) from None
    return _checked_apps(config)


def _checked_apps(config: ClusterConfig) -> ClusterConfig:
    """``config`` once its apps fit its models (``ConfigError`` naming the key otherwise)."""
    try:
        config.app_graphs()
    except SchemaError as exc:
        raise ConfigError(exc.path, exc.problem) from None
    return config


def declared_signature(model: ModelConfig) -> ModelSignature | None:
    """The signature the config fixes: an emulated model's (``backends/emulated.py``: input
    ``x``, output ``y``); None for the others (known once a backend loads them)."""
    if model.emulated is None:
        return None
    return ModelSignature(model.name, (TensorSpec("x", model.input_dtype, model.input_shape),),
                          (TensorSpec("y", "float32", model.output_shape),))


def _with_repository(models: tuple[ModelConfig, ...], found: tuple[ModelConfig, ...],
                     load: tuple[str, ...]) -> tuple[tuple[ModelConfig, ...], tuple[str, ...]]:
    """The cluster's models with the repository's, and the repository's not loaded at start."""
    names = {m.name for m in models}
    for model in found:
        if model.name in names:
            raise ConfigError(f"repository.models.{model.name}",
                              "a [[models]] table has this name too")
    in_repository = {m.name for m in found}
    for i, name in enumerate(load):
        if name != "*" and name not in in_repository:
            raise ConfigError(f"repository.load[{i}]",
                              f"no model {name!r} in the repository "
                              f"(it holds {', '.join(sorted(in_repository)) or 'none'})")
    if not models and not found:
        raise ConfigError("models", "at least one [[models]] table or repository model is "
                          "required")
    loaded = in_repository if "*" in load else set(load)
    return models + found, tuple(sorted(in_repository - loaded))


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and validate a cluster.toml; relative model paths resolve against its folder."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), str(exc)) from exc
    return parse_config(data, base_dir=path.parent)
