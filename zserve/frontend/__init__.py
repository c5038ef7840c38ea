"""The frontend role.

Its pure core and the parts the core owns, its process host, its metrics and readiness.
"""
