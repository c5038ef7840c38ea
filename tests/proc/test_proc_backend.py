"""The backend process as a plan follower: real process, real sockets, the test plays the
supervisor, the rank, a shard (plans) and a frontend (inputs and outputs)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from proc_harness import Child, Harness, Peer, cluster_config, role_config_for

from zserve.backends.follower import BACKEND_HISTOGRAMS
from zserve.backends.host import BusyMeter
from zserve.core.errors import ErrorKind
from zserve.core.request_ids import INCARNATION_SHIFT
from zserve.core.stats import merge_snapshots
from zserve.transport.messages import (
    BackendRegister,
    BatchFailed,
    BatchOutputs,
    BatchPlan,
    BatchStats,
    Heartbeat,
    Hello,
    InputFetch,
    InputReply,
    Ready,
    StatsReply,
    StatsRequest,
)

ALPHA_MS = 2.0
BETA_MS = 20.0  # l(b) = 2b + 20 ms: long enough that overlapping plans really overlap
MAX_BATCH = 8
MODEL = "emu"
ROW_FLOATS = 8192  # 32 KiB rows: staged (zserve.backends.staging.STAGING_MIN_ROW_BYTES)
FRONTEND = "frontend-0"


class BackendRig:
    """A started backend with the test's rank, shard and frontend sockets."""

    def __init__(self, h: Harness, child: Child, *, rank: Peer, shard: Peer, frontend: Peer,
                 register: BackendRegister) -> None:
        self.h = h
        self.child = child
        self.rank = rank
        self.shard = shard
        self.frontend = frontend
        self.register = register
        self._next_id = 1

    def plan(self, plan_id: int, request_ids: list[int], exec_at: float) -> BatchPlan:
        bs = len(request_ids)
        plan = BatchPlan(
            plan_id=plan_id,
            model=MODEL,
            gpu_id=0,
            exec_at=exec_at,
            expected_finish_at=exec_at + (ALPHA_MS * bs + BETA_MS) / 1e3,
            frontends=[self.frontend.endpoint],
            request_frontend=[0] * bs,
            request_ids=request_ids,
        )
        self.shard.send(plan)
        return plan

    def serve_fetch(self, bad: bool = False) -> InputFetch:
        """Answer the next InputFetch with each request's input (value = its id)."""
        identity, fetch = self.frontend.expect(InputFetch)
        shape = (1, 3) if bad else (1, 4)
        inputs = [{"x": np.full(shape, float(rid), np.float32)} for rid in fetch.request_ids]
        self.frontend.send(InputReply(fetch.plan_id, fetch.request_ids, inputs, []), identity)
        return fetch

    def stats_of(self, plan_id: int) -> BatchStats:
        return self.rank.expect(BatchStats, where=lambda m: m.plan_id == plan_id)[1]


def wide_input(request_id: int) -> dict[str, np.ndarray]:
    """One request's input of ``ROW_FLOATS`` values, each its id."""
    return {"x": np.full((1, ROW_FLOATS), float(request_id), np.float32)}


def start_backend(h: Harness, *, drain_s: float = 5.0, frontend_in_peers: bool = False,
                  input_shape: tuple[int, ...] = (4,), rank_process: str = "rank") -> BackendRig:
    """The backend, with the test's rank in the peer map as ``rank_process`` (``shard-0``: a
    scheduler process that hosts the shard too, whose plan DEALER is then the same process)."""
    cluster = cluster_config(
        [{"name": MODEL, "max_batch": MAX_BATCH,
          "emulated": {"alpha_ms": ALPHA_MS, "beta_ms": BETA_MS,
                       "input_shape": list(input_shape)}}],
        cluster={"drain_s": drain_s},
        backends={"device": "emulated"},
    )
    rank = h.router("rank")
    frontend = h.router("fe-data")
    child = h.start("backend", role_config_for(cluster, "backend", 0, h.dir))
    peers = {f"{rank_process}/rank": rank.endpoint}
    if frontend_in_peers:
        peers[f"{FRONTEND}/data"] = frontend.endpoint
    ready = h.await_ready(child, peers)
    _, register = rank.expect(BackendRegister)
    assert register.plan_address == ready.endpoints["plan"]
    shard = h.dealer(register.plan_address, "shard-0")
    return BackendRig(h, child, rank=rank, shard=shard, frontend=frontend, register=register)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[BackendRig]:
    h = Harness(tmp_path)
    try:
        yield start_backend(h)
    finally:
        h.close()


