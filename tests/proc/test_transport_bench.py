"""`zserve bench-transport --quick`: the transport benchmark end to end, with its peer process.

The figures themselves are timings and are not asserted (benchmarks report them); what is
checked is that every phase ran over real sockets to completion, counted what it sent, and that
the report is consistent with itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zserve.transport.bench import throughput
from zserve.transport.bench.results import SpacedResult
from zserve.transport.sockets import LOOPBACK_TCP_ANY_PORT


def test_quick_run_measures_every_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "transport.json"
    assert throughput.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["quick"] is True
    assert report["idle_poll"] is False
    pairs = {(pair["transport"], pair["io"]): pair for pair in report["pairs"]}
    assert set(pairs) == {("ipc", "sync"), ("ipc", "asyncio"), ("tcp", "sync"), ("tcp", "asyncio")}
    for pair in pairs.values():
        assert pair["small_bare_msgs_per_s"] > 0 and pair["small_codec_msgs_per_s"] > 0
        assert pair["small_codec_sender_cpu_us"] > 0 and pair["small_codec_receiver_cpu_us"] > 0
        assert pair["rtt_p50_bare_us"] > 0 and pair["rtt_p50_codec_us"] > 0

    # Spaced messages run on the ipc sync pair only, one row per gap, each run counting every
    # message it was told to send.
    spaced = pairs[("ipc", "sync")]["spaced"]
    assert [row["gap_s"] for row in spaced] == list(throughput.SPACED_GAPS_S)
    for pair in ("ipc", "asyncio"), ("tcp", "sync"), ("tcp", "asyncio"):
        assert pairs[pair]["spaced"] == []
    for row in spaced:
        assert row["messages"] == throughput.SPACED_MESSAGES[True]
        assert row["sender_cpu_us"] > 0 and row["sleep_cpu_us"] > 0 and row["receiver_cpu_us"] > 0
        expected = max(0.0, row["sender_cpu_us"] - row["sleep_cpu_us"]) + row["receiver_cpu_us"]
        assert row["message_cpu_us"] == pytest.approx(expected)

    printed = capsys.readouterr().out
    assert "spaced messages (ipc, sync, codec)" in printed
    assert "0.3 ms" in printed and "1 ms" in printed


def test_spaced_result_never_credits_a_cheaper_send_than_its_sleep() -> None:
    # A noisy sleep-only run can cost more than the loop with sends; the message is then counted
    # at its receiver's cost alone, never below it.
    row = SpacedResult(
        gap_s=0.001, messages=10, sender_cpu_us=20.0, sleep_cpu_us=25.0, receiver_cpu_us=30.0
    )
    assert row.message_cpu_us == 30.0
    row = SpacedResult(
        gap_s=0.001, messages=10, sender_cpu_us=45.0, sleep_cpu_us=15.0, receiver_cpu_us=30.0
    )
    assert row.message_cpu_us == 60.0


@pytest.mark.parametrize("io", ["sync", "asyncio"])
def test_the_curve_pair_runs_over_curve(io: str) -> None:
    """``--curve``'s tcp pair: the peer is a CURVE client, so it is served only if the
    measuring side's router really is a CURVE server that accepts its key."""
    if io == "sync":
        pair = throughput._run_pair_sync(throughput.CURVE_TRANSPORT, LOOPBACK_TCP_ANY_PORT, True,
                                    arrays=False)
    else:
        pair = throughput._run_pair_async(throughput.CURVE_TRANSPORT, LOOPBACK_TCP_ANY_PORT, True)
    assert (pair.transport, pair.io) == (throughput.CURVE_TRANSPORT, io)
    assert pair.small_codec_msgs_per_s > 0 and pair.small_codec_sender_cpu_us > 0
    assert pair.rtt_p50_codec_us > 0
