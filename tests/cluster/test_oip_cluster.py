"""The Open Inference Protocol through real clusters and the real clients users run:
``tritonclient.http`` / ``.http.aio`` / ``.grpc`` / ``.grpc.aio`` against the frontend's HTTP and
gRPC servers. Health and metadata, inference with JSON and binary data and over gRPC, requested
outputs, request ids, the timeout parameter, and every error kind made to happen for real, with
its HTTP status and gRPC code; unknown models (404 / NOT_FOUND), Triton's endpoints zserve does
not serve (501 / UNIMPLEMENTED) and unknown paths, each with a message tritonclient reads.
Emulated backends (outputs checked against the model run here)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from oip_helpers import (
    grpc_code,
    grpc_input,
    grpc_trailers,
    http_input,
    http_status,
    oip_cluster,
)
from runtime_helpers import wait_until_async
from tritonclient.utils import InferenceServerException

from zserve.backends.host import build_executor
from zserve.cluster.supervisor import Cluster

X = np.arange(4, dtype=np.float32).reshape(1, 4)
# Waits on the frontend's stats: asked every STATS_POLL_S, for at most STATS_WAIT_S.
STATS_POLL_S = 0.01
STATS_WAIT_S = 20.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Model ``slow``: a lone request's batch starts about 2 s after it arrives and runs 1 s.
    config = oip_cluster(slow_beta_ms=1000.0, slow_slo_ms=3000.0)
    with Cluster(config, ipc_base=tmp_path_factory.mktemp("oip")) as running:
        yield running


@pytest.fixture(scope="module")
def expected() -> np.ndarray[Any, Any]:
    """Model ``m``'s output for ``X``, computed here by the emulated executor."""
    executor: Any = build_executor("emulated", [oip_cluster().model("m")])
    executor.load()
    return np.asarray(executor.expected_outputs("m", {"x": X})["y"])


@pytest.fixture
def http(cluster: Cluster) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(cluster.http_addresses[0])
    yield client
    client.close()


@pytest.fixture
def grpc_client(cluster: Cluster) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(cluster.grpc_addresses[0])
    yield client
    client.close()


def test_health_and_metadata_over_http(http: httpclient.InferenceServerClient) -> None:
    assert http.is_server_live() and http.is_server_ready()
    assert http.is_model_ready("m") and http.is_model_ready("m", "1")
    server = http.get_server_metadata()
    assert server["name"] == "zserve" and "binary_tensor_data" in server["extensions"]
    meta = http.get_model_metadata("m")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}]
    config = http.get_model_config("m")
    assert config["max_batch_size"] == 16
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    assert http_status(lambda: http.get_model_metadata("nope")) == 404


def test_health_and_metadata_over_grpc(grpc_client: grpcclient.InferenceServerClient) -> None:
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    assert grpc_client.is_model_ready("m")
    assert grpc_client.get_server_metadata().name == "zserve"
    meta = grpc_client.get_model_metadata("m", as_json=True)
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    config = grpc_client.get_model_config("m").config
    assert config.max_batch_size == 16 and list(config.input[0].dims) == [4]
    assert grpc_code(lambda: grpc_client.get_model_metadata("nope")) == "NOT_FOUND"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_over_http(http: httpclient.InferenceServerClient, expected: Any,
                         binary: bool) -> None:
    result = http.infer("m", [http_input("x", X, binary)], request_id=f"req-{binary}",
                        outputs=[httpclient.InferRequestedOutput("y", binary_data=binary)])
    np.testing.assert_array_equal(result.as_numpy("y"), expected)
    response = result.get_response()
    assert response["id"] == f"req-{binary}" and response["model_name"] == "m"
    assert ("data" in response["outputs"][0]) is not binary


def test_infer_over_grpc(grpc_client: grpcclient.InferenceServerClient, expected: Any) -> None:
    result = grpc_client.infer("m", [grpc_input("x", X)], request_id="g-1",
                               outputs=[grpcclient.InferRequestedOutput("y")])
    np.testing.assert_array_equal(result.as_numpy("y"), expected)
    assert result.get_response().id == "g-1"
    assert len(result.get_response().raw_output_contents) == 1


async def test_asyncio_clients(cluster: Cluster, expected: Any) -> None:
    """The asyncio clients, several requests in flight at once on each."""
    http = httpaio.InferenceServerClient(cluster.http_addresses[0])
    grpc_client = grpcaio.InferenceServerClient(cluster.grpc_addresses[0])
    try:
        assert await http.is_server_ready() and await grpc_client.is_model_ready("m")
        results = await asyncio.gather(
            *(http.infer("m", [http_input("x", X)], request_id=f"h{i}") for i in range(4)),
            *(grpc_client.infer("m", [grpc_input("x", X)], request_id=f"g{i}")
              for i in range(4)))
        for result in results:
            np.testing.assert_array_equal(result.as_numpy("y"), expected)
    finally:
        await http.close()
        await grpc_client.close()


