"""``zserve bench-scheduler --models M --gpus G [--rate R] --json OUT``: scheduler-only throughput.

The scheduler alone in one process on one core (Symphony Figure 13 left): M ModelThreads and one
RankThread in one ``zserve.scheduler.core.SchedulerCore`` (the core the shard process and the
simulator host), no sockets, requests generated
in-process (Poisson per model, equal popularity) against a real clock, and emulated GPUs that run
each plan from ``exec_at`` to ``exec_at + l(bs)``.

The clock. By default it is the loop thread's own CPU time (``time.thread_time``): what a
dedicated, pinned core would see, and immune to other processes preempting this one on a shared
machine (``--clock wall`` uses ``time.perf_counter``). It does not protect against cache or
memory-bandwidth contention from neighbours, so figures stay noisy on a shared box.

What is on the clock and what is not. The scheduler's host loop is on the clock: each iteration
reads the clock, fires the core's timer when its ``wake_at`` has come, then hands the core every
model's chunk of requests whose arrival time has passed (a fresh clock reading per chunk, so the
lag below is measured at the moment of delivery; chunks grow when the loop falls behind, as a
frontend's per-tick coalescing does); the core delivers the messages between its ModelThreads
and its RankThread at once. The load generator and the invariant checker stand for
the frontends and the GPUs, which run on other cores in a deployment: every ``GEN_BLOCK_S`` of
clock the loop pauses, checks the plans and drop notices recorded since the last pause, generates
the next block of arrivals (times, deadlines and request ids as ready lists, as a frontend's
decoded message would hold them), and takes that CPU time off its clock. The result reports it
as ``harness_excluded_s`` next to ``loop_cpu_s``, so the rate one core could sustain doing both
is about ``delivered / (loop_cpu_s + harness_excluded_s)`` (leaving the harness on the clock
instead would stall the loop for a whole block at every pause and fail the lag criterion for
that reason alone); ``--profile`` splits the on-clock time between the scheduler objects and the
host loop.

A probe at rate R lasts ``--duration`` seconds and *sustains* R when

- the lag (delivery time - arrival time of a chunk's first request) has p99 <= 2 ms
  (``--max-lag-ms``), the authors' stress criterion, and
- the schedule stays correct: every invariant holds (no GPU overlap, no plan after its exec time,
  no batch past its latest moment, every request ends exactly once) and the worst per-model bad
  rate is <= 1%.

Without ``--rate`` it searches: doubling from ``--start-rate`` then bisecting to 5%; the JSON has
``sustained_rps`` and every probe. ``--profile`` adds a cProfile of one probe at 40% of the found
rate (``PROFILE_RATE_FRACTION``), timed with the same clock as the loop (a wall-clock profile on a
shared machine charges every preemption to whatever call was running, typically the clock read
itself).

The default emulated model is fast enough that GPUs are never the bottleneck at 100 GPUs:
l(b) = 0.005 ms * b + 2 ms, SLO 50 ms, max batch 512.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import math
import pstats
import sys
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.core.hosting import Outbox
from zserve.scheduler.bench.fixed_trace import run_fixed_trace
from zserve.scheduler.common import FEASIBILITY_EPS_S
from zserve.scheduler.core import SchedulerCore
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import BatchPlan, DropNotice, Message

FRONTEND = "bench"
SLOW_ITERATION_S = 0.001  # loop iterations longer than this are listed in the result
GEN_BLOCK_S = 0.01  # arrivals are generated (and plans checked) in blocks of this many seconds
# The profiled probe runs at this fraction of the sustained rate: the profiler's own cost (about
# 1 us per call event) would overload a probe at the full rate, and an overloaded loop (huge
# chunks, bulk drops) is not the steady state the profile should describe.
PROFILE_RATE_FRACTION = 0.4


class BenchInvariantError(AssertionError):
    pass


class _Probe:
    """One real-time run at a fixed total rate."""

    def __init__(self, args: argparse.Namespace, rate: float) -> None:
        self.args = args
        self.rate = rate
        self.m = args.models
        self.profile = LatencyProfile.linear(args.alpha_ms, args.beta_ms, args.max_batch)
        self.slo_s = args.slo_ms / 1e3
        policy = SchedulePolicy.parse(args.policy)
        self.rank = RankThread(list(range(args.gpus)), 0.0, grant_order=policy.grant_order)
        self.core = SchedulerCore("bench", rank=self.rank)
        outbox: Outbox = []
        for i in range(self.m):
            self.core.add_thread(0.0, ModelThread(f"m{i}", self.profile, self.slo_s, policy,
                                                  jitter_s=args.jitter_ms / 1e3), outbox)
        self.names = list(self.core.threads)
        self.rng = np.random.default_rng(args.seed)
        self.per_model_rate = rate / self.m
        capacity = int(rate * (args.duration + 1) * 1.2 + 1000)
        self.arrival = np.zeros(capacity)  # by request id
        self.status = np.zeros(capacity, dtype=np.int8)  # 0 pending, 1 good, 2 late, 3 dropped
        self.next_id = 0  # ids are given out at generation
        self.delivered = 0
        self.gpu_busy_until = [0.0] * args.gpus
        # generated, not yet delivered: per model, parallel lists from pending_pos on
        self.pending: list[list[float]] = [[] for _ in range(self.m)]  # arrival times
        self.pending_deadline: list[list[float]] = [[] for _ in range(self.m)]
        self.pending_id: list[list[int]] = [[] for _ in range(self.m)]
        self.pending_pos = [0] * self.m
        self.generated_until = 0.0
        self.next_t = [float(t) for t in self.rng.exponential(1.0 / self.per_model_rate, self.m)]
        self.lags: list[float] = []
        self.slow_iterations: list[tuple[float, float]] = []  # (start s, duration ms)
        self.busy_s = 0.0  # loop time spent in iterations that did work
        self.harness_s = 0.0  # generation and checking, taken off the clock
        self.events: list[tuple[float, Message]] = []  # (now, plan or drop) not yet checked
        self.chunks = 0
        self.plans = 0
        self.planned = 0
        self.dropped = 0

    # ------------------------------------------------------------------ generation

    def _generate(self, until: float) -> None:
        """Poisson arrivals per model up to ``until`` (in-process, in blocks)."""
        lam = self.per_model_rate
        slo = self.slo_s
        blocks: list[np.ndarray] = []
        for i in range(self.m):
            first = self.next_t[i]
            # the next arrival may lie beyond this block (low per-model rates): nothing to draw
            horizon = max(until - first, 0.0)
            n = int(lam * horizon * 1.2 + 10 * math.sqrt(lam * horizon + 1) + 10)
            gaps = self.rng.exponential(1.0 / lam, n)
            gaps[0] = 0.0
            times = first + np.cumsum(gaps)
            while times[-1] < until:
                more = times[-1] + np.cumsum(self.rng.exponential(1.0 / lam, n))
                times = np.concatenate([times, more])
            cut = int(np.searchsorted(times, until))
            self.next_t[i] = float(times[cut])  # the first arrival of the next block
            block = times[:cut]
            blocks.append(block)
            pos = self.pending_pos[i]
            base = self.next_id
            self.next_id = base + cut
            self.pending[i] = self.pending[i][pos:] + block.tolist()
            self.pending_deadline[i] = self.pending_deadline[i][pos:] + (block + slo).tolist()
            self.pending_id[i] = self.pending_id[i][pos:] + list(range(base, base + cut))
            self.pending_pos[i] = 0
        self.generated_until = until
        total = self.next_id
        if total > len(self.arrival):
            size = 2 * total
            self.arrival = np.resize(self.arrival, size)
            status = np.zeros(size, dtype=np.int8)
            status[: len(self.status)] = self.status
            self.status = status
        if blocks:
            self.arrival[total - sum(len(b) for b in blocks) : total] = np.concatenate(blocks)

    # ------------------------------------------------------------------ checking (off the clock)

    def _check_events(self) -> None:
        for now, msg in self.events:
            if type(msg) is BatchPlan:
                self._check_plan(now, msg)
            else:
                assert isinstance(msg, DropNotice)
                ids = np.array(msg.request_ids, dtype=np.int64)
                if np.any(self.status[ids] != 0):
                    raise BenchInvariantError("a dropped request had already ended")
                self.status[ids] = 3
                self.dropped += len(ids)
        self.events.clear()

    def _check_plan(self, now: float, plan: BatchPlan) -> None:
        ids = np.array(plan.request_ids, dtype=np.int64)
        bs = len(ids)
        finish = plan.exec_at + self.profile.latency(bs)
        eps = FEASIBILITY_EPS_S
        g = plan.gpu_id
        if plan.exec_at < now - eps:
            raise BenchInvariantError(f"plan reached GPU {g} after its exec_at")
        if plan.exec_at < self.gpu_busy_until[g] - eps:
            raise BenchInvariantError(f"GPU {g} runs two batches at once")
        if np.any(self.status[ids] != 0):
            raise BenchInvariantError("a request ends twice")
        deadline = float(self.arrival[ids].min()) + self.slo_s
        if finish > deadline + eps:
            raise BenchInvariantError("a batch starts after its latest moment")
        self.status[ids] = 1
        self.gpu_busy_until[g] = finish
        self.plans += 1
        self.planned += bs

    # ------------------------------------------------------------------ plumbing (on the clock)

    def _take(self, now: float, outbox: Outbox) -> None:
        """What the core left for the GPUs and the frontend: checked off the clock."""
        events = self.events
        for _, msg in outbox:
            events.append((now, msg))
        outbox.clear()

    # ------------------------------------------------------------------ run

    def run(self) -> dict[str, Any]:
        self._generate(GEN_BLOCK_S)
        clock: Callable[[], float] = (
            time.thread_time if self.args.clock == "cpu" else time.perf_counter
        )
        with _cyclic_gc_off():
            elapsed = self._loop(clock)
        return self._result(elapsed)

    def _loop(self, clock: Callable[[], float]) -> float:
        """The host loop until ``--duration`` of clock; returns the clock time it took."""
        duration = self.args.duration
        outbox: Outbox = []
        core = self.core
        names = self.names
        pending = self.pending
        pending_deadline = self.pending_deadline
        pending_id = self.pending_id
        pending_pos = self.pending_pos
        lags = self.lags
        t0 = clock()
        iter_start = 0.0
        work_mark = 0
        chunks = 0
        delivered = 0
        while True:
            now = clock() - t0
            if now - iter_start > SLOW_ITERATION_S:
                self.slow_iterations.append(
                    (round(iter_start, 4), round((now - iter_start) * 1e3, 3)))
            mark = chunks + core.n_timer_fires
            if mark != work_mark:  # the iteration did work (not an idle spin)
                self.busy_s += now - iter_start
                work_mark = mark
            if now >= duration:
                break
            iter_start = now
            if now + GEN_BLOCK_S > self.generated_until:
                t0 += self._run_harness(clock)  # off the clock
                now = clock() - t0
            if core.wake_at <= now:
                core.on_timer(now, outbox)
                self._take(now, outbox)
                now = clock() - t0
            for i, name in enumerate(names):
                times = pending[i]
                start = pending_pos[i]
                if start >= len(times) or times[start] > now:
                    continue
                now = clock() - t0  # deliver at a fresh reading: the lag is the real one
                stop = bisect_right(times, now, start + 1)
                pending_pos[i] = stop
                lags.append(now - times[start])
                core.on_arrivals(
                    now, name, FRONTEND, pending_id[i][start:stop], times[start:stop],
                    pending_deadline[i][start:stop], outbox,
                )
                chunks += 1
                delivered += stop - start
                if outbox:
                    self._take(now, outbox)
        elapsed = clock() - t0
        self.chunks = chunks
        self.delivered = delivered
        self._check_events()
        return elapsed

    def _run_harness(self, clock: Callable[[], float]) -> float:
        """The frontends' and GPUs' share of the work: check the events so far, generate the
        next block of arrivals. Returns the clock time it took (taken off the loop's clock)."""
        paused = clock()
        self._check_events()
        self._generate(self.generated_until + GEN_BLOCK_S)
        spent = clock() - paused
        self.harness_s += spent
        return spent

    def _result(self, elapsed: float) -> dict[str, Any]:
        n = self.next_id
        delivered = self.delivered
        warm = self.arrival[:n] >= 0.5  # skip the first half second (rate meter warm-up)
        status = self.status[:n]
        # requests still queued (or not yet delivered) at the end are neither good nor bad yet
        ended = status != 0
        counted = warm & ended
        bad = int(np.count_nonzero(counted & (status != 1)))
        total = int(np.count_nonzero(counted))
        lags = np.array(self.lags) * 1e3 if self.lags else np.zeros(1)
        bad_rate = bad / total if total else 0.0
        lag_p99 = float(np.percentile(lags, 99))
        ok = lag_p99 <= self.args.max_lag_ms and bad_rate <= 0.01
        return {
            "rate_rps": round(self.rate, 1),
            "delivered": delivered,
            "delivered_rps": round(delivered / elapsed, 1),
            "loop_cpu_s": round(elapsed, 4),
            "harness_excluded_s": round(self.harness_s, 4),
            "busy_fraction": round(self.busy_s / elapsed, 4),
            "cpu_us_per_request": round(self.busy_s / max(1, delivered) * 1e6, 4),
            "capacity_rps": round(delivered / self.busy_s, 1) if self.busy_s > 0 else None,
            "sustained": ok,
            "lag_ms": {
                "p50": round(float(np.percentile(lags, 50)), 4),
                "p99": round(lag_p99, 4),
                "max": round(float(lags.max()), 4),
            },
            "bad_rate": round(bad_rate, 6),
            "slow_iterations": len(self.slow_iterations),
            "slowest_iterations_ms": sorted(self.slow_iterations, key=lambda x: -x[1])[:5],
            "chunks": self.chunks,
            "mean_chunk": round(delivered / max(1, self.chunks), 2),
            "timer_fires": self.core.n_timer_fires,
            "plans": self.plans,
            "mean_batch": round(self.planned / max(1, self.plans), 2),
            "gpus_used": int(sum(1 for t in self.gpu_busy_until if t > 0)),
            "rank_grants": self.rank.n_grants,
        }


@contextlib.contextmanager
def _cyclic_gc_off() -> Iterator[None]:
    """The scheduler's objects form no reference cycles; a cyclic-GC pass over a heap of
    millions of queued ids stalls the loop for tens of ms, so the host turns it off (the process
    runtime should do the same)."""
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if gc_was_enabled:
            gc.enable()
        gc.unfreeze()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zserve bench-scheduler", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=20)
    p.add_argument("--gpus", type=int, default=100)
    p.add_argument("--rate", type=float, help="probe this total rate only (no search)")
    p.add_argument("--start-rate", type=float, default=250_000.0)
    p.add_argument("--duration", type=float, default=3.0, help="seconds per probe")
    p.add_argument("--precision", type=float, default=0.05)
    p.add_argument("--max-lag-ms", type=float, default=2.0)
    p.add_argument("--alpha-ms", type=float, default=0.005)
    p.add_argument("--beta-ms", type=float, default=2.0)
    p.add_argument("--slo-ms", type=float, default=50.0)
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--policy", default="deferred")
    p.add_argument("--jitter-ms", type=float, default=0.5,
                   help="timer lateness allowance of the ModelThreads (ModelThread jitter_s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="cProfile one probe at the result")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="cpu: the loop's clock is its own thread CPU time (a dedicated core, "
                        "immune to other processes on a shared machine); wall: time.perf_counter")
    p.add_argument("--json", dest="json_out")
    p.add_argument("--fixed-trace", type=float, metavar="RATE",
                   help="no real-time probe: one fixed trace at RATE total r/s, --duration "
                        "seconds of it, on a virtual clock; prints CPU ns per request and the "
                        "schedule's fingerprint (zserve.scheduler.bench.fixed_trace)")
    return p


def probe(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    result = _Probe(args, rate).run()
    print(f"  {rate:12.0f} r/s: busy {result['busy_fraction']:.2f}, "
          f"lag p99 {result['lag_ms']['p99']:.3f} ms, bad "
          f"{result['bad_rate']:.3%}, chunk {result['mean_chunk']}, batch {result['mean_batch']}"
          f" -> {'ok' if result['sustained'] else 'FAIL'}", file=sys.stderr)
    return result


_SCHEDULER_FILES = ("model_thread.py", "candidate_sizing.py", "rank_thread.py", "policy.py",
                    "profiles.py", "scheduler/core.py", "timer_heap.py")
_HARNESS_FUNCS = frozenset(
    {"_generate", "_check_events", "_check_plan", "_result", "__init__", "_profile", "probe"}
)
_ProfFunc = tuple[str, int, str]


def _profile_breakdown(stats: pstats.Stats) -> dict[str, float]:
    """Profiled CPU seconds by owner: ``scheduler`` (the SchedulerCore, its ModelThreads and
    RankThread and what they call: dispatch, timer heap, list methods, message constructors),
    ``host_loop`` (the bench's on-clock loop: clock reads, chunk slicing, handing plans to the
    checker) and ``harness_off_clock`` (generation and checking).
    A function outside those files is charged to its callers in proportion to the time each
    caller spent in it."""
    table: dict[_ProfFunc, Any] = stats.stats  # type: ignore[attr-defined]
    memo: dict[_ProfFunc, dict[str, float]] = {}

    def own(func: _ProfFunc) -> str | None:
        filename, _, name = func
        if filename.endswith(_SCHEDULER_FILES):
            return "scheduler"
        if filename.endswith("bench/throughput.py"):
            return "harness_off_clock" if name in _HARNESS_FUNCS else "host_loop"
        return None

    def owners(func: _ProfFunc, seen: frozenset[_ProfFunc]) -> dict[str, float]:
        group = own(func)
        if group is not None:
            return {group: 1.0}
        if func in memo:
            return memo[func]
        callers = table[func][4] if func in table else {}
        total = sum(v[2] for v in callers.values())
        dist: dict[str, float] = {}
        for caller, v in callers.items():
            if caller in seen:
                continue
            share = v[2] / total if total > 0 else 1.0 / len(callers)
            for g, f in owners(caller, seen | {func}).items():
                dist[g] = dist.get(g, 0.0) + share * f
        if not dist:
            dist = {"other": 1.0}
        memo[func] = dist
        return dist

    out: dict[str, float] = {}
    for func, entry in table.items():
        for group, frac in owners(func, frozenset()).items():
            out[group] = out.get(group, 0.0) + entry[2] * frac
    return {k: round(v, 4) for k, v in sorted(out.items())}


def _profile(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    # time the profile on the loop's own clock: a wall-clock profile on a shared machine charges
    # each preemption to the call that was running (mostly the clock read itself)
    prof = cProfile.Profile(time.thread_time) if args.clock == "cpu" else cProfile.Profile()
    prof.enable()
    result = _Probe(args, rate).run()
    prof.disable()
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream).sort_stats("tottime")
    stats.print_stats(15)
    text = stream.getvalue()
    breakdown = _profile_breakdown(stats)
    total = sum(breakdown.values())
    return {
        "rate_rps": rate,
        "result_under_profiler": result,
        "breakdown_s": breakdown,
        "breakdown_fraction": {k: round(v / total, 4) for k, v in breakdown.items()},
        "note": "profiler overhead (about 1 us per call event) inflates call-heavy code",
        "top_tottime": text.splitlines(),
    }


def _report_fixed_trace(args: argparse.Namespace) -> int:
    result = run_fixed_trace(args, args.fixed_trace)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"schema": "zserve-bench-scheduler-fixed-trace/1", "models": args.models,
             "gpus": args.gpus, "policy": args.policy, **result}, indent=2) + "\n")
    print(f"fixed trace: {result['requests']} requests at {args.fixed_trace:.0f} r/s, "
          f"{args.models} models, {args.gpus} GPUs: {result['cpu_ns_per_request']} ns CPU per "
          f"request ({result['cpu_s']} s); schedule: {result['plans']} plans, "
          f"{result['planned']} requests planned, {result['messages']} messages")
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        SchedulePolicy.parse(args.policy)
    except ValueError as exc:
        print(f"zserve bench-scheduler: {exc}", file=sys.stderr)
        return 2
    if args.fixed_trace:
        return _report_fixed_trace(args)
    probes: list[dict[str, Any]] = []
    try:
        if args.rate:
            probes.append(probe(args, args.rate))
            sustained = args.rate if probes[-1]["sustained"] else 0.0
        else:
            lo, hi = 0.0, math.inf
            rate = args.start_rate
            while hi == math.inf or (hi - lo) > args.precision * max(lo, 1.0):
                res = probe(args, rate)
                probes.append(res)
                if res["sustained"]:
                    lo = rate
                    rate = rate * 2 if hi == math.inf else (lo + hi) / 2
                else:
                    hi = rate
                    rate = (lo + hi) / 2 if lo > 0 else rate / 2
                if len(probes) > 30 or rate < 1000:
                    break
            sustained = lo
    except BenchInvariantError as exc:
        print(f"zserve bench-scheduler: INVARIANT BROKEN: {exc}", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "schema": "zserve-bench-scheduler/1",
        "models": args.models,
        "gpus": args.gpus,
        "policy": args.policy,
        "profile": {"alpha_ms": args.alpha_ms, "beta_ms": args.beta_ms, "slo_ms": args.slo_ms,
                    "max_batch": args.max_batch},
        "duration_s": args.duration,
        "max_lag_ms": args.max_lag_ms,
        "jitter_ms": args.jitter_ms,
        "clock": args.clock,
        "sustained_rps": sustained,
        "probes": probes,
        "python": sys.version.split()[0],
    }
    if args.profile and sustained > 0:
        report["cprofile"] = _profile(args, sustained * PROFILE_RATE_FRACTION)
    text = json.dumps(report, indent=2) + "\n"
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(f"sustained {sustained:.0f} r/s with {args.models} models, {args.gpus} GPUs "
          f"(policy {args.policy}, lag p99 <= {args.max_lag_ms} ms, bad rate <= 1%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
