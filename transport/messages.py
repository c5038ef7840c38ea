"""Every wire message of zserve, as a typed class.

This module is the wire contract between processes. Each message is a frozen dataclass whose
fields are msgpack-native (int, float, str, bool, bytes, None, lists and str-keyed dicts of those)
or numpy arrays. On the wire a message is ``[header, buf0, buf1, ...]``: the header is a msgpack
array ``[KIND, field0, field1, ...]`` in declaration order, with each array replaced by a
descriptor naming its dtype, shape and either its bytes (small arrays, inline) or the index of
the frame that carries them (see ``zserve.transport.arrays`` and ``codec``). Decoding validates
the kind, the arity, every field's type and the lengths of parallel lists (``SAME_LENGTH``), and
rejects anything else with ``zserve.errors.ProtocolError``.

Conventions:
- Times (``*_at``, ``deadline``, ``arrival``) are float seconds on the *cluster clock*: the rank
  process's CLOCK_MONOTONIC. Every other process reads it as ``time.monotonic()`` plus its
  estimated offset (``zserve.clock``; exactly 0 on the rank's host). Durations carry their unit
  in the name (``slo_ms``). Exceptions, named for it: ``ClockProbe``/``ClockReply`` (how the
  offset is measured) and the ``Heartbeat`` on the supervisor's control link (host-local).
- ``request_id`` between client and frontend is the client's own id, unique per connection. From
  the frontend on, ``request_id`` is the frontend's global id, unique within that frontend;
  ``(frontend, request_id)`` is unique in the cluster.
- Error kinds travel as ``zserve.errors.ErrorKind`` values (strings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

Array = np.ndarray[Any, Any]
TensorMap = dict[str, Array]


@dataclass(frozen=True, slots=True)
class Message:
    """Base class; ``KIND`` is the tag that leads the encoded header. ``SAME_LENGTH`` names groups
    of fields that are parallel lists (struct of arrays): decoding refuses a message whose lists
    in one group differ in length."""

    KIND: ClassVar[str] = ""
    SAME_LENGTH: ClassVar[tuple[tuple[str, ...], ...]] = ()


# --------------------------------------------------------------------------- client <-> frontend


@dataclass(frozen=True, slots=True)
class InferRequest(Message):
    """Client -> frontend: run ``model`` on ``inputs``. ``slo_ms`` 0 means the model's own SLO;
    a positive value may only tighten it."""

    KIND: ClassVar[str] = "infer"
    request_id: int
    model: str
    inputs: TensorMap
    slo_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class InferReply(Message):
    """Frontend -> client: the outputs of one request."""

    KIND: ClassVar[str] = "reply"
    request_id: int
    outputs: TensorMap


@dataclass(frozen=True, slots=True)
class InferError(Message):
    """Frontend -> client: the terminal error of one request (``error`` is an ErrorKind)."""

    KIND: ClassVar[str] = "error"
    request_id: int
    error: str
    message: str


@dataclass(frozen=True, slots=True)
class ClientHello(Message):
    """Client -> frontend, first on a connection: the optional message kinds this client decodes
    beyond ``InferReply`` and ``InferError`` (today only ``InferAnswers.KIND``). A client that
    never sends one is answered with one message per request."""

    KIND: ClassVar[str] = "chello"
    accepts: list[str]


@dataclass(frozen=True, slots=True)
class InferAnswers(Message):
    """Frontend -> a client that accepts this kind (``ClientHello``): the terminal answers of
    several of its requests, produced in one event-loop tick (typically one batch's outputs), in
    one message instead of one per request. ``request_ids[i]`` is answered with ``outputs[i]``
    (as by ``InferReply``), ``error_ids[i]`` with the error ``errors[i]``, ``messages[i]`` (as by
    ``InferError``); each request id appears once."""

    KIND: ClassVar[str] = "answers"
    SAME_LENGTH: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("request_ids", "outputs"),
        ("error_ids", "errors", "messages"),
    )
    request_ids: list[int]
    outputs: list[TensorMap]
    error_ids: list[int]
    errors: list[str]
    messages: list[str]


@dataclass(frozen=True, slots=True)
class CancelRequest(Message):
    """Client -> frontend: cancel a request if it has not started executing."""

    KIND: ClassVar[str] = "cancel"
    request_id: int


# --------------------------------------------------------------------------- frontend <-> shard


@dataclass(frozen=True, slots=True)
class RequestMetaBatch(Message):
    """Frontend -> owning scheduler shard: the metadata of the requests admitted in one event-loop
    tick, as parallel lists (struct of arrays: one message and no per-request objects).
    ``frontend`` is the frontend's ``data`` address (what a BatchPlan lists in ``frontends``);
    DropNotices go back to the DEALER identity the message came from."""

    KIND: ClassVar[str] = "meta"
    frontend: str
    request_ids: list[int]
    models: list[str]
    arrivals: list[float]
    deadlines: list[float]


@dataclass(frozen=True, slots=True)
class DropNotice(Message):
    """Shard -> frontend: these requests were dropped by the scheduler and get ``error``."""

    KIND: ClassVar[str] = "drop"
    request_ids: list[int]
    error: str
    message: str


# --------------------------------------------------------------------------- shard <-> rank


@dataclass(frozen=True, slots=True)
class CandidateUpdate(Message):
    """Shard -> rank: a model's current batch candidate (latest value wins).
    ``batch_size`` 0 withdraws the candidate. ``send_delay`` is d_ctrl + d_data * batch_size."""

    KIND: ClassVar[str] = "cand"
    model: str
    batch_size: int
    exec_at: float
    latest: float
    send_delay: float


@dataclass(frozen=True, slots=True)
class GrantGpu(Message):
    """Rank -> shard: ``gpu_id`` is granted to ``model``'s candidate. ``free_at`` is when that GPU
    becomes free. The rank ignores the model's candidates until it gets a GrantAnswer."""

    KIND: ClassVar[str] = "grant"
    model: str
    gpu_id: int
    grant_id: int
    free_at: float


@dataclass(frozen=True, slots=True)
class GrantAnswer(Message):
    """Shard -> rank: the answer to a grant. ``used`` False returns the GPU untouched (the queue
    emptied meanwhile); otherwise the GPU is busy until ``free_at``. Also resumes candidates."""

    KIND: ClassVar[str] = "gans"
    model: str
    gpu_id: int
    grant_id: int
    used: bool
    free_at: float


@dataclass(frozen=True, slots=True)
class BackendTable(Message):
    """Rank -> shards (and frontends): the backends that exist, by GPU id, with the address at
    which each one's plan socket listens and the models it serves. Sent whenever it changes."""

    KIND: ClassVar[str] = "btable"
    gpu_ids: list[int]
    names: list[str]
    addresses: list[str]
    models: list[list[str]]
    # Per backend, what it registered: ``profiles_ms[i][model][b-1]`` is l(b) in ms on backend i.
    profiles_ms: list[dict[str, list[float]]] = field(default_factory=list)
    # Per backend, the signatures it registered: ``signatures[i][model]`` is the wire form of the
    # model's ``zserve.signature.ModelSignature`` (frontends validate requests against it).
    signatures: list[dict[str, dict[str, Any]]] = field(default_factory=list)


# --------------------------------------------------------------------------- shard -> backend


@dataclass(frozen=True, slots=True)
class BatchPlan(Message):
    """Shard -> backend: run one batch of ``model`` at ``exec_at`` on ``gpu_id``. Request i lives
    on frontend ``frontends[request_frontend[i]]`` (a frontend address). ``finish_by[i]`` is the
    time by which request i's batch must finish for it to be answered within its SLO (its
    scheduler deadline: arrival + SLO - reply allowance); the backend leaves out requests a late
    batch can no longer finish in time. Empty: unknown (nothing is left out); otherwise exactly
    one entry per request (a backend refuses a plan whose list has another length)."""

    KIND: ClassVar[str] = "plan"
    plan_id: int
    model: str
    gpu_id: int
    exec_at: float
    expected_finish_at: float
    frontends: list[str]
    request_frontend: list[int]
    request_ids: list[int]
    finish_by: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- backend <-> frontend


@dataclass(frozen=True, slots=True)
class InputFetch(Message):
    """Backend -> frontend: send me the inputs of these requests of one plan."""

    KIND: ClassVar[str] = "fetch"
    plan_id: int
    request_ids: list[int]


@dataclass(frozen=True, slots=True)
class InputReply(Message):
    """Frontend -> backend: the inputs of the requests it still holds, one TensorMap each, and the
    ids it no longer holds (cancelled, already answered) which the backend leaves out."""

    KIND: ClassVar[str] = "inputs"
    plan_id: int
    request_ids: list[int]
    inputs: list[TensorMap]
    missing: list[int]


@dataclass(frozen=True, slots=True)
class BatchOutputs(Message):
    """Backend -> frontend: the outputs of this frontend's requests of one batch."""

    KIND: ClassVar[str] = "outputs"
    plan_id: int
    request_ids: list[int]
    outputs: list[TensorMap]
    # When the batch started and finished on the backend (monotonic seconds; 0: not reported):
    # the frontend's queueing delay is started_at - arrival, execution finished_at - started_at.
    started_at: float = 0.0
    finished_at: float = 0.0


@dataclass(frozen=True, slots=True)
class BatchFailed(Message):
    """Backend -> frontend: these requests of one batch failed with ``error``."""

    KIND: ClassVar[str] = "bfail"
    plan_id: int
    request_ids: list[int]
    error: str
    message: str


@dataclass(frozen=True, slots=True)
class CancelFetched(Message):
    """Frontend -> the backend that fetched them (over the frontend's ``data`` ROUTER): these
    requests were cancelled or their client disconnected. ``plan_ids[i]`` is the plan whose
    fetch took ``request_ids[i]``. The backend leaves them out of the batch if it has not
    started; a started batch runs, and the frontend discards those outputs."""

    KIND: ClassVar[str] = "fcancel"
    plan_ids: list[int]
    request_ids: list[int]


# --------------------------------------------------------------------------- backend -> scheduler


@dataclass(frozen=True, slots=True)
class BackendRegister(Message):
    """Backend -> rank: this backend exists. ``profiles_ms[model][b-1]`` is l(b) in milliseconds
    for b = 1..max batch; ``plan_address`` is where its plan socket can be reached."""

    KIND: ClassVar[str] = "breg"
    name: str
    device: str
    plan_address: str
    models: list[str]
    profiles_ms: dict[str, list[float]]
    # model -> the wire form of its ``zserve.signature.ModelSignature`` (``to_dict``), for the
    # frontends' request validation; a model it could not read has none.
    signatures: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BatchStats(Message):
    """Backend -> scheduler: what happened to one plan (for reports and lateness accounting)."""

    KIND: ClassVar[str] = "bstats"
    plan_id: int
    model: str
    gpu_id: int
    batch_size: int
    exec_at: float
    started_at: float
    finished_at: float
    ok: bool
    # Requests of the plan left out because the frontend cancelled them after the fetch (a plan
    # whose every request was cancelled is skipped: batch_size 0, ok True).
    cancelled: int = 0
    # When the device will be free, as the backend projects it when it reports (after a batch
    # finished or a plan was skipped): that moment, then each plan it still holds run in exec_at
    # order for its planned duration. The rank moves the GPU's free time later to it (never
    # earlier). 0: unknown (not reported).
    device_free_at: float = 0.0


# --------------------------------------------------------------------------- lifecycle


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Any process -> its peer on connect."""

    KIND: ClassVar[str] = "hello"
    role: str
    name: str
    pid: int


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """Child -> supervisor: sockets bound and models loaded; ``endpoints`` names what it serves."""

    KIND: ClassVar[str] = "ready"
    role: str
    name: str
    pid: int
    endpoints: dict[str, str]


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """A process -> its supervisor (control link; ``sent_at`` host-local) and backends and shards
    -> the rank (``sent_at`` on the cluster clock). Informational: receivers time liveness by
    arrival."""

    KIND: ClassVar[str] = "hb"
    name: str
    seq: int
    sent_at: float


@dataclass(frozen=True, slots=True)
class ClockProbe(Message):
    """Any process -> the rank (over its own DEALER, identity ``<name>.clock``): a clock sample
    request. The sender keeps its local send time under ``seq``."""

    KIND: ClassVar[str] = "clkprobe"
    seq: int


@dataclass(frozen=True, slots=True)
class ClockReply(Message):
    """Rank -> the prober: ``rank_time`` is the rank's CLOCK_MONOTONIC (the cluster clock) read
    while answering probe ``seq``; ``rank_host`` identifies the rank's clock (boot id and time
    namespace, ``zserve.clock.host_identity``): a prober with the same one shares the clock."""

    KIND: ClassVar[str] = "clkreply"
    seq: int
    rank_time: float
    rank_host: str


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    """Supervisor -> child: drain (stop admitting, finish in flight up to ``drain_s``) and exit."""

    KIND: ClassVar[str] = "shutdown"
    reason: str
    drain_s: float


@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    """Anyone -> a process: send me your counters (``reset``: and start them again)."""

    KIND: ClassVar[str] = "statsreq"
    reset: bool


@dataclass(frozen=True, slots=True)
class ClusterStatsRequest(Message):
    """Client -> a frontend's client socket: a ``StatsReply`` with the frontend's stats and,
    under ``stats["cluster"][process name]``, those of the scheduler processes and backends it
    talks to (asked now, with ``reset``; ``stats["cluster_silent"]`` names those that did not
    answer in time)."""

    KIND: ClassVar[str] = "cstatsreq"
    reset: bool


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    """A process's counters and histograms (msgpack-native values only)."""

    KIND: ClassVar[str] = "stats"
    name: str
    stats: dict[str, Any]


ALL_MESSAGES: tuple[type[Message], ...] = (
    InferRequest,
    InferReply,
    InferError,
    ClientHello,
    InferAnswers,
    CancelRequest,
    RequestMetaBatch,
    DropNotice,
    CandidateUpdate,
    GrantGpu,
    GrantAnswer,
    BackendTable,
    BatchPlan,
    InputFetch,
    InputReply,
    BatchOutputs,
    BatchFailed,
    CancelFetched,
    BackendRegister,
    BatchStats,
    Hello,
    Ready,
    Heartbeat,
    Shutdown,
    StatsRequest,
    StatsReply,
    ClusterStatsRequest,
    ClockProbe,
    ClockReply,
)

MESSAGES_BY_KIND: dict[str, type[Message]] = {cls.KIND: cls for cls in ALL_MESSAGES}
