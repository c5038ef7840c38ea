"""FrontendBackends alone: the backends as a frontend knows them (table, hellos, deaths), which of
them lost the requests they fetched and why, and what their table teaches the models' admission
(GPUs per model, signatures, measured profiles)."""

from __future__ import annotations

from typing import Any

import pytest

from zserve.config.cluster import parse_config
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.frontend.admission import ModelAdmission
from zserve.frontend.backend_view import FrontendBackends
from zserve.transport.messages import WIRE_PROTOCOL_VERSION, BackendGone, BackendTable, Hello

OTHER_PROTOCOL = WIRE_PROTOCOL_VERSION + 1


def _models() -> dict[str, ModelAdmission]:
    models = [{"name": name, "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0, "input_shape": [4]},
               "slo_ms": 100.0, "max_batch": 8} for name in ("m", "a")]
    cluster = parse_config({"backends": {"count": 2, "device": "emulated"}, "models": models})
    return {m.name: ModelAdmission(m, 0, None) for m in cluster.models}


def _view() -> tuple[FrontendBackends, dict[str, ModelAdmission]]:
    models = _models()
    return FrontendBackends(name="frontend-0", models=models, max_request_bytes=4096), models


def _table(backends: dict[str, list[str]], **extra: Any) -> BackendTable:
    names = list(backends)
    return BackendTable(list(range(len(names))), names, ["ipc://plan"] * len(names),
                        [backends[n] for n in names], **extra)


def test_a_new_pid_is_a_restarted_backend_and_loses_its_requests() -> None:
    backends, _ = _view()
    assert backends.on_hello(Hello("backend", "backend-0", 100)) == []
    assert backends.on_hello(Hello("backend", "backend-0", 100)) == []  # the same process
    assert backends.on_hello(Hello("backend", "backend-0", 101)) == [
        ("backend-0", "backend restarted")]
    assert backends.pids == {"backend-0": 101}


def test_a_hello_of_another_wire_protocol_is_ignored() -> None:
    backends, _ = _view()
    hello = Hello("backend", "backend-0", 100, protocol=OTHER_PROTOCOL)
    assert backends.on_hello(hello) == []
    assert backends.pids == {} and backends.names() == set()


def test_a_backend_that_died_loses_its_requests_once() -> None:
    backends, _ = _view()
    backends.on_hello(Hello("backend", "backend-0", 100))
    assert backends.on_gone(BackendGone("backend-0")) == [("backend-0", "backend process died")]
    assert backends.on_gone(BackendGone("backend-0")) == []  # told twice: lost once
    assert backends.on_gone(BackendGone("backend-9")) == []  # never said hello
    assert backends.pids == {}


def test_the_table_counts_gpus_per_model_and_names_the_backends_that_left() -> None:
    backends, _ = _view()
    assert backends.table is None
    assert backends.on_table(_table({"backend-0": ["m"], "backend-1": ["m", "a"]})) == []
    assert backends.gpus_for_model == {"m": 2, "a": 1}
    assert backends.on_table(_table({"backend-1": ["m", "zzz"]})) == [
        ("backend-0", "backend left the cluster")]
    assert backends.gpus_for_model == {"m": 1, "a": 0}  # a model no one serves: 0, not absent
    assert backends.table == {"backend-1": ["m", "zzz"]}
    backends.on_hello(Hello("backend", "backend-2", 7))  # said hello, not yet in the table
    assert backends.names() == {"backend-1", "backend-2"}


def test_the_table_teaches_signatures_and_measured_profiles() -> None:
    backends, models = _view()
    signature = ModelSignature("m", (TensorSpec("x", "float32", (4,)),),
                               (TensorSpec("y", "float32", (1,)),))
    backends.on_table(_table({"backend-0": ["m"]}, signatures=[{"m": signature.to_dict()}],
                             profiles_ms=[{"m": [1.0, 1.5, 2.0], "a": [], "zzz": [1.0]}]))
    assert models["m"].signature == signature
    profile = models["m"].profile
    assert profile is not None
    assert profile.latency(2) == pytest.approx(0.0015)
    assert models["a"].signature is None and models["a"].profile is None  # nothing measured
