"""``zserve bench``: open-loop load on a live cluster, goodput search, and the generator's ceiling.

::

    zserve bench CLUSTER.toml|ADDRESS WORKLOAD.toml [--rate R | --search goodput [--repeat N]]
                 [--steps 10:2000,10:4000 | --trace RATES.txt] [--workers N|auto]
                 [--json OUT] [--plots DIR] [--records OUT.npz] [--max-lateness-ms 5]
    zserve bench --max-rate-check [--workers N] [--json OUT]

The first argument is a ``cluster.toml`` (the cluster is started in-process for the run and
stopped after it) or the ``client`` address of a frontend already running (``tcp://...``,
``ipc://...``); with an address, ``--cluster CLUSTER.toml`` names its config so that requests get
the right input tensors and the backends can be asked for statistics, and ``--stats
NAME=ADDRESS`` adds any process that answers ``StatsRequest`` as a backend's plan socket does.
The rank's counters and the queueing delay of a cluster at an address come from its frontend:
``ClusterStatsRequest`` on its client socket answers with the frontend's stats and those
of the scheduler processes and backends it talks to (``frontend_stats_reader``).

The load is the workload file's (models, SLOs, popularity, arrival process, warmup / measure /
cooldown, seed); ``--rate`` replaces its rate, ``--steps`` or ``--trace`` its constant rate over
the measure window (warmup and cooldown run at the first and last rate). ``--search goodput``
bisects the total rate (``zserve.loadgen.search``) for the highest one whose worst per-model bad
rate is <= ``--max-bad-rate`` (1%), to ``--precision`` (1%), starting from the analytic bound;
a probe certain to fail stops early (``BailRule``), and a probe the generator could not
keep up with is retried once, then ends the search (exit 3). ``--repeat N`` runs N searches on
the same cluster and reports the median one, with every search's goodput under ``repeats``: on
a shared host one search can differ from the next by a third, so one search is an anecdote.

Statistics come over the wire, never from guesses in the client: every backend is asked
``StatsRequest(reset=True)`` once a second (batch sizes and run times of its batches: the batch
size distribution, overall and per model, GPU busy fraction and GPUs in use per second); the
rank's counters and the frontends' queueing delay (batch start on the backend - admission,
overall and per model) are read at the measure window's start and end: over the supervisor's
control link for a cluster started here, from the frontend's client socket for one at an
address. What could not be had is listed under ``stats.missing`` in the report.

Workload models are matched to the cluster's by name (exactly, else case-insensitively, else by
``--model-map WORKLOAD_NAME=CLUSTER_NAME``). The report (``--json``) has the schema of
``zserve.loadgen.report``, the same keys as ``zserve sim`` on the same workload file, plus a
``generator`` section (its lateness, workers), a ``timeline`` of per-second figures and
``latency_cdf_ms`` per model. ``--max-rate-check`` finds the highest rate this machine's generator
sustains within the lateness bound against a zero-delay echo server (``zserve.loadgen.echo``).

Exit status: 0 on success; 2 on a usage, workload or config error; 3 when the generator fell
behind its schedule (the run is refused: the figure would describe the generator).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from zserve import procutil
from zserve.idle_poll import IdlePollers
from zserve.loadgen import breakdown, schedules
from zserve.loadgen.generator import (
    DEFAULT_LATENESS_BOUND_MS,
    BailRule,
    GeneratorBehindError,
    GeneratorError,
    LoadPlan,
    Outcome,
    RunResult,
    plan_for_workload,
    run_load,
)
from zserve.loadgen.report import ModelOutcome, build_report, set_fraction_of_bound, summary_text
from zserve.loadgen.search import search_goodput
from zserve.loadgen.workload import ArrivalSpec, Workload, load_workload
from zserve.scheduler.policy import DEFAULT_KEEP_TOLERANCE
from zserve.transport import codec
from zserve.transport.messages import ClusterStatsRequest, StatsReply, StatsRequest, TensorMap
from zserve.transport.sockets import make_dealer

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_BEHIND = 3

# The mark at which every process's hop statistics are taken: after the last measured request's
# deadline (the window's end + the largest SLO + this margin), or at the run's end if sooner.
HOPS_MARK = "hops"
HOPS_MARK_MARGIN_S = 0.05
# Scheduler statistics are polled from every backend once per interval, aligned to the run's
# start, with reset: each reply covers exactly one interval, which gives the per-second timeline
# and, summed over the measure window, the window's batch sizes and GPU busy time.
STATS_INTERVAL_S = 1.0
STATS_REPLY_TIMEOUT_S = 0.5
# Rate a single worker is assumed to sustain when --workers auto picks a count (see
# --max-rate-check for this machine's figure).
AUTO_WORKER_RATE_RPS = 2000.0
MAX_RATE_CHECK_S = 2.0
# A search probe must plan at least this many measured requests (a 1% bad rate needs 100).
MIN_MEASURED_REQUESTS = 100


# --------------------------------------------------------------------------- target


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


def _example_inputs(signature: Any) -> TensorMap:
    """One request's inputs for a ModelSignature: zeros of shape (1, *sample shape)."""
    tensors: TensorMap = {}
    for spec in signature.inputs:
        shape = (1, *(1 if d is None else int(d) for d in spec.shape))
        tensors[spec.name] = np.zeros(shape, dtype=np.dtype(spec.dtype))
    return tensors


def _config_signature(config: Any) -> Any:
    """The ``ModelSignature`` of a cluster file's model (read without ONNX Runtime), or None
    when it cannot be read here."""
    try:
        if config.kind == "emulated":
            from zserve.backends.emulated import EmulatedModel

            return EmulatedModel(
                config.name, config.alpha_ms, config.beta_ms, max_batch=config.max_batch,
                input_shape=config.input_shape, input_dtype=config.input_dtype,
                output_shape=config.output_shape,
            ).signature
        from zserve.backends.builtin import ensure_builtin
        from zserve.backends.onnx_executor import read_signature

        return read_signature(ensure_builtin(config.builtin) if config.builtin else config.onnx,
                              config.name)
    except Exception:
        return None


