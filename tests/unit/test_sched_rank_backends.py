"""RankBackends alone, with a real RankThread and no sockets, loop or clock: GPU ids by
configured index, a standby that only notes who registered, suspicion and revival by heartbeat,
expiry of silent backends, a death announced, and what the table says."""

from __future__ import annotations

from zserve.core.hosting import DEST_MODEL, Outbox
from zserve.scheduler.rank_backends import (
    BACKEND_COUNTERS,
    RankBackends,
    configured_backend_index,
)
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import (
    WIRE_PROTOCOL_VERSION,
    BackendRegister,
    BackendSuspect,
    CandidateUpdate,
    GrantGpu,
)

TIMEOUT_S = 2.0


def _register(name: str, *, protocol: int = WIRE_PROTOCOL_VERSION,
              device_free_at: float = 0.0, retiring: bool = False) -> BackendRegister:
    return BackendRegister(name=name, device="emulated", plan_address=f"ipc://{name}.plan",
                           models=["m"], profiles_ms={"m": [1.0, 2.0]}, protocol=protocol,
                           device_free_at=device_free_at, retiring=retiring)


def _table() -> tuple[RankBackends, RankThread, dict[str, int]]:
    rank = RankThread([], 0.0)
    counters: dict[str, int] = {}
    return RankBackends(rank, counters, name="rank", timeout_s=TIMEOUT_S), rank, counters


def test_gpu_ids_are_the_configured_indexes_whatever_the_registration_order() -> None:
    backends, rank, counters = _table()
    assert set(BACKEND_COUNTERS) <= set(counters)
    outbox: Outbox = []
    for name in ("backend-2", "backend-0", "odd-name"):
        assert backends.on_register(1.0, name.encode(), _register(name), outbox, active=True)
    table = backends.table(epoch=7)
    assert (table.gpu_ids, table.names, table.epoch) == (
        [0, 1, 2], ["backend-0", "odd-name", "backend-2"], 7)
    assert table.addresses[0] == "ipc://backend-0.plan"
    assert rank.gpu_ids == [0, 1, 2]
    assert counters["registrations"] == 3
    # a backend that registers again keeps its id
    assert backends.on_register(2.0, b"backend-2", _register("backend-2"), outbox, active=True)
    assert rank.gpu_ids == [0, 1, 2] and backends.table(7).gpu_ids == [0, 1, 2]
    assert configured_backend_index("backend-12") == 12
    assert configured_backend_index("frontend-1") is None


def test_a_standby_notes_who_registered_and_a_wrong_protocol_is_refused() -> None:
    backends, rank, counters = _table()
    outbox: Outbox = []
    assert not backends.on_register(1.0, b"backend-0", _register("backend-0"), outbox,
                                    active=False)
    assert b"backend-0" in backends.identities and rank.gpu_ids == []
    assert counters["standby_ignored"] == 1
    older = _register("backend-1", protocol=WIRE_PROTOCOL_VERSION - 1)
    assert not backends.on_register(1.0, b"backend-1", older, outbox, active=True)
    assert counters["bad_messages"] == 1 and b"backend-1" not in backends.identities
    backends.on_hello(b"backend-3")
    assert b"backend-3" in backends.identities


def test_a_suspect_gpu_is_taken_out_until_a_heartbeat_sent_after_the_suspicion() -> None:
    backends, rank, counters = _table()
    outbox: Outbox = []
    backends.on_register(1.0, b"backend-0", _register("backend-0"), outbox, active=True)
    # a plan sent before the registration says nothing about this registration
    stale = BackendSuspect(gpu_id=0, plan_id=1, sent_at=0.5, message="no ack")
    assert not backends.on_suspect(2.0, stale, outbox)
    suspect = BackendSuspect(gpu_id=0, plan_id=2, sent_at=1.5, message="no ack")
    assert backends.on_suspect(2.0, suspect, outbox)
    assert rank.gpu_ids == [] and backends.table(1).gpu_ids == []
    assert backends.stats()["0"] == {"name": "backend-0", "alive": False,
                                     "device": "emulated", "kind": "",
                                     "suspect": True, "retired": False}
    assert not backends.on_suspect(2.1, suspect, outbox)  # out already: nothing changes
    # a heartbeat sent before the suspicion (arriving after it) does not bring it back
    assert backends.on_heartbeat(2.2, b"backend-0", 1.9, outbox) is False
    assert backends.on_heartbeat(2.3, b"backend-0", 2.1, outbox) is True
    assert rank.gpu_ids == [0] and counters["suspects"] == counters["revivals"] == 1
    assert backends.on_heartbeat(2.4, b"stranger", 2.4, outbox) is None


