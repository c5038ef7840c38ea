"""The bridge between the Open Inference Protocol servers and the frontend's core.

An OIP request (HTTP or gRPC) becomes the same admission call a native client's ``InferRequest``
becomes: ``FrontendCore.on_infer`` under one reserved client identity (``OIP_CLIENT``), with a
request id of the bridge's own. The answer comes back through the frontend host: when the core's
outbox answers ``OIP_CLIENT`` (one ``InferAnswers`` per tick), the host hands it to ``deliver``,
which resolves that request's asyncio future with its outputs or its typed ``zserve.core.errors``
error. Requests submitted during one loop iteration are admitted together (one call of the
host's ``admit``), so the shards get one ``RequestMetaBatch`` for them, as they do for one socket
chunk of native requests.

The bridge also answers what the health and metadata endpoints ask (``zserve.frontend.readiness``),
from the core's state: whether it admits, the rank's backend table, the signatures the backends
registered. It runs on the frontend's loop and is never touched from another thread.

Two refusals are the servers' own, with Triton's codes (its ``TRITONSERVER_ERROR_NOT_FOUND`` and
``_UNSUPPORTED``): a model or version the cluster does not serve (``UnknownModelError``: HTTP 404,
gRPC ``NOT_FOUND``), and an endpoint of Triton's that zserve does not serve
(``UnsupportedEndpointError``, made by ``unsupported``: HTTP 501, gRPC ``UNIMPLEMENTED``). Both
are ``BAD_REQUEST`` to zserve (the request never ran; a retry cannot succeed), so their JSON body
is every error's: ``{"error", "kind", "may_have_run"}``, which tritonclient reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib import metadata
from typing import Any

from zserve.config.apps import app_signature
from zserve.config.signature import ModelSignature, named_list, quoted
from zserve.core.errors import (
    BadRequestError,
    ShuttingDownError,
    UnavailableError,
    ZServeError,
    error_from_wire,
)
from zserve.frontend import readiness
from zserve.frontend.core import FrontendCore
from zserve.frontend.repository_link import RepositoryLink
from zserve.transport.messages import InferAnswers, InferError, InferReply, InferRequest, Message

# The client identity of every OIP request inside the core. ZeroMQ's own routing ids are five
# bytes starting with a zero byte, and an identity a peer sets may not start with one: no
# ZeroMQ client can take this one.
OIP_CLIENT = b"\x00zserve-oip"
SERVER_NAME = "zserve"
# The OIP extensions served (Triton's names): binary tensor data over HTTP, model configuration,
# the model repository (index, load, unload: docs/orchestration.md, "Model repository").
EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository")
MODEL_VERSIONS = ("", "1")

Outputs = dict[str, Any]


class UnknownModelError(BadRequestError):
    """A model (or a version of it) this cluster does not serve."""


class UnsupportedEndpointError(BadRequestError):
    """An endpoint of Triton's that zserve does not serve (its model repository, statistics,
    trace, logging, shared memory, generate and streaming endpoints)."""


def unsupported(extension: str, endpoint: str) -> UnsupportedEndpointError:
    """The answer to ``endpoint`` (``POST /v2/repository/index``, ``RepositoryIndex``), one of
    ``extension``'s."""
    return UnsupportedEndpointError(
        f"{endpoint}: zserve does not serve Triton's {extension} extension (it serves health, "
        f"metadata and inference, and the extensions {', '.join(EXTENSIONS)})")


