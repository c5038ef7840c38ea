"""Workload files, arrivals, search, reports, simulator invariants and the two CLIs."""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zserve.backends.follower import RunBatch
from zserve.config.profiles import LatencyProfile, save_profiles
from zserve.core.errors import ErrorKind
from zserve.loadgen.arrivals import arrival_times, model_rng, popularity_shares
from zserve.loadgen.report import summary_text
from zserve.loadgen.search import search_goodput
from zserve.loadgen.sim import cli
from zserve.loadgen.sim.report import workload_bound_rps
from zserve.loadgen.sim.simulator import InvariantError, SimConfig, Simulator, simulate
from zserve.loadgen.workload import WorkloadError, load_workload, parse_workload
from zserve.scheduler.bench import throughput
from zserve.transport.messages import BatchPlan

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "examples" / "workloads"


def _small(**workload: Any) -> dict[str, Any]:
    section = {"gpus": 2, "rate": 400.0, "warmup_s": 0.2, "measure_s": 1.0, "cooldown_s": 0.1}
    section.update(workload)
    return {
        "workload": section,
        "models": [
            {"name": "a", "slo_ms": 25.0, "alpha_ms": 1.053, "beta_ms": 5.072},
            {"name": "b", "slo_ms": 40.0, "alpha_ms": 2.0, "beta_ms": 8.0, "max_batch": 16},
        ],
    }


# ------------------------------------------------------------------ workload file


def test_shipped_workloads_parse() -> None:
    r50 = load_workload(WORKLOADS / "table2-resnet50.toml")
    assert r50.gpus == 8 and r50.models[0].name == "ResNet50" and r50.jitter_ms == 1.0
    zoo = load_workload(WORKLOADS / "a100-zoo-64gpu.toml")
    assert len(zoo.models) == 37 and zoo.gpus == 64
    assert load_workload(WORKLOADS / "table2-irv2.toml").models[0].slo_ms == 70.0


def test_unknown_keys_name_their_path(tmp_path: Path) -> None:
    bad = _small(arival="poisson")
    with pytest.raises(WorkloadError, match=r"workload\.arival"):
        parse_workload(bad)
    bad = _small()
    bad["models"][1]["slo"] = 3
    with pytest.raises(WorkloadError, match=r"models\[1\]\.slo"):
        parse_workload(bad)
    bad = _small()
    del bad["models"][0]["beta_ms"]
    with pytest.raises(WorkloadError, match=r"models\[0\]\.beta_ms"):
        parse_workload(bad)
    with pytest.raises(WorkloadError, match="arrival"):
        parse_workload(_small(arrival="gamma"))
    with pytest.raises(WorkloadError, match="policy"):
        parse_workload(_small(policy="sometimes"))
    path = tmp_path / "w.toml"
    path.write_text("[workload]\ngpus = 'x'\n")
    with pytest.raises(WorkloadError, match=r"workload\.gpus"):
        load_workload(path)
    with pytest.raises(WorkloadError,
                       match=r"w\.toml: workload\.gpus: must be an integer, got 'x'$"):
        load_workload(path)
    with pytest.raises(WorkloadError,
                       match=r"workload\.arival: unknown key \(did you mean 'arrival'"):
        parse_workload(_small(arival="poisson"))
    bad = _small()
    bad["models"][0]["profile"] = "p.json"
    with pytest.raises(WorkloadError, match=r"models\[0\]: give either profile or alpha_ms"):
        parse_workload(bad)


