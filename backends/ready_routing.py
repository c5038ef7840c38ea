"""A backend's ready-delay samples, each held for the shard that plans its model.

The follower notes each started batch's ready delay (``PlanFollower.ready_samples``: model,
seconds from the plan's send to its last input, rows); the shards learn ``d_ctrl`` from them
(``zserve.scheduler.learned_allowances``) and hear them on the ``PlanAck`` of their next plan, so
no message is added. With several scheduler shards, a chunk of plans acknowledges only the shards
whose plans it holds: :class:`ReadyRouting` keeps each sample for the shard that last sent a plan
of its model, and hands a shard its own when it is acknowledged. Every shard thus hears every
batch of its models, whichever shards the batches of messages happen to acknowledge.

Pure logic: no clock, no I/O; the backend host calls it.
"""

from __future__ import annotations

from collections.abc import Iterable

# Samples held per shard at most (a shard whose plans stopped keeps its first ones: the shard
# needs a sample of the tail, not every batch; matches the follower's own bound).
SHARD_SAMPLES_MAX = 64

ReadySamples = tuple[list[str], list[float], list[int]]  # models, delays (s), rows


class ReadyRouting:
    """Ready samples by the shard that plans their model (see the module docstring)."""

    __slots__ = ("_held", "_shard_of")

    def __init__(self) -> None:
        self._shard_of: dict[str, bytes] = {}  # model -> the identity of its newest plan's shard
        self._held: dict[bytes, ReadySamples] = {}

    def note_plan(self, model: str, shard: bytes) -> None:
        """A plan of ``model`` came from ``shard``: its model's samples go there from now on."""
        self._shard_of[model] = shard

    def hold(self, samples: Iterable[tuple[str, float, int]]) -> None:
        """Keep ``samples`` (model, delay s, rows) for their models' shards; those of a model
        no shard planned are dropped (nobody learns from them)."""
        for model, delay_s, rows in samples:
            shard = self._shard_of.get(model)
            if shard is None:
                continue
            held = self._held.get(shard)
            if held is None:
                held = self._held[shard] = ([], [], [])
            if len(held[0]) < SHARD_SAMPLES_MAX:
                held[0].append(model)
                held[1].append(delay_s)
                held[2].append(rows)

    def take(self, shard: bytes) -> ReadySamples:
        """The samples held for ``shard`` (empty lists when none), which it now hears."""
        return self._held.pop(shard, ([], [], []))

    def held(self, shard: bytes) -> int:
        """How many samples wait for ``shard``."""
        held = self._held.get(shard)
        return 0 if held is None else len(held[0])


__all__ = ["SHARD_SAMPLES_MAX", "ReadyRouting", "ReadySamples"]
