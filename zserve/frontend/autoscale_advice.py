"""The frontend's autoscaling advice: the :class:`~zserve.orchestrator.autoscale.Autoscaler` fed
from the frontend's cluster stats (``[autoscale] enabled``).

Every ``interval_s`` the frontend host asks its cluster stats round (what a scrape gets: its own
stats and every backend's) and hands the answer to :meth:`AdviceTracker.observe`. One interval's
:class:`Signals` are the differences between two answers: the requests this frontend answered
(offered) and those it did not answer with outputs (bad: DEADLINE, OVERLOADED, UNAVAILABLE,
BACKEND_FAILED, SHUTTING_DOWN, INTERNAL; a client's own BAD_REQUEST, TOO_LARGE or CANCELLED is
neither), the busy seconds of every backend (``busy_total_s``, each backend's own increase, so one
that restarted or left counts from its new value) and the backends serving (the frontend's
table). The advice and its signals go into the frontend's stats under ``autoscale``, which
``zserve status`` prints, the metrics endpoint exports (``zserve_autoscale_backends_advice``
...) and ``zserve up`` acts on (``zserve.cluster.autoscaler``).

With several frontends each advises from its own requests (a share of the cluster's: the same
bad rate when the load is spread) and every backend's busy time.

With ``[autoscale.kinds.<kind>]`` each device kind is also advised on its own
(``zserve.orchestrator.autoscale_kinds``): its backends (by the ``kind`` in their stats), their
busy time, and its models' requests (``outcome/<model>/<o>`` counters); the snapshot's ``kinds``
holds each kind's advice, which ``zserve up`` acts on per kind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from zserve.config.cluster import ClusterConfig
from zserve.core.errors import ErrorKind
from zserve.frontend.core import OUTCOME_OF_MODEL, OUTCOME_OK
from zserve.orchestrator.autoscale import Advice, AutoscalePolicy, Autoscaler, Signals
from zserve.orchestrator.autoscale_kinds import BackendSample, KindAutoscalers, kind_signals

# Answers that are the cluster's failure to serve in time (the bad rate's numerator).
BAD_KINDS = (ErrorKind.DEADLINE, ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE,
             ErrorKind.BACKEND_FAILED, ErrorKind.SHUTTING_DOWN, ErrorKind.INTERNAL)
# A client's own mistakes or choices: not offered load the cluster failed.
CLIENT_KINDS = (ErrorKind.BAD_REQUEST, ErrorKind.TOO_LARGE, ErrorKind.CANCELLED)


def autoscale_policy(cluster: ClusterConfig) -> AutoscalePolicy:
    """``[autoscale]`` as the core's policy (``max_backends = 0``: the backends started)."""
    a = cluster.autoscale
    low, high = a.bounds(cluster.backends.total)
    return AutoscalePolicy(
        min_backends=low, max_backends=high, up_window_s=a.up_window_s,
        down_window_s=a.down_window_s, add_bad_rate=a.add_bad_rate, idle_floor=a.idle_floor,
        release_margin=a.release_margin, headroom=a.headroom, settle_s=a.settle_s,
        down_hold_s=a.down_hold_s, max_release_fraction=a.max_release_fraction,
        min_requests=a.min_requests)


def _kind_count(counters: Mapping[str, int], kind: ErrorKind) -> int:
    return int(counters.get(f"error_{kind.value}", 0)) + int(
        counters.get(f"rejected_{kind.value}", 0))


def answered_and_bad(counters: Mapping[str, int]) -> tuple[int, int]:
    """(requests answered, bad answers) from a frontend's counters."""
    bad = sum(_kind_count(counters, kind) for kind in BAD_KINDS)
    return int(counters.get("replied", 0)) + bad, bad


def backend_busy(stats: Mapping[str, Any]) -> dict[str, float]:
    """Each backend's busy seconds so far (never reset), by name."""
    cluster = stats.get("cluster") or {}
    return {name: float(peer.get("busy_total_s", 0.0)) for name, peer in cluster.items()
            if isinstance(peer, Mapping) and peer.get("role") == "backend"}


def model_outcomes(counters: Mapping[str, int], models: list[str]) -> dict[str, tuple[int, int]]:
    """(requests answered, bad answers) of each model, from ``outcome/<model>/<o>``."""
    out: dict[str, tuple[int, int]] = {}
    for model in models:
        bad = sum(int(counters.get(OUTCOME_OF_MODEL.format(model, k.value), 0))
                  for k in BAD_KINDS)
        ok = int(counters.get(OUTCOME_OF_MODEL.format(model, OUTCOME_OK), 0))
        out[model] = (ok + bad, bad)
    return out


def backend_samples(stats: Mapping[str, Any]) -> dict[str, tuple[str, float, tuple[str, ...]]]:
    """Each backend's (kind, busy seconds so far, models), by name."""
    cluster = stats.get("cluster") or {}
    return {name: (str(peer.get("kind", "")), float(peer.get("busy_total_s", 0.0)),
                   tuple(peer.get("models") or ()))
            for name, peer in cluster.items()
            if isinstance(peer, Mapping) and peer.get("role") == "backend"}


