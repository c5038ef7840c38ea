"""The open-loop load generator: send on schedule, whatever the replies do.

This module runs a plan (``run_load``: the workers, their coordinator, the result); the plan,
outcomes and early-stop rule are ``zserve.loadgen.load_plan``'s, one worker's send loop is
``zserve.loadgen.sender``'s.

A run has three parts:

1. A :class:`LoadPlan`: every request of the run planned ahead, as parallel arrays (send time
   relative to the run start, model index), plus each model's SLO and the measure window. Build it
   with :func:`plan_for_workload` from a workload file (``zserve.loadgen.workload``), or with
   :func:`build_plan` from a rate schedule (``zserve.loadgen.schedules``), per-model shares and an
   arrival process (``zserve.loadgen.arrivals``).
2. :func:`run_load`: one or more *workers* send the plan to a frontend's ``client`` socket.
   Worker ``w`` of ``W`` sends requests ``w, w+W, w+2W, ...`` so each worker carries an equal,
   interleaved share and the union is exactly the plan. One worker runs in the calling process;
   more are spawned processes that start together at an agreed ``time.monotonic()`` instant
   (CLOCK_MONOTONIC is shared by every process on a host). A worker never waits for a reply to
   send: between sends it only reads the replies that have already arrived.
3. A :class:`RunResult`: per request the send time, reply time, outcome (:class:`Outcome`) and
   error kind, plus the generator's own *lateness* (actual send time minus planned send time).

Honesty rule: if the generator fell behind its schedule by more than ``lateness_bound_ms`` at
the ``LATENESS_QUANTILE`` of the measured requests, :func:`run_load` raises
:class:`GeneratorBehindError` (carrying the figure) instead of returning a result, because the
run would then describe the generator rather than the system under test.

Outcome rules (``shared/DESIGN.md`` section 6, ``notes/anchors.md`` section 3): a request is
GOOD iff its reply arrived by send time + SLO. A reply after that is LATE; a ``DEADLINE`` error is
DROPPED; any other error is ERROR (its kind recorded); no answer by the end of the run is TIMEOUT.
Only requests planned inside the measure window count. All but GOOD are bad.

Early stop: with a :class:`BailRule`, the run stops as soon as one model's measured requests are
certain to fail (more bad requests than its whole bad budget), so a goodput search does not
spend a full probe on a rate that fails.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from zserve.loadgen.load_plan import (
    BAD,
    COUNTERS,
    DECIDED,
    DEFAULT_LATENESS_BOUND_MS,
    NO_ERROR,
    SENT,
    BailRule,
    GeneratorBehindError,
    GeneratorError,
    IntArray,
    LoadPlan,
    Outcome,
    RunResult,
    lateness_of,
)
from zserve.loadgen.sender import (
    DEFAULT_REPLY_GRACE_S,
    MONITOR_INTERVAL_S,
    PROTOCOLS,
    WORKER_START_TIMEOUT_S,
    Channels,
    WorkerOutput,
    WorkerSpec,
    send_loop,
    worker_main,
)
from zserve.transport.messages import TensorMap

# A worker that is this far behind its schedule stops at once: the run will be refused anyway.
ABANDON_LAG_S = 0.5
# Workers start together this long after the last one reports ready.
START_DELAY_S = 0.1
# Runs shorter than this get no progress bar (and none unless stderr is a terminal).
PROGRESS_MIN_S = 5.0


# --------------------------------------------------------------------------- the run


class _Coordinator:
    """Sums every worker's counters, applies the early-stop rule and the lag watch, and draws the
    progress bar."""

    def __init__(self, plan: LoadPlan, bail: BailRule | None, progress: _Progress | None) -> None:
        self.plan = plan
        self.bail = bail
        self.progress = progress
        self.reason: str | None = None
        self.abandoned_lag_s: float | None = None  # stopped: the generator fell behind

    def check(self, counters: IntArray, lag_s: float, t0: float) -> str | None:
        if self.reason is None:
            if lag_s > ABANDON_LAG_S:
                self.reason = f"generator {lag_s:.2f} s behind schedule"
                self.abandoned_lag_s = lag_s
            elif self.bail is not None:
                verdict = self.bail.verdict(counters, self.plan.models)
                if verdict is not None:
                    self.reason = f"early stop: {verdict}"
        if self.progress is not None:
            self.progress.draw(time.monotonic() - t0, counters)
        return self.reason


def run_load(
    plan: LoadPlan,
    address: str | Sequence[str],
    *,
    inputs: dict[str, TensorMap] | None = None,
    workers: int = 1,
    lateness_bound_ms: float = DEFAULT_LATENESS_BOUND_MS,
    bail: BailRule | None = None,
    reply_grace_s: float = DEFAULT_REPLY_GRACE_S,
    progress: bool | None = None,
    refuse_if_behind: bool = True,
    on_start: Callable[[float], None] | None = None,
    protocol: str = "native",
) -> RunResult:
    """Run ``plan`` against the frontend ``client`` socket at ``address`` (or several frontends:
    worker w sends to ``address[w % len(address)]``).

    ``inputs`` maps each model to the tensors every one of its requests carries (the same arrays,
    sent zero-copy). ``workers`` > 1 spreads the plan over spawned processes. ``progress`` draws a
    bar on stderr (default: only when stderr is a terminal and the run lasts PROGRESS_MIN_S).
    Raises :class:`GeneratorBehindError` when the lateness bound is exceeded (unless
    ``refuse_if_behind`` is False, then the result says ``lateness.behind``). ``on_start(t0)`` is
    called once the start instant is fixed, before the first send (e.g. to align a statistics
    poller with the run). ``protocol``: send through zserve's client socket (``native``) or
    an Open Inference Protocol server (``zserve.loadgen.sender.PROTOCOLS``; ``address`` is
    then its ``host:port``).
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r} (one of {', '.join(PROTOCOLS)})")
    if progress is None:
        progress = sys.stderr.isatty() and plan.duration_s >= PROGRESS_MIN_S
    bar = _Progress(plan) if progress else None
    coordinator = _Coordinator(plan, bail, bar)
    spec = WorkerSpec(
        address=address if isinstance(address, str) else address[0],
        plan=plan,
        inputs=dict(inputs or {}),
        identity=_identity(0),
        reply_grace_s=reply_grace_s,
        bail=bail,
        protocol=protocol,
    )
    t0, outputs = _run_workers(spec, workers, coordinator, on_start, address)
    if bar is not None:
        bar.close()
    return _assemble(
        plan,
        t0,
        outputs,
        workers=workers,
        lateness_bound_ms=lateness_bound_ms,
        stopped=coordinator.reason,
        abandoned_lag_s=coordinator.abandoned_lag_s,
        refuse_if_behind=refuse_if_behind,
    )


