"""FrontendCore and requests that carry a batch: a request of n rows (its inputs' leading
dimension) is validated, counted as n rows by admission, and its n travels to the shard in
``RequestMetaBatch.rows`` (empty while every request of the tick holds one row)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zserve.config.cluster import ClusterConfig, parse_config
from zserve.config.signature import ModelSignature, TensorSpec
from zserve.core.hosting import Outbox
from zserve.frontend.core import TO_SHARD, FrontendCore
from zserve.transport.messages import (
    BackendTable,
    BatchOutputs,
    InferError,
    InferReply,
    InferRequest,
    InputFetch,
    InputReply,
    RequestMetaBatch,
)

CLIENT = b"client-1"
MAX_BATCH = 8


def _core(max_queue: int = 64) -> FrontendCore:
    cluster: ClusterConfig = parse_config({
        "backends": {"count": 1, "device": "emulated"},
        "models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0,
                                              "input_shape": [4]},
                    "slo_ms": 100.0, "max_batch": MAX_BATCH, "max_queue": max_queue}]})
    return FrontendCore(name="frontend-0", cluster=cluster, index=0, data_address="ipc://data",
                        profiles={})


def _register(core: FrontendCore, *, signed: bool = True) -> None:
    signature = ModelSignature("m", (TensorSpec("x", "float32", (4,)),
                                     TensorSpec("k", "int64", (2,))),
                               (TensorSpec("y", "float32", (1,)),)).to_dict()
    outbox: Outbox = []
    core.on_backend_table(0.0, BackendTable([0], ["backend-0"], ["ipc://plan"], [["m"]],
                                            signatures=[{"m": signature}] if signed else []),
                          outbox)
    assert outbox == []


def _inputs(rows: int, key_rows: int | None = None) -> dict[str, Any]:
    return {"x": np.full((rows, 4), float(rows), np.float32),
            "k": np.zeros((rows if key_rows is None else key_rows, 2), np.int64)}


def _submit(core: FrontendCore, request_id: int, inputs: dict[str, Any]) -> Outbox:
    outbox: Outbox = []
    core.on_infer(0.0, CLIENT, InferRequest(request_id, "m", inputs), outbox)
    return outbox


def _metas(core: FrontendCore) -> list[RequestMetaBatch]:
    outbox: Outbox = []
    core.end_tick(outbox)
    metas = [m for d, m in outbox if d[0] == TO_SHARD and isinstance(m, RequestMetaBatch)]
    assert len(metas) == len(outbox)
    return metas


@pytest.mark.parametrize("signed", [True, False], ids=["signature", "no-signature"])
def test_requests_of_n_rows_are_admitted_and_their_rows_reach_the_shard(signed: bool) -> None:
    core = _core()
    _register(core, signed=signed)
    assert _submit(core, 1, _inputs(1)) == []
    assert _metas(core)[0].rows == []  # every request of the tick holds one row: no list
    for request_id, rows in ((2, 1), (3, 3), (4, MAX_BATCH)):
        assert _submit(core, request_id, _inputs(rows)) == []
    (meta,) = _metas(core)
    assert meta.rows == [1, 3, MAX_BATCH]
    assert core.stats()["models"] == {"m": 1 + 1 + 3 + MAX_BATCH}  # rows pending


@pytest.mark.parametrize(("inputs", "kind", "fragment"), [
    (_inputs(3, key_rows=2), "BAD_REQUEST", "inputs disagree on the number of rows: 'x' has 3, "
                                            "'k' has 2"),
    (_inputs(0), "BAD_REQUEST", "has 0 rows"),
    (_inputs(MAX_BATCH + 1), "TOO_LARGE",
     f"a request of {MAX_BATCH + 1} rows exceeds the model's max batch of {MAX_BATCH} rows"),
], ids=["rows-disagree", "zero-rows", "above-max-batch"])
def test_bad_row_counts_get_one_clear_line(inputs: dict[str, Any], kind: str,
                                           fragment: str) -> None:
    core = _core()
    _register(core)
    (answer,) = _submit(core, 1, inputs)
    msg = answer[1]
    assert isinstance(msg, InferError) and msg.error == kind
    assert fragment in msg.message and "\n" not in msg.message
    assert _metas(core) == [] and core.stats()["models"] == {"m": 0}


def test_without_a_signature_rows_must_still_agree_and_fit() -> None:
    core = _core()
    _register(core, signed=False)
    for request_id, inputs in enumerate((_inputs(3, key_rows=2), _inputs(MAX_BATCH + 1))):
        (answer,) = _submit(core, request_id, inputs)
        assert isinstance(answer[1], InferError) and answer[1].error == "BAD_REQUEST"
        assert f"one leading dimension of 1..{MAX_BATCH} rows" in answer[1].message


def test_admission_bounds_count_rows_and_an_answer_gives_them_back() -> None:
    core = _core(max_queue=10)
    _register(core)
    assert _submit(core, 1, _inputs(MAX_BATCH)) == []
    assert _submit(core, 2, _inputs(2)) == []
    (answer,) = _submit(core, 3, _inputs(1))  # 10 rows queued: an eleventh does not fit
    assert isinstance(answer[1], InferError) and answer[1].error == "OVERLOADED"
    assert "10 rows queued (limit 10)" in answer[1].message
    (meta,) = _metas(core)
    outbox: Outbox = []
    core.on_fetch(0.01, "backend-0", InputFetch(7, meta.request_ids[:1]), outbox)
    (reply,) = [m for _, m in outbox if isinstance(m, InputReply)]
    assert reply.inputs[0]["x"].shape == (MAX_BATCH, 4)
    outputs = {"y": np.arange(MAX_BATCH, dtype=np.float32).reshape(MAX_BATCH, 1)}
    outbox = []
    core.on_outputs(0.02, BatchOutputs(7, meta.request_ids[:1], [outputs]), outbox)
    (answered,) = [m for _, m in outbox if isinstance(m, InferReply)]
    assert answered.request_id == 1 and answered.outputs["y"].shape == (MAX_BATCH, 1)
    assert core.stats()["models"] == {"m": 2}
    assert _submit(core, 4, _inputs(MAX_BATCH)) == []  # its rows are free again
