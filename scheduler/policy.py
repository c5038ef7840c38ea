"""What the scheduler does under each batch policy, the rate meter, and the rate-driven target
batch size. The policy names and their parse (``SchedulePolicy``) are the runtime kit's
(``zserve.policies``), which configuration validates with.

Schedule policies decide *when* a candidate becomes schedulable (its ``exec`` time); every policy
runs through the same ModelThread/RankThread code paths:

``deferred`` (default; ``deferred-bl`` is the same policy under its older name)
    Frontrun while deferring pays, else schedulable at once. With lambda the model's metered
    rate, b* its rate-driven target batch size and n = lambda*l(b*)/b* the GPUs its load needs,
    a candidate of ``bs`` requests waits for its frontrun moment ``d - l(bs + 1)`` only while

    - ``bs < max(beta*lambda, b*)`` when n >= DEFER_STAGGER_MIN_GPUS and beta*lambda >= 1: a
      model with the load of several GPUs runs staggered (DESIGN section 3), and starting before
      the staggered batch size wastes the stagger;
    - ``bs < beta*lambda - 1`` otherwise: the model shares GPUs with others, so at its frontrun
      moment (a window only ``alpha + jitter`` wide) the GPU it needs is often running another
      model's batch, and a missed window costs the head request; it waits only while at least
      one more whole request is expected within beta. Such a model also learns a margin from
      its own missed windows (DEFER_MISS_WIDEN_S per miss, up to DEFER_MISS_MAX_S, each granted
      batch gives DEFER_MISS_RELAX_S back).

    ``beta*lambda`` is the second Symphony paper's rule (section 4.3). It keeps deferred at or
    above 0.95x eager on the eager-floor grid, but on shared GPUs it mostly turns deferral off:
    ``beta*lambda - 1`` is below 1 for most A100-zoo models at their rates (batches of median 1
    on the 10-model zoo subset), and at light load a model below 2 GPUs of load never defers
    (at 0.1x of ResNet50's goodput on 4 GPUs the GPUs are 0.39 busy for 0.09 of load).
``deferred-adaptive``
    The decision by what waiting buys and what it costs (``zserve experiment policy-grid``
    measures it against the default). A candidate waits for its aim ``d - l(bs + 1)`` only while

    - a request is likely to join before then: lambda * (aim - now) >= DEFER_MIN_JOINERS (ln 2,
      an even chance); otherwise it starts at once, on a GPU that is idle anyway (at light load
      a lone request runs in l(1) plus the allowances);
    - on shared GPUs (the second branch above, with no beta*lambda bound): the model's estimate
      of its chance to lose the grant window (a window closed ungranted, or a head dropped after
      its candidate waited; DEFER_MISS_EWMA per deferred outcome) is at most DEFER_MISS_RATE_MAX,
      and its estimate of the chance to find every GPU busy at its aim is at most
      DEFER_QUEUED_RATE_MAX; batches granted meanwhile forget both (DEFER_MISS_FORGET_S,
      DEFER_MISS_FORGET_REQUESTS), so it tries again when the cluster has room;
    - staggered models: as ``deferred``.

    It keeps the GPU busy fraction on the load-proportional line at light load and runs larger
    batches below saturation, but at saturation on mixes it loses to eager (the staggered
    branch keeps deferring on GPUs it shares; see docs/performance.md, "The policy grid").
``frontrun``
    Symphony Algorithm 1 as written (section 3.1):
    ``exec = max(now + delay(bs), gpu_free_at, d - l(bs + 1))``, the last moment at which one more
    request could still have joined the batch, whatever the batch size and rate (for ablations).
``latest``
    ``exec = d - l(bs)``: the latest moment that still meets the earliest deadline.
``eager``
    Work-conserving: ``exec = max(now + delay(bs), gpu_free_at)`` (Clockwork/Shepherd default),
    with the window drop's target batch size.
``eager-edf``
    The paper's Clockwork baseline: eager, under the ``alone`` drop (no target batch size: only
    what cannot finish even alone is dropped, and the batch is the largest feasible prefix), and a
    freed GPU goes to the waiting candidate whose latest start is earliest (the rank's order for
    every policy; Clockwork's "earliest latest executable moment", earliest-deadline-first on
    start deadlines across models). An explicit ``drop`` other than ``window`` overrides.
``timeout:F``
    TF-Serving/Triton style: ``exec = max(earliest, a + F * SLO)`` with ``a`` the earliest
    arrival in the batch, F a fraction of the SLO (``timeout:0.3``).

Every ``exec`` is clamped into ``[earliest, latest]`` so no batch starts after its latest moment.

Drop policies decide *which* requests leave the queue unserved (DESIGN section 3):

``window`` (default)
    Sliding window with a rate-driven target batch size: drop the head of the queue while keeping
    it would force a batch smaller than the target (relaxed by ``keep_tolerance``), then grow the
    batch past the target while the earliest deadline still holds ("free lunch"). The batch the
    head must finish in is ``min(target, queue length)``: the authors' 2021 rule. Symphony's
    public code since October 2022 (nexuslb ``batch_policy.cpp``) uses ``min(target, longest
    feasible suffix of the queue)`` instead, which keeps a head the queue behind it could not
    fill a target batch with anyway; zserve has not adopted it (not measured on the grid).
``alone``
    Drop only what cannot finish even alone; the batch is the largest feasible prefix (Clipper).
``fcfs``
    Deadline order with no early drops (only what cannot finish alone), and the batch is capped at
    the target size (no free lunch).
"""

