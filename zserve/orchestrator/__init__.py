"""Orchestration's pure logic: the models' memory (static and dynamic), device-kind memory budgets
and the overcommit check (:mod:`zserve.orchestrator.memory`), the sub-cluster partitioning MILP
of Symphony's Appendix A.1 (:mod:`zserve.orchestrator.partition`), and the decisions over time
that use them: on-demand loads, evictions, idle unloads and periodic re-plans
(:mod:`zserve.orchestrator.replanner`). No I/O: callers pass numbers and a clock reading in and
read decisions back. docs/orchestration.md describes them."""
