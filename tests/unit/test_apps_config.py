"""``[[apps]]`` of cluster.toml: a valid app's plan, and a one-line error naming the key path for
each way an app cannot be served (unknown model, a cycle, a mapping that names nothing, shapes
that cannot chain, fan-outs that disagree, two last stages)."""

from __future__ import annotations

from typing import Any

import pytest

from zserve.config.cluster import ConfigError, parse_config


def _document(stages: list[dict[str, Any]], **app: Any) -> dict[str, Any]:
    models = [{"name": "det", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0,
                                           "output_shape": [4]}},
              {"name": "cls", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0}},
              {"name": "img", "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0,
                                           "input_shape": [8], "output_shape": [4]}}]
    return {"backends": {"count": 1, "device": "emulated"}, "models": models,
            "apps": [{"name": "pipe", "slo_ms": 200.0, "stages": stages, **app}]}


DETECT = {"name": "detect", "model": "det", "inputs": {"x": "app.image"}}


def _error(stages: list[dict[str, Any]], **app: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(_document(stages, **app))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_valid_app_has_its_order_counts_and_signature() -> None:
    stages = [{"name": "classify", "model": "cls", "after": {"detect": 3},
               "inputs": {"x": "detect.y"}}, DETECT]
    plan = parse_config(_document(stages)).app_graphs()["pipe"]
    assert plan.order == ("detect", "classify") and plan.last == "classify"
    assert dict(plan.count) == {"detect": 1, "classify": 3}
    assert plan.signature is not None
    assert [(t.name, t.shape) for t in plan.signature.inputs] == [("image", (4,))]
    assert [(t.name, t.shape) for t in plan.signature.outputs] == [("y", (1,))]


@pytest.mark.parametrize(("stages", "expected"), [
    ([{**DETECT, "model": "nope"}], "apps[0].stages[0].model: unknown model 'nope'"),
    ([{**DETECT, "after": {"classify": 1}},
      {"name": "classify", "model": "cls", "after": {"detect": 1}, "inputs": {"x": "detect.y"}}],
     "apps[0].stages[0].after: stage 'detect' is on a cycle"),
    ([DETECT, {"name": "classify", "model": "cls", "after": {"detect": 1},
               "inputs": {"x": "track.y"}}],
     "apps[0].stages[1].inputs.x: 'track.y' names nothing"),
    ([DETECT, {"name": "classify", "model": "cls", "after": {"detect": 1},
               "inputs": {"x": "detect.boxes"}}],
     "apps[0].stages[1].inputs.x: stage 'detect' has no output 'boxes'"),
    ([DETECT, {"name": "classify", "model": "img", "after": {"detect": 1},
               "inputs": {"x": "detect.y"}}],
     "apps[0].stages[1].inputs.x: detect.y is float32[4] but the input needs float32[8]"),
    ([DETECT, {"name": "a", "model": "cls", "after": {"detect": 2}, "inputs": {"x": "detect.y"}},
      {"name": "b", "model": "cls", "after": {"detect": 3}, "inputs": {"x": "detect.y"}},
      {"name": "join", "model": "cls", "after": {"a": 1, "b": 1}, "inputs": {"x": "app.image"}}],
     "apps[0].stages[3].after: its edges give it different numbers of requests"),
    ([DETECT, {"name": "a", "model": "cls", "after": {"detect": 1}, "inputs": {"x": "detect.y"}},
      {"name": "b", "model": "cls", "after": {"detect": 1}, "inputs": {"x": "detect.y"}}],
     "apps[0].stages: an app ends in exactly one stage, got a, b"),
    ([{**DETECT, "inputs": {"z": "app.image"}}], "apps[0].stages[0].inputs.z: model 'det' has "
     "no input 'z'"),
    ([{**DETECT, "after": {"detect": 0}}], "apps[0].stages[0].after[...]: must be >= 1"),
])
def test_an_app_that_cannot_be_served_is_refused_naming_the_key(
        stages: list[dict[str, Any]], expected: str) -> None:
    assert expected in _error(stages)


def test_an_app_named_like_a_model_or_with_a_bad_slo_is_refused() -> None:
    assert "apps[0].name: a model is named 'det' too" in _error([DETECT], name="det")
    assert "apps[0].slo_ms" in _error([DETECT], slo_ms=0.0)
