"""The orchestrator in a real cluster (two CPU backends, real ONNX Runtime sessions of the
built-in MLP, tritonclient over HTTP): a model folder copied into the repository after start is
loaded with ``load_model`` (the folder is read again), answers and has its Prometheus series; a
request for a repository model loaded nowhere waits for an on-demand load and is answered with
the model's outputs; a model with no request for ``idle_unload_s`` is unloaded, its backends
free it, and a request loads it on demand again; a request held for an on-demand load that
fails is answered ``UNAVAILABLE`` with the failure, well before its deadline."""

from __future__ import annotations

import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from oip_helpers import LOOPBACK_ANY, http_input
from runtime_helpers import wait_until

import zserve
from zserve.backends.builtin import ensure_builtin
from zserve.backends.onnx_executor import OnnxExecutor
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config

# A lone request runs about its SLO after it arrives (deferred batching); the SLO also bounds
# its wait for an on-demand load (a load and warm-up of the MLP takes well under a second here).
SLO_MS = 3000.0
IDLE_UNLOAD_S = 3.0
CLIENT_TIMEOUT_S = 60.0
X = np.random.default_rng(11).standard_normal((1, 64)).astype(np.float32)


def _model_folder(root: Path, name: str) -> None:
    version = root / name / "1"
    version.mkdir(parents=True)
    shutil.copy(ensure_builtin("mlp"), version / "model.onnx")
    (root / name / "config.toml").write_text(f"slo_ms = {SLO_MS}\nmax_batch = 4\n")


def _config(root: Path) -> ClusterConfig:
    for name in ("base", "cold", "broken"):
        _model_folder(root, name)
    return parse_config({
        "cluster": {"drain_s": 5.0},
        "scheduler": {"d_ctrl_ms": 5.0, "jitter_ms": 50.0},
        "frontends": {"reply_allowance_ms": 20.0, "http_addresses": [LOOPBACK_ANY],
                      "metrics_addresses": [LOOPBACK_ANY]},
        "backends": {"count": 2, "device": "cpu"},
        "repository": {"path": str(root), "load": ["base"]},
        "orchestration": {"idle_unload_s": IDLE_UNLOAD_S},
    })


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("repository")


@pytest.fixture(scope="module")
def cluster(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(_config(repository), ipc_base=tmp_path_factory.mktemp("ipc")) as running:
        yield running


@pytest.fixture
def http(cluster: Cluster) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(cluster.http_addresses[0],
                                              network_timeout=CLIENT_TIMEOUT_S)
    yield client
    client.close()


def _states(http: httpclient.InferenceServerClient) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["state"], e.get("reason", ""))
            for e in http.get_model_repository_index()}


def _expected() -> np.ndarray[Any, Any]:
    with OnnxExecutor(["mlp"]) as executor:
        return np.asarray(executor.run("mlp", {"features": X})[0]["logits"])


def _served_by_backends(cluster: Cluster, model: str) -> list[bool]:
    return [model in cluster.stats(b)["models"] for b in ("backend-0", "backend-1")]


def test_a_model_folder_added_after_start_is_loaded_and_answers(
        cluster: Cluster, repository: Path, http: httpclient.InferenceServerClient) -> None:
    assert "added" not in _states(http)
    _model_folder(repository, "added")
    assert _states(http)["added"] == ("UNAVAILABLE", "not loaded")  # the index rescans
    http.load_model("added")
    assert _states(http)["added"] == ("READY", "")
    result = http.infer("added", [http_input("features", X)],
                        timeout=int(CLIENT_TIMEOUT_S * 1e6))
    np.testing.assert_allclose(result.as_numpy("logits"), _expected(), rtol=1e-5, atol=1e-6)
    # the shard that owns it schedules it, and a restarted role would know it
    assert "added" in cluster.stats("shard-0")["models"]
    # and the frontend's Prometheus endpoint has its series
    with urllib.request.urlopen(cluster.stats("frontend-0")["metrics_url"], timeout=10) as page:
        exposition = page.read().decode()
    assert 'zserve_model_requests_total{frontend="frontend-0",model="added",outcome="ok"} 1.0' \
        in exposition


def test_a_request_for_a_model_loaded_nowhere_is_answered_after_an_on_demand_load(
        cluster: Cluster, http: httpclient.InferenceServerClient) -> None:
    assert _states(http)["cold"] == ("UNAVAILABLE", "not loaded")
    with zserve.Client(cluster.client_address, timeout=CLIENT_TIMEOUT_S,
                       max_retries=0) as client:
        outputs = client.infer("cold", {"features": X})
    np.testing.assert_allclose(outputs["logits"], _expected(), rtol=1e-5, atol=1e-6)
    assert cluster.stats("frontend-0")["counters"]["outcome/cold/ok"] == 1


def test_an_idle_model_is_unloaded_and_loads_again_on_demand(
        cluster: Cluster, http: httpclient.InferenceServerClient) -> None:
    # "added" (loaded by the first test) has had no request since: it goes, and its backends
    # free it
    wait_until(lambda: _states(http)["added"] == ("UNAVAILABLE", "unloaded"),
               lambda: f"added to be unloaded when idle: {_states(http)}",
               timeout_s=10 * IDLE_UNLOAD_S)
    wait_until(lambda: not any(_served_by_backends(cluster, "added")),
               "the backends to free added")
    result = http.infer("added", [http_input("features", X)],
                        timeout=int(CLIENT_TIMEOUT_S * 1e6))
    np.testing.assert_allclose(result.as_numpy("logits"), _expected(), rtol=1e-5, atol=1e-6)


def test_a_request_held_for_a_load_that_fails_is_answered_unavailable_not_deadline(
        cluster: Cluster, repository: Path) -> None:
    # the folder was valid when the cluster read it; its weights break before the load
    (repository / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    with (zserve.Client(cluster.client_address, timeout=CLIENT_TIMEOUT_S,
                        max_retries=0) as client,
          pytest.raises(zserve.UnavailableError, match="cannot be loaded")):
        client.infer("broken", {"features": X})
    counters = cluster.stats("frontend-0")["counters"]
    assert counters["outcome/broken/UNAVAILABLE"] == 1
    assert counters.get("outcome/broken/DEADLINE", 0) == 0
