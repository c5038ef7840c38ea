"""A backend that hangs (SIGSTOP) under open-loop load, in a real cluster of three emulated
backends: how many requests fail, and how soon the scheduler stops planning onto it.

The scheduler notices a hung backend by the plan it does not acknowledge (sent by the backend's
batch loop on its next ``BatchStats`` to the shard, or alone as ``PlanAck`` within
``ACK_HOLD_S``): once a plan goes unacknowledged for its delivery allowance plus
``PLAN_ACK_MARGIN_S``, the shard marks the GPU suspect, the rank stops granting it, and the
requests of every unacknowledged plan go back to their ModelThread's queue. Only the requests
whose inputs the hung backend had already taken (its running batch, and at most one plan it
received ahead of it) may have run, and only those are answered ``BACKEND_FAILED``. After
SIGCONT the backend heartbeats again, comes back into use, and every request still has exactly
one answer, its own.

Run as a script for the figures (``python tests/faults/test_runtime_backend_hang.py [RUNS]``): the
median over RUNS runs of the requests that failed and of the time from SIGSTOP to the GPU leaving
the rank's table.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import zserve
from zserve.backends.emulated import EmulatedExecutor
from zserve.backends.host import build_executor
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config

MODEL = "m"
MAX_BATCH = 8
# l(b) = 2 b + 30 ms: batches of 32-46 ms, SLO 400 ms: wide margins on a loaded 2-core machine.
ALPHA_MS, BETA_MS, SLO_MS = 2.0, 30.0, 400.0
RATE_RPS = 80.0
WARMUP_S = 1.0
# How long the backend stays stopped after the scheduler stopped planning onto it (and at most
# STOP_MAX_S in all, for code that never notices).
STOPPED_AFTER_S = 0.5
STOP_MAX_S = 4.0
# Bounds the fix is held to (the unfixed scheduler took ~2-2.5 s; see docs/reliability.md).
DETECT_BOUND_S = 0.75
# What the hung backend can hold with its inputs taken: the batch it ran when it stopped and the
# plan it acknowledged ahead of it (deferred scheduling sends a GPU's next plan only
# d_ctrl + d_data * bs before it frees), with one more plan of slack for a late-running scheduler.
FAILED_BOUND = 3 * MAX_BATCH
POLL_S = 0.02
BACK_TIMEOUT_S = 15.0
REVIVED_BATCHES = 5  # batches the revived backend runs before the figures are read


def hang_config() -> ClusterConfig:
    return parse_config({
        "cluster": {"drain_s": 2.0},
        "scheduler": {"d_ctrl_ms": 5.0},
        "frontends": {"count": 1, "reply_allowance_ms": 20.0},
        "backends": {"count": 3, "device": "emulated"},
        "models": [{"name": MODEL, "slo_ms": SLO_MS, "max_batch": MAX_BATCH,
                    "emulated": {"alpha_ms": ALPHA_MS, "beta_ms": BETA_MS}}],
    })


class Scenario:
    """One run: load, SIGSTOP the busiest backend (GPU 0: the rank prefers low ids), SIGCONT,
    wait until it runs batches again; every answer is recorded."""

    def __init__(self, cluster: Cluster, config: ClusterConfig) -> None:
        self.cluster = cluster
        executor = build_executor("emulated", list(config.models))
        assert isinstance(executor, EmulatedExecutor)
        executor.load()
        self.executor = executor
        self.inputs = executor.synthetic_requests(MODEL, 64, seed=1)
        # per request: (input index, sent at, answered at, kind)
        self.answers: list[tuple[int, float, float, str]] = []
        self.messages: dict[str, str] = {}  # the first error message of each kind
        self.wrong_outputs = 0
        self.figures: dict[str, Any] = {}

    async def stats(self, name: str) -> dict[str, Any]:
        stats: dict[str, Any] = await asyncio.to_thread(self.cluster.stats, name)
        return stats

    async def rank_gpu(self) -> dict[str, Any]:
        gpus: dict[str, dict[str, Any]] = (await self.stats("shard-0"))["rank"]["gpus"]
        return gpus["0"]

    async def _answer(self, future: asyncio.Future[Any], index: int, sent: float) -> None:
        try:
            outputs = await future
            kind = "OK"
            expected = self.executor.expected_outputs(MODEL, self.inputs[index])
            if any(not (outputs[k] == v).all() for k, v in expected.items()):
                self.wrong_outputs += 1
        except zserve.ZServeError as exc:
            kind = exc.kind.value
            self.messages.setdefault(kind, str(exc))
        self.answers.append((index, sent, time.monotonic(), kind))

    async def load(self, client: zserve.AsyncClient, stop: asyncio.Event) -> None:
        """Open loop at RATE_RPS until ``stop``; every answer awaited."""
        tasks: list[asyncio.Task[None]] = []
        start = time.monotonic()
        n = 0
        while not stop.is_set():
            index = n % len(self.inputs)
            tasks.append(asyncio.create_task(self._answer(
                client.submit(MODEL, self.inputs[index]), index, time.monotonic())))
            n += 1
            await asyncio.sleep(max(0.0, start + n / RATE_RPS - time.monotonic()))
        await asyncio.gather(*tasks)

    async def run(self) -> None:
        stop = asyncio.Event()
        async with zserve.AsyncClient(self.cluster.client_address, timeout=10.0,
                                      max_retries=0) as client:
            loader = asyncio.create_task(self.load(client, stop))
            try:
                await asyncio.sleep(WARMUP_S)
                await self._hang_and_resume()
            finally:
                stop.set()
                await loader
            self.figures["unmatched_replies"] = client.unmatched_replies

    async def _hang_and_resume(self) -> None:
        # Imported here: run as a script (the figures), tests/ joins sys.path only in __main__.
        from runtime_helpers import wait_until_async

        victim = (await self.rank_gpu())["name"]
        pid = self.cluster.pids()[victim]
        assert pid is not None
        before = (await self.stats(victim))["counters_total"]["batches_ok"]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        self.figures["stopped_at"] = stopped_at
        try:
            while (await self.rank_gpu())["alive"] and time.monotonic() - stopped_at < STOP_MAX_S:
                await asyncio.sleep(POLL_S)
            self.figures["detect_s"] = time.monotonic() - stopped_at
            await asyncio.sleep(STOPPED_AFTER_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed_at = time.monotonic()

        async def batches_ok() -> int:
            return int((await self.stats(victim))["counters_total"]["batches_ok"])

        async def back_in_use() -> bool:
            return bool((await self.rank_gpu())["alive"]) and await batches_ok() > before + 1

        # Back into use: alive in the rank's table and running batches again.
        await wait_until_async(back_in_use, "the backend back in use", timeout_s=BACK_TIMEOUT_S,
                               interval_s=POLL_S)
        self.figures["back_s"] = time.monotonic() - resumed_at
        # some load on the revived backend: a few more batches of its own, not a guessed time
        back = await batches_ok()

        async def ran_more() -> bool:
            return await batches_ok() >= back + REVIVED_BATCHES

        await wait_until_async(ran_more, f"{REVIVED_BATCHES} more batches on the revived backend",
                               timeout_s=BACK_TIMEOUT_S, interval_s=POLL_S)
        self.figures["victim"] = (await self.stats(victim))["counters_total"]
        self.figures["frontend"] = (await self.stats("frontend-0"))["counters"]
        shard = await self.stats("shard-0")
        self.figures["shard"] = shard["counters"]
        self.figures["rank"] = shard["rank"]["counters"]

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for _, _, _, kind in self.answers:
            kinds[kind] = kinds.get(kind, 0) + 1
        stopped_at = self.figures["stopped_at"]
        failed_at = [t for _, _, t, kind in self.answers if kind == "BACKEND_FAILED"]
        failed_sent = [sent for _, sent, _, kind in self.answers if kind != "OK"]
        victim = self.figures["victim"]
        return {
            "requests": len(self.answers),
            "answers": kinds,
            "backend_failed": kinds.get("BACKEND_FAILED", 0),
            "failed": len(self.answers) - kinds.get("OK", 0),
            "detect_s": round(self.figures["detect_s"], 3),
            # the last BACKEND_FAILED answer, and the last request sent that failed at all
            "failures_end_s": round(max(failed_at) - stopped_at, 3) if failed_at else 0.0,
            "failing_until_s": round(max(failed_sent) - stopped_at, 3) if failed_sent else 0.0,
            "back_s": round(self.figures["back_s"], 3),
            "replanned": self.figures["shard"].get("replanned"),
            "suspects": self.figures["rank"].get("suspects"),
            # what the resumed backend did with the plans it still held: inputs it found taken
            # (their requests re-planned and fetched elsewhere), rows shed late, late outputs
            "victim_missing": victim["requests_missing"],
            "victim_shed_late": victim["requests_shed_late"],
            "late_outputs": self.figures["frontend"].get("late_outputs"),
            "messages": self.messages,
            "wrong_outputs": self.wrong_outputs,
            "unmatched_replies": self.figures["unmatched_replies"],
        }


def run_scenario(base: Path) -> dict[str, Any]:
    config = hang_config()
    with Cluster(config, ipc_base=base) as cluster:
        scenario = Scenario(cluster, config)
        asyncio.run(scenario.run())
        return scenario.summary()


def test_backend_hang_under_load(tmp_path: Path) -> None:
    """SIGSTOP the busiest of three backends under load: the scheduler stops planning onto it
    within DETECT_BOUND_S, re-plans what it had not acknowledged, and fails only what it had
    taken; after SIGCONT it is used again, and every request has exactly one answer, its own."""
    result = run_scenario(tmp_path)
    print("backend hang:", result)
    answers = result["answers"]
    assert result["requests"] >= RATE_RPS * WARMUP_S, result
    assert result["wrong_outputs"] == 0 and result["unmatched_replies"] == 0, result
    # (UNAVAILABLE, never run, can come from a host so loaded that inputs take 50 ms to arrive)
    assert set(answers) <= {"OK", "BACKEND_FAILED", "DEADLINE", "UNAVAILABLE"}, result
    assert result["detect_s"] < DETECT_BOUND_S, result
    assert result["failures_end_s"] < DETECT_BOUND_S, result
    assert result["backend_failed"] <= FAILED_BOUND, result
    # BACKEND_FAILED only for requests whose inputs the hung backend had taken: after SIGCONT
    # each of them either ran (its outputs came late) or was shed late (it held it past its
    # deadline); a request it never took was planned again instead.
    assert result["backend_failed"] <= result["late_outputs"] + result["victim_shed_late"], result
    assert result["suspects"] >= 1 and result["replanned"] >= 1, result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: runtime_helpers
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    results = []
    for _ in range(runs):
        with contextlib.ExitStack() as stack:
            import tempfile

            base = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            results.append(run_scenario(base))
            print(results[-1], flush=True)
    print("median: failed", statistics.median(r["failed"] for r in results),
          "backend_failed", statistics.median(r["backend_failed"] for r in results),
          "detect_s", statistics.median(r["detect_s"] for r in results),
          "failures_end_s", statistics.median(r["failures_end_s"] for r in results),
          "failing_until_s", statistics.median(r["failing_until_s"] for r in results))
