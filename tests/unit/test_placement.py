"""Memory-aware placement (zserve.orchestrator.placement): partitioned, random-search and
round-robin placements of the A100 zoo fit every GPU's memory and place every model; an
overcommitted or incomplete placement is refused with one line before anything loads."""

from __future__ import annotations

import time

import numpy as np
import pytest

from zserve.loadgen.experiments.common import ZOO_CSV
from zserve.loadgen.zoo import load_zoo_csv
from zserve.orchestrator.memory import GIB_BYTES, ModelMemory, placement_bytes, zoo_model_memory
from zserve.orchestrator.placement import (
    Device,
    ModelDemand,
    Placement,
    PlacementError,
    busy_gpus_floor,
    cheapest_kind,
    check_placement,
    gpus_for_rate,
    load_imbalance,
    partitioned_placement,
    random_placement,
    round_robin_placement,
    share_devices,
)


def zoo_demands(rate_rps: float = 500.0) -> list[ModelDemand]:
    return [ModelDemand(zoo_model_memory(r.name, r.alpha_ms, r.beta_ms, r.slo_ms),
                        gpus_for_rate(r.alpha_ms, r.beta_ms, r.slo_ms, rate_rps))
            for r in load_zoo_csv(ZOO_CSV)]


def third_of_zoo_devices(demands: list[ModelDemand], count: int) -> list[Device]:
    """GPUs whose memory holds about a third of the zoo's weights (plus the largest
    activations, with 15% slack)."""
    memories = [d.memory for d in demands]
    budget = int(1.15 * sum(m.static_bytes for m in memories) / 3
                 + max(m.dynamic_bytes for m in memories))
    return [Device(f"gpu-{i}", budget) for i in range(count)]


def assert_fits(placement: Placement, demands: list[ModelDemand],
                devices: list[Device]) -> None:
    memory = {d.name: d.memory for d in demands}
    for device in devices:
        held = [memory[m] for m in placement.models_on.get(device.name, ())]
        assert placement_bytes(held) <= device.budget_bytes, device.name
    assert set(placement.replicas()) == set(memory)


def test_the_partitioned_placement_fits_and_balances_equal_sub_clusters() -> None:
    demands = zoo_demands()
    devices = third_of_zoo_devices(demands, 64)
    placement = partitioned_placement(demands, devices, 3, time_limit_s=0.5)
    assert_fits(placement, demands, devices)
    groups = set(placement.models_on.values())
    assert len(groups) == 3  # three sub-clusters, each device holding all of one's models
    assert sorted(m for g in groups for m in g) == sorted(d.name for d in demands)
    gpus = {g: sum(1 for models in placement.models_on.values() if models == g) for g in groups}
    assert sorted(gpus.values()) == [21, 21, 22]
    load = {d.name: d.load_gpus for d in demands}
    total = sum(load.values())
    for group in groups:  # each group's load within 5% of a third
        assert abs(sum(load[m] for m in group) / total - 1 / 3) < 0.05 / 3


def test_a_proportional_split_gives_busier_groups_more_gpus() -> None:
    demands = zoo_demands()
    devices = third_of_zoo_devices(demands, 64)
    deadline = time.perf_counter() + 0.1
    placement = random_placement(demands, devices, 3, np.random.default_rng(2),
                                 lambda: time.perf_counter() > deadline, proportional=True)
    assert_fits(placement, demands, devices)
    load = {d.name: d.load_gpus for d in demands}
    total = sum(load.values())
    for group in set(placement.models_on.values()):
        gpus = sum(1 for models in placement.models_on.values() if models == group)
        assert abs(gpus - 64 * sum(load[m] for m in group) / total) <= 1.0


def test_the_random_placement_fits_too() -> None:
    demands = zoo_demands()
    devices = third_of_zoo_devices(demands, 64)
    deadline = time.perf_counter() + 0.2
    placement = random_placement(demands, devices, 3, np.random.default_rng(1),
                                 lambda: time.perf_counter() > deadline)
    assert_fits(placement, demands, devices)