def _match_models(
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


def _target_from_config(
    config: Any, client_address: str, stats_addresses: dict[str, str], workload: Workload,
    model_map: dict[str, str],
) -> Target:
    names = _match_models(workload, [m.name for m in config.models], model_map)
    inputs: dict[str, TensorMap] = {}
    notes: list[str] = []
    for wname, cname in names.items():
        signature = _config_signature(config.model(cname))
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


# The frontend at the address a bench drives, as a name in Target.frontends (its stats come
# from its client socket, with those of its peers: see frontend_stats_reader).
FRONTEND_AT_ADDRESS = "frontend"
# How long a frontend may take to gather its peers' stats (its own bound, 0.5 s, plus slack).
CLUSTER_STATS_TIMEOUT_S = 1.0
# Names asked of one frontend within this long share its answer (the names of one mark).
CLUSTER_STATS_REUSE_S = 0.2


def frontend_stats_reader(address: str) -> Callable[[str], dict[str, Any]]:
    """``control_stats`` for a cluster at an address: asks its frontend's client socket
    ``ClusterStatsRequest(reset=False)``; the frontend answers with its own stats and those of
    the shards, rank and backends it talks to. ``FRONTEND_AT_ADDRESS`` names the frontend
    itself; ``"rank"`` falls back to ``"shard-0"`` (a scheduler embedding the rank). One answer
    serves the names asked within CLUSTER_STATS_REUSE_S (one mark); a server that did not answer
    once (not a zserve frontend) is not asked again."""
    counter = iter(range(1 << 30))
    last: list[tuple[float, dict[str, Any]]] = []
    silent = False

    def ask() -> dict[str, Any]:
        nonlocal silent
        if silent:
            raise TimeoutError(f"the server at {address} does not answer ClusterStatsRequest")
        if last and time.monotonic() - last[0][0] < CLUSTER_STATS_REUSE_S:
            return last[0][1]
        ctx: zmq.Context[Any] = zmq.Context.instance()
        identity = f"loadgen-cstats-{os.getpid()}-{next(counter)}".encode()
        sock = make_dealer(ctx, address, identity=identity)
        try:
            sock.send_multipart(codec.encode(ClusterStatsRequest(reset=False)), copy=False)
            if not sock.poll(int(CLUSTER_STATS_TIMEOUT_S * 1e3)):
                silent = True
                raise TimeoutError(f"no StatsReply from the frontend at {address}")
            msg = codec.decode(sock.recv_multipart(copy=False))
        finally:
            sock.close(linger=0)
        if not isinstance(msg, StatsReply):
            raise TypeError(f"{type(msg).__name__} instead of a StatsReply from {address}")
        last[:] = [(time.monotonic(), dict(msg.stats))]
        return last[0][1]

    def read(name: str) -> dict[str, Any]:
        stats = ask()
        if name == FRONTEND_AT_ADDRESS:
            return stats
        cluster = stats.get("cluster") or {}
        for candidate in (name, "shard-0") if name == "rank" else (name,):
            if isinstance(cluster.get(candidate), dict):
                return dict(cluster[candidate])
        raise KeyError(f"the frontend at {address} has no stats of {name!r}")

    return read


def _at_address(target: Target) -> Target:
    """A cluster at an address: its rank counters and queueing delay come from its frontend."""
    target.control_stats = frontend_stats_reader(target.client_address)
    target.rank_process = "rank"
    target.frontends = [FRONTEND_AT_ADDRESS]
    return target


def _backend_addresses(peers: dict[str, str]) -> dict[str, str]:
    """``backend-i/plan`` entries of a peer map: backends answer StatsRequest on that socket."""
    return {
        key.rpartition("/")[0]: address
        for key, address in sorted(peers.items())
        if key.startswith("backend-") and key.endswith("/plan") and not address.endswith(":0")
    }


@contextlib.contextmanager
def open_target(
    spec: str, workload: Workload, *, cluster_config: str | None, model_map: dict[str, str]
) -> Iterator[Target]:
    """A running cluster to drive: started here from a cluster.toml, or one at an address."""
    from zserve.config import load_config

    if "://" in spec:
        if cluster_config is None:
            yield _at_address(Target(
                client_address=spec,
                inputs={m.name: {} for m in workload.models},
                model_names={m.name: m.name for m in workload.models},
                stats_addresses={},
                notes=["no --cluster config: requests carry no inputs"],
            ))
            return
        config = load_config(cluster_config)
        peers = config.static_peers(config.ipc_dir)
        yield _at_address(
            _target_from_config(config, spec, _backend_addresses(peers), workload, model_map)
        )
        return
    config = load_config(spec)
    from zserve import supervisor

    with supervisor.Cluster(config) as cluster:
        peers = dict(cluster.supervisor.peers) if cluster.supervisor is not None else {}
        target = _target_from_config(
            config, cluster.client_address, _backend_addresses(peers), workload, model_map
        )
        target.client_addresses = list(cluster.client_addresses)
        target.control_stats = lambda name: cluster.stats(name, timeout=STATS_REPLY_TIMEOUT_S)
        target.rank_process = "rank" if config.scheduler.shards > 0 else "shard-0"
        target.frontends = [n for r, n, _ in config.process_names() if r == "frontend"]
        target.shards = [n for r, n, _ in config.process_names() if r == "shard"]
        target.pids = cluster.pids
        yield target


# --------------------------------------------------------------------------- statistics


@dataclass
class StatsSample:
    """One poll of one process: the interval (t_prev, t] in seconds from the run start."""

    t_s: float
    interval_s: float
    name: str
    stats: dict[str, Any]


class StatsPoller:
    """Polls ``StatsRequest(reset=True)`` from each address every STATS_INTERVAL_S, aligned to the
    run's start, in a background thread (the send loop never waits for it). At each *mark* (a
    time from the run start, a label and, optionally, the names to ask; all ``control_names``
    when None) it also takes ``control_stats(name)`` of those processes (cumulative counters
    over the supervisor's control link) and the CPU snapshot."""

    def __init__(
        self,
        addresses: dict[str, str],
        *,
        interval_s: float = STATS_INTERVAL_S,
        control_stats: Callable[[str], dict[str, Any]] | None = None,
        control_names: list[str] | None = None,
        marks: list[tuple[float, str, list[str] | None]] | None = None,
        cpu_pids: Callable[[], dict[str, int | None]] | None = None,
    ) -> None:
        self.addresses = dict(addresses)
        self.interval_s = interval_s
        self.control_stats = control_stats
        self.control_names = list(control_names or [])
        self.marks = sorted(marks or []) if control_stats is not None else []
        self.samples: list[StatsSample] = []
        self.at_marks: dict[str, dict[str, dict[str, Any]]] = {}
        self.cpu_pids = cpu_pids
        # CPU seconds used so far by each process, at each mark (see cpu_at_marks)
        self.cpu_at_marks: dict[str, dict[str, float]] = {}
        self.silent: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self, t0: float) -> None:
        self._t0 = t0
        if self.addresses or self.marks:
            self._thread = threading.Thread(target=self._run, name="stats-poller", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _take_mark(self, label: str, names: list[str] | None) -> None:
        assert self.control_stats is not None
        taken: dict[str, dict[str, Any]] = {}
        for name in self.control_names if names is None else names:
            try:
                taken[name] = self.control_stats(name)
            except Exception:
                self.silent.add(name)
        self.at_marks[label] = taken
        self.cpu_at_marks[label] = cpu_snapshot(self.cpu_pids() if self.cpu_pids else {})

    def _run(self) -> None:
        ctx = zmq.Context()
        identity = f"loadgen-stats-{os.getpid()}".encode()
        socks = {
            name: make_dealer(ctx, address, identity=identity)
            for name, address in self.addresses.items()
        }
        marks = list(self.marks)
        try:
            k = 0
            last = {name: 0.0 for name in socks}
            while True:
                poll_at = self._t0 + k * self.interval_s if socks else math.inf
                mark_at = self._t0 + marks[0][0] if marks else math.inf
                at = min(poll_at, mark_at)
                if at == math.inf or self._stop.wait(max(0.0, at - time.monotonic())):
                    break
                if mark_at <= poll_at:
                    _, label, names = marks.pop(0)
                    self._take_mark(label, names)
                    continue
                self._poll(socks, at, k, last)
                k += 1
            self._poll(socks, time.monotonic(), k, last)  # the last, partial interval
            # The hop statistics are wanted even when the run ended before their mark (it falls
            # after the last measured deadline, which may be past the run's last request).
            if any(label == HOPS_MARK for _, label, _ in marks) and "end" in self.at_marks:
                self._take_mark(HOPS_MARK, None)
        finally:
            for sock in socks.values():
                sock.close(linger=0)
            ctx.term()

    def _poll(
        self, socks: dict[str, zmq.Socket[Any]], at: float, k: int, last: dict[str, float]
    ) -> None:
        t = at - self._t0
        for name, sock in socks.items():
            reply = _ask_stats(sock)
            if reply is None:
                # Not reset: its counters keep running, so the next sample covers this interval
                # too (``last`` stays where the previous successful poll left it).
                self.silent.add(name)
                continue
            if k > 0:  # the first poll only resets the counters at the run's start
                self.samples.append(StatsSample(t, t - last[name], name, reply))
            last[name] = t


LOADGEN_PROCESS = "loadgen"
LOADGEN_WORKERS = "loadgen workers"


def cpu_snapshot(cluster_pids: dict[str, int | None]) -> dict[str, float]:
    """CPU seconds used so far by every cluster process, by this process (the generator's first
    worker, the stats poller and the supervisor thread) and, summed, by this process's other
    children (the generator's spawned workers). Empty where ``/proc`` is not available."""
    snapshot: dict[str, float] = {}
    known: set[int] = set()
    for name, pid in cluster_pids.items():
        if pid is None:
            continue
        known.add(pid)
        seconds = procutil.cpu_seconds(pid)
        if seconds is not None:
            snapshot[name] = seconds
    me = os.getpid()
    own = procutil.cpu_seconds(me)
    if own is None:
        return snapshot
    snapshot[LOADGEN_PROCESS] = own
    known |= IdlePollers.live_pids()  # they run only on otherwise idle CPU: not load
    workers = [procutil.cpu_seconds(p) for p in procutil.child_pids(me) if p not in known]
    snapshot[LOADGEN_WORKERS] = sum(w for w in workers if w is not None)
    return snapshot


def cpu_per_request(
    start: dict[str, float], end: dict[str, float], requests: int, seconds: float
) -> dict[str, Any] | None:
    """Each process's CPU over a window: microseconds per request sent in it, and cores used."""
    names = [n for n in end if n in start]
    if not names or requests <= 0 or seconds <= 0:
        return None
    used = {n: max(0.0, end[n] - start[n]) for n in names}
    if used.get(LOADGEN_WORKERS) == 0.0:
        del used[LOADGEN_WORKERS]  # one worker: it runs in this process
    return {
        "per_request_us": {n: round(v / requests * 1e6, 1) for n, v in sorted(used.items())},
        "cores": {n: round(v / seconds, 3) for n, v in sorted(used.items())},
        "total_cores": round(sum(used.values()) / seconds, 3),
        "requests": requests,
        "seconds": round(seconds, 3),
        "cpus": os.cpu_count(),
        "source": "/proc utime + stime at the measure window's start and end",
    }


def _ask_stats(sock: zmq.Socket[Any]) -> dict[str, Any] | None:
    while True:  # discard replies to earlier polls that timed out
        try:
            sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            break
    sock.send_multipart(codec.encode(StatsRequest(reset=True)), copy=False)
    if not sock.poll(int(STATS_REPLY_TIMEOUT_S * 1e3)):
        return None
    msg = codec.decode(sock.recv_multipart(copy=False))
    return dict(msg.stats) if isinstance(msg, StatsReply) else None


@dataclass
class StatsWindow:
    """Scheduler-side figures over one time window, from the backends' stats replies."""

    batch_sizes: np.ndarray[Any, Any]
    busy_s: float
    backends: int
    seconds: float
    # The model of each batch_sizes entry (cluster model names), None when a backend did not
    # report them.
    batch_models: np.ndarray[Any, Any] | None = None

    def sizes_of(self, model: str) -> np.ndarray[Any, Any] | None:
        """The batch sizes of ``model``'s batches, None when models were not reported."""
        if self.batch_models is None:
            return None
        return self.batch_sizes[self.batch_models == model]

    @property
    def busy_fraction(self) -> float | None:
        if self.backends == 0 or self.seconds <= 0:
            return None
        return self.busy_s / (self.backends * self.seconds)


def _busy_s(recorded: dict[str, Any]) -> float:
    """A poll's device busy time: the backend's exact in-window ``busy_s``; from a backend that
    does not report it (an older one, the echo server), the sum of the batches' run times,
    which credits a batch to the poll in which it ended."""
    busy = recorded.get("busy_s")
    if isinstance(busy, (int, float)):
        return float(busy)
    return float(sum(recorded.get("run_s", [])))


def stats_window(samples: list[StatsSample], start_s: float, end_s: float) -> StatsWindow | None:
    """Sum the samples whose interval ends inside (start_s, end_s] (to the poll granularity)."""
    chosen = [s for s in samples if start_s + 1e-6 < s.t_s <= end_s + 1e-6]
    if not chosen:
        return None
    sizes: list[int] = []
    models: list[str] | None = []
    busy = 0.0
    for s in chosen:
        recorded = s.stats.get("samples", {})
        batch_sizes = [int(b) for b in recorded.get("batch_size", [])]
        sizes.extend(batch_sizes)
        batch_models = recorded.get("batch_model")
        if models is not None and isinstance(batch_models, list) and (
            len(batch_models) == len(batch_sizes)
        ):
            models.extend(str(m) for m in batch_models)
        else:
            models = None  # a backend that does not name its batches' models
        busy += _busy_s(recorded)
    names = {s.name for s in samples}
    seconds = max(s.t_s for s in chosen) - min(s.t_s - s.interval_s for s in chosen)
    return StatsWindow(np.asarray(sizes, dtype=np.int64), busy, len(names), seconds,
                       None if models is None else np.asarray(models, dtype=object))


# --------------------------------------------------------------------------- the report


def live_report(
    result: RunResult,
    workload: Workload,
    *,
    target: Target | None,
    samples: list[StatsSample],
    at_marks: dict[str, dict[str, dict[str, Any]]] | None = None,
    stats_missing: list[str],
    cpu_at_marks: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """The report of one live run in ``zserve.loadgen.report``'s schema."""
    plan = result.plan
    measured = plan.measured
    latency_ms = result.latency_s * 1e3
    window = stats_window(samples, plan.measure_start_s, plan.measure_end_s)
    single_model = len(plan.models) == 1
    # Workload model name -> the cluster's, which the backends' stats use.
    cluster_names = target.model_names if target is not None else {}
    outcomes: list[ModelOutcome] = []
    cdfs: dict[str, list[list[float]]] = {}
    # A run stopped early counts what it sent: its unsent requests are neither good nor bad.
    sent = result.outcome != Outcome.UNSENT
    for m, name in enumerate(plan.models):
        mask = measured & (plan.model_index == m) & sent
        oc = result.outcome[mask]
        served = (oc == Outcome.GOOD) | (oc == Outcome.LATE)
        cdfs[name] = latency_cdf(latency_ms[mask][served])
        outcomes.append(
            ModelOutcome(
                name=name,
                slo_ms=plan.slo_ms[m],
                total=int(mask.sum()),
                good=int(np.count_nonzero(oc == Outcome.GOOD)),
                late=int(np.count_nonzero(oc == Outcome.LATE)),
                dropped=int(np.count_nonzero(oc == Outcome.DROPPED)),
                latencies_ms=latency_ms[mask][served],
                batch_sizes=(
                    None if window is None
                    else window.batch_sizes if single_model
                    else window.sizes_of(cluster_names.get(name, name))
                ),
                extra={
                    "errors": int(np.count_nonzero(oc == Outcome.ERROR)),
                    "timeouts": int(np.count_nonzero(oc == Outcome.TIMEOUT)),
                    "unsent": int(
                        np.count_nonzero(measured & (plan.model_index == m) & ~sent)
                    ),
                    "error_kinds": result.error_counts(m),
                },
            )
        )
    gpus = (target.gpus if target is not None else None) or workload.gpus
    bound = _bound_rps(workload, gpus)
    extra: dict[str, Any] = {
        "rate_rps": round(plan.offered_rate_rps, 3),
        "arrival": plan.description.get("arrival", str(workload.arrival)),
        "bailed": result.stopped_early is not None,
        "stopped_early": result.stopped_early,
        "wall_s": round(plan.duration_s, 3),
        "generator": {
            "workers": result.workers,
            "lateness_ms": result.lateness.to_dict(),
            "planned_requests": len(plan),
        },
        "schedule": plan.description.get("schedule"),
        "timeline": timeline(result, samples),
        "latency_cdf_ms": cdfs,
        # The live scheduler's, when its config is known (cluster.toml has no such key yet:
        # then the ModelThread default).
        "keep_tolerance": target.keep_tolerance if target is not None else None,
        "allowances_ms": (
            target.allowances_ms
            if target is not None and target.allowances_ms is not None
            else {"d_ctrl": workload.d_ctrl_ms, "d_data": workload.d_data_ms,
                  "reply": workload.reply_ms}
        ),
        "stats": {
            "source": "backend StatsReply (plan socket), polled every "
            f"{STATS_INTERVAL_S:g} s with reset",
            "processes": sorted({s.name for s in samples}),
            "missing": stats_missing,
        },
    }
    if target is not None:
        extra["target"] = {"address": target.client_address, "models": target.model_names}
        if target.notes:
            extra["notes"] = list(target.notes)
    report = build_report(
        outcomes,
        source="live",
        workload=workload.name,
        policy=(target.policy if target is not None and target.policy else workload.policy),
        drop=(target.drop if target is not None and target.drop else workload.drop),
        seed=workload.seed,
        gpus=gpus,
        measure_s=plan.measure_s,
        gpu_busy_fraction=window.busy_fraction if window is not None else None,
        bound_rps=bound,
        extra=extra,
    )
    _add_control_stats(report, target, at_marks or {}, stats_missing)
    cpu_marks = cpu_at_marks or {}
    if "start" in cpu_marks and "end" in cpu_marks:
        sent_in_window = int(np.count_nonzero(measured & sent))
        cpu = cpu_per_request(cpu_marks["start"], cpu_marks["end"], sent_in_window,
                              plan.measure_s)
        if cpu is not None:
            report["cpu"] = cpu
    if target is not None and at_marks and "end" in at_marks:
        served = measured & sent & ((result.outcome == Outcome.GOOD)
                                    | (result.outcome == Outcome.LATE))
        report["hops"] = _hops(target, latest=_latest_stats(at_marks), samples=samples, plan=plan,
                               client_latency_ms=latency_ms[served], cpu=report.get("cpu"))
    if window is not None and not single_model and len(window.batch_sizes):
        values, counts = np.unique(window.batch_sizes, return_counts=True)
        report["batch_size"] = {
            "median": float(np.median(window.batch_sizes)),
            "mean": round(float(np.mean(window.batch_sizes)), 3),
            "histogram": {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)},
        }
    return report


# Levels of the latency CDF kept in a live report (fraction, latency ms): every percent, then the
# tail in finer steps, so that the plot shows p99.9 without storing every sample.
CDF_LEVELS = (*(i / 100 for i in range(100)), 0.995, 0.999, 0.9995, 1.0)


def _hops(
    target: Target,
    *,
    latest: dict[str, dict[str, Any]],
    samples: list[StatsSample],
    plan: LoadPlan,
    client_latency_ms: np.ndarray[Any, Any],
    cpu: dict[str, Any] | None,
) -> dict[str, Any]:
    """The per-hop breakdown (``zserve.loadgen.breakdown``) of one run."""
    rank = latest.get(target.rank_process or "")
    if rank is not None and isinstance(rank.get("rank"), dict):
        rank = rank["rank"]  # shards = 0: the shard process hosts the rank
    in_window = [s for s in samples
                 if plan.measure_start_s + 1e-6 < s.t_s <= plan.measure_end_s + 1e-6]
    rows = breakdown.hop_breakdown(
        client_latency_ms=client_latency_ms,
        frontends=[latest[n] for n in target.frontends if n in latest],
        shards=[latest[n] for n in target.shards if n in latest],
        rank=rank,
        backend_samples=[s.stats["samples"] for s in in_window
                         if isinstance(s.stats.get("samples"), dict)],
    )
    return {"rows": [r.to_dict() for r in rows],
            "scheduler_cpu_ms_per_1000_requests": breakdown.scheduler_cpu_ms_per_1000(cpu)}


def latency_cdf(values_ms: np.ndarray[Any, Any]) -> list[list[float]]:
    if len(values_ms) == 0:
        return []
    quantiles = np.quantile(values_ms, CDF_LEVELS)
    return [[level, round(float(q), 4)] for level, q in zip(CDF_LEVELS, quantiles, strict=True)]


def _rank_counters(stats: dict[str, Any]) -> dict[str, Any] | None:
    """The RankThread counters in a rank's stats, or in a shard's that embeds the rank."""
    if isinstance(stats.get("rank_thread"), dict):
        return dict(stats["rank_thread"])
    embedded = stats.get("rank")
    if isinstance(embedded, dict):
        return _rank_counters(embedded)
    return None


def _latest_stats(
    at_marks: dict[str, dict[str, dict[str, Any]]],
) -> dict[str, dict[str, Any]]:
    """Every process's stats as of just after the window (the hops mark, which asked them all),
    or the window's end mark when the run ended before the hops mark could be taken."""
    return at_marks.get(HOPS_MARK) or at_marks["end"]


def _add_control_stats(
    report: dict[str, Any],
    target: Target | None,
    at_marks: dict[str, dict[str, dict[str, Any]]],
    missing: list[str],
) -> None:
    """From the stats taken over the control link at the measure window's start and end: the
    RankThread's counters over the window (the simulator's ``rank`` key), and the queueing delay
    the frontends measured: batch start on the backend (``BatchOutputs.started_at``) minus
    admission, overall and per model (the latest samples, taken just after the window).
    Frontends that do not report it leave the older approximation: admission -> the backend's
    input fetch, which happens when the batch plan reaches the backend, just before exec_at.
    """
    if target is None or target.control_stats is None:
        return
    if "end" not in at_marks:
        missing.append("the run stopped before the measure window's end: no rank counters or "
                       "queueing delay over the window")
        return
    start, end = at_marks.get("start", {}), at_marks["end"]
    latest = _latest_stats(at_marks)
    rank_name = target.rank_process or ""
    before = _rank_counters(start.get(rank_name, {}))
    after = _rank_counters(end.get(rank_name, {}))
    if before is not None and after is not None:
        report["rank"] = {
            key: after[key] - before.get(key, 0)
            for key in after
            if isinstance(after[key], int | float)
        }
    else:
        missing.append(f"no RankThread counters from {rank_name!r} at the window's start and end")
    # Every hop the frontends time, as they reported it at the window's end (to compare the
    # frontend's view of latency, admit_to_answer, with the client's).
    report["frontend_hops_ms"] = {
        name: latest[name].get("hops", {}) for name in target.frontends if name in latest
    }
    for hop_name, source in (
        ("queueing", "frontend queueing (backend batch start - admission), latest samples just "
                     "after the window"),
        ("admit_to_fetch", "frontend admit_to_fetch hop (an approximation: the frontends did not "
                           "report batch starts), latest samples just after the window"),
    ):
        hops = [
            latest[name].get("hops", {}).get(hop_name, {})
            for name in target.frontends
            if name in latest
        ]
        hops = [h for h in hops if h.get("count")]
        if hops:
            # Several frontends: the figures of the one with the most samples.
            hop = max(hops, key=lambda h: h["count"])
            report["queueing_ms"] = {
                "p50": round(float(hop["p50_ms"]), 4),
                "p99": round(float(hop["p99_ms"]), 4),
                "source": source,
                "samples": int(hop["count"]),
            }
            break
    else:
        missing.append("no queueing samples from the frontends: queueing delay unknown")
    for model, entry in report.get("per_model", {}).items():
        cluster_model = target.model_names.get(model, model)
        by_model = [
            latest[name].get("queueing_by_model", {}).get(cluster_model, {})
            for name in target.frontends
            if name in latest
        ]
        by_model = [h for h in by_model if h.get("count")]
        if by_model:
            hop = max(by_model, key=lambda h: h["count"])
            entry["queueing_p50_ms"] = round(float(hop["p50_ms"]), 4)
            entry["queueing_p99_ms"] = round(float(hop["p99_ms"]), 4)


def _bound_rps(workload: Workload, gpus: int) -> float | None:
    try:
        from zserve.loadgen.sim import workload_bound_rps

        bound = workload_bound_rps(workload.with_overrides(gpus=gpus))
    except Exception:
        return None
    return bound if 0 < bound < math.inf else None


def timeline(result: RunResult, samples: list[StatsSample]) -> dict[str, Any]:
    """Per-second series over the whole run (by planned send time): offered, good and bad rate;
    from the backends' stats, the GPU busy time and the GPUs that ran any batch."""
    plan = result.plan
    seconds = max(1, math.ceil(plan.duration_s))
    edges = np.arange(seconds + 1, dtype=np.float64)
    offered = np.histogram(plan.times_s, bins=edges)[0]
    good = np.histogram(plan.times_s[result.outcome == Outcome.GOOD], bins=edges)[0]
    decided = (result.outcome != Outcome.UNSENT)
    total = np.histogram(plan.times_s[decided], bins=edges)[0]
    bad_rate = [
        round(1.0 - g / t, 6) if t else None for g, t in zip(good, total, strict=True)
    ]
    gpus_busy: list[float | None] = [None] * seconds
    gpus_active: list[int | None] = [None] * seconds
    if samples:
        busy = np.zeros(seconds)
        active: list[set[str]] = [set() for _ in range(seconds)]
        for s in samples:
            # A poll at t covers (t - interval, t]: the second that ends at ceil(t).
            k = min(seconds - 1, max(0, math.ceil(s.t_s - 1e-6) - 1))
            recorded = s.stats.get("samples", {})
            busy_s = _busy_s(recorded)
            busy[k] += busy_s
            if recorded.get("run_s") or busy_s > 0:
                active[k].add(s.name)
        gpus_busy = [round(float(b), 4) for b in busy]
        gpus_active = [len(a) for a in active]
    return {
        "t_s": [float(t) for t in edges[:-1]],
        "offered_rps": [int(x) for x in offered],
        "good_rps": [int(x) for x in good],
        "bad_rate": bad_rate,
        "gpus_busy": gpus_busy,
        "gpus_active": gpus_active,
        "measure_start_s": plan.measure_start_s,
        "measure_end_s": plan.measure_end_s,
    }


# --------------------------------------------------------------------------- running


@dataclass
class BenchOptions:
    workers: int
    lateness_bound_ms: float
    bail: BailRule | None
    progress: bool | None
    schedule: schedules.RateSchedule | None
    records: str | None = None  # write each run's per-request records here (.npz)


def run_once(
    workload: Workload,
    target: Target,
    rate_rps: float | None,
    options: BenchOptions,
) -> dict[str, Any]:
    """One live run at ``rate_rps`` (None: the workload's rate or the schedule as given)."""
    plan = plan_for_workload(workload, rate_rps=rate_rps, schedule=options.schedule)
    plan = _rename(plan, target.model_names)
    inputs = {target.model_names[w]: t for w, t in target.inputs.items()}
    control_names = list(dict.fromkeys(
        n for n in [target.rank_process, *target.shards, *target.frontends] if n
    ))
    # Asking a process for its stats costs it a millisecond or more of its event loop (the
    # frontend's hop quantiles: 2-5 ms), and a stall of that size inside the measure window is a
    # burst of bad requests under a 25 ms SLO. So the window's start and end ask only the rank,
    # whose counters are all that is needed there (the RankThread's counters over the window);
    # the hop statistics (the latest samples, not differences) are taken from every process a
    # little after the window, when a stall no longer touches a measured request.
    rank_only = [target.rank_process] if target.rank_process else []
    last_answer_s = plan.measure_end_s + max(plan.slo_ms, default=0.0) / 1e3 + HOPS_MARK_MARGIN_S
    hops_at = min(last_answer_s, plan.duration_s)
    poller = StatsPoller(
        target.stats_addresses,
        control_stats=target.control_stats,
        control_names=control_names,
        marks=[(plan.measure_start_s, "start", rank_only), (plan.measure_end_s, "end", rank_only),
               (hops_at, HOPS_MARK, None)],
        cpu_pids=target.pids,
    )
    missing: list[str] = []
    if not target.stats_addresses:
        missing.append(
            "no process to ask for statistics (start the cluster from cluster.toml, or pass "
            "--cluster with an address): batch sizes and GPU busy fraction are unknown"
        )
    if target.control_stats is None:
        missing.append("no control link and no frontend to ask: queueing delay and rank "
                       "counters are unknown")

    try:
        result = run_load(
            plan,
            target.client_addresses or target.client_address,
            inputs=inputs,
            workers=_workers_for(options.workers, plan, len(target.client_addresses)),
            lateness_bound_ms=options.lateness_bound_ms,
            bail=options.bail,
            progress=options.progress,
            on_start=poller.start,
        )
    finally:
        poller.stop()
    if poller.silent:
        missing.append(f"no StatsReply from {sorted(poller.silent)}")
    result = _rename_result(result, workload)
    if options.records:
        result.save(options.records)
    return live_report(result, workload, target=target, samples=poller.samples,
                       at_marks=poller.at_marks, stats_missing=missing,
                       cpu_at_marks=poller.cpu_at_marks)


def _workers_for(requested: int, plan: LoadPlan, frontends: int = 1) -> int:
    """``requested``, or (0: auto) one worker per AUTO_WORKER_RATE_RPS of the peak per-second
    planned rate, at most one per CPU, and at least one per frontend (each worker feeds one)."""
    if requested > 0:
        return requested
    peak = float(np.histogram(plan.times_s, bins=max(1, math.ceil(plan.duration_s)))[0].max())
    by_rate = min(os.cpu_count() or 1, math.ceil(peak / AUTO_WORKER_RATE_RPS))
    return max(1, frontends, by_rate)


def _rename(plan: LoadPlan, names: dict[str, str]) -> LoadPlan:
    return dataclasses.replace(plan, models=tuple(names.get(m, m) for m in plan.models))


def _rename_result(result: RunResult, workload: Workload) -> RunResult:
    """Report under the workload's model names, as the simulator does."""
    plan = dataclasses.replace(result.plan, models=tuple(m.name for m in workload.models))
    return dataclasses.replace(result, plan=plan)


# --------------------------------------------------------------------------- max-rate check


def max_rate_check(
    *, workers: int, lateness_bound_ms: float, arrival: str, seconds: float, precision: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """The highest open-loop rate this machine's generator sustains within the lateness bound,
    against a zero-delay echo server (the real wire protocol, no cluster)."""
    from zserve.loadgen.echo import EchoConfig, EchoServer
    from zserve.loadgen.generator import build_plan

    inputs = {"echo": {"x": np.zeros((1, 4), dtype=np.float32)}}
    probes: list[dict[str, Any]] = []
    with EchoServer(EchoConfig(service_ms=0.0)) as echo:

        def probe(rate: float) -> dict[str, Any]:
            plan = build_plan(
                models=["echo"], slo_ms=[1000.0], shares=[1.0],
                schedule=schedules.constant(rate, seconds), arrival=ArrivalSpec.parse(arrival),
                warmup_s=0.5, cooldown_s=0.0, seed=len(probes),
            )
            result = run_load(
                plan, echo.address, inputs=inputs, workers=workers,
                lateness_bound_ms=lateness_bound_ms, refuse_if_behind=False, progress=False,
            )
            lat = result.lateness
            ok = not lat.behind and not np.any(result.outcome == Outcome.TIMEOUT)
            probes.append({"rate": round(rate, 1), "pass": ok, **lat.to_dict()})
            progress(
                f"  probe {rate:10.1f} r/s: p99 lateness {lat.quantile_ms:8.2f} ms "
                f"({'ok' if ok else 'behind'})"
            )
            return {"bad_rate": 0.0 if ok else 1.0, "lateness": lat.to_dict()}

        found = search_goodput(probe, 2000.0 * workers, rel_precision=precision)
    return {
        "max_rate_rps": found["goodput_rps"],
        "workers": workers,
        "lateness_bound_ms": lateness_bound_ms,
        "arrival": arrival,
        "probe_s": seconds,
        "probes": probes,
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
    }


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zserve bench", description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", help="cluster.toml to start, or a frontend client address")
    p.add_argument("workload", nargs="?", help="workload TOML file")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, help="total offered rate (r/s)")
    mode.add_argument("--search", choices=["goodput"], help="binary-search the goodput")
    mode.add_argument(
        "--max-rate-check", action="store_true",
        help="find the highest rate the generator itself sustains (echo server, no cluster)",
    )
    p.add_argument("--cluster", help="cluster.toml of the cluster at ADDRESS (inputs, stats)")
    p.add_argument("--stats", action="append", default=[], metavar="NAME=ADDRESS",
                   help="a process that answers StatsRequest like a backend's plan socket "
                   "(added to those the cluster names)")
    p.add_argument("--model-map", action="append", default=[], metavar="WORKLOAD=CLUSTER",
                   help="serve workload model WORKLOAD with cluster model CLUSTER")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--steps", help="rate steps of the measured part: DUR_S:RATE,DUR_S:RATE,...")
    shape.add_argument("--trace", help="file of per-second rates (the measured part)")
    p.add_argument("--trace-scale", type=float, default=1.0, help="multiply the trace's rates")
    p.add_argument("--arrival", help="constant | poisson | gamma:K")
    p.add_argument("--seed", type=int)
    p.add_argument("--measure", type=float, help="measure window seconds")
    p.add_argument("--warmup", type=float, help="warmup seconds")
    p.add_argument("--cooldown", type=float, help="cooldown seconds")
    p.add_argument("--workers", default="auto",
                   help="generator processes, or 'auto' (default): one per "
                   f"{AUTO_WORKER_RATE_RPS:.0f} r/s of peak planned rate, at most one per CPU")
    p.add_argument("--max-lateness-ms", type=float, default=DEFAULT_LATENESS_BOUND_MS,
                   help="refuse a run whose p99 send lateness exceeds this")
    p.add_argument("--start-rate", type=float, help="first probe of --search (default: bound)")
    p.add_argument("--max-bad-rate", type=float, default=0.01)
    p.add_argument("--precision", type=float, default=0.01, help="relative search precision")
    p.add_argument("--no-early-stop", action="store_true", help="run every probe to its end")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="with --search: run N searches on the same cluster and report the "
                   "median one (every goodput is listed); live goodputs vary from search to "
                   "search with the host, so quote the median of several")
    p.add_argument("--json", dest="json_out", help="write the report here")
    p.add_argument("--plots", help="write plots (PNG) into this folder (needs matplotlib)")
    p.add_argument("--records", help="write per-request records (.npz) of the run (with "
                   "--search, one file per probe: NAME-<rate>rps.npz)")
    p.add_argument("--compare", metavar="REPORT.json",
                   help="print this report (e.g. `zserve sim ... --json`) side by side")
    p.add_argument("--quiet", action="store_true", help="no text summary")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None)
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _parse_steps(text: str) -> schedules.RateSchedule:
    pairs = []
    for item in text.split(","):
        duration, sep, rate = item.strip().partition(":")
        if not sep:
            raise ValueError(f"--steps: expected DUR_S:RATE, got {item!r}")
        pairs.append((float(duration), float(rate)))
    return schedules.steps(pairs)


