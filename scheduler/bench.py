"""``zserve bench-scheduler --models M --gpus G [--rate R] --json OUT``: scheduler-only throughput.

The scheduler alone in one process on one core (Symphony Figure 13 left): M ModelThreads and one
RankThread hosted exactly as the simulator hosts them, no sockets, requests generated in-process
(Poisson per model, equal popularity) against the *real* clock (``time.perf_counter``), and
emulated GPUs that run each plan from ``exec_at`` to ``exec_at + l(bs)``.

The clock is, by default, the loop thread's own CPU time (``time.thread_time``): exactly what a
dedicated, pinned core would see, and immune to other processes preempting this one on a shared
machine (``--clock wall`` uses ``time.perf_counter``). Each loop iteration reads the clock, hands
every model the chunk of its requests whose arrival
time has passed (so chunks grow when the loop falls behind, as a frontend's per-tick coalescing
does), runs the timers that are due, and delivers every message at once. A probe at rate R lasts
``--duration`` seconds and *sustains* R when

- the lag (delivery time - arrival time of a chunk's first request) has p99 <= 2 ms
  (``--max-lag-ms``), the authors' stress criterion, and
- the schedule stays correct: every invariant holds (no GPU overlap, no plan after its exec time,
  no batch past its latest moment, every request ends exactly once) and the worst per-model bad
  rate is <= 1%.

Without ``--rate`` it searches: doubling from ``--start-rate`` then bisecting to 5%; the JSON has
``sustained_rps`` and every probe. ``--profile`` adds a cProfile of one probe at the found rate.

The default emulated model is fast enough that GPUs are never the bottleneck at 100 GPUs:
l(b) = 0.005 ms * b + 2 ms, SLO 50 ms, max batch 512.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import heapq
import io
import json
import math
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from zserve.scheduler.common import FEASIBILITY_EPS_S, Outbox
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.policy import SchedulePolicy
from zserve.scheduler.profiles import LatencyProfile
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import BatchPlan, CandidateUpdate, DropNotice, GrantAnswer

FRONTEND = "bench"
SLOW_ITERATION_S = 0.001  # loop iterations longer than this are listed in the result
GEN_BLOCK_S = 0.01  # arrivals are generated in-process in blocks of this many seconds


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
        self.models = [
            ModelThread(f"m{i}", self.profile, self.slo_s, policy, jitter_s=args.jitter_ms / 1e3)
            for i in range(self.m)
        ]
        self.index = {mt.model: i for i, mt in enumerate(self.models)}
        self.rank = RankThread(list(range(args.gpus)), 0.0)
        self.rng = np.random.default_rng(args.seed)
        self.per_model_rate = rate / self.m
        capacity = int(rate * (args.duration + 1) * 1.2 + 1000)
        self.arrival = np.zeros(capacity)
        self.status = np.zeros(capacity, dtype=np.int8)  # 0 pending, 1 good, 2 late, 3 dropped
        self.next_id = 0
        self.gpu_busy_until = [0.0] * args.gpus
        self.pending: list[list[float]] = [[] for _ in range(self.m)]  # generated, not delivered
        self.pending_pos = [0] * self.m
        self.generated_until = 0.0
        self.next_t = [float(t) for t in self.rng.exponential(1.0 / self.per_model_rate, self.m)]
        self.lags: list[float] = []
        self.slow_iterations: list[tuple[float, float]] = []  # (start s, duration ms)
        self.timer_fires = 0
        self.busy_s = 0.0  # loop time spent in iterations that did work
        self.timers: list[tuple[float, int, int]] = []  # (wake, kind 0 model / 1 rank, idx)
        self.model_wake = [math.inf] * self.m
        self.rank_wake = math.inf
        self.chunks = 0
        self.plans = 0
        self.planned = 0
        self.dropped = 0

    # ------------------------------------------------------------------ generation

    def _generate(self, until: float) -> None:
        """Poisson arrivals per model up to ``until`` (in-process, in blocks)."""
        lam = self.per_model_rate
        for i in range(self.m):
            first = self.next_t[i]
            horizon = until - first
            n = int(lam * max(horizon, 0.0) * 1.2 + 10 * math.sqrt(lam * horizon + 1) + 10)
            gaps = self.rng.exponential(1.0 / lam, n)
            gaps[0] = 0.0
            times = first + np.cumsum(gaps)
            while times[-1] < until:
                more = times[-1] + np.cumsum(self.rng.exponential(1.0 / lam, n))
                times = np.concatenate([times, more])
            cut = int(np.searchsorted(times, until))
            self.next_t[i] = float(times[cut])  # the first arrival of the next block
            rest = self.pending[i][self.pending_pos[i] :]
            rest.extend(times[:cut].tolist())
            self.pending[i] = rest
            self.pending_pos[i] = 0
        self.generated_until = until
        total = self.next_id + sum(len(p) for p in self.pending)
        if total > len(self.arrival):
            size = 2 * total
            self.arrival = np.resize(self.arrival, size)
            status = np.zeros(size, dtype=np.int8)
            status[: len(self.status)] = self.status
            self.status = status

    # ------------------------------------------------------------------ plumbing

    def _dispatch(self, now: float, outbox: Outbox) -> None:
        rank = self.rank
        pos = 0
        touched: list[int] = []
        while pos < len(outbox):
            dest, msg = outbox[pos]
            pos += 1
            kind = dest[0]
            if kind == "rank":
                if type(msg) is CandidateUpdate:
                    rank.on_candidate(now, msg, outbox)
                else:
                    assert isinstance(msg, GrantAnswer)
                    rank.on_grant_answer(now, msg, outbox)
            elif kind == "model":
                i = self.index[str(dest[1])]
                self.models[i].on_grant(now, msg, outbox)
                touched.append(i)
            elif kind == "backend":
                assert isinstance(msg, BatchPlan)
                self._on_plan(now, msg)
            else:
                assert isinstance(msg, DropNotice)
                ids = np.array(msg.request_ids, dtype=np.int64)
                if np.any(self.status[ids] != 0):
                    raise BenchInvariantError("a dropped request had already ended")
                self.status[ids] = 3
                self.dropped += len(ids)
        outbox.clear()
        for i in touched:
            self._resched_model(i)
        wake = rank.wake_at
        if wake != self.rank_wake:
            self.rank_wake = wake
            if wake < math.inf:
                heapq.heappush(self.timers, (wake, 1, -1))

    def _resched_model(self, i: int) -> None:
        wake = self.models[i].wake_at
        if wake != self.model_wake[i]:
            self.model_wake[i] = wake
            if wake < math.inf:
                heapq.heappush(self.timers, (wake, 0, i))

    def _on_plan(self, now: float, plan: BatchPlan) -> None:
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

    # ------------------------------------------------------------------ run

    def run(self) -> dict[str, Any]:
        duration = self.args.duration
        outbox: Outbox = []
        models = self.models
        timers = self.timers
        pending = self.pending
        pending_pos = self.pending_pos
        slo = self.slo_s
        lags = self.lags
        self._generate(GEN_BLOCK_S)
        clock = time.thread_time if self.args.clock == "cpu" else time.perf_counter
        # The scheduler's objects form no reference cycles; a cyclic-GC pass over a heap of
        # millions of queued ids stalls the loop for tens of ms, so the host turns it off (the
        # process runtime should do the same).
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        t0 = clock()
        now = 0.0
        iter_start = 0.0
        slow = self.slow_iterations
        work_mark = 0
        while True:
            now = clock() - t0
            if now - iter_start > SLOW_ITERATION_S:
                slow.append((round(iter_start, 4), round((now - iter_start) * 1e3, 3)))
            mark = self.chunks + self.timer_fires
            if mark != work_mark:  # the iteration did work (not an idle spin)
                self.busy_s += now - iter_start
                work_mark = mark
            iter_start = now
            if now >= duration:
                break
            if now + GEN_BLOCK_S > self.generated_until:
                self._generate(self.generated_until + GEN_BLOCK_S)
                now = clock() - t0
            for i in range(self.m):
                times = pending[i]
                start = pending_pos[i]
                if start >= len(times) or times[start] > now:
                    continue
                stop = start + 1
                n_times = len(times)
                # gallop then scan: arrivals with time <= now
                step = 1
                while stop + step < n_times and times[stop + step] <= now:
                    stop += step
                    step *= 2
                while stop < n_times and times[stop] <= now:
                    stop += 1
                chunk = times[start:stop]
                pending_pos[i] = stop
                first = self.next_id
                count = stop - start
                self.next_id = first + count
                self.arrival[first : first + count] = chunk
                lags.append(now - chunk[0])
                models[i].on_arrivals(
                    now, FRONTEND, range(first, first + count), chunk,
                    [t + slo for t in chunk], outbox,
                )
                self.chunks += 1
                self._dispatch(now, outbox)
                self._resched_model(i)
                if timers and timers[0][0] <= now:
                    self._run_timers(now, outbox)
            now = clock() - t0
            self._run_timers(now, outbox)
        elapsed = clock() - t0
        if gc_was_enabled:
            gc.enable()
        gc.unfreeze()
        return self._result(elapsed)

    def _run_timers(self, now: float, outbox: Outbox) -> None:
        timers = self.timers
        models = self.models
        while timers and timers[0][0] <= now:
            wake, kind, idx = heapq.heappop(timers)
            self.timer_fires += 1
            if kind == 0:
                if self.model_wake[idx] != wake:
                    continue
                self.model_wake[idx] = math.inf
                models[idx].on_timer(now, outbox)
                self._dispatch(now, outbox)
                self._resched_model(idx)
            else:
                if self.rank_wake != wake:
                    continue
                self.rank_wake = math.inf
                self.rank.on_timer(now, outbox)
                self._dispatch(now, outbox)

    def _result(self, elapsed: float) -> dict[str, Any]:
        n = self.next_id
        warm = self.arrival[:n] >= 0.5  # skip the first half second (rate meter warm-up)
        status = self.status[:n]
        # requests still queued at the end are neither good nor bad yet: leave them out
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
            "delivered": n,
            "delivered_rps": round(n / elapsed, 1),
            "busy_fraction": round(self.busy_s / elapsed, 4),
            "cpu_us_per_request": round(self.busy_s / max(1, n) * 1e6, 4),
            "capacity_rps": round(n / self.busy_s, 1) if self.busy_s > 0 else None,
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
            "mean_chunk": round(n / max(1, self.chunks), 2),
            "plans": self.plans,
            "mean_batch": round(self.planned / max(1, self.plans), 2),
            "gpus_used": int(sum(1 for t in self.gpu_busy_until if t > 0)),
            "rank_grants": self.rank.n_grants,
        }


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
    return p


def probe(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    result = _Probe(args, rate).run()
    print(f"  {rate:12.0f} r/s: busy {result['busy_fraction']:.2f}, "
          f"lag p99 {result['lag_ms']['p99']:.3f} ms, bad "
          f"{result['bad_rate']:.3%}, chunk {result['mean_chunk']}, batch {result['mean_batch']}"
          f" -> {'ok' if result['sustained'] else 'FAIL'}", file=sys.stderr)
    return result


def _profile(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    prof = cProfile.Profile()
    prof.enable()
    result = _Probe(args, rate).run()
    prof.disable()
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream).sort_stats("tottime")
    stats.print_stats(15)
    text = stream.getvalue()
    return {"rate_rps": rate, "result_under_profiler": result, "top_tottime": text.splitlines()}


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        SchedulePolicy.parse(args.policy)
    except ValueError as exc:
        print(f"zserve bench-scheduler: {exc}", file=sys.stderr)
        return 2
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
        report["cprofile"] = _profile(args, sustained)
    text = json.dumps(report, indent=2) + "\n"
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(f"sustained {sustained:.0f} r/s with {args.models} models, {args.gpus} GPUs "
          f"(policy {args.policy}, lag p99 <= {args.max_lag_ms} ms, bad rate <= 1%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
