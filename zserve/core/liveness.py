"""How often every role process proves it is alive, the one interval all liveness timeouts scale.

Each role heartbeats its supervisor (``zserve.runtime.control_link``) and each backend its rank
at this interval; a peer silent for a few intervals is taken for gone (the rank's backend
timeout, a restarted rank's rejoin grace).
"""

HEARTBEAT_INTERVAL_S = 0.5
