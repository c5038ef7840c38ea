"""The supervisor's model repository (pure): the index, loads and unloads sent to every backend
and answered once each reported, failures and dead backends, commands of one model that cross;
and the repository folder read into the cluster's models, with one-line errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from zserve.cluster.repository import Call, Effects, ModelRepository
from zserve.config.cluster import ConfigError, parse_config
from zserve.core.errors import ErrorKind
from zserve.transport.messages import LoadModel, RepositoryReply, UnloadModel

CALL = Call("frontend-0", 7)
MODELS = {"a": {"name": "a", "onnx": "/r/a/1/model.onnx"},
          "b": {"name": "b", "onnx": "/r/b/1/model.onnx"}}


def _repository() -> ModelRepository:
    return ModelRepository(MODELS, {"backend-0": ["a"], "backend-1": ["a"]})


def _answers(effects: Effects) -> list[tuple[str, str]]:
    return [(reply.error, reply.message) for _, reply in effects.answers]


def test_the_index_says_where_each_model_stands() -> None:
    repo = _repository()
    (frontend, reply), = repo.call(CALL, "index", "").answers
    assert frontend == "frontend-0" and isinstance(reply, RepositoryReply)
    assert (reply.request_id, reply.models, reply.states, reply.reasons) == (
        7, ["a", "b"], ["READY", "UNAVAILABLE"], ["", "not loaded"])


def _warm(model: str) -> LoadModel:
    return LoadModel(model, MODELS[model], announce=False)


def test_a_load_warms_on_every_backend_then_announces_on_all_at_once() -> None:
    repo = _repository()
    effects = repo.call(CALL, "load", "b")
    assert effects.commands == [("backend-0", _warm("b")), ("backend-1", _warm("b"))]
    assert not effects.answers and repo.state("b") == ("LOADING", "")
    # a second call while it loads sends nothing more and waits too
    assert repo.call(Call("frontend-0", 8), "load", "b").commands == []
    assert repo.on_report("backend-0", "b", "WARM").commands == []  # backend-1 still loads
    announce = repo.on_report("backend-1", "b", "WARM")
    assert announce.commands == [("backend-0", LoadModel("b", MODELS["b"])),
                                 ("backend-1", LoadModel("b", MODELS["b"]))]
    assert not announce.answers and repo.state("b") == ("LOADING", "")
    assert not repo.on_report("backend-0", "b", "READY").answers
    done = repo.on_report("backend-1", "b", "READY")
    assert [reply.request_id for _, reply in done.answers] == [7, 8]
    assert _answers(done) == [("", ""), ("", "")]
    assert repo.state("b") == ("READY", "") and repo.served_by("backend-1") == ["a", "b"]
    # loaded everywhere already: answered at once
    again = repo.call(CALL, "load", "b")
    assert again.commands == [] and _answers(again) == [("", "")]


def test_a_failed_load_unloads_the_warm_ones_and_is_answered_with_its_reason() -> None:
    """No half-loaded model stays behind: a model listed on some backends only would cost the
    rank grants its thread declines."""
    repo = _repository()
    repo.call(CALL, "load", "b")
    repo.on_report("backend-0", "b", "WARM")
    rollback = repo.on_report("backend-1", "b", "FAILED", "bad file")
    assert rollback.commands == [("backend-0", UnloadModel("b"))] and not rollback.answers
    assert repo.state("b") == ("UNLOADING", "")
    done = repo.on_report("backend-0", "b", "UNAVAILABLE")
    assert _answers(done) == [(ErrorKind.BAD_REQUEST.value,
                               "failed to load 'b': backend-1: bad file")]
    assert repo.state("b") == ("UNAVAILABLE", "load failed on backend-1: bad file")


def test_an_unload_goes_to_the_backends_that_serve_it() -> None:
    repo = _repository()
    effects = repo.call(CALL, "unload", "a")
    assert effects.commands == [("backend-0", UnloadModel("a")), ("backend-1", UnloadModel("a"))]
    assert repo.state("a") == ("UNLOADING", "")
    assert not repo.on_report("backend-0", "a", "UNAVAILABLE").answers
    assert _answers(repo.on_report("backend-1", "a", "UNAVAILABLE")) == [("", "")]
    assert repo.state("a") == ("UNAVAILABLE", "unloaded")
    # nothing loaded: answered at once
    assert _answers(repo.call(CALL, "unload", "a")) == [("", "")]


def test_a_load_then_an_unload_of_one_model_settle_in_order() -> None:
    """Each backend runs one model's commands in order: the load's WARM does not end the
    unload that came after it, and the load's caller learns it was undone."""
    repo = _repository()
    repo.call(Call("f", 1), "load", "b")
    unload = repo.call(Call("f", 2), "unload", "b")
    assert [msg for _, msg in unload.commands] == [UnloadModel("b"), UnloadModel("b")]
    for backend in ("backend-0", "backend-1"):
        assert not repo.on_report(backend, "b", "WARM").commands
    repo.on_report("backend-0", "b", "UNAVAILABLE")
    done = repo.on_report("backend-1", "b", "UNAVAILABLE")
    assert _answers(done) == [(ErrorKind.UNAVAILABLE.value,
                               "'b' was unloaded before its load finished"), ("", "")]


