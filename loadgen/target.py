"""The target a live run drives: where requests go, what they carry, who answers for stats.

``open_target(spec, workload, ...)`` yields a ``Target`` for a cluster started here from a
``cluster.toml`` (``target_for_cluster``: stats over the supervisor's control link, its process
ids for CPU accounting) or for one already running at a frontend's client address (its stats
from that frontend: ``frontend_stats_reader``). Workload models are matched to the cluster's by
name (``match_models``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zserve.client.cluster_stats import FRONTEND_AT_ADDRESS, frontend_stats_reader
from zserve.config.cluster import ModelConfig
from zserve.config.policy_names import DEFAULT_KEEP_TOLERANCE
from zserve.config.signature import ModelSignature
from zserve.loadgen.stats_poller import STATS_REPLY_TIMEOUT_S
from zserve.loadgen.workload import Workload
from zserve.transport.messages import TensorMap

log = logging.getLogger(__name__)


@dataclass
class Target:
    """Where requests go, what each model's requests carry, and who answers StatsRequest."""

    client_address: str
    inputs: dict[str, TensorMap]  # by workload model name
    model_names: dict[str, str]  # workload model name -> cluster model name
    stats_addresses: dict[str, str]  # process name -> address answering StatsRequest
    # A process's StatsReply over the supervisor's control link (in-process clusters only), and
    # the processes worth asking: the one hosting the RankThread, and the frontends.
    control_stats: Callable[[str], dict[str, Any]] | None = None
    rank_process: str | None = None
    frontends: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)  # scheduler shard processes (hop breakdown)
    allowances_ms: dict[str, float] | None = None  # d_ctrl, d_data, reply (the cluster's)
    keep_tolerance: float | None = None  # the window drop's (the cluster's scheduler)
    gpus: int | None = None
    policy: str | None = None
    drop: str | None = None
    notes: list[str] = field(default_factory=list)
    # Every frontend's client address (the generator's workers spread over them); the first is
    # ``client_address``.
    client_addresses: list[str] = field(default_factory=list)
    # The cluster's process ids by name (in-process clusters only), for CPU accounting.
    pids: Callable[[], dict[str, int | None]] | None = None
    # Each frontend's Open Inference Protocol servers (host:port), by server ("http", "grpc").
    oip_addresses: dict[str, list[str]] = field(default_factory=dict)

    def addresses_for(self, protocol: str) -> list[str]:
        """Where a load generator sending by ``protocol`` (``native``, ``http-json``,
        ``http-binary``, ``grpc``) sends: every frontend that serves it."""
        if protocol == "native":
            return self.client_addresses or [self.client_address]
        server = "grpc" if protocol == "grpc" else "http"
        addresses = self.oip_addresses.get(server, [])
        if not addresses:
            raise ValueError(f"protocol {protocol}: the cluster serves no OIP {server} (set "
                             f"[frontends] {server}_addresses in its cluster.toml)")
        return addresses


def _example_inputs(signature: Any) -> TensorMap:
    """One request's inputs for a ModelSignature: zeros of shape (1, *sample shape)."""
    tensors: TensorMap = {}
    for spec in signature.inputs:
        shape = (1, *(1 if d is None else int(d) for d in spec.shape))
        tensors[spec.name] = np.zeros(shape, dtype=np.dtype(spec.dtype))
    return tensors


def match_models(
    workload: Workload, cluster_names: list[str], model_map: dict[str, str]
) -> dict[str, str]:
    by_lower: dict[str, list[str]] = {}
    for name in cluster_names:
        by_lower.setdefault(name.lower(), []).append(name)
    matched: dict[str, str] = {}
    for model in workload.models:
        if model.name in model_map:
            target = model_map[model.name]
        elif model.name in cluster_names:
            target = model.name
        elif len(by_lower.get(model.name.lower(), [])) == 1:
            target = by_lower[model.name.lower()][0]
        else:
            raise ValueError(
                f"workload model {model.name!r} is not served by the cluster (models: "
                f"{', '.join(cluster_names)}); use --model-map {model.name}=NAME"
            )
        if target not in cluster_names:
            raise ValueError(f"--model-map names {target!r}, which the cluster does not serve")
        matched[model.name] = target
    return matched


def config_signature(config: ModelConfig) -> ModelSignature | None:
    """The signature of a cluster file's model, read here without ONNX Runtime (the load
    generator builds each request's inputs from it), or None when it cannot be read here."""
    try:
        if config.kind == "emulated":
            from zserve.backends.emulated import EmulatedModel

            assert config.alpha_ms is not None and config.beta_ms is not None
            return EmulatedModel(
                config.name, config.alpha_ms, config.beta_ms, max_batch=config.max_batch,
                input_shape=config.input_shape, input_dtype=config.input_dtype,
                output_shape=config.output_shape,
            ).signature
        from zserve.backends.builtin import ensure_builtin
        from zserve.backends.onnx_executor import read_signature

        path = ensure_builtin(config.builtin) if config.builtin else config.onnx
        assert path is not None
        return read_signature(path, config.name)
    except Exception as exc:  # any unreadable model: the requests then carry no inputs
        log.warning("model %s: no signature here (%s)", config.name, exc)
        return None


