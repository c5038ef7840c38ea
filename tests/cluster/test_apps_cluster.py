"""An ``[[apps]]`` app served by a real cluster (emulated backends): called by name through
tritonclient HTTP (metadata, readiness, inference, a bad input's error) and the native client,
answered with the three models' chained outputs; the same app under a non-default splitter,
re-split from the rates its frontend measured while tritonclient calls it; and ``zserve
experiment apps --quick``."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from runtime_helpers import wait_until
from tritonclient.utils import InferenceServerException

import zserve
from zserve.cluster.supervisor import Cluster
from zserve.config.apps import DEFAULT_SPLITTER, SPLITTERS
from zserve.config.cluster import parse_config
from zserve.loadgen.experiments import common, runner
from zserve.loadgen.experiments.apps import APP, apps_cluster_toml, expected_outputs

CLIENT_TIMEOUT_S = 30.0
RESPLIT_EVERY_S = 0.3


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


def test_a_non_default_splitter_resplits_while_tritonclient_calls_the_app(
        tmp_path: Path) -> None:
    splitter = next(name for name in SPLITTERS if name not in ("proportional", DEFAULT_SPLITTER))
    config = parse_config(tomllib.loads(apps_cluster_toml(
        splitter=splitter, resplit_every_s=RESPLIT_EVERY_S)))
    with Cluster(config, ipc_base=tmp_path) as running:
        client = httpclient.InferenceServerClient(running.http_addresses[0])
        sent = 0

        def call() -> bool:
            """One app request through tritonclient: True when answered with the chained
            outputs, False when a stage missed its deadline (a loaded host's stall)."""
            nonlocal sent
            image = np.full((1, 4), float(sent % 7), np.float32)
            sent += 1
            tensor = httpclient.InferInput("image", [1, 4], "FP32")
            tensor.set_data_from_numpy(image)
            try:
                result = client.infer(APP, [tensor])
            except InferenceServerException as exc:
                assert "[504]" in str(exc), exc  # DEADLINE only: any other error is a fault
                return False
            np.testing.assert_array_equal(result.as_numpy("y"), expected_outputs(image))
            return True

        def resplit() -> dict[str, Any] | None:
            """The frontend's split once a period's measured rates have re-split it (one more
            request each time, so every period measures some)."""
            call()
            stats = running.stats("frontend-0")
            return stats["app_splits"][APP] if stats["counters"]["app_resplits"] >= 1 else None

        try:
            split = wait_until(resplit, f"a re-split by {splitter!r}")
            assert split["splitter"] == splitter and split["by_splitter"]
            assert set(split["rates_rps"]) == {"detect", "classify", "track"}
            assert split["rates_rps"]["classify"] > 0
            assert sum(split["budgets_ms"].values()) <= config.apps[0].slo_ms
            wait_until(call, "an app request answered under the new split")
        finally:
            client.close()


def test_apps_experiment_quick(tmp_path: Path) -> None:
    opts = common.Options(quick=True, live=True, out_dir=tmp_path / "apps", plots=False,
                          say=lambda _line: None)
    result = runner.run_experiment("apps", opts, "zserve experiment apps --live --quick")
    failed = [c for c in result["checks"] if not c["passed"]]
    assert not failed, failed
    (row,) = result["tables"][0]["rows"]
    assert row[0] == row[1] > 0  # sent == answered
