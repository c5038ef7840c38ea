"""The hot-spare scheduler in a whole cluster of real processes (``[scheduler] standby = true``):
the active scheduler SIGKILLed or SIGSTOPped under open-loop load from the public client. The
standby takes over; every request sent gets exactly one answer, its own outputs or a typed error;
a resumed old scheduler dispatches nothing and steps down (zserve.core.epochs, docs/runtime.md)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_helpers import wait_until

import zserve
from zserve.backends.emulated import EmulatedExecutor, EmulatedModel
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import STANDBY_NAME, ClusterConfig, parse_config

RATE_RPS = 40.0
REQUESTS = 200  # 5 s of load
FAULT_AT = 40  # the fault comes after this many requests (1 s)
SLO_MS = 2_000.0  # queued requests survive a ~1 s takeover on a loaded 2-core machine
# The release's quiet time is twice the longest SLO plus two heartbeats: 9 s, so backend-0 is
# still draining (and answers its stats) when the load's answers are checked.
RELEASE_SLO_MS = 4_000.0
WAIT_S = 20.0
# Answers a request may get when the scheduler fails under it (none is lost silently).
ALLOWED = {"OK", "DEADLINE", "UNAVAILABLE", "BACKEND_FAILED"}


def standby_cluster(takeover_timeout_ms: float = 1000.0) -> ClusterConfig:
    return parse_config(_standby_table(takeover_timeout_ms))


def _standby_table(takeover_timeout_ms: float = 1000.0) -> dict[str, Any]:
    return {
        "cluster": {"drain_s": 1.0},
        # Eager: a batch runs as soon as a GPU is free, so a loaded machine's lateness of tens
        # of ms costs no request (the deferred policy holds a lone one to its deadline's edge).
        "scheduler": {"standby": True, "policy": "eager", "d_ctrl_ms": 20.0,
                      "takeover_timeout_ms": takeover_timeout_ms},
        "frontends": {"reply_allowance_ms": 100.0},
        "backends": {"count": 2, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 2.0, "beta_ms": 20.0},
                    "slo_ms": SLO_MS, "max_batch": 16}],
    }


def _inputs(i: int) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.full((1, 4), float(i), np.float32)}


class OpenLoop:
    """Open-loop load from an AsyncClient on its own thread; ``sent_event`` is set once
    ``FAULT_AT`` requests are out; ``outcomes[i]`` is request i's answer kind."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.fault_point = threading.Event()
        self.outcomes: list[str] = []
        self.errors: list[str] = []  # the messages of the typed errors, for a failure's report
        self.sent_at: list[float] = []
        self.unmatched = -1
        self.error: BaseException | None = None
        self._executor = EmulatedExecutor([EmulatedModel("m", 2.0, 20.0, max_batch=16)])
        self._thread = threading.Thread(target=self._run, name="open-loop")

    def __enter__(self) -> OpenLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(timeout=60.0)
        assert not self._thread.is_alive(), "the load did not finish"
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            asyncio.run(self._drive())
        except BaseException as exc:
            self.error = exc

    async def _drive(self) -> None:
        async with zserve.AsyncClient(self.address, timeout=30.0, max_retries=0) as client:
            futures = []
            start = time.monotonic()
            for i in range(REQUESTS):
                delay = start + i / RATE_RPS - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing the open loop, not waiting for a state
                self.sent_at.append(time.monotonic())
                futures.append(client.submit("m", _inputs(i)))
                if i + 1 == FAULT_AT:
                    self.fault_point.set()
            _, pending = await asyncio.wait(futures, timeout=WAIT_S + SLO_MS / 1e3)
            assert not pending, f"{len(pending)} requests got no answer"
            # A duplicate answer would arrive unmatched: one more round trip lets it come in.
            with pytest.raises(zserve.BadRequestError):
                await client.infer("no-such-model", {})
            self.unmatched = client.unmatched_replies
            for i, future in enumerate(futures):
                self.outcomes.append(self._outcome(i, future))

    def _outcome(self, i: int, future: asyncio.Future[Any]) -> str:
        try:
            outputs = future.result()
        except zserve.ZServeError as exc:
            self.errors.append(f"{i}: {exc}")
            return exc.kind.value
        expected = self._executor.expected_outputs("m", _inputs(i))
        np.testing.assert_array_equal(outputs["y"], expected["y"])  # its own outputs
        return "OK"


