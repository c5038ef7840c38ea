"""The peer process of ``zserve bench-transport`` (``zserve.transport.bench.throughput``), and the
phase protocol both sides speak.

The measuring side sends a ``Phase`` (what to send, how, for how long); the peer runs it (flood,
echo, spaced sends or the sleeps alone), ends it with the ``END`` marker and, where the phase
measures the sender, reports its CPU seconds after it (``CPU``). ``peer_main`` is the spawned
process's entry point, with sync or asyncio sockets.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from zserve.transport.codec import encode
from zserve.transport.curve import CurveClient
from zserve.transport.messages import CandidateUpdate, InferRequest, Message, Shutdown
from zserve.transport.socket_io import async_recv, async_send, sync_recv, sync_send
from zserve.transport.sockets import make_dealer

PEER_IDENTITY = b"bench-peer"
# The peer checks the clock once per this many small sends, so the clock is not what we measure
# (and before every array send, where it costs nothing in comparison).
CLOCK_CHECK_EVERY = 64
# At least this many messages per phase even when one takes longer than the phase.
MIN_MESSAGES_PER_PHASE = 3
T = TypeVar("T")
ACK = b"ACK"
END = b"END"
CPU = b"CPU"  # the sender's CPU seconds for the phase, sent after the end marker
RCVMORE = int(zmq.RCVMORE)  # as the codec passes it: a plain int, not the enum member
END_MESSAGE = Shutdown(reason="bench-end", drain_s=0.0)


def small_message() -> CandidateUpdate:
    return CandidateUpdate(
        model="resnet50", batch_size=8, exec_at=1234.5678, latest=1234.6, send_delay=0.00021
    )


def array_message(size_bytes: int) -> InferRequest:
    array = np.random.default_rng(0).random(size_bytes // 4, dtype=np.float32)
    return InferRequest(request_id=1, model="resnet50", inputs={"input": array}, slo_ms=50.0)


def bare_frames(message: Message) -> list[Any]:
    """The codec's frames, encoded once: bare pyzmq sends these same bytes without the codec."""
    return list(encode(message))


@dataclass(frozen=True)
class Phase:
    """One streaming phase: what the peer sends and how."""

    op: str  # "flood", "echo", "spaced" (sleep, send; codec only) or "sleep" (the sleeps alone)
    mode: str  # "bare" or "codec"
    size_bytes: int  # 0 for the small message
    duration_s: float = 0.0
    window: int = 1
    ack_every: int = 1
    round_trips: int = 0
    gap_s: float = 0.0
    count: int = 0

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self))

    @staticmethod
    def unpack(data: bytes) -> Phase:
        return Phase(**msgpack.unpackb(data))

    def message(self) -> Message:
        return array_message(self.size_bytes) if self.size_bytes else small_message()


def pack_seconds(seconds: float) -> bytes:
    return struct.pack("!d", seconds)



# --------------------------------------------------------------------------- the peer process


def peer_main(endpoint: str, io: str, curve: CurveClient | None = None) -> None:
    """Entry point of the spawned peer: connect (a CURVE client with ``curve``), say hello, run
    phases until told to quit."""
    if io == "sync":
        ctx = zmq.Context()
        sock = make_dealer(ctx, endpoint, identity=PEER_IDENTITY, curve=curve)
        try:
            _peer_loop_sync(sock)
        finally:
            sock.close(linger=0)
            ctx.term()
    else:
        run_on_uvloop(_peer_loop_async(endpoint, curve))


def _peer_loop_sync(sock: zmq.Socket[Any]) -> None:
    sock.send(b"hello")
    while True:
        command = sock.recv_multipart()
        if command[0] == ACK:  # a late ack of the previous phase
            continue
        if command[0] == b"quit":
            return
        phase = Phase.unpack(command[1])
        if phase.op == "flood":
            _peer_flood_sync(sock, phase)
        elif phase.op in ("spaced", "sleep"):
            _peer_spaced_sync(sock, phase)
        else:
            _peer_echo_sync(sock, phase)


