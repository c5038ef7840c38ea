"""`zserve bench-transport`: what the transport costs on top of bare pyzmq.

Two processes (the peer is started with multiprocessing *spawn*) talk over a ROUTER/DEALER pair
from the socket factory, over ipc:// and tcp://127.0.0.1, with sync and asyncio sockets:

- small messages: the peer streams ``CandidateUpdate`` messages for a fixed time with a window of
  messages in flight (credit-based: the receiver acks every ``ack_every``), so the figure is
  throughput, not round-trip latency. "bare" sends the same header bytes with plain pyzmq calls;
  "codec" encodes and decodes a typed message per send (sync_send / sync_recv). Each is run
  three times, interleaved, and the median is reported.

  With sync sockets the bare loop makes the very pyzmq calls the codec path makes (``send`` of
  the header bytes; ``recv`` and ``RCVMORE`` frame by frame, the header copied, array frames
  zero-copy), so the difference is the codec alone and not a difference in pyzmq usage. The
  asyncio bare loop is plain ``zmq.asyncio`` ``send_multipart``/``recv_multipart``. Neither
  receiving loop adds per-message work of its own: a silent peer is caught by RCVTIMEO (sync)
  or one deadline per phase (asyncio), not by a poll or a ``wait_for`` per message, which cost
  more than the codec and used to hide part of its overhead.

  How the overhead is computed. Sender and receiver are separate processes, each with its own
  ZeroMQ I/O thread, so the codec's encode cost lands on one side and its decode cost on the
  other. Two figures are reported:

  * ``overhead`` (throughput) = ``1 - codec_rate / bare_rate``, each rate the median of the
    interleaved runs. The rate is set by the busier process, or by the total CPU of both when
    the cores are oversubscribed (four busy threads on a shared 2-core machine), so this is
    what an application sees, but it mixes both sides and the machine's load.
  * per-side CPU: each process measures its own CPU time (``time.process_time``: all its
    threads, ZeroMQ's I/O thread included) over the phase and divides by the messages; the
    sender reports its figure after the end marker. ``+x%`` is ``codec_cpu / bare_cpu - 1`` on
    that side: the codec's share of the work of that process, much less sensitive to other
    load on the machine than the rates.
- round trip: ping-pong of one small message; p50 in microseconds.
- arrays (sync sockets): one float32 array per message, 1 KiB .. 64 MiB, bytes per second.
- spaced messages (ipc, sync sockets, codec): the peer sleeps ``gap`` and sends one small message,
  ``count`` times, so the connection is idle between messages, as it is in a serving process at
  moderate load; then the same sleeps without the sends. Each side's CPU per message (all its
  threads) is the median of interleaved runs, and "one message" is the sender's CPU less the
  sleeps' plus the receiver's. A flood amortises ZeroMQ's wake-ups over many messages; a spaced
  message pays them all: the sender's I/O thread is woken by an eventfd, the receiver's I/O
  thread by the socket and its application thread by another eventfd. On a small VM each wake-up
  costs far more than the message itself (docs/performance.md, "Overhead"), which is what makes
  the per-request CPU of a live cluster at a few thousand requests per second.

Numbers on a shared machine are noisy; run it on an idle one for figures you quote.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import struct
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from zserve.idle_poll import IdlePollers
from zserve.transport.codec import decode, encode
from zserve.transport.messages import CandidateUpdate, InferRequest, Message, Shutdown
from zserve.transport.socket_io import async_recv, async_send, sync_recv, sync_send
from zserve.transport.sockets import LOOPBACK_TCP_ANY_PORT, IpcDir, make_dealer, make_router

KIB = 1024
MIB = 1024 * KIB
ARRAY_SIZES_BYTES = (1 * KIB, 16 * KIB, 256 * KIB, 4 * MIB, 64 * MIB)
# Phase lengths (full run, --quick run): the whole benchmark stays under 60 s (10 s quick).
SMALL_PHASE_S = (0.5, 0.1)
# Small-message phases run this many times, bare and codec interleaved; the median is reported.
SMALL_REPEATS = 3
# Runs of the in-process encode/decode timing; the median is reported.
CODEC_COST_RUNS = 7
ARRAY_PHASE_S = (0.6, 0.08)
ROUND_TRIPS = (2000, 300)
# Credit window: small messages in flight, and bytes in flight for arrays.
SMALL_WINDOW_MESSAGES = 1000
ARRAY_WINDOW_BYTES = 64 * MIB
# At least this many messages per phase even when one takes longer than the phase.
MIN_MESSAGES_PER_PHASE = 3
PEER_START_TIMEOUT_S = 60.0
PHASE_TIMEOUT_S = 60.0
PEER_POLL_INTERVAL_S = 0.1
PEER_IDENTITY = b"bench-peer"
# Spaced messages: the gaps between sends, messages per run (full, --quick), interleaved runs.
SPACED_GAPS_S = (0.0003, 0.001)
SPACED_MESSAGES = (1000, 150)
SPACED_REPEATS = 3
# The peer checks the clock once per this many small sends, so the clock is not what we measure
# (and before every array send, where it costs nothing in comparison).
CLOCK_CHECK_EVERY = 64

_T = TypeVar("_T")
_ACK = b"ACK"
_END = b"END"
_CPU = b"CPU"  # the sender's CPU seconds for the phase, sent after the end marker
_RCVMORE = int(zmq.RCVMORE)  # as the codec passes it: a plain int, not the enum member
_END_MESSAGE = Shutdown(reason="bench-end", drain_s=0.0)


def _small_message() -> CandidateUpdate:
    return CandidateUpdate(
        model="resnet50", batch_size=8, exec_at=1234.5678, latest=1234.6, send_delay=0.00021
    )


def _array_message(size_bytes: int) -> InferRequest:
    array = np.random.default_rng(0).random(size_bytes // 4, dtype=np.float32)
    return InferRequest(request_id=1, model="resnet50", inputs={"input": array}, slo_ms=50.0)


def _bare_frames(message: Message) -> list[Any]:
    """The codec's frames, encoded once: bare pyzmq sends these same bytes without the codec."""
    return list(encode(message))


