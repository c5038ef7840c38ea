"""Closed-loop clients on a virtual clock: the scheduler's pure core (ModelThread and RankThread)
driven by N clients that each send their next request a moment after their last answer, and a
GPU that runs each plan as planned. Deferral cannot pay there (nothing can join a batch held
back while every client waits for its answer), so from each client's second request on every
request must start within l(1) plus the allowances of its arrival, under ``deferred`` as under
``eager``; an open-loop Poisson stream at the same rate still batches."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

from zserve.config.policy_names import SchedulePolicy
from zserve.config.profiles import LatencyProfile
from zserve.core.hosting import Outbox
from zserve.scheduler.core import SchedulerCore
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.policy import ECHO_SHARE_MIN, AnswerEchoes
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import BatchPlan, DropNotice

MS = 1e-3
INF = math.inf  # no metered rate: the echoes are judged against the rows before alone
# the demo cluster's CNN: about 5 ms a batch, SLO 200 ms, its allowances and reply allowance
PROFILE = LatencyProfile.linear(0.3, 5.0, 16)
SLO_S = 0.2
REPLY_ALLOWANCE_S = 10 * MS
D_CTRL_S, D_DATA_S, JITTER_S = 2 * MS, 0.15 * MS, 1 * MS
ALLOWANCES_S = D_CTRL_S + D_DATA_S + JITTER_S
# answer -> client -> next request at the scheduler: client k's round trip
ROUND_TRIP_S = 0.5 * MS
ROUND_TRIP_STEP_S = 0.1 * MS


class _Run:
    """One model on ``gpus`` GPUs under ``policy``: what each request's arrival and start were."""

    def __init__(self, policy: str, gpus: int) -> None:
        self.core = SchedulerCore("shard", rank=RankThread(list(range(gpus)), 0.0))
        self.thread = ModelThread("m", PROFILE, SLO_S, SchedulePolicy.parse(policy),
                                  d_ctrl_s=D_CTRL_S, d_data_s=D_DATA_S, jitter_s=JITTER_S)
        self.core.add_thread(0.0, self.thread, [])
        self.events: list[tuple[float, int, int]] = []  # (time, seq, client): a client sends
        self.seq = 0
        self.arrival: dict[int, float] = {}
        self.start: dict[int, float] = {}
        self.client_of: dict[int, int] = {}
        self.answers: list[tuple[float, int]] = []  # (answered at, request id)
        self.next_id = 1

    def send_at(self, when: float, client: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, client))

    def _arrive(self, now: float, client: int, outbox: Outbox) -> None:
        rid = self.next_id
        self.next_id += 1
        self.arrival[rid] = now
        self.client_of[rid] = client
        self.core.on_arrivals(now, "m", "fe", [rid], [now], [now + SLO_S - REPLY_ALLOWANCE_S],
                              outbox)

    def _deliver(self, outbox: Outbox) -> None:
        for _, msg in outbox:
            assert not isinstance(msg, DropNotice), msg
            if isinstance(msg, BatchPlan):
                finish = msg.exec_at + PROFILE.latency(len(msg.request_ids))
                for rid in msg.request_ids:
                    self.start[rid] = msg.exec_at
                    self.answers.append((finish, rid))
        outbox.clear()

    def run(self, until: float, closed_loop: bool) -> None:
        outbox: Outbox = []
        now = 0.0
        while now < until:
            timer = self.core.wake_at
            event = self.events[0][0] if self.events else math.inf
            now = min(timer, event)
            if now == math.inf:
                break
            if event <= timer:
                _, _, client = heapq.heappop(self.events)
                self._arrive(now, client, outbox)
            else:
                self.core.on_timer(now, outbox)
            self._deliver(outbox)
            if closed_loop:  # an answered client sends again after its round trip
                for finish, rid in self.answers:
                    client = self.client_of[rid]
                    self.send_at(finish + ROUND_TRIP_S + ROUND_TRIP_STEP_S * client, client)
            self.answers.clear()


def _closed_loop(policy: str, clients: int, gpus: int = 1, until: float = 3.0) -> _Run:
    run = _Run(policy, gpus)
    for client in range(clients):  # the clients start together, a cold burst
        run.send_at(1.0 + 0.1 * MS * client, client)
    run.run(until, closed_loop=True)
    return run


def _waits_after_first(run: _Run) -> list[float]:
    """Each request's wait from arrival to start, from each client's second request on."""
    first: dict[int, int] = {}
    for rid in sorted(run.arrival):
        first.setdefault(run.client_of[rid], rid)
    return [run.start[rid] - run.arrival[rid] for rid in run.start
            if rid != first[run.client_of[rid]]]


