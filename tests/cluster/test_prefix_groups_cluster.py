"""Prefix groups end to end through real processes (``[[prefix_groups]]``): three variants of
the built-in CNN that differ in their last layer are scheduled as one model, so their rows share
batches; the backend runs the merged model (the prefix once, each head on its own rows) with
real ONNX Runtime sessions, and every request gets exactly one answer, its own: the outputs its
full model gives its inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

import zserve
from zserve.backends.prefix import cnn_variants
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.frontend.core import OUTCOME_OF_MODEL

VARIANTS = 3
REQUESTS = 36
ROWS = (1, 2, 3)
MAX_BATCH = 16
# As tests/cluster/test_runtime_rows.py: a loaded 2-core host stalls processes for hundreds of
# ms; the test checks answers, not the SLO.
HOST_STALL_ALLOWANCE_MS = 500.0


def _config(paths: list[Path]) -> ClusterConfig:
    names = [f"cnn-v{i}" for i in range(len(paths))]
    return parse_config({
        "cluster": {"drain_s": 2.0},
        "scheduler": {"policy": "deferred", "d_ctrl_ms": 2.0,
                      "jitter_ms": HOST_STALL_ALLOWANCE_MS},
        "frontends": {"reply_allowance_ms": 20.0},
        "backends": {"count": 1, "device": "cpu"},
        "models": [{"name": n, "onnx": str(p), "slo_ms": 3000.0, "max_batch": MAX_BATCH}
                   for n, p in zip(names, paths, strict=True)],
        "prefix_groups": [{"name": "cnn-heads", "models": names}],
    })


def _batch_rows(cluster: Cluster, model: str) -> dict[int, int]:
    """The backends' batches of ``model``: size (rows) -> count."""
    sizes: dict[int, int] = {}
    for name in cluster.pids():
        if name.startswith("backend-"):
            for size, count in cluster.stats(name)["batch_sizes"].get(model, {}).items():
                sizes[int(size)] = sizes.get(int(size), 0) + int(count)
    return sizes


def test_grouped_variants_answer_each_request_with_its_full_models_outputs(
        tmp_path: Path) -> None:
    paths = cnn_variants(VARIANTS, tmp_path / "variants")
    config = _config(paths)
    full = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in paths]
    rng = np.random.default_rng(11)
    requests: list[tuple[int, dict[str, Any]]] = [
        (i % VARIANTS, {"image": rng.standard_normal((ROWS[i // VARIANTS % len(ROWS)], 3, 64,
                                                      64), dtype=np.float32)})
        for i in range(REQUESTS)]
    expected = [full[v].run(None, inputs)[0] for v, inputs in requests]
    with Cluster(config, ipc_base=tmp_path) as cluster, \
            zserve.Client(cluster.client_address, timeout=60) as client:
        futures = [client.submit(f"cnn-v{v}", inputs) for v, inputs in requests]
        for future, want in zip(futures, expected, strict=True):
            np.testing.assert_allclose(future.result(60)["logits"], want, rtol=1e-5, atol=1e-5)
        with pytest.raises(zserve.core.errors.BadRequestError, match="unknown model"):
            client.infer("cnn-heads", {"image": np.zeros((1, 3, 64, 64), np.float32)})
        sizes = _batch_rows(cluster, "cnn-heads")
        frontend = cluster.stats("frontend-0")
    total_rows = sum(next(iter(inputs.values())).shape[0] for _, inputs in requests)
    assert sum(size * count for size, count in sizes.items()) == total_rows  # each row once
    assert sum(sizes.values()) < REQUESTS  # the variants' requests shared batches
    for v in range(VARIANTS):  # each variant keeps its own stats
        assert frontend["counters"][OUTCOME_OF_MODEL.format(f"cnn-v{v}", "ok")] == \
            REQUESTS // VARIANTS