def _load(args: argparse.Namespace) -> tuple[Workload, schedules.RateSchedule | None]:
    workload = load_workload(args.workload)
    overrides: dict[str, Any] = {}
    for key, value in (("rate", args.rate), ("seed", args.seed), ("measure_s", args.measure),
                       ("warmup_s", args.warmup), ("cooldown_s", args.cooldown)):
        if value is not None:
            overrides[key] = value
    if args.arrival is not None:
        overrides["arrival"] = ArrivalSpec.parse(args.arrival)
    schedule = None
    if args.steps:
        schedule = _parse_steps(args.steps)
    elif args.trace:
        schedule = schedules.from_trace(args.trace, scale=args.trace_scale)
    if schedule is not None:
        overrides["measure_s"] = schedule.duration_s
        if args.rate is not None:
            schedule = schedule.with_mean_rate(args.rate)
        overrides["rate"] = schedule.mean_rate_rps
    if overrides:
        workload = workload.with_overrides(**overrides)
    return workload, schedule


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{flag}: expected NAME=VALUE, got {item!r}")
        out[key] = value
    return out


def _say(quiet: bool) -> Callable[[str], None]:
    def say(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    return say


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    say = _say(args.quiet)
    workers_auto = args.workers == "auto"
    try:
        workers = 0 if workers_auto else int(args.workers)
        if workers < 0:
            raise ValueError
    except ValueError:
        print("zserve bench: --workers must be a positive integer or 'auto'", file=sys.stderr)
        return EXIT_USAGE
    if args.max_rate_check:
        report = max_rate_check(
            workers=max(1, workers or (os.cpu_count() or 1)),
            lateness_bound_ms=args.max_lateness_ms,
            arrival=args.arrival or "poisson",
            seconds=args.measure or MAX_RATE_CHECK_S,
            precision=max(args.precision, 0.05),
            progress=say,
        )
        _write_json(args.json_out, report)
        if not args.quiet:
            print(
                f"generator sustains {report['max_rate_rps']:.0f} r/s with {report['workers']} "
                f"worker(s) (p99 send lateness <= {args.max_lateness_ms:g} ms, {report['arrival']}"
                f" arrivals, {os.cpu_count()} CPUs, load average {report['load_average'][0]:.2f})"
            )
        return EXIT_OK
    if not args.target or not args.workload:
        print("zserve bench: need CLUSTER_OR_ADDRESS and WORKLOAD (or --max-rate-check)",
              file=sys.stderr)
        return EXIT_USAGE
    if args.repeat < 1 or (args.repeat > 1 and not args.search):
        print("zserve bench: --repeat N needs N >= 1, and N > 1 needs --search goodput",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        workload, schedule = _load(args)
        model_map = _pairs(args.model_map, "--model-map")
        extra_stats = _pairs(args.stats, "--stats")
    except (OSError, ValueError) as exc:
        print(f"zserve bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    options = BenchOptions(
        workers=workers,
        lateness_bound_ms=args.max_lateness_ms,
        bail=None if args.no_early_stop or not args.search else BailRule(args.max_bad_rate),
        progress=args.progress,
        schedule=schedule,
        records=args.records,
    )
    try:
        with open_target(args.target, workload, cluster_config=args.cluster,
                         model_map=model_map) as target:
            target.stats_addresses.update(extra_stats)
            report = _bench(args, workload, target, options, say)
    except GeneratorBehindError as exc:
        print(f"zserve bench: {exc}", file=sys.stderr)
        _write_json(args.json_out, {"refused": str(exc),
                                    "lateness_ms": exc.result.lateness.to_dict(),
                                    "search_probes": exc.search_probes})
        return EXIT_BEHIND
    except (OSError, ValueError, GeneratorError) as exc:
        print(f"zserve bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _write_json(args.json_out, report)
    if args.plots:
        from zserve.loadgen import plots

        written = plots.write_all(report, args.plots)
        say(f"plots: {', '.join(str(p) for p in written)}")
    if not args.quiet:
        print(summary_text(report))
        repeats = report.get("repeats")
        if repeats:
            listed = ", ".join(f"{g:.1f}" for g in repeats["goodput_rps"])
            print(f"goodput over {len(repeats['goodput_rps'])} searches: {listed} r/s; median "
                  f"{repeats['median_rps']:.1f} (the report above is the median search's)")
        gen = report["generator"]
        lat = gen["lateness_ms"]
        print(f"generator: {gen['workers']} worker(s), send lateness p50 {lat['p50_ms']:.2f} ms "
              f"p99 {lat['p99_ms']:.2f} ms max {lat['max_ms']:.2f} ms (bound "
              f"{lat['bound_ms']:g} ms)")
        cpu = report.get("cpu")
        if cpu:
            costs = "  ".join(f"{name} {us:.0f}" for name, us in cpu["per_request_us"].items())
            print(f"cpu us/request (measure window, {cpu['total_cores']:.2f} of {cpu['cpus']} "
                  f"cores busy): {costs}")
        hops = report.get("hops")
        if hops and hops["rows"]:
            print(breakdown.format_table(
                [breakdown.HopRow(**row) for row in hops["rows"]],
                hops["scheduler_cpu_ms_per_1000_requests"]))
        for line in report["stats"]["missing"]:
            print(f"missing: {line}")
    if args.compare:
        try:
            other = json.loads(Path(args.compare).read_text())
            print(side_by_side(report, other))
        except (OSError, ValueError, KeyError) as exc:
            print(f"zserve bench: --compare {args.compare}: {exc}", file=sys.stderr)
    return EXIT_OK


class _BelowFloor(Exception):
    """A search probe would measure too few requests to judge a 1% bad rate."""


def repeat_summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """N goodput searches as one report: the median search's report (for an even N the lower of
    the two middle ones, so that it is a search that ran) with ``repeats``: every search's
    goodput in the order run, their median, min and max."""
    goodputs = [float(r["goodput_rps"]) for r in reports]
    chosen = sorted(reports, key=lambda r: float(r["goodput_rps"]))[(len(reports) - 1) // 2]
    return {**chosen, "repeats": {"goodput_rps": goodputs,
                                  "median_rps": float(statistics.median(goodputs)),
                                  "min_rps": min(goodputs), "max_rps": max(goodputs)}}


def _bench(
    args: argparse.Namespace, workload: Workload, target: Target, options: BenchOptions,
    say: Callable[[str], None],
) -> dict[str, Any]:
    if not args.search:
        return run_once(workload, target, None if options.schedule else workload.rate, options)
    if args.repeat == 1:
        return _search(args, workload, target, options, say)
    reports = []
    for k in range(args.repeat):
        say(f"search {k + 1} of {args.repeat}")
        # one set of record files per search
        reports.append(_search(args, workload, target,
                               _records_suffixed(options, f"search{k + 1}"), say))
    return repeat_summary(reports)


def _records_suffixed(options: BenchOptions, suffix: str) -> BenchOptions:
    """``options`` writing its per-request records to ``NAME-<suffix>.npz`` instead of
    ``NAME.npz`` (unchanged when it writes none)."""
    if not options.records:
        return options
    path = Path(options.records)
    return dataclasses.replace(options, records=str(path.with_name(f"{path.stem}-{suffix}.npz")))


def _search(
    args: argparse.Namespace, workload: Workload, target: Target, options: BenchOptions,
    say: Callable[[str], None],
) -> dict[str, Any]:
    last: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    floor_rps = MIN_MEASURED_REQUESTS / workload.measure_s

    def probe(rate: float) -> dict[str, Any]:
        if rate < floor_rps:
            raise _BelowFloor
        probe_options = _records_suffixed(options, f"{rate:.0f}rps")
        try:
            report = run_once(workload, target, rate, probe_options)
        except GeneratorBehindError as exc:
            # One retry: on a shared machine a burst of other work can starve the generator
            # for a moment; twice in a row means this rate is beyond it (the search stops).
            say(f"  probe {rate:10.1f} r/s: {exc}; retrying once")
            try:
                report = run_once(workload, target, rate, probe_options)
            except GeneratorBehindError as again:
                again.search_probes = list(probes)
                raise
        last[:] = [report]
        probes.append({"rate": round(rate, 3), "bad_rate": report["bad_rate"],
                       "pass": report["bad_rate"] <= args.max_bad_rate and not report["bailed"]})
        say(
            f"  probe {rate:10.1f} r/s: worst bad rate {report['bad_rate']:.3%}"
            f"{' (stopped early)' if report['bailed'] else ''}"
        )
        return report

    start = args.start_rate or _bound_rps(workload, target.gpus or workload.gpus) or workload.rate
    try:
        report = search_goodput(
            probe, start, max_bad_rate=args.max_bad_rate, rel_precision=args.precision
        )
    except _BelowFloor:
        say(f"  no probe passed above {floor_rps:.1f} r/s (fewer than {MIN_MEASURED_REQUESTS} "
            f"requests in the measure window below it): goodput 0")
        report = {
            "goodput_rps": 0.0,
            "search": {"max_bad_rate": args.max_bad_rate, "rel_precision": args.precision,
                       "lo_rps": None, "hi_rps": probes[-1]["rate"] if probes else None,
                       "probes": probes, "floor_rps": floor_rps},
        }
    if "per_model" not in report and last:
        # No probe passed: report the last (lowest) probe's measurements with goodput 0.
        report = {**last[0], "goodput_rps": report["goodput_rps"], "search": report["search"]}
    set_fraction_of_bound(report)
    return report


def side_by_side(left: dict[str, Any], right: dict[str, Any]) -> str:
    """Two reports of the schema (a live run and a simulated one, say) in two columns."""

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows: list[tuple[str, str, str]] = []

    def row(label: str, get: Callable[[dict[str, Any]], Any], spec: str = ".1f") -> None:
        values = []
        for report in (left, right):
            try:
                values.append(fmt(get(report), spec))
            except (KeyError, TypeError):
                values.append("-")
        rows.append((label, values[0], values[1]))

    row("source", lambda r: r["source"], "")
    row("goodput r/s", lambda r: r.get("goodput_rps"))
    row("offered r/s", lambda r: r["offered_rps"])
    row("good r/s", lambda r: r["good_rps"])
    row("worst bad rate", lambda r: r["bad_rate"], ".3%")
    row("fraction of bound", lambda r: r["fraction_of_bound"], ".3f")
    def latency(q: str) -> Callable[[dict[str, Any]], Any]:
        return lambda r: r["latency_ms"][q]

    for q in ("p50", "p90", "p99", "p99.9"):
        row(f"latency {q} ms", latency(q), ".2f")
    row("queueing p50 ms", lambda r: r["queueing_ms"]["p50"], ".2f")
    row("queueing p99 ms", lambda r: r["queueing_ms"]["p99"], ".2f")
    row("median batch", lambda r: r["batch_size"]["median"], "g")
    row("mean batch", lambda r: r["batch_size"]["mean"], ".2f")
    row("GPU busy fraction", lambda r: r["gpu_busy_fraction"], ".3f")
    width = max(len(label) for label, _, _ in rows)
    lines = [f"{'':<{width}}  {'left':>14}  {'right':>14}"]
    lines += [f"{label:<{width}}  {a:>14}  {b:>14}" for label, a, b in rows]
    return "\n".join(lines)


def _write_json(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