def test_bad_requests(http: httpclient.InferenceServerClient,
                      grpc_client: grpcclient.InferenceServerClient) -> None:
    """400 / INVALID_ARGUMENT: wrong shape, wrong datatype, unknown output; an unknown model
    is 404 / NOT_FOUND."""
    wrong_shape = X.reshape(4, 1)
    assert http_status(lambda: http.infer("nope", [http_input("x", X)])) == 404
    assert http_status(lambda: http.infer("m", [http_input("x", wrong_shape)])) == 400
    as_int = X.astype(np.int32)
    assert http_status(lambda: http.infer("m", [http_input("x", as_int, datatype="INT32")])) \
        == 400
    unknown_output = [httpclient.InferRequestedOutput("z")]
    assert http_status(lambda: http.infer("m", [http_input("x", X)],
                                          outputs=unknown_output)) == 400
    assert grpc_code(lambda: grpc_client.infer("nope", [grpc_input("x", X)])) \
        == "NOT_FOUND"
    assert grpc_code(lambda: grpc_client.infer("m", [grpc_input("x", wrong_shape)])) \
        == "INVALID_ARGUMENT"


def test_oversize_request(http: httpclient.InferenceServerClient,
                          grpc_client: grpcclient.InferenceServerClient) -> None:
    """413: inputs over ``max_request_bytes`` (1024 here)."""
    big = np.zeros((1, 400), dtype=np.float32)
    assert http_status(lambda: http.infer("m", [http_input("x", big)])) == 413
    assert grpc_code(lambda: grpc_client.infer("m", [grpc_input("x", big)])) \
        == "INVALID_ARGUMENT"


def test_impossible_slo(http: httpclient.InferenceServerClient,
                        grpc_client: grpcclient.InferenceServerClient) -> None:
    """504 / DEADLINE_EXCEEDED: a timeout parameter of 1 us no request can meet; a generous
    one still succeeds (the parameter is the per-request SLO, never above the model's)."""
    assert http_status(lambda: http.infer("m", [http_input("x", X)], timeout=1)) == 504
    assert grpc_code(lambda: grpc_client.infer("m", [grpc_input("x", X)], timeout=1)) \
        == "DEADLINE_EXCEEDED"
    assert http_status(lambda: http.infer("m", [http_input("x", X)], timeout=10**9)) == 200


async def test_overloaded_says_when_to_retry(cluster: Cluster) -> None:
    """429 / RESOURCE_EXHAUSTED with Retry-After: model ``slow`` queues at most 2 requests and
    holds them about 2 s, so of three sent at once the third is refused."""
    http = httpaio.InferenceServerClient(cluster.http_addresses[0])
    try:
        results = await asyncio.gather(
            *(http.infer("slow", [http_input("x", X)]) for _ in range(3)),
            return_exceptions=True)
    finally:
        await http.close()
    refused = [r for r in results if isinstance(r, InferenceServerException)]
    assert len(refused) == 1 and refused[0].status() == "429", results
    address = cluster.grpc_addresses[0]
    grpc_client = grpcaio.InferenceServerClient(address)
    try:
        calls = [grpc_client.infer("slow", [grpc_input("x", X)]) for _ in range(2)]
        pending = [asyncio.ensure_future(call) for call in calls]
        await _until_queued(cluster, "slow", 2)
        code, trailers = await asyncio.to_thread(grpc_trailers, address, "slow", X)
        await asyncio.gather(*pending)
    finally:
        await grpc_client.close()
    assert code.name == "RESOURCE_EXHAUSTED"
    assert trailers["zserve-error-kind"] == "OVERLOADED" and trailers["retry-after"] == "1"
    assert trailers["zserve-may-have-run"] == "false"


async def _until_queued(cluster: Cluster, model: str, count: int) -> None:
    last: dict[str, Any] = {}

    async def queued() -> dict[str, Any] | None:
        last.clear()
        last.update(await asyncio.to_thread(cluster.stats, "frontend-0"))
        return dict(last) if last["models"][model] >= count else None

    await wait_until_async(
        queued, lambda: f"{model} to have {count} requests queued; last stats {last}",
        timeout_s=STATS_WAIT_S, interval_s=STATS_POLL_S)


