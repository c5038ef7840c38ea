"""A shard's profiles by device kind (zserve.scheduler.kind_profiles): a model's own profile is the
slowest registered one, element-wise, as before kinds; a GPU of an announced kind whose profile
differs is listed with its kind's profile; one kind, or none, lists none."""

from __future__ import annotations

import pytest

from zserve.scheduler.kind_profiles import merge_profiles, served_profiles
from zserve.transport.messages import BackendTable

SLOW_MS = [10.0, 12.0, 14.0, 16.0]  # a GTX 1080 Ti's l(1..4)
SLOWER_MS = [11.0, 12.5, 14.0, 15.0]  # another of the kind: its profile merges in
FAST_MS = [2.0, 2.3, 2.6, 2.9]  # an A100's


def _table(kinds: list[str], profiles: list[dict[str, list[float]]]) -> BackendTable:
    n = len(profiles)
    return BackendTable(gpu_ids=list(range(n)), names=[f"backend-{i}" for i in range(n)],
                        addresses=[f"ipc://b{i}" for i in range(n)],
                        models=[sorted(p) for p in profiles], profiles_ms=profiles,
                        kinds=kinds)


def test_a_gpu_of_another_kind_plans_with_that_kinds_profile() -> None:
    table = _table(["gtx1080ti", "gtx1080ti", "a100"],
                   [{"m": SLOW_MS}, {"m": SLOWER_MS}, {"m": FAST_MS, "other": FAST_MS}])
    found = served_profiles(table, {"m": 4})
    assert found.served == {"m": [0, 1, 2], "other": [2]}
    slowest = [11.0, 12.5, 14.0, 16.0]
    assert found.own["m"].latency_ms_list() == pytest.approx(slowest)
    # the 1080 Tis' merged profile is the model's own: only the A100 is listed
    assert list(found.by_gpu["m"]) == [2]
    assert found.by_gpu["m"][2].latency_ms_list() == pytest.approx(FAST_MS)
    # a model this shard does not own has no profiles here; a max batch caps the profile
    assert "other" not in found.own
    capped = served_profiles(table, {"m": 2})
    assert capped.own["m"].latency_ms_list() == pytest.approx(slowest[:2])
    assert capped.by_gpu["m"][2].latency_ms_list() == pytest.approx(FAST_MS[:2])


@pytest.mark.parametrize("kinds", [[], ["", ""], ["a100", "a100"]])
def test_one_kind_or_none_lists_no_gpu(kinds: list[str]) -> None:
    """No kinds announced (an older table, or backends with none), or one kind: every GPU
    plans with the model's own profile, the slowest of all, as before kinds."""
    found = served_profiles(_table(kinds, [{"m": SLOW_MS}, {"m": FAST_MS}]), {"m": 8})
    assert found.by_gpu == {}
    assert found.own["m"].latency_ms_list() == pytest.approx(SLOW_MS)
    assert found.own["m"].latency_ms_list() == pytest.approx(
        merge_profiles([SLOW_MS, FAST_MS], 8).latency_ms_list())  # type: ignore[union-attr]


def test_a_model_registered_without_a_profile_has_none_from_the_table() -> None:
    found = served_profiles(_table(["a100"], [{}]), {"m": 4})
    assert found.own == {} and found.by_gpu == {}
    table = BackendTable(gpu_ids=[0], names=["backend-0"], addresses=["ipc://b0"],
                         models=[["m"]])
    assert served_profiles(table, {"m": 4}).served == {"m": [0]}
