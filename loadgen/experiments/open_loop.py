"""The live experiments' load: open-loop requests at set moments, sent from a process of its own.

The experiment's process hosts the supervisor (``Cluster``) and its helpers; a load sent from
the same interpreter would add their stalls to the measured latencies, so the load runs in a
spawned process and hands its results back through a pipe. Each result is (sent at on this
host's monotonic clock, the answer's kind: ``OK``, an error kind's value or ``no answer``,
latency in seconds, ``inf`` without an answer).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import zserve

ANSWER_WAIT_S = 30.0
OpenLoopResult = tuple[float, str, float]


def start_open_loop(address: str, requests: Sequence[tuple[float, str]], start: float, *,
                    name: str) -> Callable[[], list[OpenLoopResult]]:
    """Send each (offset s, model) request at ``start + offset`` (monotonic) from a spawned
    process; returns the call that waits for the results, in the requests' order."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_load_process, args=(send, address, list(requests), start),
                              name=name)
    process.start()

    def collect() -> list[OpenLoopResult]:
        results: list[OpenLoopResult] = receive.recv()
        process.join()
        return results

    return collect


def _load_process(conn: Connection, address: str, requests: list[tuple[float, str]],
                  start: float) -> None:
    conn.send(asyncio.run(_load(address, requests, start)))
    conn.close()


async def _load(address: str, requests: list[tuple[float, str]],
                start: float) -> list[OpenLoopResult]:
    x = {"x": np.zeros((1, 4), np.float32)}
    sent: list[float] = []
    futures: list[asyncio.Future[Any]] = []
    done_at: dict[int, float] = {}
    async with zserve.AsyncClient(address, timeout=ANSWER_WAIT_S, max_retries=0) as client:
        for i, (offset, model) in enumerate(requests):
            delay = start + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sent.append(time.monotonic())
            future = client.submit(model, x)
            future.add_done_callback(functools.partial(_stamp, done_at, i))
            futures.append(future)
        await asyncio.wait(futures, timeout=ANSWER_WAIT_S)
    results = []
    for i, future in enumerate(futures):
        kind = "no answer"
        if future.done():
            error = future.exception()
            kind = "OK" if error is None else getattr(getattr(error, "kind", None), "value",
                                                       type(error).__name__)
        results.append((sent[i], kind, done_at.get(i, float("inf")) - sent[i]))
    return results


def _stamp(done_at: dict[int, float], index: int, _future: Any) -> None:
    done_at[index] = time.monotonic()


__all__ = ["ANSWER_WAIT_S", "OpenLoopResult", "start_open_loop"]
