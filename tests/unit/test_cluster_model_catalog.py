"""A model folder added to the repository while the cluster runs (``zserve.cluster.model_catalog``
and ``ModelRepository.add_model``): a rescan finds only the new models, the config lists them as
not loaded at start and the shard that owns each lists it; a bad folder is one line naming the
key and adds nothing; the repository knows the model, loaded nowhere, and loads it on a call."""

from __future__ import annotations

from pathlib import Path

from zserve.cluster import model_catalog
from zserve.cluster.repository import LOADING, Call, ModelRepository
from zserve.config.cluster import parse_config, shard_for_model
from zserve.transport.messages import LoadModel


def _folder(root: Path, name: str, settings: str = "") -> None:
    version = root / name / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(b"onnx")
    if settings:
        (root / name / "config.toml").write_text(settings)


def test_a_rescan_adds_only_the_new_models(tmp_path: Path) -> None:
    _folder(tmp_path, "first")
    config = parse_config({"repository": {"path": str(tmp_path), "load": ["*"]},
                           "scheduler": {"shards": 2}})
    assert model_catalog.rescan(config) == ([], None)
    _folder(tmp_path, "second", "slo_ms = 250.0\n")
    added, problem = model_catalog.rescan(config)
    assert problem is None and [m.name for m in added] == ["second"]
    assert added[0].slo_ms == 250.0
    grown = model_catalog.with_models(config, added)
    assert [m.name for m in grown.models] == ["first", "second"]
    assert grown.unloaded_at_start == ("second",)
    assert "second" in grown.repository_models
    assert model_catalog.rescan(grown) == ([], None)
    owner = shard_for_model("second", 2)
    assert "second" in [m.name for m in model_catalog.role_models(grown, "shard", owner)]
    assert "second" not in [m.name for m in model_catalog.role_models(grown, "shard", 1 - owner)]
    assert len(model_catalog.role_models(grown, "frontend", 0)) == 2


def test_a_bad_folder_added_later_is_one_line_and_adds_nothing(tmp_path: Path) -> None:
    _folder(tmp_path, "first")
    config = parse_config({"repository": {"path": str(tmp_path)}})
    _folder(tmp_path, "good")
    (tmp_path / "broken").mkdir()
    added, problem = model_catalog.rescan(config)
    assert added == []
    assert problem is not None and problem.startswith("repository.models.broken: ")
    assert "\n" not in problem


def test_the_repository_knows_an_added_model_loaded_nowhere() -> None:
    repository = ModelRepository({"a": {"name": "a"}}, {"backend-0": ["a"]})
    repository.add_model("late", {"name": "late"})
    assert repository.state("late") == ("UNAVAILABLE", "not loaded")
    assert not repository.busy("late") and not repository.busy("a")
    effects = repository.call(Call("frontend-0", 1), "load", "late")
    assert effects.commands == [("backend-0", LoadModel("late", {"name": "late"},
                                                        announce=False))]
    assert repository.states["late"] == {"backend-0": LOADING} and repository.busy("late")