def test_round_robin_spreads_replicas_evenly_within_memory() -> None:
    demands = zoo_demands()
    devices = third_of_zoo_devices(demands, 64)
    placement = round_robin_placement(demands, devices, per_device=12)
    assert_fits(placement, demands, devices)
    replicas = placement.replicas()
    assert max(replicas.values()) - min(replicas.values()) <= 3, replicas
    ids = placement.gpu_ids(devices)
    assert sorted(g for gs in ids.values() for g in gs) == sorted(
        i for i, d in enumerate(devices) for _ in placement.models_on[d.name])


def test_an_overcommitted_gpu_is_refused_with_memorys_one_line() -> None:
    demands = zoo_demands()
    devices = [Device("gpu-0", 2 * GIB_BYTES)]
    everything = Placement({"gpu-0": tuple(d.name for d in demands)})
    with pytest.raises(PlacementError) as err:
        check_placement(everything, demands, devices)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("device gpu-0 overcommitted: 37 models need ")
    assert "budget 2.00 GiB; place fewer models on it" in line


def test_a_model_on_no_gpu_and_an_unknown_gpu_are_refused() -> None:
    a = ModelDemand(ModelMemory("a", GIB_BYTES, 0), 1.0)
    b = ModelDemand(ModelMemory("b", GIB_BYTES, 0), 1.0)
    devices = [Device("gpu-0", 4 * GIB_BYTES)]
    with pytest.raises(PlacementError, match=r"^model b is on no device \(1 models unplaced\)"):
        check_placement(Placement({"gpu-0": ("a",)}), [a, b], devices)
    with pytest.raises(PlacementError, match="names device 'gpu-9'"):
        check_placement(Placement({"gpu-9": ("a", "b")}), [a, b], devices)
    # two GPUs that each hold one of two 3 GiB models, never both: round-robin places them apart
    big = [ModelDemand(ModelMemory(n, 3 * GIB_BYTES, 0), 1.0) for n in "ab"]
    two = [Device("gpu-0", 4 * GIB_BYTES), Device("gpu-1", 4 * GIB_BYTES)]
    assert round_robin_placement(big, two, per_device=2).models_on == {
        "gpu-0": ("a",), "gpu-1": ("b",)}
    with pytest.raises(PlacementError, match=r"^model b is on no device"):
        round_robin_placement(big, two[:1], per_device=2)


def test_a_partition_that_cannot_fit_is_refused() -> None:
    demands = zoo_demands()
    devices = [Device(f"gpu-{i}", GIB_BYTES) for i in range(8)]  # a third of 6 GiB won't fit
    with pytest.raises(PlacementError, match=r"^no partition into 3 sub-clusters fits: "):
        partitioned_placement(demands, devices, 3, time_limit_s=0.2)


def test_devices_are_shared_in_proportion_with_at_least_one_each() -> None:
    assert share_devices([1.0, 1.0, 2.0], 8) == [2, 2, 4]
    assert share_devices([100.0, 0.0, 0.0], 5) == [3, 1, 1]
    assert sum(share_devices([0.3, 0.3, 0.4], 7)) == 7
    with pytest.raises(PlacementError, match="3 sub-clusters need at least 3 devices"):
        share_devices([1.0, 1.0, 1.0], 2)


def test_a_rate_needs_the_gpus_its_largest_timely_batch_keeps_busy() -> None:
    # l(b) = b + 5 ms, SLO 25 ms, 1,000 r/s (1 ms apart): b + 5 + b <= 25 gives b = 10, and
    # 1,000 r/s at l(10) / 10 = 1.5 ms each keeps 1.5 GPUs busy
    assert gpus_for_rate(1.0, 5.0, 25.0, 1000.0) == pytest.approx(1.5)
    # a higher rate fills larger batches: more throughput per GPU
    assert gpus_for_rate(1.0, 5.0, 25.0, 4000.0) < 4 * gpus_for_rate(1.0, 5.0, 25.0, 1000.0)
    # a kind whose batch of one misses the SLO cannot serve the model at all
    assert gpus_for_rate(1.0, 25.0, 25.0, 10.0) == float("inf")
    assert gpus_for_rate(1.0, 5.0, 25.0, 0.0) == 0.0


