"""Closed-loop load: N clients, each sending its next request only once its last one is answered.

This is how most users first drive a server (a sync loop, ``perf_analyzer --concurrency-range``),
and it is the load a scheduler can least afford to misjudge: no request can join a batch the
scheduler holds back, since every client is waiting for an answer. The open-loop generator
(``zserve.loadgen.generator``) cannot show that; this runner does.

``run_closed_loop`` drives a ``Target`` (``zserve.loadgen.target``) with ``clients`` concurrent
loops over one ``AsyncClient`` connection per frontend, for a warm-up and then a measured window,
and returns a report: answers per second, good answers per second (within the model's SLO,
measured from send to receive), latency percentiles, error kinds, per model. Each request's model
is drawn by the workload's shares (seeded).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zserve.client.async_client import AsyncClient
from zserve.core.errors import ZServeError
from zserve.loadgen.target import Target
from zserve.loadgen.workload import Workload

# The client's own timeout: far past any SLO, so a lost answer still ends the loop's wait.
CLIENT_TIMEOUT_S = 30.0
PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class _Tally:
    """One model's measured answers."""

    latencies_s: list[float] = field(default_factory=list)
    good: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class _Window:
    """The measured window: answers to requests sent within [start, end) count."""

    start: float
    end: float
    tallies: dict[str, _Tally]


async def _client_loop(client: AsyncClient, workload: Workload, target: Target,
                       rng: np.random.Generator, window: _Window) -> None:
    names = [m.name for m in workload.models]
    shares = np.asarray(workload.shares(), dtype=float)
    shares = shares / shares.sum()
    slos = {m.name: m.slo_ms / 1e3 for m in workload.models}
    while (sent := time.monotonic()) < window.end:
        name = names[int(rng.choice(len(names), p=shares))]
        try:
            await client.infer(target.model_names[name], target.inputs.get(name, {}),
                               timeout=CLIENT_TIMEOUT_S, max_retries=0)
            error = None
        except ZServeError as exc:
            error = exc.kind.value
        if sent < window.start:
            continue
        latency = time.monotonic() - sent
        tally = window.tallies[name]
        tally.latencies_s.append(latency)
        if error is not None:
            tally.errors[error] += 1
        elif latency <= slos[name]:
            tally.good += 1


async def _drive(target: Target, workload: Workload, clients: int, *, warmup_s: float,
                 measure_s: float, seed: int) -> _Window:
    now = time.monotonic()
    window = _Window(now + warmup_s, now + warmup_s + measure_s,
                     {m.name: _Tally() for m in workload.models})
    addresses = target.client_addresses or [target.client_address]
    connections = [AsyncClient(address, timeout=CLIENT_TIMEOUT_S) for address in addresses]
    rngs = np.random.default_rng(seed).spawn(clients)
    try:
        await asyncio.gather(*(
            _client_loop(connections[i % len(connections)], workload, target, rngs[i], window)
            for i in range(clients)))
    finally:
        for connection in connections:
            await connection.close()
    return window


def _percentiles_ms(latencies_s: list[float]) -> dict[str, float | None]:
    if not latencies_s:
        return {f"p{q:g}": None for q in PERCENTILES}
    values = np.percentile(np.asarray(latencies_s) * 1e3, PERCENTILES)
    return {f"p{q:g}": round(float(v), 3) for q, v in zip(PERCENTILES, values, strict=True)}


def run_closed_loop(target: Target, workload: Workload, *, clients: int, warmup_s: float,
                    measure_s: float, seed: int = 1) -> dict[str, Any]:
    """``clients`` closed loops against ``target`` for ``warmup_s`` then ``measure_s`` seconds;
    the report of the measured window."""
    if clients < 1:
        raise ValueError(f"closed loop needs at least one client, got {clients}")
    window = asyncio.run(_drive(target, workload, clients, warmup_s=warmup_s,
                                measure_s=measure_s, seed=seed))
    per_model = {}
    everything: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    good = answered = 0
    for name, tally in window.tallies.items():
        count = len(tally.latencies_s)
        per_model[name] = {"answers": count, "good": tally.good,
                           "errors": dict(tally.errors),
                           "latency_ms": _percentiles_ms(tally.latencies_s)}
        everything += tally.latencies_s
        errors.update(tally.errors)
        good += tally.good
        answered += count
    return {
        "mode": "closed-loop", "clients": clients, "measure_s": measure_s,
        "answers_per_s": round(answered / measure_s, 2), "good_rps": round(good / measure_s, 2),
        "answers": answered, "good": good, "errors": dict(errors),
        "latency_ms": _percentiles_ms(everything), "per_model": per_model,
    }


__all__ = ["run_closed_loop"]
