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
- ``--curve`` adds the tcp pairs again as ``tcp+curve``: the measuring side's context has CURVE
  installed (a ZAP handler accepting the peer's key) and the peer is a CURVE client, so the
  difference to ``tcp`` is what authentication and encryption cost per message.
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
from dataclasses import asdict
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from zserve.transport.bench.peer import (
    ACK,
    CPU,
    END,
    PEER_IDENTITY,
    RCVMORE,
    Phase,
    bare_frames,
    peer_main,
    run_on_uvloop,
    small_message,
)
from zserve.transport.bench.results import FloodResult, PairResult, SpacedResult
from zserve.transport.codec import decode, encode
from zserve.transport.curve import CLUSTER_DOMAIN, CurveClient, CurveIdentity
from zserve.transport.idle_poll import IdlePollers
from zserve.transport.messages import Shutdown
from zserve.transport.socket_io import async_recv, async_send, sync_recv, sync_send
from zserve.transport.sockets import (
    LOOPBACK_TCP_ANY_PORT,
    IpcDir,
    make_router,
    release_context,
    secure_context,
)

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
PEER_START_TIMEOUT_S = 60.0
PHASE_TIMEOUT_S = 60.0
PEER_POLL_INTERVAL_S = 0.1
# Spaced messages: the gaps between sends, messages per run (full, --quick), interleaved runs.
SPACED_GAPS_S = (0.0003, 0.001)
SPACED_MESSAGES = (1000, 150)
SPACED_REPEATS = 3

# The tcp pairs again with CURVE on (``--curve``).
CURVE_TRANSPORT = "tcp+curve"

_T = TypeVar("_T")
# --------------------------------------------------------------------------- the measuring side


def _unpack_seconds(frames: list[Any]) -> float:
    if len(frames) != 3 or bytes(frames[1]) != CPU:
        raise RuntimeError(f"expected the peer's CPU report, got {frames!r:.80}")
    seconds: float = struct.unpack("!d", bytes(frames[2]))[0]
    return seconds


def _is_end(frames: list[Any]) -> bool:
    return len(frames) == 2 and bytes(frames[1]) == END


def _recv_bare_sync(router: zmq.Socket[Any]) -> list[Any]:
    """One routed message with the pyzmq calls sync_recv makes: identity and header copied
    (small bytes), later frames zero-copy, RCVMORE checked after each frame."""
    frames: list[Any] = [router.recv()]
    while router.getsockopt(RCVMORE):
        frames.append(router.recv(copy=len(frames) < 2))
    return frames


def _flood_sync(router: zmq.Socket[Any], phase: Phase) -> FloodResult:
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
                router.send_multipart([PEER_IDENTITY, ACK])
        seconds = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        report = router.recv_multipart()
    except zmq.Again:
        raise TimeoutError(f"peer sent nothing for {PHASE_TIMEOUT_S} s during {phase}") from None
    return FloodResult(received, seconds, cpu_s, _unpack_seconds(report))


def _spaced_run_sync(router: zmq.Socket[Any], phase: Phase) -> tuple[float, float]:
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
    spaced = Phase("spaced", "codec", 0, gap_s=gap_s, count=count)
    sleeps = Phase("sleep", "codec", 0, gap_s=gap_s, count=count)
    sender, sleep, receiver = [], [], []
    for _ in range(SPACED_REPEATS):
        receiver_s, sender_s = _spaced_run_sync(router, spaced)
        receiver.append(receiver_s / count * 1e6)
        sender.append(sender_s / count * 1e6)
        sleep.append(_spaced_run_sync(router, sleeps)[1] / count * 1e6)
    median = statistics.median
    return SpacedResult(gap_s, count, median(sender), median(sleep), median(receiver))


def _round_trips_sync(router: zmq.Socket[Any], phase: Phase) -> float:
    message = phase.message()
    frames = bare_frames(message)
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


async def _flood_async(router: zmq.asyncio.Socket, phase: Phase) -> FloodResult:
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
                await router.send_multipart([PEER_IDENTITY, ACK])
        seconds = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        report = await router.recv_multipart()
    return FloodResult(received, seconds, cpu_s, _unpack_seconds(report))


async def _round_trips_async(router: zmq.asyncio.Socket, phase: Phase) -> float:
    message = phase.message()
    frames = bare_frames(message)
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


def _small_phases(quick: bool) -> tuple[Phase, Phase, Phase, Phase]:
    duration = SMALL_PHASE_S[quick]
    window = SMALL_WINDOW_MESSAGES
    ack_every = window // 10
    trips = ROUND_TRIPS[quick]
    return (
        Phase("flood", "bare", 0, duration, window, ack_every),
        Phase("flood", "codec", 0, duration, window, ack_every),
        Phase("echo", "bare", 0, round_trips=trips),
        Phase("echo", "codec", 0, round_trips=trips),
    )


def _array_phase(mode: str, size_bytes: int, quick: bool) -> Phase:
    window = max(2, min(SMALL_WINDOW_MESSAGES, ARRAY_WINDOW_BYTES // size_bytes))
    return Phase("flood", mode, size_bytes, ARRAY_PHASE_S[quick], window, max(1, window // 4))


def _secure_bench(ctx: zmq.Context[Any], transport: str) -> CurveClient | None:
    """For ``tcp+curve``: install CURVE on the measuring side's context, accepting one fresh
    client key, and return the peer's CURVE settings; None for the other transports."""
    if transport != CURVE_TRANSPORT:
        return None
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    secure_context(ctx, CurveIdentity(
        public=server_public, secret=server_secret, servers={},
        authorized={CLUSTER_DOMAIN: frozenset({client_public})},
    ))
    return CurveClient(client_public, client_secret, server_public)


def _start_peer(endpoint: str, io: str, curve: CurveClient | None = None
                ) -> multiprocessing.process.BaseProcess:
    peer = multiprocessing.get_context("spawn").Process(
        target=peer_main, args=(endpoint, io, curve), name=f"bench-peer-{io}", daemon=True
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
    curve = _secure_bench(ctx, transport)
    router, endpoint = make_router(ctx, endpoint_hint, name="bench")
    peer = _start_peer(endpoint, "sync", curve)
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
        release_context(ctx)
        ctx.term()
    return result


async def _run_pair_async_main(transport: str, endpoint_hint: str, quick: bool) -> PairResult:
    result = PairResult(transport, "asyncio")
    ctx = zmq.asyncio.Context()
    curve = _secure_bench(ctx, transport)
    router, endpoint = make_router(ctx, endpoint_hint, name="bench")
    peer = _start_peer(endpoint, "asyncio", curve)
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
        release_context(ctx)
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
    return run_on_uvloop(_run_pair_async_main(transport, endpoint_hint, quick))


def _codec_cost_us(repeat: int) -> tuple[float, float]:
    """In-process CPU cost of encode and decode of the small message, microseconds each: the
    median of ``CODEC_COST_RUNS`` runs of ``repeat`` calls each, timed with this thread's CPU
    clock so that time spent descheduled on a busy machine does not count."""
    message = small_message()
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


def _print_report(
    pairs: list[PairResult], encode_us: float, decode_us: float, elapsed_s: float
) -> None:
    _print_small(pairs, encode_us, decode_us)
    _print_arrays(pairs)
    _print_spaced(pairs)
    print(f"\n(total {elapsed_s:.1f} s; noisy on a shared machine: compare runs, quote medians)")



def _print_small(pairs: list[PairResult], encode_us: float, decode_us: float) -> None:
    """Small messages: throughput, round trips, CPU per message on each side."""
    header_bytes = len(encode(small_message())[0])
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
    print(
        f"codec CPU per small message, in process (median of {CODEC_COST_RUNS} runs): "
        f"encode {encode_us:.2f} us, decode {decode_us:.2f} us"
    )


def _print_arrays(pairs: list[PairResult]) -> None:
    """Arrays: bytes per second by size, bare and codec."""
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
    """Spaced messages: CPU per message when the connection idles between them."""
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
        help="keep the CPUs awake while it runs, as the benchmark clusters do "
             "(zserve.transport.idle_poll)",
    )
    parser.add_argument("--curve", action="store_true",
                        help="also run the tcp pairs with CURVE (authenticated, encrypted)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    pairs: list[PairResult] = []
    with contextlib.ExitStack() as stack:
        if args.idle_poll:
            stack.enter_context(IdlePollers())
        ipc = stack.enter_context(IpcDir())
        for transport in ("ipc", "tcp", *((CURVE_TRANSPORT,) if args.curve else ())):
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
