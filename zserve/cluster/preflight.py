"""Preflight: every checkable problem of a cluster config, found before any process is spawned.

Schema problems stop ``load_config``; what it cannot see needs the file system and the network:
model files that are missing, do not parse or cannot be batched (the backend's signature
reader: ``onnx`` without ONNX Runtime and without external data), unknown built-in names,
profile files that are missing, do not parse or lack the model, a model the backends' device
cannot run (an emulated model on an ONNX Runtime device, a model without l(b) on an emulated
one), bind addresses that cannot be bound right now (every tcp address cluster.toml names,
ZeroMQ, HTTP, gRPC and metrics alike, is bound and closed), ipc paths over the socket path
limit or in a missing folder, an address or port named twice across keys, a tcp bind on a
non-loopback host without CURVE keys (unless ``security.insecure``), and key files that are
missing, malformed or readable by other users (docs/security.md).
``check_cluster`` returns them all, each naming its key path; ``preflight`` raises
``PreflightError`` with them. The supervisor runs it first thing, so a bad file costs one line
per problem instead of tracebacks from processes that already started.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import zmq

from zserve.backends.builtin import builtin_names
from zserve.backends.executor import ModelLoadError
from zserve.backends.onnx_executor import read_signature
from zserve.cluster.orchestrator_host import onnx_file_bytes
from zserve.config.cluster import ClusterConfig, ModelConfig, process_name
from zserve.config.profiles import profile_from_file
from zserve.orchestrator.memory import (
    GIB_BYTES,
    ModelMemory,
    UnknownDeviceKindError,
    configured_memory,
    device_budget_bytes,
    overcommit_error,
)
from zserve.runtime.keys import key_problems

# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
IPC_PATH_MAX_BYTES = 107
# What tempfile.mkdtemp(prefix="zs-") names the run folder: the prefix and 8 random characters.
RUN_DIR_PLACEHOLDER = "zs-xxxxxxxx"
# A library's error text is cut to this, so each problem stays one readable line.
REASON_MAX_CHARS = 400
IPC_SCHEME = "ipc://"
TCP_SCHEME = "tcp://"
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})
EMULATED_DEVICE = "emulated"
# The frontends' HTTP/gRPC endpoints (host:port, not ZeroMQ addresses), by their key in
# [frontends]: the Open Inference Protocol servers and the Prometheus endpoint.
HTTP_ADDRESS_KEYS = ("http_addresses", "grpc_addresses", "metrics_addresses")


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem: the key path in cluster.toml (``models[1].onnx``) and what is wrong."""

    key: str
    problem: str

    def __str__(self) -> str:
        return f"{self.key}: {self.problem}"


