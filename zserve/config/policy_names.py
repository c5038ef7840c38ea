"""Schedule and drop policy names, and the one parse that turns them into a ``SchedulePolicy``.

A runtime-kit module: cluster.toml and workload files validate their ``policy``/``drop`` keys with
it, and the scheduler (``zserve.scheduler.policy``, which documents what each policy does) runs
on the parsed value. It imports nothing of zserve, so configuration needs no scheduler import.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KEEP_TOLERANCE = 0.05
"""Default ``keep_tolerance`` of the window drop policy (see ``ModelThread``). 0 is exactly the
authors' rule (drop a head that would force a batch below the target); 0.05 keeps a head while a
batch whose per-request cost l(b)/b is within 5% of the target's still fits. In the simulator it
raises the Poisson goodput of Table 2 from 5234 to 5430 r/s (ResNet50) and from 942 to 970 r/s
(InceptionResNetV2), and the Gamma(0.3) ResNet50 goodput from 4688 to 4875 r/s."""

SCHEDULE_POLICIES = ("deferred", "deferred-bl", "frontrun", "latest", "eager", "eager-edf",
                     "eager-lsf", "timeout")
DROP_POLICIES = ("window", "suffix", "alone", "fcfs")
SIM_BASELINE_POLICIES = ("nexus", "nexus-fill", "nexus-backup", "nexus-fill-backup",
                         "shepherd-flex")
"""The papers' other systems, which only the simulator runs (``zserve.loadgen.sim.baselines``):
they replace the scheduler rather than tune it. ``nexus:F`` runs Nexus with F frontends;
``nexus-fill`` plans every model at the largest multiple of its rate the GPUs hold; ``-backup``
adds the public code's backup backends (a GPU relays what overflows its batch)."""


def sim_baseline_frontends(spec: str) -> int | None:
    """For a simulator baseline (``nexus[-fill][:F]``, ``shepherd-flex``) its frontend count (1
    unless ``:F``); None for every other policy name. Raises PolicyError on a bad F."""
    base, _, arg = spec.strip().partition(":")
    if base not in SIM_BASELINE_POLICIES:
        return None
    if not arg:
        return 1
    if base.startswith("nexus") and arg.isdigit() and int(arg) >= 1:
        return int(arg)
    raise PolicyError("policy", f"policy {spec!r}: only the nexus policies take an argument, "
                      "a frontend count >= 1 (nexus:8)")

# Schedule kinds as small ints: compared on the hot path.
KIND_DEFERRED = 0
KIND_FRONTRUN = 1
KIND_LATEST = 2
KIND_EAGER = 3
KIND_TIMEOUT = 4
_KIND_BY_NAME = {
    "deferred": KIND_DEFERRED,
    "deferred-bl": KIND_DEFERRED,  # the second paper's beta*lambda rule, the earlier default
    "frontrun": KIND_FRONTRUN,
    "latest": KIND_LATEST,
    "eager": KIND_EAGER,
    "eager-edf": KIND_EAGER,
    "eager-lsf": KIND_EAGER,
    "timeout": KIND_TIMEOUT,
}
# eager-edf and eager-lsf are eager under the alone drop (Clockwork: no target batch size; see
# zserve.scheduler.policy): their drop unless another than the default window is named.
_DEFAULT_DROP_BY_NAME = {"eager-edf": "alone", "eager-lsf": "alone"}
# How the rank hands out a GPU: to the first candidate whose exec time comes (every policy but
# two), or, for the two eager baselines, to the most urgent of the candidates waiting when it
# frees: by deadline (eager-edf) or by latest start, least slack first (eager-lsf).
GRANT_FIRST_DUE = "first-due"
GRANT_LEAST_SLACK = "least-slack"
GRANT_EARLIEST_DEADLINE = "earliest-deadline"
_GRANT_ORDER_BY_NAME = {"eager-edf": GRANT_EARLIEST_DEADLINE, "eager-lsf": GRANT_LEAST_SLACK}
DROP_WINDOW = 0
DROP_ALONE = 1
DROP_FCFS = 2
DROP_SUFFIX = 3
_DROP_BY_NAME = {"window": DROP_WINDOW, "suffix": DROP_SUFFIX, "alone": DROP_ALONE,
                 "fcfs": DROP_FCFS}


class PolicyError(ValueError):
    """A bad policy or drop name; ``key`` is the configuration key at fault."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, slots=True)
class SchedulePolicy:
    """A parsed policy name. ``timeout_fraction`` is only meaningful for ``timeout``;
    ``rank_rescue``: the rank may start the policy's deferring candidates early (``deferred``;
    ``deferred-bl`` runs the same kind without it, zserve.scheduler.policy);
    ``grant_order``: how the rank hands out a GPU (``GRANT_FIRST_DUE`` and the others)."""

    name: str
    kind: int
    timeout_fraction: float = 0.0
    drop: int = DROP_WINDOW
    drop_name: str = "window"
    rank_rescue: bool = False
    grant_order: str = GRANT_FIRST_DUE

    @property
    def keeps_target(self) -> bool:
        """The drop keeps a target batch size (``window`` and ``suffix``)."""
        return self.drop in (DROP_WINDOW, DROP_SUFFIX)

    @classmethod
    def parse(cls, spec: str, drop: str = "window") -> SchedulePolicy:
        """``deferred`` | ``deferred-bl`` | ``frontrun`` | ``latest`` | ``eager`` |
        ``eager-edf`` | ``eager-lsf`` | ``timeout:F``; ``drop`` is ``window`` | ``suffix`` |
        ``alone`` | ``fcfs`` (``window``, the default, means ``alone`` for ``eager-edf`` and
        ``eager-lsf``). Raises PolicyError (a
        ValueError) naming the choices and, in ``key``, which of the two names is at fault."""
        base, _, arg = spec.strip().partition(":")
        if base not in _KIND_BY_NAME:
            raise PolicyError("policy", f"unknown policy {spec!r}; choose one of "
                              f"{SCHEDULE_POLICIES} (timeout takes a fraction of the SLO: "
                              "timeout:0.3)")
        if drop not in _DROP_BY_NAME:
            raise PolicyError("drop",
                              f"unknown drop policy {drop!r}; choose one of {DROP_POLICIES}")
        if drop == "window":
            drop = _DEFAULT_DROP_BY_NAME.get(base, drop)
        return cls(spec.strip(), _KIND_BY_NAME[base], _timeout_fraction(base, arg, spec),
                   _DROP_BY_NAME[drop], drop, rank_rescue=base == "deferred",
                   grant_order=_GRANT_ORDER_BY_NAME.get(base, GRANT_FIRST_DUE))


def _timeout_fraction(base: str, arg: str, spec: str) -> float:
    """The F of ``timeout:F`` (0 for the other policies, which take no argument)."""
    if base != "timeout":
        if arg:
            raise PolicyError("policy", f"policy {base!r} takes no argument, got {spec!r}")
        return 0.0
    try:
        fraction = float(arg)
    except ValueError:
        raise PolicyError("policy", "timeout needs a fraction of the SLO, e.g. timeout:0.3; "
                          f"got {spec!r}") from None
    if not 0.0 <= fraction <= 1.0:
        raise PolicyError("policy", f"timeout fraction must be within [0, 1], got {fraction}")
    return fraction
