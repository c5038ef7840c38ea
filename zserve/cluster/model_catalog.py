"""The repository folder read again while the cluster runs: the models added since start.

Triton rescans its repository on an index or load call; so does the supervisor
(``Supervisor._repository_call``): ``rescan`` reads the ``[repository]`` folder and returns the
models the cluster does not know yet, ``with_models`` the cluster config with them (known to
every role from then on, loaded nowhere), and ``role_models`` what a role's config lists (a
shard the models it owns), so that a role restarted later starts with them. A folder that
cannot be read (a bad ``config.toml``, a model folder without a version) is a one-line problem
naming the key, as at start; the models known already stay served.
"""

from __future__ import annotations

import msgspec

from zserve.config.cluster import ClusterConfig, ConfigError, ModelConfig, shard_for_model
from zserve.config.decode import SchemaError
from zserve.config.repository import scan_repository


def rescan(config: ClusterConfig) -> tuple[list[ModelConfig], str | None]:
    """The models of the repository folder that ``config`` does not know yet, and the one-line
    problem if the folder cannot be read (then none is added)."""
    if config.repository.path is None:
        return [], None
    try:
        found: list[ModelConfig] = scan_repository(config.repository.path, ModelConfig)
    except SchemaError as exc:
        return [], str(ConfigError(exc.path, exc.problem))
    known = {m.name for m in config.models}
    return [m for m in found if m.name not in known], None


def with_models(config: ClusterConfig, added: list[ModelConfig]) -> ClusterConfig:
    """``config`` with the repository models ``added`` (not loaded at start)."""
    names = tuple(m.name for m in added)
    return msgspec.structs.replace(
        config, models=config.models + tuple(added),
        unloaded_at_start=config.unloaded_at_start + names,
        repository_models=config.repository_models + names)


def role_models(config: ClusterConfig, role: str, index: int) -> tuple[ModelConfig, ...]:
    """The models a role's config lists: a shard the ones it owns, any other role all."""
    if role != "shard":
        return config.models
    shards = config.scheduler.shards
    return tuple(m for m in config.models if shard_for_model(m.name, shards) == index)


__all__ = ["rescan", "role_models", "with_models"]