def _increase(before: float, after: float) -> float:
    """A counter's increase; one that went back (reset, restarted process) counts from 0."""
    return after - before if after >= before else after


class AdviceTracker:
    """The advice of one frontend (module docstring); ``snapshot`` is its stats entry."""

    def __init__(self, policy: AutoscalePolicy, backends: int, now: float,
                 kinds: KindAutoscalers | None = None, models: tuple[str, ...] = ()) -> None:
        self.autoscaler = Autoscaler(policy, backends, now)
        self._last: tuple[float, int, int, dict[str, float]] | None = None
        self.serving = backends
        self.kinds = kinds
        self.models = list(models)
        self._last_kinds: tuple[dict[str, tuple[int, int]],
                                dict[str, tuple[str, float, tuple[str, ...]]]] | None = None

    @classmethod
    def for_cluster(cls, cluster: ClusterConfig, now: float) -> AdviceTracker | None:
        if not cluster.autoscale.enabled:
            return None
        policy = autoscale_policy(cluster)
        bounds = cluster.autoscale.kind_bounds(cluster.backends)
        kinds = KindAutoscalers(policy, bounds, cluster.backends.started_by_kind(),
                                now) if bounds else None
        return cls(policy, cluster.backends.total, now, kinds,
                   tuple(m.name for m in cluster.models))

    def observe(self, now: float, stats: Mapping[str, Any]) -> None:
        """One stats answer: the interval since the previous one becomes a sample."""
        answered, bad = answered_and_bad(stats.get("counters", {}))
        busy = backend_busy(stats)
        self.serving = len(stats.get("backends", [])) or self.serving
        last, self._last = self._last, (now, answered, bad, busy)
        if last is None or now <= last[0]:
            return
        then, answered0, bad0, busy0 = last
        busy_s = sum(_increase(busy0.get(name, 0.0), value) for name, value in busy.items())
        self.autoscaler.observe(now, Signals(
            now - then, int(_increase(answered0, answered)), int(_increase(bad0, bad)), busy_s,
            self.serving))
        self.autoscaler.advise(now)
        self._observe_kinds(now, now - then, stats)

    def _observe_kinds(self, now: float, duration_s: float, stats: Mapping[str, Any]) -> None:
        """Per kind (``[autoscale.kinds]``): the interval's signals of each kind's backends and
        models. Only the backends of the frontend's table count as serving."""
        if self.kinds is None:
            return
        outcomes = model_outcomes(stats.get("counters", {}), self.models)
        table = set(stats.get("backends") or ())
        samples = {n: s for n, s in backend_samples(stats).items() if n in table}
        last, self._last_kinds = self._last_kinds, (outcomes, samples)
        if last is None or duration_s <= 0:
            return
        outcomes0, samples0 = last
        offered = {m: int(_increase(outcomes0.get(m, (0, 0))[0], a)) for m, (a, _) in
                   outcomes.items()}
        bad = {m: int(_increase(outcomes0.get(m, (0, 0))[1], b)) for m, (_, b) in
               outcomes.items()}
        backends = {name: BackendSample(kind, _increase(
            samples0[name][1] if name in samples0 else 0.0, busy_s), models)
            for name, (kind, busy_s, models) in samples.items()}
        self.kinds.observe(now, kind_signals(duration_s, offered, bad, backends))
        self.kinds.advise(now)

    def snapshot(self) -> dict[str, Any]:
        """The advice now, its signals, and the newest change (its size and its rule); with
        kinds, each kind's the same under ``kinds``."""
        out = _advice_entry(self.autoscaler, self.serving)
        if self.kinds is not None:
            out["kinds"] = {kind: _advice_entry(a, self.kinds.serving[kind])
                            for kind, a in self.kinds.autoscalers.items()}
        return out


def _advice_entry(autoscaler: Autoscaler, serving: int) -> dict[str, Any]:
    advice: Advice = autoscaler.last
    changed = autoscaler.last_change
    policy = autoscaler.policy
    return {"advice_backends": advice.backends, "backends": serving,
            "change": changed.change if changed else 0,
            "reason": changed.reason if changed else advice.reason,
            "changes": len(autoscaler.changes),
            "bad_rate": round(advice.bad_rate, 6),
            "idle_fraction": round(advice.idle_fraction, 6),
            "needed": round(advice.needed, 3),
            "min_backends": policy.min_backends, "max_backends": policy.max_backends}


async def advise_every(tracker: AdviceTracker, interval_s: float, clock: Callable[[], float],
                       ask: Callable[[], Coroutine[Any, Any, dict[str, Any] | None]]) -> None:
    """The host's task: every ``interval_s``, one cluster stats round into ``tracker``."""
    while True:
        stats = await ask()
        if stats is not None:
            tracker.observe(clock(), stats)
        await asyncio.sleep(interval_s)


__all__ = ["BAD_KINDS", "AdviceTracker", "advise_every", "answered_and_bad",
           "autoscale_policy", "backend_busy"]