class PreflightError(ValueError):
    """The config cannot start; ``problems`` lists every problem found, one line each."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(problem) for problem in self.problems))


def preflight(
    config: ClusterConfig, *, ipc_base: str | None = None, ipc_base_key: str = "cluster.ipc_dir"
) -> None:
    """Raise ``PreflightError`` if ``check_cluster`` finds anything."""
    problems = check_cluster(config, ipc_base=ipc_base, ipc_base_key=ipc_base_key)
    if problems:
        raise PreflightError(problems)


def check_cluster(
    config: ClusterConfig, *, ipc_base: str | None = None, ipc_base_key: str = "cluster.ipc_dir"
) -> list[Problem]:
    """Every problem of ``config`` that can be found without starting it. ``ipc_base`` is the
    folder the run folder goes under (None: ``cluster.ipc_dir``, else the system temp folder),
    named ``ipc_base_key`` in the problems (``--ipc-dir`` when the command line gave it)."""
    problems: list[Problem] = []
    for index, model in enumerate(config.models):
        problems += check_model(f"models[{index}]", model)
    problems += check_devices(config)
    problems += check_memory(config)
    problems += _check_explicit_binds(config)
    if config.scheduler.standby and config.scheduler.shards > 0:
        # The standby replaces the one embedded scheduler process; a pair per shard plus one
        # for the rank is not built (docs/runtime.md, "Hot spare").
        problems.append(Problem("scheduler.standby",
                                "needs scheduler.shards = 0 (a hot spare replaces the one "
                                f"embedded scheduler process), got shards = "
                                f"{config.scheduler.shards}"))
    problems += check_security(config)
    if config.transport == "ipc":
        base = ipc_base or config.ipc_dir or tempfile.gettempdir()
        problems += _check_run_folder(config, base, ipc_base_key)
    else:
        problems += _probe_tcp_binds(_generated_tcp_hosts(config))
    return problems


def check_model(key: str, model: ModelConfig) -> list[Problem]:
    """The model's file or built-in name, and its profile file."""
    problems: list[Problem] = []
    if model.onnx is not None:
        problem = _onnx_problem(model.name, model.onnx)
        if problem:
            problems.append(Problem(f"{key}.onnx", problem))
    if model.builtin is not None and model.builtin not in builtin_names():
        problems.append(Problem(
            f"{key}.builtin",
            f"unknown built-in model {model.builtin!r} (built-in: {', '.join(builtin_names())})",
        ))
    files = [("profile", model.profile)] if model.profile is not None else []
    files += [(f"profiles.{kind}", path) for kind, path in (model.profiles or {}).items()]
    for subkey, path in files:
        problem = _file_problem(path)
        if not problem:
            try:
                profile_from_file(model, path)
            except (OSError, ValueError) as exc:
                problem = _one_line(exc)
        if problem:
            problems.append(Problem(f"{key}.{subkey}", problem))
    return problems


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= REASON_MAX_CHARS else text[: REASON_MAX_CHARS - 3] + "..."


def _file_problem(path: str) -> str | None:
    if not os.path.exists(path):
        return f"no such file: {path}"
    if not os.path.isfile(path):
        return f"not a file: {path}"
    if not os.access(path, os.R_OK):
        return f"not readable: {path}"
    return None


def _onnx_problem(name: str, path: str) -> str | None:
    """Why ``path`` cannot serve as model ``name``, or None: the backend's own signature reader
    (``onnx`` only, no ONNX Runtime, external weights not loaded) parses it and applies the
    executor's checks (a dynamic batch dimension, tensor types). ONNX Runtime judges the
    operators only when a backend loads it."""
    problem = _file_problem(path)
    if problem:
        return problem
    try:
        signature = read_signature(path, name)
    except ModelLoadError as exc:
        return _one_line(exc)
    # Protobuf parses many byte strings as an empty message: a model with nothing to feed.
    if not signature.inputs or not signature.outputs:
        return f"not an ONNX model: {path} (no inputs or outputs)"
    return None


def check_devices(config: ClusterConfig) -> list[Problem]:
    """Each model against the devices of the backends (every backend loads every model): an
    emulated model runs only on an emulated device (ONNX Runtime runs ``onnx`` and ``builtin``
    models on ``cpu`` and ``cuda:N``), and an emulated device needs each model's l(b) (its
    emulated alpha/beta or a profile file; backends/host.py ``build_executor``)."""
    backends = config.backends
    devices = ([(f"backends.devices[{i}]", device) for i, device in enumerate(backends.devices)]
               if backends.devices else [("backends.device", backends.device)])
    onnx_runtime = ", ".join(f'{key} is "{device}"' for key, device in devices
                             if device != EMULATED_DEVICE)
    emulated = ", ".join(key for key, device in devices if device == EMULATED_DEVICE)
    problems: list[Problem] = []
    for index, model in enumerate(config.models):
        key = f"models[{index}].{model.kind}"
        if model.kind == "emulated" and onnx_runtime:
            problems.append(Problem(key, (
                f"model {model.name!r} is emulated, which only a backend with device = "
                f'"{EMULATED_DEVICE}" runs, but {onnx_runtime} (ONNX Runtime, for onnx and '
                "builtin models)")))
        elif model.kind != "emulated" and emulated and model.profile is None and not all(
                backends.kind_of(i) in (model.profiles or {}) for i in range(backends.total)):
            problems.append(Problem(key, (
                f"model {model.name!r} has no l(b) for the emulated device of {emulated}: "
                "give it a profile file (models[].profile, or one for every backend's kind: "
                "models[].profiles), or a cpu or cuda device")))
    return problems


