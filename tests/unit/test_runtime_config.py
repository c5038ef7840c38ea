"""cluster.toml: strict validation with key paths, defaults, addresses, role configs, shards."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from zserve.config.cluster import (
    DEFAULT_JITTER_MS,
    ClusterConfig,
    ConfigError,
    RoleConfig,
    load_config,
    parse_config,
    role_config,
    shard_for_model,
)
from zserve.runtime.peer_map import endpoints_of
from zserve.scheduler.shard_host import ShardHost
from zserve.transport.reactor import SocketReactor
from zserve.transport.sockets import make_router

MODEL: dict[str, Any] = {"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0}}


def config(**tables: Any) -> ClusterConfig:
    return parse_config({"models": [MODEL], **tables})


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"models": [MODEL], "backends": {"gpus": 2}}, r"^backends\.gpus: unknown key"),
        ({"models": [MODEL], "nonsense": {}}, r"^nonsense: unknown key"),
        ({"models": [{**MODEL, "slo_ms": 0}]}, r"^models\[0\]\.slo_ms: must be a finite num"),
        ({"models": [{**MODEL, "max_batch": "8"}]}, r"^models\[0\]\.max_batch: must be an integer"),
        ({"models": [{**MODEL, "max_batch": 8, "session_batch_sizes": [1, 16]}]},
         r"^models\[0\]\.session_batch_sizes\[1\]: 16 is above max_batch \(8\)"),
        ({"models": [{**MODEL, "session_batch_sizes": [0]}]},
         r"^models\[0\]\.session_batch_sizes\[0\]: must be >= 1"),
        ({"models": [MODEL, {**MODEL, "colour": 1}]}, r"^models\[1\]\.colour: unknown key"),
        ({"models": [{**MODEL, "emulated": {"alpha_ms": 1.0}}]},
         r"^models\[0\]\.emulated\.beta_ms: required"),
        ({"models": [{"name": "m"}]}, r"^models\[0\]: exactly one of onnx, builtin, emulated"),
        ({"models": [{**MODEL, "builtin": "cnn"}]}, r"exactly one of"),
        ({"models": [MODEL, MODEL]}, r"^models\[1\]\.name: duplicate model"),
        ({"models": []}, r"^models: at least one"),
        ({"models": [MODEL], "scheduler": {"shards": -1}}, r"^scheduler\.shards: must be >= 0"),
        ({"models": [MODEL], "scheduler": {"policy": "fastest"}}, r"^scheduler\.policy: "),
        ({"models": [MODEL], "scheduler": {"drop": "random"}}, r"^scheduler\.drop: "),
        ({"models": [MODEL], "scheduler": {"jitter_ms": -0.5}},
         r"^scheduler\.jitter_ms: must be a finite number >= 0"),
        ({"models": [MODEL], "scheduler": {"jitter_ms": "1"}},
         r"^scheduler\.jitter_ms: must be a number"),
        ({"models": [MODEL], "scheduler": {"jitter_ms": float("inf")}},
         r"^scheduler\.jitter_ms: must be a finite number"),
        ({"models": [MODEL], "backends": {"device": "tpu"}}, r"^backends\.device: must be"),
        ({"models": [MODEL], "backends": {"devices": ["cuda:0", "gpu"]}},
         r"^backends\.devices\[1\]: "),
        ({"models": [MODEL], "frontends": {"addresses": ["http://x"]}},
         r"^frontends\.addresses\[0\]: not a ZeroMQ address"),
        ({"models": [MODEL], "frontends": {"count": 1, "addresses": ["tcp://a:1", "tcp://b:2"]}},
         r"^frontends\.addresses: more addresses than"),
        ({"models": [MODEL], "cluster": {"transport": "udp"}}, r"^cluster\.transport: must be one"),
        ({"models": [MODEL], "cluster": {"drain_s": float("nan")}}, r"^cluster\.drain_s: "),
        ({"models": [MODEL], "cluster": "x"}, r"^cluster: must be a table"),
        ({"models": [{**MODEL, "d_data_ms": -0.1}]},
         r"^models\[0\]\.d_data_ms: must be a finite number >= 0"),
        ({"models": [{**MODEL, "backends": ["backend-0", "backend-2"]}],
          "backends": {"count": 2}},
         r"^models\[0\]\.backends\[1\]: no backend named 'backend-2' \(the backends are "
         r"backend-0 \.\. backend-1\)$"),
        ({"models": [{**MODEL, "backends": ["backend-0", "backend-0"]}]},
         r"^models\[0\]\.backends\[1\]: backend 'backend-0' named twice$"),
        ({"models": [{**MODEL, "backends": []}]},
         r"^models\[0\]\.backends: name at least one backend \(leave the key out: every "
         r"backend\)$"),
        ({"models": [MODEL], "backends": {"count": 2, "kinds": ["a100"]}},
         r"^backends\.kinds: names one kind per backend: 1 kinds for 2 backends$"),
        ({"models": [MODEL], "backends": {"kind": "a 100"}}, r"^backends\.kind: must match "),
        ({"models": [MODEL], "backends": {"count": 2, "kinds": ["a100", ""]}},
         r"^backends\.kinds\[1\]: must match "),
        ({"models": [{**MODEL, "backends": "backend-0"}]},
         r"^models\[0\]\.backends: must be a list, got 'backend-0'$"),
        # a profile file per device kind: kinds the backends announce, one path each
        ({"models": [{**MODEL, "profiles": {}}], "backends": {"kind": "a100"}},
         r"^models\[0\]\.profiles: name at least one device kind \(leave the key out: one "
         r"profile for every kind\)$"),
        ({"models": [{**MODEL, "profiles": {"a 100": "a.json"}}], "backends": {"kind": "a100"}},
         r"^models\[0\]\.profiles\.a 100: must match "),
        ({"models": [{**MODEL, "profiles": {"a100": ""}}], "backends": {"kind": "a100"}},
         r"^models\[0\]\.profiles\.a100: must be a profile file's path, got ''$"),
        ({"models": [{**MODEL, "profiles": {"a100": 3}}], "backends": {"kind": "a100"}},
         r"^models\[0\]\.profiles\.a100: must be a profile file's path, got 3$"),
        ({"models": [MODEL, {**MODEL, "name": "n", "profiles": {"h100": "h.json"}}],
          "backends": {"count": 2, "kinds": ["a100", "gtx1080ti"]}},
         r"^models\[1\]\.profiles\.h100: no backend announces kind 'h100' \(the backends "
         r"announce a100, gtx1080ti\)$"),
        ({"models": [{**MODEL, "profiles": {"a100": "a.json"}}]},
         r"^models\[0\]\.profiles: per-kind profiles need backends that announce a kind "
         r"\(backends\.kind or backends\.kinds\)$"),
    ],
)
def test_errors_name_the_key(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(document)


def test_defaults_and_round_trip() -> None:
    cluster = config()
    assert cluster.scheduler.shards == 0 and cluster.scheduler.policy == "deferred"
    assert cluster.scheduler.jitter_ms == DEFAULT_JITTER_MS
    assert config(scheduler={"jitter_ms": 0}).scheduler.jitter_ms == 0.0
    assert cluster.frontends.count == 1 and cluster.backends.total == 1
    (model,) = cluster.models
    assert model.kind == "emulated" and model.wait_bound_ms == model.slo_ms
    assert ClusterConfig.from_dict(cluster.to_dict()) == cluster


def test_shard_rule_is_stable_and_spreads() -> None:
    names = [f"model-{i}" for i in range(64)]
    assert all(shard_for_model(n, 0) == 0 and shard_for_model(n, 1) == 0 for n in names)
    spread = {shard_for_model(n, 4) for n in names}
    assert spread == {0, 1, 2, 3}
    # crc32 is fixed forever: these values must never change (frontends and shards must agree).
    assert [shard_for_model(n, 3) for n in ("alpha", "beta", "resnet50")] == [1, 1, 1]
    assert [shard_for_model(n, 2) for n in ("alpha", "beta", "resnet50", "vgg")] == [0, 1, 0, 1]


def test_layout_addresses_and_role_configs(tmp_path: Path) -> None:
    # Explicit addresses are only parsed and passed through here, never bound or connected: a
    # non-zero port is what makes an address known before its process starts.
    cluster = config(
        scheduler={"shards": 2, "rank_address": "tcp://rank.example:5000"},
        frontends={"count": 2, "addresses": ["tcp://0.0.0.0:7000"]},
        backends={"devices": ["cuda:0", "cuda:1", "cpu"]},
    )
    names = [name for _, name, _ in cluster.process_names()]
    assert names == ["rank", "shard-0", "shard-1", "backend-0", "backend-1", "backend-2",
                     "frontend-0", "frontend-1"]
    ipc = str(tmp_path)
    assert cluster.bind_addresses("rank", 0, ipc) == {"rank": "tcp://rank.example:5000"}
    assert cluster.bind_addresses("frontend", 0, ipc) == {
        "client": "tcp://0.0.0.0:7000", "data": f"ipc://{ipc}/frontend-0.data"}
    assert cluster.bind_addresses("frontend", 1, None)["client"] == "tcp://127.0.0.1:0"
    backend = role_config(cluster, "backend", 1, ipc_dir=ipc)
    assert backend.name == "backend-1" and backend.device == "cuda:1"
    shard = role_config(cluster, "shard", shard_for_model("m", 2), ipc_dir=ipc)
    assert [m.name for m in shard.models] == ["m"] and not shard.embedded_rank
    peers = cluster.static_peers(ipc)
    assert endpoints_of(peers, "shard") == {
        "shard-0": f"ipc://{ipc}/shard-0.shard", "shard-1": f"ipc://{ipc}/shard-1.shard"}
    without_ipc = cluster.static_peers(None)
    assert "frontend-1/client" not in without_ipc  # tcp port 0: only known once bound
    assert without_ipc["frontend-0/client"] == "tcp://0.0.0.0:7000"


def test_embedded_rank_layout() -> None:
    cluster = config(backends={"count": 2, "device": "cuda"})
    assert [n for _, n, _ in cluster.process_names()] == [
        "shard-0", "backend-0", "backend-1", "frontend-0"]
    assert set(cluster.bind_addresses("shard", 0, "/r")) == {"shard", "rank"}
    assert role_config(cluster, "shard", 0, ipc_dir="/r").embedded_rank
    assert cluster.backends.device_of(1) == "cuda:1"


def test_a_named_standby_is_in_the_static_peers_of_roles_started_alone() -> None:
    cluster = config(scheduler={
        "standby": True, "rank_address": "tcp://zserve-scheduler-a:7100",
        "shard_addresses": ["tcp://zserve-scheduler-a:7200"],
        "standby_rank_address": "tcp://zserve-scheduler-b:7100",
        "standby_shard_address": "tcp://zserve-scheduler-b:7200"})
    peers = cluster.static_peers(None)
    assert endpoints_of(peers, "rank") == {"shard-0": "tcp://zserve-scheduler-a:7100",
                                           "shard-0b": "tcp://zserve-scheduler-b:7100"}
    assert endpoints_of(peers, "shard")["shard-0b"] == "tcp://zserve-scheduler-b:7200"
    standby = role_config(cluster, "shard", 0, ipc_dir=None, name="shard-0b")
    assert standby.standby and standby.bind == {"shard": "tcp://zserve-scheduler-b:7200",
                                                "rank": "tcp://zserve-scheduler-b:7100"}
    assert ("scheduler.standby_rank_address", "tcp://zserve-scheduler-b:7100") in (
        cluster.explicit_bind_keys())
    with pytest.raises(ConfigError,
                       match=r"^scheduler\.standby_rank_address: needs standby = true"):
        config(scheduler={"standby_rank_address": "tcp://b:7100"})
    with pytest.raises(ConfigError, match=r"^scheduler\.standby_shard_address: "):
        config(scheduler={"standby": True, "standby_shard_address": "b:7200"})


def test_a_model_on_named_backends_is_loaded_there_at_start() -> None:
    """``[[models]] backends``: each backend's start-up list (``RoleConfig.serve``, what it
    loads and registers with the rank) has the models that name it and those that name none."""
    other = {**MODEL, "name": "n", "backends": ["backend-0", "backend-2"]}
    cluster = config(models=[MODEL, other], backends={"count": 3})
    serve = [role_config(cluster, "backend", i, ipc_dir=None).serve for i in range(3)]
    assert serve == [("m", "n"), ("m",), ("m", "n")]
    assert [m.name for m in cluster.startup_models_of("backend-1")] == ["m"]
    assert cluster.model("n").backends == ("backend-0", "backend-2")


def test_each_backend_announces_its_kind() -> None:
    """``[backends] kinds`` per backend, else ``kind`` for all (one the autoscaler adds past
    ``kinds`` too), else none ("")."""
    per_backend = config(backends={"count": 2, "kinds": ["a100", "gtx1080ti"], "kind": "a100"})
    assert [per_backend.backends.kind_of(i) for i in range(3)] == ["a100", "gtx1080ti", "a100"]
    assert config(backends={"kind": "h200"}).backends.kind_of(0) == "h200"
    assert config().backends.kind_of(0) == ""


def test_load_config_resolves_paths_and_reports_syntax(tmp_path: Path) -> None:
    good = tmp_path / "c.toml"
    good.write_text('[[models]]\nname = "r"\nonnx = "models/r.onnx"\nprofile = "p.json"\n')
    (model,) = load_config(good).models
    assert model.onnx == str(tmp_path / "models" / "r.onnx")
    assert model.profile == str(tmp_path / "p.json")
    per_kind = tmp_path / "k.toml"
    per_kind.write_text('[backends]\ncount = 2\nkinds = ["a100", "gtx1080ti"]\n'
                        '[[models]]\nname = "r"\nonnx = "r.onnx"\n'
                        'profiles = { a100 = "a100.json", gtx1080ti = "/abs/g.json" }\n')
    assert load_config(per_kind).model("r").profiles == {
        "a100": str(tmp_path / "a100.json"), "gtx1080ti": "/abs/g.json"}
    bad = tmp_path / "bad.toml"
    bad.write_text("[[models]\n")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_config(bad)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"models": [MODEL], "schedulr": {}}, r"^schedulr: unknown key \(did you mean 'scheduler'"),
        ({"models": [{**MODEL, "slo": 5}]},
         r"^models\[0\]\.slo: unknown key \(did you mean 'slo_ms'"),
        ({"models": [MODEL], "backends": {"xyz": 1}},
         r"^backends\.xyz: unknown key; allowed: count, device, devices, host, kind, kinds, "
         r"memory, onnx_io, plan_addresses$"),
        ({"models": [{**MODEL, "emulated": {**MODEL["emulated"], "input_dtype": "f32"}}]},
         r"^models\[0\]\.emulated\.input_dtype: must be one of .*float32.*, got 'f32'$"),
        ({"models": [MODEL], "cluster": {"transport": "udp"}},
         r"^cluster\.transport: must be one of ipc, tcp, got 'udp'$"),
        ({"models": [MODEL], "frontends": {"count": 0}},
         r"^frontends\.count: must be >= 1, got 0$"),
        ({"models": [MODEL], "cluster": {"idle_poll": 1}},
         r"^cluster\.idle_poll: must be true or false, got 1$"),
    ],
)
def test_errors_suggest_keys_and_list_choices(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(document)


def test_role_config_is_typed_and_survives_spawn_and_json(tmp_path: Path) -> None:
    cluster = config(scheduler={"shards": 2}, backends={"devices": ["emulated", "cpu"]})
    shard = role_config(cluster, "shard", shard_for_model("m", 2), ipc_dir=str(tmp_path),
                        peers={"rank/rank": "ipc:///r"})
    assert isinstance(shard, RoleConfig) and shard.cluster == cluster
    assert shard.models == (cluster.model("m"),) and shard.peers == {"rank/rank": "ipc:///r"}
    # The supervisor's children are spawned: the config crosses a pickle; a test harness's
    # children get it as JSON on their command line.
    assert pickle.loads(pickle.dumps(shard)) == shard
    assert msgspec.json.decode(msgspec.json.encode(shard), type=RoleConfig) == shard
    backend = role_config(cluster, "backend", 0, ipc_dir=None)
    assert backend.device == "emulated" and backend.bind == {"plan": "tcp://127.0.0.1:0"}
    with pytest.raises(ValueError, match="unknown role"):
        role_config(cluster, "router", 0, ipc_dir=None)


async def test_a_models_own_data_allowance_reaches_its_model_thread() -> None:
    # One cluster, 600 KB images and small vectors: the images' allowance is their own, the
    # other model keeps the scheduler's. The shard's ModelThreads plan with them.
    cluster = parse_config({
        "scheduler": {"d_data_ms": 0.05},
        "models": [{**MODEL, "name": "images", "d_data_ms": 0.5}, {**MODEL, "name": "vectors"}],
    })
    images, vectors = cluster.models
    assert (cluster.d_data_ms_of(images), cluster.d_data_ms_of(vectors)) == (0.5, 0.05)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock, _ = make_router(ctx, name="shard")
    reactor = SocketReactor(asyncio.get_running_loop())
    host = ShardHost(name="shard-0", ctx=ctx, sock=sock, reactor=reactor, cluster=cluster,
                     models=list(cluster.models), peers={})
    try:
        assert host.threads["images"].d_data_s == pytest.approx(0.5e-3)
        assert host.threads["vectors"].d_data_s == pytest.approx(0.05e-3)
    finally:
        await host.close()
        reactor.close()
        sock.close(0)
        ctx.term()
