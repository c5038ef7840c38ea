"""The generator's own ceiling: the highest open-loop rate it sustains on this machine.

``zserve bench --max-rate-check`` searches it against a zero-delay echo server (the real wire
protocol, no cluster), so that a live figure near it is known to describe the generator.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from zserve.loadgen import schedules
from zserve.loadgen.generator import run_load
from zserve.loadgen.load_plan import Outcome
from zserve.loadgen.search import search_goodput
from zserve.loadgen.workload import ArrivalSpec

MAX_RATE_CHECK_S = 2.0




def max_rate_check(
    *, workers: int, lateness_bound_ms: float, arrival: str, seconds: float, precision: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """The highest open-loop rate this machine's generator sustains within the lateness bound,
    against a zero-delay echo server (the real wire protocol, no cluster)."""
    from zserve.loadgen.bench.echo import EchoConfig, EchoServer
    from zserve.loadgen.load_plan import build_plan

    inputs = {"echo": {"x": np.zeros((1, 4), dtype=np.float32)}}
    probes: list[dict[str, Any]] = []
    with EchoServer(EchoConfig(service_ms=0.0)) as echo:

        def probe(rate: float) -> dict[str, Any]:
            plan = build_plan(
                models=["echo"], slo_ms=[1000.0], shares=[1.0],
                schedule=schedules.constant(rate, seconds), arrival=ArrivalSpec.parse(arrival),
                warmup_s=0.5, cooldown_s=0.0, seed=len(probes),
            )
            result = run_load(
                plan, echo.address, inputs=inputs, workers=workers,
                lateness_bound_ms=lateness_bound_ms, refuse_if_behind=False, progress=False,
            )
            lat = result.lateness
            ok = not lat.behind and not np.any(result.outcome == Outcome.TIMEOUT)
            probes.append({"rate": round(rate, 1), "pass": ok, **lat.to_dict()})
            progress(
                f"  probe {rate:10.1f} r/s: p99 lateness {lat.quantile_ms:8.2f} ms "
                f"({'ok' if ok else 'behind'})"
            )
            return {"bad_rate": 0.0 if ok else 1.0, "lateness": lat.to_dict()}

        found = search_goodput(probe, 2000.0 * workers, rel_precision=precision)
    return {
        "max_rate_rps": found["goodput_rps"],
        "workers": workers,
        "lateness_bound_ms": lateness_bound_ms,
        "arrival": arrival,
        "probe_s": seconds,
        "probes": probes,
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
    }