def test_the_floor_batches_as_large_as_the_rate_can_fill_in_time() -> None:
    # l(b) = b + 5 ms, SLO 26 ms, 1,000 r/s: the batch's first request waits for the b - 1
    # after it, b + 5 + (b - 1) <= 26 gives b = 11 (the sizing estimate's b + 5 + b: 10), and
    # 1,000 r/s at l(11) / 11 ms each keeps 16 / 11 GPUs busy
    assert busy_gpus_floor(1.0, 5.0, 26.0, 1000.0) == pytest.approx(16 / 11)
    assert gpus_for_rate(1.0, 5.0, 26.0, 1000.0) == pytest.approx(1.5)
    # never above the estimate, for any rate; a rate split in two (over two kinds, or two
    # pools) fills smaller batches, so the halves together need no less
    for rate in (10.0, 300.0, 1000.0, 7000.0):
        floor = busy_gpus_floor(0.4, 3.0, 30.0, rate)
        assert floor <= gpus_for_rate(0.4, 3.0, 30.0, rate)
        assert 2 * busy_gpus_floor(0.4, 3.0, 30.0, rate / 2) >= floor
    # the profile's cap on the batch holds; a batch of one that misses the SLO: inf
    assert busy_gpus_floor(1.0, 5.0, 26.0, 1000.0, max_batch=2) == pytest.approx(3.5)
    assert busy_gpus_floor(1.0, 25.0, 25.0, 10.0) == float("inf")


def test_the_cheapest_kind_that_meets_the_slo_wins() -> None:
    prices = {"a100": 3.673, "gtx1080ti": 0.526}
    # BERT at 300 r/s (A100 zoo SLO 59 ms): about as many GPUs of either kind, 7x cheaper
    bert = {"a100": gpus_for_rate(7.353, 0.22, 59.0, 300.0),
            "gtx1080ti": gpus_for_rate(7.008, 0.16, 59.0, 300.0)}
    assert cheapest_kind(bert, prices) == "gtx1080ti"
    # EfficientNetB0 (SLO 20 ms): at 300 r/s the 1080 Ti's small batches are cheaper; at 3,000
    # r/s the A100's large batches serve it for less than 13.7x as many 1080 Tis would cost
    def b0(rate: float) -> dict[str, float]:
        return {"a100": gpus_for_rate(0.115, 4.33, 20.0, rate),
                "gtx1080ti": gpus_for_rate(1.569, 5.59, 20.0, rate)}

    assert cheapest_kind(b0(300.0), prices) == "gtx1080ti"
    assert cheapest_kind(b0(3000.0), prices) == "a100"
    # a kind whose batch of one misses the SLO is never chosen; none that meets it: None
    assert cheapest_kind({"a100": 2.0, "gtx1080ti": float("inf")}, prices) == "a100"
    assert cheapest_kind({"gtx1080ti": float("inf")}, prices) is None


def test_load_imbalance_splits_each_models_load_over_its_devices() -> None:
    a = ModelDemand(ModelMemory("a", GIB_BYTES, 0), 2.0)
    b = ModelDemand(ModelMemory("b", GIB_BYTES, 0), 1.0)
    # a over two devices (1 each), b on the third: balanced
    assert load_imbalance(Placement({"g0": ("a",), "g1": ("a",), "g2": ("b",)}), [a, b]) == 0.0
    # a and b on one device each: 2 and 1 around a mean of 1.5
    assert load_imbalance(Placement({"g0": ("a",), "g1": ("b",)}), [a, b]) == pytest.approx(
        1 / 1.5)