def test_profile_file_and_zoo_paths_are_relative_to_the_workload(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    save_profiles(tmp_path / "profiles" / "cpu.json",
                  {"net": LatencyProfile.from_table_ms([2.0, 3.0, 4.0, 5.0])}, "cpu")
    zoo = (ROOT / "examples" / "profiles" / "model_zoo_a100.csv").read_text()
    (tmp_path / "profiles" / "zoo.csv").write_text(zoo)
    (tmp_path / "w.toml").write_text(
        '[workload]\nzoo_csv = "profiles/zoo.csv"\npopularity = "zipf:1.0"\n'
        '[[models]]\nname = "mine"\nslo_ms = 20\nprofile = "profiles/cpu.json"\n'
        'profile_model = "net"\nmax_batch = 3\n'
    )
    w = load_workload(tmp_path / "w.toml")
    assert len(w.models) == 38
    assert w.models[-1].profile.max_batch == 3
    shares = w.shares()
    assert sum(shares) == pytest.approx(1.0) and shares[0] > shares[1] > shares[-1]


# ------------------------------------------------------------------ arrivals and popularity


@pytest.mark.parametrize(("kind", "shape", "cv"), [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0)])
def test_arrival_processes_have_mean_rate_and_cv(kind: str, shape: float, cv: float) -> None:
    times = arrival_times(kind, shape, 2000.0, 20.0, model_rng(1, 0))
    gaps = np.diff(times)
    assert len(times) / 20.0 == pytest.approx(2000.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert np.all(gaps >= 0) and times[-1] < 20.0


def test_constant_arrivals_and_per_model_seeds() -> None:
    times = arrival_times("constant", 0.0, 100.0, 1.0, model_rng(1, 0))
    assert np.allclose(np.diff(times), 0.01) and 0 <= times[0] < 0.01
    a = arrival_times("poisson", 1.0, 100.0, 1.0, model_rng(7, 2))
    b = arrival_times("poisson", 1.0, 100.0, 1.0,
                      np.random.default_rng(np.random.SeedSequence(7).spawn(3)[2]))
    assert np.array_equal(a, b)


def test_per_model_streams_never_repeat_across_seeds() -> None:
    # seed + 31*i made seed 32's model 0 replay seed 1's model 1 (and seed 1's model 0 was seed
    # 32's model -1 ...): SeedSequence children are independent streams
    first = {(seed, m): model_rng(seed, m).random(4).tobytes()
             for seed in (0, 1, 2, 32, 63) for m in range(4)}
    assert len(set(first.values())) == len(first)
    assert model_rng(32, 0).random(4).tobytes() != model_rng(1, 1).random(4).tobytes()
    with pytest.raises(WorkloadError, match=r"workload\.seed"):
        parse_workload(_small(seed=-1))


def test_a_bailed_probe_counts_only_the_requests_decided_before_it_stopped() -> None:
    # 3x the capacity of 2 GPUs over a 4 s window: the run bails within the first second of it.
    # Before the fix, every request of the window that never arrived counted as bad.
    w = parse_workload(_small(rate=5000.0, measure_s=4.0, cooldown_s=0.0))
    sim = Simulator(w, SimConfig(bail_bad_rate=0.03))
    report = sim.run()
    assert report["bailed"] and sim.bailed_at < w.warmup_s + 1.0
    decided = ((sim.arrival_all >= w.warmup_s) & (sim.arrival_all < sim.bailed_at)
               & (sim.status != 0))
    for i, name in enumerate(("a", "b")):
        mine = decided & (sim.model_of == i)
        bad = np.count_nonzero(mine & (sim.status != 1))  # 1: GOOD
        entry = report["per_model"][name]
        assert entry["total"] == np.count_nonzero(mine) > 0
        assert entry["bad_rate"] == pytest.approx(bad / np.count_nonzero(mine), abs=1e-6)
    in_window = np.count_nonzero((sim.arrival_all >= w.warmup_s)
                                 & (sim.arrival_all < w.warmup_s + w.measure_s))
    assert sum(e["total"] for e in report["per_model"].values()) < in_window / 3


def test_popularity_shares() -> None:
    class M:
        def __init__(self, share: float | None) -> None:
            self.share = share

    models = [M(None), M(None)]
    assert popularity_shares("equal", models) == [0.5, 0.5]
    assert popularity_shares([3.0, 1.0], models) == [0.75, 0.25]
    assert popularity_shares("equal", [M(1.0), M(3.0)]) == [0.25, 0.75]
    with pytest.raises(ValueError):
        popularity_shares("pareto", models)


# ------------------------------------------------------------------ search


def test_search_brackets_and_bisects_to_precision() -> None:
    threshold = 1234.0
    seen: list[float] = []

    def probe(rate: float) -> dict[str, Any]:
        seen.append(rate)
        return {"bad_rate": 0.0 if rate <= threshold else 0.5, "offered_rps": rate}

    result = search_goodput(probe, 100.0, rel_precision=0.01)
    assert threshold * 0.99 <= result["goodput_rps"] <= threshold
    assert result["search"]["probes"][0]["rate"] == 100.0
    stopped = search_goodput(probe, 100.0, on_probe=lambda rate, rep: len(seen) >= 30)
    assert stopped["goodput_rps"] > 0


# ------------------------------------------------------------------ simulator


def test_simulation_report_schema_and_invariants() -> None:
    w = parse_workload(_small())
    report = simulate(w)
    for key in ("offered_rps", "bad_rate", "gpu_busy_fraction", "policy", "seed", "per_model",
                "latency_ms", "queueing_ms", "batch_size", "bound_rps", "fraction_of_bound"):
        assert key in report
    for name in ("a", "b"):
        m = report["per_model"][name]
        for key in ("bad_rate", "p50_ms", "p99_ms", "median_batch"):
            assert key in m
        assert m["p99_ms"] <= m["slo_ms"] + 1e-6
    assert report["offered_rps"] == pytest.approx(400.0, rel=0.15)
    assert report["bad_rate"] <= 0.01
    assert 0 < report["gpu_busy_fraction"] < 1
    text = summary_text(report)
    assert "offered" in text and len(text.splitlines()) < 25


@pytest.mark.parametrize("policy", ["deferred", "deferred-bl", "latest", "eager", "eager-edf",
                                    "timeout:0.3"])
@pytest.mark.parametrize("arrival", ["poisson", "gamma:0.2"])
def test_every_policy_keeps_every_invariant_under_overload(policy: str, arrival: str) -> None:
    # 4x the capacity of 2 GPUs: drops galore, and every invariant is checked on every plan
    w = parse_workload(_small(rate=6000.0, policy=policy, arrival=arrival, measure_s=0.5))
    report = simulate(w)
    assert report["bad_rate"] > 0.3
    assert report["gpu_busy_fraction"] > 0.5


def test_sim_tick_coalesces_arrivals() -> None:
    w = parse_workload(_small(sim_tick_ms=5.0, rate=300.0))
    sim = Simulator(w)
    report = sim.run()
    assert report["bad_rate"] <= 0.05
    arrived = sum(m.n_arrived for m in sim.models)
    assert arrived == sim.n_requests
    # 5 ms ticks at 150 r/s per model: a chunk holds 0.75 requests on average
    assert report["rank"]["grants"] < arrived


def _admitted(sim: Simulator) -> list[int]:
    """Every request reaches the frontend's core, which admits it (its metadata is never sent:
    the test plans by hand); the core's request ids, by request index."""
    frontend = sim.frontends[0]
    for index in range(sim.n_requests):
        model = sim.w.models[int(sim.model_of[index])].name
        frontend.admit(float(sim.arrival_all[index]), index, model)
    rid_of = {index: rid for rid, index in sim.index_of_rid.items()}
    return [rid_of[index] for index in range(sim.n_requests)]


def test_invariant_checker_catches_broken_plans() -> None:
    w = parse_workload(_small())
    sim = Simulator(w, SimConfig(), arrivals=[np.array([0.0, 0.001]), np.array([0.0])])
    r0, r1, _ = _admitted(sim)
    good = BatchPlan(1, "a", 0, 0.002, 0.002 + 0.006125, ["sim"], [0], [r0])
    sim._on_plan(0.0, good)
    with pytest.raises(InvariantError, match="two batches at once"):
        sim._on_plan(0.0, BatchPlan(2, "a", 0, 0.003, 0.003 + 0.006125, ["sim"], [0], [r1]))
    with pytest.raises(InvariantError, match="planned twice"):
        sim._on_plan(0.0, BatchPlan(3, "a", 1, 0.003, 0.003 + 0.006125, ["sim"], [0], [r0]))
    with pytest.raises(InvariantError, match="latest"):
        sim._on_plan(0.0, BatchPlan(4, "a", 1, 0.030, 0.030 + 0.006125, ["sim"], [0], [r1]))
    with pytest.raises(InvariantError, match="after its exec_at"):
        sim._on_plan(0.01, BatchPlan(5, "a", 1, 0.005, 0.005 + 0.006125, ["sim"], [0], [r1]))


def test_invariant_checker_catches_a_follower_running_two_batches_at_once() -> None:
    w = parse_workload(_small())
    sim = Simulator(w, SimConfig(), arrivals=[np.array([0.0, 0.001]), np.array([0.0])])
    r0, r1, _ = _admitted(sim)
    first = BatchPlan(1, "a", 0, 0.002, 0.002 + 0.006125, ["sim"], [0], [r0])
    sim._run_batch(0.002, 0, RunBatch(first, [0], [{}], 0.002))
    second = BatchPlan(2, "a", 0, 0.003, 0.003 + 0.006125, ["sim"], [0], [r1])
    with pytest.raises(InvariantError, match="two batches at once"):
        sim._run_batch(0.003, 0, RunBatch(second, [0], [{}], 0.003))
    third = BatchPlan(3, "a", 1, 0.003, 0.003 + 0.006125, ["sim"], [0], [r0])
    with pytest.raises(InvariantError, match="runs twice"):
        sim._run_batch(0.003, 1, RunBatch(third, [0], [{}], 0.003))


def _drain_gpu_events(sim: Simulator) -> None:
    """Run the GPU events the test queued (no arrivals: ``run`` is never called)."""
    while sim._events:
        now, seq, kind, idx = heapq.heappop(sim._events)
        sim._now = now
        sim._on_gpu_event(now, kind, idx, seq)


def test_plans_and_inputs_reach_the_follower_after_their_delays_and_start_on_time() -> None:
    w = parse_workload(_small(d_ctrl_ms=2.0, d_data_ms=0.5))
    sim = Simulator(w, SimConfig(), arrivals=[np.array([0.0, 0.0]), np.array([0.0])])
    r0, r1, _ = _admitted(sim)
    # granted at 0: the plan arrives at 2 ms, its two inputs at 3 ms, its exec_at
    plan = BatchPlan(1, "a", 0, 0.003, 0.003 + w.models[0].profile.latency(2), ["sim"],
                     [0, 0], [r0, r1], [0.025, 0.025])
    sim._on_plan(0.0, plan)
    follower = sim.followers[0]
    now, seq, kind, gpu = heapq.heappop(sim._events)
    assert now == pytest.approx(0.002) and gpu == 0
    sim._on_gpu_event(now, kind, gpu, seq)
    assert follower.held_plans == 1 and follower.running is None
    assert sim._events[0][0] == pytest.approx(0.003)  # the inputs: d_data per request later
    _drain_gpu_events(sim)
    ((gpu_id, model, start, end, size),) = sim.batches
    assert (gpu_id, model, size) == (0, 0, 2)
    assert start == pytest.approx(0.003) and end == pytest.approx(plan.expected_finish_at)
    assert sim.late_starts == 0 and follower.idle
    assert list(sim.status[:2]) == [1, 1]  # good: the core answered the outputs in time
    assert list(sim.answers.answered_at[:2]) == [pytest.approx(plan.expected_finish_at)] * 2


def test_a_models_own_data_allowance_times_its_inputs_and_plans() -> None:
    # model a's own d_data (1.5 ms per row) against the workload's 0.5: its two inputs are in
    # at 2 + 2 x 1.5 ms, its ModelThread plans with it, and the bound accounts for it
    document = _small(d_ctrl_ms=2.0, d_data_ms=0.5)
    document["models"][0]["d_data_ms"] = 1.5
    w = parse_workload(document)
    sim = Simulator(w, SimConfig(), arrivals=[np.array([0.0, 0.0]), np.array([0.0])])
    assert [m.d_data_s for m in sim.models] == [pytest.approx(1.5e-3), pytest.approx(0.5e-3)]
    r0, r1, _ = _admitted(sim)
    plan = BatchPlan(1, "a", 0, 0.005, 0.005 + w.models[0].profile.latency(2), ["sim"],
                     [0, 0], [r0, r1], [0.025, 0.025])
    sim._on_plan(0.0, plan)
    now, seq, kind, gpu = heapq.heappop(sim._events)
    sim._on_gpu_event(now, kind, gpu, seq)  # the plan, at 2 ms
    assert sim._events[0][0] == pytest.approx(0.005)  # its inputs
    assert workload_bound_rps(w) < workload_bound_rps(parse_workload(_small(d_data_ms=0.5)))
    document["models"][0]["d_data_ms"] = -1.0
    with pytest.raises(WorkloadError, match=r"models\[0\]\.d_data_ms: must be a finite"):
        parse_workload(document)


def test_a_plan_reaching_its_follower_late_starts_at_once_and_sheds_late_rows() -> None:
    # d_ctrl 5 ms, but this plan's exec_at leaves none of it: the follower gets it 5 ms late,
    # starts it at once, and sheds the request whose deadline the late batch would miss
    w = parse_workload(_small(d_ctrl_ms=5.0))
    sim = Simulator(w, SimConfig(), arrivals=[np.array([0.0, 0.0]), np.array([0.0])])
    r0, r1, _ = _admitted(sim)
    l2 = w.models[0].profile.latency(2)
    l1 = w.models[0].profile.latency(1)
    sim.deadline_all[0] = 0.001 + l2  # too tight once the batch starts at 5 ms
    plan = BatchPlan(1, "a", 1, 0.0, l2, ["sim"], [0, 0], [r0, r1],
                     [float(sim.deadline_all[0]), float(sim.deadline_all[1])])
    sim._on_plan(0.0, plan)
    _drain_gpu_events(sim)
    assert sim.late_starts == 1
    assert sim.backend_failed == {ErrorKind.DEADLINE.value: 1}
    assert list(sim.status[:2]) == [3, 1]  # shed (dropped), then good
    ((gpu_id, model, start, end, size),) = sim.batches
    assert (gpu_id, model, size) == (0, 1, 1)
    assert start == pytest.approx(0.005) and end == pytest.approx(0.005 + l1)
    lateness = sim.followers[1].histograms["lateness"]
    assert lateness.count == 1 and lateness.min == lateness.max == pytest.approx(0.005)


def test_report_counts_what_the_followers_did() -> None:
    report = simulate(parse_workload(_small(d_ctrl_ms=1.0, d_data_ms=0.1)))
    assert report["backends"] == {"late_starts": 0, "answered": {}, "drift_corrections": 0}
    assert report["bad_rate"] <= 0.01


def test_a_gpu_of_another_kind_runs_each_batch_for_its_own_profiles_latency() -> None:
    # GPU 1 is a faster kind for model a (l(b) = b/2 + 2 ms) and the same kind for model b
    w = parse_workload(_small(gpus=2, rate=600.0))
    fast = LatencyProfile.linear(0.5, 2.0, 32)
    sim = Simulator(w, SimConfig(gpu_profiles=[{}, {"a": fast}]))
    report = sim.run()  # the run's invariants (each batch finishes by its deadline) hold
    assert report["bad_rate"] <= 0.01
    own = {m.name: m.profile for m in w.models}
    seen_fast = 0
    for model, gpu, start, end, bs in sim.batches:
        name = w.models[model].name
        profile = fast if (gpu, name) == (1, "a") else own[name]
        assert end - start == pytest.approx(profile.latency(bs)), (name, gpu, bs)
        seen_fast += (gpu, name) == (1, "a")
    assert seen_fast > 0
    with pytest.raises(ValueError, match="gpu_profiles lists 1 GPUs, the workload has 2"):
        Simulator(w, SimConfig(gpu_profiles=[{}]))


def test_a_placement_runs_each_model_only_on_the_gpus_that_hold_it() -> None:
    w = parse_workload(_small(gpus=3, rate=300.0))
    sim = Simulator(w, SimConfig(model_gpus={"a": [0, 2], "b": [1]}))
    report = sim.run()
    assert report["bad_rate"] <= 0.01
    ran = {(w.models[model].name, gpu) for model, gpu, *_ in sim.batches}
    assert ran <= {("a", 0), ("a", 2), ("b", 1)}  # a needs one of its two GPUs at this rate
    assert {name for name, _ in ran} == {"a", "b"}
    with pytest.raises(ValueError, match="model_gpus names 'c', not a workload model"):
        Simulator(w, SimConfig(model_gpus={"a": [0], "b": [1], "c": [2]}))


def test_sim_cli_writes_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w.toml"
    path.write_text(
        "[workload]\ngpus = 2\nrate = 300.0\nwarmup_s = 0.2\nmeasure_s = 1.0\ncooldown_s = 0.1\n"
        '[[models]]\nname = "a"\nslo_ms = 25.0\nalpha_ms = 1.053\nbeta_ms = 5.072\n'
    )
    out = tmp_path / "r.json"
    assert cli.main([str(path), "--policy", "eager", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["policy"] == "eager" and report["seed"] == 1
    assert "offered" in capsys.readouterr().out
    searched = tmp_path / "s.json"
    assert cli.main([str(path), "--search", "goodput", "--precision", "0.1", "--quiet",
                         "--json", str(searched)]) == 0
    report = json.loads(searched.read_text())
    assert report["goodput_rps"] > 300 and report["fraction_of_bound"] is not None
    assert cli.main([str(path), "--policy", "nope"]) == 2


def test_sim_cli_takes_the_allowances_of_a_cluster_file(tmp_path: Path) -> None:
    # the simulated twin of `zserve bench CLUSTER WORKLOAD`: the cluster's budget, not the
    # workload's (which has none here), and a lower bound because of it
    path = tmp_path / "w.toml"
    path.write_text(
        "[workload]\ngpus = 2\nrate = 300.0\nwarmup_s = 0.2\nmeasure_s = 1.0\ncooldown_s = 0.1\n"
        '[[models]]\nname = "a"\nslo_ms = 25.0\nalpha_ms = 1.053\nbeta_ms = 5.072\n'
    )
    plain, twin = tmp_path / "plain.json", tmp_path / "twin.json"
    assert cli.main([str(path), "--quiet", "--json", str(plain)]) == 0
    cluster = ROOT / "examples" / "clusters" / "emulated-8gpu-resnet50.toml"
    assert cli.main([str(path), "--allowances-from", str(cluster), "--quiet",
                         "--json", str(twin)]) == 0
    plain_report, twin_report = (json.loads(f.read_text()) for f in (plain, twin))
    assert plain_report["allowances_ms"] == {"d_ctrl": 0.0, "d_data": 0.0, "reply": 0.0,
                                             "jitter": 0.0}
    assert twin_report["allowances_ms"] == {"d_ctrl": 3.0, "d_data": 0.02, "reply": 3.0,
                                            "jitter": 3.0}
    assert twin_report["bound_rps"] < plain_report["bound_rps"]
    # --jitter-ms still wins; a missing cluster file is a usage error
    assert cli.main([str(path), "--allowances-from", str(cluster), "--jitter-ms", "2",
                         "--quiet", "--json", str(twin)]) == 0
    assert json.loads(twin.read_text())["allowances_ms"]["jitter"] == 2.0
    assert cli.main([str(path), "--allowances-from", str(tmp_path / "none.toml")]) == 2


def test_the_allowances_of_a_cluster_file_carry_each_models_own_data_allowance() -> None:
    from zserve.config.cluster import parse_config

    cluster = parse_config({"models": [
        {"name": "a", "emulated": {"alpha_ms": 1.0, "beta_ms": 5.0}, "d_data_ms": 0.7},
        {"name": "c", "emulated": {"alpha_ms": 1.0, "beta_ms": 5.0}, "d_data_ms": 0.9}]})
    w = parse_workload(_small())
    a, b = cli.cluster_model_allowances(cluster, w.models)
    assert (a.d_data_ms, b.d_data_ms) == (0.7, None)  # b: not in the cluster, the workload's


def test_bench_scheduler_cli_smoke(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    rc = throughput.main(["--models", "3", "--gpus", "50", "--rate", "20000", "--duration", "0.3",
                     "--max-lag-ms", "1000", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["sustained_rps"] == 20000
    probe = report["probes"][0]
    assert probe["bad_rate"] <= 0.01 and probe["plans"] > 0


def test_bench_scheduler_fixed_trace_is_the_same_schedule_every_run(tmp_path: Path) -> None:
    """The fixed trace takes the machine out of the input: two runs plan alike, request for
    request, whatever their CPU times."""
    reports = []
    for run in range(2):
        out = tmp_path / f"f{run}.json"
        rc = throughput.main(["--models", "4", "--gpus", "8", "--fixed-trace", "40000",
                              "--duration", "0.2", "--json", str(out)])
        assert rc == 0
        reports.append(json.loads(out.read_text()))
    first, second = reports
    # (the last SLO's worth of requests may still be queued when the trace ends)
    assert first["plans"] > 0 and first["planned"] > 0.7 * first["requests"]
    for key in ("requests", "plans", "planned", "messages"):
        assert first[key] == second[key], key


def test_the_twin_runs_each_kinds_profile_file(tmp_path: Path) -> None:
    """``--allowances-from`` a cluster whose backends announce kinds and whose model has a
    profile file per kind: simulated GPU i has backend i's kind, and its batches take that
    kind's l(b) (``cli.cluster_gpu_profiles``)."""
    from zserve.config.cluster import load_config

    save_profiles(tmp_path / "a100.json", {"a": LatencyProfile.linear(1.053, 5.072, 64)}, "a100")
    save_profiles(tmp_path / "gtx.json", {"a": LatencyProfile.linear(2.0, 9.0, 64)}, "gtx1080ti")
    cluster = tmp_path / "c.toml"
    cluster.write_text(
        '[backends]\ncount = 2\ndevice = "emulated"\nkinds = ["a100", "gtx1080ti"]\n'
        '[[models]]\nname = "a"\nslo_ms = 25.0\n'
        "emulated = { alpha_ms = 1.053, beta_ms = 5.072 }\n"
        'profiles = { a100 = "a100.json", gtx1080ti = "gtx.json" }\n'
        '[[models]]\nname = "b"\nslo_ms = 25.0\nemulated = { alpha_ms = 1.0, beta_ms = 1.0 }\n')
    path = tmp_path / "w.toml"
    path.write_text(
        "[workload]\ngpus = 2\nrate = 300.0\nwarmup_s = 0.2\nmeasure_s = 1.0\ncooldown_s = 0.1\n"
        '[[models]]\nname = "a"\nslo_ms = 25.0\nalpha_ms = 1.053\nbeta_ms = 5.072\n')
    twin, kinds = cli.cluster_gpu_profiles(load_config(cluster), load_workload(path))
    # the model's own profile is the slowest of its GPUs' (the GTX's, which GPU 1 runs), as a
    # live shard's is; GPU 0 (the A100) is listed with its file's
    (model,) = twin.models
    assert kinds is not None and kinds[1] == {} and sorted(kinds[0]) == ["a"]
    assert model.profile.latency(1) == pytest.approx(0.011)
    assert kinds[0]["a"].latency(1) == pytest.approx(0.006125)
    assert model.profile.max_batch == kinds[0]["a"].max_batch == 18  # the workload's cap
    sim = Simulator(twin, SimConfig(gpu_profiles=kinds))
    sim.run()
    took = {(gpu, bs): end - start for _, gpu, start, end, bs in sim.batches}
    assert {gpu for gpu, _ in took} == {0, 1}
    for (gpu, bs), seconds in took.items():
        profile = kinds[gpu].get("a", model.profile)
        assert seconds == pytest.approx(profile.latency(bs))
    out = tmp_path / "r.json"
    assert cli.main([str(path), "--allowances-from", str(cluster), "--quiet",
                     "--json", str(out)]) == 0
    assert json.loads(out.read_text())["good_rps"] > 0
    # without per-kind files (or kinds) the twin is what it was
    plain = tmp_path / "plain.toml"
    plain.write_text('[[models]]\nname = "a"\nemulated = { alpha_ms = 1.0, beta_ms = 1.0 }\n')
    assert cli.cluster_gpu_profiles(load_config(plain), load_workload(path))[1] is None


def test_a_model_whose_every_gpu_is_slower_than_its_own_profile_is_refused(
        tmp_path: Path) -> None:
    """Every grant of such a model would be given back and granted again at the same instant
    (the run never ended): refused in one line before it starts; one GPU that runs its own
    profile, or is as fast, is enough."""
    path = tmp_path / "w.toml"
    path.write_text(
        "[workload]\ngpus = 2\nrate = 300.0\nwarmup_s = 0.2\nmeasure_s = 1.0\ncooldown_s = 0.1\n"
        '[[models]]\nname = "a"\nslo_ms = 25.0\nalpha_ms = 1.053\nbeta_ms = 5.072\n')
    w = load_workload(path)
    slower = LatencyProfile.linear(2.0, 9.0, 18)
    capped = w.models[0].profile.truncated(8)  # the same line, but no batch above 8
    for kinds in ([{"a": slower}, {"a": slower}], [{"a": capped}, {"a": slower}]):
        with pytest.raises(ValueError, match=r"^gpu_profiles: every GPU serving 'a' runs it "
                           r"slower than its own profile at some batch size"):
            Simulator(w, SimConfig(gpu_profiles=kinds))
    # a GPU of its own profile, or one as fast everywhere, serves it: it runs
    faster = LatencyProfile.linear(0.9, 4.0, 18)
    for kinds in ([{}, {"a": slower}], [{"a": faster}, {"a": slower}]):
        assert Simulator(w, SimConfig(gpu_profiles=kinds)).run()["good_rps"] > 0
