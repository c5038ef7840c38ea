"""The model repository folder: one folder per model, read into ``ModelConfig``\\ s.

Laid out as Triton lays a repository out::

    <repository>/<model>/config.toml        # optional: the model's [[models]] keys
    <repository>/<model>/<version>/model.onnx

``<model>`` is the model's name (``[A-Za-z0-9][A-Za-z0-9_.-]*``); ``<version>`` a positive
integer, and the highest version folder holding a ``model.onnx`` is the one served (zserve serves
one version per model). ``config.toml`` holds any key of a ``[[models]]`` table but ``name`` and
the model's source (``onnx``, ``builtin``, ``emulated``: the folder gives both), e.g.
``slo_ms = 200.0`` and ``max_batch = 16``; a relative ``profile`` resolves against the model's
folder. A problem is a ``ConfigError`` naming the key path under ``repository``
(``repository.models.resnet50.slo_ms: must be a finite number > 0, got 0.0``). Read when the
cluster file is loaded (``zserve.config.cluster.parse_config``); nothing here runs a model.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from zserve.config.decode import SchemaError, decode

MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.toml"
# Keys the folder itself gives: a config.toml that names one is refused.
FOLDER_KEYS = ("name", "onnx", "builtin", "emulated")


class RepositoryError(SchemaError):
    """A repository folder problem; the message starts with the key path under
    ``repository``."""


def model_file(model_dir: Path) -> Path | None:
    """The ``model.onnx`` of the highest numeric version folder that holds one, else None."""
    versions = [(int(child.name), child) for child in model_dir.iterdir()
                if child.is_dir() and child.name.isdigit() and int(child.name) > 0
                and (child / MODEL_FILE).is_file()]
    return max(versions)[1] / MODEL_FILE if versions else None


def _settings(model_dir: Path, key: str) -> dict[str, Any]:
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        with path.open("rb") as f:
            settings = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise RepositoryError(key, f"{path}: {exc}") from None
    for name in FOLDER_KEYS:
        if name in settings:
            raise RepositoryError(f"{key}.{name}", f"given by the folder; remove it from {path}")
    profile = settings.get("profile")
    if isinstance(profile, str) and not Path(profile).is_absolute():
        settings["profile"] = str((model_dir / profile).resolve())
    kinds = settings.get("profiles")
    if isinstance(kinds, dict):  # a profile file per device kind: the same rule
        settings["profiles"] = {kind: str((model_dir / path).resolve())
                                if isinstance(path, str) and path and not Path(path).is_absolute()
                                else path for kind, path in kinds.items()}
    return settings


def scan_repository(root: str | Path, schema: type[Any], *, key: str = "repository"
                    ) -> list[Any]:
    """Every model folder of ``root`` as a ``schema`` (``ModelConfig``), in name order. Folders
    without a version folder holding ``model.onnx`` are refused, naming the folder."""
    root = Path(root)
    if not root.is_dir():
        raise RepositoryError(f"{key}.path", f"no such folder: {root}")
    models: list[Any] = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        where = f"{key}.models.{model_dir.name}"
        onnx = model_file(model_dir)
        if onnx is None:
            raise RepositoryError(where, f"{model_dir} has no <version>/{MODEL_FILE}")
        document = {**_settings(model_dir, where), "name": model_dir.name, "onnx": str(onnx)}
        try:
            models.append(decode(document, schema))
        except SchemaError as exc:
            raise RepositoryError(f"{where}.{exc.path}".rstrip("."), exc.problem) from None
    return models


__all__ = ["CONFIG_FILE", "MODEL_FILE", "RepositoryError", "model_file", "scan_repository"]
