"""``zserve bench``: the report schema shared with ``zserve sim``, plots, refusal, model names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from zserve.loadgen import cli
from zserve.loadgen.bench.echo import EchoConfig, EchoServer
from zserve.loadgen.live_run import BenchOptions
from zserve.loadgen.report import summary_text
from zserve.loadgen.sim.simulator import simulate
from zserve.loadgen.stats_poller import StatsSample, stats_window
from zserve.loadgen.target import match_models
from zserve.loadgen.workload import load_workload

WORKLOAD = """
[workload]
name = "echo-live"
gpus = 1
seed = 2
rate = 200.0
arrival = "poisson"
warmup_s = 0.2
measure_s = 0.6
cooldown_s = 0.0

[[models]]
name = "Small"
slo_ms = 50.0
alpha_ms = 1.0
beta_ms = 2.0

[[models]]
name = "tiny"
slo_ms = 80.0
alpha_ms = 0.5
beta_ms = 1.0
"""
# Keys only a simulator can fill (its own speed), and the rank counters, which a live run reads
# over the supervisor's control link (absent when driving a bare address, as here).
SIM_ONLY_KEYS = {"sim_requests", "sim_rps_wall", "rank", "backends", "frontends"}


@pytest.fixture(scope="module")
def echo() -> Iterator[EchoServer]:
    with EchoServer(EchoConfig(service_ms=2.0)) as server:
        yield server


@pytest.fixture
def workload_file(tmp_path: Path) -> Path:
    path = tmp_path / "echo-live.toml"
    path.write_text(WORKLOAD)
    return path


def test_live_report_has_the_simulators_keys(
    echo: EchoServer, workload_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "live.json"
    plots = tmp_path / "plots"
    # The measure window spans several 1 s stats polls, so one slow poll on a loaded machine
    # cannot leave it without scheduler statistics.
    code = cli.main([
        echo.address, str(workload_file), "--steps", "1.5:150,1.5:300", "--json", str(out),
        "--plots", str(plots), "--max-lateness-ms", "1000", "--quiet",
        "--stats", f"backend-0={echo.address}",
    ])
    assert code == cli.EXIT_OK
    live = json.loads(out.read_text())
    sim = simulate(load_workload(workload_file))
    assert set(sim) - set(live) <= SIM_ONLY_KEYS
    for name, entry in sim["per_model"].items():
        assert set(entry) <= set(live["per_model"][name])
    assert live["source"] == "live" and sim["source"] == "sim"
    assert set(live["per_model"]) == {"Small", "tiny"}
    assert live["schedule"]["rates_rps"] == [150.0, 300.0]
    # 2 ms replies against 50/80 ms SLOs: good, unless this shared machine stalls a process.
    assert live["bad_rate"] < 0.5
    assert live["generator"]["lateness_ms"]["bound_ms"] == 1000.0
    assert len(live["timeline"]["offered_rps"]) == 4  # 3.2 s of run in one-second bins
    # Scheduler statistics came over the wire (the echo server answers StatsRequest as a backend
    # does: every request a batch of one that ran 2 ms).
    assert live["stats"]["processes"] == ["backend-0"]
    assert set(live["batch_size"]["histogram"]) == {"1"}
    assert live["batch_size"]["median"] == 1.0
    assert 0.1 < live["gpu_busy_fraction"] < 0.9  # ~225 r/s x 2 ms
    assert any(b and b > 0 for b in live["timeline"]["gpus_busy"])
    assert {p.name for p in plots.iterdir()} == {
        "latency_cdf.png", "timeline.png", "batch_sizes.png"
    }
    assert "source=live" in summary_text(live)
    table = cli.side_by_side(live, sim).splitlines()
    assert table[1].split() == ["source", "live", "sim"]
    assert any(line.startswith("median batch") for line in table)


def test_refuses_a_run_the_generator_cannot_keep_up_with(
    echo: EchoServer, workload_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "refused.json"
    code = cli.main([
        echo.address, str(workload_file), "--rate", "300000", "--measure", "0.3",
        "--arrival", "constant", "--workers", "1", "--json", str(out), "--quiet",
    ])
    assert code == cli.EXIT_BEHIND
    refused = json.loads(out.read_text())
    assert "fell behind" in refused["refused"]
    assert refused["lateness_ms"]["behind"] is True
    lateness = refused["lateness_ms"]
    # The figure: its p99 send lateness, or how far behind it was when it gave up.
    assert max(lateness["p99_ms"], lateness["abandoned_lag_ms"] or 0.0) > lateness["bound_ms"]


def test_models_are_matched_by_name_then_case_then_map(workload_file: Path) -> None:
    workload = load_workload(workload_file)
    assert match_models(workload, ["small", "tiny"], {}) == {"Small": "small", "tiny": "tiny"}
    assert match_models(workload, ["a", "b"], {"Small": "a", "tiny": "b"}) == {
        "Small": "a", "tiny": "b"
    }
    with pytest.raises(ValueError, match="--model-map"):
        match_models(workload, ["other"], {})


def test_usage_errors(workload_file: Path) -> None:
    assert cli.main([]) == cli.EXIT_USAGE
    assert cli.main(["tcp://127.0.0.1:1", str(workload_file), "--steps", "1-100"]) == (
        cli.EXIT_USAGE
    )
    assert cli.main(["tcp://127.0.0.1:1", str(workload_file), "--workers", "x"]) == cli.EXIT_USAGE


def test_stats_window_takes_the_backends_in_window_busy_time() -> None:
    """A backend's ``busy_s`` (its exact busy time in the poll's window) wins over the sum of
    its batches' run times (which credits a batch to the poll in which it ended); a backend
    without it falls back to the sum."""
    exact = {"samples": {"batch_size": [4, 4], "run_s": [0.6, 0.6], "busy_s": 0.95}}
    legacy = {"samples": {"batch_size": [2], "run_s": [0.5]}}
    samples = [StatsSample(1.0, 1.0, "backend-0", exact),
               StatsSample(1.0, 1.0, "backend-1", legacy)]
    window = stats_window(samples, 0.0, 1.0)
    assert window is not None
    assert window.busy_s == pytest.approx(0.95 + 0.5)
    assert window.busy_fraction == pytest.approx((0.95 + 0.5) / 2)
    assert list(window.batch_sizes) == [4, 4, 2]


def test_repeat_reports_the_median_search_and_lists_them_all() -> None:
    def search(goodput: float, tag: str) -> dict[str, object]:
        return {"goodput_rps": goodput, "tag": tag}

    odd = cli.repeat_summary([search(3900.0, "a"), search(2100.0, "b"), search(2900.0, "c")])
    assert odd["tag"] == "c" and odd["goodput_rps"] == 2900.0
    assert odd["repeats"] == {"goodput_rps": [3900.0, 2100.0, 2900.0], "median_rps": 2900.0,
                              "min_rps": 2100.0, "max_rps": 3900.0}
    even = cli.repeat_summary([search(4000.0, "a"), search(3000.0, "b")])
    assert even["tag"] == "b"  # the lower middle: a search that ran
    assert even["repeats"]["median_rps"] == 3500.0
    one = cli.repeat_summary([search(1234.0, "x")])
    assert one["repeats"]["median_rps"] == 1234.0 and one["tag"] == "x"


def test_repeat_needs_a_search_and_a_positive_count(
    workload_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for extra in (["--rate", "100", "--repeat", "2"], ["--search", "goodput", "--repeat", "0"]):
        code = cli.main(["ipc:///nonexistent/zserve-test", str(workload_file), *extra, "--quiet"])
        assert code == cli.EXIT_USAGE
        assert "--repeat N needs N >= 1" in capsys.readouterr().err


def test_record_files_are_named_per_search_and_per_probe(tmp_path: Path) -> None:
    options = BenchOptions(workers=1, lateness_bound_ms=5.0, bail=None, progress=False,
                               schedule=None, records=str(tmp_path / "run.npz"))
    search = cli._records_suffixed(options, "search2")
    probe = cli._records_suffixed(search, "3100rps")
    assert probe.records == str(tmp_path / "run-search2-3100rps.npz")
    none = BenchOptions(workers=1, lateness_bound_ms=5.0, bail=None, progress=False,
                            schedule=None)
    assert cli._records_suffixed(none, "search1") is none
