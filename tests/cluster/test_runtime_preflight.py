"""Bad configuration is caught before anything starts: every checkable problem of a cluster.toml
(model files that do not exist or do not parse, unknown built-in names, profile files, a model
its backends' device cannot run, bind addresses in use, too long or duplicated, ZeroMQ, HTTP,
gRPC and metrics alike) is one line ``zserve up: <key path>: <problem>`` and exit code 2, and no
process is spawned. A port taken after the check fails the start in one line too. Real files,
real sockets and processes; ports are taken at port 0."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zserve
from zserve.backends.builtin import ensure_builtin
from zserve.cluster.preflight import PreflightError, check_cluster
from zserve.cluster.supervisor import Cluster, StartupError, Supervisor
from zserve.config.cluster import parse_config

ZSERVE_UP = [sys.executable, "-m", "zserve", "up"]
# The bad cases exit from the preflight; a generous bound for a loaded 2-core machine, far below
# the seconds a spawned cluster took to fail.
CLI_EXIT_TIMEOUT_S = 60.0


@pytest.fixture
def occupied_port() -> Iterator[int]:
    """A loopback TCP port held by a listening socket for the test's duration."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


EMULATED_MODEL = '[[models]]\nname = "m"\nemulated = { alpha_ms = 1.0, beta_ms = 1.0 }\n'


def _write_cluster(path: Path, body: str, *, device: str = "cpu") -> Path:
    path.write_text(f'[cluster]\nname = "preflight"\n[backends]\ncount = 1\ndevice = "{device}"\n'
                    + body)
    return path


def _zserve_up(config: Path, ipc_base: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [*ZSERVE_UP, str(config), "--ipc-dir", str(ipc_base), "--state-dir", str(ipc_base)],
        capture_output=True, text=True, timeout=CLI_EXIT_TIMEOUT_S, check=False,
    )
    return result, time.monotonic() - started


def test_cli_reports_every_problem_as_one_line(tmp_path: Path, occupied_port: int) -> None:
    """A missing ONNX file, an unknown built-in and a port in use: three lines, exit 2, nothing
    spawned (the run folder the supervisor would create under --ipc-dir never appears)."""
    missing = tmp_path / "models" / "absent.onnx"
    config = _write_cluster(tmp_path / "bad.toml", f"""
[frontends]
addresses = ["tcp://127.0.0.1:{occupied_port}"]
[[models]]
name = "a"
onnx = "{missing}"
[[models]]
name = "b"
builtin = "resnet9000"
""")
    ipc_base = tmp_path / "run"
    ipc_base.mkdir()
    result, elapsed_s = _zserve_up(config, ipc_base)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"zserve up: models[0].onnx: no such file: {missing}",
        "zserve up: models[1].builtin: unknown built-in model 'resnet9000' "
        "(built-in: cnn, mlp, cnn-u8, cnn-f16)",
        f"zserve up: frontends.addresses[0]: cannot bind tcp://127.0.0.1:{occupied_port}: "
        "Address already in use",
    ]
    assert list(ipc_base.iterdir()) == []
    print(f"three bad keys: exit 2 after {elapsed_s:.2f} s")


