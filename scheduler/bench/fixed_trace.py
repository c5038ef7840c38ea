"""``zserve bench-scheduler --fixed-trace R``: the scheduler's CPU per request on one fixed input.

The real-time probes of ``zserve.scheduler.bench.throughput`` find the rate one core sustains,
but their input depends on the machine (a slower loop takes bigger chunks, which cost less per
request), so two builds compared on a shared machine differ by more than their code does. This
mode takes the machine out of the input: one seeded Poisson trace per model at total rate R, fed
to the same ``SchedulerCore`` (ModelThreads and an embedded RankThread, the bench's model) on a
virtual clock that advances ``STEP_S`` per iteration, whatever the loop costs. Each iteration
fires the core's timer when due, then hands it every model's requests that arrived during the
step (at ``STEP_S`` = 250 us and 4.5 M r/s, chunks of about 56 requests, the real-time probe's
size at that rate). The schedule is identical on every machine and build that schedules alike;
the output gives its fingerprint (plans, requests planned) beside the CPU time, so an A/B
compares costs of identical work. Run it a few times and compare medians, or count instructions
(``valgrind --tool=lackey --basic-counts=yes``, two durations, the difference) where the machine
is busy.
"""

from __future__ import annotations

import argparse
import gc
import time
from bisect import bisect_right
from typing import Any

import numpy as np

from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.core.hosting import Outbox
from zserve.scheduler.core import SchedulerCore
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import BatchPlan

STEP_S = 250e-6  # virtual time per loop iteration
FRONTEND = "bench"


def _trace(models: int, rate: float, duration_s: float,
           seed: int) -> list[tuple[list[float], list[int]]]:
    """Per model: its arrival times in [0, duration_s) and their request ids."""
    rng = np.random.default_rng(seed)
    per_model = rate / models
    trace: list[tuple[list[float], list[int]]] = []
    next_id = 0
    for _ in range(models):
        gaps = rng.exponential(1.0 / per_model, int(per_model * duration_s * 1.2) + 16)
        times = np.cumsum(gaps)
        times = times[times < duration_s]
        trace.append((times.tolist(), list(range(next_id, next_id + len(times)))))
        next_id += len(times)
    return trace


def run_fixed_trace(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """Feed the trace through a fresh core; CPU seconds (process time) and the schedule's
    fingerprint."""
    profile = LatencyProfile.linear(args.alpha_ms, args.beta_ms, args.max_batch)
    slo_s = args.slo_ms / 1e3
    policy = SchedulePolicy.parse(args.policy)
    core = SchedulerCore("bench", rank=RankThread(list(range(args.gpus)), 0.0,
                                                  grant_order=policy.grant_order))
    outbox: Outbox = []
    for i in range(args.models):
        core.add_thread(0.0, ModelThread(f"m{i}", profile, slo_s, policy,
                                         jitter_s=args.jitter_ms / 1e3), outbox)
    names = list(core.threads)
    trace = _trace(args.models, rate, args.duration, args.seed)
    deadlines = [[t + slo_s for t in times] for times, _ in trace]
    left: list[Any] = []  # what the core left for the GPUs and the frontend
    positions = [0] * len(trace)
    gc.disable()
    try:
        started = time.process_time()
        now = 0.0
        while now < args.duration:
            now += STEP_S
            if core.wake_at <= now:
                core.on_timer(now, outbox)
                left.extend(msg for _, msg in outbox)
                outbox.clear()
            for i, (times, ids) in enumerate(trace):
                start = positions[i]
                if start >= len(times) or times[start] > now:
                    continue
                stop = bisect_right(times, now, start + 1)
                positions[i] = stop
                core.on_arrivals(now, names[i], FRONTEND, ids[start:stop], times[start:stop],
                                 deadlines[i][start:stop], outbox)
                if outbox:
                    left.extend(msg for _, msg in outbox)
                    outbox.clear()
        cpu_s = time.process_time() - started
    finally:
        gc.enable()
    requests = sum(len(times) for times, _ in trace)
    plans = [msg for msg in left if type(msg) is BatchPlan]
    return {"rate_rps": rate, "requests": requests, "cpu_s": round(cpu_s, 4),
            "cpu_ns_per_request": round(cpu_s / max(requests, 1) * 1e9, 1),
            "plans": len(plans), "planned": sum(len(p.request_ids) for p in plans),
            "messages": len(left)}


__all__ = ["STEP_S", "run_fixed_trace"]