def _active(cluster: Cluster) -> tuple[str, int]:
    view = cluster.stats("frontend-0")["scheduler"]
    return str(view["active"]), int(view["epoch"])


def _check_answers(load: OpenLoop, switched_at: float) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind in load.outcomes:
        counts[kind] = counts.get(kind, 0) + 1
    assert len(load.outcomes) == REQUESTS and load.unmatched == 0, counts
    assert set(counts) <= ALLOWED, counts
    after = [kind for kind, sent in zip(load.outcomes, load.sent_at, strict=True)
             if sent > switched_at]
    # Served after the takeover: outputs, or now and then UNAVAILABLE (never ran, the client
    # retries it) when a loaded host delays an input fetch past the backend's 50 ms wait.
    assert after and set(after) <= {"OK", "UNAVAILABLE"}, (counts, load.errors)
    assert after.count("OK") >= 0.9 * len(after), (counts, load.errors)
    return counts


def test_standby_takes_over_from_a_killed_scheduler(tmp_path: Path) -> None:
    with Cluster(standby_cluster(), ipc_base=tmp_path) as cluster:
        assert _active(cluster)[0] == "shard-0"
        old_epoch = _active(cluster)[1]
        with OpenLoop(cluster.client_address) as load:
            assert load.fault_point.wait(WAIT_S)
            cluster.kill("shard-0")
            wait_until(lambda: _active(cluster)[0] == STANDBY_NAME, "takeover", timeout_s=WAIT_S)
            switched_at = time.monotonic()  # the moment the takeover was seen
        epoch = _active(cluster)[1]
        assert epoch > old_epoch
        _check_answers(load, switched_at)
        cluster.wait_ready("shard-0", incarnation=2)  # restarted, as the standby
        restarted = cluster.stats("shard-0")
        assert not restarted["active"] and cluster.stats(STANDBY_NAME)["epoch"] == epoch
        for backend in ("backend-0", "backend-1"):
            assert cluster.stats(backend)["scheduler"]["epoch"] == epoch


def test_resumed_old_scheduler_dispatches_nothing_and_steps_down(tmp_path: Path) -> None:
    with Cluster(standby_cluster(), ipc_base=tmp_path) as cluster:
        old_epoch = _active(cluster)[1]
        with OpenLoop(cluster.client_address) as load:
            assert load.fault_point.wait(WAIT_S)
            cluster.kill("shard-0", signal.SIGSTOP)  # hung: its sockets stay open
            try:
                wait_until(lambda: _active(cluster)[0] == STANDBY_NAME, "takeover",
                           timeout_s=WAIT_S)
                switched_at = time.monotonic()  # the moment the takeover was seen
                before = _old_plans(cluster, old_epoch)
            finally:
                cluster.kill("shard-0", signal.SIGCONT)
            cluster.wait_ready("shard-0", incarnation=2)  # it stepped down, exited, restarted
        _check_answers(load, switched_at)
        # Whatever the resumed process planned, no backend took a plan of its epoch after the
        # takeover (they refuse it: stale_epoch), and it came back as the standby.
        assert _old_plans(cluster, old_epoch) == before
        assert not cluster.stats("shard-0")["active"]
        assert cluster.stats(STANDBY_NAME)["active"]