async def test_a_cancelled_call_cancels_its_request(cluster: Cluster) -> None:
    """A gRPC call that ends before its answer (the client's deadline) cancels its request in
    the frontend (queued: it never runs; fetched: the backend drops it unless its batch has
    started), and it is never answered with outputs."""
    before = (await asyncio.to_thread(cluster.stats, "frontend-0"))["counters"]
    grpc_client = grpcaio.InferenceServerClient(cluster.grpc_addresses[0])
    try:
        with pytest.raises(InferenceServerException) as raised:
            await grpc_client.infer("slow", [grpc_input("x", X)], client_timeout=0.3)
    finally:
        await grpc_client.close()
    assert "DEADLINE_EXCEEDED" in str(raised.value.status())
    def cancelled(counters: dict[str, int]) -> int:
        return counters["cancelled"] + counters["cancelled_fetched"]

    last: dict[str, int] = {}

    async def counted() -> dict[str, int] | None:
        last.clear()
        last.update((await asyncio.to_thread(cluster.stats, "frontend-0"))["counters"])
        return dict(last) if cancelled(last) > cancelled(before) else None

    after = await wait_until_async(
        counted, lambda: f"the cancel to be counted; before {before}, last {last}",
        timeout_s=STATS_WAIT_S, interval_s=STATS_POLL_S)
    assert cancelled(after) == cancelled(before) + 1, (before, after)
    assert after["error_CANCELLED"] == before["error_CANCELLED"] + 1
    assert after["replied"] == before["replied"]


