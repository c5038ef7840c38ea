"""Orchestration's pure logic: the models' memory (static and dynamic), device-kind memory budgets
and the overcommit check (:mod:`zserve.orchestrator.memory`), and the sub-cluster partitioning MILP
of Symphony's Appendix A.1 (:mod:`zserve.orchestrator.partition`), and memory-aware placement of
models on GPUs (:mod:`zserve.orchestrator.placement`). No I/O: callers pass numbers
in and read assignments back. docs/orchestration.md describes them."""
