"""The fault harness (tests/test_faults_*.py): a real cluster, open-loop load through the public
``zserve.AsyncClient``, a fault injected at a chosen moment, and a ledger of every request sent.

The ledger is the suite's one judge. Each request ``i`` carries its own input (every element
``FIRST_VALUE + i``), and the emulated model's outputs are a function of the request's own input
(``EmulatedExecutor.expected_outputs``), so an answer says whose it is. The checks:

- every request sent has exactly one outcome (an unanswered future is ``SILENT``; a second answer
  reaches the client as an unmatched reply, which ``check`` refuses too);
- an output is the request's own: another request's outputs are ``FOREIGN``, anything else
  ``WRONG``, both failures;
- an error is typed: a ``zserve.core.errors.ZServeError`` (``kind``), or the client's
  ``ConnectionLostError`` (``CONNECTION_LOST``: the frontend's connection broke, the request may
  have run); any other exception is ``UNTYPED``, a failure;
- ``counts`` gives the outcomes by kind, for the assertions of each case and for the docs.

``drive`` sends ``count`` requests open loop (Poisson or constant arrivals from a seeded
generator: the schedule never waits for an answer), runs the fault (any callable: a signal to a
named child through ``Cluster.kill``, a SIGSTOP/SIGCONT pair, a malformed frame) on a worker
thread when the chosen request has been sent, then waits for every answer. Nothing sleeps to wait
for a state: waits are on futures, on the supervisor's incarnation counter or on stats polls,
each bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

import zserve
from zserve.backends.emulated import EmulatedExecutor
from zserve.backends.host import build_executor
from zserve.client.async_client import ConnectionLostError
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config

# The role a fault targets -> the child it hits (shards >= 1: shard and rank are processes).
ROLE_CHILD = {"frontend": "frontend-0", "shard": "shard-0", "rank": "rank",
              "backend": "backend-0"}
MODEL = "m"
# Inputs are FIRST_VALUE + i: exact in float32, and no request's input is another's.
FIRST_VALUE = 1.0
INPUT_SHAPE = (1, 4)
# A client timeout far past every SLO used here: a DEADLINE from the client itself means the
# cluster left a request without its answer, which the cases refuse.
CLIENT_TIMEOUT_S = 30.0
ANSWER_WAIT_S = 40.0
RECOVERY_WAIT_S = 60.0
RETRY_PACE_S = 0.02
# Outcome names that are not error kinds.
OK = "OK"
CONNECTION_LOST = "CONNECTION_LOST"
SILENT = "SILENT"
FOREIGN = "FOREIGN"
WRONG = "WRONG"
UNTYPED = "UNTYPED"
FAILURES = frozenset({SILENT, FOREIGN, WRONG, UNTYPED})


def fault_cluster(
    *,
    backends: int = 2,
    alpha_ms: float = 2.0,
    beta_ms: float = 20.0,
    slo_ms: float = 600.0,
    max_batch: int = 16,
    max_queue: int = 1024,
    shards: int = 1,
    drain_s: float = 2.0,
    transport: str = "ipc",
    profile: str | None = None,
    max_wait_ms: float | None = None,
) -> ClusterConfig:
    """The suite's cluster: one frontend, a shard and a rank as separate processes, emulated
    backends of l(b) = alpha b + beta, an SLO of hundreds of ms (margin on a loaded 2-core
    machine). Capacity at the defaults: b = 16 in 52 ms on each of 2 GPUs, ~600 requests/s.
    ``profile``: a profile file for the model (its l(b) then comes from there)."""
    model: dict[str, Any] = {
        "name": MODEL, "emulated": {"alpha_ms": alpha_ms, "beta_ms": beta_ms},
        "slo_ms": slo_ms, "max_batch": max_batch, "max_queue": max_queue}
    if profile is not None:
        model["profile"] = profile
    if max_wait_ms is not None:
        model["max_wait_ms"] = max_wait_ms
    return parse_config({
        "cluster": {"drain_s": drain_s, "transport": transport},
        # jitter 50 ms: the default policy defers a lone model's batches to their last moment
        # minus the jitter allowance, and a loaded 2-core CI host stalls for more than 1 ms
        "scheduler": {"shards": shards, "d_ctrl_ms": 5.0, "jitter_ms": 50.0},
        "frontends": {"count": 1, "reply_allowance_ms": 20.0},
        "backends": {"count": backends, "device": "emulated"},
        "models": [model],
    })


def request_input(index: int) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.full(INPUT_SHAPE, FIRST_VALUE + index, np.float32)}


class Ledger:
    """Every request sent and its one outcome, each output checked against the request's own
    expected outputs (see the module docstring)."""

    def __init__(self, config: ClusterConfig, model: str = MODEL) -> None:
        executor = build_executor("emulated", [m for m in config.models if m.name == model])
        assert isinstance(executor, EmulatedExecutor)
        self.executor = executor
        self.model = model
        self.sent: dict[int, float] = {}  # index -> send time (monotonic s)
        self.outcomes: dict[int, list[str]] = {}
        self.answered_at: dict[int, float] = {}
        self.unmatched_replies = 0
        self.problems: list[str] = []
        self.first_message: dict[str, str] = {}  # error kind -> its first message: why it came
        self._owner: dict[bytes, int] = {}

    def expected(self, index: int) -> dict[str, np.ndarray[Any, Any]]:
        return dict(self.executor.expected_outputs(self.model, request_input(index)))

    def sending(self, index: int, at: float) -> None:
        assert index not in self.sent, f"request {index} sent twice"
        self.sent[index] = at
        self._owner[self.expected(index)["y"].tobytes()] = index

    def record_outputs(self, index: int, outputs: Mapping[str, Any], at: float) -> str:
        expected = self.expected(index)
        mine = outputs.keys() == expected.keys() and all(
            np.array_equal(np.asarray(outputs[k]), v) for k, v in expected.items())
        if mine:
            return self._record(index, OK, at)
        owner = self._owner.get(np.asarray(outputs.get("y", b"")).tobytes())
        if owner is not None:
            self.problems.append(f"request {index} got request {owner}'s outputs")
            return self._record(index, FOREIGN, at)
        self.problems.append(f"request {index} got outputs {dict(outputs)}, not {expected}")
        return self._record(index, WRONG, at)

    def record_error(self, index: int, error: BaseException, at: float) -> str:
        if isinstance(error, ConnectionLostError):
            self.first_message.setdefault(CONNECTION_LOST, str(error))
            return self._record(index, CONNECTION_LOST, at)
        if isinstance(error, zserve.ZServeError):
            self.first_message.setdefault(error.kind.value, str(error))
            return self._record(index, error.kind.value, at)
        self.problems.append(f"request {index} raised {error!r}")
        return self._record(index, UNTYPED, at)

    def record_silence(self, index: int) -> str:
        self.problems.append(f"request {index} got no answer")
        return self._record(index, SILENT, time.monotonic())

    def _record(self, index: int, kind: str, at: float) -> str:
        self.outcomes.setdefault(index, []).append(kind)
        self.answered_at.setdefault(index, at)
        return kind

    def counts(self) -> dict[str, int]:
        return dict(Counter(kinds[0] for kinds in self.outcomes.values()))

    def check(self) -> dict[str, int]:
        """Assert the ledger's invariants; return the outcomes by kind."""
        problems = list(self.problems)
        missing = sorted(self.sent.keys() - self.outcomes.keys())
        if missing:
            problems.append(f"{len(missing)} requests have no outcome: {missing[:10]}")
        twice = {i: k for i, k in self.outcomes.items() if len(k) != 1}
        if twice:
            problems.append(f"requests with several outcomes: {dict(list(twice.items())[:10])}")
        stray = sorted(self.outcomes.keys() - self.sent.keys())
        if stray:
            problems.append(f"outcomes of requests never sent: {stray[:10]}")
        if self.unmatched_replies:
            problems.append(f"{self.unmatched_replies} answers matched no request in flight")
        assert not problems, f"{problems[:20]}; outcomes {self.counts()}"
        return self.counts()

    def latest_failure_after(self, fault_at: float) -> float:
        """Seconds from ``fault_at`` to the send of the last request sent after it that did not
        get its outputs (0 if none): how long service stayed disturbed."""
        late = [at - fault_at for i, at in self.sent.items()
                if at >= fault_at and self.outcomes.get(i, [OK])[0] != OK]
        return max(late, default=0.0)

    def answer_latencies(self) -> list[float]:
        return [self.answered_at[i] - at for i, at in self.sent.items() if i in self.answered_at]


