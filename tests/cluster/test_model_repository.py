"""The model repository through a real cluster and the real tritonclient: a repository folder of
ONNX models on two CPU backends (real ONNX Runtime sessions), one loaded at start and two not.
The index lists every model with its state, over HTTP and gRPC; a model not loaded at start is
refused UNAVAILABLE, then loaded (every backend warms and announces it) and served, with the
outputs the model gives when run here; unloading a model with queued requests answers each of
them UNAVAILABLE (typed, never silence), and the backends free it; calls that cannot succeed
(an unknown model, load parameters) are typed errors."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from oip_helpers import LOOPBACK_ANY, grpc_code, http_input, http_status
from runtime_helpers import wait_until

import zserve
from zserve.backends.builtin import ensure_builtin
from zserve.backends.onnx_executor import OnnxExecutor
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.core.errors import UnavailableError

# A lone request of ``quick`` runs about its SLO after it arrives (deferred batching); one of
# ``held`` stays queued for most of a minute: long enough to unload the model under it.
QUICK_SLO_MS = 1500.0
HELD_SLO_MS = 60000.0
QUEUED = 3
CLIENT_TIMEOUT_S = 90.0
X = np.random.default_rng(7).standard_normal((1, 64)).astype(np.float32)


def _repository(root: Path) -> Path:
    """``quick``, ``late`` and ``held``: the built-in MLP (float32 Nx64 -> Nx10) three times."""
    mlp = ensure_builtin("mlp")
    for name, slo_ms in (("quick", QUICK_SLO_MS), ("late", QUICK_SLO_MS), ("held", HELD_SLO_MS)):
        version = root / name / "1"
        version.mkdir(parents=True)
        shutil.copy(mlp, version / "model.onnx")
        (root / name / "config.toml").write_text(f"slo_ms = {slo_ms}\nmax_batch = 4\n")
    return root


def _config(root: Path) -> ClusterConfig:
    return parse_config({
        "cluster": {"drain_s": 5.0},
        "scheduler": {"d_ctrl_ms": 5.0, "jitter_ms": 50.0},
        "frontends": {"reply_allowance_ms": 20.0, "http_addresses": [LOOPBACK_ANY],
                      "grpc_addresses": [LOOPBACK_ANY]},
        "backends": {"count": 2, "device": "cpu"},
        "repository": {"path": str(_repository(root)), "load": ["quick"]},
    })


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = _config(tmp_path_factory.mktemp("repository"))
    with Cluster(config, ipc_base=tmp_path_factory.mktemp("ipc")) as running:
        yield running


@pytest.fixture
def http(cluster: Cluster) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(cluster.http_addresses[0],
                                              network_timeout=CLIENT_TIMEOUT_S)
    yield client
    client.close()


@pytest.fixture
def grpc_client(cluster: Cluster) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(cluster.grpc_addresses[0])
    yield client
    client.close()


def _states(index: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["state"], e.get("reason", "")) for e in index}


def _expected(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    with OnnxExecutor(["mlp"]) as executor:
        return np.asarray(executor.run("mlp", {"features": x})[0]["logits"])


def test_the_index_lists_every_model_and_its_state(
        http: httpclient.InferenceServerClient,
        grpc_client: grpcclient.InferenceServerClient) -> None:
    states = _states(http.get_model_repository_index())
    assert states["quick"] == ("READY", "")
    assert states["held"] == ("UNAVAILABLE", "not loaded")
    over_grpc = grpc_client.get_model_repository_index(as_json=True)["models"]
    assert {e["name"]: e["state"] for e in over_grpc}["quick"] == "READY"
    assert all(e["version"] == "1" for e in over_grpc) and len(over_grpc) == 3
    assert http.is_server_ready() and not http.is_model_ready("late")


def test_a_model_not_loaded_at_start_is_loaded_then_served(
        cluster: Cluster, http: httpclient.InferenceServerClient) -> None:
    tensor = http_input("features", X)
    assert http_status(lambda: http.infer("late", [tensor])) == 503  # UNAVAILABLE
    http.load_model("late")  # returns once every backend warmed and announced it
    assert _states(http.get_model_repository_index())["late"] == ("READY", "")
    assert http.is_model_ready("late")
    for backend in ("backend-0", "backend-1"):
        stats = cluster.stats(backend)
        assert "late" in stats["models"] and stats["warmed"]["late"] == [1, 2, 3, 4]
        assert stats["counters_total"]["models_loaded"] >= 1
    result = http.infer("late", [tensor], timeout=int(10 * QUICK_SLO_MS * 1e3))
    np.testing.assert_allclose(result.as_numpy("logits"), _expected(X), rtol=1e-5, atol=1e-6)
    http.load_model("late")  # loaded already: answered at once


def test_unloading_a_model_answers_its_queued_requests_unavailable(
        cluster: Cluster, grpc_client: grpcclient.InferenceServerClient) -> None:
    grpc_client.load_model("held")
    wait_until(lambda: cluster.stats("frontend-0")["unready_models"].count("held") == 0,
               "the frontend to see held served")
    with zserve.Client(cluster.client_address, timeout=CLIENT_TIMEOUT_S,
                       max_retries=0) as client:
        futures: list[Future[Any]] = [client.submit("held", {"features": X})
                                      for _ in range(QUEUED)]
        wait_until(lambda: cluster.stats("shard-0")["models"]["held"]["queued"] == QUEUED,
                   "the requests of held to be queued at the scheduler")
        grpc_client.unload_model("held")  # returns once both backends freed it
        for future in futures:
            with pytest.raises(UnavailableError, match="no backend serves 'held'"):
                future.result(timeout=CLIENT_TIMEOUT_S)
        with pytest.raises(UnavailableError):
            client.infer("held", {"features": X})
    states = _states(grpc_client.get_model_repository_index(as_json=True)["models"])
    assert states["held"] == ("UNAVAILABLE", "unloaded")
    for backend in ("backend-0", "backend-1"):
        stats = cluster.stats(backend)
        assert "held" not in stats["models"] and "held" not in stats["warmed"]
        assert stats["counters_total"]["models_unloaded"] >= 1


def test_calls_that_cannot_succeed_are_typed_errors(
        http: httpclient.InferenceServerClient,
        grpc_client: grpcclient.InferenceServerClient) -> None:
    assert http_status(lambda: http.load_model("nope")) == 400
    assert grpc_code(lambda: grpc_client.unload_model("nope")) == "INVALID_ARGUMENT"
    assert http_status(lambda: http.load_model("quick", config='{"max_batch_size": 2}')) == 400
    assert http.is_model_ready("quick")
