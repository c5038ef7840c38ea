"""Per-model GPU membership: the RankThread matches a model's candidates only to its own GPUs,
alone and embedded in the SchedulerCore; the rank's backend table keeps the membership."""

from __future__ import annotations

import math
import random

import pytest

from zserve.config.policy_names import GRANT_LEAST_SLACK
from zserve.config.profiles import LatencyProfile
from zserve.core.errors import ErrorKind
from zserve.core.hosting import DEST_BACKEND, DEST_FRONTEND, Outbox
from zserve.scheduler.core import SchedulerCore
from zserve.scheduler.model_thread import ModelThread
from zserve.scheduler.rank_backends import RankBackends
from zserve.scheduler.rank_thread import RankThread
from zserve.transport.messages import (
    BackendRegister,
    BatchPlan,
    CandidateUpdate,
    DropNotice,
    GrantAnswer,
    GrantGpu,
    RequestMetaBatch,
)

MS = 1e-3


def _cand(model: str, bs: int, exec_at: float, latest: float, delay: float = 0.0
          ) -> CandidateUpdate:
    return CandidateUpdate(model, bs, exec_at, latest, delay)


def _grants(out: Outbox) -> list[GrantGpu]:
    return [m for _, m in out if isinstance(m, GrantGpu)]


def _answer(rank: RankThread, now: float, grant: GrantGpu, until: float, out: Outbox) -> None:
    rank.on_grant_answer(now, GrantAnswer(grant.model, grant.gpu_id, grant.grant_id, True,
                                          until), out)


def test_a_model_on_a_subset_takes_the_first_free_gpu_of_its_own() -> None:
    rank = RankThread([0, 1, 2, 3], 0.0)
    out: Outbox = []
    rank.set_members(0.0, {"a": [2, 3], "b": [0, 1, 2, 3]}, out)
    rank.on_candidate(0.0, _cand("a", 4, exec_at=0.0, latest=1.0), out)
    (grant,) = _grants(out)
    assert grant.gpu_id == 2  # GPUs 0 and 1 are free and lower, but do not serve a
    out.clear()
    rank.on_candidate(0.0, _cand("b", 4, exec_at=0.0, latest=1.0), out)
    assert [g.gpu_id for g in _grants(out)] == [0]
    assert rank.gpus_of("a") == [2, 3] and rank.gpus_of("b") == [0, 1, 2, 3]


def test_a_gpu_serving_no_waiting_model_stays_free_for_the_models_it_serves() -> None:
    rank = RankThread([0, 1], 0.0)
    out: Outbox = []
    rank.set_members(0.0, {"a": [1], "b": [0, 1]}, out)
    rank.on_candidate(0.0, _cand("fill", 1, 0.0, 1.0), out)  # "fill" has no GPU: no grant
    assert _grants(out) == []
    rank.set_members(0.0, {"a": [1], "b": [0, 1], "fill": [1]}, out)
    (fill,) = _grants(out)
    assert fill.gpu_id == 1
    _answer(rank, 0.0, fill, 5.0, out)  # GPU 1 busy until 5.0
    out.clear()
    rank.on_candidate(0.0, _cand("a", 4, exec_at=1.0, latest=6.0, delay=0.5), out)
    rank.on_timer(rank.wake_at, out)
    assert _grants(out) == [] and rank.pending_models() == ["a"]  # GPU 0 idle, but not a's
    assert rank.wake_at == pytest.approx(4.5)  # a's GPU timer: GPU 1 frees at 5.0, less 0.5
    rank.on_candidate(2.0, _cand("b", 4, exec_at=2.0, latest=3.0), out)
    (grant,) = _grants(out)
    assert grant.model == "b" and grant.gpu_id == 0  # GPU 0 was kept free for b
    out.clear()
    rank.on_timer(4.5, out)
    (grant,) = _grants(out)
    assert grant.model == "a" and grant.gpu_id == 1 and grant.free_at == pytest.approx(5.0)