def test_a_backend_that_dies_fails_its_load_and_a_restart_serves_what_it_started_with() -> None:
    repo = _repository()
    repo.call(CALL, "load", "b")
    repo.on_report("backend-0", "b", "WARM")
    rollback = repo.on_backend_gone("backend-1")
    assert rollback.commands == [("backend-0", UnloadModel("b"))]
    done = repo.on_report("backend-0", "b", "UNAVAILABLE")
    assert _answers(done) == [(ErrorKind.BAD_REQUEST.value,
                               "failed to load 'b': backend-1: its process died")]
    assert repo.states["a"] == {"backend-0": "READY"}
    repo.on_backend_started("backend-1", ["a", "b"])
    assert repo.states["b"] == {"backend-1": "READY"}


def test_a_restarted_backend_loads_what_was_loaded_elsewhere_since_it_was_spawned() -> None:
    repo = _repository()
    repo.call(CALL, "load", "b")
    for backend in ("backend-0", "backend-1"):
        repo.on_report(backend, "b", "WARM")
    for backend in ("backend-0", "backend-1"):
        repo.on_report(backend, "b", "READY")
    repo.on_backend_gone("backend-1")
    catch_up = repo.on_backend_started("backend-1", ["a"])  # spawned before b was loaded
    assert catch_up.commands == [("backend-1", _warm("b"))] and not catch_up.answers
    announce = repo.on_report("backend-1", "b", "WARM")
    assert announce.commands == [("backend-1", LoadModel("b", MODELS["b"]))]
    assert not repo.on_report("backend-1", "b", "READY").answers
    assert repo.states["b"] == {"backend-0": "READY", "backend-1": "READY"}


def test_unknown_models_and_actions_are_bad_requests() -> None:
    repo = _repository()
    assert _answers(repo.call(CALL, "load", "nope")) == [(
        ErrorKind.BAD_REQUEST.value, "no model 'nope' in the repository (it holds a, b)")]
    assert _answers(repo.call(CALL, "reload", "a"))[0][0] == ErrorKind.BAD_REQUEST.value
    lonely = ModelRepository(MODELS, {})
    assert _answers(lonely.call(CALL, "load", "b")) == [
        (ErrorKind.UNAVAILABLE.value, "no live backend to load it on")]


# --------------------------------------------------------------------------- the folder


def _folder(root: Path, name: str, settings: str | None = None, version: str = "1") -> None:
    (root / name / version).mkdir(parents=True)
    (root / name / version / "model.onnx").write_bytes(b"onnx")
    if settings is not None:
        (root / name / "config.toml").write_text(settings)


