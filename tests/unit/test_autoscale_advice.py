"""The frontend's autoscaling advice (zserve.frontend.autoscale_advice), its gauges
(zserve.frontend.metrics) and the ``[autoscale]`` schema: stats answers in, advice out."""

from __future__ import annotations

from typing import Any

import pytest

from zserve.config.cluster import ConfigError, parse_config
from zserve.frontend.autoscale_advice import AdviceTracker, answered_and_bad, autoscale_policy
from zserve.frontend.metrics import cluster_families
from zserve.orchestrator.autoscale import ADD_BAD, RELEASE_IDLE

MODELS = [{"name": "m", "emulated": {"alpha_ms": 1.0, "beta_ms": 1.0}}]


def cluster(**autoscale: Any) -> Any:
    return parse_config({"models": MODELS, "backends": {"count": 4, "device": "emulated"},
                         "autoscale": {"enabled": True, "max_backends": 8, "up_window_s": 2.0,
                                       "down_window_s": 4.0, "settle_s": 0.0,
                                       "down_hold_s": 0.0, "min_requests": 10, **autoscale}})


def stats(replied: int, deadline: int, busy: list[float], cancelled: int = 0) -> dict[str, Any]:
    """A frontend's ClusterStatsRequest answer, as much of it as the advice reads."""
    return {"counters": {"replied": replied, "error_DEADLINE": deadline,
                         "rejected_OVERLOADED": 0, "error_CANCELLED": cancelled},
            "backends": [f"backend-{i}" for i in range(len(busy))],
            "cluster": {f"backend-{i}": {"role": "backend", "busy_total_s": b}
                        for i, b in enumerate(busy)} | {"shard-0": {"role": "shard"}}}


def test_bad_answers_are_the_clusters_failures_not_the_clients() -> None:
    counters = {"replied": 90, "error_DEADLINE": 4, "rejected_OVERLOADED": 5,
                "error_BAD_REQUEST": 7, "error_CANCELLED": 2, "error_BACKEND_FAILED": 1}
    assert answered_and_bad(counters) == (100, 10)


def feed(tracker: AdviceTracker, seconds: int, rate: int, bad_share: float,
         busy_per_backend: float) -> None:
    replied = deadline = 0
    busy = [0.0] * tracker.serving
    for t in range(seconds + 1):
        tracker.observe(float(t), stats(replied, deadline, busy))
        replied += round(rate * (1 - bad_share))
        deadline += round(rate * bad_share)
        busy = [b + busy_per_backend for b in busy]


def test_an_overloaded_cluster_is_advised_to_add_backends() -> None:
    config = cluster(max_backends=16)
    tracker = AdviceTracker.for_cluster(config, 0.0)
    assert tracker is not None and autoscale_policy(config).max_backends == 16
    feed(tracker, 3, rate=1000, bad_share=0.5, busy_per_backend=1.0)
    snapshot = tracker.snapshot()
    # 4 busy backends (at most the peak's 97%) / ((1 - 0.5) x 0.97 x (1 - 3% headroom)) = 8.2
    assert snapshot["advice_backends"] == 9 and snapshot["reason"] == ADD_BAD
    assert snapshot["bad_rate"] == pytest.approx(0.5) and snapshot["backends"] == 4


def test_an_idle_cluster_is_advised_to_release_backends() -> None:
    tracker = AdviceTracker.for_cluster(cluster(max_release_fraction=1.0), 0.0)
    assert tracker is not None
    feed(tracker, 5, rate=1000, bad_share=0.0, busy_per_backend=0.25)
    snapshot = tracker.snapshot()
    assert snapshot["reason"] == RELEASE_IDLE and snapshot["advice_backends"] == 2
    assert snapshot["idle_fraction"] == pytest.approx(0.75)


def test_a_counter_reset_counts_from_zero() -> None:
    tracker = AdviceTracker.for_cluster(cluster(), 0.0)
    assert tracker is not None
    tracker.observe(0.0, stats(5000, 0, [100.0] * 4))
    tracker.observe(1.0, stats(100, 0, [0.5] * 4))  # reset by a poller; backends restarted
    window = tracker.autoscaler._window(1.0, 2.0)
    assert (window.offered, window.busy_s) == (100, 2.0)


def test_the_advice_is_exported_as_gauges_only_when_enabled() -> None:
    tracker = AdviceTracker.for_cluster(cluster(), 0.0)
    assert tracker is not None
    feed(tracker, 3, rate=1000, bad_share=0.5, busy_per_backend=1.0)
    answer = stats(0, 0, [0.0] * 4) | {"autoscale": tracker.snapshot()}
    families = {f.name: f for f in cluster_families("frontend-0", answer, frozenset({"m"}))}
    advice = families["zserve_autoscale_backends_advice"].samples[0]
    assert advice.value == 8.0 and advice.labels == {"frontend": "frontend-0"}
    assert families["zserve_autoscale_backends"].samples[0].value == 4.0
    plain = {f.name for f in cluster_families("frontend-0", stats(0, 0, [0.0]), frozenset())}
    assert not any(name.startswith("zserve_autoscale") for name in plain)
    assert AdviceTracker.for_cluster(parse_config({"models": MODELS}), 0.0) is None


@pytest.mark.parametrize(("document", "path"), [
    ({"autoscale": {"enabled": True, "max_backends": 2}, "backends": {"count": 3}},
     "backends.count"),
    ({"autoscale": {"min_backends": 4, "max_backends": 2}}, "autoscale.min_backends"),
    ({"autoscale": {"add_bad_rate": 1.0}}, "autoscale.add_bad_rate"),
    ({"autoscale": {"up_window_s": 0.0}}, "autoscale.up_window_s"),
    ({"autoscale": {"enabled": True, "max_backends": 4}, "backends": {"devices": ["cpu"]}},
     "backends.devices"),
    ({"autoscale": {"min_backend": 1}}, "autoscale.min_backend"),
])
def test_bad_autoscale_keys_are_one_line_errors_naming_the_key(document: dict[str, Any],
                                                               path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"models": MODELS} | document)
    assert str(caught.value).startswith(path) and "\n" not in str(caught.value)
