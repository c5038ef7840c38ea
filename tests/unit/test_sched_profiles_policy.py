"""Latency profiles, profile files, policy names, rate meter, target batch size, bounds."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from zserve.config.cluster import ModelConfig, parse_config
from zserve.config.policy_names import (
    GRANT_EARLIEST_DEADLINE,
    GRANT_FIRST_DUE,
    GRANT_LEAST_SLACK,
    SchedulePolicy,
)
from zserve.config.profiles import (
    LatencyProfile,
    configured_profile,
    load_profiles,
    save_profiles,
    write_profile_entries,
)
from zserve.scheduler import bounds
from zserve.scheduler.policy import RpsMeter, target_batch_size


def test_linear_profile_and_infeasible_sizes() -> None:
    p = LatencyProfile.linear(1.0, 5.0, 8)
    assert p.latency(1) == pytest.approx(0.006)
    assert p.latency(8) == pytest.approx(0.013)
    assert p.latency(9) == math.inf and p.table_s[9] == math.inf
    assert p.latency(0) == 0.0
    assert p.largest_batch_within(0.0105) == 5
    assert p.largest_batch_within(0.001) == 0


def test_table_is_forced_monotone_and_fitted() -> None:
    p = LatencyProfile.from_table_ms([6.0, 5.0, 8.0, 9.0])
    assert p.latency_ms_list() == pytest.approx([6.0, 6.0, 8.0, 9.0])
    assert p.max_batch == 4 and p.latency(5) == math.inf
    assert p.alpha_s > 0 and p.beta_s > 0
    with pytest.raises(ValueError):
        LatencyProfile.from_table_ms([1.0, -2.0])


def test_linear_for_slo_caps_max_batch() -> None:
    p = LatencyProfile.linear_for_slo(1.053, 5.072, 25.0)
    assert p.max_batch == 18  # l(18) = 24.0 <= 25 < l(19)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_profile_file_round_trip(tmp_path: Path, suffix: str) -> None:
    profiles = {
        "lin": LatencyProfile.linear(1.0, 5.0, 16),
        "tab": LatencyProfile.from_table_ms([2.0, 3.0, 3.5]),
    }
    path = tmp_path / f"p{suffix}"
    save_profiles(path, profiles, "cpu")
    loaded = load_profiles(path)
    assert loaded["lin"].max_batch == 16 and loaded["lin"].latency(3) == pytest.approx(0.008)
    assert loaded["tab"].latency_ms_list() == pytest.approx([2.0, 3.0, 3.5])


def test_profile_table_wins_over_alpha_beta_and_max_batch_truncates(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "format": "zserve-profile/1", "device": "cpu",
        "models": {"m": {"alpha_ms": 100.0, "beta_ms": 100.0, "max_batch": 2,
                         "latency_ms": [1.0, 2.0, 3.0]}},
    }))
    p = load_profiles(path)["m"]
    assert p.max_batch == 2 and p.latency(2) == pytest.approx(0.002)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"format": "other", "models": {}}, "format"),
        ({"format": "zserve-profile/1", "models": {"m": {"alpha_ms": 1.0}}}, "beta_ms"),
        ({"format": "zserve-profile/1", "models": {"m": {"alpha_ms": 1, "beta_ms": 1}}},
         "max_batch"),
        ({"format": "zserve-profile/1", "models": {"m": {"latency_ms": [1], "x": 1}}}, "x"),
        ({"format": "zserve-profile/1", "models": {}, "extra": 1}, "extra"),
    ],
)
def test_profile_file_errors(tmp_path: Path, data: dict[str, object], match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_profiles(path)


def test_policy_names() -> None:
    assert SchedulePolicy.parse("deferred").drop_name == "window"
    assert SchedulePolicy.parse("timeout:0.3").timeout_fraction == pytest.approx(0.3)
    assert SchedulePolicy.parse("eager", "alone").drop_name == "alone"
    edf = SchedulePolicy.parse("eager-edf")
    assert (edf.kind, edf.drop_name) == (SchedulePolicy.parse("eager").kind, "alone")
    assert SchedulePolicy.parse("eager-edf", "fcfs").drop_name == "fcfs"
    # earliest deadline first across models; least slack first under its own name
    lsf = SchedulePolicy.parse("eager-lsf")
    assert (edf.grant_order, lsf.grant_order) == (GRANT_EARLIEST_DEADLINE, GRANT_LEAST_SLACK)
    assert lsf.drop_name == "alone"
    assert all(SchedulePolicy.parse(name).grant_order == GRANT_FIRST_DUE
               for name in ("deferred", "frontrun", "eager", "timeout:0.3"))
    for bad in ("fast", "timeout", "timeout:2", "eager:1"):
        with pytest.raises(ValueError):
            SchedulePolicy.parse(bad)
    with pytest.raises(ValueError, match="drop"):
        SchedulePolicy.parse("deferred", "lifo")


def test_rps_meter_window() -> None:
    meter = RpsMeter(bucket_s=0.05, window=4)
    assert meter.rate() is None
    t = 0.0
    for _ in range(40):
        meter.add(t, 10)  # 10 per 10 ms = 1000 r/s
        t += 0.01
    assert meter.rate() == pytest.approx(1000.0, rel=0.05)
    meter.add(t + 10.0, 1)  # a long silence empties the window
    assert meter.rate() == pytest.approx(0.0)


def test_target_batch_size_matches_staggered_batch() -> None:
    resnet = LatencyProfile.linear(1.053, 5.072, 64)
    # at the staggered rate of 8 GPUs the target is the staggered batch, 16
    assert target_batch_size(resnet, 0.025, 5839.0, 0.0) == 16
    # a low rate cannot fill large batches in time
    assert target_batch_size(resnet, 0.025, 500.0, 0.0) < 8
    # before any rate sample: the largest b with l(b) <= budget / 2
    assert target_batch_size(resnet, 0.025, None, 0.0) == 7


def test_bounds_reproduce_table2() -> None:
    assert bounds.staggered_batch(1.053, 5.072, 25, 8) == 16
    assert bounds.uncoordinated_batch(1.053, 5.072, 25) == 7
    assert bounds.staggered_throughput_rps(1.053, 5.072, 25, 8) == pytest.approx(5839, abs=1)
    assert bounds.uncoordinated_throughput_rps(1.053, 5.072, 25, 8) == pytest.approx(4501, abs=1)
    assert bounds.staggered_batch(5.090, 18.368, 70, 8) == 8
    assert bounds.uncoordinated_batch(5.090, 18.368, 70) == 3
    assert bounds.staggered_throughput_rps(5.090, 18.368, 70, 8) == pytest.approx(1083, abs=1)
    assert bounds.uncoordinated_throughput_rps(5.090, 18.368, 70, 8) == pytest.approx(713, abs=1)
    # the mixed-model bound agrees with the closed form for one model
    resnet = LatencyProfile.linear(1.053, 5.072, 64)
    assert bounds.staggered_bound_rps([(resnet, 0.025, 1.0)], 8) == pytest.approx(5839, rel=1e-3)
    two = bounds.staggered_bound_rps([(resnet, 0.025, 0.5), (resnet, 0.025, 0.5)], 16)
    assert two == pytest.approx(2 * 5839, rel=2e-3)


def _model(**keys: object) -> ModelConfig:
    (model,) = parse_config({"models": [{"name": "m", **keys}]}).models
    return model


def test_configured_profile_one_rule(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profiles(path, {"m": LatencyProfile.from_table_ms([1.0, 1.5]),
                         "other": LatencyProfile.linear(1.0, 1.0, 2)}, "cpu")
    emulated = {"alpha_ms": 10.0, "beta_ms": 10.0}
    # 1. The profile file wins over the emulated line (a measured l(b) beats a configured one).
    both = configured_profile(_model(emulated=emulated, profile=str(path), max_batch=8))
    assert both is not None and both.latency_ms_list() == pytest.approx([1.0, 1.5])
    # 2. Else the emulated line, up to the model's max_batch.
    line = configured_profile(_model(emulated=emulated, max_batch=8))
    assert line is not None and line.max_batch == 8 and line.latency(1) == pytest.approx(0.02)
    # 3. Else nothing: the backends measure it.
    assert configured_profile(_model(builtin="cnn")) is None
    # A file without the model's entry is an error, never a silent fallback.
    with pytest.raises(ValueError, match=r"has no entry for 'm' \(it has other\)"):
        save_profiles(path, {"other": LatencyProfile.linear(1.0, 1.0, 2)}, "cpu")
        configured_profile(_model(emulated=emulated, profile=str(path)))


def test_configured_profile_per_device_kind(tmp_path: Path) -> None:
    """``profiles``: a backend of a listed kind gets that kind's file; another kind the model's
    ``profile`` (or line); no kind at all (a shard before its table, a frontend) the slowest of
    every profile given, batch by batch, up to the smallest max batch."""
    fast, slow = tmp_path / "a100.json", tmp_path / "gtx.json"
    save_profiles(fast, {"m": LatencyProfile.from_table_ms([1.0, 1.2, 1.4])}, "a100")
    save_profiles(slow, {"m": LatencyProfile.from_table_ms([0.5, 3.0])}, "gtx1080ti")
    (model,) = parse_config({
        "backends": {"count": 3, "kinds": ["a100", "gtx1080ti", "t4"]},
        "models": [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 1.0}, "max_batch": 4,
                    "profiles": {"a100": str(fast), "gtx1080ti": str(slow)}}]}).models
    on_a100 = configured_profile(model, "a100")
    on_gtx = configured_profile(model, "gtx1080ti")
    on_t4 = configured_profile(model, "t4")  # no file for the kind: the emulated line
    assert on_a100 is not None and on_a100.latency_ms_list() == pytest.approx([1.0, 1.2, 1.4])
    assert on_gtx is not None and on_gtx.latency_ms_list() == pytest.approx([0.5, 3.0])
    assert on_t4 is not None and on_t4.latency_ms_list() == pytest.approx([2.0, 3.0, 4.0, 5.0])
    anywhere = configured_profile(model)
    assert anywhere is not None and anywhere.latency_ms_list() == pytest.approx([2.0, 3.0])
    # a kind's file without the model's entry is an error, as for ``profile``
    save_profiles(slow, {"other": LatencyProfile.linear(1.0, 1.0, 2)}, "gtx1080ti")
    with pytest.raises(ValueError, match=r"gtx\.json has no entry for 'm' \(it has other\)"):
        configured_profile(model, "gtx1080ti")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"format": "zserve-profile/1", "models": {"m": {"alpha_ms": 1, "beta_ms": 1,
                                                         "max_bach": 4}}},
         r"bad\.json: models\.m\.max_bach: unknown key \(did you mean 'max_batch'\?\)$"),
        ({"format": "zserve-profile/1", "models": {"m": {"latency_ms": [1.0, "x"]}}},
         r"bad\.json: models\.m\.latency_ms\[1\]: must be a number, got 'x'$"),
        ({"format": "zserve-profile/1", "models": {"m": {"latency_ms": [1.0], "max_batch": 2}}},
         r"bad\.json: models\.m: max_batch 2 > len\(latency_ms\) 1$"),
        ({"models": {}}, r"bad\.json: format: required$"),
    ],
)
def test_profile_file_errors_name_the_key(tmp_path: Path, data: dict[str, object],
                                          message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_profiles(path)


def test_profile_files_merge_per_device(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    write_profile_entries(path, "cpu", {"a": LatencyProfile.linear(1.0, 2.0, 4).to_entry()})
    write_profile_entries(path, "cpu", {"b": LatencyProfile.from_table_ms([3.0]).to_entry()})
    assert sorted(load_profiles(path)) == ["a", "b"]
    assert tomllib.loads(path.read_text())["device"] == "cpu"
    with pytest.raises(ValueError, match="device 'cpu', not 'cuda:0'"):
        write_profile_entries(path, "cuda:0", {})