def _run_workers(
    spec: WorkerSpec, workers: int, coordinator: _Coordinator,
    on_start: Callable[[float], None] | None, address: str | Sequence[str],
) -> tuple[float, list[tuple[IntArray, WorkerOutput]]]:
    """One native worker runs here; several, or an OIP worker, in processes of their own (an
    OIP worker always: grpcio's asyncio support keeps process-wide state bound to the first
    event loop that used it)."""
    if workers == 1 and spec.protocol == "native":
        t0 = time.monotonic() + START_DELAY_S
        if on_start is not None:
            on_start(t0)
        out = send_loop(spec, t0, lambda c, lag: coordinator.check(c, lag, t0))
        return t0, [(np.arange(len(spec.plan)), out)]
    addresses = [address] if isinstance(address, str) else list(address)
    return _run_processes(spec, workers, coordinator, on_start, addresses)


def _identity(worker: int) -> bytes:
    return f"loadgen-{os.getpid()}-{worker}-{os.urandom(4).hex()}".encode()


def _start_workers(
    ctx: Any, spec: WorkerSpec, *, workers: int, channels: Channels, tmp: str,
    addresses: list[str], procs: list[Any],
) -> list[IntArray]:
    """Spawn one worker per share of the plan (worker w sends requests w, w + workers, ...);
    appends each process to ``procs`` as it starts (so the caller can stop them whatever
    happens) and returns the shares."""
    shares: list[IntArray] = []
    for w in range(workers):
        indices = np.arange(w, len(spec.plan), workers, dtype=np.int64)
        shares.append(indices)
        worker_spec = replace(
            spec,
            plan=spec.plan.subset(indices),
            identity=_identity(w),
            address=addresses[w % len(addresses)],
        )
        proc = ctx.Process(
            target=worker_main,
            args=(worker_spec, w, channels, os.path.join(tmp, f"worker-{w}.npz")),
            name=f"loadgen-worker-{w}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return shares


def _await_ready(channels: Channels, procs: list[Any]) -> None:
    """Wait for every worker's ready release; a worker that died first is an error."""
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    for _ in procs:
        while not channels.ready.acquire(timeout=0.1):
            dead = [p.name for p in procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise GeneratorError(f"load generator workers failed to start: {dead}")


def _watch_workers(procs: list[Any], channels: Channels, coordinator: _Coordinator,
                   n_models: int, t0: float) -> None:
    """Until every worker has exited: sum their counters every MONITOR_INTERVAL_S, and tell
    them all to stop when the coordinator says so."""
    view = np.frombuffer(channels.counters, dtype=np.int64).reshape(len(procs), n_models, -1)
    pending = {p.sentinel for p in procs}
    while pending:
        ready_now = multiprocessing.connection.wait(list(pending), timeout=MONITOR_INTERVAL_S)
        pending.difference_update(ready_now)
        lag = max(channels.lag_s[:])
        if coordinator.check(view.sum(axis=0), lag, t0) is not None:
            channels.stop.set()


def _collect_outputs(procs: list[Any], shares: list[IntArray],
                     tmp: str) -> list[tuple[IntArray, WorkerOutput]]:
    outputs = []
    for w, proc in enumerate(procs):
        proc.join()
        path = os.path.join(tmp, f"worker-{w}.npz")
        if proc.exitcode != 0 or not os.path.exists(path):
            raise GeneratorError(f"load generator worker {w} exited with {proc.exitcode}")
        with np.load(path) as data:
            outputs.append(
                (
                    shares[w],
                    WorkerOutput(
                        data["sent_s"], data["replied_s"], data["outcome"],
                        data["error_kind"], None,
                    ),
                )
            )
    return outputs


def _run_processes(
    spec: WorkerSpec,
    workers: int,
    coordinator: _Coordinator,
    on_start: Callable[[float], None] | None,
    addresses: list[str],
) -> tuple[float, list[tuple[IntArray, WorkerOutput]]]:
    ctx = multiprocessing.get_context("spawn")
    n_models = len(spec.plan.models)
    width = n_models * len(COUNTERS)
    channels = Channels(
        counters=ctx.RawArray("q", workers * width),
        lag_s=ctx.RawArray("d", workers),
        ready=ctx.Semaphore(0),
        go=ctx.Event(),
        start_at=ctx.RawValue("d", 0.0),
        stop=ctx.Event(),
    )
    tmp = tempfile.mkdtemp(prefix="zserve-loadgen-")
    procs: list[Any] = []
    try:
        shares = _start_workers(ctx, spec, workers=workers, channels=channels, tmp=tmp,
                                addresses=addresses, procs=procs)
        _await_ready(channels, procs)
        t0 = time.monotonic() + START_DELAY_S
        channels.start_at.value = t0
        channels.go.set()
        if on_start is not None:
            on_start(t0)
        _watch_workers(procs, channels, coordinator, n_models, t0)
        return t0, _collect_outputs(procs, shares, tmp)
    finally:
        channels.stop.set()
        channels.go.set()
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
        shutil.rmtree(tmp, ignore_errors=True)



def _assemble(
    plan: LoadPlan,
    t0: float,
    outputs: list[tuple[IntArray, WorkerOutput]],
    *,
    workers: int,
    lateness_bound_ms: float,
    stopped: str | None,
    abandoned_lag_s: float | None,
    refuse_if_behind: bool,
) -> RunResult:
    n = len(plan)
    sent = np.full(n, np.nan)
    replied = np.full(n, np.nan)
    outcome = np.full(n, Outcome.UNSENT, dtype=np.int8)
    error_kind = np.full(n, NO_ERROR, dtype=np.int8)
    for indices, out in outputs:
        sent[indices] = out.sent_s
        replied[indices] = out.replied_s
        outcome[indices] = out.outcome
        error_kind[indices] = out.error_kind
    lateness = lateness_of(plan, sent, lateness_bound_ms)
    if abandoned_lag_s is not None:
        lateness = replace(lateness, behind=True, abandoned_lag_ms=abandoned_lag_s * 1e3)
    result = RunResult(
        plan=plan,
        t0=t0,
        sent_s=sent,
        replied_s=replied,
        outcome=outcome,
        error_kind=error_kind,
        workers=workers,
        lateness=lateness,
        stopped_early=stopped,
    )
    if lateness.behind and refuse_if_behind:
        raise GeneratorBehindError(result)
    return result



# --------------------------------------------------------------------------- progress bar


class _Progress:
    """A one-line progress bar on stderr (only drawn when asked: a terminal)."""

    WIDTH = 30

    def __init__(self, plan: LoadPlan) -> None:
        self.plan = plan
        self._last = 0.0

    def draw(self, elapsed_s: float, counters: IntArray) -> None:
        now = time.monotonic()
        if now - self._last < 0.2:
            return
        self._last = now
        total = self.plan.duration_s
        frac = min(1.0, max(0.0, elapsed_s / total)) if total else 1.0
        filled = int(frac * self.WIDTH)
        sent = int(counters[:, SENT].sum())
        answered = int(counters[:, DECIDED].sum())
        bad = int(counters[:, BAD].sum())
        bad_pct = 100.0 * bad / answered if answered else 0.0
        line = (
            f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {elapsed_s:6.1f}/{total:.1f} s "
            f"sent {sent} bad {bad_pct:.2f}%"
        )
        with contextlib.suppress(OSError):
            sys.stderr.write(line)
            sys.stderr.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            sys.stderr.write("\n")
            sys.stderr.flush()
