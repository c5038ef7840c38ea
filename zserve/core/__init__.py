"""The vocabulary every role shares, pure and I/O-free.

Errors, request ids, epochs, the stats schema, grouping by frontend, and the hosting contract.
"""