class OipBridge:
    """Submits OIP requests to a ``FrontendCore`` and resolves their futures from its answers.

    ``admit(requests)``: the host admits them under ``OIP_CLIENT`` (one tick); ``cancel(rid)``:
    the host cancels one (its caller went away)."""

    def __init__(self, core: FrontendCore, admit: Callable[[list[InferRequest]], None],
                 cancel: Callable[[int], None]) -> None:
        self.core = core
        self._admit = admit
        self._cancel = cancel
        self._futures: dict[int, asyncio.Future[Outputs]] = {}
        self._queued: list[InferRequest] = []
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_scheduled = False
        self._closed_because: str | None = None
        self.version = metadata.version("zserve")
        # The supervisor's model repository (the host sets it when a supervisor runs it).
        self.repository: RepositoryLink | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start admitting (the host is connected to the scheduler and backends)."""
        self._loop = loop

    @property
    def admitting(self) -> bool:
        return self._loop is not None and not self.core.draining

    # ------------------------------------------------------------------ requests

    def submit(self, model: str, inputs: dict[str, Any], slo_ms: float) -> asyncio.Future[Outputs]:
        """Submit one request; its future ends with the outputs or a ``ZServeError``."""
        loop = self._loop
        if loop is None:
            if self._closed_because is not None:
                raise ShuttingDownError(self._closed_because)
            raise UnavailableError(f"frontend {self.core.name} is not serving yet")
        if model not in self.core.models and model not in self.core.apps.names:
            raise UnknownModelError(f"unknown model {quoted(model)}")
        rid = self._next_id
        self._next_id += 1
        future: asyncio.Future[Outputs] = loop.create_future()
        self._futures[rid] = future
        self._queued.append(InferRequest(rid, model, inputs, slo_ms))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._flush_scheduled = False
        queued, self._queued = self._queued, []
        if queued:
            self._admit(queued)

    def forget(self, future: asyncio.Future[Outputs]) -> None:
        """The caller stopped waiting for ``future`` (its connection closed): cancel the
        request if it has not started."""
        for rid, pending in self._futures.items():
            if pending is future:
                del self._futures[rid]
                if any(req.request_id == rid for req in self._queued):
                    self._queued = [req for req in self._queued if req.request_id != rid]
                else:
                    self._cancel(rid)
                return

    def deliver(self, msg: Message) -> None:
        """An answer the core sent to ``OIP_CLIENT``."""
        futures = self._futures
        if type(msg) is InferAnswers:
            for rid, outputs in zip(msg.request_ids, msg.outputs, strict=False):
                future = futures.pop(rid, None)
                if future is not None and not future.done():
                    future.set_result(outputs)
            for rid, kind, message in zip(msg.error_ids, msg.errors, msg.messages, strict=False):
                self._fail(rid, error_from_wire(kind, message))
        elif type(msg) is InferReply:
            future = futures.pop(msg.request_id, None)
            if future is not None and not future.done():
                future.set_result(msg.outputs)
        elif type(msg) is InferError:
            self._fail(msg.request_id, error_from_wire(msg.error, msg.message))

    def _fail(self, rid: int, error: ZServeError) -> None:
        future = self._futures.pop(rid, None)
        if future is not None and not future.done():
            future.set_exception(error)

    def close(self, message: str) -> None:
        """Answer every request still waiting (the core has answered all it admitted)."""
        self._queued.clear()
        futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(ShuttingDownError(message))
        self._loop = None
        self._closed_because = message

    # ------------------------------------------------------------------ health and metadata

    def ready(self) -> bool:
        """Admitting, and every model loaded at start served (a repository model loaded
        later, or never, does not make the server unready)."""
        return readiness.frontend_ready(self.admitting,
                                        [m.name for m in self.core.cluster.startup_models],
                                        self.core.backend_models)

    def model_ready(self, model: str, version: str = "") -> bool:
        """Whether ``model`` is served; an app, when every model of its stages is."""
        self.check_model(model, version)
        plan = self.core.apps.plans.get(model)
        models = [model] if plan is None else [s.model for s in plan.stages.values()]
        return self.admitting and all(readiness.model_ready(m, self.core.backend_models)
                                      for m in models)

    def check_model(self, model: str, version: str = "") -> None:
        if model not in self.core.models and model not in self.core.apps.names:
            raise UnknownModelError(f"unknown model {quoted(model)} (this cluster serves "
                                    f"{named_list(sorted(self.core.models))})")
        if version not in MODEL_VERSIONS:
            raise UnknownModelError(f"model {quoted(model)} has version 1 only, not "
                                    f"{quoted(version)}")

    def signature(self, model: str, version: str = "") -> ModelSignature:
        """The signature ``model``'s backends registered (UNAVAILABLE before one did)."""
        self.check_model(model, version)
        plan = self.core.apps.plans.get(model)
        signature = (self.core.models[model].signature if plan is None else app_signature(
            plan, {name: m.signature for name, m in self.core.models.items()}))
        if signature is None:
            raise UnavailableError(f"model {quoted(model)}: no backend has registered it yet, so "
                                   "its inputs and outputs are not known")
        return signature

    def max_batch(self, model: str) -> int:
        """An app's: the smallest of its stages' models'."""
        plan = self.core.apps.plans.get(model)
        if plan is None:
            return self.core.models[model].config.max_batch
        return min(self.core.models[s.model].config.max_batch for s in plan.stages.values())

    # ------------------------------------------------------------------ model repository

    def _repository(self) -> RepositoryLink:
        if self.repository is None:
            raise UnavailableError("this frontend has no link to the model repository")
        return self.repository

    async def repository_index(self) -> list[dict[str, str]]:
        """Every model of the cluster: ``{"name", "version", "state", "reason"}`` (Triton's
        index entries; reason left out when empty)."""
        reply = await self._repository().call("index")
        index = []
        for name, state, reason in zip(reply.models, reply.states, reply.reasons, strict=True):
            entry = {"name": name, "version": "1", "state": state}
            if reason:
                entry["reason"] = reason
            index.append(entry)
        return index

    async def load_model(self, model: str) -> None:
        """Load ``model`` on the cluster's backends; returns once it is READY there."""
        await self._repository().call("load", model)

    async def unload_model(self, model: str) -> None:
        """Unload ``model`` everywhere; returns once every backend freed it. Its queued
        requests are answered UNAVAILABLE."""
        await self._repository().call("unload", model)
