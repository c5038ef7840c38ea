"""What wraps a role process.

Its runner, arguments, control link to the supervisor, cluster clock, timers and CURVE keys.
"""
