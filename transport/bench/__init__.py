"""``zserve bench-transport`` and the transport's other benchmarks."""
