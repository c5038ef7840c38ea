"""The fault suite's busy-host mode (``--busy-host``, tests/conftest.py): a pytest session run with
it keeps one spinning process per core at nice 19 from its first test to its end, and leaves none
behind, whether it ends normally, on Ctrl-C (SIGINT) or killed outright (SIGKILL). Each case runs
a real nested pytest session over a copy of tests/conftest.py and reads the spinners from /proc."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import wait_until

CONFTEST = Path(__file__).parents[1] / "conftest.py"
SESSION_TIMEOUT_S = 60.0
# What the nested session's one test records: the children of its pytest process that run the
# spinner, with their nice values; then it either returns or waits to be interrupted.
NESTED_TEST = """
import json, os, pathlib, threading

def _children():
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"zserve-busy-host" in cmdline:
            found[int(entry.name)] = int(fields[16])
    return found

def test_records_the_spinners():
    record = pathlib.Path(os.environ["SPINNER_RECORD"])
    record.with_suffix(".tmp").write_text(json.dumps(_children()))
    record.with_suffix(".tmp").rename(record)
    if os.environ.get("HOLD_SESSION") == "1":
        threading.Event().wait(60)
"""


_DEFAULT_SIGINT_PYTEST = ("import signal, sys, pytest; "
                          "signal.signal(signal.SIGINT, signal.default_int_handler); "
                          "sys.exit(pytest.main(sys.argv[1:]))")


def _nested_session(tmp_path: Path, *args: str, hold: bool = False,
                    busy_env: bool = False) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``pytest ARGS`` on the nested test, with the suite's conftest; the record path."""
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_nested.py").write_text(NESTED_TEST)
    record = tmp_path / "spinners.json"
    env = dict(os.environ, SPINNER_RECORD=str(record), HOLD_SESSION="1" if hold else "0")
    env.pop("ZSERVE_BUSY_HOST", None)
    if busy_env:
        env["ZSERVE_BUSY_HOST"] = "1"
    # The suite's own directory first: the conftest imports zserve, and this checkout's is meant.
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]),
                                         env.get("PYTHONPATH", "")])
    # The nested session takes Ctrl-C's default handler whatever this process passed down (a
    # role's control link run in-process ignores SIGINT; children inherit an ignored signal).
    command = [sys.executable, "-c", _DEFAULT_SIGINT_PYTEST, "-p", "no:cacheprovider",
               "-p", "no:asyncio",
               "--rootdir", str(tmp_path), "-o", "timeout=0", *args,
               str(tmp_path / "test_nested.py")]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    return process, record


def _spinning(pid: int) -> bool:
    """Whether ``pid`` is still a spinner (a reused pid runs something else)."""
    try:
        return b"zserve-busy-host" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _recorded(record: Path, process: subprocess.Popen[bytes]) -> dict[int, int]:
    def ready() -> bool:
        assert record.exists() or process.poll() is None, _output(process)
        return record.exists()

    wait_until(ready, "the nested session's record of its spinners", timeout_s=SESSION_TIMEOUT_S)
    return {int(pid): nice for pid, nice in json.loads(record.read_text()).items()}


def _output(process: subprocess.Popen[bytes]) -> str:
    """What an ended nested session printed (its stdout may be closed already)."""
    if process.poll() is None or process.stdout is None or process.stdout.closed:
        return ""
    return process.stdout.read().decode(errors="replace")


@pytest.mark.parametrize("how", ["option", "environment"])
def test_busy_host_spins_one_process_per_core_at_nice_19_and_stops_them(
        tmp_path: Path, how: str) -> None:
    args = ("--busy-host",) if how == "option" else ()
    process, record = _nested_session(tmp_path, *args, busy_env=how == "environment")
    with process:
        out, _ = process.communicate(timeout=SESSION_TIMEOUT_S)
    assert process.returncode == 0, out.decode(errors="replace")
    assert b"busy host: " in out
    spinners = _recorded(record, process)
    assert len(spinners) == os.cpu_count(), spinners
    assert set(spinners.values()) == {19}, spinners
    assert not [pid for pid in spinners if _spinning(pid)]  # stopped before the session ended


def test_without_busy_host_nothing_spins(tmp_path: Path) -> None:
    process, record = _nested_session(tmp_path)
    with process:
        out, _ = process.communicate(timeout=SESSION_TIMEOUT_S)
    assert process.returncode == 0, out.decode(errors="replace")
    assert _recorded(record, process) == {}
    assert b"busy host" not in out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_an_interrupted_or_killed_session_leaves_no_spinner(tmp_path: Path, sig: int) -> None:
    process, record = _nested_session(tmp_path, "--busy-host", hold=True)
    with process:
        try:
            spinners = _recorded(record, process)
            assert len(spinners) == os.cpu_count()
            process.send_signal(sig)
            process.communicate(timeout=SESSION_TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    # SIGINT: the session's teardown stops them; SIGKILL: each sees its parent gone and exits.
    wait_until(lambda: not [pid for pid in spinners if _spinning(pid)],
               f"the spinners {sorted(spinners)} to end after {signal.Signals(sig).name}",
               timeout_s=SESSION_TIMEOUT_S)
