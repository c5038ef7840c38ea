"""Applications: DAGs of models under one end-to-end latency SLO, and how to plan them.

Pure logic, no I/O (the import contract keeps zmq, asyncio and the runtime out):

- :mod:`zserve.apps.dag`: the application model (stages, a fan-out factor per edge, one SLO),
  per-stage rates and the critical path.
- :mod:`zserve.apps.configs`: a module configuration (device kind, batch size, duration, price),
  machine groups and module plans, and the worst-case latency estimators (TC, per-config, RR).
- :mod:`zserve.apps.module_plan`: one module's plan at a latency budget (Harpagon's Algorithm 1,
  dummy requests, the one- and two-tuple baselines) and the exact per-module search.
- :mod:`zserve.apps.split`: the SLO splitters (Harpagon's latency-cost greedy with node merging
  and cost-direct, throughput-greedy, even, Nexus's quantised dynamic program).
- :mod:`zserve.apps.harpagon`: the planners (Harpagon and the Nexus-, Scrooge-, InferLine- and
  Clipper-like baselines) and the brute-force optima (best split; whole plan family).
- :mod:`zserve.apps.tc_dispatch`: the throughput-cost batch dispatcher and per-stage
  discrete-event runs of a plan (Theorem 1's case, one stream, Poisson arrivals).

docs/apps.md explains them for a newcomer.
"""