def test_the_repository_folder_becomes_the_clusters_models(tmp_path: Path) -> None:
    _folder(tmp_path, "a", "slo_ms = 250.0\nmax_batch = 4\n")
    _folder(tmp_path, "b", version="3")
    (tmp_path / "b" / "1").mkdir()  # an older, empty version folder
    config = parse_config({"repository": {"path": str(tmp_path), "load": ["a"]},
                           "models": [{"name": "m", "builtin": "mlp"}]})
    assert [m.name for m in config.models] == ["m", "a", "b"]
    assert config.model("a").slo_ms == 250.0 and config.model("a").max_batch == 4
    assert config.model("b").onnx == str(tmp_path / "b" / "3" / "model.onnx")
    assert config.repository_models == ("a", "b") and config.unloaded_at_start == ("b",)
    assert [m.name for m in config.startup_models] == ["m", "a"]
    everything = parse_config({"repository": {"path": str(tmp_path), "load": ["*"]}})
    assert everything.unloaded_at_start == ()


@pytest.mark.parametrize(("layout", "load", "error"), [
    ({"a": "slo_ms = 0.0\n"}, [],
     "repository.models.a.slo_ms: must be a finite number > 0, got 0.0"),
    ({"a": "sloms = 1.0\n"}, [], "repository.models.a.sloms: unknown key"),
    ({"a": 'onnx = "x.onnx"\n'}, [], "repository.models.a.onnx: given by the folder"),
    ({"a": None}, ["z"], "repository.load[0]: no model 'z' in the repository (it holds a)"),
    ({"a": 'profiles = { h100 = "h.json" }\n'}, [],
     "repository.models.a.profiles.h100: no backend announces kind 'h100' (the backends "
     "announce a100)"),
    ({"a": "profiles = { a100 = 1 }\n"}, [],
     "repository.models.a.profiles.a100: must be a profile file's path, got 1"),
])
def test_repository_problems_are_one_line_errors_naming_the_key(
        tmp_path: Path, layout: dict[str, str | None], load: list[str], error: str) -> None:
    for name, settings in layout.items():
        _folder(tmp_path, name, settings)
    with pytest.raises(ConfigError) as info:
        parse_config({"repository": {"path": str(tmp_path), "load": load},
                      "backends": {"kind": "a100"}})
    assert str(info.value).startswith(error) and "\n" not in str(info.value)


def test_a_folders_profile_per_kind_resolves_against_the_folder(tmp_path: Path) -> None:
    _folder(tmp_path, "a", 'profiles = { a100 = "a100.json", t4 = "/abs/t4.json" }\n')
    config = parse_config({"repository": {"path": str(tmp_path)},
                           "backends": {"count": 2, "kinds": ["a100", "t4"]}})
    assert config.model("a").profiles == {"a100": str(tmp_path / "a" / "a100.json"),
                                          "t4": "/abs/t4.json"}