from __future__ import annotations

import math

from zserve.profiles import LatencyProfile

__all__ = [
    "DEFER_MIN_JOINERS",
    "DEFER_MISS_EWMA",
    "DEFER_MISS_FORGET_REQUESTS",
    "DEFER_MISS_FORGET_S",
    "DEFER_MISS_MAX_S",
    "DEFER_MISS_RATE_MAX",
    "DEFER_MISS_RELAX_S",
    "DEFER_MISS_WIDEN_S",
    "DEFER_QUEUED_RATE_MAX",
    "DEFER_QUEUED_SLACK_S",
    "DEFER_STAGGER_MIN_GPUS",
    "RpsMeter",
    "largest_batch_at_rate",
    "target_batch_size",
]

DEFER_STAGGER_MIN_GPUS = 2.0
"""``deferred``: a model whose load needs at least this many GPUs (at its target batch size) is
treated as running staggered over GPUs of its own and defers at least to its target batch size;
below it the model shares GPUs and defers only while beta*lambda - 1 exceeds its batch."""

DEFER_MIN_JOINERS = math.log(2.0)
"""``deferred``: a candidate waits for its aim only while at least this many requests are
expected to join it before then (lambda * (aim - now)): ln 2 is an even chance that one does.
Below it waiting buys nothing but latency and a GPU held later (a lone request at light load
starts at once, on a GPU that is idle anyway)."""

DEFER_MISS_EWMA = 0.02
"""``deferred``, sharing GPUs: the weight of each deferred candidate's outcome (window missed: 1,
granted: 0) in the model's estimate of its chance to lose the grant window to other models."""

DEFER_MISS_RATE_MAX = 0.02
"""``deferred``, sharing GPUs: the model stops deferring while its estimated chance to miss a
grant window is above this (two misses in close succession): waiting then costs more heads than
the batching it buys (1 GPU shared by 2 models with beta/alpha 16: deferring lost 90% of eager's
goodput). One missed window stays below it."""

DEFER_MISS_FORGET_S = 5.0
DEFER_MISS_FORGET_REQUESTS = 2000
"""``deferred``: a model that stopped deferring forgets its miss and queued estimates as its
batches are granted, by the smaller of the time since the last one over DEFER_MISS_FORGET_S and
the batch's requests over DEFER_MISS_FORGET_REQUESTS: it tries again after about 3.5 s and 1,400
requests from two misses, and keeps deferring once the cluster has room. A try that fails costs
about two heads: at most 0.15% of the model's requests. Forgetting per batch instead (1/200,
1/1000 of the estimate per batch) let fast models retry every second or two, and slow ones every
few hundred requests; those misses alone cost 0.3-1.4% of requests at batches of 1, and
deferred fell to 0.82-0.93x eager on 2 GPUs shared by 2 models."""

DEFER_QUEUED_RATE_MAX = 0.2
"""``deferred``, sharing GPUs: the model stops deferring while its estimate (same weights as the
miss estimate) of the chance that a deferred candidate finds every GPU busy at its aim is above
this. Deferring then only moves its place in the queue for a GPU later: its batch grows, but it
enters the contest for the next free GPU with a window alpha + jitter wide instead of its whole
slack. Measured: on 10 A100-zoo models on 16 GPUs, 2% of deferred grants waited for a GPU
(deferring pays); on 2 GPUs shared by 2 models with beta = alpha, 55% (eager wins by 8%)."""

DEFER_QUEUED_SLACK_S = 0.0002
"""A deferred candidate granted more than this after its aim counts as having waited for a GPU
(live, a grant reaches the shard a little after the rank's timer)."""

