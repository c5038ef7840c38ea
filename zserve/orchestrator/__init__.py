"""Orchestration's pure logic: the models' memory (static and dynamic), device-kind memory budgets
and the overcommit check (:mod:`zserve.orchestrator.memory`), the sub-cluster partitioning MILP
of Symphony's Appendix A.1 (:mod:`zserve.orchestrator.partition`), memory-aware placement of
models on GPUs (:mod:`zserve.orchestrator.placement`), each model's device kind priced at whole
GPUs per kind (:mod:`zserve.orchestrator.kind_plan`), the decisions over time that use them
(on-demand loads, evictions, idle unloads and periodic re-plans:
:mod:`zserve.orchestrator.replanner`) and the autoscaling advice
(:mod:`zserve.orchestrator.autoscale`). No I/O: callers pass numbers and a clock reading in
and read decisions back. docs/orchestration.md describes them."""
