"""An open Poisson stream is not taken for closed-loop clients on two chance windows: the policy
grid's mix3 x4 cell at 208 r/s, where InceptionResNetV2's finish windows were drowned but two,
which read 0.68, while its learned window read 0.03 over 14 batches (``ECHO_STREAM_SHARE``). With
the verdict held its batches ran at once, one row each, and the GPUs were 0.49 busy against a
load-proportional 0.23. Simulated with the same seeded arrivals each run."""

from __future__ import annotations

from zserve.loadgen.experiments import policy_grid as grid
from zserve.loadgen.experiments.simulated import sim_probe

PROBE_RPS = 208.0
QUICK_WINDOWS_S = (0.5, 1.0, 0.25)


def test_a_poisson_stream_keeps_load_proportional_gpu_use_at_a_quarter_load() -> None:
    make = grid._workload("mix3-4", 4, [grid.RESNET50, grid.IRV2, grid.MOBILENET],
                          windows_s=QUICK_WINDOWS_S)
    report = sim_probe(make("deferred"), PROBE_RPS, bail=False)
    # a quarter of the cell's goodput, where the GPUs are 0.91 busy: about 0.23 here
    assert report["gpu_busy_fraction"] < 0.35, report["gpu_busy_fraction"]
    assert report["batch_size"]["median"] > 1
