"""The example cluster + workload pairs describe the same system, so that `zserve sim` and
`zserve bench` on them compare like with like: GPUs, SLO, profile, batch cap and allowances."""

from __future__ import annotations

from pathlib import Path

import pytest

from zserve.config.cluster import load_config, parse_config
from zserve.demo import DEMO_CONFIG
from zserve.loadgen.workload import load_workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# (cluster, workload, whether the workload's allowances are the cluster's)
PAIRS = [
    ("demo.toml", "cnn-cpu.toml", True),
    ("emulated-8gpu-resnet50-slow.toml", "resnet50-slow.toml", True),
    # Symphony's Table 2 row as the paper ran it: the simulator without allowances.
    ("emulated-8gpu-resnet50.toml", "table2-resnet50.toml", False),
    ("emulated-8gpu-irv2.toml", "table2-irv2.toml", False),
    # two replicas under one generator (the peers' side-by-side), the same paper setting
    ("emulated-2gpu-resnet50.toml", "resnet50-2gpu.toml", False),
]


@pytest.mark.parametrize(("cluster_file", "workload_file", "same_allowances"), PAIRS)
def test_example_pairs_match(cluster_file: str, workload_file: str, same_allowances: bool) -> None:
    cluster = load_config(EXAMPLES / "clusters" / cluster_file)
    workload = load_workload(EXAMPLES / "workloads" / workload_file)
    (model,) = cluster.models
    (spec,) = workload.models
    assert workload.gpus == cluster.backends.total
    # `zserve bench CLUSTER WORKLOAD` maps models by case-insensitive name: no --model-map needed
    assert spec.name.lower() == model.name.lower()
    assert spec.slo_ms == model.slo_ms
    assert workload.policy == cluster.scheduler.policy
    if model.alpha_ms is not None and model.beta_ms is not None:
        assert spec.profile.alpha_s * 1e3 == pytest.approx(model.alpha_ms)
        assert spec.profile.beta_s * 1e3 == pytest.approx(model.beta_ms)
    if same_allowances:
        assert spec.profile.max_batch == model.max_batch
        assert workload.d_ctrl_ms == cluster.scheduler.d_ctrl_ms
        assert workload.d_data_ms == cluster.scheduler.d_data_ms
        assert workload.reply_ms == cluster.frontends.reply_allowance_ms
        assert workload.jitter_ms == cluster.scheduler.jitter_ms
    else:
        # the paper's setting in the workload, the machine's allowances in the cluster (wider:
        # `zserve sim WORKLOAD --allowances-from CLUSTER` is the live cluster's twin)
        assert workload.jitter_ms <= cluster.scheduler.jitter_ms


def test_demo_cluster_schedules_deferred_and_has_a_builtin_twin() -> None:
    demo = load_config(EXAMPLES / "clusters" / "demo.toml")
    assert demo.scheduler.policy == "deferred" and demo.scheduler.jitter_ms > 0
    # `zserve demo` on an install without the examples folder uses DEMO_CONFIG: the same cluster.
    assert parse_config(DEMO_CONFIG) == demo