def check_memory(config: ClusterConfig) -> list[Problem]:
    """``[backends] memory``: the models each backend loads at start (its ``startup_models_of``:
    weights + the largest activations, ``zserve.orchestrator.memory``) within the budget, or
    one line for the first backend overcommitted.
    A model's memory is ``memory.configured_memory``'s (declared, else the zoo's figures, else
    its onnx file's size as weights); a model none of them knows is a problem."""
    budget_setting = config.backends.memory
    if budget_setting is None:
        return []
    if isinstance(budget_setting, str):
        try:
            budget = device_budget_bytes(budget_setting)
        except UnknownDeviceKindError as exc:
            return [Problem("backends.memory", str(exc))]
    else:
        budget = round(budget_setting * GIB_BYTES)
    problems: list[Problem] = []
    memories: dict[str, ModelMemory] = {}
    index = {m.name: i for i, m in enumerate(config.models)}
    for model in config.startup_models:
        memory = configured_memory(model, onnx_file_bytes(model))
        if memory is None:
            problems.append(Problem(f"models[{index.get(model.name, '?')}].memory_mib",
                                    f"model {model.name!r}: declare its weights in MiB to "
                                    "check them against backends.memory"))
            continue
        memories[model.name] = memory
    for i in range(config.backends.total):
        backend = process_name("backend", i)
        held = [memories[m.name] for m in config.startup_models_of(backend)
                if m.name in memories]
        error = overcommit_error(backend, budget, held) if held else None
        if error is not None:
            problems.append(Problem("backends.memory", error))
            break  # one line: the first backend over its budget
    return problems


def bound_addresses(config: ClusterConfig) -> list[tuple[str, str]]:
    """``(key path, address)`` of every address cluster.toml names that a process binds: the
    ZeroMQ ones (``ClusterConfig.explicit_bind_keys``), then each frontend's HTTP, gRPC and
    metrics ``host:port``."""
    frontends = config.frontends
    http = [(f"frontends.{name}[{i}]", address)
            for name in HTTP_ADDRESS_KEYS
            for i, address in enumerate(getattr(frontends, name)[:frontends.count])]
    return config.explicit_bind_keys() + http


def _endpoint(address: str) -> tuple[str, ...]:
    """What two addresses must differ in: ``("tcp", host, port)`` for ``tcp://host:port`` and
    ``host:port`` alike, else the scheme and the path."""
    scheme, separator, rest = address.partition("://")
    if not separator:  # host:port
        scheme, rest = "tcp", address
    if scheme != "tcp":
        return (scheme, rest)
    host, _, port = rest.rpartition(":")
    return ("tcp", host.removeprefix("[").removesuffix("]"), port)


def _check_explicit_binds(config: ClusterConfig) -> list[Problem]:
    """Duplicates, then each ipc path's length and folder, then a bind probe of each tcp one."""
    problems: list[Problem] = []
    first_key: dict[tuple[str, ...], str] = {}
    to_probe: list[tuple[str, str]] = []
    for key, address in bound_addresses(config):
        endpoint = _endpoint(address)
        if endpoint in first_key:
            problems.append(Problem(key, f"same address as {first_key[endpoint]}: {address}"))
            continue
        if endpoint[0] != "tcp" or endpoint[2] != "0":  # port 0: a new port each time
            first_key[endpoint] = key
        if address.startswith(IPC_SCHEME):
            problems += _check_ipc_path(key, address[len(IPC_SCHEME):])
        elif endpoint[0] == "tcp":
            to_probe.append((key, address))
    return problems + _probe_tcp_binds(to_probe)


