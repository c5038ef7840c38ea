"""The fault suite's ledger fails when it should: a checker that cannot fail is a defect. Each
case feeds it one bad outcome (another request's outputs, wrong outputs, silence, an untyped
exception, two outcomes, an answer nobody asked for) and ``check`` must refuse it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from fault_harness import Ledger, Load, fault_cluster

import zserve
from zserve.client.async_client import ConnectionLostError


def _ledger(count: int = 3) -> Ledger:
    ledger = Ledger(fault_cluster())
    for index in range(count):
        ledger.sending(index, float(index))
    return ledger


def _answer_all_but_first(ledger: Ledger) -> None:
    for index in range(1, len(ledger.sent)):
        ledger.record_outputs(index, ledger.expected(index), 10.0)


def test_own_outputs_and_typed_errors_pass() -> None:
    ledger = _ledger(4)
    ledger.record_outputs(0, ledger.expected(0), 1.0)
    ledger.record_error(1, zserve.DeadlineError("late"), 1.0)
    ledger.record_error(2, ConnectionLostError("gone"), 1.0)
    ledger.record_error(3, zserve.UnavailableError("away"), 1.0)
    assert ledger.check() == {"OK": 1, "DEADLINE": 1, "CONNECTION_LOST": 1, "UNAVAILABLE": 1}


def _swapped(ledger: Ledger) -> None:
    ledger.record_outputs(0, ledger.expected(1), 1.0)


def _wrong(ledger: Ledger) -> None:
    ledger.record_outputs(0, {"y": np.full((1, 1), -7.0, np.float32)}, 1.0)


def _silent(ledger: Ledger) -> None:
    ledger.record_silence(0)


def _untyped(ledger: Ledger) -> None:
    ledger.record_error(0, RuntimeError("not a zserve error"), 1.0)


def _missing(ledger: Ledger) -> None:
    del ledger  # request 0 never gets an outcome


def _twice(ledger: Ledger) -> None:
    ledger.record_outputs(0, ledger.expected(0), 1.0)
    ledger.record_error(0, zserve.DeadlineError("again"), 2.0)


def _unmatched(ledger: Ledger) -> None:
    ledger.record_outputs(0, ledger.expected(0), 1.0)
    ledger.unmatched_replies = 1


def _never_sent(ledger: Ledger) -> None:
    ledger.record_outputs(0, ledger.expected(0), 1.0)
    ledger.record_error(99, zserve.DeadlineError("whose?"), 1.0)


BAD: dict[str, tuple[Callable[[Ledger], None], str]] = {
    "another-requests-outputs": (_swapped, "got request 1's outputs"),
    "wrong-outputs": (_wrong, "got outputs"),
    "silence": (_silent, "got no answer"),
    "untyped-error": (_untyped, "raised RuntimeError"),
    "no-outcome": (_missing, "have no outcome"),
    "two-outcomes": (_twice, "several outcomes"),
    "unmatched-answer": (_unmatched, "matched no request"),
    "never-sent": (_never_sent, "never sent"),
}


@pytest.mark.parametrize("case", BAD, ids=str)
def test_the_ledger_refuses_a_bad_outcome(case: str) -> None:
    ledger = _ledger()
    feed, fragment = BAD[case]
    feed(ledger)
    _answer_all_but_first(ledger)
    with pytest.raises(AssertionError, match=fragment):
        ledger.check()


def test_load_schedules_are_open_loop_and_seeded() -> None:
    poisson = Load(rate_rps=100.0, count=1000, seed=3).send_times()
    assert poisson == Load(rate_rps=100.0, count=1000, seed=3).send_times()
    assert 8.0 < poisson[-1] < 12.0  # ~count / rate
    constant = Load(rate_rps=50.0, count=5, poisson=False).send_times()
    assert constant == pytest.approx([0.0, 0.02, 0.04, 0.06, 0.08])
