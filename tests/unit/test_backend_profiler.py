"""Profiler (fit, profile file, `zserve profile`) and built-in models (`zserve models`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from zserve.backends import builtin, profiler
from zserve.backends.onnx_executor import OnnxExecutor
from zserve.backends.profiler import LatencyMeasurement, fit_linear, write_profile_file
from zserve.config.profiles import load_profiles


def test_fit_linear_recovers_exact_line() -> None:
    sizes = [1, 2, 3, 4, 8, 16]
    alpha, beta, r2, max_rel = fit_linear(sizes, [0.75 * b + 4.5 for b in sizes])
    assert alpha == pytest.approx(0.75)
    assert beta == pytest.approx(4.5)
    assert r2 == pytest.approx(1.0)
    assert max_rel == pytest.approx(0.0, abs=1e-12)


def test_fit_linear_reports_misfit() -> None:
    # Quadratic data: the line cannot explain it all, and says so.
    sizes = list(range(1, 9))
    alpha, beta, r2, max_rel = fit_linear(sizes, [float(b * b + 20) for b in sizes])
    assert alpha == pytest.approx(9.0)
    assert beta == pytest.approx(5.0)
    assert 0.9 < r2 < 1.0
    assert max_rel == pytest.approx(1 / 3)  # at b = 1: fit 14 against 21
    assert fit_linear([4], [7.0]) == (0.0, 7.0, 1.0, 0.0)


def test_fit_linear_keeps_alpha_and_beta_non_negative() -> None:
    # A tiny model's timings are noise: the unbounded line falls (alpha < 0), which a profile
    # file refuses. The bounded fit is flat at the mean.
    alpha, beta, _, _ = fit_linear([1, 2, 3], [0.023, 0.025, 0.021])
    assert alpha == 0.0
    assert beta == pytest.approx(0.023)
    # A line through below the origin (beta < 0) is fitted through the origin instead.
    alpha, beta, _, _ = fit_linear([1, 2, 3], [1.0, 3.0, 5.0])
    assert beta == 0.0
    assert alpha == pytest.approx((1 + 6 + 15) / 14)


def test_profile_table_is_monotone() -> None:
    profile = LatencyMeasurement.from_measurements(
        "m", "cpu", {1: [5.0, 5.2, 4.8], 2: [4.9, 4.9, 4.9], 3: [6.0]}
    )
    assert profile.latency_ms == [5.0, 4.9, 6.0]
    assert profile.p10_ms[0] == pytest.approx(4.84)
    assert profile.table_ms() == [5.0, 5.0, 6.0]
    with pytest.raises(ValueError, match=r"every size 1\.\.max_batch"):
        LatencyMeasurement.from_measurements("m", "cpu", {1: [1.0], 3: [2.0]}).table_ms()


def test_profile_file_schema_and_scheduler_loader(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    cnn = LatencyMeasurement.linear("cnn", "cpu", 0.5, 3.5, 4)
    data = write_profile_file(path, "cpu", [cnn])
    on_disk = json.loads(path.read_text())
    assert on_disk == data
    assert on_disk == {
        "format": "zserve-profile/1",
        "device": "cpu",
        "models": {
            "cnn": {"alpha_ms": 0.5, "beta_ms": 3.5, "max_batch": 4,
                    "latency_ms": [4.0, 4.5, 5.0, 5.5]},
        },
    }
    # A second model merges into the same file; the scheduler's loader reads both.
    write_profile_file(path, "cpu", [LatencyMeasurement.linear("mlp", "cpu", 0.01, 0.1, 2)])
    loaded = load_profiles(path)
    assert sorted(loaded) == ["cnn", "mlp"]
    assert loaded["cnn"].max_batch == 4
    assert loaded["cnn"].latency(4) == pytest.approx(5.5e-3)
    assert loaded["cnn"].alpha_s == pytest.approx(0.5e-3)
    assert loaded["mlp"].latency(3) == float("inf")
    with pytest.raises(ValueError, match="device 'cpu', not 'cuda:0'"):
        write_profile_file(path, "cuda:0", [cnn])


def test_cnn_profile_fit_explains_measured_latency() -> None:
    # A real measurement on a shared machine, kept small (sizes up to 16, 5 repeats, ~0.3 s) and
    # checked loosely: the CNN's batching effect is strong (l(16) is about 2.5 x l(1)), so even a
    # noisy median curve is mostly explained by the line. Exact figures come from
    # `zserve profile cnn --max-batch 32`, not from this test.
    sizes = [1, 2, 4, 8, 16]
    with OnnxExecutor(["cnn"], max_batch=16) as executor:
        profile = executor.profile("cnn", sizes, repeats=5, warmup=1)
    assert profile.batch_sizes == sizes
    assert all(lo <= med <= hi for lo, med, hi in
               zip(profile.p10_ms, profile.latency_ms, profile.p90_ms, strict=True))
    assert profile.alpha_ms > 0
    assert profile.beta_ms > 0
    assert profile.r2 > 0.5
    assert profile.max_rel_error == pytest.approx(
        max(abs(profile.predict_ms(b) - m) / m
            for b, m in zip(sizes, profile.latency_ms, strict=True))
    )


def test_profile_command_writes_file_and_plot(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    argv = ["mlp", "--max-batch", "3", "--repeats", "2", "--out", str(out), "--plot", str(png)]
    assert profiler.main(argv) == 0
    printed = capsys.readouterr().out
    assert "fit: l(b) =" in printed and "R^2" in printed and "max rel error" in printed
    entry = json.loads(out.read_text())["models"]["mlp"]
    assert entry["max_batch"] == 3 and len(entry["latency_ms"]) == 3
    assert load_profiles(out)["mlp"].max_batch == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_command_reports_bad_model(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert profiler.main([str(tmp_path / "missing.onnx")]) == 2
    assert "no such model file" in capsys.readouterr().err
    assert profiler.main(["resnet9000"]) == 2
    assert "neither a built-in model" in capsys.readouterr().err


def test_builtin_models_are_cached_atomically_and_deterministic(
    zserve_model_cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert builtin.cache_dir() == zserve_model_cache_dir
    monkeypatch.setenv("ZSERVE_CACHE_DIR", str(tmp_path / "fresh"))
    path = builtin.ensure_builtin("mlp")
    assert path.parent == tmp_path / "fresh"
    first = path.read_bytes()
    path.unlink()
    assert builtin.ensure_builtin("mlp").read_bytes() == first  # same seed, same bytes
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left
    assert path.stat().st_mode & 0o777 == builtin.CACHE_FILE_MODE


def test_model_specs() -> None:
    assert builtin.resolve_model_spec("mlp").path == builtin.builtin_path("mlp")
    assert builtin.resolve_model_spec("r50=/m/resnet.onnx") == builtin.ModelSpec(
        "r50", Path("/m/resnet.onnx")
    )
    assert builtin.resolve_model_spec("models/resnet.onnx").name == "resnet"
    for bad in ("", "=x.onnx", "nope"):
        with pytest.raises(ValueError):
            builtin.resolve_model_spec(bad)


def test_models_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert builtin.main(["path", "mlp"]) == 0
    assert capsys.readouterr().out.strip() == str(builtin.builtin_path("mlp"))
    assert builtin.main([]) == 0
    listing = capsys.readouterr().out
    assert "cnn" in listing and "mlp" in listing and "cached" in listing
    assert builtin.main(["build", "nope"]) == 2
    assert "unknown built-in model 'nope'" in capsys.readouterr().err


def test_cnn_output_scale_is_sane() -> None:
    # He initialisation keeps logits finite and neither vanishing nor exploding.
    with OnnxExecutor(["cnn"], max_batch=2) as executor:
        (out,) = executor.run("cnn", executor.synthetic_requests("cnn", 1))
    logits = out["logits"]
    assert np.all(np.isfinite(logits))
    assert 1e-3 < float(np.abs(logits).max()) < 1e3