def test_proc_backend_registers_after_warmup(rig: BackendRig) -> None:
    reg = rig.register
    assert reg.name == "backend-0" and reg.device == "emulated" and reg.models == [MODEL]
    expected = [ALPHA_MS * b + BETA_MS for b in range(1, MAX_BATCH + 1)]
    assert reg.profiles_ms[MODEL] == pytest.approx(expected)
    rig.shard.send(StatsRequest(reset=False))
    _, reply = rig.shard.expect(StatsReply)
    assert reply.stats["warmed"] == {MODEL: list(range(1, MAX_BATCH + 1))}
    rig.rank.expect(Heartbeat)


def test_proc_backend_connects_the_frontends_it_learns_before_any_plan(tmp_path: Path) -> None:
    """The frontends of the peer map get the backend's Hello as it starts serving; a frontend a
    plan names first gets it before that plan's InputFetch."""
    h = Harness(tmp_path)
    try:
        rig = start_backend(h, frontend_in_peers=True)
        _, hello = rig.frontend.expect(Hello)  # no plan sent yet
        assert (hello.role, hello.name, hello.pid) == ("backend", "backend-0", rig.child.proc.pid)
        other = h.router("fe-other")
        rig.shard.send(BatchPlan(1, MODEL, 0, time.monotonic(), time.monotonic() + 0.03,
                                 [other.endpoint], [0], [7]))
        _, first = other.recv()
        assert isinstance(first, Hello)
        other.expect(InputFetch)
    finally:
        h.close()


def test_proc_backend_connects_afresh_to_a_frontend_restarted_at_its_address(
        tmp_path: Path) -> None:
    """A frontend restarted at the same address (a pod's container: a new incarnation in its
    request ids): the first plan naming the new incarnation gets a fresh connection, which says
    Hello before its InputFetch. The old connection would reconnect on ZeroMQ's backoff (up to
    RECONNECT_INTERVAL_MAX_MS after the frontend bound again) without a Hello, and the fetch
    would wait for it: past a deferred batch's deadline."""
    h = Harness(tmp_path)
    try:
        rig = start_backend(h, frontend_in_peers=True)
        rig.frontend.expect(Hello)
        old, new = 5, 6  # incarnations
        rig.plan(1, [(old << INCARNATION_SHIFT) | 7], time.monotonic())
        rig.serve_fetch()
        rig.frontend.expect(BatchOutputs)
        rig.frontend.sock.close(linger=0)  # the frontend's process leaves...
        restarted = h.router("fe-data")  # ...and its successor binds the same address
        assert restarted.endpoint == rig.frontend.endpoint
        rig.frontend = restarted
        rig.plan(2, [(new << INCARNATION_SHIFT) | 7], time.monotonic())
        _, first = restarted.recv()
        assert isinstance(first, Hello) and first.pid == rig.child.proc.pid, first
        fetch = rig.serve_fetch()
        assert fetch.request_ids == [(new << INCARNATION_SHIFT) | 7]
        restarted.expect(BatchOutputs)
        # a late plan of the old incarnation changes nothing: no second Hello
        rig.plan(3, [(old << INCARNATION_SHIFT) | 8], time.monotonic())
        rig.serve_fetch()
        assert not restarted.drain_kind(Hello)
    finally:
        h.close()


def test_proc_backend_runs_a_plan_and_pushes_outputs(rig: BackendRig) -> None:
    exec_at = time.monotonic() + 0.05
    rig.plan(1, [11, 12, 13], exec_at)
    fetch = rig.serve_fetch()
    assert fetch.plan_id == 1 and fetch.request_ids == [11, 12, 13]
    _, out = rig.frontend.expect(BatchOutputs)
    assert out.request_ids == [11, 12, 13]
    # The emulated model answers 2 * sum(inputs) + a model constant, per request.
    values = [float(o["y"][0, 0]) for o in out.outputs]
    constants = {v - 2 * 4 * rid for v, rid in zip(values, out.request_ids, strict=True)}
    assert len(constants) == 1
    stats = rig.stats_of(1)
    assert stats.ok and stats.batch_size == 3
    assert stats.started_at >= exec_at
    assert stats.finished_at - stats.started_at >= (ALPHA_MS * 3 + BETA_MS) / 1e3 - 1e-3
    # the shard that sent the plan hears the same report (where its answers' echoes begin)
    _, to_shard = rig.shard.expect(BatchStats)
    assert to_shard == stats


