"""Every wire message of zserve, as a typed class.

This module is the wire contract between processes. Each message is a frozen ``msgspec.Struct``
(``array_like``, tagged with its ``KIND``) whose fields are msgpack-native (int, float, str,
bool, bytes, None, lists and str-keyed dicts of those) or numpy arrays. On the wire a message is
``[header, buf0, buf1, ...]``: the header is a msgpack array ``[KIND, field0, field1, ...]`` in
declaration order, with each array replaced by a descriptor naming its dtype, shape and either its
bytes (small arrays, inline) or the index of the frame that carries them (see
``zserve.transport.arrays`` and ``codec``). Decoding validates the kind, the arity, every field's
type and the lengths of parallel lists (``SAME_LENGTH``), and rejects anything else with
``zserve.core.errors.ProtocolError``. A changed copy of a message is ``msgspec.structs.replace``.

Conventions:
- Times (``*_at``, ``deadline``, ``arrival``) are float seconds on the *cluster clock*: the rank
  process's CLOCK_MONOTONIC. Every other process reads it as ``time.monotonic()`` plus its
  estimated offset (``zserve.runtime.clock``; exactly 0 on the rank's host). Durations carry their
  unit in the name (``slo_ms``). Exceptions, named for it: ``ClockProbe``/``ClockReply`` (how the
  offset is measured) and the ``Heartbeat`` on the supervisor's control link (host-local).
- ``request_id`` between client and frontend is the client's own id, unique per connection. From
  the frontend on, ``request_id`` is the frontend's global id, unique within that frontend and
  across its restarts (the high bits are the frontend process's incarnation:
  ``zserve.core.request_ids``); ``(frontend, request_id)`` is unique in the cluster.
- Error kinds travel as ``zserve.core.errors.ErrorKind`` values (strings).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import msgspec
import numpy as np

Array = np.ndarray[Any, Any]
TensorMap = dict[str, Array]


# gc=False: a message holds lists, dicts and arrays but never a reference cycle, so the cyclic
# collector need not track it (cheaper to build, msgspec's advice for such structs).
# 3: CandidateUpdate.shared; 4: BackendRegister.kind, BackendTable.kinds; 5: InferRequests;
# 6: BatchPlan.sent_at, PlanAck.ready_models / ready_delays / ready_rows (learned allowances);
# 7: BatchPlan.reply_allowance; 8: BatchStats.acked_plan_ids and ready_* (acknowledgements
# ride the batch report)
WIRE_PROTOCOL_VERSION = 8
"""The version of this module's wire messages, carried in every handshake (``HANDSHAKES``:
``ClientHello``, ``Hello``, ``BackendRegister``, ``Ready``); fields are only ever appended after
``protocol``. A receiver refuses a peer of another version with one line naming both
(``protocol_mismatch``): the receiving host when the handshake decodes, else the codec
(``zserve.core.errors.WireVersionError``: a later version's handshake with other fields, whose
``protocol`` still sits where this version has it). A peer from before the field sends one field
fewer and is refused as malformed by the arity check. Version 2: the rescue's fields of
``CandidateUpdate`` and ``GrantGpu``."""


def protocol_mismatch(peer: str, theirs: int) -> str | None:
    """The one-line refusal of ``peer`` speaking wire protocol ``theirs``; None if it matches."""
    if theirs == WIRE_PROTOCOL_VERSION:
        return None
    return (f"{peer} speaks wire protocol version {theirs}, this process speaks version "
            f"{WIRE_PROTOCOL_VERSION}: upgrade the older side")


class Message(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, gc=False):
    """Base class; ``KIND`` is the tag that leads the encoded header (each class's ``tag``).
    ``SAME_LENGTH`` names groups of fields that are parallel lists (struct of arrays): decoding
    refuses a message whose lists in one group differ in length."""

    KIND: ClassVar[str] = ""
    SAME_LENGTH: ClassVar[tuple[tuple[str, ...], ...]] = ()


# --------------------------------------------------------------------------- client <-> frontend


class InferRequest(Message, frozen=True, tag="infer"):
    """Client -> frontend: run ``model`` on ``inputs``. ``slo_ms`` 0 means the model's own SLO;
    a positive value may only tighten it."""

    request_id: int
    model: str
    inputs: TensorMap
    slo_ms: float = 0.0


class InferRequests(Message, frozen=True, tag="infers"):
    """Client -> frontend: several requests in one message, as parallel lists (struct of
    arrays): request ``request_ids[i]`` runs ``models[i]`` on ``inputs[i]`` with ``slo_ms[i]``,
    each exactly as the ``InferRequest`` of those fields would (admitted, refused and answered
    one by one). A client that has several requests to send at once (an open-loop generator's
    due sends) sends them in one message: one receive, one decode and one wake-up of the
    frontend instead of one per request."""

    SAME_LENGTH: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("request_ids", "models", "inputs", "slo_ms"),
    )
    request_ids: list[int]
    models: list[str]
    inputs: list[TensorMap]
    slo_ms: list[float]

    def requests(self) -> list[InferRequest]:
        """The requests it carries, each as its own ``InferRequest`` (in order)."""
        return [InferRequest(rid, model, tensors, slo) for rid, model, tensors, slo in zip(
            self.request_ids, self.models, self.inputs, self.slo_ms, strict=True)]


class InferReply(Message, frozen=True, tag="reply"):
    """Frontend -> client: the outputs of one request."""

    request_id: int
    outputs: TensorMap


class InferError(Message, frozen=True, tag="error"):
    """Frontend -> client: the terminal error of one request (``error`` is an ErrorKind)."""

    request_id: int
    error: str
    message: str


class ClientHello(Message, frozen=True, tag="chello"):
    """Client -> frontend, first on a connection: the optional message kinds this client decodes
    beyond ``InferReply`` and ``InferError`` (today only ``InferAnswers.KIND``). A client that
    never sends one is answered with one message per request."""

    accepts: list[str]
    protocol: int = WIRE_PROTOCOL_VERSION


class InferAnswers(Message, frozen=True, tag="answers"):
    """Frontend -> a client that accepts this kind (``ClientHello``): the terminal answers of
    several of its requests, produced in one event-loop tick (typically one batch's outputs), in
    one message instead of one per request. ``request_ids[i]`` is answered with ``outputs[i]``
    (as by ``InferReply``), ``error_ids[i]`` with the error ``errors[i]``, ``messages[i]`` (as by
    ``InferError``); each request id appears once."""

    SAME_LENGTH: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("request_ids", "outputs"),
        ("error_ids", "errors", "messages"),
    )
    request_ids: list[int]
    outputs: list[TensorMap]
    error_ids: list[int]
    errors: list[str]
    messages: list[str]


class CancelRequest(Message, frozen=True, tag="cancel"):
    """Client -> frontend: cancel a request if it has not started executing."""

    request_id: int


# --------------------------------------------------------------------------- frontend <-> shard


class RequestMetaBatch(Message, frozen=True, tag="meta"):
    """Frontend -> owning scheduler shard: the metadata of the requests admitted in one event-loop
    tick, as parallel lists (struct of arrays: one message and no per-request objects).
    ``frontend`` is the frontend's ``data`` address (what a BatchPlan lists in ``frontends``);
    DropNotices go back to the DEALER identity the message came from."""

    frontend: str
    request_ids: list[int]
    models: list[str]
    arrivals: list[float]
    deadlines: list[float]
    # Each request's rows (the leading dimension of its inputs, 1..the model's max batch).
    # Empty: every request holds one row (the common case costs one byte per message, nothing
    # per request); otherwise exactly one entry per request (a shard refuses another length).
    rows: list[int] = msgspec.field(default_factory=list)
    # The newest scheduler epoch the frontend had heard of when it sent this: a scheduler of a
    # newer epoch ignores it, since the frontend re-sends what is still queued on hearing that
    # epoch (messages queued for a dead scheduler must not be planned twice).
    epoch: int = 0


class CancelQueued(Message, frozen=True, tag="qcancel"):
    """Frontend -> owning scheduler shard: these requests of ``frontend`` (its ``data`` address,
    as in RequestMetaBatch) were cancelled or their client left before any backend fetched
    them; ``models[i]`` is the model of ``request_ids[i]``. One per shard per tick, sent after
    that tick's RequestMetaBatch. The shard removes the ones still queued; a request already in
    a sent plan finds no inputs at fetch time."""

    frontend: str
    request_ids: list[int]
    models: list[str]


class DropNotice(Message, frozen=True, tag="drop"):
    """Shard -> frontend: these requests were dropped by the scheduler and get ``error``."""

    request_ids: list[int]
    error: str
    message: str


# --------------------------------------------------------------------------- shard <-> rank


class CandidateUpdate(Message, frozen=True, tag="cand"):
    """Shard -> rank: a model's current batch candidate (latest value wins).
    ``batch_size`` 0 withdraws the candidate. ``send_delay`` is d_ctrl + d_data * batch_size.
    ``duration`` is l(batch_size), what the batch holds a GPU for; ``early_ok``: the candidate is
    deferring by choice, and the rank may start it before ``exec_at`` on an idle GPU when waiting
    would lose its grant window (``deferred``, zserve.scheduler.policy). ``shared``: the
    model shares its GPUs with other models, so a candidate of it that finds every GPU busy at
    its exec time is contention (a staggered model's is its stagger at work). ``aim_at``: where a
    candidate that starts at once by choice (``exec_at`` before it) would have aimed had it
    deferred, the moment the rank may hold it back to while it would take the last free GPU from
    a tighter model (0: it does not start early by choice). ``lone_wait_s``: how long a lone
    request of the model can wait for a GPU (its budget less l(1) and delay(1)), the rank's measure
    of how tight the model is."""

    model: str
    batch_size: int
    exec_at: float
    latest: float
    send_delay: float
    duration: float = 0.0
    early_ok: bool = False
    shared: bool = False
    aim_at: float = 0.0
    lone_wait_s: float = math.inf


class GrantGpu(Message, frozen=True, tag="grant"):
    """Rank -> shard: ``gpu_id`` is granted to ``model``'s candidate. ``free_at`` is when that GPU
    becomes free. The rank ignores the model's candidates until it gets a GrantAnswer."""

    model: str
    gpu_id: int
    grant_id: int
    free_at: float
    # The scheduler epoch of the rank that granted (``zserve.core.epochs``).
    epoch: int = 0
    # Granted before the candidate's exec time (a rescue): the batch starts as soon as it can.
    early: bool = False


class GrantAnswer(Message, frozen=True, tag="gans"):
    """Shard -> rank: the answer to a grant. ``used`` False returns the GPU untouched (the queue
    emptied meanwhile); otherwise the GPU is busy until ``free_at``. Also resumes candidates."""

    model: str
    gpu_id: int
    grant_id: int
    used: bool
    free_at: float


class BackendTable(Message, frozen=True, tag="btable"):
    """Rank -> shards (and frontends): the backends that exist, by GPU id, with the address at
    which each one's plan socket listens and the models it serves. Sent whenever it changes."""

    gpu_ids: list[int]
    names: list[str]
    addresses: list[str]
    models: list[list[str]]
    # Per backend, what it registered: ``profiles_ms[i][model][b-1]`` is l(b) in ms on backend i.
    profiles_ms: list[dict[str, list[float]]] = msgspec.field(default_factory=list)
    # Per backend, the signatures it registered: ``signatures[i][model]`` is the wire form of the
    # model's ``zserve.config.signature.ModelSignature`` (frontends validate requests against it).
    signatures: list[dict[str, dict[str, Any]]] = msgspec.field(default_factory=list)
    # The scheduler epoch of the rank that sent it: a frontend ignores a table of an older
    # epoch than the newest it has seen (``zserve.core.epochs``).
    epoch: int = 0
    # Per backend, the device kind it announced ("a100"; "": none): a shard plans a model on a
    # GPU with the profile that GPU's kind registered (``zserve.scheduler.kind_profiles``).
    kinds: list[str] = msgspec.field(default_factory=list)


# --------------------------------------------------------------------------- shard -> backend


class BatchPlan(Message, frozen=True, tag="plan"):
    """Shard -> backend: run one batch of ``model`` at ``exec_at`` on ``gpu_id``. Request i lives
    on frontend ``frontends[request_frontend[i]]`` (a frontend address). ``finish_by[i]`` is the
    time by which request i's batch must finish for it to be answered within its SLO (its
    scheduler deadline: arrival + SLO - reply allowance); the backend leaves out requests a late
    batch can no longer finish in time. Empty: unknown (nothing is left out); otherwise exactly
    one entry per request (a backend refuses a plan whose list has another length)."""

    plan_id: int
    model: str
    gpu_id: int
    exec_at: float
    expected_finish_at: float
    frontends: list[str]
    request_frontend: list[int]
    request_ids: list[int]
    finish_by: list[float] = msgspec.field(default_factory=list)
    # Each request's rows, as in RequestMetaBatch (empty: one each). The batch holds their sum,
    # at most the model's max batch; its l(b) and late shedding count rows.
    rows: list[int] = msgspec.field(default_factory=list)
    # The scheduler epoch that made the plan: a backend that has seen a newer epoch refuses it
    # (``zserve.core.epochs``: a superseded scheduler never dispatches).
    epoch: int = 0
    # When the shard made (and sent) it, on the cluster clock; 0: not said. The backend reports
    # the plan's ready delay from it (``PlanAck.ready_delays``).
    sent_at: float = 0.0
    # The reply allowance ``finish_by`` was planned with (seconds; the learned one under
    # learned allowances); 0: not said. The backend's late shedding keeps a row finishing at
    # most ``SHED_GRACE_FRACTION`` of it past its ``finish_by``, so a learned allowance smaller
    # than the configured one is not overrun by the configured one's grace.
    reply_allowance: float = 0.0


# --------------------------------------------------------------------------- backend <-> frontend


class InputFetch(Message, frozen=True, tag="fetch"):
    """Backend -> frontend: send me the inputs of these requests of one plan."""

    plan_id: int
    request_ids: list[int]


class InputReply(Message, frozen=True, tag="inputs"):
    """Frontend -> backend: the inputs of the requests it still holds, one TensorMap each, and the
    ids it no longer holds (cancelled, already answered) which the backend leaves out."""

    plan_id: int
    request_ids: list[int]
    inputs: list[TensorMap]
    missing: list[int]


class BatchOutputs(Message, frozen=True, tag="outputs"):
    """Backend -> frontend: the outputs of this frontend's requests of one batch."""

    plan_id: int
    request_ids: list[int]
    outputs: list[TensorMap]
    # When the batch started and finished on the backend (monotonic seconds; 0: not reported):
    # the frontend's queueing delay is started_at - arrival, execution finished_at - started_at.
    started_at: float = 0.0
    finished_at: float = 0.0


class BatchFailed(Message, frozen=True, tag="bfail"):
    """Backend -> frontend: these requests of one batch failed with ``error``."""

    plan_id: int
    request_ids: list[int]
    error: str
    message: str


class CancelFetched(Message, frozen=True, tag="fcancel"):
    """Frontend -> the backend that fetched them (over the frontend's ``data`` ROUTER): these
    requests were cancelled or their client disconnected. ``plan_ids[i]`` is the plan whose
    fetch took ``request_ids[i]``. The backend leaves them out of the batch if it has not
    started; a started batch runs, and the frontend discards those outputs."""

    plan_ids: list[int]
    request_ids: list[int]


# --------------------------------------------------------------------------- backend -> scheduler


class BackendRegister(Message, frozen=True, tag="breg"):
    """Backend -> rank: this backend exists. ``profiles_ms[model][b-1]`` is l(b) in milliseconds
    for b = 1..max batch; ``plan_address`` is where its plan socket can be reached."""

    name: str
    device: str
    plan_address: str
    models: list[str]
    profiles_ms: dict[str, list[float]]
    # model -> the wire form of its ``zserve.config.signature.ModelSignature`` (``to_dict``), for
    # the frontends' request validation; a model it could not read has none.
    signatures: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    protocol: int = WIRE_PROTOCOL_VERSION
    # When the backend's device frees (cluster clock; 0: free now): a scheduler that takes
    # over rebuilds each GPU's free time from it.
    device_free_at: float = 0.0
    # Released by the autoscaler (``RetireBackend``): a rank grants it nothing new. Said in
    # every registration, so a standby that takes over mid-release learns it too.
    retiring: bool = False
    # Its device kind (``[backends] kind`` / ``kinds``; "": none announced).
    kind: str = ""


class BatchStats(Message, frozen=True, tag="bstats"):
    """Backend -> scheduler: what happened to one plan (for reports and lateness accounting),
    to the shard that sent the plan (over the backend's ``plan`` ROUTER: a batch that ran tells
    its ModelThread when it ended, ``zserve.scheduler.policy.AnswerEchoes``) and to the rank. A
    scheduler process that hosts both (``shards = 0``) gets it once, on the plan socket, and its
    shard hands it to its rank."""

    SAME_LENGTH: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("ready_models", "ready_delays", "ready_rows"),
    )

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
    # Plans of this shard acknowledged with this report, and the ready-delay samples, as a
    # ``PlanAck`` would carry them (``zserve.backends.held_acks``: a backend holds a plan's
    # acknowledgement briefly for its next report to that shard). Empty in the rank's copy.
    acked_plan_ids: list[int] = msgspec.field(default_factory=list)
    ready_models: list[str] = msgspec.field(default_factory=list)
    ready_delays: list[float] = msgspec.field(default_factory=list)
    ready_rows: list[int] = msgspec.field(default_factory=list)


# --------------------------------------------------------------------------- lifecycle


class Hello(Message, frozen=True, tag="hello"):
    """Any process -> its peer on connect. ``epoch``: from a scheduler process, the epoch in
    which it is active (0: a standby); from any other process, the newest scheduler epoch it has
    seen (``zserve.core.epochs``)."""

    role: str
    name: str
    pid: int
    protocol: int = WIRE_PROTOCOL_VERSION
    epoch: int = 0


class BackendGone(Message, frozen=True, tag="bgone"):
    """Supervisor -> the rank's host and every frontend (control link): backend ``name``'s
    process died. Its requests are answered BACKEND_FAILED now rather than at their deadlines."""

    name: str


class RetireBackend(Message, frozen=True, tag="retire"):
    """Supervisor -> the rank's hosts and the backend itself (control links): the autoscaler
    releases backend ``name``. The rank grants its GPU nothing new but keeps it in the table, so
    the plans it already holds run and are answered; the supervisor stops the process once it
    holds none (a plain drain would answer new plans SHUTTING_DOWN, ``BackendGone`` would fail
    those it holds). The backend registers again saying it is ``retiring``, and says so to every
    rank it registers with later: a standby that takes over mid-release grants it nothing."""

    name: str


class Ready(Message, frozen=True, tag="ready"):
    """Child -> supervisor: sockets bound and models loaded; ``endpoints`` names what it serves."""

    role: str
    name: str
    pid: int
    endpoints: dict[str, str]
    protocol: int = WIRE_PROTOCOL_VERSION


class Heartbeat(Message, frozen=True, tag="hb"):
    """A process -> its supervisor (control link; ``sent_at`` host-local) and backends and shards
    -> the rank (``sent_at`` on the cluster clock). Informational: receivers time liveness by
    arrival."""

    name: str
    seq: int
    sent_at: float
    # To a scheduler: the newest scheduler epoch the sender has seen (a superseded scheduler
    # that hears a newer one steps down; ``zserve.core.epochs``).
    epoch: int = 0


class ClockProbe(Message, frozen=True, tag="clkprobe"):
    """Any process -> the rank (over its own DEALER, identity ``<name>.clock``): a clock sample
    request. The sender keeps its local send time under ``seq``."""

    seq: int


class ClockReply(Message, frozen=True, tag="clkreply"):
    """Rank -> the prober: ``rank_time`` is the rank's CLOCK_MONOTONIC (the cluster clock) read
    while answering probe ``seq``; ``rank_host`` identifies the rank's clock (boot id and time
    namespace, ``zserve.runtime.clock.host_identity``): a prober with the same one shares the
    clock."""

    seq: int
    rank_time: float
    rank_host: str


class Shutdown(Message, frozen=True, tag="shutdown"):
    """Supervisor -> child: drain (stop admitting, finish in flight up to ``drain_s``) and exit."""

    reason: str
    drain_s: float


class StatsRequest(Message, frozen=True, tag="statsreq"):
    """Anyone -> a process: send me your counters (``reset``: and start them again)."""

    reset: bool


class ClusterStatsRequest(Message, frozen=True, tag="cstatsreq"):
    """Client -> a frontend's client socket: a ``StatsReply`` with the frontend's stats and,
    under ``stats["cluster"][process name]``, those of the scheduler processes and backends it
    talks to (asked now, with ``reset``; ``stats["cluster_silent"]`` names those that did not
    answer in time)."""

    reset: bool


class StatsReply(Message, frozen=True, tag="stats"):
    """A process's counters and histograms (msgpack-native values only)."""

    name: str
    stats: dict[str, Any]


# --------------------------------------------------------------------------- plan acknowledgement


class PlanAck(Message, frozen=True, tag="pack"):
    """Backend -> the shard that sent these plans (over the backend's ``plan`` ROUTER): its batch
    loop received them, the first at ``received_at`` (cluster clock). Sent from the loop that
    starts the batches, so a stopped or wedged backend sends none: with its next ``BatchStats``
    to that shard (``BatchStats.acked_plan_ids``), or alone once the first was held
    ``zserve.backends.held_acks.ACK_HOLD_S``. A plan not acknowledged within its delivery
    allowance (``d_ctrl``) plus ``zserve.scheduler.sent_plans.PLAN_ACK_MARGIN_S`` makes the
    shard suspect the backend (``BackendSuspect``) and plan the requests of every plan the
    backend has not acknowledged again."""

    SAME_LENGTH: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("ready_models", "ready_delays", "ready_rows"),
    )
    plan_ids: list[int]
    received_at: float
    # Started batches since the last acknowledgement: each one's model, the delay from its plan's
    # ``sent_at`` to its last input's arrival, and its rows; the shard learns its ``d_ctrl`` from
    # them (``zserve.scheduler.learned_allowances``). Each sample goes to the shard that sent
    # the newest plan of its model (``zserve.backends.ready_routing``).
    ready_models: list[str] = msgspec.field(default_factory=list)
    ready_delays: list[float] = msgspec.field(default_factory=list)
    ready_rows: list[int] = msgspec.field(default_factory=list)


class BackendSuspect(Message, frozen=True, tag="bsuspect"):
    """Shard -> rank: the backend of ``gpu_id`` did not acknowledge plan ``plan_id``, sent at
    ``sent_at`` (cluster clock), within its allowance. The rank stops granting the GPU and
    broadcasts the table without it, as for a removal; a heartbeat the backend sends after the
    rank heard this brings it back."""

    gpu_id: int
    plan_id: int
    sent_at: float
    message: str


class SchedulerPing(Message, frozen=True, tag="sping"):
    """Scheduler process -> the other scheduler process of an active/standby pair (to its
    ``rank`` ROUTER), every ``zserve.core.epochs.PING_INTERVAL_S``: ``name`` is alive and, when
    ``active``, dispatches in ``epoch``. The receiver answers each on the same connection with
    its own (``reply`` True; a reply is not answered), so each process hears its partner over
    the connection it made itself. A standby takes over once the active one stops answering,
    and an active one that hears a newer epoch steps down (``zserve.core.epochs``)."""

    name: str
    epoch: int
    active: bool
    reply: bool = False


# --------------------------------------------------------------------------- orchestration


class LoadModel(Message, frozen=True, tag="mload"):
    """Supervisor -> backend (control link): load ``model``, whose ``config`` is the wire form of
    its ``zserve.config.cluster.ModelConfig`` (``to_dict``), and warm it at every batch size;
    with ``announce``, then announce it to the rank (``BackendRegister`` listing it) and report
    ``ModelReport`` READY, else report WARM and hold it unannounced until a ``LoadModel`` with
    ``announce`` (the supervisor's two phases: every backend warm, then all announce). A model
    it serves already is reported READY again."""

    model: str
    config: dict[str, Any]
    announce: bool = True


class UnloadModel(Message, frozen=True, tag="munload"):
    """Supervisor -> backend (control link): stop serving ``model``: withdraw it from the rank
    (``BackendRegister`` without it), let the plans of it already sent finish, then close its
    sessions, free their memory and report ``ModelReport`` (UNAVAILABLE)."""

    model: str


class ModelReport(Message, frozen=True, tag="mreport"):
    """Backend -> supervisor (control link): ``model`` is now ``state`` on backend ``name``:
    ``READY`` (loaded, warmed and announced to the rank), ``WARM`` (loaded and warmed, not
    announced), ``UNAVAILABLE`` (unloaded, its memory freed) or ``FAILED`` (the load failed;
    ``message`` says why)."""

    name: str
    model: str
    state: str
    message: str = ""


class RepositoryRequest(Message, frozen=True, tag="repo"):
    """Frontend -> supervisor (control link): a call of the Open Inference Protocol's model
    repository extension. ``action``: ``index``, ``load`` or ``unload`` (of ``model``); the
    answer is one ``RepositoryReply`` with the same ``request_id``, once the call is done (a
    load: the model READY on its backends)."""

    request_id: int
    action: str
    model: str = ""


class RepositoryReply(Message, frozen=True, tag="reporeply"):
    """Supervisor -> frontend: the answer to ``RepositoryRequest`` ``request_id``. ``error``: ""
    when it succeeded, else an ErrorKind value with ``message``. An index lists every model of
    the repository: ``models[i]`` is in state ``states[i]`` (READY, LOADING, UNLOADING,
    UNAVAILABLE) for ``reasons[i]`` (empty when READY)."""

    SAME_LENGTH: ClassVar[tuple[tuple[str, ...], ...]] = (("models", "states", "reasons"),)
    request_id: int
    error: str
    message: str
    models: list[str] = msgspec.field(default_factory=list)
    states: list[str] = msgspec.field(default_factory=list)
    reasons: list[str] = msgspec.field(default_factory=list)


class ModelUsage(Message, frozen=True, tag="musage"):
    """Frontend -> supervisor (control link), for the orchestrator: ``requests`` it admitted per
    model since its last report; ``waiting``: the requests it holds now, per model, for a model
    no backend serves (an on-demand load); ``pending``: its requests admitted and not yet
    answered, per model (a model with some is in use). The last two are whole counts."""

    name: str
    requests: dict[str, int]
    waiting: dict[str, int]
    pending: dict[str, int] = msgspec.field(default_factory=dict)


class ModelAdded(Message, frozen=True, tag="madded"):
    """Supervisor -> every frontend and scheduler process (control link): a model found in the
    repository folder after start (a rescan, on a repository index or load). ``config``: the
    wire form of its ``ModelConfig``; a frontend admits it from now on (refused UNAVAILABLE
    until a backend serves it), a scheduler process that owns it schedules it once a backend
    registers it. A model known already is ignored."""

    config: dict[str, Any]


class ModelUnservable(Message, frozen=True, tag="munserv"):
    """Supervisor -> every frontend (control link): the orchestrator cannot load ``model`` on
    demand now (its load failed, or it fits on no backend). A frontend answers the requests it
    holds for the model ``UNAVAILABLE`` with ``reason`` at once, rather than at their deadlines;
    a later request is held again (the orchestrator tries again while demand remains)."""

    model: str
    reason: str


ALL_MESSAGES: tuple[type[Message], ...] = (
    InferRequest,
    InferRequests,
    InferReply,
    InferError,
    ClientHello,
    InferAnswers,
    CancelRequest,
    RequestMetaBatch,
    CancelQueued,
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
    BackendGone,
    RetireBackend,
    Ready,
    Heartbeat,
    Shutdown,
    StatsRequest,
    StatsReply,
    ClusterStatsRequest,
    ClockProbe,
    ClockReply,
    PlanAck,
    BackendSuspect,
    SchedulerPing,
    LoadModel,
    UnloadModel,
    ModelReport,
    RepositoryRequest,
    RepositoryReply,
    ModelUsage,
    ModelAdded,
    ModelUnservable,
)

# KIND is each class's msgspec tag, read back once here so that the tag is written only once.
for _cls in ALL_MESSAGES:
    _cls.KIND = _cls.__struct_config__.tag  # type: ignore[assignment]
del _cls

HANDSHAKES: tuple[type[Message], ...] = (ClientHello, Hello, BackendRegister, Ready)
"""The messages that open a conversation and carry ``protocol`` (``WIRE_PROTOCOL_VERSION``)."""

MESSAGES_BY_KIND: dict[str, type[Message]] = {cls.KIND: cls for cls in ALL_MESSAGES}
