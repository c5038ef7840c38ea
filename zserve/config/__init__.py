"""Configuration: what a cluster and its models are.

cluster.toml and its typed decoding, latency profiles, model signatures, policy names.
"""
