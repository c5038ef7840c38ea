"""A reader that goes away (``zserve --help | head -1``) ends the command as it ends ``cat``:
nothing more written, no traceback, exit status 141 (128 + SIGPIPE); a reader that stays sees
status 0. `zserve status` and `zserve up` with a gone reader: tests/cluster/test_newcomer.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

CLI_TIMEOUT_S = 60
ZSERVE = [sys.executable, "-m", "zserve"]
# What a shell reports for a command that SIGPIPE stopped, as `zserve` exits for one.
SIGPIPE_EXIT_STATUS = 128 + signal.SIGPIPE


def test_help_into_a_pipe_whose_reader_has_gone_exits_141_quietly() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # what `| head` leaves once head has exited
    try:
        done = subprocess.run([*ZSERVE, "--help"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=CLI_TIMEOUT_S, check=False)
    finally:
        os.close(write_end)
    assert done.returncode == SIGPIPE_EXIT_STATUS == 141, done.stderr
    assert done.stderr == ""


def test_help_into_a_pipe_that_is_read_exits_0() -> None:
    done = subprocess.run([*ZSERVE, "--help"], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, check=False)
    assert done.returncode == 0 and done.stdout.startswith("usage: zserve"), done.stderr