def _check_ipc_path(key: str, path: str) -> list[Problem]:
    if path.startswith("@"):  # Linux abstract namespace: no file, no folder
        return []
    problems: list[Problem] = []
    size = len(os.fsencode(path))
    if size > IPC_PATH_MAX_BYTES:
        problems.append(Problem(
            key, f"ipc path is {size} bytes, over the {IPC_PATH_MAX_BYTES}-byte limit: {path}"
        ))
    folder_problem = _folder_problem(os.path.dirname(path) or ".")
    if folder_problem:
        problems.append(Problem(key, folder_problem))
    return problems


def _folder_problem(folder: str) -> str | None:
    if not os.path.isdir(folder):
        return f"no such folder: {folder}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"folder not writable: {folder}"
    return None


def _check_run_folder(config: ClusterConfig, base: str, key: str) -> list[Problem]:
    """The folder the run folder is made in, and the longest ipc path the cluster would use."""
    folder_problem = _folder_problem(base)
    if folder_problem:
        return [Problem(key, folder_problem)]
    run_dir = os.path.join(base, RUN_DIR_PLACEHOLDER)
    generated = [
        address[len(IPC_SCHEME):]
        for role, _, index in config.process_names()
        for address in config.bind_addresses(role, index, run_dir).values()
        if address.startswith(f"{IPC_SCHEME}{run_dir}/")
    ]
    longest = max(generated, key=lambda path: len(os.fsencode(path)), default=None)
    if longest is None or len(os.fsencode(longest)) <= IPC_PATH_MAX_BYTES:
        return []
    return [Problem(key, (
        f"ipc paths under {base} would be up to {len(os.fsencode(longest))} bytes, over the "
        f"{IPC_PATH_MAX_BYTES}-byte limit ({longest}); use a shorter folder"
    ))]


