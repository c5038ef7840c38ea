"""Open-loop load generator, workloads, goodput search and reports."""