@dataclass(frozen=True)
class _Phase:
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
    def unpack(data: bytes) -> _Phase:
        return _Phase(**msgpack.unpackb(data))

    def message(self) -> Message:
        return _array_message(self.size_bytes) if self.size_bytes else _small_message()


# --------------------------------------------------------------------------- the peer process


def _peer_main(endpoint: str, io: str) -> None:
    """Entry point of the spawned peer: connect, say hello, run phases until told to quit."""
    if io == "sync":
        ctx = zmq.Context()
        sock = make_dealer(ctx, endpoint, identity=PEER_IDENTITY)
        try:
            _peer_loop_sync(sock)
        finally:
            sock.close(linger=0)
            ctx.term()
    else:
        _run_on_uvloop(_peer_loop_async(endpoint))


def _peer_loop_sync(sock: zmq.Socket[Any]) -> None:
    sock.send(b"hello")
    while True:
        command = sock.recv_multipart()
        if command[0] == _ACK:  # a late ack of the previous phase
            continue
        if command[0] == b"quit":
            return
        phase = _Phase.unpack(command[1])
        if phase.op == "flood":
            _peer_flood_sync(sock, phase)
        elif phase.op in ("spaced", "sleep"):
            _peer_spaced_sync(sock, phase)
        else:
            _peer_echo_sync(sock, phase)


def _peer_flood_sync(sock: zmq.Socket[Any], phase: _Phase) -> None:
    message = phase.message()
    frames = _bare_frames(message)
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
        sync_send(sock, _END_MESSAGE)
    else:
        sock.send(_END)
    sock.send_multipart([_CPU, _pack_seconds(time.process_time() - cpu_started)])


def _peer_spaced_sync(sock: zmq.Socket[Any], phase: _Phase) -> None:
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
    sync_send(sock, _END_MESSAGE)
    sock.send_multipart([_CPU, _pack_seconds(cpu_s)])