@dataclasses.dataclass
class Load:
    """An open-loop schedule: ``count`` requests at ``rate_rps`` (Poisson or constant)."""

    rate_rps: float
    count: int
    poisson: bool = True
    seed: int = 0
    first_index: int = 0

    def send_times(self) -> list[float]:
        rng = random.Random(self.seed)
        t, times = 0.0, []
        for _ in range(self.count):
            times.append(t)
            t += rng.expovariate(self.rate_rps) if self.poisson else 1.0 / self.rate_rps
        return times


@dataclasses.dataclass
class Run:
    """What one ``drive`` saw: the ledger's counts, when the fault ran, how long it took."""

    counts: dict[str, int]
    fault_at: float | None
    started_at: float
    sent_s: float
    answered_s: float


async def drive(
    address: str,
    ledger: Ledger,
    load: Load,
    *,
    fault: Callable[[], object] | None = None,
    fault_after: int = 0,
    check: bool = True,
) -> Run:
    """Send ``load`` through one ``AsyncClient``; run ``fault`` on a worker thread once request
    ``fault_after`` (counted from the load's first) has been sent; wait for every answer and
    record it in ``ledger``; ``check`` it (unless told not to)."""
    loop = asyncio.get_running_loop()
    fault_task: asyncio.Future[object] | None = None
    fault_at: float | None = None
    futures: dict[int, asyncio.Future[dict[str, Any]]] = {}
    arrivals: dict[int, float] = {}  # when each answer came (monotonic s)
    async with zserve.AsyncClient(address, timeout=CLIENT_TIMEOUT_S, max_retries=0) as client:
        start = time.monotonic()
        for n, offset in enumerate(load.send_times()):
            delay = start + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            index = load.first_index + n
            ledger.sending(index, time.monotonic())
            future = client.submit(ledger.model, request_input(index))
            future.add_done_callback(functools.partial(_arrived, arrivals, index))
            futures[index] = future
            if fault is not None and n == fault_after:
                fault_at = time.monotonic()
                fault_task = loop.run_in_executor(None, fault)
        sent_s = time.monotonic() - start
        await _collect(ledger, futures, arrivals)
        if fault_task is not None:
            await fault_task
        # A second answer to any request would have come in by the time a fresh request's
        # answer does: one more round trip, then count what matched nothing.
        with contextlib.suppress(zserve.ZServeError):
            await client.infer("no-such-model", {}, max_retries=0)
        ledger.unmatched_replies += client.unmatched_replies
    counts = ledger.check() if check else ledger.counts()
    return Run(counts, fault_at, start, sent_s, time.monotonic() - start)


