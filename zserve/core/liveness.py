"""How often every role process proves it is alive, the one interval all liveness timeouts scale.

Each role heartbeats its supervisor (``zserve.runtime.control_link``) and each backend its rank
at this interval; a peer silent for a few intervals is taken for gone (the rank's backend
timeout, a restarted rank's rejoin grace).
"""

HEARTBEAT_INTERVAL_S = 0.5

# A judge of silence (the rank's backend timeout, a shard's plan acknowledgements) whose own loop
# ran this much later than its timer asked was stalled itself: on a loaded host the peers it
# judges were stalled too, and their messages are late for the same reason. The stall beyond
# this is credited to them (the silence it did not see does not count); a peer dead for good is
# still removed once silent for its timeout of the judge's running time. 50 ms is far beyond a
# timer's precision (~0.1 ms) and an idle host's longest stall (26 ms, docs/performance.md,
# "Host stalls").
JUDGE_STALL_MIN_S = 0.05


def stall_credit_s(late_s: float) -> float:
    """How much of a judge's own lateness ``late_s`` (its loop ran that long after its timer was
    due) is credited to the peers it judges: all of it from JUDGE_STALL_MIN_S on, else none."""
    return late_s if late_s >= JUDGE_STALL_MIN_S else 0.0
