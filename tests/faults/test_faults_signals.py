"""Signals to each role of a loaded cluster (docs/reliability.md, F1, F2, F4, F8, F19): SIGKILL,
SIGSTOP then SIGCONT, and SIGTERM of the frontend, the shard, the rank and a backend while
open-loop load runs. Every request sent gets exactly one outcome, its own outputs or one typed
error (the ledger of tests/fault_harness.py), the role is back (restarted or resumed), and the
cluster serves every request again afterwards.

One cluster serves every case of the module: each case ends with the cluster serving again,
which is what the next one starts from (and a case that breaks it fails, not the next)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator

import pytest
from fault_harness import (
    CONNECTION_LOST,
    OK,
    ROLE_CHILD,
    Ledger,
    Load,
    Run,
    drive,
    fault_cluster,
    signal_child,
    stop_then_continue,
    wait_served,
)

from zserve.cluster.supervisor import Cluster

# ~2 s of load at a fifth of capacity; the fault when a third of it has been sent.
LOAD = Load(rate_rps=120.0, count=240)
FAULT_AFTER = 80
STOPPED_S = 1.5
SLO_S = 0.6  # fault_cluster's default
LATENESS_MARGIN_S = 1.5
# Outcomes a role's death or pause may cause, besides OK. UNAVAILABLE: not sent while the
# frontend was away, or no backend to run it; BACKEND_FAILED: its batch's backend died;
# DEADLINE: lost with a dead shard, rank or backend and answered by the frontend's deadline
# timer; CONNECTION_LOST: in flight on the dead frontend's connection; SHUTTING_DOWN: a
# draining frontend's refusal.
TYPED = {OK, "UNAVAILABLE", "BACKEND_FAILED", "DEADLINE", CONNECTION_LOST, "SHUTTING_DOWN",
         "OVERLOADED"}
ROLES = tuple(ROLE_CHILD)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = fault_cluster()
    with Cluster(config, ipc_base=tmp_path_factory.mktemp("faults")) as running:
        yield running


class Cases:
    """Request indices unique across the module's cases (the ledger keys by index)."""

    next_index = 0

    @classmethod
    def take(cls, count: int) -> int:
        first, cls.next_index = cls.next_index, cls.next_index + count
        return first


def _run_fault(cluster: Cluster, fault_name: str, role: str) -> Run:
    ledger = Ledger(cluster.config)
    name = ROLE_CHILD[role]
    incarnation = cluster.incarnation(name)
    fault: Callable[[], object]
    if fault_name == "SIGSTOP":
        fault = stop_then_continue(cluster, name, STOPPED_S)
    else:
        fault = signal_child(cluster, name, getattr(signal, fault_name))
    load = Load(LOAD.rate_rps, LOAD.count, seed=len(fault_name) + len(role),
                first_index=Cases.take(LOAD.count))
    run = asyncio.run(drive(cluster.client_address, ledger, load, fault=fault,
                            fault_after=FAULT_AFTER, check=False))
    if fault_name != "SIGSTOP":  # the supervisor restarts what exited
        cluster.wait_ready(name, incarnation + 1, timeout=60.0)
    try:
        recovery_s = wait_served(cluster.client_address, ledger, Cases.take(1000))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {_what_each_role_knew(cluster)}") from None
    counts = ledger.check()
    assert run.fault_at is not None
    # No answer comes later than its SLO (the frontend's deadline timer), save while the
    # frontend itself is paused; a loaded machine's stalls get a generous margin.
    slowest_s = max(ledger.answer_latencies())
    paused_s = STOPPED_S if (fault_name, role) == ("SIGSTOP", "frontend") else 0.0
    bound_s = SLO_S + paused_s + LATENESS_MARGIN_S
    assert slowest_s < bound_s, (slowest_s, counts, _late_answers(ledger, run.fault_at, bound_s),
                                 _what_each_role_knew(cluster))
    print(f"{fault_name} {role}: load {run.counts}, all {counts}; disturbed for "
          f"{ledger.latest_failure_after(run.fault_at):.2f} s after the fault; slowest answer "
          f"{slowest_s:.2f} s; served again {recovery_s:.2f} s after the load")
    return run


def _late_answers(ledger: Ledger, fault_at: float, bound_s: float) -> list[str]:
    """Each request answered later than ``bound_s``: when it was sent (from the fault), what it
    got and when. An answer at the client's own timeout (CLIENT_TIMEOUT_S) is one the cluster
    never gave; the frontend then counts it ``disconnect_cancelled`` once the client leaves."""
    return [f"request {i} sent {at - fault_at:+.3f} s from the fault: "
            f"{ledger.outcomes[i][0]} after {ledger.answered_at[i] - at:.2f} s"
            for i, at in sorted(ledger.sent.items())
            if i in ledger.answered_at and ledger.answered_at[i] - at >= bound_s]


def _what_each_role_knew(cluster: Cluster) -> str:
    """For a cluster that does not serve again: which of its parts refuses, and what it knows.
    An UNAVAILABLE answered at once comes from the frontend's admission (no backend in its
    table serves the model, or its shard unreachable: its counters, its table), from the shard
    (no GPU serves the model: its ``unavailable`` counter and GPUs per model) or from the
    client (its connection down). The rank's peers say whether the frontend still hears of
    table changes; its GPUs what the table holds."""
    frontend = cluster.stats("frontend-0")
    shard = cluster.stats("shard-0")
    rank = cluster.stats("rank")
    shard_gpus = {m: s["gpus"] for m, s in shard["models"].items()}
    return (f"frontend: backends {frontend.get('backends')}, counters {frontend['counters']}; "
            f"shard: GPUs per model {shard_gpus}, counters {shard['counters']}; "
            f"rank: gpus {rank['gpus']}, peers {rank.get('peers')}")


@pytest.mark.parametrize("role", ROLES)
def test_sigkill_under_load(cluster: Cluster, role: str) -> None:
    run = _run_fault(cluster, "SIGKILL", role)
    assert set(run.counts) <= TYPED, run.counts
    assert run.counts.get(OK, 0) > 0, run.counts


@pytest.mark.parametrize("role", ("frontend", "shard", "rank"))
def test_sigstop_then_sigcont_under_load(cluster: Cluster, role: str) -> None:
    run = _run_fault(cluster, "SIGSTOP", role)
    assert set(run.counts) <= TYPED - {CONNECTION_LOST}, run.counts
    assert run.counts.get(OK, 0) > 0, run.counts


@pytest.mark.parametrize("role", ROLES)
def test_sigterm_under_load(cluster: Cluster, role: str) -> None:
    run = _run_fault(cluster, "SIGTERM", role)
    assert set(run.counts) <= TYPED, run.counts
    assert run.counts.get(OK, 0) > 0, run.counts
