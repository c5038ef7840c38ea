"""The results of ``zserve bench-transport`` (``zserve.transport.bench.throughput``): one streaming
phase (``FloodResult``), one gap of spaced messages (``SpacedResult``), and everything measured over
one transport and I/O style (``PairResult``, with the overheads the report prints).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


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
