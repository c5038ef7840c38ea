"""RankThread: GPU free times, one candidate per model, and model-GPU matchmaking (pure logic).

See ``zserve.core.hosting`` for the hosting contract (``now``, outbox, ``wake_at``).

Inputs (host -> RankThread):

- ``on_candidate(now, update: CandidateUpdate, outbox)``: a model's latest candidate (latest value
  wins; ``batch_size`` 0 withdraws). Ignored while the model has an unanswered grant.
- ``on_grant_answer(now, answer: GrantAnswer, outbox)``: the GPU is busy until ``free_at`` (or is
  returned untouched); the model's candidates are accepted again.
- ``on_device_free_at(now, gpu_id, free_at, outbox)``: the GPU's backend projects its device
  free at ``free_at`` (``BatchStats.device_free_at``: it started batches later than planned).
  Moves the GPU's free time later, never earlier (the rank may have granted a batch the backend
  has not received yet); ignored while the GPU is granted and unanswered (the answer sets it).
- ``add_gpu(now, gpu_id, outbox, free_at=None)``, ``remove_gpu(now, gpu_id, outbox)``: GPU-set
  changes at run time. A removed GPU finishes what it holds and is granted nothing new.
- ``release_grants(now, models, outbox)``: the grants of ``models`` still unanswered will never
  be answered (the shard that owned them restarted, or the grant could not be sent): each GPU
  goes back as it was before its grant and the models' candidates are accepted again.
- ``set_members(now, members, outbox)``: which GPUs serve which model (model -> GPU ids; a model
  absent serves none), or None: every GPU serves every model (the default). A candidate is
  matched only to a GPU that serves its model.
- ``on_timer(now, outbox)``: ``now >= wake_at`` (model timers and the GPU timer are internal).

Outputs: ``(("model", name), GrantGpu)``.

Matching (Symphony Appendix D, with the design's consolidation rule):

- Model timer at ``exec - delay(bs)``: if ``now + delay(bs) > latest`` the candidate is stale and
  nothing happens (its ModelThread re-evaluates at that moment). Otherwise the candidate gets the
  lowest-id GPU that is already free (consolidation: high ids stay idle at low load), else the
  GPU with the smallest free time if it is free by ``exec``; otherwise the candidate becomes
  *schedulable* (pending).
- GPU timer at ``min free_at - max pending delay``: purge pending candidates with
  ``latest < free_at`` (safe for every later GPU, which frees no earlier), then grant the GPU to the
  pending candidate with the smallest ``latest`` (least slack first), or under
  ``GRANT_EARLIEST_DEADLINE`` (``eager-edf``) the earliest deadline, ``latest`` plus its batch's
  duration. Under the two ordered grants (``eager-edf``, ``eager-lsf``) a model timer takes only
  a GPU idle now, so every GPU that frees goes to the most urgent waiting candidate rather than
  to the first whose timer fires.
- A grant marks the GPU as granted (free at +inf) and discards the model's candidate; the model's
  further candidates are ignored until its GrantAnswer arrives.

The ``deferred`` policy's rescue (``_rescue``, ``_rescue_at_risk``): a GPU that is idle or frees
may start an ``early_ok`` candidate before its exec time, under contention or where waiting would
certainly cost another candidate its window; it is evaluated at most once per
``RESCUE_SPACING_S_PER_CANDIDATE`` times the candidates held (``_rescue_step``). Under contention
a freeing GPU may go to such a candidate ahead of a pending one with a later latest start, if its
batch runs at least as long as the pending one's (``_on_gpu_timer``).

Membership: the GPUs are grouped into *pools*, the GPUs that serve the same models (one pool of
every GPU while every GPU serves every model). Each pool keeps its own idle and busy heaps and
its own waiting candidates (a candidate waits in every pool of its model): a model's timer takes
the first free GPU among its pools, and a pool's GPU timer grants its GPU only to a candidate of
a model it serves. A GPU no waiting model is served by stays free for the models it serves, and
no GPU is granted to a model that does not run there. With one pool every lookup is the one it
was before membership existed (``bench-scheduler`` measures that path). In pools, a rescue looks
at each pool's GPUs and models, and candidates waiting in one pool hold back the rescue in every
pool (as one waiting candidate holds it back in the single pool).

Data structures: binary heaps with lazy deletion (each entry carries the model's candidate version
or the GPU's state stamp), so every event costs O(log M + log G) amortized.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping

from zserve.config.policy_names import GRANT_EARLIEST_DEADLINE, GRANT_FIRST_DUE, GRANT_LEAST_SLACK
from zserve.core.hosting import DEST_MODEL, Outbox
from zserve.scheduler.policy import (
    RESCUE_CONTENTION,
    RESCUE_CONTENTION_EWMA,
    RESCUE_SPACING_S_PER_CANDIDATE,
)
from zserve.transport.messages import CandidateUpdate, GrantAnswer, GrantGpu

_INF = math.inf
# GPU states
_IDLE = 0  # free_at <= some time already seen; lives in the idle heap (lowest id first)
_BUSY = 1  # lives in the busy heap keyed by (free_at, gpu_id)
_GRANTED = 2  # granted, waiting for the model's answer; in no heap


class _Pool:
    """GPUs that serve the same models (``models``; None: every model): their idle heap (lowest
    id first), their busy heap (by free time), and the candidates waiting for one of them
    (``pending``: model -> version, with its two heaps, by latest start and by send delay)."""

    __slots__ = ("busy", "gpus", "idle", "models", "pending", "pending_delay", "pending_latest")

    def __init__(self, models: frozenset[str] | None, pending: dict[str, int]) -> None:
        self.models = models
        self.gpus: set[int] = set()
        self.idle: list[tuple[int, int]] = []  # (gpu_id, stamp)
        self.busy: list[tuple[float, int, int]] = []  # (free_at, gpu_id, stamp)
        self.pending = pending
        # (order key, version, model): the latest start, or the deadline (deadline_order)
        self.pending_latest: list[tuple[float, int, str]] = []
        self.pending_delay: list[tuple[float, int, str]] = []  # (-delay, version, model)


class RankThread:
    """Global GPU state and per-model candidates; see the module docstring.

    GPUs: ``_free_at`` and ``_state`` (``_IDLE``, ``_BUSY``, ``_GRANTED``) by GPU id, ``_stamp``
    (a GPU's heap entries are live while their stamp matches), and the pools (``_Pool``: the
    GPUs serving the same models, with their heaps; ``_pool_of`` by GPU id, ``_model_pools`` by
    model, None while every GPU serves every model and ``_everywhere`` is the one pool).
    Candidates: ``_candidates`` (model -> ``(bs, exec_at, latest, delay)``: ``bs`` is the batch
    size in rows), ``_candidate_runs`` (the rescue's view: duration, early_ok, shared) and
    ``_version`` (a model's heap entries are live while their version matches); ``_pending``
    holds the schedulable candidates waiting for a GPU (each waits in every pool of its model as
    well; the one pool's ``pending`` is ``_pending`` itself). Grants: ``_awaiting`` (model -> its
    unanswered grant id) and ``_grants`` (grant id -> model and GPU).
    """

    # kind preference (set_home): model -> the GPUs where it is at home; None: everywhere
    _home: dict[str, frozenset[int]] | None = None

    def __init__(self, gpu_ids: list[int] | tuple[int, ...] = (), now: float = 0.0, *,
                 grant_order: str = GRANT_FIRST_DUE) -> None:
        """``grant_order`` (``zserve.config.policy_names``): ``GRANT_FIRST_DUE``, a candidate takes
        the GPU that is free by its exec time when its timer comes, and a freed GPU goes to the
        waiting candidate with the earliest latest start; ``GRANT_LEAST_SLACK`` and
        ``GRANT_EARLIEST_DEADLINE``, a candidate takes only a GPU idle at its timer, and a GPU
        that frees goes to the waiting candidate with the earliest latest start, or deadline:
        the most urgent, whichever timer came first (the eager baselines)."""
        if grant_order not in (GRANT_FIRST_DUE, GRANT_LEAST_SLACK, GRANT_EARLIEST_DEADLINE):
            raise ValueError(f"unknown grant order {grant_order!r}")
        self.wake_at = _INF
        self.grant_order = grant_order
        self._by_deadline = grant_order == GRANT_EARLIEST_DEADLINE
        self._free_only = grant_order != GRANT_FIRST_DUE
        # The scheduler epoch its grants carry (zserve.core.epochs); the host sets it.
        self.epoch = 0
        self._free_at: dict[int, float] = {}
        self._state: dict[int, int] = {}
        self._n_idle = 0  # GPUs in state _IDLE (_set_state keeps it)
        self._stamp: dict[int, int] = {}
        self._removing: set[int] = set()
        # candidates: model -> (bs, exec_at, latest, delay); version bumps invalidate heap entries
        self._candidates: dict[str, tuple[int, float, float, float]] = {}
        # the rescue's view of each candidate: model -> (duration, early_ok, shared, aim_at); and
        # how many candidates are early_ok (the rescue runs only while some are)
        self._candidate_runs: dict[str, tuple[float, bool, bool, float]] = {}
        # the hold-back's view of the sharing models: model -> its lone request's wait for a GPU
        # (CandidateUpdate.lone_wait_s); the two tightest of them (None: to recompute)
        self._lone_wait: dict[str, float] = {}
        self._tightest: list[tuple[float, str]] | None = []
        self._n_early_ok = 0
        # the rescue's next evaluation no sooner than this (RESCUE_SPACING_S_PER_CANDIDATE)
        self._rescue_next = -_INF
        self._version: dict[str, int] = {}
        self._awaiting: dict[str, int] = {}  # model -> grant_id
        self._grants: dict[int, tuple[str, int]] = {}  # grant_id -> (model, gpu_id)
        self._granted_free_at: dict[int, float] = {}  # grant_id -> the GPU's free time before
        self._grant_seq = 0
        self._model_timers: list[tuple[float, int, str]] = []  # (fire_at, version, model)
        self._pending: dict[str, int] = {}  # model -> version (schedulable, waiting for a GPU)
        # membership (the module docstring): the pools, by GPU and by model
        self._everywhere = _Pool(None, self._pending)
        self._pools: list[_Pool] = [self._everywhere]
        self._pool_of: dict[int, _Pool] = {}
        self._model_pools: dict[str, list[_Pool]] | None = None
        self._gpu_models: dict[int, frozenset[str]] = {}  # the members map, by GPU
        self._pool_by_models: dict[frozenset[str], _Pool] = {}
        self.n_grants = 0  # counters
        self.n_model_matches = 0
        self.n_gpu_matches = 0
        self.n_stale = 0
        self.n_purged = 0
        self.n_rescues = 0  # early grants: a deferring candidate started before its exec time
        self.n_holds = 0  # early starts held back to their aim to keep a GPU for a tighter model
        # the chance that a candidate due at its exec time finds every GPU busy (EWMA)
        self.contention = 0.0
        self.n_drift_corrections = 0  # device_free_at reports that moved a GPU later
        self.drift_corrected_s = 0.0  # and by how much, in total
        for gpu_id in gpu_ids:
            self._insert_gpu(gpu_id, now, now)

    # ------------------------------------------------------------------ GPU set

    @property
    def gpu_ids(self) -> list[int]:
        return sorted(g for g in self._state if g not in self._removing)

    def gpu_free_at(self, gpu_id: int) -> float:
        """The GPU's free time (``inf`` while granted and unanswered)."""
        return _INF if self._state[gpu_id] == _GRANTED else self._free_at[gpu_id]

    def add_gpu(
        self, now: float, gpu_id: int, outbox: Outbox, free_at: float | None = None
    ) -> None:
        if gpu_id in self._state and gpu_id not in self._removing:
            raise ValueError(f"GPU {gpu_id} already exists")
        self._removing.discard(gpu_id)
        if gpu_id in self._state and self._state[gpu_id] == _GRANTED:
            return  # re-added while a grant is outstanding: the answer puts it back
        self._insert_gpu(gpu_id, now if free_at is None else free_at, now)
        self._fire_due(now, outbox)

    def remove_gpu(self, now: float, gpu_id: int, outbox: Outbox) -> None:
        if gpu_id not in self._state or gpu_id in self._removing:
            raise ValueError(f"GPU {gpu_id} does not exist")
        if self._state[gpu_id] == _GRANTED:
            self._removing.add(gpu_id)  # dropped when its grant is answered
        else:
            self._drop_gpu(gpu_id)
        self._fire_due(now, outbox)

    def _insert_gpu(self, gpu_id: int, free_at: float, now: float) -> None:
        stamp = self._stamp.get(gpu_id, 0) + 1
        self._stamp[gpu_id] = stamp
        self._free_at[gpu_id] = free_at
        pool = self._pool_of.get(gpu_id) or self._join_pool(gpu_id)
        if free_at <= now:
            self._set_state(gpu_id, _IDLE)
            heapq.heappush(pool.idle, (gpu_id, stamp))
        else:
            self._set_state(gpu_id, _BUSY)
            heapq.heappush(pool.busy, (free_at, gpu_id, stamp))

    def _set_state(self, gpu_id: int, state: int) -> None:
        if self._state.get(gpu_id) == _IDLE:
            self._n_idle -= 1
        if state == _IDLE:
            self._n_idle += 1
        self._state[gpu_id] = state

    def _drop_gpu(self, gpu_id: int) -> None:
        self._stamp[gpu_id] = self._stamp.get(gpu_id, 0) + 1  # invalidates heap entries
        if self._state[gpu_id] == _IDLE:
            self._n_idle -= 1
        del self._state[gpu_id]
        del self._free_at[gpu_id]
        self._removing.discard(gpu_id)
        pool = self._pool_of.pop(gpu_id, None)
        if pool is not None:
            pool.gpus.discard(gpu_id)

    # ------------------------------------------------------------------ membership

    def set_members(self, now: float, members: Mapping[str, Iterable[int]] | None,
                    outbox: Outbox) -> None:
        """Which GPUs serve which model (a model absent from ``members`` serves none; a GPU id
        not in the rank yet joins its pool when added), or None: every GPU serves every model.
        Candidates waiting for a GPU wait for their model's GPUs from now on; a grant already
        made stands (its model's thread declines a GPU it no longer serves)."""
        if members is None:
            self._model_pools = None
            self._gpu_models = {}
        else:
            by_gpu: dict[int, set[str]] = {}
            for model, gpu_ids in members.items():
                for gpu_id in gpu_ids:
                    by_gpu.setdefault(gpu_id, set()).add(model)
            self._model_pools = {}
            self._gpu_models = {g: frozenset(models) for g, models in by_gpu.items()}
        self._rebuild_pools(now)
        self._fire_due(now, outbox)

    def set_home(self, home: Mapping[str, Iterable[int]] | None) -> None:
        """The GPUs where each model is at home (the device kind that serves it for least); its
        other GPUs take it as a spill only: a GPU that frees goes to the most urgent candidate
        at home there, and to one spilling only when none at home waits for it. A model not
        listed is at home everywhere; None (the default): no preference."""
        self._home = None if home is None else {m: frozenset(g) for m, g in home.items()}

    def _home_first(self, pool: _Pool, model: str, gpu_id: int, free_at: float) -> str | None:
        """``model``, the most urgent waiting there, unless it would spill onto ``gpu_id``: then
        the most urgent candidate at home there waiting in time, else ``model`` if its batch
        ends before any candidate at home there must start, else None (it stops waiting
        there: the GPU is kept for the models at home on it)."""
        home = self._home
        assert home is not None
        if gpu_id in home.get(model, (gpu_id,)):
            return model
        best, best_latest = model, _INF
        candidates = self._candidates
        for other in pool.pending:
            latest = candidates[other][2]
            if free_at <= latest < best_latest and gpu_id in home.get(other, (gpu_id,)):
                best, best_latest = other, latest
        if best != model:
            return best
        done = free_at + self._candidate_runs[model][0]
        for other, (_, _, latest, _) in candidates.items():
            if other != model and latest < done and gpu_id in home.get(other, (gpu_id,)):
                return None
        return model

    def _home_pools(self, model: str, pools: list[_Pool]) -> list[_Pool]:
        """``pools`` with a GPU at home for ``model`` (all of them when none has)."""
        assert self._home is not None
        home = self._home.get(model)
        if home is None:
            return pools
        return [p for p in pools if not p.gpus.isdisjoint(home)] or pools

    def gpus_of(self, model: str) -> list[int]:
        """The GPUs (in use) that serve ``model``."""
        pools = self._pools if self._model_pools is None else self._model_pools.get(model, [])
        return sorted(g for pool in pools for g in pool.gpus if g not in self._removing)

    def _join_pool(self, gpu_id: int) -> _Pool:
        """Put ``gpu_id`` in the pool of the models it serves (a new pool if none has them)."""
        model_pools = self._model_pools
        if model_pools is None:
            pool = self._everywhere
        else:
            models = self._gpu_models.get(gpu_id, frozenset())
            found = self._pool_by_models.get(models)
            if found is None:
                found = _Pool(models, {})
                self._pool_by_models[models] = found
                self._pools.append(found)
                for model in models:
                    model_pools.setdefault(model, []).append(found)
            pool = found
        pool.gpus.add(gpu_id)
        self._pool_of[gpu_id] = pool
        return pool

    def _rebuild_pools(self, now: float) -> None:
        """New pools from the members map: every GPU goes into its pool's heaps again (a
        granted one when answered), every waiting candidate waits in its model's pools, and
        every other candidate's timer is armed again (one whose model had no GPU had none)."""
        self._pool_by_models = {}
        self._pool_of = {}
        if self._model_pools is None:
            self._everywhere = _Pool(None, self._pending)
            self._pools = [self._everywhere]
        else:
            self._pools = []
        for gpu_id, state in list(self._state.items()):
            self._join_pool(gpu_id)
            if state != _GRANTED:
                self._insert_gpu(gpu_id, self._free_at[gpu_id], now)
        for model, (_, exec_at, latest, delay) in self._candidates.items():
            version = self._version[model]
            if model in self._pending:
                self._wait_for_gpu(model, version, latest, delay)
            else:
                heapq.heappush(self._model_timers, (exec_at - delay, version, model))

    def _pools_of(self, model: str) -> list[_Pool]:
        model_pools = self._model_pools
        return self._pools if model_pools is None else model_pools.get(model, [])

    def _wait_for_gpu(self, model: str, version: int, latest: float, delay: float) -> None:
        """The candidate waits for a GPU: in ``_pending`` and in every pool of its model."""
        self._pending[model] = version
        # a candidate's deadline is its latest start plus its batch's duration
        key = latest + self._candidate_runs[model][0] if self._by_deadline else latest
        for pool in self._pools_of(model):
            pool.pending[model] = version
            heapq.heappush(pool.pending_latest, (key, version, model))
            heapq.heappush(pool.pending_delay, (-delay, version, model))

    def _unpend(self, model: str) -> None:
        """The model's candidate waits for no GPU any more."""
        if self._pending.pop(model, None) is not None and self._model_pools is not None:
            for pool in self._model_pools.get(model, ()):
                pool.pending.pop(model, None)

    # ------------------------------------------------------------------ messages

    def on_candidate(self, now: float, update: CandidateUpdate, outbox: Outbox) -> None:
        model = update.model
        if model in self._awaiting:
            return  # computed before the model saw its grant: stale
        version = self._version.get(model, 0) + 1
        self._version[model] = version
        self._unpend(model)
        self._forget_run(model)
        if update.batch_size <= 0:
            self._candidates.pop(model, None)
        else:
            delay = update.send_delay
            self._candidates[model] = (update.batch_size, update.exec_at, update.latest, delay)
            self._candidate_runs[model] = (update.duration, update.early_ok, update.shared,
                                           update.aim_at)
            self._note_lone_wait(model, update.lone_wait_s if update.shared else _INF)
            if update.early_ok:
                self._n_early_ok += 1
            heapq.heappush(self._model_timers, (update.exec_at - delay, version, model))
        self._fire_due(now, outbox)

    def _forget_run(self, model: str) -> None:
        run = self._candidate_runs.pop(model, None)
        if run is not None and run[1]:
            self._n_early_ok -= 1

    def on_grant_answer(self, now: float, answer: GrantAnswer, outbox: Outbox) -> None:
        grant = self._grants.get(answer.grant_id)
        if grant is None or grant != (answer.model, answer.gpu_id):
            raise ValueError(f"unknown grant {answer.grant_id} for {answer.model}/{answer.gpu_id}")
        self._close_grant(now, answer.grant_id, answer.free_at)
        self._fire_due(now, outbox)

    def release_grants(self, now: float, models: list[str], outbox: Outbox) -> int:
        """Give back the unanswered grants of ``models`` (no answer will come for them); returns
        how many. Without this, a grant lost with its shard holds its GPU and its model forever:
        the model's every later candidate is ignored while it awaits the answer."""
        released = 0
        for model in models:
            grant_id = self._awaiting.get(model)
            if grant_id is not None:
                self._close_grant(now, grant_id, self._granted_free_at[grant_id])
                released += 1
        if released:
            self._fire_due(now, outbox)
        return released

    def _close_grant(self, now: float, grant_id: int, free_at: float) -> None:
        model, gpu_id = self._grants.pop(grant_id)
        self._granted_free_at.pop(grant_id, None)
        self._awaiting.pop(model, None)
        if gpu_id in self._removing:
            self._drop_gpu(gpu_id)
        elif gpu_id in self._state:
            self._insert_gpu(gpu_id, free_at, now)

    def on_device_free_at(self, now: float, gpu_id: int, free_at: float, outbox: Outbox) -> bool:
        """The backend of ``gpu_id`` reports that its device frees at ``free_at``; True when that
        moved the GPU's free time (later). The GPU timer and matching are re-evaluated."""
        state = self._state.get(gpu_id)
        if state is None or state == _GRANTED or not math.isfinite(free_at):
            return False
        old = self._free_at[gpu_id]
        if free_at <= old:
            return False
        self.n_drift_corrections += 1
        self.drift_corrected_s += free_at - old
        self._insert_gpu(gpu_id, free_at, now)  # new stamp: its old heap entry is void
        self._fire_due(now, outbox)
        return True

    def on_timer(self, now: float, outbox: Outbox) -> None:
        self._fire_due(now, outbox)

    # ------------------------------------------------------------------ matching

    def _earliest_gpu(self, now: float, pools: list[_Pool]) -> tuple[int, float] | None:
        """Among ``pools``' GPUs, the lowest-id idle GPU, else the busy GPU that frees first."""
        if len(pools) == 1:
            return self._earliest_in(pools[0], now)
        best: tuple[int, float] | None = None
        best_key = (2, _INF)
        for pool in pools:
            found = self._earliest_in(pool, now)
            if found is not None:
                # idle ones first, by id (consolidation), then by free time
                key = (0, found[0]) if found[1] <= now else (1, found[1])
                if key < best_key:
                    best, best_key = found, key
        return best

    def _earliest_in(self, pool: _Pool, now: float) -> tuple[int, float] | None:
        """The pool's lowest-id idle GPU, else its busy GPU that frees first (after moving
        GPUs whose free time has passed into the idle heap)."""
        busy = pool.busy
        state = self._state
        stamp = self._stamp
        while busy:
            free_at, gpu_id, st = busy[0]
            if stamp.get(gpu_id) != st or state.get(gpu_id) != _BUSY:
                heapq.heappop(busy)
                continue
            if free_at > now:
                break
            heapq.heappop(busy)
            self._set_state(gpu_id, _IDLE)
            heapq.heappush(pool.idle, (gpu_id, st))
        idle = pool.idle
        while idle:
            gpu_id, st = idle[0]
            if stamp.get(gpu_id) != st or state.get(gpu_id) != _IDLE:
                heapq.heappop(idle)
                continue
            return gpu_id, self._free_at[gpu_id]
        if busy:
            return busy[0][1], busy[0][0]
        return None

    def _grant(self, now: float, model: str, gpu_id: int, outbox: Outbox,
               early: bool = False) -> None:
        free_at = self._free_at[gpu_id]
        self._set_state(gpu_id, _GRANTED)
        self._stamp[gpu_id] += 1
        self._grant_seq += 1
        grant_id = self._grant_seq
        self._grants[grant_id] = (model, gpu_id)
        self._granted_free_at[grant_id] = free_at
        self._awaiting[model] = grant_id
        self._candidates.pop(model, None)
        self._forget_run(model)
        self._unpend(model)
        self._version[model] = self._version.get(model, 0) + 1
        self.n_grants += 1
        outbox.append(((DEST_MODEL, model), GrantGpu(model, gpu_id, grant_id, free_at,
                                                     self.epoch, early)))

    def _on_model_timer(self, now: float, model: str, version: int, outbox: Outbox) -> None:
        _, exec_at, latest, delay = self._candidates[model]
        if now + delay > latest:
            self.n_stale += 1
            return
        model_pools = self._model_pools
        if model_pools is None:
            found = self._earliest_in(self._everywhere, now)
        else:
            pools = model_pools.get(model)
            if not pools:
                return  # no GPU serves the model: its timer is armed again when one does
            if self._home is not None:  # its own timer takes a GPU at home; a spill waits
                pools = self._home_pools(model, pools)
            found = self._earliest_gpu(now, pools)
        # contention counts the candidates of models that share GPUs: a staggered model's
        # candidate finds its GPUs busy at about 40% of its aims by design (policy.py)
        run = self._candidate_runs[model]  # set with _candidates[model], in on_candidate
        shared = run[2]
        if found is not None and found[1] <= (now if self._free_only else exec_at):
            if run[3] > exec_at:
                hold_to = self._hold_back_to(now, model, found, latest - delay, run[3])
                if hold_to > exec_at:
                    self._hold(model, version, hold_to)
                    return
            if shared:
                self.contention -= RESCUE_CONTENTION_EWMA * self.contention
            self.n_model_matches += 1
            self._grant(now, model, found[0], outbox)
            return
        if shared:
            self.contention += RESCUE_CONTENTION_EWMA * (1.0 - self.contention)
        self._wait_for_gpu(model, version, latest, delay)

    # ------------------------------------------------------------------ hold-back

    def _note_lone_wait(self, model: str, lone_wait_s: float) -> None:
        """A model's lone-request wait as its update carries it (inf: it does not share GPUs)."""
        if self._lone_wait.get(model, _INF) == lone_wait_s:
            return
        if lone_wait_s == _INF:
            del self._lone_wait[model]
        else:
            self._lone_wait[model] = lone_wait_s
        self._tightest = None

    def _tightest_other(self, model: str) -> float:
        """The shortest lone-request wait among the models sharing GPUs other than ``model``."""
        tightest = self._tightest
        if tightest is None:
            tightest = self._tightest = heapq.nsmallest(
                2, ((wait, name) for name, wait in self._lone_wait.items()))
        for wait, name in tightest:
            if name != model:
                return wait
        return _INF

    def _hold_back_to(self, now: float, model: str, found: tuple[int, float],
                      last_start: float, aim_at: float) -> float:
        """Until when a candidate that starts at once by choice (for want of joiners) waits
        instead (policy.py, ``deferred``); ``now`` or earlier: it does not. It waits while the
        cluster is not contended, its batch would take the last free GPU (``found``), and a model
        sharing the GPUs whose lone request can wait less than the candidate itself (by
        ``last_start``, its last grantable moment) would find no GPU for longer than that wait:
        until the batch ends or another GPU frees. Frontrun's delays keep that GPU free; eager's
        start takes it. It waits for its aim ``aim_at``, or only until it has no more wait left
        than the tighter model (then it is no longer the one that can afford to wait). With
        per-model membership (``set_members``) it still counts the whole rank's GPUs and models:
        on a partial placement it may hold a batch for a tighter model of another pool, never
        past the aim the batch would have waited for under frontrun."""
        if self.contention > RESCUE_CONTENTION or self._n_idle > 1:
            return now
        tight = self._tightest_other(model)
        hold_to = last_start - tight
        if hold_to <= now:
            return now
        gpu_id = found[0]
        other_free_at = _INF  # when another GPU frees
        for other, state in self._state.items():
            if state == _BUSY and other != gpu_id and other not in self._removing:
                free_at = self._free_at[other]
                other_free_at = free_at if free_at < other_free_at else other_free_at
        blocked_until = (found[1] if found[1] > now else now) + self._candidate_runs[model][0]
        blocked_until = other_free_at if other_free_at < blocked_until else blocked_until
        if tight >= blocked_until - now:
            return now
        hold_to = aim_at if aim_at < hold_to else hold_to
        # and only until another GPU frees: it is looked at again there, and goes if that
        # leaves a GPU free (holding it on costs the batch of 1 latency and the GPU's later time)
        return other_free_at if other_free_at < hold_to else hold_to

    def _hold(self, model: str, version: int, hold_to: float) -> None:
        """Hold the candidate back: its exec time becomes ``hold_to`` and its timer fires there
        (unless an update replaces it first), where ``_hold_back_to`` looks at it again: its aim
        stays, so it is held again only while the rule still holds and up to the same bound."""
        bs, _, latest, delay = self._candidates[model]
        self._candidates[model] = (bs, hold_to, latest, delay)
        heapq.heappush(self._model_timers, (hold_to - delay, version, model))
        self.n_holds += 1

    def _enlist_due_by(self, now: float, free_at: float, pool: _Pool) -> None:
        """Ordered grants: every candidate of the pool's models whose exec time comes by
        ``free_at`` and that a grant now still serves in time joins the waiting ones, whether
        or not its own timer came: the GPU goes to the most urgent of them all."""
        pending = self._pending
        models = pool.models
        for model, (_, exec_at, latest, delay) in self._candidates.items():
            if (model not in pending and exec_at <= free_at and now + delay <= latest
                    and (models is None or model in models)):
                self._wait_for_gpu(model, self._version[model], latest, delay)

    def _max_pending_delay(self, pool: _Pool) -> float:
        heap = pool.pending_delay
        pending = pool.pending
        while heap:
            neg_delay, version, model = heap[0]
            if pending.get(model) == version:
                return -neg_delay
            heapq.heappop(heap)
        return -_INF

    def _on_gpu_timer(self, now: float, pool: _Pool, gpu: tuple[int, float],
                      outbox: Outbox) -> None:
        gpu_id, free_at = gpu
        if self._free_only:
            self._enlist_due_by(now, free_at, pool)
        heap = pool.pending_latest
        pending = pool.pending
        while heap:
            _, version, model = heap[0]
            if pending.get(model) != version:
                heapq.heappop(heap)
                continue
            latest = self._candidates[model][2]
            if latest < free_at:
                heapq.heappop(heap)
                self._purge(now, pool, model)
                continue
            if self._home is not None:
                chosen = self._home_first(pool, model, gpu_id, free_at)
                if chosen is None:  # its spill would block a model at home there
                    heapq.heappop(heap)
                    self._purge(now, pool, model)
                    continue
                if chosen != model:  # the spilling one keeps waiting (its heap entry stays)
                    self.n_gpu_matches += 1
                    self._grant(now, chosen, gpu_id, outbox)
                    return
            if self._rescuing():
                rival = self._most_urgent_deferring(now, free_at, pool.models)
                # A waiting candidate is passed over only for a rival whose batch runs at least
                # as long: a longer batch passed over is the one that finds every GPU busy when
                # its short window closes (on the A100 zoo at 17,860 r/s the slowest model,
                # NASNetLarge, took most of the drops: 1.33% of its requests, 0.98% with this).
                if (rival is not None and rival[0] < latest
                        and self._candidate_runs[model][0] <= self._candidate_runs[rival[1]][0]):
                    self.n_rescues += 1
                    self._grant(now, rival[1], gpu_id, outbox, early=True)
                    return
            heapq.heappop(heap)
            self.n_gpu_matches += 1
            self._grant(now, model, gpu_id, outbox)
            return

    def _purge(self, now: float, pool: _Pool, model: str) -> None:
        """The pool's first GPU frees after the model's latest start: the candidate stops
        waiting there (safe for the pool's later GPUs, which free no earlier), and stops waiting
        for good once no pool of its model can serve it in time."""
        del pool.pending[model]
        if pool.pending is not self._pending:
            latest = self._candidates[model][2]
            for other in self._pools_of(model):
                if model in other.pending:
                    found = self._earliest_in(other, now)
                    if found is not None and found[1] <= latest:
                        return  # still waits there
            self._unpend(model)
        self.n_purged += 1

    def _most_urgent_deferring(self, now: float, free_at: float,
                               models: frozenset[str] | None = None,
                               ) -> tuple[float, str, float] | None:
        """The not yet due candidate (of ``models``; None: any) with the earliest latest start
        that a GPU free at ``free_at`` still serves in time, as (latest, model, delay), if it is
        early_ok (one that is not will want that GPU at its exec time: nobody is started ahead
        of it)."""
        best: tuple[float, str, float] | None = None
        pending = self._pending
        for model, (_, _, latest, delay) in self._candidates.items():
            if (model not in pending and latest >= free_at and now + delay <= latest
                    and (best is None or latest < best[0])
                    and (models is None or model in models)):
                best = (latest, model, delay)
        return best if best is not None and self._candidate_runs[best[1]][1] else None

    def _gpu_timer(self, now: float) -> tuple[float, _Pool | None, tuple[int, float] | None]:
        """When the next GPU timer fires (only while candidates wait for a GPU): the pool whose
        first GPU, less the longest send delay among the candidates waiting there, comes first;
        with that pool and its GPU."""
        t_gpu = _INF
        best_pool: _Pool | None = None
        gpu: tuple[int, float] | None = None
        for pool in self._pools:
            max_delay = self._max_pending_delay(pool)
            if max_delay > -_INF:
                found = self._earliest_in(pool, now)
                if found is not None and found[1] - max_delay < t_gpu:
                    t_gpu = found[1] - max_delay
                    best_pool, gpu = pool, found
        return t_gpu, best_pool, gpu

    def _fire_due(self, now: float, outbox: Outbox) -> None:
        timers = self._model_timers
        version_of = self._version
        while True:
            # the earliest valid model timer
            t_model = _INF
            while timers:
                fire_at, version, model = timers[0]
                if version_of.get(model) != version or model in self._pending:
                    heapq.heappop(timers)
                    continue
                t_model = fire_at
                break
            # the GPU timer (only while candidates wait for a GPU)
            t_gpu = _INF
            pool: _Pool | None = None
            gpu: tuple[int, float] | None = None
            if self._pending:
                t_gpu, pool, gpu = self._gpu_timer(now)
            if t_model <= now and t_model <= t_gpu:
                _, version, model = heapq.heappop(timers)
                self._on_model_timer(now, model, version, outbox)
                continue
            if t_gpu <= now and pool is not None and gpu is not None:
                self._on_gpu_timer(now, pool, gpu, outbox)
                continue  # granted, or purged some: re-evaluate
            wake = t_model if t_model < t_gpu else t_gpu
            if not self._pending and self._may_rescue():
                t_rescue = self._rescue_step(now, outbox)
                if t_rescue is None:
                    continue  # granted
                wake = t_rescue if t_rescue < wake else wake
            self.wake_at = wake
            return

    # ------------------------------------------------------------------ rescue

    def _rescue_step(self, now: float, outbox: Outbox) -> float | None:
        """The rescue that applies (contention or at-risk), at most once per spacing
        (RESCUE_SPACING_S_PER_CANDIDATE): an event soon after a look waits for the next one.
        None when it granted, else when to look again. In pools, each pool's GPUs and models
        are looked at in turn."""
        if now < self._rescue_next:
            return self._rescue_next
        rescue = self._rescue if self.contention > RESCUE_CONTENTION else self._rescue_at_risk
        if self._model_pools is None:
            t_rescue = rescue(now, self._everywhere, outbox)
        else:
            t_rescue = _INF
            for pool in self._pools:
                if pool.models:
                    t_pool = rescue(now, pool, outbox)
                    if t_pool is None:
                        t_rescue = None
                        break
                    t_rescue = min(t_rescue, t_pool)
        if t_rescue is not None:
            self._rescue_next = now + RESCUE_SPACING_S_PER_CANDIDATE * len(self._candidates)
        return t_rescue

    def _may_rescue(self) -> bool:
        """An early_ok candidate exists. One model alone may be rescued too: its shared
        candidates that find the GPUs busy are contention of its own (one GPU at saturation:
        deferral only leaves it idle), and a staggered model's never count as contention."""
        return self._n_early_ok > 0

    def _rescuing(self) -> bool:
        """Whether the contention rescue is on: it may rescue, and the cluster is contended."""
        return self.contention > RESCUE_CONTENTION and self._may_rescue()

    def _rescue_at_risk(self, now: float, pool: _Pool, outbox: Outbox) -> float | None:
        """The rescue below the contention bar, for a window that will certainly be lost: with a
        GPU of ``pool`` idle now, the waiting candidates of its models in order of their exec
        times each take the GPU that frees first and hold it for their duration; when one would
        then find no GPU by its latest start, the first early_ok candidate starts now (its batch
        frees the GPU sooner). On one GPU shared by two models this is what stops deferral
        losing a head to the other model's batch; a busier cluster's losses are the contention's.
        None when it granted."""
        found = self._earliest_in(pool, now)
        # No GPU idle: its freeing is an event of its own. An idle GPU for every waiting
        # candidate (_earliest_in moved every GPU free by now to _IDLE): no risk, decided
        # without the O(M log M + G log G) projection, which with 128 models on 128 GPUs ran at
        # every arrival and outran a core. (With one pool, every GPU idle is the pool's.)
        models = pool.models
        if (found is None or found[1] > now
                or (len(self._pools) == 1
                    and len(self._candidates) - len(self._pending) <= self._n_idle)):
            return _INF
        waiting = sorted((c[1], c[2], model) for model, c in self._candidates.items()
                         if model not in self._pending and (models is None or model in models))
        if not waiting:
            return _INF
        times = sorted(self._free_at[g] if self._free_at[g] > now else now
                       for g in pool.gpus
                       if self._state[g] != _GRANTED and g not in self._removing)
        del times[len(waiting):]
        if len(times) == len(waiting) and times[-1] <= now:
            return _INF  # an idle GPU for every waiting candidate
        return self._project_risk(now, waiting, times, found[0], outbox)

    def _project_risk(self, now: float, waiting: list[tuple[float, float, str]],
                      times: list[float], gpu_id: int, outbox: Outbox) -> float | None:
        """``_rescue_at_risk``'s projection: ``waiting`` (exec time, latest, model) take the
        GPUs free at ``times`` in turn; at risk, the first starts on ``gpu_id`` now."""
        heapq.heapify(times)
        run = self._candidate_runs
        for exec_at, latest, model in waiting:
            free_at = times[0]
            start = exec_at if exec_at > free_at else free_at
            if start > latest:
                break  # at risk
            heapq.heapreplace(times, start + run[model][0])
        else:
            return _INF
        _, latest, model = waiting[0]  # the next to start: another would take its GPU
        if run[model][1] and now + self._candidates[model][3] <= latest:
            self.n_rescues += 1
            self._grant(now, model, gpu_id, outbox, early=True)
            return None
        return _INF

    def _rescue(self, now: float, pool: _Pool, outbox: Outbox) -> float | None:
        """The ``deferred`` policy's rescue (zserve.scheduler.policy), while candidates that
        reach their exec time often find every GPU busy (``contention``) and none waits for a
        GPU: the GPU of ``pool`` that frees first goes to the deferring (early_ok) candidate of
        its models with the earliest latest start it still serves, granted ``delay`` before it
        frees, as a pending candidate's would be. Idle GPU time is then what the cluster runs
        short of later. None when it granted, else when to look again."""
        found = self._earliest_in(pool, now)
        if found is None:
            return _INF
        gpu_id, free_at = found
        best = self._most_urgent_deferring(now, free_at if free_at > now else now, pool.models)
        if best is None:
            return _INF  # no candidate fits this GPU's free time; events change that
        _, model, delay = best
        if free_at - delay > now:
            return free_at - delay
        # a GPU that frees with no candidate waiting for it is room: it counts like a candidate
        # that found its GPU free, or the rescue, once on, would keep itself on
        self.contention -= RESCUE_CONTENTION_EWMA * self.contention
        self.n_rescues += 1
        self._grant(now, model, gpu_id, outbox, early=True)
        return None

    # ------------------------------------------------------------------ introspection

    def pending_models(self) -> list[str]:
        return sorted(self._pending)

    def candidate(self, model: str) -> tuple[int, float, float, float] | None:
        return self._candidates.get(model)