def _peer_flood_sync(sock: zmq.Socket[Any], phase: Phase) -> None:
    message = phase.message()
    frames = bare_frames(message)
    codec = phase.mode == "codec"
    check_every = 1 if phase.size_bytes else CLOCK_CHECK_EVERY
    sent = acked = 0
    cpu_started = time.process_time()
    deadline = time.monotonic() + phase.duration_s
    while True:
        if sent - acked >= phase.window:
            sock.recv()  # blocks until the receiver has caught up by ack_every messages
            acked += phase.ack_every
            continue
        if (
            sent % check_every == 0
            and sent >= MIN_MESSAGES_PER_PHASE
            and time.monotonic() >= deadline
        ):
            break
        if codec:
            sync_send(sock, message)
        elif len(frames) == 1:
            sock.send(frames[0])  # what sync_send does with a one-frame message
        else:
            sock.send_multipart(frames, copy=False)  # pyzmq copies parts < 64 KiB itself
        sent += 1
    if codec:
        sync_send(sock, END_MESSAGE)
    else:
        sock.send(END)
    sock.send_multipart([CPU, pack_seconds(time.process_time() - cpu_started)])


def _peer_spaced_sync(sock: zmq.Socket[Any], phase: Phase) -> None:
    """Sleep ``gap_s`` and send one small message, ``count`` times ("sleep": the sleeps alone),
    then the end marker and this process's CPU seconds over the loop."""
    message = phase.message()
    sends = phase.op == "spaced"
    cpu_started = time.process_time()
    for _ in range(phase.count):
        time.sleep(phase.gap_s)
        if sends:
            sync_send(sock, message)
    cpu_s = time.process_time() - cpu_started
    sync_send(sock, END_MESSAGE)
    sock.send_multipart([CPU, pack_seconds(cpu_s)])


def _peer_echo_sync(sock: zmq.Socket[Any], phase: Phase) -> None:
    for _ in range(phase.round_trips):
        if phase.mode == "codec":
            _, message = sync_recv(sock, router=False)
            sync_send(sock, message)
        else:
            sock.send_multipart(sock.recv_multipart())


async def _peer_loop_async(endpoint: str, curve: CurveClient | None) -> None:
    ctx = zmq.asyncio.Context()
    sock = make_dealer(ctx, endpoint, identity=PEER_IDENTITY, curve=curve)
    try:
        await sock.send(b"hello")
        while True:
            command = await sock.recv_multipart()
            if command[0] == ACK:
                continue
            if command[0] == b"quit":
                return
            phase = Phase.unpack(command[1])
            if phase.op == "flood":
                await _peer_flood_async(sock, phase)
            else:
                await _peer_echo_async(sock, phase)
    finally:
        sock.close(linger=0)
        ctx.term()


async def _peer_flood_async(sock: zmq.asyncio.Socket, phase: Phase) -> None:
    message = phase.message()
    frames = bare_frames(message)
    codec = phase.mode == "codec"
    check_every = 1 if phase.size_bytes else CLOCK_CHECK_EVERY
    sent = acked = 0
    cpu_started = time.process_time()
    deadline = time.monotonic() + phase.duration_s
    while True:
        if sent - acked >= phase.window:
            await sock.recv()
            acked += phase.ack_every
            continue
        if (
            sent % check_every == 0
            and sent >= MIN_MESSAGES_PER_PHASE
            and time.monotonic() >= deadline
        ):
            break
        if codec:
            await async_send(sock, message)
        else:
            await sock.send_multipart(frames, copy=False)
        sent += 1
    if codec:
        await async_send(sock, END_MESSAGE)
    else:
        await sock.send(END)
    await sock.send_multipart([CPU, pack_seconds(time.process_time() - cpu_started)])


async def _peer_echo_async(sock: zmq.asyncio.Socket, phase: Phase) -> None:
    for _ in range(phase.round_trips):
        if phase.mode == "codec":
            _, message = await async_recv(sock, router=False)
            await async_send(sock, message)
        else:
            await sock.send_multipart(await sock.recv_multipart())


def run_on_uvloop(main: Coroutine[Any, Any, T]) -> T:
    """Every zserve process runs on uvloop, so the asyncio figures are measured there."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main)