def test_a_stall_of_the_rank_is_credited_to_the_backends_and_a_silent_one_still_goes() -> None:
    """The rank's loop ran 2 s late (a loaded host: its backends were stalled with it): the
    stall is credited before the silence is judged, so neither backend is removed for it; the
    one whose heartbeats then come stays, the other is removed once silent for the timeout on
    the rank's running time."""
    backends, rank, _ = _table()
    outbox: Outbox = []
    backends.on_register(0.0, b"backend-0", _register("backend-0"), outbox, active=True)
    backends.on_register(0.0, b"backend-1", _register("backend-1"), outbox, active=True)
    assert not backends.expire(2.1, outbox, stalled_s=2.0)  # last seen at 0.0, 2.1 s ago
    backends.on_heartbeat(2.2, b"backend-0", 2.2, outbox)
    assert not backends.expire(2.0 + TIMEOUT_S, outbox)  # backend-1 credited to 2.0
    backends.on_heartbeat(3.5, b"backend-0", 3.5, outbox)
    assert backends.expire(2.0 + TIMEOUT_S + 0.1, outbox)
    assert backends.alive_names() == {"backend-0"} and rank.gpu_ids == [0]


def test_a_silent_backend_expires_and_a_dead_one_goes_at_once() -> None:
    backends, rank, counters = _table()
    outbox: Outbox = []
    backends.on_register(0.0, b"backend-0", _register("backend-0"), outbox, active=True)
    backends.on_register(0.0, b"backend-1", _register("backend-1"), outbox, active=True)
    assert backends.check_interval_s == TIMEOUT_S / 4
    backends.on_heartbeat(1.5, b"backend-1", 1.5, outbox)
    assert not backends.expire(TIMEOUT_S, outbox)  # silent for exactly the timeout: kept
    assert backends.expire(TIMEOUT_S + 0.1, outbox)
    assert rank.gpu_ids == [1] and backends.alive_names() == {"backend-1"}
    assert backends.on_gone(2.5, "backend-1", outbox)
    assert not backends.on_gone(2.5, "backend-1", outbox)
    assert rank.gpu_ids == [] and counters["removals"] == 2
    assert counters["deaths_announced"] == 1
    # a removed backend comes back with its next heartbeat, not as a suspect
    assert backends.on_heartbeat(3.0, b"backend-0", 3.0, outbox) is True
    assert counters["revivals"] == 0 and rank.gpu_ids == [0]


def test_a_registering_gpu_busy_with_an_older_epochs_plans_is_granted_from_its_free_time() -> None:
    backends, rank, _ = _table()
    outbox: Outbox = []
    backends.on_register(1.0, b"backend-0", _register("backend-0", device_free_at=1.5), outbox,
                         active=True)
    assert rank.gpu_free_at(0) == 1.5
    # drift reports count only from the connection that holds the GPU
    backends.on_device_free_at(1.1, b"impostor", 0, 3.0, outbox)
    assert rank.gpu_free_at(0) == 1.5
    backends.on_device_free_at(1.1, b"backend-0", 0, 2.0, outbox)
    assert rank.gpu_free_at(0) == 2.0
    # the GPU it added is the RankThread's to grant
    rank.on_candidate(2.0, CandidateUpdate("m", 1, 2.0, 3.0, 0.0), outbox)
    rank.on_timer(2.0, outbox)
    assert [(dest, type(msg)) for dest, msg in outbox] == [((DEST_MODEL, "m"), GrantGpu)]


