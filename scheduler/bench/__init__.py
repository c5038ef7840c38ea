"""``zserve bench-scheduler``: scheduler-only throughput."""
