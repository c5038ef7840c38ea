"""The client side of examples/kubernetes/e2e.sh: checks answers, and plays the Service.

``check``: every frontend answers N requests over OIP HTTP and gRPC (tritonclient), each
compared with the model run here (ONNX Runtime on the same ONNX file).

``load``: open-loop requests at ``--rate`` until ``STATE/stop`` appears, each sent to a frontend
as a Kubernetes Service would route it: round-robin over the frontends that are ready
(``/v2/health/ready`` polled every ``READY_POLL_S``) and not terminating (e2e.sh creates
``STATE/terminating/NAME`` before it runs a pod's preStop, as the endpoints controller takes a
terminating pod out at once). Every answer is compared with the model's; the summary line
counts each outcome, and the exit status is 1 if any request sent was not answered correctly
(one that found no endpoint once ``STATE/stop`` appeared was never sent: ``NOT_SENT``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import itertools
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

MODEL = "cnn"
INPUT, OUTPUT = "image", "logits"
SHAPE = (1, 3, 64, 64)
READY_POLL_S = 0.2
CONCURRENCY = 16
# A request the load had ready once the Service had no endpoint left and the stop was called:
# never sent, so not lost (a client would have been refused by the Service itself).
NOT_SENT = "NOT_SENT"


def image_of(index: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(index).standard_normal(SHAPE, dtype=np.float32)


class Model:
    """The model run locally: the expected answer of each request."""

    def __init__(self, path: str) -> None:
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.lock = threading.Lock()

    def expected(self, image: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        with self.lock:
            return np.asarray(self.session.run([OUTPUT], {INPUT: image})[0])


def correct(answer: np.ndarray[Any, Any] | None, expected: np.ndarray[Any, Any]) -> bool:
    # A batch of several rows may sum in another order than one row alone: close, not equal.
    return answer is not None and answer.shape == expected.shape and bool(
        np.allclose(answer, expected, rtol=1e-4, atol=1e-5))


def infer_http(endpoint: str, image: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    client = httpclient.InferenceServerClient(endpoint, network_timeout=30.0)
    try:
        tensor = httpclient.InferInput(INPUT, list(SHAPE), "FP32")
        tensor.set_data_from_numpy(image, binary_data=True)
        result = client.infer(MODEL, [tensor])
        return result.as_numpy(OUTPUT)  # type: ignore[no-any-return]
    finally:
        client.close()


def infer_grpc(endpoint: str, image: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    client = grpcclient.InferenceServerClient(endpoint)
    try:
        tensor = grpcclient.InferInput(INPUT, list(SHAPE), "FP32")
        tensor.set_data_from_numpy(image)
        result = client.infer(MODEL, [tensor])
        return result.as_numpy(OUTPUT)  # type: ignore[no-any-return]
    finally:
        client.close()


def check(args: argparse.Namespace) -> int:
    model = Model(args.model_file)
    total = good = 0
    for spec in args.frontend:
        name, endpoints = spec.split("=", 1)
        http, grpc = endpoints.split(",")
        for protocol, infer, endpoint in (("http", infer_http, http), ("grpc", infer_grpc, grpc)):
            ok = 0
            for i in range(args.requests):
                image = image_of(total + i)
                ok += correct(infer(endpoint, image), model.expected(image))
            print(f"{name} {protocol} {endpoint}: {ok}/{args.requests} answers correct")
            total += args.requests
            good += ok
    print(f"answers checked: {good}/{total} correct")
    return 0 if good == total else 1


class Service:
    """The ready, not terminating frontends, in turn (what a Service's endpoints are)."""

    def __init__(self, frontends: dict[str, str], state: Path) -> None:
        self.frontends = frontends  # pod name -> OIP HTTP host:port
        self.state = state
        self.ready: set[str] = set()
        self.turn = itertools.count()
        self.lock = threading.Lock()

    def poll(self, stop: threading.Event) -> None:
        while not stop.is_set():
            ready = {name for name, endpoint in self.frontends.items() if _ready(endpoint)}
            with self.lock:
                self.ready = ready
            stop.wait(READY_POLL_S)

    def pick(self) -> tuple[str, str] | None:
        with self.lock:
            names = sorted(n for n in self.ready
                           if not (self.state / "terminating" / n).exists())
        if not names:
            return None
        name = names[next(self.turn) % len(names)]
        return name, self.frontends[name]


def _ready(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/v2/health/ready", timeout=1.0) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def one_request(service: Service, model: Model, index: int) -> tuple[str, float]:
    """One request through the Service: its outcome (a failure names its time and frontend)
    and latency."""
    started = time.monotonic()
    wall = time.strftime("%H:%M:%S")
    picked = service.pick()
    while picked is None and time.monotonic() - started < 10.0:  # no endpoint: wait for one
        if (service.state / "stop").exists():  # the cluster is going away: never sent
            return NOT_SENT, 0.0
        time.sleep(0.05)
        picked = service.pick()
    if picked is None:
        return "NO_ENDPOINT", 0.0
    image = image_of(index)
    sent = time.monotonic()
    try:
        answer = infer_http(picked[1], image)
    except Exception as exc:
        return (f"ERROR {type(exc).__name__}: sent {wall} to {picked[0]}: {str(exc)[:100]}",
                time.monotonic() - sent)
    if correct(answer, model.expected(image)):
        return "OK", time.monotonic() - sent
    return f"WRONG: sent {wall} to {picked[0]}", time.monotonic() - sent


def load(args: argparse.Namespace) -> int:
    frontends = dict(spec.split("=", 1) for spec in args.frontend)
    state = Path(args.state)
    service, model, stop = Service(frontends, state), Model(args.model_file), threading.Event()
    threading.Thread(target=service.poll, args=(stop,), daemon=True).start()
    outcomes: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    rng = np.random.default_rng(7)
    futures = []
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        next_at, index = time.monotonic(), 0
        while not (state / "stop").exists():
            next_at += rng.exponential(1.0 / args.rate)
            time.sleep(max(0.0, next_at - time.monotonic()))
            futures.append(pool.submit(one_request, service, model, index))
            index += 1
        for future in futures:
            outcome, latency = future.result()
            outcomes[outcome.split(":")[0]] += 1
            if outcome == NOT_SENT:
                continue
            latencies.append(latency)
            if outcome != "OK":
                print(f"request failed: {outcome}", file=sys.stderr)
    stop.set()
    lost = sum(n for kind, n in outcomes.items() if kind not in {"OK", NOT_SENT})
    print(f"load: {index} requests at {args.rate:g}/s, {outcomes['OK']} answered "
          f"correctly, {lost} lost {dict(outcomes)}; latency p50 "
          f"{np.percentile(latencies, 50) * 1e3:.0f} ms, p99 "
          f"{np.percentile(latencies, 99) * 1e3:.0f} ms, max {max(latencies) * 1e3:.0f} ms")
    return 0 if lost == 0 else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    checker = sub.add_parser("check", help="answers of every frontend over HTTP and gRPC")
    checker.add_argument("--frontend", action="append", required=True,
                         metavar="NAME=HTTP,GRPC")
    checker.add_argument("--requests", type=int, default=20)
    loader = sub.add_parser("load", help="requests through the Service until STATE/stop")
    loader.add_argument("--frontend", action="append", required=True, metavar="NAME=HTTP")
    loader.add_argument("--state", required=True)
    loader.add_argument("--rate", type=float, default=20.0)
    for command in (checker, loader):
        command.add_argument("--model-file", required=True, help="the ONNX model served")
    args = parser.parse_args(argv)
    return check(args) if args.command == "check" else load(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
