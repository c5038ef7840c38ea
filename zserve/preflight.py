"""Preflight: every checkable problem of a cluster config, found before any process is spawned.

Schema problems stop ``load_config``; what it cannot see needs the file system and the network:
model files that are missing, do not parse or cannot be batched (the backend's signature
reader: ``onnx`` without ONNX Runtime and without external data), unknown built-in names,
profile files that are missing, do not parse or lack the model, bind addresses that cannot be
bound right now (each tcp address cluster.toml names is bound and closed; port 0 is not
probed), ipc paths over the socket path limit or in a missing folder, an address named
twice, a tcp bind on a non-loopback host without CURVE keys (unless ``security.insecure``), and
key files that are missing, malformed or readable by other users (docs/security.md).
``check_cluster`` returns them all, each naming its key path; ``preflight`` raises
``PreflightError`` with them. The supervisor runs it first thing, so a bad file costs one line
per problem instead of tracebacks from processes that already started.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import zmq

from zserve.backends.builtin import builtin_names
from zserve.backends.executor import ModelLoadError
from zserve.backends.onnx_executor import read_signature
from zserve.config import ClusterConfig, ModelConfig
from zserve.keys import key_problems
from zserve.profiles import configured_profile

# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
IPC_PATH_MAX_BYTES = 107
# What tempfile.mkdtemp(prefix="zs-") names the run folder: the prefix and 8 random characters.
RUN_DIR_PLACEHOLDER = "zs-xxxxxxxx"
# A library's error text is cut to this, so each problem stays one readable line.
REASON_MAX_CHARS = 400
IPC_SCHEME = "ipc://"
TCP_SCHEME = "tcp://"
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


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
    if model.profile is not None:
        problem = _file_problem(model.profile)
        if not problem:
            try:
                configured_profile(model)
            except (OSError, ValueError) as exc:
                problem = _one_line(exc)
        if problem:
            problems.append(Problem(f"{key}.profile", problem))
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


def _check_explicit_binds(config: ClusterConfig) -> list[Problem]:
    """Duplicates, then each ipc path's length and folder, then a bind probe of each tcp one."""
    problems: list[Problem] = []
    first_key: dict[str, str] = {}
    to_probe: list[tuple[str, str]] = []
    for key, address in config.explicit_bind_keys():
        if address in first_key:
            problems.append(Problem(key, f"same address as {first_key[address]}: {address}"))
            continue
        first_key[address] = key
        if address.startswith(IPC_SCHEME):
            problems += _check_ipc_path(key, address[len(IPC_SCHEME):])
        elif address.startswith(TCP_SCHEME) and not address.endswith(":0"):
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
    """Bind each address with ZeroMQ, as the roles will, then close them all. The sockets stay
    bound until every probe is done, so two names of one port (a wildcard and a host) collide
    here as they would in the cluster; destroying the context releases the ports before the
    supervisor spawns anything."""
    if not targets:
        return []
    problems: list[Problem] = []
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for key, address in targets:
            probe = context.socket(zmq.ROUTER)
            probe.setsockopt(zmq.LINGER, 0)
            try:
                probe.bind(address)
            except zmq.ZMQError as exc:
                # os.strerror: pyzmq's own text repeats the address.
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
                problems.append(Problem(key, f"cannot bind {address}: {reason}"))
    finally:
        context.destroy(linger=0)
    return problems
