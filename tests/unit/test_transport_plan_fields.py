"""The late-shedding and drift-correction fields on the wire: ``BatchPlan.finish_by`` and
``BatchStats.device_free_at`` round-trip (explicit values and defaults), the every-class samples
carry them, and malformed values are refused with a typed ProtocolError while the receiving loop
goes on. So do the acknowledgements a ``BatchStats`` carries (``acked_plan_ids``, ``ready_*``)."""

from __future__ import annotations

import re
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from transport_helpers import SAMPLE_MESSAGES, assert_messages_equal, recv_within

from zserve.core.errors import ProtocolError
from zserve.transport import codec, socket_io
from zserve.transport.messages import BatchPlan, BatchStats, CancelRequest, Message

Pair = tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
GOOD = CancelRequest(request_id=42)

PLAN = BatchPlan(3, "m", 1, 10.0, 10.02, ["ipc://fe"], [0, 0], [5, 6], [10.05, 10.25])
STATS = BatchStats(3, "m", 1, 2, 10.0, 10.001, 10.021, True, 0, 10.043)


def _pack(*items: Any) -> bytes:
    return msgpack.packb(list(items))


_PLAN_HEAD = ("plan", 3, "m", 1, 10.0, 10.02, ["ipc://fe"], [0, 0], [5, 6])
_STATS_HEAD = ("bstats", 3, "m", 1, 2, 10.0, 10.001, 10.021, True, 0)
# BatchStats.acked_plan_ids, ready_models, ready_delays, ready_rows: none
_NO_ACKS: tuple[list[Any], ...] = ([], [], [], [])
ACKING = BatchStats(4, "m", 1, 2, 10.0, 10.001, 10.021, True, 0, 10.043, [5, 7], ["m", "m"],
                    [0.002, 0.0031], [8, 6])

# name -> (frames, message fragment of the ProtocolError)
MALFORMED: dict[str, tuple[list[bytes], str]] = {
    "finish-by-not-list": ([_pack(*_PLAN_HEAD, 10.05, [], 0, 0.0, 0.0)], "BatchPlan.finish_by"),
    "finish-by-str-item": ([_pack(*_PLAN_HEAD, [10.05, "late"], [], 0, 0.0, 0.0)],
                           "BatchPlan.finish_by"),
    "finish-by-bool-item": ([_pack(*_PLAN_HEAD, [True, 10.0], [], 0, 0.0, 0.0)],
                            "BatchPlan.finish_by"),
    "finish-by-nested": ([_pack(*_PLAN_HEAD, [[10.05], [10.25]], [], 0, 0.0, 0.0)],
                         "BatchPlan.finish_by"),
    "plan-without-finish-by": ([_pack(*_PLAN_HEAD)], "BatchPlan has 13 fields"),
    "rows-str-item": ([_pack(*_PLAN_HEAD, [10.05, 10.25], [1, "2"], 0, 0.0, 0.0)],
                      "BatchPlan.rows"),
    "device-free-at-str": ([_pack(*_STATS_HEAD, "soon", *_NO_ACKS)], "BatchStats.device_free_at"),
    "device-free-at-bool": ([_pack(*_STATS_HEAD, True, *_NO_ACKS)], "BatchStats.device_free_at"),
    "device-free-at-list": ([_pack(*_STATS_HEAD, [1.0], *_NO_ACKS)], "BatchStats.device_free_at"),
    "device-free-at-none": ([_pack(*_STATS_HEAD, None, *_NO_ACKS)], "BatchStats.device_free_at"),
    "stats-without-device-free-at": ([_pack(*_STATS_HEAD)], "BatchStats has 14 fields"),
    "stats-without-acks": ([_pack(*_STATS_HEAD, 10.0)], "BatchStats has 14 fields"),
    "acked-plan-id-str": ([_pack(*_STATS_HEAD, 10.0, ["5"], [], [], [])],
                          "BatchStats.acked_plan_ids"),
    "ready-lists-differ": ([_pack(*_STATS_HEAD, 10.0, [5], ["m"], [0.002, 0.003], [8])],
                           "ready_delays"),
}


@pytest.mark.parametrize("message", [PLAN, STATS, ACKING], ids=["plan", "stats", "acking"])
def test_new_fields_round_trip(transport_pair: Pair, message: Message) -> None:
    router, dealer = transport_pair
    socket_io.sync_send(dealer, message)
    identity, received = recv_within(router, router=True)
    assert identity == b"peer-0"
    assert_messages_equal(received, message)
    assert received == message


def test_defaults_mean_unknown_and_round_trip() -> None:
    plan = BatchPlan(1, "m", 0, 1.0, 1.5, ["f"], [0], [9])
    stats = BatchStats(1, "m", 0, 1, 1.0, 1.0, 1.5, True)
    assert plan.finish_by == [] and stats.device_free_at == 0.0 and stats.acked_plan_ids == []
    assert codec.decode(codec.encode(plan)) == plan
    assert codec.decode(codec.encode(stats)) == stats


def test_ints_in_the_new_float_fields_become_floats() -> None:
    plan = codec.decode([_pack(*_PLAN_HEAD, [10, 11.5], [], 0, 0.0, 0.0)])
    stats = codec.decode([_pack(*_STATS_HEAD, 12, *_NO_ACKS)])
    assert isinstance(plan, BatchPlan) and plan.finish_by == [10.0, 11.5]
    assert all(type(x) is float for x in plan.finish_by)
    assert isinstance(stats, BatchStats) and type(stats.device_free_at) is float
    assert stats.device_free_at == 12.0


def test_every_class_samples_carry_the_new_fields() -> None:
    samples = {type(m): m for m in SAMPLE_MESSAGES}
    plan = samples[BatchPlan]
    stats = samples[BatchStats]
    assert isinstance(plan, BatchPlan) and isinstance(stats, BatchStats)
    assert len(plan.finish_by) == len(plan.request_ids) > 0
    assert stats.device_free_at > 0.0
    names = [f.name for f in msgspec.structs.fields(BatchPlan)]
    # the send time, then the reply allowance the plan was made with, came last
    assert names[-5:] == ["finish_by", "rows", "epoch", "sent_at", "reply_allowance"]
    assert [f.name for f in msgspec.structs.fields(BatchStats)][-5:] == [
        "device_free_at", "acked_plan_ids", "ready_models", "ready_delays", "ready_rows"]


@pytest.mark.parametrize("case", MALFORMED, ids=str)
def test_malformed_new_fields_raise_protocol_error(case: str) -> None:
    frames, fragment = MALFORMED[case]
    with pytest.raises(ProtocolError, match=re.escape(fragment)):
        codec.decode(frames)


@pytest.mark.parametrize("case", MALFORMED, ids=str)
def test_malformed_new_fields_are_rejected_and_the_loop_goes_on(
    transport_pair: Pair, case: str
) -> None:
    frames, fragment = MALFORMED[case]
    router, dealer = transport_pair
    dealer.send_multipart(frames)
    socket_io.sync_send(dealer, GOOD)
    with pytest.raises(ProtocolError, match=re.escape(fragment)):
        recv_within(router, router=True)
    identity, message = recv_within(router, router=True)
    assert identity == b"peer-0" and message == GOOD
