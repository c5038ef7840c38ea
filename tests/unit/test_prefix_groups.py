"""``[[prefix_groups]]`` (``zserve.config.prefix_groups``): validation with one-line key-path
errors; the scheduler sees each group as one model; the frontend admits and counts each model
by its own name, queues it under its group at the group's shard, and hands a backend each
request's inputs with its head (``HEAD_INPUT``, one per row)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zserve.config.cluster import ConfigError, parse_config, role_config, shard_for_model
from zserve.config.prefix_groups import HEAD_INPUT
from zserve.core.hosting import Outbox
from zserve.frontend.core import OUTCOME_OF_MODEL, TO_SHARD, FrontendCore
from zserve.transport.messages import (
    BatchOutputs,
    CancelQueued,
    CancelRequest,
    InferReply,
    InferRequest,
    InputFetch,
    InputReply,
    RequestMetaBatch,
)

CLIENT = b"client-1"
SHARDS = 4
VARIANTS = ("cnn-a", "cnn-b", "cnn-c")


def _document(groups: list[dict[str, Any]], **variant: Any) -> dict[str, Any]:
    models = [{"name": name, "builtin": "cnn", "slo_ms": 200.0, "max_batch": 8}
              for name in VARIANTS]
    models[1].update(variant)
    models.append({"name": "alone", "builtin": "mlp", "slo_ms": 50.0})
    models.append({"name": "emu", "emulated": {"alpha_ms": 1.0, "beta_ms": 1.0}})
    return {"scheduler": {"shards": SHARDS}, "backends": {"count": 2, "device": "cpu"},
            "models": models, "prefix_groups": groups}


GROUP = {"name": "heads", "models": list(VARIANTS)}


@pytest.mark.parametrize(("groups", "variant", "message"), [
    ([{"name": "heads", "models": ["cnn-a"]}], {},
     r"^prefix_groups\[0\]\.models: a prefix group needs at least two models, got 1$"),
    ([{"name": "heads", "models": ["cnn-a", "nope"]}], {},
     r"^prefix_groups\[0\]\.models\[1\]: no model named 'nope'$"),
    ([{"name": "alone", "models": ["cnn-a", "cnn-b"]}], {},
     r"^prefix_groups\[0\]\.name: 'alone' is taken"),
    ([GROUP, {"name": "again", "models": ["alone", "cnn-c"]}], {},
     r"^prefix_groups\[1\]\.models\[1\]: model 'cnn-c' is in group 'heads' already$"),
    ([{"name": "heads", "models": ["cnn-a", "emu"]}], {},
     r"^prefix_groups\[0\]\.models\[1\]: model 'emu' is emulated"),
    ([GROUP], {"slo_ms": 100.0},
     r"^prefix_groups\[0\]\.models\[1\]: model 'cnn-b' has slo_ms 100\.0, 'cnn-a' has 200\.0"),
    ([GROUP], {"max_batch": 4},
     r"^prefix_groups\[0\]\.models\[1\]: model 'cnn-b' has max_batch"),
    ([{"name": "heads", "models": ["cnn-a"], "extra": 1}], {},
     r"^prefix_groups\[0\]\.extra: unknown key; allowed: models, name$"),
])
def test_a_bad_group_is_one_line_naming_its_key(groups: list[dict[str, Any]],
                                                 variant: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        parse_config(_document(groups, **variant))
    assert "\n" not in str(caught.value)


def test_the_scheduler_plans_the_group_as_one_model() -> None:
    config = parse_config(_document([GROUP]))
    scheduled = {m.name: m for m in config.scheduled_models}
    assert set(scheduled) == {"heads", "alone", "emu"}
    assert scheduled["heads"].slo_ms == 200.0 and scheduled["heads"].max_batch == 8
    assert scheduled["heads"].max_queue == 3 * config.model("cnn-a").max_queue
    owner = shard_for_model("heads", SHARDS)
    shard = role_config(config, "shard", owner, ipc_dir="/tmp")
    assert "heads" in {m.name for m in shard.models}
    assert not {m.name for m in shard.models} & set(VARIANTS)
    assert config.group_heads == {name: ("heads", i) for i, name in enumerate(VARIANTS)}
    backend = role_config(config, "backend", 0, ipc_dir="/tmp")
    assert set(VARIANTS) <= {m.name for m in backend.models}  # it merges them at load


def _request(core: FrontendCore, now: float, request_id: int, model: str, rows: int) -> Outbox:
    outbox: Outbox = []
    image = np.full((rows, 3, 64, 64), float(request_id), np.float32)
    core.on_client_message(now, CLIENT, InferRequest(request_id, model, {"image": image}),
                           outbox)
    return outbox


def test_the_frontend_queues_a_groups_models_as_the_group_and_fetches_their_heads() -> None:
    config = parse_config(_document([GROUP]))
    core = FrontendCore(name="frontend-0", cluster=config, index=0, data_address="ipc://data",
                        profiles={})
    assert "heads" not in core.models  # clients call the models, never the group
    for i, (model, rows) in enumerate((("cnn-c", 2), ("cnn-a", 1), ("alone", 1), ("cnn-b", 3))):
        assert _request(core, 0.0, i, model, rows) == []
    outbox: Outbox = []
    core.end_tick(outbox)
    metas = {dest[1]: msg for dest, msg in outbox if dest[0] == TO_SHARD}
    grouped = metas[shard_for_model("heads", SHARDS)]
    assert isinstance(grouped, RequestMetaBatch)
    assert [m for m in grouped.models if m != "alone"] == ["heads"] * 3
    ids = [rid for rid, m in zip(grouped.request_ids, grouped.models, strict=True)
           if m == "heads"]
    outbox.clear()
    core.on_fetch(0.01, "backend-0", InputFetch(7, ids[:2]), outbox)
    (reply,) = [msg for _, msg in outbox if isinstance(msg, InputReply)]
    assert [r[HEAD_INPUT].tolist() for r in reply.inputs] == [[2, 2], [0]]  # per row, its head
    assert all(r["image"].shape[0] == len(r[HEAD_INPUT]) for r in reply.inputs)
    outbox.clear()
    core.on_client_message(0.02, CLIENT, CancelRequest(3), outbox)  # cnn-b, still queued
    outbox.clear()
    core.end_tick(outbox)
    (cancel,) = [msg for _, msg in outbox if isinstance(msg, CancelQueued)]
    assert cancel.models == ["heads"]  # its shard queues it under the group
    outbox.clear()
    logits = [np.zeros((2, 10), np.float32), np.ones((1, 10), np.float32)]
    core.on_outputs(0.03, BatchOutputs(7, ids[:2], [{"logits": v} for v in logits]), outbox)
    answers = {msg.request_id: msg for _, msg in outbox if isinstance(msg, InferReply)}
    assert answers[0].outputs["logits"].shape == (2, 10)
    assert answers[1].outputs["logits"].shape == (1, 10)
    assert core.counters[OUTCOME_OF_MODEL.format("cnn-c", "ok")] == 1  # its own stats
    assert core.counters[OUTCOME_OF_MODEL.format("cnn-a", "ok")] == 1
