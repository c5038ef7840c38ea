"""The frontend process against test-owned shard, rank and backend sockets: admission, input
store, fetch service, answers, cancellation, disconnects, deadlines, malformed input, drain."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from runtime_helpers import (
    FrontendHarness,
    emulated_cluster,
    fetch,
    meta_ids,
    recv,
    run_batch,
    sample,
    stats,
    wait_stats,
)

import zserve
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.transport import codec, socket_io
from zserve.transport.messages import (
    BackendGone,
    ClientHello,
    DropNotice,
    InferAnswers,
    InferError,
    InferReply,
    InferRequest,
    InferRequests,
    Shutdown,
    StatsReply,
    StatsRequest,
)
from zserve.transport.sockets import make_dealer


@pytest.fixture
def frontend(tmp_path: Any) -> Iterator[FrontendHarness]:
    harness = FrontendHarness(str(tmp_path), emulated_cluster())
    yield harness
    harness.close()


def make_frontend(tmp_path: Any, **overrides: Any) -> FrontendHarness:
    return FrontendHarness(str(tmp_path), emulated_cluster(**overrides))


def test_requests_get_their_own_outputs(frontend: FrontendHarness) -> None:
    frontend.backend_table(["backend-0"], [["m"]])
    backend = frontend.backend()
    with zserve.Client(frontend.client_address, timeout=10) as client:
        futures = [client.submit("m", sample(i)) for i in range(20)]
        ids = meta_ids(frontend, 20)
        reply = run_batch(backend, ids)
        assert reply.missing == []
        for i, future in enumerate(futures):
            assert future.result(10)["y"][0, 0] == pytest.approx(8.0 * i)
        # Once fetched and answered the frontend holds nothing.
        assert stats(frontend)["pending"] == 0
        # A second fetch of answered requests finds them gone.
        assert fetch(backend, ids[:3], plan_id=2).missing == ids[:3]


def test_bad_requests_are_typed(frontend: FrontendHarness) -> None:
    # The frontend validates against the signature its backends registered (passed on by rank).
    signature = ModelSignature("m", (TensorSpec("x", "float32", (4,)),),
                               (TensorSpec("y", "float32", (1,)),))
    frontend.backend_table(["backend-0"], [["m"]], [{"m": signature.to_dict()}])
    wait_stats(frontend, lambda st: st["backends"] == ["backend-0"])
    with zserve.Client(frontend.client_address, timeout=10) as client:
        with pytest.raises(zserve.BadRequestError, match="unknown model"):
            client.infer("nope", sample(1))
        with pytest.raises(zserve.BadRequestError, match="shape"):
            client.infer("m", {"x": np.zeros((1, 5), np.float32)})
        with pytest.raises(zserve.BadRequestError, match="dtype"):
            client.infer("m", {"x": np.zeros((1, 4), np.float64)})
        with pytest.raises(zserve.TooLargeError):
            client.infer("m", {"x": np.zeros((1, 4096), np.float32)})


def test_cancelled_request_is_not_executed(frontend: FrontendHarness) -> None:
    backend = frontend.backend()
    with zserve.Client(frontend.client_address, timeout=10) as client:
        keep, drop = client.submit("m", sample(1)), client.submit("m", sample(2))
        ids = meta_ids(frontend, 2)
        assert client.cancel(drop)
        with pytest.raises(zserve.CancelledError):
            drop.result(10)
        reply = run_batch(backend, ids)
        assert reply.missing == [ids[1]]
        assert keep.result(10)["y"][0, 0] == pytest.approx(8.0)


def test_drop_notice_answers_deadline(frontend: FrontendHarness) -> None:
    with zserve.Client(frontend.client_address, timeout=10) as client:
        future = client.submit("m", sample(1))
        (rid,) = meta_ids(frontend, 1)
        identity, _ = b"frontend-0", None
        socket_io.sync_send(frontend.shard, DropNotice([rid], "DEADLINE", "dropped"),
                            identity=identity)
        with pytest.raises(zserve.DeadlineError):
            future.result(10)


def test_deadline_timer_answers_unserved_request(tmp_path: Any) -> None:
    h = make_frontend(tmp_path, slo_ms=50.0)
    try:
        with zserve.Client(h.client_address, timeout=10) as client:
            start = time.monotonic()
            with pytest.raises(zserve.DeadlineError):
                client.infer("m", sample(1))
            assert time.monotonic() - start < 5.0
            assert stats(h)["pending"] == 0
    finally:
        h.close()


@pytest.mark.parametrize("how", ["restart", "table", "announced"])
def test_fetched_requests_fail_when_their_backend_dies(frontend: FrontendHarness, how: str) -> None:
    frontend.backend_table(["backend-0"], [["m"]])
    backend = frontend.backend(pid=100)
    with zserve.Client(frontend.client_address, timeout=10) as client:
        future = client.submit("m", sample(1))
        ids = meta_ids(frontend, 1)
        fetch(backend, ids)
        if how == "restart":
            frontend.backend(pid=101)  # same name, new pid: a new incarnation
        elif how == "announced":  # the supervisor saw its process die
            frontend.control_send(BackendGone(name="backend-0"))
        else:
            frontend.backend_table([], [])
        with pytest.raises(zserve.BackendFailedError):
            future.result(10)


def test_admission_limit_answers_overloaded(tmp_path: Any) -> None:
    h = make_frontend(tmp_path, max_queue=3)
    try:
        with zserve.Client(h.client_address, timeout=10, max_retries=0) as client:
            admitted = [client.submit("m", sample(i)) for i in range(3)]
            meta_ids(h, 3)
            with pytest.raises(zserve.OverloadedError):
                client.infer("m", sample(9))
            assert not any(f.done() for f in admitted)
            assert stats(h)["pending"] == 3
    finally:
        h.close()


def test_malformed_messages_are_counted_and_service_continues(frontend: FrontendHarness) -> None:
    raw = make_dealer(frontend.ctx, frontend.client_address, identity=b"raw-client")
    try:
        raw.send_multipart([b"\xc1garbage"])  # not msgpack
        raw.send_multipart([msgpack.packb(["infer", 7, "m", "not a map", 0.0])])
        _, answer = recv(raw, router=False)
        assert isinstance(answer, InferError) and answer.request_id == 7
        assert answer.error == "BAD_REQUEST"
        raw.send_multipart([msgpack.packb(["no-such-kind", 1])])
        _, answer = recv(raw, router=False)  # its id is recoverable too
        assert isinstance(answer, InferError) and answer.request_id == 1
        socket_io.sync_send(raw, StatsRequest(reset=False))  # a client may ask for the counters too
        _, reply = recv(raw, router=False)
        assert isinstance(reply, StatsReply) and reply.stats["counters"]["malformed"] == 3
        backend = frontend.backend()
        backend.send_multipart([b"\x00\x01"])  # garbage on the data socket too
        frontend.shard.send_multipart([b"frontend-0", b"\xff"])  # and from the shard
        with zserve.Client(frontend.client_address, timeout=10) as client:
            future = client.submit("m", sample(3))
            run_batch(backend, meta_ids(frontend, 1))
            assert future.result(10)["y"][0, 0] == pytest.approx(24.0)
        assert stats(frontend)["counters"]["malformed"] == 5
    finally:
        raw.close(linger=0)


def test_disconnected_client_requests_are_not_executed(frontend: FrontendHarness) -> None:
    raw = make_dealer(frontend.ctx, frontend.client_address, identity=b"vanishing")
    for i in range(10):
        socket_io.sync_send(raw, InferRequest(i, "m", sample(i)))
    ids = meta_ids(frontend, 10)
    raw.close(linger=0)  # no cancel: the connection just goes away
    backend = frontend.backend()
    # The disconnect reaches the frontend as a socket event; wait on its effect, not a clock.
    wait_stats(frontend, lambda st: st["pending"] == 0)
    assert fetch(backend, ids).missing == ids
    counters = stats(frontend)["counters"]
    assert counters["disconnect_cancelled"] == 10


def test_client_close_cancels_in_flight(frontend: FrontendHarness) -> None:
    backend = frontend.backend()
    client = zserve.Client(frontend.client_address, timeout=10)
    futures = [client.submit("m", sample(i)) for i in range(5)]
    ids = meta_ids(frontend, 5)
    client.close()
    assert all(f.done() for f in futures)
    wait_stats(frontend, lambda st: st["pending"] == 0)
    assert fetch(backend, ids).missing == ids


def test_drain_answers_shutting_down_and_exits_zero(frontend: FrontendHarness) -> None:
    backend = frontend.backend()
    with zserve.Client(frontend.client_address, timeout=10, max_retries=0) as client:
        served, stranded = client.submit("m", sample(1)), client.submit("m", sample(2))
        ids = meta_ids(frontend, 2)
        frontend.control_send(Shutdown("test", drain_s=5.0))
        wait_stats(frontend, lambda st: st["draining"])  # Shutdown comes on its own socket
        # Draining: new requests are refused, in-flight ones still complete.
        with pytest.raises(zserve.ShuttingDownError):
            client.infer("m", sample(3))
        run_batch(backend, ids[:1])
        assert served.result(10)["y"][0, 0] == pytest.approx(8.0)
        # The last one is never served: a second Shutdown makes the drain immediate.
        frontend.control_send(Shutdown("test", drain_s=0.0))
        with pytest.raises(zserve.ShuttingDownError):
            stranded.result(10)
    frontend.process.join(10)
    assert frontend.process.exitcode == 0


def test_a_batch_is_answered_in_one_message_to_a_client_that_accepts_it(
    frontend: FrontendHarness,
) -> None:
    frontend.backend_table(["backend-0"], [["m"]])
    backend = frontend.backend()
    raw = make_dealer(frontend.ctx, frontend.client_address, identity=b"batched-client")
    try:
        socket_io.sync_send(raw, ClientHello(accepts=[InferAnswers.KIND]))
        for i in range(6):
            socket_io.sync_send(raw, InferRequest(100 + i, "m", sample(i)))
        ids = meta_ids(frontend, 6)
        # One BatchOutputs for the first four, a DropNotice for the last two: two messages in,
        # so two InferAnswers out, each with every answer of its tick and nothing twice.
        run_batch(backend, ids[:4])
        _, answers = recv(raw, router=False)
        assert isinstance(answers, InferAnswers)
        assert answers.request_ids == [100, 101, 102, 103] and answers.error_ids == []
        for i, outputs in enumerate(answers.outputs):
            assert outputs["y"][0, 0] == pytest.approx(8.0 * i)
        socket_io.sync_send(frontend.shard, DropNotice(ids[4:], "DEADLINE", "late"),
                        identity=b"frontend-0")
        _, answers = recv(raw, router=False)
        assert isinstance(answers, InferAnswers)
        assert answers.request_ids == [] and answers.error_ids == [104, 105]
        assert answers.errors == ["DEADLINE", "DEADLINE"] and answers.messages == ["late"] * 2
        assert stats(frontend)["pending"] == 0
        # Requests refused at admission are answered the same way.
        socket_io.sync_send(raw, InferRequest(7, "nope", sample(1)))
        _, answers = recv(raw, router=False)
        assert isinstance(answers, InferAnswers)
        assert answers.error_ids == [7] and answers.errors == ["BAD_REQUEST"]
    finally:
        raw.close(linger=0)


def test_a_request_batch_is_served_request_by_request_and_a_malformed_one_answered_per_id(
    frontend: FrontendHarness,
) -> None:
    frontend.backend_table(["backend-0"], [["m"]])
    backend = frontend.backend()
    raw = make_dealer(frontend.ctx, frontend.client_address, identity=b"batching-client")
    try:
        socket_io.sync_send(raw, ClientHello(accepts=[InferAnswers.KIND]))
        socket_io.sync_send(raw, InferRequests([200, 201, 202], ["m", "nope", "m"],
                                               [sample(1), sample(2), sample(3)],
                                               [0.0, 0.0, 0.0]))
        _, refused = recv(raw, router=False)  # the unknown model, answered in its tick
        assert isinstance(refused, InferAnswers) and refused.error_ids == [201]
        run_batch(backend, meta_ids(frontend, 2))
        _, answers = recv(raw, router=False)
        assert isinstance(answers, InferAnswers) and answers.request_ids == [200, 202]
        assert [o["y"][0, 0] for o in answers.outputs] == [pytest.approx(8.0),
                                                            pytest.approx(24.0)]
        # A batch that does not decode (a model that is no string): each of its ids is answered.
        raw.send_multipart([msgpack.packb(["infers", [210, 211], ["m", 5], [{}, {}], [0.0, 0.0]])])
        errors: dict[int, str] = {}
        while len(errors) < 2:
            _, answer = recv(raw, router=False)
            assert isinstance(answer, InferError)
            errors[answer.request_id] = answer.error
        assert errors == {210: "BAD_REQUEST", 211: "BAD_REQUEST"}
    finally:
        raw.close(linger=0)


@pytest.mark.parametrize("hello", [None, ClientHello(accepts=[])], ids=["no-hello", "declined"])
def test_a_client_that_does_not_accept_answers_batches_gets_one_reply_per_request(
    frontend: FrontendHarness, hello: ClientHello | None
) -> None:
    frontend.backend_table(["backend-0"], [["m"]])
    backend = frontend.backend()
    raw = make_dealer(frontend.ctx, frontend.client_address, identity=b"plain-client")
    try:
        if hello is not None:
            socket_io.sync_send(raw, hello)
        for i in range(3):
            socket_io.sync_send(raw, InferRequest(i, "m", sample(i)))
        run_batch(backend, meta_ids(frontend, 3))
        replies = []
        for _ in range(3):
            assert raw.poll(10_000, zmq.POLLIN)
            frames = raw.recv_multipart()
            # One InferReply per request; its small outputs ride inline like everyone's.
            output = msgpack.unpackb(frames[0])[2]["y"]
            assert type(output[2]) is bytes and len(frames) == 1
            replies.append(codec.decode(frames))
        assert sorted(r.request_id for r in replies if isinstance(r, InferReply)) == [0, 1, 2]
    finally:
        raw.close(linger=0)
