"""``zserve bench-perf-analyzer``: the two clusters it starts and what it refuses before starting
them. The sweep itself needs the perf_analyzer binary (README, "Standard clients") and a quiet
host: it is a benchmark, run by hand (docs/performance.md, "Closed-loop clients")."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from zserve.config.cluster import load_config
from zserve.loadgen.bench.perf_analyzer_pair import (
    ANY_PORT,
    EAGER,
    Step,
    _concurrencies,
    _with_policy,
    main,
)

DEMO = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "demo.toml"


def test_each_cluster_runs_its_policy_under_its_own_name_on_kernel_picked_ports() -> None:
    config = load_config(str(DEMO))
    eager = _with_policy(config, EAGER)
    assert (eager.name, eager.scheduler.policy) == (f"{config.name}-eager", EAGER)
    assert eager.frontends.http_addresses == (ANY_PORT,) * config.frontends.count
    assert eager.frontends.grpc_addresses == (ANY_PORT,) * config.frontends.count
    assert eager.frontends.metrics_addresses == ()
    # the rest is the file's: the same models, backends and allowances
    assert eager.models == config.models and eager.backends == config.backends
    assert eager.scheduler.d_ctrl_ms == config.scheduler.d_ctrl_ms
    assert _with_policy(config, config.scheduler.policy).scheduler == config.scheduler


def test_it_refuses_a_missing_binary_and_an_eager_cluster_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "perf_analyzer")
    assert main([str(DEMO), "--perf-analyzer", missing]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--perf-analyzer" in err[0] and missing in err[0]
    eager = tmp_path / "eager.toml"
    eager.write_text(DEMO.read_text().replace('policy = "deferred"', 'policy = "eager"'))
    assert main([str(eager), "--perf-analyzer", "/bin/true"]) == 2
    assert "already runs eager" in capsys.readouterr().err
    for spec in ("1:x", "4:2", "0:3"):
        assert main([str(DEMO), "--range", spec, "--perf-analyzer", "/bin/true"]) == 2
        assert "--range: " in capsys.readouterr().err


def test_a_step_reads_the_mean_of_each_policys_runs() -> None:
    step = Step(4, {"deferred": [(400.0, 9.0), (500.0, 11.0)], EAGER: [(450.0, 10.0)] * 2})
    assert step.mean_rate("deferred") == 450.0 == step.mean_rate(EAGER)
    assert step.mean_p50_ms("deferred") == 10.0
    assert _concurrencies("1:16") == list(range(1, 17)) and _concurrencies("4") == [4]
    assert step.ratio("deferred") == 1.0
    # a policy whose runs perf_analyzer could not settle has no ratio, and the step says why
    unsettled = Step(8, {"deferred": [], EAGER: [(700.0, 11.0)]},
                     failed=[("deferred", "Failed to obtain stable measurement.")] * 2)
    assert math.isnan(unsettled.ratio("deferred")) and unsettled.mean_rate(EAGER) == 700.0
