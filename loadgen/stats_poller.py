"""The stats poller of a live run: backend statistics once a second, control stats at marks.

``StatsPoller`` asks every backend ``StatsRequest(reset=True)`` once per ``STATS_INTERVAL_S`` in a
background thread (one ``StatsSample`` per reply), and at each *mark* (the measure window's
start and end, and ``HOPS_MARK`` just after the last measured deadline) takes the processes'
stats over the control link and the CPU snapshot. ``stats_window`` sums the samples of a window:
batch sizes, per model, and device busy time.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from zserve.loadgen.cpu import cpu_snapshot
from zserve.transport import codec
from zserve.transport.messages import StatsReply, StatsRequest
from zserve.transport.sockets import make_dealer

# The mark at which every process's hop statistics are taken: after the last measured request's
# deadline (the window's end + the largest SLO + this margin), or at the run's end if sooner.
HOPS_MARK = "hops"
HOPS_MARK_MARGIN_S = 0.05
# A run that stops this close before a mark (its last request answered just before the window's
# end) still gets the mark; one that stops earlier (bailed) reports the mark missing.
MARK_AT_STOP_S = 0.05
# Scheduler statistics are polled from every backend once per interval, aligned to the run's
# start, with reset: each reply covers exactly one interval, which gives the per-second timeline
# and, summed over the measure window, the window's batch sizes and GPU busy time.
STATS_INTERVAL_S = 1.0
STATS_REPLY_TIMEOUT_S = 0.5



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
                    # A run whose window ends with it stops the poller about when the window's
                    # end mark falls due (its last answer may come a little before): a mark due
                    # within MARK_AT_STOP_S is taken now, as nothing happens after the run.
                    due_by = time.monotonic() + MARK_AT_STOP_S
                    while marks and self._t0 + marks[0][0] <= due_by:
                        _, label, names = marks.pop(0)
                        self._take_mark(label, names)
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
        sizes: np.ndarray[Any, Any] = self.batch_sizes[self.batch_models == model]
        return sizes

    @property
    def busy_fraction(self) -> float | None:
        if self.backends == 0 or self.seconds <= 0:
            return None
        return self.busy_s / (self.backends * self.seconds)


def polled_busy_s(recorded: dict[str, Any]) -> float:
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
        busy += polled_busy_s(recorded)
    names = {s.name for s in samples}
    seconds = max(s.t_s for s in chosen) - min(s.t_s - s.interval_s for s in chosen)
    return StatsWindow(np.asarray(sizes, dtype=np.int64), busy, len(names), seconds,
                       None if models is None else np.asarray(models, dtype=object))
