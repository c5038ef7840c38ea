"""A DEALER whose peer is not bound yet (a role started before the one it connects to, or a peer
restarting) keeps retrying at most ``RECONNECT_INTERVAL_MAX_MS`` apart, read from ZeroMQ's own
monitor events, and its queued messages arrive once the peer binds.

The cap is how late a connection comes up after its peer appears. It was 5 s: in
``test_runtime_cluster.py::test_roles_started_alone_form_a_cluster`` on a loaded machine (1 run in
12) the backend started 8 s before the frontend, its DEALER to the frontend's data socket was
retrying 5 s apart by then, and the first request's inputs could not be fetched within its 2 s SLO
(``DEADLINE``, which the test does not retry)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from zserve.transport.messages import Hello
from zserve.transport.socket_io import sync_send
from zserve.transport.sockets import RECONNECT_INTERVAL_MAX_MS, make_dealer, make_router

# A fraction of the shortest SLO the standalone-roles test and the demo use (2 s and 200 ms
# with margin for the hop): the longest a connection may take to come up after its peer binds.
RECONNECT_BOUND_MS = 500
# Enough retries for the backoff to pass the bound had it kept doubling (100, 200, 400, 800).
RETRIES = 5
WAIT_MS = 20_000


def test_a_dealer_retries_a_missing_peer_within_the_bound(tmp_path: Path) -> None:
    ctx: zmq.Context[zmq.Socket[Any]] = zmq.Context()
    address = f"ipc://{tmp_path}/late.data"
    dealer = make_dealer(ctx, address, identity=b"backend-0")
    monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED)
    monitor.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    router = None
    try:
        sync_send(dealer, Hello(role="backend", name="backend-0", pid=1))  # queued meanwhile
        # The value of a CONNECT_RETRIED event is the interval before the next attempt.
        intervals = [int(recv_monitor_message(monitor)["value"]) for _ in range(RETRIES)]
        assert max(intervals) <= RECONNECT_INTERVAL_MAX_MS <= RECONNECT_BOUND_MS, (
            f"a missing peer is retried {intervals} ms apart: a connection comes up that late "
            "after its peer binds")
        router, _ = make_router(ctx, address, name="late data")
        router.setsockopt(zmq.RCVTIMEO, WAIT_MS)
        identity, payload = router.recv_multipart()[:2]
        assert identity == b"backend-0" and payload, "the queued message never arrived"
    finally:
        dealer.disable_monitor()
        monitor.close(linger=0)
        dealer.close(linger=0)
        if router is not None:
            router.close(linger=0)
        ctx.term()
