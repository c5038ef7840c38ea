"""``zserve experiment NAME [--live] [--quick] [--out DIR]``: the performance experiments.

One command per experiment; each prints its figures as tables, writes ``DIR/NAME/result.json``
(schema ``zserve-experiment/1``, below) and PNG plots next to it. ``docs/performance.md`` quotes
the full runs and says how to read them.

``fig6a``
    Symphony Figure 6a: 10 identical models (alpha 1 ms, beta 1..15 ms, SLO = 2*l(8)) on 32
    simulated GPUs, Poisson, equal popularity. Goodput (search) under deferred, frontrun (Algorithm
    1 as written), eager and timeout (the best of a few fractions of the SLO) for every beta, and
    the eager/deferred and timeout/deferred ratios. Then, on a scaled-down
    shape (8 GPUs, 3 models), that the eager/deferred ratio does not change when every time in
    the workload is multiplied by the dilation factor (10), and with ``--live`` the same dilated
    shape on a live cluster of emulated GPUs next to its simulated twin.
``zoo``
    The 37-model A100 zoo on 64 simulated GPUs: deferred vs frontrun vs eager vs timeout (a sweep
    of the timeout fraction, as in Figure 6b) and their ratios to deferred.
``flattop``
    Symphony section 3.5: offered load from 0.1x to 2x of the deferred goodput on 24 simulated
    GPUs (four zoo models), per point goodput, bad rate and GPU busy fraction, for deferred and
    (same offered rates) frontrun and eager; the checks "goodput beyond the peak stays >= 95% of
    the peak", "no collapse after the highest good rate" and "busy fraction grows with load"
    (deferred's are the experiment's; the others' are kept for contrast). ``--live`` adds an
    8-GPU emulated cluster (ResNet50's profile dilated 20x) next to its simulated twin.
``eager-floor``
    A grid of small cases (GPUs x models x beta/alpha x SLO multiple) in the simulator:
    deferred/eager (and frontrun/eager) goodput per cell and the minimum (Symphony section 3.4.2
    claims >= 0.95).
``policy-grid``
    The default against frontrun, eager, eager-edf and the best timeout over single models,
    Figure 6a's shapes, 3- and 10-model mixes, the 37-model zoo and network delays (goodput,
    ratios, median batch, GPU busy; the check: default >= max(frontrun, eager) - 1% everywhere),
    and light load (busy fraction and p50 from 0.05x to 1x of the goodput). ``--only TEXT`` runs
    the cells whose name contains TEXT.
``random-family``
    The default against frontrun and eager on 30 workloads drawn by seed from the A100 and GTX
    1080 Ti zoo profiles (2-16 models, 1 GPU per model down to a quarter of that, equal to
    one-dominant popularity, SLOs of 2-10x l(1), Poisson and bursty arrivals, with and without
    allowances), each judged by bad-rate curves at rates common to every policy rather than by
    one search (the check: default >= max(frontrun, eager) - 1% on every member). ``--only
    TEXT`` runs the members whose name contains TEXT.
``scale``
    ``zserve bench-scheduler`` over a models x GPUs sweep (ResNet50's profile, 80% of the
    staggered bound): the scheduler's CPU per simulated second and whether one core keeps up.
``partition``
    Symphony Appendix A.2: 800 zoo model variants (exponential rates, memory from
    zserve.orchestrator.memory) over 20 sub-clusters, 100 instances; the greedy-started HiGHS
    plan's rate and memory imbalance against random search given the same wall time, and a
    re-plan after a rate drift under a disruption budget (C_max = 5% of the model bytes) against
    an unconstrained one. Pure computation, no simulator.

``autoscale``
    Symphony v2 section 5.3 with the autoscaler acting: 10 ResNet50 (1080 Ti) models, SLO 100 ms,
    offered load 0.1x to 2x of the peak of 24 simulated GPUs; each point starts on 24 GPUs and
    the advice (``zserve.orchestrator.autoscale``, hosted by ``zserve.loadgen.sim.elastic``)
    adds and releases GPUs. Checks: good rate >= 98% of the offered load, GPUs in use within 5%
    (or one GPU) of N o / p.
``day``
    Symphony v2 section 5.6's shape: a generated day of 24 models (their own SLOs) on up to 512
    GPUs in a per-step fluid model calibrated by request-level runs, under zserve's advice, Ray
    Serve's default policy, Knative's KPA and an offline oracle; and one compressed hour at
    request level against the fluid model. Checks: GPU-hours <= 1.1x the oracle's, <= 1% bad in
    >= 99% of minutes, at most one change of direction per 10 minutes, the hour's GPU-seconds
    within 10%.
``harpagon``
    Harpagon's planner for DAG applications (``zserve.apps``): the paper's toy examples value for
    value; 1,100 generated (app, rate, SLO) workloads over the zoo's A100 and GTX 1080 Ti at
    fleet's prices, each baseline's (Nexus-, Scrooge-, InferLine-, Clipper-like) cost normalised
    to Harpagon's, ablations, planner run time; Harpagon against the brute-force optimum on small
    cases; every plan's stages simulated with the TC dispatcher. Pure computation.

``nexus``
    The papers' baselines in the simulator (``zserve.loadgen.sim.baselines``): Symphony Table 2's
    Nexus column (ResNet50 and InceptionResNetV2 on 8 GPUs; the check: ``nexus-fill`` within 5% of
    4,027 and 618 r/s, ResNet50's median batch about 6) beside the rate-sized ``nexus`` plan,
    Shepherd's Flex, the Clockwork-like ``eager-edf`` and the default; and the second paper's
    section 5.3 flat top (10 ResNet-like models, 24 GPUs, 0.1x to 2x of the default's goodput)
    with Nexus and ``eager-edf`` beside the default (the check: the default's and Nexus's good
    rate beyond their peak stays >= 95% of it).

``--quick`` shrinks every experiment to well under 30 s (fewer points, a smaller shape, short
windows, coarser search): the same code path, for the tests. ``--live`` adds the live parts
(fig6a, flattop); they start clusters of emulated backends on this machine.

Result JSON::

    {"schema": "zserve-experiment/1", "experiment": NAME, "quick": bool, "live": bool,
     "command": "zserve experiment ...", "started_at": ISO-8601, "wall_s": float,
     "machine": {"cpus", "load_average", "python", "platform"},
     "config": {...what was run...},
     "tables": [{"title", "columns": [...], "rows": [[...], ...]}, ...],
     "checks": [{"name", "passed", "detail"}, ...],
     "plots": [PNG paths], "points": {...raw figures per experiment...}}

Goodput (as everywhere in zserve) is the highest offered rate whose worst per-model bad rate is
<= 1%, found by ``zserve.loadgen.search``; every probe measures at least
``MIN_MEASURED_REQUESTS`` requests (the measure window is stretched at low rates), since a 1% bad
rate over fewer requests decides nothing.
"""