def test_a_drained_active_scheduler_hands_over_at_once(tmp_path: Path) -> None:
    """SIGTERM (a rolling restart's) of the active scheduler while its partner answers: it
    leaves at once without answering its queue SHUTTING_DOWN, the standby takes over when its
    connection closes (long before the 30 s takeover timeout: not by silence), the frontends
    re-send what they held, and it comes back as the standby."""
    with Cluster(standby_cluster(takeover_timeout_ms=30_000.0), ipc_base=tmp_path) as cluster:
        old_epoch = _active(cluster)[1]
        with OpenLoop(cluster.client_address) as load:
            assert load.fault_point.wait(WAIT_S)
            cluster.kill("shard-0", signal.SIGTERM)
            wait_until(lambda: _active(cluster)[0] == STANDBY_NAME, "handover",
                       timeout_s=WAIT_S)
            switched_at = time.monotonic()
        counts = _check_answers(load, switched_at)
        assert "DEADLINE" not in counts and "BACKEND_FAILED" not in counts, (counts, load.errors)
        assert _active(cluster)[1] > old_epoch
        cluster.wait_ready("shard-0", incarnation=2)
        assert not cluster.stats("shard-0")["active"]
        assert cluster.restart_history("shard-0")  # it exited (0) and was restarted


def _old_plans(cluster: Cluster, epoch: int) -> list[int]:
    """Plans of ``epoch`` each backend has accepted."""
    return [int(cluster.stats(b)["scheduler"]["plans_by_epoch"].get(str(epoch), 0))
            for b in ("backend-0", "backend-1")]


def test_a_release_in_progress_survives_a_takeover(tmp_path: Path) -> None:
    """The autoscaler releases backend-0 (the lowest GPU id, the first a grant would take) and
    the active scheduler is SIGKILLed mid-release. The standby that takes over learns the
    release from backend-0's registration (``retiring``): it grants backend-0 nothing in its
    epoch, backend-1 serves everything after the takeover, the release's drain goes on (backend-0
    exits and is not restarted), and every request gets exactly one answer."""
    # No advice acts here: nothing is ever bad enough to add (min_requests) or idle long
    # enough to release (down_hold_s), and the advice is read once (interval_s).
    config = parse_config({
        **_standby_table(),
        "models": [{"name": "m", "emulated": {"alpha_ms": 2.0, "beta_ms": 20.0},
                    "slo_ms": RELEASE_SLO_MS, "max_batch": 16}],
        "autoscale": {"enabled": True, "min_backends": 1, "interval_s": 3600.0,
                      "min_requests": 1_000_000, "down_hold_s": 3600.0},
    })
    with Cluster(config, ipc_base=tmp_path) as cluster:
        old_epoch = _active(cluster)[1]
        with OpenLoop(cluster.client_address) as load:
            assert load.fault_point.wait(WAIT_S)
            cluster.release_backend("backend-0")
            wait_until(lambda: cluster.stats("backend-0")["retiring"], "backend-0 retiring")
            cluster.kill("shard-0")
            wait_until(lambda: _active(cluster)[0] == STANDBY_NAME, "takeover", timeout_s=WAIT_S)
            switched_at = time.monotonic()
        epoch = _active(cluster)[1]
        assert epoch > old_epoch
        counts = _check_answers(load, switched_at)
        # Still draining (the release waits 2 SLOs before it asks for held plans): backend-0
        # took no plan of the new epoch, and the new active rank has it retired.
        taken = cluster.stats("backend-0")["scheduler"]["plans_by_epoch"]
        assert taken.get(str(epoch), 0) == 0, (taken, counts)
        assert cluster.stats("backend-1")["scheduler"]["plans_by_epoch"].get(str(epoch), 0) > 0
        gpus = cluster.stats(STANDBY_NAME)["rank"]["gpus"]
        assert gpus["0"]["retired"] and not gpus["1"]["retired"], gpus
        wait_until(lambda: ("exit", "backend-0") in {
            (what, name) for _, what, name in cluster.autoscale_events()},
            "backend-0 drained and released", timeout_s=WAIT_S + RELEASE_SLO_MS / 1e3 * 3)
        assert "backend-0" not in cluster.pids()
