"""Shared by the Open Inference Protocol tests: clusters with the OIP servers on, and the
outcome of a call through a real tritonclient, HTTP or gRPC, as (status or code, kind)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from zserve.config.cluster import ClusterConfig, parse_config

LOOPBACK_ANY = "127.0.0.1:0"
JITTER_MS = 50.0


def oip_cluster(*, backends: int = 1, max_request_bytes: int = 1024,
                slow_beta_ms: float = 1000.0, slow_slo_ms: float = 30000.0,
                slow_max_queue: int = 2) -> ClusterConfig:
    """Emulated backends serving a quick model ``m`` (inputs float32[1, 4]) and a slow one
    ``slow`` (one batch takes ``slow_beta_ms``; at most ``slow_max_queue`` queued; deferred
    batching starts a lone request's batch at about ``slow_slo_ms - slow_beta_ms``), with
    generous SLOs for a loaded 2-core machine, and both OIP servers on kernel-chosen loopback
    ports."""
    return parse_config({
        "cluster": {"drain_s": 10.0},
        # A lone request is planned at its deadline - jitter - l(2): a wide jitter leaves it
        # room on a loaded host (the first request after start is deferred that far).
        "scheduler": {"d_ctrl_ms": 5.0, "jitter_ms": JITTER_MS},
        "frontends": {"reply_allowance_ms": 20.0, "max_request_bytes": max_request_bytes,
                      "http_addresses": [LOOPBACK_ANY], "grpc_addresses": [LOOPBACK_ANY]},
        "backends": {"count": backends, "device": "emulated"},
        "models": [
            {"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0}, "slo_ms": 5000.0,
             "max_batch": 16},
            {"name": "slow", "emulated": {"alpha_ms": 0.0, "beta_ms": slow_beta_ms},
             "slo_ms": slow_slo_ms, "max_batch": 16, "max_queue": slow_max_queue},
        ],
    })


def http_input(name: str, array: np.ndarray[Any, Any], binary: bool = True,
               datatype: str = "FP32") -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def grpc_input(name: str, array: np.ndarray[Any, Any],
               datatype: str = "FP32") -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def http_status(call: Callable[[], Any]) -> int:
    """The HTTP status of a tritonclient.http call (200: it succeeded)."""
    try:
        call()
    except InferenceServerException as exc:
        return int(exc.status() or 0)
    return 200


def grpc_code(call: Callable[[], Any]) -> str:
    """The gRPC status code's name of a tritonclient.grpc call ("OK": it succeeded)."""
    try:
        call()
    except InferenceServerException as exc:
        return str(exc.status()).removeprefix("StatusCode.")
    return "OK"


def grpc_trailers(address: str, model: str, array: np.ndarray[Any, Any],
                  **parameters: int) -> tuple[grpc.StatusCode, dict[str, str]]:
    """Call ModelInfer with a plain grpc channel: the status code and the trailing metadata
    (tritonclient keeps only the code and message)."""
    from zserve.frontend.oip import oip_inference_pb2 as pb

    request = pb.ModelInferRequest(model_name=model, raw_input_contents=[array.tobytes()])
    request.inputs.add(name="x", datatype="FP32", shape=array.shape)
    for key, value in parameters.items():
        request.parameters[key].int64_param = value
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
        try:
            call(request, timeout=60)
        except grpc.RpcError as exc:
            trailers = exc.trailing_metadata() or ()
            return exc.code(), {str(item.key): str(item.value) for item in trailers}
    return grpc.StatusCode.OK, {}