def test_error_body_names_the_kind(cluster: Cluster) -> None:
    """The JSON error body carries the kind and whether the request may have run."""
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                   "data": [0, 1, 2, 3]}], "parameters": {"timeout": 1}})
    request = urllib.request.Request(f"http://{cluster.http_addresses[0]}/v2/models/m/infer",
                                     data=body.encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    with raised.value as error:
        assert error.code == 504
        answer = json.loads(error.read())
    assert answer["kind"] == "DEADLINE" and answer["may_have_run"] is True, answer


def test_ports_are_read_back(cluster: Cluster) -> None:
    """Port 0 in cluster.toml: the bound ports are the ones announced, and differ."""
    http_port = int(cluster.http_addresses[0].rsplit(":", 1)[1])
    grpc_port = int(cluster.grpc_addresses[0].rsplit(":", 1)[1])
    assert http_port > 0 and grpc_port > 0 and http_port != grpc_port


def test_off_unless_configured(tmp_path: Path) -> None:
    from zserve.config.cluster import parse_config

    config = parse_config({"models": [{"name": "m", "emulated": {"alpha_ms": 1.0,
                                                                   "beta_ms": 1.0}}]})
    assert "http" not in config.bind_addresses("frontend", 0, str(tmp_path))
    assert "grpc" not in config.bind_addresses("frontend", 0, str(tmp_path))


def _refusal(call: Callable[[], Any]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as raised:
        call()
    return raised.value


def test_unknown_models_are_not_found(http: httpclient.InferenceServerClient,
                                      grpc_client: grpcclient.InferenceServerClient) -> None:
    """404 / NOT_FOUND (Triton's codes for a model it does not serve) for every endpoint that
    names a model or a version, with a message naming it and the models served."""
    for call in (lambda: http.infer("nope", [http_input("x", X)]),
                 lambda: http.get_model_metadata("nope"), lambda: http.get_model_config("nope"),
                 lambda: http.get_model_metadata("m", "2")):
        error = _refusal(call)
        assert error.status() == "404" and "'m'" in error.message(), error
    assert not http.is_model_ready("nope")  # tritonclient reads any status but 200 as False
    for call in (lambda: grpc_client.infer("nope", [grpc_input("x", X)]),
                 lambda: grpc_client.get_model_metadata("nope"),
                 lambda: grpc_client.is_model_ready("nope"),
                 lambda: grpc_client.get_model_config("m", "2")):
        error = _refusal(call)
        assert error.status() == "StatusCode.NOT_FOUND" and "'m'" in error.message(), error


def test_triton_endpoints_zserve_does_not_serve(
        http: httpclient.InferenceServerClient,
        grpc_client: grpcclient.InferenceServerClient) -> None:
    """Statistics, trace, logging and shared memory: 501 / UNIMPLEMENTED, as Triton answers
    what it does not support, with a message tritonclient reads naming the extension (no "an
    exception occurred in the client while decoding the response"). (The model repository is
    served: tests/cluster/test_model_repository.py.)"""
    calls = {
        "statistics": (http.get_inference_statistics, grpc_client.get_inference_statistics),
        "trace": (http.get_trace_settings, grpc_client.get_trace_settings),
        "logging": (http.get_log_settings, grpc_client.get_log_settings),
        "system_shared_memory": (http.get_system_shared_memory_status,
                                 grpc_client.get_system_shared_memory_status),
        "cuda_shared_memory": (http.get_cuda_shared_memory_status,
                               grpc_client.get_cuda_shared_memory_status),
    }
    for extension, (over_http, over_grpc) in calls.items():
        error = _refusal(over_http)
        assert error.status() == "501" and f"Triton's {extension} extension" in error.message()
        error = _refusal(over_grpc)
        assert error.status() == "StatusCode.UNIMPLEMENTED", error
        assert f"Triton's {extension} extension" in error.message(), error
    # the model named in a statistics path does not make it a model's metadata
    error = _refusal(lambda: http.get_inference_statistics("m"))
    assert error.status() == "501" and "statistics" in error.message()


def test_streaming_inference_is_unimplemented(cluster: Cluster) -> None:
    """Triton's bidirectional ModelStreamInfer: UNIMPLEMENTED, naming what is not served."""
    from zserve.frontend.oip import oip_inference_pb2 as pb

    with grpc.insecure_channel(cluster.grpc_addresses[0]) as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as raised:
            list(stream(iter([pb.ModelInferRequest(model_name="m")]), timeout=60))
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "streaming" in str(raised.value.details())


def _http_error(cluster: Cluster, method: str, path: str,
                body: bytes = b"{}") -> tuple[int, dict[str, Any], Any]:
    """The status, JSON body and headers of a request answered with an error."""
    request = urllib.request.Request(f"http://{cluster.http_addresses[0]}{path}", method=method,
                                     data=body if method == "POST" else None)
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    with raised.value as error:
        assert error.headers["Content-Type"].startswith("application/json")
        return error.code, json.loads(error.read()), error.headers


def test_unknown_paths_answer_json(cluster: Cluster) -> None:
    """A path no endpoint serves is 404, one served under other methods 405 with ``Allow``:
    each with the JSON error body (aiohttp's own would be plain text)."""
    code, answer, _ = _http_error(cluster, "GET", "/v2/nothing/here")
    assert code == 404 and "GET /v2/nothing/here" in answer["error"], answer
    assert answer["kind"] == "BAD_REQUEST" and answer["may_have_run"] is False
    code, answer, headers = _http_error(cluster, "POST", "/v2/health/ready")
    assert code == 405 and headers["Allow"] == "GET, HEAD" and "GET" in answer["error"], answer
    code, answer, headers = _http_error(cluster, "GET", "/v2/models/m/infer")
    assert code == 405 and headers["Allow"] == "POST", answer


def test_a_request_carries_a_batch_of_rows(http: httpclient.InferenceServerClient,
                                           grpc_client: grpcclient.InferenceServerClient,
                                           expected: Any) -> None:
    """An OIP request of n rows (leading dimension n, up to max_batch) is answered with n rows,
    row i answering row i (docs/runtime.md, "Rows")."""
    rows = np.concatenate([X, X + 1.0, X])
    for result in (http.infer("m", [http_input("x", rows)]),
                   grpc_client.infer("m", [grpc_input("x", rows)])):
        answer = result.as_numpy("y")
        assert answer.shape == (3, 1)
        np.testing.assert_array_equal(answer[[0, 2]], np.concatenate([expected, expected]))
        assert answer[1, 0] != answer[0, 0]


def test_a_shape_error_states_the_accepted_shape_with_its_batch_dimension(
        cluster: Cluster, http: httpclient.InferenceServerClient,
        grpc_client: grpcclient.InferenceServerClient) -> None:
    wrong = np.zeros((3, 5), dtype=np.float32)
    for call in (lambda: http.infer("m", [http_input("x", wrong)]),
                 lambda: grpc_client.infer("m", [grpc_input("x", wrong)])):
        message = _refusal(call).message()
        assert "has shape (3, 5)" in message and "accepts (batch, 4) ([-1, 4]" in message, \
            message
    # the metadata's shape sent as it reads: the -1 is explained
    body = json.dumps({"inputs": [{"name": "x", "shape": [-1, 4], "datatype": "FP32",
                                   "data": [0, 1, 2, 3]}]}).encode()
    code, answer, _ = _http_error(cluster, "POST", "/v2/models/m/infer", body)
    assert code == 400 and "-1 in a model's metadata means any size" in answer["error"], answer