def target_from_config(
    config: Any, client_address: str, stats_addresses: dict[str, str], workload: Workload,
    model_map: dict[str, str],
) -> Target:
    names = match_models(workload, [m.name for m in config.models], model_map)
    inputs: dict[str, TensorMap] = {}
    notes: list[str] = []
    for wname, cname in names.items():
        signature = config_signature(config.model(cname))
        if signature is None:
            notes.append(f"no signature for {cname}: requests carry no inputs")
            inputs[wname] = {}
        else:
            inputs[wname] = _example_inputs(signature)
    return Target(
        client_address=client_address,
        inputs=inputs,
        model_names=names,
        stats_addresses=stats_addresses,
        gpus=config.backends.total,
        allowances_ms={
            "d_ctrl": config.scheduler.d_ctrl_ms,
            "d_data": config.scheduler.d_data_ms,
            "reply": config.frontends.reply_allowance_ms,
            "jitter": config.scheduler.jitter_ms,
        },
        policy=config.scheduler.policy,
        drop=config.scheduler.drop,
        keep_tolerance=getattr(config.scheduler, "keep_tolerance", DEFAULT_KEEP_TOLERANCE),
        notes=notes,
    )


def at_address(target: Target) -> Target:
    """A cluster at an address: its rank counters and queueing delay come from its frontend."""
    target.control_stats = frontend_stats_reader(target.client_address)
    target.rank_process = "rank"
    target.frontends = [FRONTEND_AT_ADDRESS]
    return target


def backend_addresses(peers: dict[str, str]) -> dict[str, str]:
    """``backend-i/plan`` entries of a peer map: backends answer StatsRequest on that socket."""
    return {
        key.rpartition("/")[0]: address
        for key, address in sorted(peers.items())
        if key.startswith("backend-") and key.endswith("/plan") and not address.endswith(":0")
    }


def recorded_oip_addresses(client_address: str, config: Any) -> dict[str, list[str]]:
    """Where the running cluster with a frontend at ``client_address`` serves the Open Inference
    Protocol: as its state file records them (`zserve up` writes the ports the kernel picked for
    a configured port 0), else as ``config`` names them where it names a port."""
    from zserve.cluster.cli import recorded_state

    recorded = recorded_state(client_address).get("oip_addresses")
    if isinstance(recorded, dict):
        return {str(server): [str(a) for a in addresses]
                for server, addresses in recorded.items()}
    return {server: [a for a in getattr(config.frontends, f"{server}_addresses")
                     if not a.endswith(":0")]
            for server in ("http", "grpc")}


@contextlib.contextmanager
def open_target(
    spec: str, workload: Workload, *, cluster_config: str | None, model_map: dict[str, str]
) -> Iterator[Target]:
    """A running cluster to drive: started here from a cluster.toml, or one at an address."""
    from zserve.config.cluster import load_config

    if "://" in spec:
        if cluster_config is None:
            yield at_address(Target(
                client_address=spec,
                inputs={m.name: {} for m in workload.models},
                model_names={m.name: m.name for m in workload.models},
                stats_addresses={},
                notes=["no --cluster config: requests carry no inputs"],
            ))
            return
        config = load_config(cluster_config)
        peers = config.static_peers(config.ipc_dir)
        target = target_from_config(config, spec, backend_addresses(peers), workload, model_map)
        target.oip_addresses = recorded_oip_addresses(spec, config)
        yield at_address(target)
        return
    config = load_config(spec)
    from zserve.cluster import supervisor

    with supervisor.Cluster(config) as cluster:
        yield target_for_cluster(cluster, config, workload, model_map)


def target_for_cluster(
    cluster: Any, config: Any, workload: Workload, model_map: dict[str, str]
) -> Target:
    """The target of a cluster running in this process (a ``zserve.cluster.supervisor.Cluster``
    started from ``config``): every frontend, stats over the supervisor's control link, and the
    processes' ids for CPU accounting."""
    peers = dict(cluster.supervisor.peers) if cluster.supervisor is not None else {}
    target = target_from_config(
        config, cluster.client_address, backend_addresses(peers), workload, model_map
    )
    target.client_addresses = list(cluster.client_addresses)
    target.control_stats = lambda name: cluster.stats(name, timeout=STATS_REPLY_TIMEOUT_S)
    target.rank_process = "rank" if config.scheduler.shards > 0 else "shard-0"
    target.frontends = [n for r, n, _ in config.process_names() if r == "frontend"]
    target.shards = [n for r, n, _ in config.process_names() if r == "shard"]
    target.pids = cluster.pids
    target.oip_addresses = {"http": list(cluster.http_addresses),
                            "grpc": list(cluster.grpc_addresses)}
    return target
