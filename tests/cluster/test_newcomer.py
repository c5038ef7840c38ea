"""What a newcomer meets first, run as the real commands in subprocesses: `zserve up` (attached
and ``--detach``) and `zserve status` print every frontend's addresses as bound (the native
client's, OIP HTTP, OIP gRPC, metrics; the kernel's ports where the file said 0), each of them
answering there; and a reader that goes away (`zserve status | head`) ends the command with
status 141 and no traceback, an attached cluster drained and gone."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import zserve

ZSERVE = [sys.executable, "-m", "zserve"]
# What a shell reports for a command that SIGPIPE stopped, as `zserve` exits for one.
SIGPIPE_EXIT_STATUS = 128 + signal.SIGPIPE
COMMAND_TIMEOUT_S = 120.0
# Within pytest's own timeout, so that a cluster that never says where it serves fails here.
ANNOUNCE_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 30.0
# Every server of the frontend on a port the kernel picks: tests never take fixed ports.
CLUSTER_TOML = """
[cluster]
name = "newcomer"
drain_s = 2.0

[scheduler]
shards = 0
jitter_ms = 50.0

[frontends]
http_addresses = ["127.0.0.1:0"]
grpc_addresses = ["127.0.0.1:0"]
metrics_addresses = ["127.0.0.1:0"]

[backends]
count = 1
device = "emulated"

[[models]]
name = "m"
emulated = { alpha_ms = 1.0, beta_ms = 2.0, input_shape = [4] }
slo_ms = 1500.0
"""
ENDPOINT_LINE = re.compile(r"^  (frontend-\d+) +(client|OIP HTTP|OIP gRPC|metrics) +(\S+)$")
LABELS = {"client": "client", "OIP HTTP": "http", "OIP gRPC": "grpc", "metrics": "metrics"}
X = np.arange(4, dtype=np.float32).reshape(1, 4)


def _endpoints(text: str) -> dict[str, dict[str, str]]:
    """The endpoint lines of a command's output, as ``{frontend: {socket: address}}``."""
    found: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        match = ENDPOINT_LINE.match(line)
        if match:
            found.setdefault(match[1], {})[LABELS[match[2]]] = match[3]
    return found


def _assert_served_at(endpoints: dict[str, str]) -> None:
    """Every address answers what it should: the native client, OIP HTTP and gRPC (the model
    is ready), the Prometheus endpoint (the frontend's families)."""
    assert set(endpoints) == {"client", "http", "grpc", "metrics"}, endpoints
    for address in (endpoints["http"], endpoints["grpc"], endpoints["metrics"]):
        assert not address.removesuffix("/metrics").endswith(":0"), endpoints
    with zserve.Client(endpoints["client"], timeout=HTTP_TIMEOUT_S) as client:
        assert client.infer("m", {"x": X})["y"].shape == (1, 1)
    http = httpclient.InferenceServerClient(endpoints["http"])
    grpc_client = grpcclient.InferenceServerClient(endpoints["grpc"])
    try:
        assert http.is_model_ready("m") and grpc_client.is_model_ready("m")
    finally:
        http.close()
        grpc_client.close()
    with urllib.request.urlopen(endpoints["metrics"], timeout=HTTP_TIMEOUT_S) as answer:
        assert b"zserve_up" in answer.read()


def _run(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ZSERVE, *args], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, check=False, **kwargs)


def _closed_pipe() -> int:
    """The writing end of a pipe whose reader has gone (what `| head` leaves once it exits)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def _assert_quiet_sigpipe_exit(returncode: int, stderr: str) -> None:
    assert returncode == SIGPIPE_EXIT_STATUS, (returncode, stderr)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


@pytest.fixture
def toml(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    return path


@pytest.fixture
def detached(tmp_path: Path, toml: Path) -> Iterator[tuple[subprocess.CompletedProcess[str], Path]]:
    """`zserve up --detach` of ``toml``; `zserve down` after the test."""
    state_dir = tmp_path / "state"
    up = _run("up", str(toml), "--detach", "--state-dir", str(state_dir),
              "--ipc-dir", str(tmp_path))
    assert up.returncode == 0, up.stderr
    try:
        yield up, state_dir
    finally:
        down = _run("down", "--state-dir", str(state_dir))
        assert down.returncode == 0, down.stderr


def test_up_detach_and_status_print_every_address_as_bound(
        detached: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    up, state_dir = detached
    state = json.loads((state_dir / "newcomer.json").read_text())
    # stdout: the client address alone, what a script captures; stderr: every address
    assert up.stdout.splitlines() == state["client_addresses"]
    printed = _endpoints(up.stderr)
    assert printed == state["endpoints"], up.stderr
    _assert_served_at(printed["frontend-0"])
    address = printed["frontend-0"]["client"]
    status = _run("status", "--state-dir", str(state_dir), "--interval", "0.1")
    assert status.returncode == 0, status.stderr
    assert _endpoints(status.stdout) == printed, status.stdout
    # A cluster this state folder does not record: the frontend at the address tells its own
    # addresses as bound (every one of them here: the cluster has one frontend).
    unrecorded = _run("status", address, "--state-dir", str(state_dir / "none"),
                      "--interval", "0.1")
    assert unrecorded.returncode == 0, unrecorded.stderr
    assert _endpoints(unrecorded.stdout) == printed, unrecorded.stdout
    # `zserve status | head`: the reader has gone before anything is written
    pipe = _closed_pipe()
    try:
        piped = subprocess.run([*ZSERVE, "status", "--state-dir", str(state_dir), "--interval",
                                "0.1"], stdout=pipe, stderr=subprocess.PIPE, text=True,
                               timeout=COMMAND_TIMEOUT_S, check=False)
    finally:
        os.close(pipe)
    _assert_quiet_sigpipe_exit(piped.returncode, piped.stderr)


def _text_until_metrics(stdout: IO[bytes], timeout_s: float) -> str:
    """What attached `zserve up` prints up to its metrics address, the last of its endpoints
    (AssertionError if it ends or says nothing for ``timeout_s``). Read from the descriptor:
    a buffered reader could hold the line waited for while the selector waits for more."""
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        while not re.search(rb" metrics .*\n", data) and selector.select(timeout_s):
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                break
            data += chunk
    text = data.decode()
    assert re.search(r" metrics .*\n", text), f"zserve up printed no metrics address:\n{text}"
    return text


def test_attached_up_prints_every_address_and_a_gone_reader_ends_it_quietly(
        tmp_path: Path, toml: Path) -> None:
    state_dir = tmp_path / "state"
    log = tmp_path / "up.log"  # a file, not a pipe: the roles' logs must never block on it
    with log.open("w") as log_file:
        up = subprocess.Popen([*ZSERVE, "up", str(toml), "--state-dir", str(state_dir),
                               "--ipc-dir", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=log_file)
    try:
        assert up.stdout is not None
        printed = _endpoints(_text_until_metrics(up.stdout, ANNOUNCE_TIMEOUT_S))
        state = json.loads((state_dir / "newcomer.json").read_text())
        assert printed == state["endpoints"]
        _assert_served_at(printed["frontend-0"])
        up.stdout.close()  # the reader goes away (`zserve up ... | head` once head exits)
        up.send_signal(signal.SIGTERM)  # it drains, then says so to the closed pipe
        returncode = up.wait(COMMAND_TIMEOUT_S)
        _assert_quiet_sigpipe_exit(returncode, log.read_text())
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    for pid in state["pids"].values():  # the drain reaped every role
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert list(state_dir.iterdir()) == []