DEFER_MISS_WIDEN_S = 0.0005
"""``deferred``, for a model that shares its GPUs: how much earlier it aims its deferred
candidates after each one that missed its grant window (the window closed with no GPU granted,
so its head request is lost or the batch shrinks). A deferred candidate is grantable only from
``d - jitter - l(bs + 1)`` to ``d - l(bs)``, about alpha + jitter wide; when other models'
batches hold every GPU through that window it misses. In the 10-model zoo subset on 16 GPUs,
DenseNet121 (alpha 0.05 ms) lost 1.5% of its requests this way at 4,900 r/s, where eager lost
0.08%. Each model learns its own margin from its own misses: a model that never misses keeps
the frontrun moment exactly, and a staggered model (a miss there is the stagger at work) learns
nothing."""

DEFER_MISS_MAX_S = 0.001
"""``deferred``: the most a model's learned margin can reach (the grant window at most doubles
with the default 1 ms jitter). Aiming earlier means smaller batches, and when a model's own
load is what fills the GPUs (DenseNet121 on the flat-top workload, ~1.8 GPUs' worth) smaller
batches cause more misses: uncapped, its margin ran to beta and the flat top's goodput fell
from 32,401 to 29,265 r/s; capped at 2 ms, 31,878; at 1 ms, unchanged. Zoo subset
deferred/eager with 5 s warm-up and 10 s windows: 0.874 without a margin, 0.950 with the 2 ms
cap, 0.966 with 1 ms, 0.958 with 0.5 ms."""

DEFER_MISS_RELAX_S = DEFER_MISS_WIDEN_S / 200
"""``deferred``: how much of the learned margin each granted batch gives back, so the margin
settles where about one deferred candidate in 200 misses its window (0.5% of batches, well
inside a 1% bad-rate budget), and shrinks again when the cluster has room."""

class RpsMeter:
    """Windowed request-rate meter: counts sealed every ``bucket_s`` (50 ms), mean over the last
    ``window`` buckets (100: 5 s), maintained in O(1) per sealed bucket."""

    __slots__ = ("_bucket_end", "_bucket_s", "_buckets", "_count", "_filled", "_pos", "_sum",
                 "window")

    def __init__(self, bucket_s: float = 0.05, window: int = 100) -> None:
        self._bucket_s = bucket_s
        self.window = window
        self._buckets = [0] * window
        self._pos = 0
        self._filled = 0
        self._sum = 0
        self._count = 0
        self._bucket_end = -math.inf

    def add(self, now: float, count: int) -> bool:
        """Count ``count`` arrivals at ``now``; True when at least one bucket was sealed."""
        sealed = False
        if now >= self._bucket_end:
            sealed = self._seal(now)
        self._count += count
        return sealed

    def _seal(self, now: float) -> bool:
        if self._bucket_end == -math.inf:
            self._bucket_end = now + self._bucket_s
            return False
        steps = 0
        while now >= self._bucket_end and steps < self.window + 1:
            old = self._buckets[self._pos]
            self._buckets[self._pos] = self._count
            self._sum += self._count - old
            self._pos = (self._pos + 1) % self.window
            self._filled = min(self._filled + 1, self.window)
            self._count = 0
            self._bucket_end += self._bucket_s
            steps += 1
        if now >= self._bucket_end:  # a long silence: everything in the window is zero
            self._buckets = [0] * self.window
            self._sum = 0
            self._filled = self.window
            self._bucket_end = now + self._bucket_s
        return True

    def rate(self) -> float | None:
        """Mean rate (requests/s) over the sealed buckets, or None before the first one."""
        if self._filled == 0:
            return None
        return self._sum / (self._filled * self._bucket_s)


def target_batch_size(
    profile: LatencyProfile, budget_s: float, rate_rps: float | None, d_data_s: float
) -> int:
    """The rate-driven target batch size (BatchSizeEstimator).

    With n = r*l(b)/b GPUs busy, the staggered rule ``l(b)*(1 + 1/n) <= budget - d_data*b`` reads
    ``l(b) + b/r + d_data*b <= budget``, which is also the single-GPU (n < 1) Nexus rule, and is
    monotone in b: binary search. Before any rate sample: the largest b with l(b) <= budget/2.
    Never below 1.
    """
    if rate_rps is None or rate_rps <= 0:
        return max(1, profile.largest_batch_within(budget_s / 2))
    return max(1, largest_batch_at_rate(profile, budget_s, rate_rps, d_data_s))


def largest_batch_at_rate(
    profile: LatencyProfile, budget_s: float, rate_rps: float, d_data_s: float
) -> int:
    """The largest b with ``l(b) + b/rate + d_data*b <= budget`` (the time to gather b requests
    at ``rate_rps`` plus running them fits the budget), or 0 if not even b = 1 does. The left
    side grows with b, so this is a binary search. ``rate_rps`` must be positive."""
    table = profile.table_s
    inv_rate = 1.0 / rate_rps
    lo, hi = 0, profile.max_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if table[mid] + mid * (inv_rate + d_data_s) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo
