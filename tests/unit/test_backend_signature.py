"""ModelSignature: request validation from a signature alone, and its msgpack-native form."""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import numpy as np
import pytest

from zserve.config.signature import ModelSignature, TensorSpec
from zserve.core.errors import BadRequestError, ErrorKind, TooLargeError


@pytest.fixture
def signature() -> ModelSignature:
    return ModelSignature(
        "two_in",
        (TensorSpec("image", "float32", (3, 8, 8)), TensorSpec("mask", "int64", (5,))),
        (TensorSpec("logits", "float32", (10,)), TensorSpec("tokens", "int64", (None,))),
    )


def _request() -> dict[str, np.ndarray]:
    return {"image": np.zeros((1, 3, 8, 8), np.float32), "mask": np.zeros((1, 5), np.int64)}


def test_valid_request_passes(signature: ModelSignature) -> None:
    signature.validate_request(_request())


def test_roundtrips_through_msgpack(signature: ModelSignature) -> None:
    wire = msgpack.packb(signature.to_dict())
    again = ModelSignature.from_dict(msgpack.unpackb(wire))
    assert again == signature
    again.validate_request(_request())
    assert again.input_names == ["image", "mask"]
    assert again.output_names == ["logits", "tokens"]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda r: r.pop("mask"), "missing input(s) 'mask'"),
        (lambda r: r.update(extra=np.zeros(1)), "unexpected input(s) 'extra'"),
        (lambda r: r.update(image=r["image"].astype(np.float64)), "dtype float64, expected"),
        (lambda r: r.update(image=np.zeros((1, 3, 8, 9), np.float32)), "expected (1, 3, 8, 8)"),
        (lambda r: r.update(image=np.zeros((2, 3, 8, 8), np.float32)),
         "inputs disagree on the number of rows: 'image' has 2, 'mask' has 1"),
        (lambda r: r.update(image=np.zeros((0, 3, 8, 8), np.float32),
                            mask=np.zeros((0, 5), np.int64)), "has 0 rows"),
        (lambda r: r.update(image=np.zeros((3, 8, 8), np.float32)), "add a leading batch"),
        (lambda r: r.update(mask=[0, 1, 2, 3, 4]), "must be an array, got list"),
    ],
)
def test_mismatches_are_bad_requests(
    signature: ModelSignature, change: Callable[[dict[str, object]], object], fragment: str
) -> None:
    request: dict[str, object] = dict(_request())
    change(request)
    with pytest.raises(BadRequestError) as info:
        signature.validate_request(request)
    assert info.value.kind is ErrorKind.BAD_REQUEST
    assert fragment in info.value.message
    assert "two_in" in info.value.message


def test_a_request_of_n_rows_returns_n(signature: ModelSignature) -> None:
    request = {"image": np.zeros((3, 3, 8, 8), np.float32), "mask": np.zeros((3, 5), np.int64)}
    assert signature.validate_request(request) == 3
    assert signature.validate_request(request, max_rows=3) == 3
    assert signature.validate_request(_request(), max_rows=1) == 1


def test_more_rows_than_the_max_batch_is_too_large(signature: ModelSignature) -> None:
    request = {"image": np.zeros((9, 3, 8, 8), np.float32), "mask": np.zeros((9, 5), np.int64)}
    with pytest.raises(TooLargeError) as info:
        signature.validate_request(request, max_rows=8)
    assert info.value.kind is ErrorKind.TOO_LARGE
    assert "a request of 9 rows exceeds the model's max batch of 8 rows" in info.value.message


def test_non_mapping_is_bad_request(signature: ModelSignature) -> None:
    with pytest.raises(BadRequestError, match="must be a map"):
        signature.validate_request([np.zeros((1, 3, 8, 8), np.float32)])


def test_validate_batch_returns_size(signature: ModelSignature) -> None:
    batch = {"image": np.zeros((4, 3, 8, 8), np.float32), "mask": np.zeros((4, 5), np.int64)}
    assert signature.validate_batch(batch) == 4
    batch["mask"] = np.zeros((3, 5), np.int64)
    with pytest.raises(BadRequestError, match="'image' has 4, 'mask' has 3"):
        signature.validate_batch(batch)


def test_from_dict_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="bad"):
        ModelSignature.from_dict({"model": "m", "inputs": [{"name": "x"}], "outputs": []})
    with pytest.raises(ValueError, match="bad"):
        ModelSignature.from_dict(
            {"model": "m", "inputs": [{"name": "x", "dtype": "nope", "shape": []}], "outputs": []}
        )