def is_loopback_host(host: str) -> bool:
    """Whether a bind host is reachable from this machine only (127.0.0.0/8, ::1, localhost);
    a host name other than localhost counts as reachable from elsewhere."""
    host = host.removeprefix("[").removesuffix("]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_security(config: ClusterConfig) -> list[Problem]:
    """Without CURVE keys, each tcp bind on a non-loopback host, unless ``security.insecure``
    says so in so many words; with keys, each key file the cluster needs that is missing,
    malformed or readable by others; keys or not, each HTTP/gRPC endpoint on a non-loopback
    host (they have no authentication), unless ``security.insecure``."""
    security = config.security
    problems = [] if security.insecure else _open_http_endpoints(config)
    if security.curve:
        roles = {"supervisor", "shard", "backend", "frontend"}
        if config.scheduler.shards > 0:
            roles.add("rank")
        return problems + [Problem(key, problem) for key, problem in key_problems(security, roles)]
    if security.insecure:
        return []
    binds = [(key, address) for key, address in config.explicit_bind_keys()
             if address.startswith(TCP_SCHEME)]
    if config.transport == "tcp":
        binds += _generated_tcp_hosts(config)
    for key, address in binds:
        host = address[len(TCP_SCHEME):].rpartition(":")[0]
        if not is_loopback_host(host):
            problems.append(Problem(key, (
                f"{address} is reachable from other hosts but [security] has no keys_dir: "
                "run `zserve keys init` and set security.keys_dir (CURVE), or set "
                "security.insecure = true"
            )))
    return problems


def _open_http_endpoints(config: ClusterConfig) -> list[Problem]:
    """The frontends' HTTP and gRPC endpoints (Open Inference Protocol, Prometheus) have no
    authentication of their own (CURVE covers ZeroMQ links only): one on a non-loopback host
    is refused unless ``security.insecure`` says so, keys or not (put an authenticating,
    TLS-terminating proxy in front, or bind loopback)."""
    frontends = config.frontends
    endpoints = [(f"frontends.{name}[{i}]", address)
                 for name, addresses in (("http_addresses", frontends.http_addresses),
                                         ("grpc_addresses", frontends.grpc_addresses),
                                         ("metrics_addresses", frontends.metrics_addresses))
                 for i, address in enumerate(addresses)]
    return [Problem(key, (
        f"{address} is reachable from other hosts and its HTTP/gRPC endpoint has no "
        "authentication: bind loopback behind an authenticating proxy, or set "
        "security.insecure = true"
    )) for key, address in endpoints if not is_loopback_host(address.rpartition(":")[0])]


def _generated_tcp_hosts(config: ClusterConfig) -> list[tuple[str, str]]:
    """``(key, tcp://host:0)`` for each host the cluster binds kernel-chosen ports on."""
    hosts = [("cluster.host", f"{TCP_SCHEME}{config.host}:0")]
    if config.backends.host and config.backends.host != config.host:
        hosts.append(("backends.host", f"{TCP_SCHEME}{config.backends.host}:0"))
    return hosts


def _probe_tcp_binds(targets: list[tuple[str, str]]) -> list[Problem]:
    """Bind each address as its process will (ZeroMQ for ``tcp://``, a listening socket for a
    ``host:port``), alone, and release it: one another program holds cannot be bound. Then
    bind those that share a port all at once: two keys naming one port under different names
    (a wildcard and a host, ``localhost`` and ``127.0.0.1``) collide there as in the cluster.
    Every probe is released before the supervisor spawns anything."""
    problems: list[Problem] = []
    free: list[tuple[str, str]] = []
    for key, address in targets:
        with _BindProbes() as probes:
            reason = probes.bind(address)
        if reason is None:
            free.append((key, address))
        else:
            problems.append(Problem(key, f"cannot bind {address}: {reason}"))
    ports = [_endpoint(address)[2] for _, address in free]
    shared = [(key, address) for key, address in free
              if _endpoint(address)[2] != "0" and ports.count(_endpoint(address)[2]) > 1]
    held: list[tuple[str, str]] = []
    with _BindProbes() as probes:
        for key, address in shared:
            if probes.bind(address) is None:
                held.append((key, address))
                continue
            other_key, other = next((k, a) for k, a in held
                                    if _endpoint(a)[2] == _endpoint(address)[2])
            problems.append(Problem(key, f"same port as {other_key} ({other}): {address}"))
    return problems


class _BindProbes:
    """Sockets bound to probe addresses, all released on exit (destroying the ZeroMQ context
    waits for its I/O thread to close the listeners)."""

    def __init__(self) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._probes: list[zmq.Socket[bytes]] = []
        self._sockets: list[socket.socket] = []

    def __enter__(self) -> _BindProbes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sock in self._sockets:
            sock.close()
        for probe in self._probes:
            probe.close(linger=0)
        if self._context is not None:
            self._context.destroy(linger=0)

    def bind(self, address: str) -> str | None:
        """Bind and keep ``address``; why it cannot be bound, or None."""
        if address.startswith(TCP_SCHEME):
            if self._context is None:
                self._context = zmq.Context()
            probe = self._context.socket(zmq.ROUTER)
            self._probes.append(probe)
            probe.setsockopt(zmq.LINGER, 0)
            try:
                probe.bind(address)
            except zmq.ZMQError as exc:
                # os.strerror: pyzmq's own text repeats the address.
                return os.strerror(exc.errno) if exc.errno else str(exc)
            return None
        return self._bind_listener(address)

    def _bind_listener(self, address: str) -> str | None:
        """A listening socket on each address ``host`` resolves to, with SO_REUSEADDR as
        aiohttp, gRPC and the metrics server set it (a port in TIME_WAIT is free to them). A
        port in use on any of them is a problem; an address family this host lacks (``::1``
        for ``localhost`` without IPv6) only when no address binds at all."""
        host, _, port = address.rpartition(":")
        try:
            resolved = socket.getaddrinfo(host.removeprefix("[").removesuffix("]"), int(port),
                                          type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            return f"cannot resolve {host}: {exc.strerror}"
        unbound: str | None = None
        bound = False
        for family, kind, protocol, _, sockaddr in dict.fromkeys(resolved):
            listener = socket.socket(family, kind, protocol)
            self._sockets.append(listener)
            with contextlib.suppress(OSError):
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                listener.bind(sockaddr)
                listener.listen()
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    return exc.strerror or str(exc)
                unbound = exc.strerror or str(exc)
            else:
                bound = True
        return None if bound else unbound