def test_a_folder_without_a_model_file_or_no_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty" / "1").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"repository\.models\.empty: .* has no "):
        parse_config({"repository": {"path": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"repository\.path: no such folder"):
        parse_config({"repository": {"path": str(tmp_path / "nowhere")}})


# ------------------------------------------------------------------ make-before-break moves


def _three() -> ModelRepository:
    return ModelRepository(MODELS, {"backend-0": ["a"], "backend-1": ["a"], "backend-2": []})


def test_a_move_loads_and_announces_on_the_new_backends_before_the_old_ones_unload() -> None:
    repo = _three()
    assert repo.placement["a"] == frozenset({"backend-0", "backend-1"})
    start = repo.move(CALL, "a", ["backend-1", "backend-2"])
    assert start.commands == [("backend-2", _warm("a"))] and not start.answers
    # a load or unload of a moving model is refused, not queued behind the move
    assert _answers(repo.call(Call("frontend-0", 9), "unload", "a"))[0][0] == "UNAVAILABLE"
    announce = repo.on_report("backend-2", "a", "WARM")
    assert announce.commands == [("backend-2", LoadModel("a", MODELS["a"]))]
    assert repo.on_report("backend-0", "a", "READY").commands == []  # a late report: no step
    # the new backend serves it: only now is the old one told to unload (its plans run first)
    switch = repo.on_report("backend-2", "a", "READY")
    assert switch.commands == [("backend-0", UnloadModel("a"))] and not switch.answers
    assert repo.state("a") == ("UNLOADING", "")
    done = repo.on_report("backend-0", "a", "UNAVAILABLE")
    assert _answers(done) == [("", "")] and done.commands == []
    assert repo.states["a"] == {"backend-1": "READY", "backend-2": "READY"}
    assert repo.placement["a"] == frozenset({"backend-1", "backend-2"})


def test_a_move_whose_load_fails_leaves_the_model_where_it_was() -> None:
    repo = _three()
    repo.move(CALL, "a", ["backend-2"])
    done = repo.on_report("backend-2", "a", "FAILED", "out of memory")
    assert done.commands == []  # the old backends keep it: nothing unloads
    assert _answers(done) == [("BAD_REQUEST", "failed to move 'a': backend-2: out of memory")]
    assert repo.states["a"] == {"backend-0": "READY", "backend-1": "READY"}
    assert repo.placement["a"] == frozenset({"backend-0", "backend-1"})


def test_a_move_within_the_backends_that_serve_it_only_unloads() -> None:
    repo = _three()
    effects = repo.move(CALL, "a", ["backend-0"])
    assert effects.commands == [("backend-1", UnloadModel("a"))] and not effects.answers
    assert _answers(repo.on_report("backend-1", "a", "UNAVAILABLE")) == [("", "")]


def test_a_bad_move_is_refused_at_once() -> None:
    repo = _three()
    assert _answers(repo.move(CALL, "zz", ["backend-0"]))[0][0] == "BAD_REQUEST"
    refused = repo.move(CALL, "a", ["backend-9"])
    assert _answers(refused) == [("BAD_REQUEST", "cannot move 'a' to backend-9: the live "
                                  "backends are backend-0, backend-1, backend-2")]
    repo.call(CALL, "load", "b")  # b loads: a move of b waits for nothing, it is refused
    assert _answers(repo.move(CALL, "b", ["backend-0"]))[0][0] == "UNAVAILABLE"


def test_a_restarted_backend_loads_a_model_only_where_it_is_placed() -> None:
    repo = _three()
    repo.move(CALL, "a", ["backend-0"])
    repo.on_report("backend-1", "a", "UNAVAILABLE")
    repo.on_backend_gone("backend-1")
    assert repo.on_backend_started("backend-1", []).commands == []  # a is not placed there
    repo.on_backend_gone("backend-0")
    assert repo.on_backend_started("backend-0", []).commands == []  # nothing READY to copy


def test_a_load_of_a_model_that_names_its_backends_goes_to_those_alone() -> None:
    placed = {"name": "c", "onnx": "/r/c/1/model.onnx", "backends": ["backend-1"]}
    repo = ModelRepository({**MODELS, "c": placed}, {"backend-0": ["a"], "backend-1": ["a"]})
    effects = repo.call(CALL, "load", "c")
    assert effects.commands == [("backend-1", LoadModel("c", placed, announce=False))]
    repo.on_report("backend-1", "c", "WARM")
    assert _answers(repo.on_report("backend-1", "c", "READY")) == [("", "")]
    assert repo.served_by("backend-0") == ["a"] and repo.served_by("backend-1") == ["a", "c"]
    # a restarted backend it does not name does not load it
    assert repo.on_backend_started("backend-0", ["a"]).commands == []
    # none of its backends live: refused in one line
    repo.on_backend_gone("backend-1")
    repo.call(Call("frontend-0", 9), "unload", "c")
    refused = repo.call(Call("frontend-0", 10), "load", "c")
    assert _answers(refused) == [
        ("UNAVAILABLE", "no live backend to load it on (it names backend-1)")]
