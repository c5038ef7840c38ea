"""Health that tells the truth, and the errors of faults, through the real OIP clients: a wedged
backend makes its models unready (and their requests UNAVAILABLE, 503) within the heartbeat
timeout and ready again when it recovers; a backend that dies under a batch answers it
BACKEND_FAILED (500 / INTERNAL); a draining frontend is unready and refuses new requests
SHUTTING_DOWN (503 / UNAVAILABLE) while it still answers the one in flight. And the demo's ONNX
CNN served over both protocols, checked against the model run here."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from oip_helpers import (
    JITTER_MS,
    LOOPBACK_ANY,
    grpc_code,
    grpc_input,
    http_input,
    http_status,
    oip_cluster,
)
from runtime_helpers import wait_until

from zserve.backends.host import build_executor
from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import load_config
from zserve.scheduler.rank_backends import BACKEND_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
X = np.arange(4, dtype=np.float32).reshape(1, 4)
# The rank's liveness loop looks every BACKEND_TIMEOUT_S / 4; the table then reaches the frontend.
UNREADY_WITHIN_S = BACKEND_TIMEOUT_S * 1.25 + 1.0
RECOVERY_S = 60.0


def test_wedged_backend_makes_its_models_unready(tmp_path: Path) -> None:
    with Cluster(oip_cluster(), ipc_base=tmp_path) as cluster:
        http = httpclient.InferenceServerClient(cluster.http_addresses[0])
        grpc_client = grpcclient.InferenceServerClient(cluster.grpc_addresses[0])
        pid = cluster.pids()["backend-0"]
        assert pid is not None and http.is_server_ready() and http.is_model_ready("m")
        os.kill(pid, signal.SIGSTOP)  # alive, heartbeating no more
        try:
            stopped_at = time.monotonic()
            wait_until(lambda: not http.is_model_ready("m"), "unready",
                       timeout_s=UNREADY_WITHIN_S * 2)
            assert time.monotonic() - stopped_at < UNREADY_WITHIN_S * 2
            assert not http.is_server_ready() and not grpc_client.is_model_ready("m")
            stats = cluster.stats("frontend-0")
            assert stats["ready"] is False and stats["unready_models"] == ["m", "slow"]
            assert not grpc_client.is_server_ready() and http.is_server_live()
            assert http_status(lambda: http.infer("m", [http_input("x", X)])) == 503
            assert grpc_code(lambda: grpc_client.infer("m", [grpc_input("x", X)])) \
                == "UNAVAILABLE"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        wait_until(http.is_server_ready, "ready again", timeout_s=RECOVERY_S)
        assert cluster.stats("frontend-0")["ready"] is True
        assert http_status(lambda: http.infer("m", [http_input("x", X)])) == 200
        http.close()
        grpc_client.close()


def test_backend_dying_under_a_batch_is_500(tmp_path: Path) -> None:
    """Model ``slow``'s batch runs 3 s; the backend is killed while it runs: both requests of
    the batch (one HTTP, one gRPC) are answered BACKEND_FAILED at once."""
    config = oip_cluster(slow_beta_ms=3000.0, slow_slo_ms=4500.0)
    with Cluster(config, ipc_base=tmp_path) as cluster, \
            ThreadPoolExecutor(2) as pool:
        http = httpclient.InferenceServerClient(cluster.http_addresses[0])
        grpc_client = grpcclient.InferenceServerClient(cluster.grpc_addresses[0])
        http_call = pool.submit(http_status, lambda: http.infer("slow", [http_input("x", X)]))
        grpc_call = pool.submit(grpc_code,
                                lambda: grpc_client.infer("slow", [grpc_input("x", X)]))
        wait_until(lambda: cluster.stats("frontend-0")["fetched_by"].get("backend-0", 0) == 2,
                   "the batch of both requests to start", timeout_s=10.0)
        cluster.kill("backend-0")
        assert http_call.result(20.0) == 500
        assert grpc_call.result(20.0) == "INTERNAL"
        http.close()
        grpc_client.close()


def test_draining_frontend_is_unready_and_answers_in_flight(tmp_path: Path) -> None:
    config = oip_cluster(slow_beta_ms=2000.0, slow_slo_ms=3000.0)
    cluster = Cluster(config, ipc_base=tmp_path).start()
    http = httpclient.InferenceServerClient(cluster.http_addresses[0])
    grpc_client = grpcclient.InferenceServerClient(cluster.grpc_addresses[0])
    stopper: threading.Thread | None = None
    with ThreadPoolExecutor(1) as pool:
        try:
            in_flight: Future[Any] = pool.submit(
                lambda: http.infer("slow", [http_input("x", X)]).as_numpy("y"))
            wait_until(lambda: cluster.stats("frontend-0")["pending"] == 1, "admitted",
                       timeout_s=20.0)
            stopper = threading.Thread(target=cluster.stop)
            stopper.start()
            checker = httpclient.InferenceServerClient(cluster.http_addresses[0])
            wait_until(lambda: not checker.is_server_ready(), "unready while draining",
                       timeout_s=20.0)
            assert http_status(lambda: checker.infer("m", [http_input("x", X)])) == 503
            assert grpc_code(lambda: grpc_client.infer("m", [grpc_input("x", X)])) \
                == "UNAVAILABLE"
            assert in_flight.result(20.0).shape == (1, 1)  # answered before the frontend went
            checker.close()
        finally:
            if stopper is None:
                cluster.stop()
            else:
                stopper.join()
            http.close()
            grpc_client.close()


def test_demo_cnn_over_both_protocols(tmp_path: Path) -> None:
    """The demo cluster's ONNX CNN (two CPU backends): HTTP binary, HTTP JSON and gRPC answers
    equal the model run here."""
    demo = load_config(REPO / "examples" / "clusters" / "demo.toml")
    frontends = msgspec.structs.replace(demo.frontends, http_addresses=(LOOPBACK_ANY,),
                                        grpc_addresses=(LOOPBACK_ANY,),
                                        metrics_addresses=(LOOPBACK_ANY,))
    scheduler = msgspec.structs.replace(demo.scheduler, jitter_ms=JITTER_MS)
    config = msgspec.structs.replace(demo, frontends=frontends, scheduler=scheduler)
    executor: Any = build_executor("cpu", list(config.models))
    executor.load()
    image = np.random.default_rng(0).standard_normal((1, 3, 64, 64), dtype=np.float32)
    expected = executor.run("cnn", [{"image": image}])[0]["logits"]
    with Cluster(config, ipc_base=tmp_path) as cluster:
        http = httpclient.InferenceServerClient(cluster.http_addresses[0])
        grpc_client = grpcclient.InferenceServerClient(cluster.grpc_addresses[0])
        meta = http.get_model_metadata("cnn")
        assert meta["inputs"] == [{"name": "image", "datatype": "FP32",
                                   "shape": [-1, 3, 64, 64]}]
        for binary in (True, False):
            result = http.infer("cnn", [http_input("image", image, binary)])
            np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-4,
                                       atol=1e-5)
        result = grpc_client.infer("cnn", [grpc_input("image", image)])
        np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-4, atol=1e-5)
        http.close()
        grpc_client.close()
