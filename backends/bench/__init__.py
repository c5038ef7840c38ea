"""Benchmarks of the backend process: the latency of each hop."""