def test_cli_reports_a_corrupt_onnx_file(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07this is not a protobuf \xff\xfe" * 10)
    config = _write_cluster(tmp_path / "bad.toml", f"""
[[models]]
name = "c"
onnx = "{corrupt}"
""")
    ipc_base = tmp_path / "run"
    ipc_base.mkdir()
    result, elapsed_s = _zserve_up(config, ipc_base)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"zserve up: models[0].onnx: model 'c': {corrupt} is not a valid ONNX model")
    assert list(ipc_base.iterdir()) == []
    print(f"corrupt onnx: exit 2 after {elapsed_s:.2f} s")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _one_model(**keys: Any) -> dict[str, Any]:
    return {"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 1.0}, **keys}


def _emulated(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` on emulated backends, the device its emulated models run on."""
    backends = {"device": "emulated", **document.get("backends", {})}
    return {**document, "backends": backends}


def _problems(document: dict[str, Any], ipc_base: Path) -> list[str]:
    """The problems the Cluster API's start raises for ``document``; asserts nothing was made
    under ``ipc_base`` (the run folder is the first thing a starting supervisor creates)."""
    with pytest.raises(PreflightError) as raised:
        Cluster(parse_config(document), ipc_base=ipc_base).start()
    assert list(ipc_base.iterdir()) == []
    return [str(problem) for problem in raised.value.problems]


def test_cli_names_where_the_run_folder_came_from(tmp_path: Path) -> None:
    """The run folder's parent is ``cluster.ipc_dir`` unless ``--ipc-dir`` overrides it."""
    missing = tmp_path / "missing"
    config = tmp_path / "c.toml"
    config.write_text(f'[cluster]\nipc_dir = "{missing}"\n[backends]\ndevice = "emulated"\n'
                      + EMULATED_MODEL)
    result, _ = _zserve_up(config, missing)
    assert (result.returncode, result.stderr.splitlines()) == (
        2, [f"zserve up: --ipc-dir: no such folder: {missing}"])
    result = subprocess.run([*ZSERVE_UP, str(config)], capture_output=True, text=True,
                            timeout=CLI_EXIT_TIMEOUT_S, check=False)
    assert (result.returncode, result.stderr.splitlines()) == (
        2, [f"zserve up: cluster.ipc_dir: no such folder: {missing}"])


def test_profile_files_are_checked(tmp_path: Path) -> None:
    absent = tmp_path / "absent.json"
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "zserve-profile/1", "models": {')
    other = tmp_path / "other.json"
    other.write_text('{"format": "zserve-profile/1", "models": '
                     '{"x": {"alpha_ms": 1.0, "beta_ms": 2.0, "max_batch": 4}}}')
    document = {"backends": {"count": 2, "kinds": ["a100", "t4"]}, "models": [
        _one_model(name="a", profile=str(absent)),
        _one_model(name="b", profile=str(broken)),
        _one_model(name="c", profile=str(other)),
        _one_model(name="d", profiles={"a100": str(other), "t4": str(absent)}),
    ]}
    (tmp_path / "run").mkdir()
    problems = _problems(_emulated(document), tmp_path / "run")
    assert problems[0] == f"models[0].profile: no such file: {absent}"
    assert problems[1].startswith(f"models[1].profile: {broken}: ")
    assert problems[2] == (f"models[2].profile: profile file {other} has no entry for 'c' "
                           "(it has x)")
    assert problems[3] == (f"models[3].profiles.a100: profile file {other} has no entry for "
                           "'d' (it has x)")
    assert problems[4] == f"models[3].profiles.t4: no such file: {absent}"
    assert len(problems) == 5


def test_onnx_files_that_cannot_serve(tmp_path: Path) -> None:
    """An empty file, bytes that protobuf reads as an empty model, a fixed batch dimension."""
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    hollow = tmp_path / "hollow.onnx"
    hollow.write_bytes(b"\x08\x07")  # ir_version 7 and nothing else
    fixed = tmp_path / "fixed.onnx"
    _write_identity_model(fixed, batch_dim=2)
    (tmp_path / "run").mkdir()
    problems = _problems({"models": [
        {"name": "e", "onnx": str(empty)},
        {"name": "h", "onnx": str(hollow)},
        {"name": "f", "onnx": str(fixed)},
    ]}, tmp_path / "run")
    assert problems[:2] == [
        f"models[0].onnx: model 'e': model file {empty} is empty",
        f"models[1].onnx: not an ONNX model: {hollow} (no inputs or outputs)",
    ]
    assert problems[2].startswith(
        f"models[2].onnx: model 'f' ({fixed}): input 'x' has a fixed batch dimension")
    assert len(problems) == 3


def _write_identity_model(path: Path, *, batch_dim: int | str, op_type: str = "Identity") -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch_dim, 4])
    graph = helper.make_graph([helper.make_node(op_type, ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_duplicate_and_unusable_addresses(tmp_path: Path) -> None:
    """A tcp address named twice, an ipc path over the limit, an ipc folder that is missing."""
    port = _free_port()
    long_path = str(tmp_path / ("x" * 120))
    missing_folder = tmp_path / "nowhere"
    document = {
        "scheduler": {"rank_address": f"ipc://{long_path}"},
        "frontends": {"addresses": [f"tcp://127.0.0.1:{port}"],
                      "data_addresses": [f"tcp://127.0.0.1:{port}"]},
        "backends": {"plan_addresses": [f"ipc://{missing_folder}/plan"]},
        "models": [_one_model()],
    }
    (tmp_path / "run").mkdir()
    assert _problems(_emulated(document), tmp_path / "run") == [
        f"scheduler.rank_address: ipc path is {len(long_path)} bytes, over the 107-byte limit: "
        f"{long_path}",
        f"frontends.data_addresses[0]: same address as frontends.addresses[0]: "
        f"tcp://127.0.0.1:{port}",
        f"backends.plan_addresses[0]: no such folder: {missing_folder}",
    ]


def test_tcp_hosts_are_probed(tmp_path: Path) -> None:
    """transport tcp: a cluster.host that is no address of this machine cannot take the
    kernel-chosen ports every socket binds."""
    foreign_host = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never assigned to a local interface
    # The probe alone; keys are tests/cluster/test_security_keys.py's.
    document = {"cluster": {"transport": "tcp", "host": foreign_host}, "models": [_one_model()],
                "security": {"insecure": True}}
    (tmp_path / "run").mkdir()
    assert _problems(_emulated(document), tmp_path / "run") == [
        f"cluster.host: cannot bind tcp://{foreign_host}:0: Cannot assign requested address",
    ]


def test_the_run_folder_is_checked(tmp_path: Path) -> None:
    """ipc transport: the folder the run folder goes in must exist, and the longest socket path
    the cluster would make under it must fit."""
    absent = tmp_path / "absent"
    with pytest.raises(PreflightError) as raised:
        Cluster(parse_config(_emulated({"models": [_one_model()]})), ipc_base=absent).start()
    assert [str(p) for p in raised.value.problems] == [f"ipc_base: no such folder: {absent}"]
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    with pytest.raises(PreflightError) as raised:
        Cluster(parse_config(_emulated({"models": [_one_model()]})), ipc_base=deep).start()
    (problem,) = raised.value.problems
    assert problem.key == "ipc_base"
    assert problem.problem.startswith(f"ipc paths under {deep} would be up to ")
    assert list(deep.iterdir()) == []


def test_a_good_config_still_starts(tmp_path: Path) -> None:
    """Named files, a named tcp address and an ipc one pass the checks and serve a request."""
    onnx_file = tmp_path / "mlp.onnx"
    onnx_file.write_bytes(ensure_builtin("mlp").read_bytes())
    profile = tmp_path / "profile.json"
    # A profile far slower than the model really is: deferred scheduling starts the lone request
    # l(b) before its deadline, and a loaded CI machine must still finish it in time.
    profile.write_text('{"format": "zserve-profile/1", "models": '
                       '{"served": {"alpha_ms": 1.0, "beta_ms": 300.0, "max_batch": 8}}}')
    (tmp_path / "run").mkdir()
    config = parse_config({
        "cluster": {"drain_s": 1.0},
        "frontends": {"addresses": [f"tcp://127.0.0.1:{_free_port()}"],
                      "data_addresses": [f"ipc://{tmp_path}/data"]},
        "backends": {"count": 1},
        "models": [{"name": "served", "onnx": str(onnx_file), "profile": str(profile),
                    "slo_ms": 2000.0, "max_batch": 8}],
    })
    assert check_cluster(config, ipc_base=str(tmp_path / "run")) == []
    with Cluster(config, ipc_base=tmp_path / "run") as cluster, \
            zserve.Client(cluster.client_address) as client:
        sample = np.zeros((1, 64), dtype=np.float32)
        outputs = client.infer("served", {next(iter(_input_names(onnx_file))): sample},
                               timeout=30.0)
        assert next(iter(outputs.values())).shape[0] == 1


def _input_names(path: Path) -> list[str]:
    import onnx

    return [value.name for value in onnx.load(str(path)).graph.input]


def test_demo_reports_problems_like_up(tmp_path: Path) -> None:
    """``zserve demo --config`` checks the file before it loads the model in-process."""
    config = _write_cluster(tmp_path / "bad.toml", '[[models]]\nname = "m"\nbuiltin = "cnm"\n')
    result = subprocess.run(
        [sys.executable, "-m", "zserve", "demo", "--config", str(config)],
        capture_output=True, text=True, timeout=CLI_EXIT_TIMEOUT_S, check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "zserve demo: models[0].builtin: unknown built-in model 'cnm' "
        "(built-in: cnn, mlp, cnn-u8, cnn-f16)",
    ]


@pytest.mark.parametrize("key", ["http_addresses", "grpc_addresses", "metrics_addresses"])
def test_cli_reports_an_http_port_in_use(tmp_path: Path, occupied_port: int, key: str) -> None:
    """The frontends' OIP HTTP, OIP gRPC and Prometheus ports are probed like the ZeroMQ ones:
    one line naming the key, exit 2, nothing spawned."""
    config = _write_cluster(tmp_path / "bad.toml",
                            f'[frontends]\n{key} = ["127.0.0.1:{occupied_port}"]\n'
                            + EMULATED_MODEL, device="emulated")
    ipc_base = tmp_path / "run"
    ipc_base.mkdir()
    result, elapsed_s = _zserve_up(config, ipc_base)
    assert (result.returncode, result.stderr.splitlines()) == (2, [
        f"zserve up: frontends.{key}[0]: cannot bind 127.0.0.1:{occupied_port}: "
        "Address already in use",
    ])
    assert list(ipc_base.iterdir()) == []
    print(f"{key} in use: exit 2 after {elapsed_s:.2f} s")


def test_cli_reports_one_port_for_http_and_grpc(tmp_path: Path) -> None:
    port = _free_port()
    config = _write_cluster(tmp_path / "bad.toml", f"""
[frontends]
http_addresses = ["127.0.0.1:{port}"]
grpc_addresses = ["127.0.0.1:{port}"]
""" + EMULATED_MODEL, device="emulated")
    ipc_base = tmp_path / "run"
    ipc_base.mkdir()
    result, elapsed_s = _zserve_up(config, ipc_base)
    assert (result.returncode, result.stderr.splitlines()) == (2, [
        f"zserve up: frontends.grpc_addresses[0]: same address as frontends.http_addresses[0]: "
        f"127.0.0.1:{port}",
    ])
    assert list(ipc_base.iterdir()) == []
    print(f"one port for HTTP and gRPC: exit 2 after {elapsed_s:.2f} s")


def test_one_port_under_two_keys_of_any_kind(tmp_path: Path) -> None:
    """A ZeroMQ address and an HTTP one on the same host and port; a wildcard and a loopback
    host on one port (they collide when bound together)."""
    same, wildcard = _free_port(), _free_port()
    document = _emulated({
        "frontends": {"addresses": [f"tcp://127.0.0.1:{same}"],
                      "data_addresses": [f"tcp://0.0.0.0:{wildcard}"],
                      "metrics_addresses": [f"127.0.0.1:{same}"],
                      "http_addresses": [f"127.0.0.1:{wildcard}"]},
        "models": [_one_model()],
        "security": {"insecure": True},  # the wildcard data address alone (test_security_keys)
    })
    (tmp_path / "run").mkdir()
    assert _problems(document, tmp_path / "run") == [
        f"frontends.metrics_addresses[0]: same address as frontends.addresses[0]: "
        f"127.0.0.1:{same}",
        f"frontends.http_addresses[0]: same port as frontends.data_addresses[0] "
        f"(tcp://0.0.0.0:{wildcard}): 127.0.0.1:{wildcard}",
    ]


def test_cli_reports_an_emulated_model_on_a_cpu(tmp_path: Path) -> None:
    config = _write_cluster(tmp_path / "bad.toml", EMULATED_MODEL)
    ipc_base = tmp_path / "run"
    ipc_base.mkdir()
    result, elapsed_s = _zserve_up(config, ipc_base)
    assert (result.returncode, result.stderr.splitlines()) == (2, [
        "zserve up: models[0].emulated: model 'm' is emulated, which only a backend with "
        'device = "emulated" runs, but backends.device is "cpu" (ONNX Runtime, for onnx and '
        "builtin models)",
    ])
    assert list(ipc_base.iterdir()) == []
    print(f"emulated model on a cpu: exit 2 after {elapsed_s:.2f} s")


def test_each_model_against_each_device(tmp_path: Path) -> None:
    """Every backend loads every model: an emulated model needs every device emulated, and an
    emulated device needs every model's l(b) (emulated, or a profile file)."""
    document = {"backends": {"devices": ["cpu", "emulated"]},
                "models": [_one_model(name="e"), {"name": "b", "builtin": "mlp"}]}
    (tmp_path / "run").mkdir()
    assert _problems(document, tmp_path / "run") == [
        "models[0].emulated: model 'e' is emulated, which only a backend with device = "
        '"emulated" runs, but backends.devices[0] is "cpu" (ONNX Runtime, for onnx and builtin '
        "models)",
        "models[1].builtin: model 'b' has no l(b) for the emulated device of "
        "backends.devices[1]: give it a profile file (models[].profile, or one for every "
        "backend's kind: models[].profiles), or a cpu or cuda device",
    ]


def test_the_models_every_backend_loads_must_fit_its_memory(tmp_path: Path) -> None:
    """``[backends] memory``: weights + the largest activations of the started models within
    the kind's budget (GTX 1080 Ti: 10 GiB), refused in memory's one line; a model whose memory
    is not known is a problem of its own."""
    (tmp_path / "run").mkdir()
    big = [_one_model(name=f"m{i}", memory_mib=2048.0, activation_mib=512.0 * i)
           for i in range(5)]
    document = _emulated({"backends": {"memory": "gtx1080ti"},
                          "models": [*big, {"name": "b", "builtin": "mlp", "profile": "p"}]})
    problems = _problems(document, tmp_path / "run")
    assert "models[5].memory_mib: model 'b': declare its weights in MiB to check them against " \
        "backends.memory" in problems
    assert "backends.memory: device backend-0 overcommitted: 5 models need 12.00 GiB (weights " \
        "10.00 GiB + the largest activations 2.00 GiB, m4), budget 10.00 GiB; place fewer " \
        "models on it" in problems
    # four of them fit (8 GiB + 1.5 GiB); a budget in GiB; an unknown kind is named
    fits = _emulated({"backends": {"memory": 9.5}, "models": big[:4]})
    assert [str(p) for p in check_cluster(parse_config(fits)) if "memory" in str(p)] == []
    unknown = _emulated({"backends": {"memory": "tpu"}, "models": big[:1]})
    assert [str(p) for p in check_cluster(parse_config(unknown)) if "memory" in str(p)] == [
        "backends.memory: device kind 'tpu' has no memory budget (known: a100, a100-80gb, "
        "gtx1080ti, h200)"]
    # placed on named backends, each backend's own models count: three 2 GiB models overcommit
    # a 5 GiB backend that loads them all, not two backends that share them out
    spread = [_one_model(name=f"s{i}", memory_mib=2048.0, backends=where)
              for i, where in enumerate([["backend-0"], ["backend-1"], ["backend-1"]])]
    shared = _emulated({"backends": {"memory": 5.0, "count": 2}, "models": spread})
    assert [str(p) for p in check_cluster(parse_config(shared)) if "memory" in str(p)] == []
    spread[0]["backends"] = ["backend-0", "backend-1"]
    assert [str(p) for p in check_cluster(parse_config(shared)) if "memory" in str(p)] == [
        "backends.memory: device backend-1 overcommitted: 3 models need 6.00 GiB (weights "
        "6.00 GiB + the largest activations 0.00 GiB, s0), budget 5.00 GiB; place fewer models "
        "on it"]
    # a model named as a zoo model needs no declaration: the zoo's figures count (VGG19: 143.7
    # M parameters, 575 MB, plus 32 samples of 224 x 224 at 512 bytes a pixel, 822 MB)
    vgg = _emulated({"backends": {"memory": 1.0}, "models": [_one_model(name="VGG19")]})
    assert [str(p) for p in check_cluster(parse_config(vgg)) if "memory" in str(p)] == [
        "backends.memory: device backend-0 overcommitted: 1 models need 1.30 GiB (weights "
        "0.54 GiB + the largest activations 0.77 GiB, VGG19), budget 1.00 GiB; place fewer "
        "models on it"]


@pytest.mark.parametrize("key", ["addresses", "http_addresses", "grpc_addresses",
                                 "metrics_addresses"])
def test_a_port_taken_after_the_preflight_fails_the_start_in_one_line(
        tmp_path: Path, key: str) -> None:
    """Another program takes the port between the preflight (in ``Supervisor()``) and the
    frontend's bind (in ``start``): the frontend exits 2 with one line, and the start fails
    with that line, naming the key."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}" if key == "addresses" else f"127.0.0.1:{port}"
    config = parse_config(_emulated({"frontends": {key: [address]}, "models": [_one_model()]}))
    supervisor = Supervisor(config, ipc_base=tmp_path)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
            holder.bind(("127.0.0.1", port))
            holder.listen()
            with pytest.raises(StartupError) as raised:
                supervisor.start()
    finally:
        supervisor.shutdown(0.0)
    (line,) = str(raised.value).splitlines()
    assert line.startswith(f"frontend-0 (frontend) died: exit code 2: frontends.{key}[0]: "
                           "frontend-0"), line
    assert address in line


def test_a_child_still_starting_is_killed_at_once(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A child that has not said Ready when the cluster stops (a start that failed while it
    loaded its models) has nothing to drain: SIGKILL at once, not SIGTERM, 3 s, SIGTERM again and
    2 s. Here the backend has sent Ready and waits for its peer map, but the supervisor, spawning
    it alone and not polling, has not read the Ready yet: to the supervisor it is starting."""
    supervisor = Supervisor(parse_config(_emulated({"models": [_one_model()]})),
                            ipc_base=tmp_path)
    try:
        supervisor._spawn(supervisor.children["backend-0"])
        assert supervisor.control.poll(int(CLI_EXIT_TIMEOUT_S * 1e3)), "backend-0 sent no Ready"
    finally:
        with caplog.at_level(logging.INFO, logger="zserve.cluster.supervisor"):
            supervisor.shutdown(0.0)
    messages = [record.getMessage() for record in caplog.records]
    assert "backend-0 was still starting; SIGKILL" in messages
    assert [message for message in messages if "did not exit" in message] == []
