"""An ``[[apps]]`` app served by a real cluster (emulated backends): called by name through
tritonclient HTTP (metadata, readiness, inference, a bad input's error) and the native client,
answered with the three models' chained outputs; and ``zserve experiment apps --quick``."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import parse_config
from zserve.loadgen.experiments import common, runner
from zserve.loadgen.experiments.apps import APP, apps_cluster_toml, expected_outputs

CLIENT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = parse_config(tomllib.loads(apps_cluster_toml()))
    with Cluster(config, ipc_base=tmp_path_factory.mktemp("apps")) as running:
        yield running


def test_tritonclient_calls_an_app_like_a_model(cluster: Cluster) -> None:
    client = httpclient.InferenceServerClient(cluster.http_addresses[0])
    try:
        assert client.is_model_ready(APP)
        metadata = client.get_model_metadata(APP)
        assert [(t["name"], t["shape"]) for t in metadata["inputs"]] == [("image", [-1, 4])]
        assert [(t["name"], t["shape"]) for t in metadata["outputs"]] == [("y", [-1, 1])]
        image = np.full((1, 4), 2.5, np.float32)
        tensor = httpclient.InferInput("image", [1, 4], "FP32")
        tensor.set_data_from_numpy(image)
        result = client.infer(APP, [tensor])
        np.testing.assert_array_equal(result.as_numpy("y"), expected_outputs(image))
        wrong = httpclient.InferInput("picture", [1, 4], "FP32")
        wrong.set_data_from_numpy(image)
        with pytest.raises(InferenceServerException, match="takes inputs 'image'"):
            client.infer(APP, [wrong])
    finally:
        client.close()


def test_the_native_client_calls_an_app_by_name(cluster: Cluster) -> None:
    images = [np.full((1, 4), float(i), np.float32) for i in range(4)]
    with zserve.Client(cluster.client_address, timeout=CLIENT_TIMEOUT_S) as client:
        for image in images:
            outputs = client.infer(APP, {"image": image})
            np.testing.assert_array_equal(outputs["y"], expected_outputs(image))
        with pytest.raises(zserve.ZServeError, match="stage 'detect'"):
            client.infer(APP, {"image": np.zeros((1, 5), np.float32)})


def test_apps_experiment_quick(tmp_path: Path) -> None:
    opts = common.Options(quick=True, live=True, out_dir=tmp_path / "apps", plots=False,
                          say=lambda _line: None)
    result = runner.run_experiment("apps", opts, "zserve experiment apps --live --quick")
    failed = [c for c in result["checks"] if not c["passed"]]
    assert not failed, failed
    (row,) = result["tables"][0]["rows"]
    assert row[0] == row[1] > 0  # sent == answered