def _peer_echo_sync(sock: zmq.Socket[Any], phase: _Phase) -> None:
    for _ in range(phase.round_trips):
        if phase.mode == "codec":
            _, message = sync_recv(sock, router=False)
            sync_send(sock, message)
        else:
            sock.send_multipart(sock.recv_multipart())


async def _peer_loop_async(endpoint: str) -> None:
    ctx = zmq.asyncio.Context()
    sock = make_dealer(ctx, endpoint, identity=PEER_IDENTITY)
    try:
        await sock.send(b"hello")
        while True:
            command = await sock.recv_multipart()
            if command[0] == _ACK:
                continue
            if command[0] == b"quit":
                return
            phase = _Phase.unpack(command[1])
            if phase.op == "flood":
                await _peer_flood_async(sock, phase)
            else:
                await _peer_echo_async(sock, phase)
    finally:
        sock.close(linger=0)
        ctx.term()


async def _peer_flood_async(sock: zmq.asyncio.Socket, phase: _Phase) -> None:
    message = phase.message()
    frames = _bare_frames(message)
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
        await async_send(sock, _END_MESSAGE)
    else:
        await sock.send(_END)
    await sock.send_multipart([_CPU, _pack_seconds(time.process_time() - cpu_started)])


async def _peer_echo_async(sock: zmq.asyncio.Socket, phase: _Phase) -> None:
    for _ in range(phase.round_trips):
        if phase.mode == "codec":
            _, message = await async_recv(sock, router=False)
            await async_send(sock, message)
        else:
            await sock.send_multipart(await sock.recv_multipart())


# --------------------------------------------------------------------------- the measuring side


@dataclass
class FloodResult:
    messages: int
    seconds: float
    receiver_cpu_s: float  # process CPU time of each side over the phase
    sender_cpu_s: float

    @property
    def messages_per_s(self) -> float:
        return self.messages / self.seconds

    @property
    def receiver_cpu_us(self) -> float:
        return self.receiver_cpu_s / self.messages * 1e6

    @property
    def sender_cpu_us(self) -> float:
        return self.sender_cpu_s / self.messages * 1e6


@dataclass
class SpacedResult:
    """CPU microseconds per message at one gap: medians of the interleaved runs."""

    gap_s: float
    messages: int  # per run
    sender_cpu_us: float  # the sender's loop: its sleep and its send
    sleep_cpu_us: float  # the same loop without the send
    receiver_cpu_us: float

    @property
    def message_cpu_us(self) -> float:
        """One message, both processes: the sender's cost beyond its sleep, plus the receiver's."""
        return max(0.0, self.sender_cpu_us - self.sleep_cpu_us) + self.receiver_cpu_us


@dataclass
class PairResult:
    transport: str
    io: str
    small_bare_msgs_per_s: float = 0.0
    small_codec_msgs_per_s: float = 0.0
    rtt_p50_bare_us: float = 0.0
    rtt_p50_codec_us: float = 0.0
    # CPU microseconds per small message in each process (medians of the interleaved runs)
    small_bare_sender_cpu_us: float = 0.0
    small_codec_sender_cpu_us: float = 0.0
    small_bare_receiver_cpu_us: float = 0.0
    small_codec_receiver_cpu_us: float = 0.0
    # array size in bytes -> bytes per second
    array_bare_bytes_per_s: dict[int, float] = field(default_factory=dict)
    array_codec_bytes_per_s: dict[int, float] = field(default_factory=dict)
    spaced: list[SpacedResult] = field(default_factory=list)

    @property
    def small_overhead(self) -> float:
        return 1.0 - self.small_codec_msgs_per_s / self.small_bare_msgs_per_s

    @property
    def small_sender_cpu_overhead(self) -> float:
        return self.small_codec_sender_cpu_us / self.small_bare_sender_cpu_us - 1.0

    @property
    def small_receiver_cpu_overhead(self) -> float:
        return self.small_codec_receiver_cpu_us / self.small_bare_receiver_cpu_us - 1.0

    def set_small(self, bare: list[FloodResult], codec: list[FloodResult]) -> None:
        """Medians of the interleaved small-message runs."""
        median = statistics.median
        self.small_bare_msgs_per_s = median(run.messages_per_s for run in bare)
        self.small_codec_msgs_per_s = median(run.messages_per_s for run in codec)
        self.small_bare_sender_cpu_us = median(run.sender_cpu_us for run in bare)
        self.small_codec_sender_cpu_us = median(run.sender_cpu_us for run in codec)
        self.small_bare_receiver_cpu_us = median(run.receiver_cpu_us for run in bare)
        self.small_codec_receiver_cpu_us = median(run.receiver_cpu_us for run in codec)


