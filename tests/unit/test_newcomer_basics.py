"""What a newcomer meets first, checked without a cluster: `zserve --help` names every
experiment, the demo cluster serves metrics, the addresses `zserve up` and `zserve status` print
are labelled in one place, a shape error states the accepted shape with its batch dimension, and
the repository carries the license pyproject.toml names."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import numpy as np
import pytest

from zserve import cli
from zserve.cluster.cli import ENDPOINT_LABELS, endpoint_lines
from zserve.cluster.supervisor import USER_ENDPOINTS
from zserve.config.cluster import load_config
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.core.errors import BadRequestError
from zserve.demo import DEMO_TOML
from zserve.loadgen.experiments.runner import EXPERIMENTS

ROOT = Path(__file__).resolve().parents[2]
# SHA-256 of the Apache License 2.0 as apache.org publishes it (LICENSE-2.0.txt), unchanged.
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_help_lists_every_experiment(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (heading,) = [i for i, line in enumerate(lines) if line.startswith("experiments")]
    assert lines[heading + 1].strip().split(", ") == list(EXPERIMENTS)
    assert tuple(EXPERIMENTS) == cli.EXPERIMENT_NAMES  # the help's copy of the registry


def test_the_demo_cluster_serves_metrics() -> None:
    demo = load_config(DEMO_TOML)
    assert demo.frontends.metrics_addresses == ("127.0.0.1:8002",)  # next to Triton's 8000/8001


def test_every_address_a_user_reaches_has_its_label() -> None:
    assert tuple(ENDPOINT_LABELS) == USER_ENDPOINTS
    lines = endpoint_lines({"frontend-0": {"client": "ipc:///run/f0", "metrics": "http://h:9/metrics"},
                            "frontend-1": {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}})
    assert lines == ["  frontend-0   client    ipc:///run/f0",
                     "  frontend-0   metrics   http://h:9/metrics",
                     "  frontend-1   OIP HTTP  127.0.0.1:8000",
                     "  frontend-1   OIP gRPC  127.0.0.1:8001"]


@pytest.mark.parametrize(("shape", "expected"), [
    ((3, 31), "has shape (3, 31), expected (3, 32)"),
    ((32,), "has shape (32,), expected (n, 32)"),
    ((2, 3, 32), "has shape (2, 3, 32), expected (n, 32)"),
])
def test_a_shape_error_states_the_accepted_shape_with_its_batch_dimension(
        shape: tuple[int, ...], expected: str) -> None:
    signature = ModelSignature("m", (TensorSpec("x", "float32", (32,)),),
                               (TensorSpec("y", "float32", (1,)),))
    with pytest.raises(BadRequestError) as raised:
        signature.validate_request({"x": np.zeros(shape, np.float32)})
    message = raised.value.message
    assert expected in message, message
    assert "the model accepts (batch, 32) ([-1, 32] in its metadata), batch being the " \
        "request's number of rows (1 or more)" in message, message
    with pytest.raises(BadRequestError) as raised:
        signature.validate_request({"z": np.zeros((1, 32), np.float32)})
    assert "the model takes x: float32[batch, 32]" in raised.value.message


def test_the_repository_carries_the_license_pyproject_names() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256
    assert b"Apache License\n                           Version 2.0, January 2004" in text
