"""Live load and unload of one backend's models, on the supervisor's command.

A part of the backend host (``zserve.backends.host.BackendHost``), run on its event loop:

- ``LoadModel``: the model's sessions are opened in a helper thread (the loop keeps serving the
  other models and heartbeating), it is warmed at every batch size 1..max_batch on the
  executor's worker thread (one batch per call, so the other models' batches interleave) and
  its profile is the configured one or measured there. Without ``announce`` it is then held
  and reported ``WARM``; with it (at once, or by a second ``LoadModel``) its batch buffers are
  allocated, the follower learns it, and only then is it announced to the rank (``announce``:
  a ``BackendRegister`` listing it) and reported ``READY``. A failure is reported ``FAILED``
  with its one-line reason and leaves nothing loaded.
- ``UnloadModel``: the model is withdrawn first (``announce`` without it: the rank's next
  ``BackendTable`` tells every shard, which plans it here no more and answers its queue
  ``UNAVAILABLE`` where no backend serves it); the plans already sent run (a model held warm
  and never announced is freed at once); once none is held
  and none has come for ``UNLOAD_QUIET_S`` (the table has reached the shards, and a plan sent
  before it has arrived), the follower forgets the model (a later plan is refused
  ``UNAVAILABLE``), its buffers and sessions are dropped, the collector runs, and it is
  reported ``UNAVAILABLE``: its memory is back (docs/orchestration.md, "Model repository",
  for the measurement).

Operations on one model run in the order they came (one lock per model); different models'
interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from zserve.backends.batch_runner import BatchRunner
from zserve.backends.executor import Executor
from zserve.backends.follower import PlanFollower
from zserve.config.cluster import ModelConfig
from zserve.config.profiles import LatencyProfile, configured_profile
from zserve.runtime.clock import ClusterClock
from zserve.transport.messages import LoadModel, ModelReport, UnloadModel

log = logging.getLogger(__name__)

READY, WARM, UNAVAILABLE, FAILED = "READY", "WARM", "UNAVAILABLE", "FAILED"
# After a withdrawn model's last plan (or its withdrawal): long enough for the rank's table to
# reach every shard and for a plan sent before it to arrive (both take a hop of about 0.1 ms
# on one host; the margin covers a loaded host's scheduling stalls).
UNLOAD_QUIET_S = 0.25
UNLOAD_POLL_S = 0.01
# Repeats per batch size when a loaded model's profile has to be measured.
PROFILE_REPEATS = 3

Report = Callable[[ModelReport], Awaitable[Any]]


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): the memory an
    unloaded model's sessions freed otherwise stays in the allocator's arenas and counts in the
    process's RSS. False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def model_spec(config: ModelConfig, executor: Executor | None = None, kind: str = "") -> Any:
    """What ``executor.add_model`` loads: an ``EmulatedModel`` (its profile on a device of
    ``kind``) on an emulated device, else the ``ModelSpec`` of an ONNX or built-in model."""
    from zserve.backends.builtin import ModelSpec, ensure_builtin
    from zserve.backends.emulated import EmulatedExecutor, EmulatedModel

    if isinstance(executor, EmulatedExecutor):
        return EmulatedModel.from_config(config, kind)

    if config.kind == "builtin" and config.builtin:
        return ModelSpec(config.name, ensure_builtin(config.builtin))
    if config.kind == "onnx" and config.onnx:
        return ModelSpec(config.name, Path(config.onnx))
    raise ValueError(f"model {config.name!r} ({config.kind}) cannot be loaded at run time")


class ModelLifecycle:
    """Loads and unloads the models of one backend (see the module docstring). ``served``: the
    host's list of the models it announces (changed in place); ``announce``: register again
    with the rank; ``report``: send a ``ModelReport`` to the supervisor."""

    def __init__(self, *, name: str, executor: Executor, follower: PlanFollower,
                 runner: BatchRunner, clock: ClusterClock, served: list[str],
                 profiles: dict[str, LatencyProfile], warmed: dict[str, list[int]],
                 announce: Callable[[], None], report: Report, kind: str = "") -> None:
        self.name = name
        self.executor = executor
        self.follower = follower
        self.runner = runner
        self.clock = clock
        self.served = served
        self.profiles = profiles
        self.warmed = warmed
        self.announce = announce
        self.report = report
        self.kind = kind  # the device kind the backend announces: its models' profiles there
        self._locks: dict[str, asyncio.Lock] = {}
        self._last_plan_at: dict[str, float] = {}
        # loaded and warmed, not announced yet (a LoadModel without ``announce``): its profile
        self._warm: dict[str, LatencyProfile] = {}
        self.counters = {"models_loaded": 0, "models_unloaded": 0, "model_loads_failed": 0}

    def note_plan(self, model: str, now: float) -> None:
        """A plan of ``model`` arrived (an unload waits for the plans to stop)."""
        self._last_plan_at[model] = now

    async def handle(self, msg: LoadModel | UnloadModel) -> None:
        """Carry out one command, after the earlier ones of the same model."""
        model = msg.model
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            if isinstance(msg, LoadModel):
                await self._load(ModelConfig.from_dict(msg.config), announce=msg.announce)
            else:
                await self._unload(model)

    # ------------------------------------------------------------------ load

    async def _load(self, config: ModelConfig, *, announce: bool) -> None:
        model = config.name
        if model in self.served:
            await self._tell(model, READY)
            return
        if model not in self._warm:
            try:
                self._warm[model] = await self._open_and_warm(config)
            except Exception as exc:  # a bad file, an ONNX Runtime refusal: the supervisor's
                self.counters["model_loads_failed"] += 1
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.executor.remove_model, model)
                log.error("%s: loading %s failed: %s", self.name, model, exc)
                await self._tell(model, FAILED, (str(exc) or repr(exc)).splitlines()[0])
                return
            self.counters["models_loaded"] += 1
        if not announce:
            await self._tell(model, WARM)
            return
        self._serve(model, self._warm.pop(model))
        log.info("%s: %s loaded, warmed and announced", self.name, model)
        await self._tell(model, READY)

    def _serve(self, model: str, profile: LatencyProfile) -> None:
        """Batch buffers, the follower, then the rank: from now on plans of it may come."""
        max_batch = self.executor.max_batch(model)
        self.runner.allocate(model)
        self.profiles[model] = profile
        self.warmed[model] = list(range(1, max_batch + 1))
        self.follower.add_model(model, profile.table_s, max_batch)
        self.served.append(model)
        self.announce()

    async def _open_and_warm(self, config: ModelConfig) -> LatencyProfile:
        """Open the sessions, warm every batch size, fix the profile; raises on failure."""
        model = config.name
        await asyncio.to_thread(self.executor.add_model,
                                model_spec(config, self.executor, self.kind),
                                max_batch=config.max_batch,
                                session_batch_sizes=config.session_batch_sizes)
        for size in range(1, self.executor.max_batch(model) + 1):
            if not self.executor.holds_runtime_state:
                break
            await self.executor.run_async(model, self.executor.synthetic_requests(model, size))
        profile = configured_profile(config, self.kind)
        if profile is None:
            measured = await asyncio.to_thread(self.executor.profile, model,
                                               repeats=PROFILE_REPEATS, warmup=0)
            profile = LatencyProfile.from_table_ms(measured.table_ms())
        return profile

    # ------------------------------------------------------------------ unload

    async def _unload(self, model: str) -> None:
        if model not in self.served and self._warm.pop(model, None) is None:
            await self._tell(model, UNAVAILABLE)
            return
        if model in self.served:  # withdraw it, then wait for its plans
            self.served.remove(model)
            self.announce()
            withdrawn_at = self.clock.now()
            while not self._quiet(model, withdrawn_at):
                await asyncio.sleep(UNLOAD_POLL_S)
            self.follower.remove_model(model)
            self.runner.free(model)
            self.profiles.pop(model, None)
            self.warmed.pop(model, None)
        message = ""
        try:
            await asyncio.to_thread(self.executor.remove_model, model)
        except Exception as exc:  # an executor that keeps its models (emulated): served no more
            message = f"withdrawn, but its executor keeps it: {exc}"
            log.warning("%s: %s %s", self.name, model, message)
        if self.executor.holds_runtime_state:  # a collection stalls the loop for tens of ms
            gc.collect()
            release_free_heap()
        self.counters["models_unloaded"] += 1
        log.info("%s: %s unloaded", self.name, model)
        await self._tell(model, UNAVAILABLE, message)

    async def withdraw_all(self, bound_s: float) -> None:
        """Before a drain: withdraw every served model with one announce, then wait (at most
        ``bound_s``) until no plan has come for ``UNLOAD_QUIET_S``: the schedulers plan nothing
        more here, so the drain refuses no plan that another backend could have run (a rolling
        restart loses no request to it). The plans held then are the drain's to run."""
        if not self.served or bound_s <= 0:
            return
        withdrawn = list(self.served)
        self.served.clear()
        self.announce()
        withdrawn_at = self.clock.now()
        deadline = withdrawn_at + bound_s
        log.info("%s: withdrew %s before draining", self.name, ", ".join(withdrawn))
        while self.clock.now() < deadline:
            last = max([withdrawn_at, *(self._last_plan_at.get(m, -math.inf) for m in withdrawn)])
            if self.clock.now() - last >= UNLOAD_QUIET_S:
                return
            await asyncio.sleep(UNLOAD_POLL_S)

    def _quiet(self, model: str, withdrawn_at: float) -> bool:
        """No plan of ``model`` held or running, and none for ``UNLOAD_QUIET_S``."""
        last = max(withdrawn_at, self._last_plan_at.get(model, -math.inf))
        return (self.follower.plans_of(model) == 0
                and self.clock.now() - last >= UNLOAD_QUIET_S)

    async def _tell(self, model: str, state: str, message: str = "") -> None:
        await self.report(ModelReport(name=self.name, model=model, state=state,
                                      message=message))


__all__ = ["FAILED", "READY", "UNAVAILABLE", "UNLOAD_QUIET_S", "WARM", "ModelLifecycle",
           "model_spec"]