def test_proc_backend_stages_each_input_into_its_row_as_it_arrives(tmp_path: Path) -> None:
    """Rows of 32 KiB (staged: zserve.backends.staging). Two plans held at once: each one's
    inputs are copied into its staging slot on arrival and its batch runs as that slot's slice
    (``staged_batches``); a request missing in the middle breaks the rows apart, so that batch is
    assembled by copy. Every answer is its own."""
    h = Harness(tmp_path)
    try:
        rig = start_backend(h, input_shape=(ROW_FLOATS,))
        now = time.monotonic()
        rig.plan(1, [21, 22, 23], now + 0.04)
        rig.plan(2, [31, 32, 33, 34], now + 0.05)
        for _ in range(2):
            identity, fetch = rig.frontend.expect(InputFetch)
            rig.frontend.send(InputReply(fetch.plan_id, fetch.request_ids,
                                         [wide_input(rid) for rid in fetch.request_ids], []),
                              identity)
        rig.plan(3, [41, 42, 43], time.monotonic() + 0.03)
        identity, fetch = rig.frontend.expect(InputFetch)
        rig.frontend.send(InputReply(fetch.plan_id, [41, 43],
                                     [wide_input(41), wide_input(43)], [42]), identity)
        answered: dict[int, float] = {}
        for _ in range(3):
            _, out = rig.frontend.expect(BatchOutputs)
            answered.update({rid: float(o["y"][0, 0]) for rid, o in
                             zip(out.request_ids, out.outputs, strict=True)})
        assert sorted(answered) == [21, 22, 23, 31, 32, 33, 34, 41, 43]
        # each request got the answer to its own inputs: 2 * sum + the model's constant
        assert len({value - 2 * ROW_FLOATS * rid for rid, value in answered.items()}) == 1
        rig.shard.send(StatsRequest(reset=False))
        _, reply = rig.shard.expect(StatsReply)
        assert reply.stats["staged_batches"] == 2
        assert reply.stats["counters"]["plans_unstaged"] == 0
    finally:
        h.close()


def test_proc_backend_does_not_stage_small_rows(rig: BackendRig) -> None:
    """Rows of 16 bytes: copied when the batch starts (cheaper than staging), answered alike."""
    rig.plan(1, [11, 12], time.monotonic() + 0.03)
    rig.serve_fetch()
    rig.frontend.expect(BatchOutputs)
    rig.shard.send(StatsRequest(reset=False))
    _, reply = rig.shard.expect(StatsReply)
    assert reply.stats["staged_batches"] == 0
    assert reply.stats["counters"]["plans_unstaged"] == 0


def test_proc_backend_reports_busy_time_per_stats_window(rig: BackendRig) -> None:
    """``samples.busy_s`` is the device time used since the last reset: one batch's run, then
    nothing in the next window."""
    rig.shard.send(StatsRequest(reset=True))  # open a window
    rig.shard.expect(StatsReply)
    rig.plan(1, [1, 2, 3], time.monotonic() + 0.03)
    rig.serve_fetch()
    rig.frontend.expect(BatchOutputs)
    stats = rig.stats_of(1)
    rig.shard.send(StatsRequest(reset=True))
    _, reply = rig.shard.expect(StatsReply)
    busy = reply.stats["samples"]["busy_s"]
    assert (ALPHA_MS * 3 + BETA_MS) / 1e3 - 1e-3 <= busy <= stats.finished_at - stats.started_at
    # The batch's timings, one sample each, in the zserve.core.stats schema.
    first = reply.stats
    for metric in BACKEND_HISTOGRAMS:
        assert first["latency"][metric]["count"] == 1, metric
    assert first["latency"]["run"]["max_ms"] == pytest.approx(busy * 1e3, abs=1.0)
    rig.shard.send(StatsRequest(reset=True))
    _, reply = rig.shard.expect(StatsReply)
    assert reply.stats["samples"]["busy_s"] == 0.0
    assert reply.stats["latency"]["run"] == {"count": 0}
    # Successive windows add up (the load generator pools its polls this way).
    assert merge_snapshots([first, reply.stats])["latency"]["run"]["count"] == 1
    # The window's counters were zeroed by the resets; the totals since start were not.
    assert reply.stats["counters"]["batches_ok"] == 0
    assert reply.stats["counters_total"]["batches_ok"] == 1
    assert reply.stats["counters_total"]["requests_ok"] == 3