def test_no_gpu_is_granted_again_and_again_to_a_model_it_does_not_serve() -> None:
    rank = RankThread([0, 1], 0.0)
    out: Outbox = []
    rank.set_members(0.0, {"a": [1], "b": [0]}, out)
    rank.on_candidate(0.0, _cand("b", 1, 0.0, 10.0), out)
    (b,) = _grants(out)
    _answer(rank, 0.0, b, 8.0, out)
    rank.set_members(0.0, {"a": [], "b": [0]}, out)  # a's last GPU goes
    out.clear()
    rank.on_candidate(0.0, _cand("a", 4, exec_at=0.5, latest=5.0), out)
    rank.on_timer(0.5, out)
    assert _grants(out) == [] and rank.n_grants == 1
    assert rank.wake_at == math.inf  # nothing to do: no busy loop on GPU 1, idle for nobody
    rank.set_members(1.0, {"a": [1], "b": [0]}, out)  # a is served again: its timer comes back
    (grant,) = _grants(out)
    assert grant.model == "a" and grant.gpu_id == 1


def test_a_candidate_waiting_in_two_pools_takes_the_one_that_frees_in_time() -> None:
    rank = RankThread([0, 1, 2], 0.0)
    out: Outbox = []
    rank.set_members(0.0, {"x": [0], "y": [1], "a": [0, 1]}, out)
    for model, until in (("x", 9.0), ("y", 3.0)):
        rank.on_candidate(0.0, _cand(model, 1, 0.0, 10.0), out)
        (grant,) = _grants(out)
        _answer(rank, 0.0, grant, until, out)
        out.clear()
    rank.on_candidate(0.0, _cand("a", 4, exec_at=1.0, latest=4.0, delay=0.2), out)
    rank.on_timer(rank.wake_at, out)
    assert rank.pending_models() == ["a"]
    while not _grants(out):
        rank.on_timer(rank.wake_at, out)
    (grant,) = _grants(out)
    # GPU 2 (free) serves nobody's a; GPU 0 frees too late (9.0 > latest 4.0); GPU 1 in time
    assert grant.model == "a" and grant.gpu_id == 1 and grant.free_at == pytest.approx(3.0)
    assert rank.n_purged == 0


def test_a_grant_made_before_a_membership_change_stands_and_its_gpu_joins_the_new_pool() -> None:
    rank = RankThread([0, 1], 0.0)
    out: Outbox = []
    rank.on_candidate(0.0, _cand("a", 1, 0.0, 1.0), out)
    (grant,) = _grants(out)
    assert grant.gpu_id == 0
    rank.set_members(0.0, {"a": [1], "b": [0]}, out)  # the move: a now on GPU 1 only
    _answer(rank, 0.0, grant, 0.5, out)  # GPU 0's batch runs; then it is b's
    out.clear()
    rank.on_candidate(1.0, _cand("a", 1, 1.0, 2.0), out)
    rank.on_candidate(1.0, _cand("b", 1, 1.0, 2.0), out)
    assert sorted((g.model, g.gpu_id) for g in _grants(out)) == [("a", 1), ("b", 0)]
    rank.set_members(1.0, None, out)  # every GPU serves every model again
    assert rank.gpus_of("a") == [0, 1] == rank.gpus_of("c")