def _arrived(arrivals: dict[int, float], index: int, _future: object) -> None:
    arrivals[index] = time.monotonic()


async def _collect(ledger: Ledger, futures: Mapping[int, asyncio.Future[dict[str, Any]]],
                   arrivals: Mapping[int, float]) -> None:
    async def one(index: int, future: asyncio.Future[dict[str, Any]]) -> None:
        try:
            outputs = await future
        except BaseException as exc:  # every exception is judged by the ledger
            ledger.record_error(index, exc, arrivals.get(index, time.monotonic()))
        else:
            ledger.record_outputs(index, outputs, arrivals.get(index, time.monotonic()))

    tasks = [asyncio.ensure_future(one(i, f)) for i, f in futures.items()]
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=ANSWER_WAIT_S)
        for task in pending:
            task.cancel()
    for index, future in futures.items():
        if not future.done():
            ledger.record_silence(index)


# --------------------------------------------------------------------------- faults


def signal_child(cluster: Cluster, name: str, sig: int) -> Callable[[], int]:
    """A fault: send ``sig`` to the child ``name``."""
    return lambda: cluster.kill(name, sig)


def stop_then_continue(cluster: Cluster, name: str, stopped_s: float,
                       resumed: threading.Event | None = None) -> Callable[[], None]:
    """A fault: SIGSTOP the child ``name``, hold it stopped for ``stopped_s`` (the fault's own
    duration, not a wait for a state), then SIGCONT it."""

    def fault() -> None:
        pid = cluster.kill(name, signal.SIGSTOP)
        try:
            threading.Event().wait(stopped_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            if resumed is not None:
                resumed.set()

    return fault


def wait_served(address: str, ledger: Ledger, first_index: int, count: int = 8,
                timeout: float = RECOVERY_WAIT_S) -> float:
    """After a fault: send ``count`` requests one at a time until each gets its own outputs
    (UNAVAILABLE, OVERLOADED and DEADLINE mean "not yet"; each attempt is its own ledger entry).
    Returns the seconds it took."""

    async def run() -> float:
        start = time.monotonic()
        index = first_index
        async with zserve.AsyncClient(address, timeout=CLIENT_TIMEOUT_S, max_retries=0) as client:
            served = 0
            last_error: BaseException | None = None
            while served < count:
                assert time.monotonic() - start < timeout, (
                    f"not served again within {timeout} s: {ledger.counts()}; last error "
                    f"{last_error!r}")
                ledger.sending(index, time.monotonic())
                try:
                    outputs = await client.infer(ledger.model, request_input(index))
                except (zserve.UnavailableError, zserve.OverloadedError,
                        zserve.DeadlineError) as exc:
                    ledger.record_error(index, exc, time.monotonic())
                    served = 0
                    last_error = exc
                    await asyncio.sleep(RETRY_PACE_S)  # a retry's pace, as a client's backoff
                else:
                    served += ledger.record_outputs(index, outputs, time.monotonic()) == OK
                index += 1
            ledger.unmatched_replies += client.unmatched_replies
        return time.monotonic() - start

    return asyncio.run(run())


def rss_bytes(pid: int) -> int:
    """The resident set size of ``pid`` (``VmRSS`` of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