def _pack_seconds(seconds: float) -> bytes:
    return struct.pack("!d", seconds)


def _unpack_seconds(frames: list[Any]) -> float:
    if len(frames) != 3 or bytes(frames[1]) != _CPU:
        raise RuntimeError(f"expected the peer's CPU report, got {frames!r:.80}")
    seconds: float = struct.unpack("!d", bytes(frames[2]))[0]
    return seconds


def _is_end(frames: list[Any]) -> bool:
    return len(frames) == 2 and bytes(frames[1]) == _END


def _recv_bare_sync(router: zmq.Socket[Any]) -> list[Any]:
    """One routed message with the pyzmq calls sync_recv makes: identity and header copied
    (small bytes), later frames zero-copy, RCVMORE checked after each frame."""
    frames: list[Any] = [router.recv()]
    while router.getsockopt(_RCVMORE):
        frames.append(router.recv(copy=len(frames) < 2))
    return frames


def _flood_sync(router: zmq.Socket[Any], phase: _Phase) -> FloodResult:
    """Receive one flood. A silent peer is caught by the socket's RCVTIMEO (``zmq.Again``), not
    by a poll per message, which would cost more than the codec being measured."""
    codec = phase.mode == "codec"
    cpu_started = time.process_time()
    started = time.perf_counter()
    router.send_multipart([PEER_IDENTITY, b"run", phase.pack()])
    received = 0
    try:
        while True:
            if codec:
                _, message = sync_recv(router, router=True)
                if type(message) is Shutdown:
                    break
            else:
                frames = _recv_bare_sync(router)
                if _is_end(frames):
                    break
            received += 1
            if received % phase.ack_every == 0:
                router.send_multipart([PEER_IDENTITY, _ACK])
        seconds = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        report = router.recv_multipart()
    except zmq.Again:
        raise TimeoutError(f"peer sent nothing for {PHASE_TIMEOUT_S} s during {phase}") from None
    return FloodResult(received, seconds, cpu_s, _unpack_seconds(report))


def _spaced_run_sync(router: zmq.Socket[Any], phase: _Phase) -> tuple[float, float]:
    """One spaced (or sleep-only) run: (receiver CPU seconds, sender CPU seconds). The receiver
    blocks in ``recv`` between messages, as a serving process waits in its poll."""
    router.send_multipart([PEER_IDENTITY, b"run", phase.pack()])
    cpu_started = time.process_time()
    try:
        while True:
            _, message = sync_recv(router, router=True)
            if type(message) is Shutdown:
                break
        cpu_s = time.process_time() - cpu_started
        report = router.recv_multipart()
    except zmq.Again:
        raise TimeoutError(f"peer sent nothing for {PHASE_TIMEOUT_S} s during {phase}") from None
    return cpu_s, _unpack_seconds(report)


