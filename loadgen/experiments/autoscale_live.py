"""``autoscale --live``: a step in load on emulated backends under the supervisor's autoscaler.

A cluster (``Cluster``, what ``zserve up`` runs) starts with ``START_BACKENDS`` emulated backend
and ``[autoscale]`` acting within ``MIN_BACKENDS .. MAX_BACKENDS``. The reference peak p is what
``REFERENCE_BACKENDS`` backends serve at full batches (``MAX_BATCH / (alpha MAX_BATCH + beta)``
each). Open-loop load, evenly spaced, steps from ``LOW_LOAD`` x p to ``HIGH_LOAD`` x p and back
(phases ``low``, ``high``, ``low again``). Every request's answer is recorded with the moment
it was sent; a request is **lost** when it got no answer or an error other than a missed
deadline or an overload refusal (``BACKEND_FAILED``, ``SHUTTING_DOWN``, ``UNAVAILABLE``,
``INTERNAL``: what a killed or plainly drained backend would cost), and **bad** when it was not
answered with outputs within its SLO. Twice a second the backends running (processes), those
serving (frontend-0's table) and the advice are sampled.

Checks: backends were added in the high phase and released after it, down to what the low load
needs; no request lost; the bad rate of the last ``SETTLED_S`` of each phase at most
``SETTLED_BAD_RATE``. The plot: offered load, backends and advice over time, and the bad rate
per second.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from zserve.cluster.supervisor import Cluster
from zserve.config.cluster import ClusterConfig, parse_config
from zserve.loadgen.experiments.common import Check, Options, Outcome, Table, pyplot, save_figure
from zserve.loadgen.experiments.open_loop import start_open_loop

ALPHA_MS, BETA_MS, MAX_BATCH, SLO_MS = 10.0, 20.0, 8, 300.0
REFERENCE_BACKENDS = 2
START_BACKENDS, MIN_BACKENDS, MAX_BACKENDS = 1, 1, 6
LOW_LOAD, HIGH_LOAD = 0.3, 1.5
PHASE_S = {"low": 10.0, "high": 30.0, "low again": 40.0}
QUICK_PHASE_S = {"low": 6.0, "high": 20.0, "low again": 25.0}
# The policy's times, shortened so that a step settles within a phase (docs/cluster-toml.md).
AUTOSCALE = {"enabled": True, "min_backends": MIN_BACKENDS, "max_backends": MAX_BACKENDS,
             "interval_s": 0.5, "up_window_s": 2.0, "down_window_s": 5.0, "settle_s": 2.0,
             "down_hold_s": 5.0, "min_requests": 50, "max_release_fraction": 0.5}
LOST_KINDS = ("no answer", "BACKEND_FAILED", "SHUTTING_DOWN", "UNAVAILABLE", "INTERNAL")
SETTLED_S = 5.0
SETTLED_BAD_RATE = 0.01
SAMPLE_S = 0.5
LOAD_START_S = 3.0  # the load process's imports and connection


def live_autoscale_cluster() -> ClusterConfig:
    return parse_config({
        "cluster": {"drain_s": 1.0},
        "scheduler": {"shards": 0},
        "frontends": {"count": 1},
        "backends": {"count": START_BACKENDS, "device": "emulated"},
        "autoscale": AUTOSCALE,
        "models": [{"name": "a", "emulated": {"alpha_ms": ALPHA_MS, "beta_ms": BETA_MS,
                                              "input_shape": [4]},
                    "slo_ms": SLO_MS, "max_batch": MAX_BATCH}],
    })


def reference_peak_rps() -> float:
    return REFERENCE_BACKENDS * MAX_BATCH / ((ALPHA_MS * MAX_BATCH + BETA_MS) / 1e3)


def schedule(phases: dict[str, float], peak_rps: float) -> list[tuple[float, str]]:
    """Each request's send offset (s from the start) and phase: evenly spaced at the phase's
    rate."""
    out: list[tuple[float, str]] = []
    start = 0.0
    for (name, length), load in zip(phases.items(), (LOW_LOAD, HIGH_LOAD, LOW_LOAD),
                                    strict=True):
        rate = load * peak_rps
        out += [(start + i / rate, name) for i in range(int(length * rate))]
        start += length
    return out


class Sampler:
    """Twice a second: (monotonic s, backend processes, backends in frontend-0's table, advice)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.samples: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscale-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            running = sum(1 for n in self.cluster.pids() if n.startswith("backend-"))
            stats = self.cluster.stats("frontend-0")
            advice = int((stats.get("autoscale") or {}).get("advice_backends") or 0)
            self.samples.append((time.monotonic(), running, len(stats["backends"]), advice))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def one_run(quick: bool, say: Any) -> dict[str, Any]:
    phases = QUICK_PHASE_S if quick else PHASE_S
    peak = reference_peak_rps()
    planned = schedule(phases, peak)
    with tempfile.TemporaryDirectory(prefix="zs-autoscale-") as folder, Cluster(
            live_autoscale_cluster(), ipc_base=folder) as cluster:
        sampler = Sampler(cluster)
        start = time.monotonic() + LOAD_START_S
        collect = start_open_loop(cluster.client_address, [(o, "a") for o, _ in planned], start,
                                  name="autoscale-load")
        say(f"autoscale --live: {len(planned)} requests over {sum(phases.values()):g} s")
        results = collect()
        sampler.stop()
        events = cluster.autoscale_events()
    return {"peak_rps": peak, "phases_s": phases, "start": start,
            "requests": [(s - start, kind, lat, phase)
                         for (s, kind, lat), (_, phase) in zip(results, planned, strict=True)],
            "samples": [(t - start, *rest) for t, *rest in sampler.samples],
            "events": [(t - start, what, name) for t, what, name in events]}


def _is_bad(kind: str, latency_s: float) -> bool:
    return kind != "OK" or latency_s > SLO_MS / 1e3


def _phase_row(run: dict[str, Any], name: str, begin: float, end: float) -> dict[str, Any]:
    requests = [r for r in run["requests"] if r[3] == name]
    settled = [r for r in requests if r[0] >= end - SETTLED_S]
    lost: dict[str, int] = {}
    bad: dict[str, int] = {}  # the bad ones by answer: "late" was answered after its SLO
    for r in requests:
        if r[1] in LOST_KINDS:
            lost[r[1]] = lost.get(r[1], 0) + 1
        if _is_bad(r[1], r[2]):
            kind = "late" if r[1] == "OK" else r[1]
            bad[kind] = bad.get(kind, 0) + 1
    inside = [s for s in run["samples"] if begin <= s[0] < end]
    return {"phase": name, "offered_rps": len(requests) / (end - begin),
            "good_rps": sum(1 for r in requests if not _is_bad(r[1], r[2])) / (end - begin),
            "bad_rate": sum(1 for r in requests if _is_bad(r[1], r[2])) / max(1, len(requests)),
            "settled_bad_rate": sum(1 for r in settled if _is_bad(r[1], r[2]))
            / max(1, len(settled)),
            "lost": sum(lost.values()), "lost_by_kind": lost, "bad_by_kind": bad,
            "backends_mean": float(np.mean([s[1] for s in inside])) if inside else 0.0,
            "backends_max": max((s[1] for s in inside), default=0),
            "backends_end": inside[-1][2] if inside else 0}


def run_autoscale_live(opts: Options) -> Outcome:
    run = one_run(opts.quick, opts.say)
    bounds, begin = [], 0.0
    for name, length in run["phases_s"].items():
        bounds.append((name, begin, begin + length))
        begin += length
    rows = [_phase_row(run, *b) for b in bounds]
    table = Table(
        f"A step {LOW_LOAD:g}x -> {HIGH_LOAD:g}x -> {LOW_LOAD:g}x of p = {run['peak_rps']:.0f} "
        f"r/s ({REFERENCE_BACKENDS} emulated backends at full batches), autoscaled within "
        f"{MIN_BACKENDS}..{MAX_BACKENDS} from {START_BACKENDS}, SLO {SLO_MS:g} ms",
        ["phase", "s", "offered r/s", "good r/s", "bad", "bad by answer",
         f"bad, last {SETTLED_S:g} s", "lost", "backends mean", "backends max", "serving at end"],
        [[r["phase"], run["phases_s"][r["phase"]], r["offered_rps"], r["good_rps"],
          round(r["bad_rate"], 4),
          ", ".join(f"{k} {v}" for k, v in sorted(r["bad_by_kind"].items())) or "-",
          round(r["settled_bad_rate"], 4), r["lost"],
          round(r["backends_mean"], 2), r["backends_max"], r["backends_end"]] for r in rows])
    adds = [e for e in run["events"] if e[1] == "add"]
    exits = [e for e in run["events"] if e[1] == "exit"]
    high_end = bounds[1][2]
    lost = sum(r["lost"] for r in rows)
    checks = [
        Check("backends added in the high phase and released after it",
              any(bounds[1][1] <= e[0] < high_end for e in adds)
              and any(e[0] >= high_end for e in exits)
              and rows[2]["backends_end"] < rows[1]["backends_max"],
              f"{len(adds)} added, {len(exits)} released; serving at the end of each phase "
              + ", ".join(str(r["backends_end"]) for r in rows)),
        Check("no request lost", lost == 0,
              f"{lost} lost " + str({k: v for r in rows for k, v in r["lost_by_kind"].items()})),
        Check(f"bad rate over the last {SETTLED_S:g} s of every phase <= {SETTLED_BAD_RATE:.0%}",
              all(r["settled_bad_rate"] <= SETTLED_BAD_RATE for r in rows),
              ", ".join(f"{r['phase']} {r['settled_bad_rate']:.4f}" for r in rows)),
    ]
    config = {"alpha_ms": ALPHA_MS, "beta_ms": BETA_MS, "max_batch": MAX_BATCH,
              "slo_ms": SLO_MS, "reference_backends": REFERENCE_BACKENDS,
              "loads": [LOW_LOAD, HIGH_LOAD, LOW_LOAD], "phases_s": run["phases_s"],
              "autoscale": AUTOSCALE, "start_backends": START_BACKENDS}
    outcome = Outcome(config, [table], checks, {"phases": rows, "samples": run["samples"],
                                                "events": run["events"]})
    if opts.plots:
        outcome.plots.append(_plot(run, bounds, opts.out_dir / "autoscale-live.png"))
    return outcome


def _plot(run: dict[str, Any], bounds: list[tuple[str, float, float]], path: Path) -> Path:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    t = [s[0] for s in run["samples"]]
    top.step(t, [s[1] for s in run["samples"]], where="post", label="backend processes")
    top.step(t, [s[2] for s in run["samples"]], where="post", label="serving (table)")
    top.step(t, [s[3] for s in run["samples"]], where="post", linestyle="--", label="advice")
    load = top.twinx()
    seconds = int(bounds[-1][2])
    sent = np.histogram([r[0] for r in run["requests"]], bins=seconds, range=(0, seconds))[0]
    load.plot(np.arange(seconds) + 0.5, sent, color="gray", alpha=0.5, label="offered r/s")
    load.set_ylabel("offered r/s")
    top.set_ylabel("backends")
    top.legend(fontsize="small", loc="upper left")
    bad = np.histogram([r[0] for r in run["requests"] if _is_bad(r[1], r[2])], bins=seconds,
                       range=(0, seconds))[0]
    bottom.plot(np.arange(seconds) + 0.5, bad / np.maximum(sent, 1), label="bad rate")
    lost = [r[0] for r in run["requests"] if r[1] in LOST_KINDS]
    bottom.plot(lost, [0.0] * len(lost), "rx", label=f"lost ({len(lost)})")
    bottom.set_ylabel("bad rate (per s)")
    bottom.set_xlabel("s since the load started")
    bottom.legend(fontsize="small")
    for ax in (top, bottom):
        for _, begin, _ in bounds[1:]:
            ax.axvline(begin, color="k", linestyle=":", linewidth=0.8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Live step {LOW_LOAD:g}x -> {HIGH_LOAD:g}x -> {LOW_LOAD:g}x, autoscaled")
    return Path(save_figure(fig, path))