@pytest.mark.parametrize(("clients", "gpus"), [(1, 1), (4, 1), (4, 2), (16, 2)])
def test_closed_loop_clients_start_within_l1_plus_the_allowances_from_their_second_request(
    clients: int, gpus: int,
) -> None:
    """Before, the second and third requests of each client still waited to their frontrun aim
    (about 180 ms) until the deferral yield had learned that nothing joins; the answers' echoes
    (``AnswerEchoes``) show it from the first answer on, for 1, 4 and 16 clients, and the loop
    answers at least 0.9 of what it answers under eager."""
    run = _closed_loop("deferred", clients, gpus)
    waits = _waits_after_first(run)
    assert len(waits) > 100 * clients  # ~5 ms a round: the loop ran
    bound = PROFILE.latency(1) + ALLOWANCES_S
    assert max(waits) <= bound + 1e-9, (max(waits), bound)
    assert run.thread.sizing.answer_echoes.closed_loop(2.0, math.inf)
    eager = _closed_loop("eager", clients, gpus)
    assert len(waits) >= 0.9 * len(_waits_after_first(eager))


def test_an_open_loop_stream_at_the_closed_loops_rate_keeps_deferring() -> None:
    """Poisson arrivals at about the rate the single closed-loop client reaches: the answers bring
    no arrivals, the echo share stays near 0, and the batches grow as before."""
    run = _Run("deferred", 1)
    rng = np.random.default_rng(7)
    times = 1.0 + np.cumsum(rng.exponential(1 / 150.0, 600))
    for when in times:
        run.send_at(float(when), 0)
    run.run(float(times[-1]) + 1.0, closed_loop=False)
    assert not run.thread.sizing.answer_echoes.closed_loop(float(times[-1]), 150.0)
    batches = run.thread.n_batches
    assert run.thread.n_planned == 600 and batches < 600 / 4  # batches of 4 and more


def test_answer_echoes_weigh_arrivals_after_an_answer_against_a_stream_in_the_same_span(
) -> None:
    """The statistic itself: a batch of 2 rows executed at 0.996 s, expected to finish at 1.0 s
    (l = 4 ms); the rows that arrive just after its windows' anchors against what a stream brings
    in the same span: the rows just before, or the rate times the span, whichever is more."""
    echoes = AnswerEchoes()
    echoes.note_arrivals(0.9, 1, INF)
    echoes.note_answer(0.996, 0.004, 2, INF)
    assert not echoes.closed_loop(1.0, INF)  # nothing known yet
    echoes.note_arrivals(1.0005, 1, INF)
    assert not echoes.closed_loop(1.0005, INF)  # one row of two: not yet half
    echoes.note_arrivals(1.0006, 1, INF)  # both rows within 0.6 ms; none came before
    # no meter yet: the kept arrivals' rate, 2 rows in 0.1006 s, expects 0.012 rows
    assert echoes.closed_loop(1.001, INF) and echoes.echo == pytest.approx(2.0, abs=0.02)
    assert echoes.answered == 2.0
    stream = AnswerEchoes()  # a row every 0.3 ms: about as many before each anchor as after it
    stream.note_answer(0.996, 0.004, 2, 1 / 0.0003)
    for i in range(40):
        stream.note_arrivals(0.99615 + 0.0003 * i, 1, 1 / 0.0003)
        assert not stream.closed_loop(0.99615 + 0.0003 * i, 1 / 0.0003)
    assert stream.answered == 2.0 and stream.echo < ECHO_SHARE_MIN * stream.answered
    gap = AnswerEchoes()  # a stream at 4,000 r/s with a gap before the finish
    gap.note_arrivals(0.99, 1, 4000.0)
    gap.note_answer(0.996, 0.004, 2, 4000.0)
    gap.note_arrivals(1.0003, 1, 4000.0)
    gap.note_arrivals(1.0006, 1, 4000.0)  # the rate expects 2.4 rows in 0.6 ms
    assert not gap.closed_loop(1.001, 4000.0) and gap.echo == 0.0


def test_a_window_no_arrival_closed_is_judged_when_the_next_batch_is_planned() -> None:
    """A sync client whose second request deferred (before the echoes had been judged) sends
    its third one only after that batch: the first window is judged when the second batch is
    planned, so the second batch is looked at, and the third request, its echo, is seen."""
    echoes = AnswerEchoes()
    echoes.note_arrivals(1.0, 1, INF)
    echoes.note_answer(1.05, 0.006, 1, 20.0)  # the cold first request, at the first sample
    echoes.note_arrivals(1.0575, 1, 20.0)  # its echo, 1.5 ms after the answer
    echoes.note_answer(1.24, 0.006, 1, 20.0)  # the echo deferred to its aim, then planned
    echoes.note_arrivals(1.2475, 1, 20.0)  # the second batch's echo
    assert echoes.closed_loop(1.2475, 20.0) and echoes.answered > 1.0