def test_an_ordered_grant_gives_a_freeing_gpu_to_the_most_urgent_of_its_own_models() -> None:
    rank = RankThread([0, 1], 0.0, grant_order=GRANT_LEAST_SLACK)
    out: Outbox = []
    rank.set_members(0.0, {"a": [0], "b": [1], "fill": [0, 1]}, out)
    for _ in range(2):
        rank.on_candidate(0.0, _cand("fill", 1, 0.0, 10.0), out)
        (grant,) = _grants(out)
        _answer(rank, 0.0, grant, 2.0 + grant.gpu_id, out)  # GPU 0 frees at 2, GPU 1 at 3
        out.clear()
    # b is the more urgent, but GPU 0 (the first to free) is a's alone
    rank.on_candidate(0.0, _cand("a", 1, exec_at=1.0, latest=5.0), out)
    rank.on_candidate(0.0, _cand("b", 1, exec_at=1.0, latest=3.5), out)
    while len(_grants(out)) < 2:
        rank.on_timer(rank.wake_at, out)
    assert [(g.model, g.gpu_id, g.free_at) for g in _grants(out)] == [("a", 0, 2.0),
                                                                     ("b", 1, 3.0)]


def test_under_random_load_every_grant_is_to_a_gpu_of_its_model() -> None:
    """Many models on overlapping subsets, candidates and answers at random, membership
    changing now and then: no grant ever names a GPU outside its model's set, and every
    model is granted (none starves behind a GPU it cannot use)."""
    rng = random.Random(7)
    gpus = list(range(6))
    rank = RankThread(gpus, 0.0)
    models = [f"m{i}" for i in range(8)]
    out: Outbox = []
    members = {m: rng.sample(gpus, rng.randint(1, 3)) for m in models}
    rank.set_members(0.0, members, out)
    granted: dict[str, int] = dict.fromkeys(models, 0)
    now = 0.0

    def answer_grants() -> None:
        while grants := _grants(out):
            out.clear()
            for grant in grants:
                assert grant.gpu_id in members[grant.model]
                granted[grant.model] += 1
                _answer(rank, now, grant, max(now, grant.free_at) + rng.uniform(0.001, 0.02),
                        out)

    for step in range(3000):
        now += rng.expovariate(200.0)
        if rank.wake_at <= now:
            rank.on_timer(now, out)
            answer_grants()
        if step % 500 == 499:
            members = {m: rng.sample(gpus, rng.randint(1, 3)) for m in models}
            rank.set_members(now, members, out)
            answer_grants()
        model = rng.choice(models)
        exec_at = now + rng.uniform(0.0, 0.01)
        rank.on_candidate(now, _cand(model, 4, exec_at, exec_at + 0.02, 0.001), out)
        answer_grants()
    assert min(granted.values()) > 50
    assert rank.n_grants == sum(granted.values())


# ---------------------------------------------------------------- embedded in the SchedulerCore

PROFILE = LatencyProfile.linear(alpha_ms=1.0, beta_ms=5.0, max_batch=8)
FRONTEND = "fe/data"


def _meta(model: str, ids: list[int], at: float) -> RequestMetaBatch:
    return RequestMetaBatch(FRONTEND, ids, [model] * len(ids), [at] * len(ids),
                            [at + 50 * MS] * len(ids))


def test_the_embedded_core_plans_a_model_only_onto_its_gpus() -> None:
    core = SchedulerCore("shard-t", rank=RankThread([0, 1, 2, 3], 0.0))
    for model in ("a", "b"):
        core.add_thread(0.0, ModelThread(model, PROFILE, 50 * MS, "deferred"), [])
    out: Outbox = []
    core.set_members(0.0, {"a": [3], "b": [0, 1, 2, 3]}, out)
    plans: list[BatchPlan] = []
    rid = 0
    now = 0.0
    while now < 0.5:
        for model in ("a", "b"):
            rid += 1
            core.on_meta(now, _meta(model, [rid], now), out)
        if core.wake_at <= now + 2 * MS:
            now = max(now, core.wake_at)
            core.on_timer(now, out)
        plans += [m for (kind, _), m in out if kind == DEST_BACKEND and isinstance(m, BatchPlan)]
        out.clear()
        now += 2 * MS
    assert {p.gpu_id for p in plans if p.model == "a"} == {3}
    assert {p.model for p in plans} == {"a", "b"}