def test_busy_meter_splits_a_batch_across_windows() -> None:
    meter = BusyMeter(window_start=10.0)
    meter.start(10.5)
    assert meter.take(11.0, reset=True) == pytest.approx(0.5)  # running at the boundary
    meter.stop(11.25)
    assert meter.take(12.0, reset=False) == pytest.approx(0.25)  # only its part after 11.0
    meter.start(12.25)  # the next batch, still running at the window's end
    assert meter.take(12.5, reset=True) == pytest.approx(0.5)  # 0.25 + 0.25
    assert meter.take(12.5, reset=True) == pytest.approx(0.0)
    meter.stop(13.0)
    assert meter.take(13.5, reset=True) == pytest.approx(0.5)
    meter.stop(13.75)  # a stop without a start adds nothing
    assert meter.take(14.0, reset=True) == 0.0


def test_proc_backend_never_overlaps_batches(rig: BackendRig) -> None:
    # Three plans whose exec windows overlap: 2 starts while 1 runs (l(2) = 24 ms), 3 even
    # before 1; the follower runs them one at a time in exec_at order.
    now = time.monotonic()
    rig.plan(1, [1, 2], now + 0.060)
    rig.plan(2, [3, 4], now + 0.070)
    rig.plan(3, [5], now + 0.055)
    for _ in range(3):
        rig.serve_fetch()
    stats = sorted((rig.stats_of(i) for i in (1, 2, 3)), key=lambda s: s.started_at)
    assert [s.plan_id for s in stats] == [3, 1, 2]
    for first, second in itertools.pairwise(stats):
        assert second.started_at >= first.finished_at
    assert all(s.ok for s in stats)


def test_proc_backend_late_plan_runs_at_once(rig: BackendRig) -> None:
    exec_at = time.monotonic() - 0.200  # already 200 ms late when it is sent
    rig.plan(7, [70], exec_at)
    rig.serve_fetch()
    stats = rig.stats_of(7)
    assert stats.ok and stats.started_at - stats.exec_at >= 0.200
    rig.shard.send(StatsRequest(reset=False))
    _, reply = rig.shard.expect(StatsReply)
    assert reply.stats["counters"]["late_plans"] == 1
    assert reply.stats["latency"]["lateness"]["max_ms"] >= 200.0


def test_proc_backend_keys_inputs_by_frontend_and_request_id(rig: BackendRig) -> None:
    # Two frontends that both number a request 5: each request must get its own inputs back.
    other = rig.h.router("fe-data-1")
    plan = BatchPlan(
        plan_id=9, model=MODEL, gpu_id=0, exec_at=time.monotonic() + 0.03,
        expected_finish_at=time.monotonic() + 0.03 + (ALPHA_MS * 2 + BETA_MS) / 1e3,
        frontends=[rig.frontend.endpoint, other.endpoint], request_frontend=[0, 1],
        request_ids=[5, 5],
    )
    rig.shard.send(plan)
    for peer, value in ((rig.frontend, 1.0), (other, 100.0)):
        identity, fetch = peer.expect(InputFetch)
        assert fetch.request_ids == [5]
        inputs = [{"x": np.full((1, 4), value, np.float32)}]
        peer.send(InputReply(fetch.plan_id, [5], inputs, []), identity)
    _, first = rig.frontend.expect(BatchOutputs)
    _, second = other.expect(BatchOutputs)
    # 2 * sum(inputs) + the model constant: the two answers differ by 2 * 4 * (100 - 1).
    difference = float(second.outputs[0]["y"][0, 0]) - float(first.outputs[0]["y"][0, 0])
    assert difference == pytest.approx(2 * 4 * 99.0)
    assert rig.stats_of(9).batch_size == 2