def _spaced_sync(router: zmq.Socket[Any], gap_s: float, count: int) -> SpacedResult:
    """Spaced sends and the bare sleeps, interleaved ``SPACED_REPEATS`` times."""
    spaced = _Phase("spaced", "codec", 0, gap_s=gap_s, count=count)
    sleeps = _Phase("sleep", "codec", 0, gap_s=gap_s, count=count)
    sender, sleep, receiver = [], [], []
    for _ in range(SPACED_REPEATS):
        receiver_s, sender_s = _spaced_run_sync(router, spaced)
        receiver.append(receiver_s / count * 1e6)
        sender.append(sender_s / count * 1e6)
        sleep.append(_spaced_run_sync(router, sleeps)[1] / count * 1e6)
    median = statistics.median
    return SpacedResult(gap_s, count, median(sender), median(sleep), median(receiver))


def _round_trips_sync(router: zmq.Socket[Any], phase: _Phase) -> float:
    message = phase.message()
    frames = _bare_frames(message)
    router.send_multipart([PEER_IDENTITY, b"run", phase.pack()])
    samples_ns: list[int] = []
    for _ in range(phase.round_trips):
        start = time.perf_counter_ns()
        if phase.mode == "codec":
            sync_send(router, message, identity=PEER_IDENTITY)
            sync_recv(router, router=True)
        else:
            router.send_multipart([PEER_IDENTITY, *frames])
            router.recv_multipart()
        samples_ns.append(time.perf_counter_ns() - start)
    return statistics.median(samples_ns) / 1000


async def _flood_async(router: zmq.asyncio.Socket, phase: _Phase) -> FloodResult:
    """Receive one flood under one deadline for the whole phase: ``wait_for`` around each
    receive would add a task and a timer per message, more than the codec being measured."""
    codec = phase.mode == "codec"
    cpu_started = time.process_time()
    started = time.perf_counter()
    received = 0
    async with asyncio.timeout(PHASE_TIMEOUT_S):
        await router.send_multipart([PEER_IDENTITY, b"run", phase.pack()])
        while True:
            if codec:
                _, message = await async_recv(router, router=True)
                if type(message) is Shutdown:
                    break
            else:
                frames = await router.recv_multipart()
                if _is_end(frames):
                    break
            received += 1
            if received % phase.ack_every == 0:
                await router.send_multipart([PEER_IDENTITY, _ACK])
        seconds = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        report = await router.recv_multipart()
    return FloodResult(received, seconds, cpu_s, _unpack_seconds(report))


async def _round_trips_async(router: zmq.asyncio.Socket, phase: _Phase) -> float:
    message = phase.message()
    frames = _bare_frames(message)
    await router.send_multipart([PEER_IDENTITY, b"run", phase.pack()])
    samples_ns: list[int] = []
    for _ in range(phase.round_trips):
        start = time.perf_counter_ns()
        if phase.mode == "codec":
            await async_send(router, message, identity=PEER_IDENTITY)
            await async_recv(router, router=True)
        else:
            await router.send_multipart([PEER_IDENTITY, *frames])
            await router.recv_multipart()
        samples_ns.append(time.perf_counter_ns() - start)
    return statistics.median(samples_ns) / 1000


def _small_phases(quick: bool) -> tuple[_Phase, _Phase, _Phase, _Phase]:
    duration = SMALL_PHASE_S[quick]
    window = SMALL_WINDOW_MESSAGES
    ack_every = window // 10
    trips = ROUND_TRIPS[quick]
    return (
        _Phase("flood", "bare", 0, duration, window, ack_every),
        _Phase("flood", "codec", 0, duration, window, ack_every),
        _Phase("echo", "bare", 0, round_trips=trips),
        _Phase("echo", "codec", 0, round_trips=trips),
    )