def test_the_embedded_core_answers_a_model_with_no_gpu_unavailable() -> None:
    core = SchedulerCore("shard-t", rank=RankThread([0], 0.0))
    core.add_thread(0.0, ModelThread("a", PROFILE, 50 * MS, "deferred"), [])
    out: Outbox = []
    core.on_meta(0.0, _meta("a", [1, 2], 0.0), out)  # queued (deferred)
    core.set_members(0.0, {"a": []}, out)
    core.on_meta(0.0, _meta("a", [3], 0.0), out)
    drops = [m for (kind, _), m in out if kind == DEST_FRONTEND and isinstance(m, DropNotice)]
    assert sorted(i for d in drops for i in d.request_ids) == [1, 2, 3]
    assert {d.error for d in drops} == {ErrorKind.UNAVAILABLE.value}


# ---------------------------------------------------------------- the rank's backend table


def _register(name: str, models: list[str]) -> BackendRegister:
    return BackendRegister(name=name, device="emulated", plan_address=f"ipc://{name}",
                           models=models, profiles_ms={})


def test_a_backends_registration_is_the_one_step_that_changes_its_models_gpus() -> None:
    rank = RankThread([], 0.0)
    backends = RankBackends(rank, {}, name="rank")
    out: Outbox = []
    backends.on_register(0.0, b"backend-0", _register("backend-0", ["a", "b"]), out, active=True)
    backends.on_register(0.0, b"backend-1", _register("backend-1", ["b"]), out, active=True)
    assert rank.gpus_of("a") == [0] and rank.gpus_of("b") == [0, 1]
    backends.on_register(0.0, b"backend-1", _register("backend-1", ["a", "b"]), out, active=True)
    assert rank.gpus_of("a") == [0, 1]
    backends.on_register(0.0, b"backend-0", _register("backend-0", ["b"]), out, active=True)
    assert rank.gpus_of("a") == [1] and backends.members() == {"a": [1], "b": [0, 1]}


@pytest.mark.parametrize("home", [False, True])
def test_a_freed_gpu_goes_to_the_models_at_home_there_before_one_spilling(home: bool) -> None:
    """GPU 0 is the cheap kind (home of "small"), GPU 1 the pricier one (home of "big"; "small"
    may spill there). Both busy; "small" is more urgent than "big". Without a preference the
    freed GPU 1 goes to "small"; with one (``set_home``) to "big", and "small" keeps waiting
    for its own GPU. With nobody at home waiting, "small" spills onto GPU 1."""
    rank = RankThread([0, 1], 0.0)
    out: Outbox = []
    rank.set_members(0.0, {"small": [0, 1], "big": [1], "fill0": [0], "fill1": [1]}, out)
    if home:
        rank.set_home({"small": [0], "big": [1]})
    for fill, until in (("fill0", 3.0), ("fill1", 1.0)):
        rank.on_candidate(0.0, _cand(fill, 1, 0.0, 1.0), out)
        (grant,) = _grants(out)
        _answer(rank, 0.0, grant, until, out)
        out.clear()
    rank.on_candidate(0.5, _cand("small", 4, exec_at=0.5, latest=3.5), out)
    rank.on_candidate(0.5, _cand("big", 4, exec_at=0.5, latest=4.0), out)
    rank.on_timer(0.5, out)
    assert _grants(out) == [] and sorted(rank.pending_models()) == ["big", "small"]
    rank.on_timer(rank.wake_at, out)  # GPU 1 frees at 1.0
    (grant,) = _grants(out)
    assert (grant.model, grant.gpu_id) == (("big", 1) if home else ("small", 1))
    if home:
        assert rank.pending_models() == ["small"]  # it waits for GPU 0 (free at 3.0)
        _answer(rank, 1.0, grant, 2.0, out)
        out.clear()
        rank.on_timer(rank.wake_at, out)  # GPU 1 frees at 2.0, before GPU 0: nobody at home
        (spill,) = _grants(out)
        assert (spill.model, spill.gpu_id) == ("small", 1)
