"""A whole cluster.

The supervisor and its children, the preflight checks, ``zserve up / down / status``.
"""