def _array_phase(mode: str, size_bytes: int, quick: bool) -> _Phase:
    window = max(2, min(SMALL_WINDOW_MESSAGES, ARRAY_WINDOW_BYTES // size_bytes))
    return _Phase("flood", mode, size_bytes, ARRAY_PHASE_S[quick], window, max(1, window // 4))


def _start_peer(endpoint: str, io: str) -> multiprocessing.process.BaseProcess:
    peer = multiprocessing.get_context("spawn").Process(
        target=_peer_main, args=(endpoint, io), name=f"bench-peer-{io}", daemon=True
    )
    peer.start()
    return peer


def _stop_peer(peer: multiprocessing.process.BaseProcess) -> None:
    peer.join(timeout=5)
    if peer.is_alive():
        peer.terminate()
        peer.join(timeout=5)


def _run_pair_sync(
    transport: str, endpoint_hint: str, quick: bool, arrays: bool, spaced: bool = False
) -> PairResult:
    result = PairResult(transport, "sync")
    ctx = zmq.Context()
    router, endpoint = make_router(ctx, endpoint_hint, name="bench")
    peer = _start_peer(endpoint, "sync")
    try:
        # Poll the peer's sentinel too, so a peer that dies while starting fails the run at once.
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(peer.sentinel, zmq.POLLIN)
        ready = dict(poller.poll(int(PEER_START_TIMEOUT_S * 1000)))
        if router not in ready:
            raise RuntimeError(f"bench peer did not connect (exit code {peer.exitcode})")
        router.recv_multipart()  # hello
        router.setsockopt(zmq.RCVTIMEO, int(PHASE_TIMEOUT_S * 1000))
        bare, codec, echo_bare, echo_codec = _small_phases(quick)
        bare_runs, codec_runs = [], []
        for _ in range(SMALL_REPEATS):
            bare_runs.append(_flood_sync(router, bare))
            codec_runs.append(_flood_sync(router, codec))
        result.set_small(bare_runs, codec_runs)
        result.rtt_p50_bare_us = _round_trips_sync(router, echo_bare)
        result.rtt_p50_codec_us = _round_trips_sync(router, echo_codec)
        for size in ARRAY_SIZES_BYTES if arrays else ():
            for mode, table in (
                ("bare", result.array_bare_bytes_per_s),
                ("codec", result.array_codec_bytes_per_s),
            ):
                flood = _flood_sync(router, _array_phase(mode, size, quick))
                table[size] = flood.messages * size / flood.seconds
        for gap_s in SPACED_GAPS_S if spaced else ():
            result.spaced.append(_spaced_sync(router, gap_s, SPACED_MESSAGES[quick]))
        router.send_multipart([PEER_IDENTITY, b"quit"])
    finally:
        _stop_peer(peer)
        router.close(linger=0)
        ctx.term()
    return result


async def _run_pair_async_main(transport: str, endpoint_hint: str, quick: bool) -> PairResult:
    result = PairResult(transport, "asyncio")
    ctx = zmq.asyncio.Context()
    router, endpoint = make_router(ctx, endpoint_hint, name="bench")
    peer = _start_peer(endpoint, "asyncio")
    try:
        await _wait_for_hello_async(router, peer)
        bare, codec, echo_bare, echo_codec = _small_phases(quick)
        bare_runs, codec_runs = [], []
        for _ in range(SMALL_REPEATS):
            bare_runs.append(await _flood_async(router, bare))
            codec_runs.append(await _flood_async(router, codec))
        result.set_small(bare_runs, codec_runs)
        result.rtt_p50_bare_us = await _round_trips_async(router, echo_bare)
        result.rtt_p50_codec_us = await _round_trips_async(router, echo_codec)
        await router.send_multipart([PEER_IDENTITY, b"quit"])
    finally:
        _stop_peer(peer)
        router.close(linger=0)
        ctx.term()
    return result


async def _wait_for_hello_async(
    router: zmq.asyncio.Socket, peer: multiprocessing.process.BaseProcess
) -> None:
    deadline = time.monotonic() + PEER_START_TIMEOUT_S
    hello = asyncio.ensure_future(router.recv_multipart())
    try:
        while not hello.done():
            if not peer.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"bench peer did not connect (exit code {peer.exitcode})")
            await asyncio.wait([hello], timeout=PEER_POLL_INTERVAL_S)
        hello.result()
    finally:
        hello.cancel()


def _run_pair_async(transport: str, endpoint_hint: str, quick: bool) -> PairResult:
    return _run_on_uvloop(_run_pair_async_main(transport, endpoint_hint, quick))


def _run_on_uvloop(main: Coroutine[Any, Any, _T]) -> _T:
    """Every zserve process runs on uvloop, so the asyncio figures are measured there."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main)


def _codec_cost_us(repeat: int) -> tuple[float, float]:
    """In-process CPU cost of encode and decode of the small message, microseconds each: the
    median of ``CODEC_COST_RUNS`` runs of ``repeat`` calls each, timed with this thread's CPU
    clock so that time spent descheduled on a busy machine does not count."""
    message = _small_message()
    frames = encode(message)
    encode_runs, decode_runs = [], []
    for _ in range(CODEC_COST_RUNS):
        start = time.thread_time()
        for _ in range(repeat):
            encode(message)
        encode_runs.append((time.thread_time() - start) / repeat)
        start = time.thread_time()
        for _ in range(repeat):
            decode(frames)
        decode_runs.append((time.thread_time() - start) / repeat)
    return statistics.median(encode_runs) * 1e6, statistics.median(decode_runs) * 1e6


def _format_rate(value: float) -> str:
    return f"{value / 1000:,.0f} k" if value < 1e7 else f"{value / 1e6:,.1f} M"


def _format_bytes_rate(value: float) -> str:
    return f"{value / 1e9:6.2f} GB/s" if value >= 1e9 else f"{value / 1e6:6.0f} MB/s"


def _format_size(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def _print_small_messages(pairs: list[PairResult]) -> None:
    header_bytes = len(encode(_small_message())[0])
    print(
        f"small messages: CandidateUpdate ({header_bytes} B), window {SMALL_WINDOW_MESSAGES} "
        f"in flight; messages/s"
    )
    print(
        f"{'transport':<10}{'io':<9}{'bare':>10}{'codec':>10}{'overhead':>10}"
        f"{'rtt p50 bare':>14}{'rtt p50 codec':>15}"
    )
    for pair in pairs:
        print(
            f"{pair.transport:<10}{pair.io:<9}{_format_rate(pair.small_bare_msgs_per_s):>10}"
            f"{_format_rate(pair.small_codec_msgs_per_s):>10}{pair.small_overhead:>10.0%}"
            f"{pair.rtt_p50_bare_us:>11.0f} us{pair.rtt_p50_codec_us:>12.0f} us"
        )
    print(
        f"(median of {SMALL_REPEATS} interleaved runs; overhead = 1 - codec/bare; the asyncio\n"
        " codec path reads queued messages through a sync twin socket, so it can beat bare"
        " zmq.asyncio)"
    )
    print(
        "\nCPU per small message in each process (all its threads, ZMQ I/O included), us;"
        " +x% = codec/bare - 1"
    )
    print(
        f"{'transport':<10}{'io':<9}{'send bare':>10}{'send codec':>11}{'':>7}"
        f"{'recv bare':>10}{'recv codec':>11}{'':>7}"
    )
    for pair in pairs:
        print(
            f"{pair.transport:<10}{pair.io:<9}"
            f"{pair.small_bare_sender_cpu_us:>10.2f}{pair.small_codec_sender_cpu_us:>11.2f}"
            f"{pair.small_sender_cpu_overhead:>+7.0%}"
            f"{pair.small_bare_receiver_cpu_us:>10.2f}{pair.small_codec_receiver_cpu_us:>11.2f}"
            f"{pair.small_receiver_cpu_overhead:>+7.0%}"
        )


def _print_arrays(pairs: list[PairResult]) -> None:
    array_pairs = [pair for pair in pairs if pair.array_bare_bytes_per_s]
    if not array_pairs:
        return
    print("\narrays (float32, one per message, sync sockets): bytes/s")
    columns = [(pair.transport, mode) for pair in array_pairs for mode in ("bare", "codec")]
    print(f"{'size':<9}" + "".join(f"{f'{t} {m}':>14}" for t, m in columns))
    for size in ARRAY_SIZES_BYTES:
        cells = []
        for pair in array_pairs:
            cells.append(_format_bytes_rate(pair.array_bare_bytes_per_s[size]))
            cells.append(_format_bytes_rate(pair.array_codec_bytes_per_s[size]))
        print(f"{_format_size(size):<9}" + "".join(f"{cell:>14}" for cell in cells))


def _print_spaced(pairs: list[PairResult]) -> None:
    for pair in pairs:
        if not pair.spaced:
            continue
        print(
            f"\nspaced messages ({pair.transport}, {pair.io}, codec): one small message per gap,"
            " the connection idle between them;\nCPU us per message (all threads), medians of"
            f" {SPACED_REPEATS} interleaved runs"
        )
        print(
            f"{'gap':<9}{'messages':>9}{'sender':>9}{'its sleep':>11}{'receiver':>10}"
            f"{'one message':>13}{'vs flood':>10}"
        )
        flood_us = pair.small_codec_sender_cpu_us + pair.small_codec_receiver_cpu_us
        for row in pair.spaced:
            print(
                f"{f'{row.gap_s * 1e3:g} ms':<9}{row.messages:>9}{row.sender_cpu_us:>9.1f}"
                f"{row.sleep_cpu_us:>11.1f}{row.receiver_cpu_us:>10.1f}"
                f"{row.message_cpu_us:>13.1f}{row.message_cpu_us / flood_us:>9.0f}x"
            )
        print(
            "(one message = sender - its sleep + receiver; vs flood: against the same message's"
            " send + recv CPU in the flood above)"
        )


def _print_report(
    pairs: list[PairResult], encode_us: float, decode_us: float, elapsed_s: float
) -> None:
    _print_small_messages(pairs)
    print(
        f"codec CPU per small message, in process (median of {CODEC_COST_RUNS} runs): "
        f"encode {encode_us:.2f} us, decode {decode_us:.2f} us"
    )
    _print_arrays(pairs)
    _print_spaced(pairs)
    print(f"\n(total {elapsed_s:.1f} s; noisy on a shared machine: compare runs, quote medians)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="zserve bench-transport",
        description="Throughput of the zserve transport against bare pyzmq (two processes).",
    )
    parser.add_argument("--quick", action="store_true", help="short phases (~10 s in all)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument(
        "--idle-poll",
        action="store_true",
        help="keep the CPUs awake while it runs, as the benchmark clusters do (zserve.idle_poll)",
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    pairs: list[PairResult] = []
    with contextlib.ExitStack() as stack:
        if args.idle_poll:
            stack.enter_context(IdlePollers())
        ipc = stack.enter_context(IpcDir())
        for transport in ("ipc", "tcp"):
            sync_bind = ipc.endpoint("sync") if transport == "ipc" else LOOPBACK_TCP_ANY_PORT
            async_bind = ipc.endpoint("async") if transport == "ipc" else LOOPBACK_TCP_ANY_PORT
            pairs.append(
                _run_pair_sync(
                    transport, sync_bind, args.quick, arrays=True, spaced=transport == "ipc"
                )
            )
            pairs.append(_run_pair_async(transport, async_bind, args.quick))
    encode_us, decode_us = _codec_cost_us(2000 if args.quick else 20000)
    elapsed = time.perf_counter() - started
    if args.idle_poll:
        print("(run with idle pollers: the CPUs kept awake)")
    _print_report(pairs, encode_us, decode_us, elapsed)
    if args.json:
        report = {
            "quick": args.quick,
            "idle_poll": args.idle_poll,
            "elapsed_s": elapsed,
            "codec_encode_us": encode_us,
            "codec_decode_us": decode_us,
            "pairs": [
                {
                    **asdict(pair),
                    "small_codec_overhead": pair.small_overhead,
                    "small_sender_cpu_overhead": pair.small_sender_cpu_overhead,
                    "small_receiver_cpu_overhead": pair.small_receiver_cpu_overhead,
                    "spaced": [
                        {**asdict(row), "message_cpu_us": row.message_cpu_us} for row in pair.spaced
                    ],
                }
                for pair in pairs
            ],
        }
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
