"""Built-in models with smaller inputs on the wire (zserve.backends.wire_inputs): cnn-u8 and
cnn-f16 answer as cnn does on the normalised float32 input, in real ONNX Runtime sessions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from zserve.backends.builtin import ensure_builtin, main
from zserve.backends.onnx_executor import OnnxExecutor, read_signature
from zserve.backends.wire_inputs import narrow_input, normalise_pixels


@pytest.fixture(scope="module")
def executor() -> Iterator[OnnxExecutor]:
    with OnnxExecutor(["cnn", "cnn-u8", "cnn-f16"], max_batch=4) as executor:
        yield executor


def logits(executor: OnnxExecutor, model: str, image: np.ndarray) -> np.ndarray:
    return np.concatenate([o["logits"] for o in executor.run(model, {"image": image})])


def test_inputs_are_a_quarter_and_a_half_of_the_float32_bytes() -> None:
    sizes = {}
    for model in ("cnn", "cnn-u8", "cnn-f16"):
        spec = read_signature(ensure_builtin(model)).inputs[0]
        assert (spec.name, spec.shape) == ("image", (3, 64, 64))
        sizes[model] = np.dtype(spec.dtype).itemsize
    assert sizes == {"cnn": 4, "cnn-u8": 1, "cnn-f16": 2}


def test_uint8_pixels_normalised_in_the_graph_match_the_float32_model(
        executor: OnnxExecutor) -> None:
    pixels = np.random.default_rng(5).integers(0, 256, (4, 3, 64, 64), dtype=np.uint8)
    got = logits(executor, "cnn-u8", pixels)
    want = logits(executor, "cnn", normalise_pixels(pixels))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert not np.allclose(got[0], got[1])  # the rows are the images' own answers


def test_float16_images_match_the_float32_model_within_half_precision(
        executor: OnnxExecutor) -> None:
    image = np.random.default_rng(6).standard_normal((3, 3, 64, 64)).astype(np.float32)
    half = image.astype(np.float16)
    got = logits(executor, "cnn-f16", half)
    np.testing.assert_allclose(got, logits(executor, "cnn", half.astype(np.float32)),
                               rtol=1e-5, atol=1e-5)
    want = logits(executor, "cnn", image)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_narrow_refuses_what_it_cannot_rewrite(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    source = ensure_builtin("cnn").read_bytes()
    with pytest.raises(ValueError, match="expected one of"):
        narrow_input(source, "int8")
    with pytest.raises(ValueError, match="3 channels"):
        narrow_input(source, "uint8", mean=(0.5,), std=(0.5,))
    with pytest.raises(ValueError, match="exactly one float32 input"):
        narrow_input(ensure_builtin("cnn-u8").read_bytes(), "uint8")
    with pytest.raises(ValueError, match="not a valid ONNX model"):
        narrow_input(b"\x00garbage", "uint8")
    assert main(["narrow", str(tmp_path / "missing.onnx"), str(tmp_path / "out.onnx")]) == 2
    assert "zserve models:" in capsys.readouterr().err
    target = tmp_path / "mlp16.onnx"
    assert main(["narrow", str(ensure_builtin("mlp")), str(target), "--input", "float16"]) == 0
    assert read_signature(target).inputs[0].dtype == "float16"
