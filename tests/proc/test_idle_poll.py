"""Idle pollers (zserve.transport.idle_poll): SCHED_IDLE spinners that keep the CPUs awake; and the
wake-up and stall probes that measure what they are for (zserve.loadgen.bench.wakeup)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from zserve.config.cluster import ConfigError, parse_config
from zserve.loadgen.bench.wakeup import ping_pong_rtts_us, spin_gaps, stall_probe
from zserve.transport.idle_poll import IdlePollers, available_cpus

pytestmark = pytest.mark.skipif(not IdlePollers.supported(), reason="needs Linux SCHED_IDLE")

WAIT_S = 10.0
# spin_gaps: float rounding between (last - start) + (now - last) and (now - start); a threshold
# a spinning loop's clock steps stay under; one no gap of a 10 ms window exceeds unless the
# host took the CPU away for an hour.
ROUNDING_S = 1e-9
SMALL_GAP_S = 10e-6
NO_GAP_S = 3600.0


def _policy(pid: int) -> int | None:
    try:
        return os.sched_getscheduler(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie of ours still answers kill(0): reaped processes are gone, others must be zombies
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_pollers_run_at_sched_idle_and_stop_cleanly() -> None:
    with IdlePollers(2) as pollers:
        pids = [p.pid for p in pollers.processes]
        assert len(pids) == 2
        for pid in pids:  # start() returned after each poller's ready byte
            assert _policy(pid) == os.SCHED_IDLE
        for p in pollers.processes:
            assert p.poll() is None  # still spinning
        assert IdlePollers.live_pids() >= set(pids)  # CPU accounting leaves them out
    assert pollers.processes == []
    assert not IdlePollers.live_pids() & set(pids)
    for pid in pids:
        assert _gone(pid)


def test_default_count_is_one_per_available_cpu() -> None:
    assert IdlePollers().count == available_cpus() >= 1


def test_pollers_die_with_their_parent() -> None:
    """PR_SET_PDEATHSIG: a SIGKILLed supervisor leaves no spinning processes behind."""
    script = textwrap.dedent("""
        import signal
        from zserve.transport.idle_poll import IdlePollers
        pollers = IdlePollers(1).start()
        print(pollers.processes[0].pid, flush=True)
        signal.pause()  # until the test kills this process
    """)
    # Leaving the with block closes the pipe and reaps the process (after the kill below).
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    ) as parent:
        try:
            assert parent.stdout is not None
            poller_pid = int(parent.stdout.readline())
            assert _policy(poller_pid) == os.SCHED_IDLE
            exited = os.pidfd_open(poller_pid)  # readable once the poller has exited
            try:
                parent.send_signal(signal.SIGKILL)
                parent.wait()
                readable, _, _ = select.select([exited], [], [], WAIT_S)
                assert readable, "the orphaned poller did not die with its parent"
            finally:
                os.close(exited)
            assert _gone(poller_pid)
        finally:
            if parent.poll() is None:
                parent.kill()


def test_ping_pong_measures_round_trips() -> None:
    rtts = ping_pong_rtts_us(0.0, round_trips=50)
    assert rtts.shape == (50,)
    assert (rtts > 0).all()


def test_config_idle_poll_is_a_checked_boolean() -> None:
    models = [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 1.0}, "slo_ms": 50.0}]
    assert parse_config({"models": models}).idle_poll is False
    assert parse_config({"cluster": {"idle_poll": True}, "models": models}).idle_poll is True
    with pytest.raises(ConfigError, match=r"cluster\.idle_poll: must be true or false"):
        parse_config({"cluster": {"idle_poll": 1}, "models": models})


def test_spin_gaps_reports_every_gap_above_the_threshold_in_order() -> None:
    """With a zero threshold every clock step is a gap: they follow one another without a hole
    (each starts where the one before ended, from the first reading on), the last one starts
    inside the window and ends past it. Logic only: a busy host makes the gaps longer, never
    changes these relations."""
    gaps = spin_gaps(0.05, min_gap_s=0.0)
    assert gaps, "a 50 ms spin read the clock more than once"
    starts = [t for t, _ in gaps]
    assert starts[0] == 0.0  # the first step from the first reading
    for (start, gap), next_start in zip(gaps, starts[1:], strict=False):
        assert gap > 0.0
        assert start + gap == pytest.approx(next_start, abs=ROUNDING_S), "a step was lost"
    assert starts[-1] < 0.05 + ROUNDING_S and starts[-1] + gaps[-1][1] > 0.05 - ROUNDING_S
    # With a threshold, only the steps above it (a spinning loop steps far more often than
    # every 10 us, so an unfiltered list would hold steps below it).
    assert all(gap > SMALL_GAP_S for _, gap in spin_gaps(0.01, min_gap_s=SMALL_GAP_S))
    assert spin_gaps(0.01, min_gap_s=NO_GAP_S) == []


def test_stall_probe_prints_one_row_per_process(capsys: pytest.CaptureFixture[str]) -> None:
    from zserve.loadgen.bench.wakeup import main

    table = stall_probe(0.05, cpus=2)
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["0", "1"]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[2:7]]
        stalls, over5, over10 = (int(c) for c in cells[:3])
        longest_ms, per_minute = float(cells[3]), float(cells[4])
        # Each column counts a subset of the one before, the longest stall agrees with the
        # counts (to the table's 0.1 ms rounding), and the rate is the count over 50 ms.
        assert stalls >= over5 >= over10, row
        assert (longest_ms == 0.0) == (stalls == 0), row
        assert (longest_ms >= 5.0) if over5 else (longest_ms <= 5.0), row
        assert (longest_ms >= 10.0) if over10 else (longest_ms <= 10.0), row
        assert per_minute == pytest.approx(stalls * 60.0 / 0.05, abs=0.05), row
    with pytest.raises(SystemExit):
        main(["--stalls", "0"])
    assert "--stalls must be > 0" in capsys.readouterr().err
