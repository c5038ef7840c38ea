"""The open-loop generator against a real ZeroMQ echo/delay server in a spawned process.

The echo server (zserve.loadgen.bench.echo) speaks the real wire protocol, so these tests run the
generator's whole path: codec, DEALER socket, reply matching, outcome rules, workers, lateness.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from zserve.loadgen import schedules
from zserve.loadgen.bench.echo import EchoConfig, EchoServer
from zserve.loadgen.generator import run_load
from zserve.loadgen.load_plan import BailRule, GeneratorBehindError, LoadPlan, Outcome, build_plan
from zserve.loadgen.sender import WorkerSpec, peek_answers, send_loop
from zserve.loadgen.workload import ArrivalSpec
from zserve.transport import codec, socket_io
from zserve.transport.messages import (
    ClientHello,
    InferAnswers,
    InferError,
    InferReply,
    InferRequest,
    InferRequests,
    Message,
    StatsReply,
)
from zserve.transport.sockets import make_router

# Generous: these tests check behaviour, not this (shared, noisy) machine's timing.
RELAXED_BOUND_MS = 1000.0
INPUTS = {"a": {"x": np.zeros(4, dtype=np.float32)}, "b": {"x": np.ones(2, dtype=np.float32)}}


def _plan(rate: float, measure_s: float, slo_ms: float = 200.0, seed: int = 5) -> LoadPlan:
    return build_plan(
        models=["a", "b"],
        slo_ms=[slo_ms, slo_ms],
        shares=[3.0, 1.0],
        schedule=schedules.constant(rate, measure_s),
        arrival=ArrivalSpec.parse("poisson"),
        warmup_s=0.1,
        cooldown_s=0.05,
        seed=seed,
    )


@pytest.fixture(scope="module")
def echo() -> Iterator[EchoServer]:
    with EchoServer(EchoConfig(service_ms=1.0, error_every=10)) as server:
        yield server


def test_open_loop_run_records_every_request(echo: EchoServer, tmp_path: Path) -> None:
    plan = _plan(400.0, 0.5)
    result = run_load(plan, echo.address, inputs=INPUTS, lateness_bound_ms=RELAXED_BOUND_MS)
    assert not np.any(np.isnan(result.sent_s))
    assert not np.any(result.outcome == Outcome.UNSENT)
    # Every request was answered: 1 in 10 with OVERLOADED (an ERROR), the rest in time (GOOD).
    assert not np.any(result.outcome == Outcome.TIMEOUT)
    errors = result.outcome == Outcome.ERROR
    assert 0.05 < errors.mean() < 0.15
    assert set(result.error_counts()) == {"OVERLOADED"}
    assert np.all(result.outcome[~errors] == Outcome.GOOD)
    assert np.all(result.latency_s[~errors] > 0)
    counts = result.outcome_counts()
    assert sum(counts.values()) == int(plan.measured.sum())
    assert result.goodput_rps == pytest.approx(counts["good"] / plan.measure_s)
    assert result.lateness.max_ms >= result.lateness.p50_ms >= 0.0
    assert 0.05 < max(result.bad_rates()) < 0.2
    # Per-request records: model, send time, reply time, outcome, error kind.
    result.save(tmp_path / "records.npz")
    with np.load(tmp_path / "records.npz") as saved:
        np.testing.assert_array_equal(saved["outcome"], result.outcome)
        np.testing.assert_array_equal(saved["sent_s"], result.sent_s)
        assert list(saved["models"]) == ["a", "b"]
        kinds = saved["error_kinds"][saved["error_kind"][saved["error_kind"] >= 0]]
        assert set(kinds) == {"OVERLOADED"}


def test_an_error_in_the_monitor_ends_the_run(echo: EchoServer) -> None:
    """The reactor only logs what its handlers raise; the worker's loop must end with it
    instead (a monitor or a bug that fails would otherwise leave the run hanging)."""

    def failing_monitor(counters: object, lag_s: float) -> str | None:
        raise RuntimeError("monitor failed")

    spec = WorkerSpec(echo.address, _plan(400.0, 5.0), INPUTS, b"failing-monitor")
    with pytest.raises(RuntimeError, match="monitor failed"):
        send_loop(spec, time.monotonic(), failing_monitor)


def test_sends_on_schedule_without_waiting_for_replies() -> None:
    """The server answers after 2 s; every request is sent long before the first reply, and the
    ones past their SLO with no answer by the end of the run are TIMEOUT (bad)."""
    with EchoServer(EchoConfig(service_ms=2000.0)) as slow:
        plan = _plan(300.0, 0.4, slo_ms=50.0)
        result = run_load(
            plan, slow.address, inputs=INPUTS, reply_grace_s=0.05,
            lateness_bound_ms=RELAXED_BOUND_MS,
        )
    assert not np.any(np.isnan(result.sent_s))
    assert np.all(result.outcome == Outcome.TIMEOUT)
    assert result.bad_rates() == [1.0, 1.0]
    assert result.goodput_rps == 0.0


def test_slow_replies_are_late_not_good() -> None:
    with EchoServer(EchoConfig(service_ms=30.0)) as server:
        plan = _plan(200.0, 0.3, slo_ms=10.0)
        result = run_load(plan, server.address, inputs=INPUTS, lateness_bound_ms=RELAXED_BOUND_MS)
    measured = plan.measured
    assert np.all(result.outcome[measured] == Outcome.LATE)
    assert np.all(result.latency_s[measured] >= 0.03)


def test_workers_split_the_plan(echo: EchoServer) -> None:
    plan = _plan(600.0, 0.5, seed=11)
    result = run_load(
        plan, echo.address, inputs=INPUTS, workers=2, lateness_bound_ms=RELAXED_BOUND_MS
    )
    assert result.workers == 2
    assert not np.any(np.isnan(result.sent_s))
    assert not np.any(np.isin(result.outcome, [Outcome.UNSENT, Outcome.TIMEOUT]))
    # Both workers sent on the same clock: the union follows the plan.
    assert np.all(result.sent_s >= plan.times_s - 1e-6)


def test_clearly_failing_run_stops_early() -> None:
    with EchoServer(EchoConfig(service_ms=0.5, error_every=2)) as failing:
        plan = _plan(500.0, 5.0)
        result = run_load(
            plan, failing.address, inputs=INPUTS, lateness_bound_ms=RELAXED_BOUND_MS,
            bail=BailRule(bad_budget=0.01),
        )
    assert result.stopped_early is not None and "early stop" in result.stopped_early
    assert np.count_nonzero(result.outcome == Outcome.UNSENT) > len(plan) // 2


def test_generator_that_cannot_keep_up_is_refused(echo: EchoServer) -> None:
    """One worker asked for an absurd rate: the run is refused with the lateness figure."""
    plan = build_plan(
        models=["a"], slo_ms=[100.0], shares=[1.0],
        schedule=schedules.constant(300_000.0, 0.5), arrival=ArrivalSpec.parse("constant"),
        warmup_s=0.05,
    )
    with pytest.raises(GeneratorBehindError, match=r"p99 lateness \d+\.\d+ ms") as info:
        run_load(plan, echo.address, inputs=INPUTS, lateness_bound_ms=5.0)
    lateness = info.value.result.lateness
    assert lateness.behind
    assert max(lateness.quantile_ms, lateness.abandoned_lag_ms or 0.0) > 5.0


def test_peek_answers_reads_every_answer_form() -> None:
    y = {"y": np.zeros((1, 1), np.float32)}

    def peek(message: Message) -> list[tuple[int, str | None]]:
        return peek_answers([bytes(codec.encode(message)[0])])

    assert peek(InferReply(3, y)) == [(3, None)]
    assert peek(InferError(4, "DEADLINE", "late")) == [(4, "DEADLINE")]
    assert peek(InferAnswers([1, 2], [y, y], [5], ["OVERLOADED"], ["busy"])) == [
        (1, None), (2, None), (5, "OVERLOADED"),
    ]
    assert peek(InferAnswers([], [], [], [], [])) == []
    assert peek(StatsReply("p", {})) == []
    for header in (
        ["answers", [1, 2], [{}], [], [], []],  # parallel lists that disagree
        ["answers", [1], [{}], [2], ["E"], []],
        ["answers", ["1"], [{}], [], [], []],  # an id that is not an int
        ["answers", [], [], [True], ["E"], ["m"]],
        ["answers", [], [], [1], [7], ["m"]],  # an error kind that is not a str
        ["answers", [1], [{}]],
        ["reply", "3", {}],
        ["error", 4, 5, "m"],
    ):
        assert peek_answers([msgpack.packb(header)]) == [], header
    assert peek_answers([b"\xc1 not msgpack"]) == []


class _BatchingFrontend:
    """A stand-in frontend answering each burst of requests in one InferAnswers (every fifth
    with OVERLOADED), as the real one does for a client that says it accepts that."""

    def __init__(self, tmp: Path) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock, self.address = make_router(self.ctx, f"ipc://{tmp}/batching")
        self.hello: ClientHello | None = None
        self.answers_sent = 0
        self.batched_requests = 0  # those that came in an InferRequests
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20, zmq.POLLIN):
                continue
            burst: list[int] = []
            identity: bytes | None = b""
            while self.sock.poll(0, zmq.POLLIN):
                identity, message = socket_io.sync_recv(self.sock, router=True)
                assert identity is not None
                if isinstance(message, ClientHello):
                    self.hello = message
                elif isinstance(message, InferRequest):
                    burst.append(message.request_id)
                elif isinstance(message, InferRequests):  # requests due at once: one message
                    burst.extend(message.request_ids)
                    self.batched_requests += len(message.request_ids)
            if burst:
                ok = [i for i in burst if i % 5]
                failed = [i for i in burst if not i % 5]
                outputs = [{"y": np.zeros((1, 1), np.float32)} for _ in ok]
                answers = InferAnswers(ok, outputs, failed, ["OVERLOADED"] * len(failed),
                                       ["busy"] * len(failed))
                socket_io.sync_send(self.sock, answers, identity=identity)
                self.answers_sent += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


def test_answers_coalesced_per_batch_settle_every_request(tmp_path: Path) -> None:
    server = _BatchingFrontend(tmp_path)
    try:
        plan = _plan(400.0, 0.4)
        result = run_load(plan, server.address, inputs=INPUTS, lateness_bound_ms=RELAXED_BOUND_MS)
    finally:
        server.close()
    assert server.hello == ClientHello(accepts=[InferAnswers.KIND])
    assert server.answers_sent > 0
    ids = np.arange(len(plan))
    failed = ids % 5 == 0
    assert np.all(result.outcome[failed] == Outcome.ERROR)
    assert np.all(result.outcome[~failed] == Outcome.GOOD)
    assert set(result.error_counts()) == {"OVERLOADED"}


def test_requests_due_at_once_go_in_one_message_and_each_is_settled(tmp_path: Path) -> None:
    server = _BatchingFrontend(tmp_path)
    try:
        # 5,000 r/s: a timer pass finds several requests due (the loop wakes in ~1 ms steps).
        plan = _plan(5_000.0, 0.2)
        result = run_load(plan, server.address, inputs=INPUTS, lateness_bound_ms=RELAXED_BOUND_MS)
    finally:
        server.close()
    assert server.batched_requests > 0
    failed = np.arange(len(plan)) % 5 == 0
    assert np.all(result.outcome[failed] == Outcome.ERROR)
    assert np.all(result.outcome[~failed] == Outcome.GOOD)