def test_proc_backend_execution_error_fails_only_that_batch(rig: BackendRig) -> None:
    now = time.monotonic()
    rig.plan(1, [1, 2], now + 0.03)
    rig.plan(2, [3], now + 0.04)
    rig.serve_fetch(bad=True)  # plan 1's inputs have the wrong shape: its execution fails
    rig.serve_fetch()
    _, failed = rig.frontend.expect(BatchFailed)
    assert failed.plan_id == 1 and failed.request_ids == [1, 2]
    assert failed.error == ErrorKind.BACKEND_FAILED
    _, out = rig.frontend.expect(BatchOutputs)
    assert out.plan_id == 2 and out.request_ids == [3]
    assert not rig.stats_of(1).ok and rig.stats_of(2).ok
    # ... and it keeps serving.
    rig.plan(3, [4, 5], time.monotonic())
    rig.serve_fetch()
    assert rig.frontend.expect(BatchOutputs)[1].request_ids == [4, 5]
    assert rig.child.proc.poll() is None


def test_proc_backend_sigterm_drains(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        rig = start_backend(h, drain_s=1.0)
        now = time.monotonic()
        rig.plan(1, [1], now + 0.3)  # starts within the grace period: runs
        rig.plan(2, [2], now + 30.0)  # cannot start within it: SHUTTING_DOWN
        rig.serve_fetch()
        rig.serve_fetch()
        rig.child.terminate()
        _, failed = rig.frontend.expect(BatchFailed)
        assert failed.plan_id == 2 and failed.error == ErrorKind.SHUTTING_DOWN
        _, out = rig.frontend.expect(BatchOutputs)
        assert out.plan_id == 1
        assert rig.child.wait() == 0
    finally:
        h.close()


def test_proc_backend_withdraws_its_models_before_it_drains(tmp_path: Path) -> None:
    """SIGTERM first withdraws every model (a BackendRegister without them: the schedulers plan
    nothing more here); a plan sent before the schedulers heard it still runs, where a drain
    would have refused it SHUTTING_DOWN; then the drain, and exit 0."""
    h = Harness(tmp_path)
    try:
        rig = start_backend(h, drain_s=5.0)
        rig.child.terminate()
        # Sent right behind the signal (well within UNLOAD_QUIET_S of the withdrawal), as a
        # plan the scheduler made before it heard of the withdrawal.
        rig.plan(1, [1, 2], time.monotonic())
        _, withdrawal = rig.rank.expect(BackendRegister)
        assert withdrawal.name == "backend-0" and withdrawal.models == []
        rig.serve_fetch()
        _, out = rig.frontend.expect(BatchOutputs)
        assert out.plan_id == 1 and out.request_ids == [1, 2]
        assert not [m for _, m in rig.frontend.backlog if isinstance(m, BatchFailed)]
        assert rig.child.wait() == 0
    finally:
        h.close()


def test_proc_backend_onnx_ready_only_after_warmup(tmp_path: Path) -> None:
    """A real ONNX Runtime backend (built-in ``mlp``): Ready comes only once every batch size is
    warm, and a plan's outputs are what the model computes for each request."""
    from zserve.backends.builtin import ensure_builtin
    from zserve.backends.onnx_executor import OnnxExecutor, read_signature

    max_batch = 4
    cluster = cluster_config(
        [{"name": "mlp", "builtin": "mlp", "max_batch": max_batch}], backends={"device": "cpu"}
    )
    path = ensure_builtin("mlp")  # built once here, so the child's start-up is load + warm only
    h = Harness(tmp_path)
    try:
        rank = h.router("rank")
        frontend = h.router("fe-data")
        child = h.start("backend", role_config_for(cluster, "backend", 0, h.dir))
        h.await_ready(child, {"rank/rank": rank.endpoint})
        ready_at = time.monotonic()
        _, register = rank.expect(BackendRegister)
        assert len(register.profiles_ms["mlp"]) == max_batch  # measured after warm-up
        shard = h.dealer(register.plan_address, "shard-0")
        shard.send(StatsRequest(reset=False))
        _, reply = shard.expect(StatsReply)
        assert reply.stats["warmed"] == {"mlp": list(range(1, max_batch + 1))}
        assert reply.stats["warm_finished_at"] <= ready_at

        signature = read_signature(path, "mlp")
        (spec,) = signature.inputs
        rng = np.random.default_rng(7)
        shape = tuple(int(dim) for dim in spec.shape if dim is not None)
        assert len(shape) == len(spec.shape)  # the test model fixes every dimension
        requests = {rid: {spec.name: rng.standard_normal((1, *shape)).astype(spec.dtype)}
                    for rid in (1, 2, 3)}
        now = time.monotonic()
        shard.send(BatchPlan(1, "mlp", 0, now, now + 0.01, [frontend.endpoint], [0, 0, 0],
                             [1, 2, 3]))
        identity, fetch = frontend.expect(InputFetch)
        frontend.send(InputReply(1, fetch.request_ids, [requests[r] for r in fetch.request_ids],
                                 []), identity)
        _, out = frontend.expect(BatchOutputs)
        with OnnxExecutor([f"mlp={path}"], device="cpu", max_batch=max_batch) as executor:
            for rid, got in zip(out.request_ids, out.outputs, strict=True):
                (want,) = executor.run("mlp", [requests[rid]])
                assert got.keys() == want.keys()
                for name in want:
                    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    finally:
        h.close()


def test_proc_backend_loads_and_unloads_a_model_on_command(tmp_path: Path) -> None:
    """The supervisor's LoadModel / UnloadModel on the control link: a real ONNX Runtime backend
    started with ``mlp`` loads ``extra`` while serving (WARM, unannounced; then READY and a
    BackendRegister listing it), runs a plan of it, unloads it (a BackendRegister without it
    first, then UNAVAILABLE once freed; a later plan of it is refused UNAVAILABLE), and reports
    a file that is no model FAILED, in one line."""
    from zserve.backends.builtin import ensure_builtin
    from zserve.transport.messages import LoadModel, ModelReport, UnloadModel

    path = ensure_builtin("mlp")
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    models = [{"name": "mlp", "builtin": "mlp", "max_batch": 2},
              {"name": "extra", "onnx": str(path), "max_batch": 2},
              {"name": "broken", "onnx": str(broken), "max_batch": 2}]
    cluster = cluster_config(models, backends={"device": "cpu"})
    h = Harness(tmp_path)
    try:
        rank, frontend = h.router("rank"), h.router("fe-data")
        config = role_config_for(cluster, "backend", 0, h.dir)
        config.serve = ("mlp",)
        child = h.start("backend", config)
        identity, _ = h.control.expect(Ready, where=lambda m: m.name == child.name)
        h.control.send(Ready("supervisor", "supervisor", 1, {"rank/rank": rank.endpoint}),
                       identity)
        _, register = rank.expect(BackendRegister)
        assert register.models == ["mlp"]
        shard = h.dealer(register.plan_address, "shard-0")

        def report(state: str) -> ModelReport:
            return h.control.expect(ModelReport, where=lambda m: m.state == state)[1]

        extra = cluster.model("extra").to_dict()
        h.control.send(LoadModel("extra", extra, announce=False), identity)
        assert report("WARM").model == "extra"
        h.control.send(LoadModel("extra", extra), identity)
        assert report("READY").model == "extra"
        _, register = rank.expect(BackendRegister, where=lambda m: "extra" in m.models)
        assert len(register.profiles_ms["extra"]) == 2 and "extra" in register.signatures

        x = {"features": np.ones((1, 64), np.float32)}
        now = time.monotonic()
        shard.send(BatchPlan(1, "extra", 0, now, now + 0.01, [frontend.endpoint], [0], [5]))
        fetch_from, fetch = frontend.expect(InputFetch)
        frontend.send(InputReply(1, fetch.request_ids, [x], []), fetch_from)
        _, out = frontend.expect(BatchOutputs)
        assert out.request_ids == [5] and out.outputs[0]["logits"].shape == (1, 10)

        h.control.send(UnloadModel("extra"), identity)
        rank.expect(BackendRegister, where=lambda m: m.models == ["mlp"])  # withdrawn first
        assert report("UNAVAILABLE").model == "extra"
        shard.send(BatchPlan(2, "extra", 0, now, now + 0.01, [frontend.endpoint], [0], [6]))
        _, failed = frontend.expect(BatchFailed)
        assert (failed.request_ids, failed.error) == ([6], ErrorKind.UNAVAILABLE.value)

        h.control.send(LoadModel("broken", cluster.model("broken").to_dict()), identity)
        failure = report("FAILED")
        assert failure.model == "broken" and "not a valid ONNX model" in failure.message
        assert "\n" not in failure.message
    finally:
        h.close()
