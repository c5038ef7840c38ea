"""Which way to drain an edge-triggered ZeroMQ socket costs the least CPU per message.

``python -m zserve.transport.bench.reactor_drain`` sends small messages from a DEALER to a ROUTER
(one process, ipc://, no event loop: only the receive path is timed) and drains them with each
candidate strategy, in interleaved rounds, and prints the CPU time per message of each:

- ``events``: ask ``getsockopt(EVENTS) & POLLIN`` before every receive;
- ``poll``: receive first (the FD fired, so a message is all but certain), then ``zmq_poll``
  with timeout 0 before every further receive;
- ``recv``: receive until it fails with EAGAIN;
- ``hybrid``: receive first, ask ``zmq_poll`` once, and if more came receive until EAGAIN (a
  lone message costs one poll, a flood one failing receive per chunk).

"flood": 20,000 messages queued, drained in chunks of up to 512; "spaced": one message at a time
(each wait for input, then one drain): the cost an idle connection pays per message. The reactor
(``zserve.transport.reactor``) uses the winner.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq

_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
CHUNK = 512

Drain = Callable[[zmq.Socket[Any], list[tuple[zmq.Socket[Any], int]]], int]


def _recv_message(sock: zmq.Socket[Any]) -> list[Any]:
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def drain_events(sock: zmq.Socket[Any], _items: list[tuple[zmq.Socket[Any], int]]) -> int:
    getsockopt: Callable[[int], int] = sock.getsockopt  # type: ignore[assignment]
    count = 0
    while count < CHUNK and getsockopt(_EVENTS) & _POLLIN:
        _recv_message(sock)
        count += 1
    return count


def drain_poll(sock: zmq.Socket[Any], items: list[tuple[zmq.Socket[Any], int]]) -> int:
    count = 0
    try:
        while count < CHUNK and (count == 0 or zmq.zmq_poll(items, 0)):
            _recv_message(sock)
            count += 1
    except zmq.Again:
        pass
    return count


def drain_recv(sock: zmq.Socket[Any], _items: list[tuple[zmq.Socket[Any], int]]) -> int:
    count = 0
    try:
        while count < CHUNK:
            _recv_message(sock)
            count += 1
    except zmq.Again:
        pass
    return count


def drain_hybrid(sock: zmq.Socket[Any], items: list[tuple[zmq.Socket[Any], int]]) -> int:
    count = 0
    try:
        while count < CHUNK and (count != 1 or zmq.zmq_poll(items, 0)):
            _recv_message(sock)
            count += 1
    except zmq.Again:
        pass
    return count


STRATEGIES: dict[str, Drain] = {"events": drain_events, "poll": drain_poll, "recv": drain_recv,
                                "hybrid": drain_hybrid}


def _flood(router: zmq.Socket[Any], dealer: zmq.Socket[Any], drain: Drain, count: int) -> float:
    """CPU seconds per message to drain ``count`` queued messages."""
    payload = [b"header-of-a-small-message", b"x" * 64]
    for _ in range(count):
        dealer.send_multipart(payload)
    items = [(router, _POLLIN)]
    got = 0
    cpu = 0.0
    while got < count:
        router.poll(1000, zmq.POLLIN)  # waiting is not timed: only the drains are
        started = time.process_time()
        got += drain(router, items)
        cpu += time.process_time() - started
    return cpu / count


def _spaced(router: zmq.Socket[Any], dealer: zmq.Socket[Any], drain: Drain, count: int) -> float:
    """CPU seconds per message when each message is drained alone."""
    payload = [b"header-of-a-small-message", b"x" * 64]
    items = [(router, _POLLIN)]
    cpu = 0.0
    for _ in range(count):
        dealer.send_multipart(payload)
        router.poll(1000, zmq.POLLIN)
        started = time.process_time()
        got = drain(router, items)
        cpu += time.process_time() - started
        assert got == 1
    return cpu / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zserve.transport.bench.reactor_drain")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flood", type=int, default=20_000, help="messages per flood round")
    parser.add_argument("--spaced", type=int, default=5_000, help="messages per spaced round")
    args = parser.parse_args(argv)
    ctx: zmq.Context[Any] = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{tmp}/bench")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, 0)
        router.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(f"ipc://{tmp}/bench")
        results: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for name, drain in STRATEGIES.items():
                results.setdefault(("flood", name), []).append(
                    _flood(router, dealer, drain, args.flood))
                results.setdefault(("spaced", name), []).append(
                    _spaced(router, dealer, drain, args.spaced))
        router.close(0)
        dealer.close(0)
    ctx.term()
    print(f"receive path, CPU per message (median of {args.rounds} interleaved rounds)")
    for mode in ("flood", "spaced"):
        for name in STRATEGIES:
            per_msg = statistics.median(results[(mode, name)])
            print(f"  {mode:6s} {name:6s} {per_msg * 1e6:6.2f} us/msg  "
                  f"{1 / per_msg / 1e3:8.0f} k msgs/s of CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
