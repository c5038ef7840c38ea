"""Benchmarks of the host and of the load generator itself.

Wake-ups and stalls, the generator's own ceiling, what a scrape costs, the echo stand-in.
"""