def test_a_retired_backend_keeps_its_table_entry_but_gets_no_grants_until_it_exits() -> None:
    """The autoscaler's release (``RetireBackend``): the GPU leaves the RankThread at once, the
    table (what shards and frontends hold plans against) keeps it, heartbeats do not bring it
    back; its exit removes it, and a new backend of the same name is granted again."""
    backends, rank, counters = _table()
    outbox: Outbox = []
    for name in ("backend-0", "backend-1"):
        backends.on_register(1.0, name.encode(), _register(name), outbox, active=True)
    assert backends.on_retire(2.0, "backend-1", outbox)
    assert not backends.on_retire(2.0, "backend-1", outbox)  # once
    assert not backends.on_retire(2.0, "backend-7", outbox)  # not in the table
    assert rank.gpu_ids == [0] and backends.table(1).names == ["backend-0", "backend-1"]
    assert counters["retirements"] == 1
    assert backends.on_heartbeat(2.5, b"backend-1", 2.4, outbox) is False
    backends.on_register(2.6, b"backend-1", _register("backend-1"), outbox, active=True)
    assert rank.gpu_ids == [0]  # a registration again (a model loaded) is no way back
    assert backends.on_gone(3.0, "backend-1", outbox)
    assert rank.gpu_ids == [0] and backends.table(1).names == ["backend-0"]
    backends.on_register(4.0, b"backend-1", _register("backend-1"), outbox, active=True)
    assert rank.gpu_ids == [0, 1] and backends.table(1).names == ["backend-0", "backend-1"]


def test_a_backend_that_registers_as_retiring_is_in_the_table_but_never_granted() -> None:
    """A rank that took over (or restarted) mid-release knows the release only from the
    backend: its registration says ``retiring``. The GPU is in the table (its plans of the old
    epoch are answered) but not the RankThread's, also when it is busy, suspected and revived;
    a backend already granted that registers as retiring leaves the RankThread at once."""
    backends, rank, counters = _table()
    outbox: Outbox = []
    backends.on_register(1.0, b"backend-0", _register("backend-0"), outbox, active=True)
    assert backends.on_register(1.0, b"backend-1",
                                _register("backend-1", retiring=True, device_free_at=1.5),
                                outbox, active=True)
    assert rank.gpu_ids == [0] and backends.table(1).names == ["backend-0", "backend-1"]
    assert counters["retirements"] == 1
    suspect = BackendSuspect(gpu_id=1, plan_id=1, sent_at=1.2, message="no ack")
    assert backends.on_suspect(2.0, suspect, outbox)
    assert backends.on_heartbeat(2.5, b"backend-1", 2.4, outbox) is True
    assert rank.gpu_ids == [0]  # back in the table, still not granted
    assert not backends.on_retire(2.6, "backend-1", outbox)  # retired already
    # backend-0 hears the supervisor's RetireBackend before this rank does
    backends.on_register(3.0, b"backend-0", _register("backend-0", retiring=True), outbox,
                         active=True)
    assert rank.gpu_ids == [] and counters["retirements"] == 2
    rank.on_candidate(3.0, CandidateUpdate("m", 1, 3.0, 4.0, 0.0), outbox)
    rank.on_timer(3.0, outbox)
    assert not [msg for _, msg in outbox if isinstance(msg, GrantGpu)]


def test_a_backend_that_withdraws_every_model_is_granted_nothing_until_it_serves_again() -> None:
    """A backend about to drain registers without models: the matching (GPUs, not models)
    must not offer its idle GPU 0 ahead of GPU 1, which serves the model."""
    backends, rank, _ = _table()
    outbox: Outbox = []
    for name in ("backend-0", "backend-1"):
        backends.on_register(1.0, name.encode(), _register(name), outbox, active=True)
    withdrawn = BackendRegister(name="backend-0", device="emulated",
                                plan_address="ipc://backend-0.plan", models=[], profiles_ms={})
    backends.on_register(2.0, b"backend-0", withdrawn, outbox, active=True)
    # the rank keeps GPU 0 but matches it to no model (per-model membership: no pool has it)
    assert rank.gpu_ids == [0, 1]
    assert backends.table(1).gpu_ids == [0, 1]  # still listed (alive), serving nothing
    assert backends.table(1).models[0] == []
    outbox.clear()
    rank.on_candidate(2.0, CandidateUpdate("m", 1, 2.0, 3.0, 0.0), outbox)
    assert [msg.gpu_id for _, msg in outbox if isinstance(msg, GrantGpu)] == [1]
    backends.on_register(3.0, b"backend-0", _register("backend-0"), outbox, active=True)
    assert rank.gpu_ids == [0, 1]  # serves again: matched again
    backends.expire(10.0, outbox)  # both silent: removed, whether matched or not
    assert rank.gpu_ids == [] and backends.table(1).gpu_ids == []
