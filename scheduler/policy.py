"""What the scheduler does under each batch policy, the rate meter, and the rate-driven target
batch size. The policy names and their parse (``SchedulePolicy``) are the runtime kit's
(``zserve.config.policy_names``), which configuration validates with.

Schedule policies decide *when* a candidate becomes schedulable (its ``exec`` time); every policy
runs through the same ModelThread/RankThread code paths:

``deferred`` (default)
    Symphony's frontrun moment wherever waiting can pay, and never a GPU left idle for it while
    the cluster is short of GPUs. With lambda the model's metered rate, b* its rate-driven
    target batch size and n = lambda*l(b*)/b* the GPUs its load needs, a candidate of ``bs``
    requests aims at ``d - jitter - l(bs + 1)``, the last moment one more request could join:

    - a model with the load of several GPUs (n >= DEFER_STAGGER_MIN_GPUS and beta*lambda >= 1;
      a model no other shares its GPUs with from n >= DEFER_STAGGER_ALONE_MIN_GPUS) runs
      staggered over GPUs of its own (DESIGN section 3) and defers while
      ``bs < max(beta*lambda, b*)``, starting at once from there;
    - a model that shares its GPUs starts at once while the cluster is lightly loaded (its
      models' load run at once would keep under DEFER_LIGHT_LOAD of the GPUs busy: the GPU time
      a wait saves is not needed), and when fewer than DEFER_MIN_JOINERS arrivals are expected
      before its aim (lambda * (aim - now) over the rows one arrival brings: rows that come
      together, a fan-out's, join together or not at all): waiting would buy nothing but latency
      (light load: a lone request runs in l(1) plus the allowances, on a GPU that is idle
      anyway). Before its rate meter's first sample (50 ms after its first arrival) there is
      no rate to count joiners with, and the model's own arrivals are the only evidence
      (DEFER_COLD_MIN_REQUESTS): its first request, while no second has come, waits for one no
      later than that sample, the time within which the evidence arrives; from its second
      request on it defers as frontrun does, to the last moment one more request could join (a
      cold burst batches there: starting every cold request at once, Symphony's section 3.3
      example, 3 GPUs, l(b) = b + 5 ms, a request every 0.75 ms, dropped 37 of 200 requests
      where frontrun drops none). Deferring the lone first request too left it 1 ms before its
      last moment, where a loaded host's stall made it a DEADLINE (the demo's first run,
      perf_analyzer's first request). A staggered model keeps
      its aim: a batch started below its stagger costs the stagger (InceptionResNetV2 x8 under
      Gamma(0.3) bursts: 736 against frontrun's 753 r/s when the joiner rule applied to it too);
    - a candidate that starts at once for want of joiners carries the aim it did not wait for,
      and the rank holds it back towards that aim while its batch would take the last free GPU
      from a tighter model: one sharing the GPUs whose lone request can wait less (its budget
      less l(1) and delay(1)) than the candidate's own remaining wait, and less than the batch
      would keep every GPU busy (until it ends or another GPU frees). It waits until its aim,
      until it has no more wait left than the tighter model, or until another GPU frees,
      whichever comes first, and is looked at again there; never while the rank's contention
      is above RESCUE_CONTENTION (``RankThread._hold_back_to``). Eager's start takes the GPU a
      tight model's request needs a moment later; frontrun's delays keep it free. On 7 A100
      models on 2 GPUs (the random family's r04), where Xception can wait 3.8 ms and every other
      model's batch of 1 runs longer, it took the default from 28.6 to 54 r/s (frontrun 36);
    - a model that shares its GPUs with others defers, and its candidate is ``early_ok`` from
      RESCUE_SHARED_FLOOR x (beta*lambda - 1) requests on (at light load, from one): the rank may
      start it before its aim (the *rescue*, ``RankThread``). While more than RESCUE_CONTENTION of
      the shared models' candidates that reach their exec time find every GPU busy, a GPU that frees
      (or is idle) goes to the most urgent of the candidates waiting for a GPU and the early_ok
      ones, by latest start: the work-conserving order of eager, with batches that grew up to the
      grant. A waiting candidate is passed over only for an early_ok one whose batch runs at least
      as long: a longer batch passed over is the one that finds every GPU busy when its window
      closes (the zoo's NASNetLarge). Below that contention the GPU waits for the next aim. A
      staggered model's candidate is early_ok only from ``beta*lambda - 1`` requests on: on a
      contended cluster its GPUs are not its own, and from there starting now costs less GPU time
      per request than waiting (the second paper's throughput argument); below it, as for
      InceptionResNetV2 on the 3-model mix on 4 GPUs, a rescue would run a batch of 1 for 23 ms. A
      staggered model's candidate that finds its GPUs busy is not contention: it does so at about
      40% of its aims by design (counted, Figure 6a's ten staggered models at beta 5 ms were rescued
      into smaller batches and lost 13%). One model alone with at most one GPU's worth of load is
      rescued too: its own batches are the contention (one GPU, beta/alpha 0.25: deferral left
      the GPU idle at 0.868 of eager, rescued 1.000). An early_ok candidate is published to the
      rank at once (publish-ahead holds back only the others), since the rescue can only choose
      among candidates it has seen;
    - a model whose arrivals are its own answers' echoes starts at once (``AnswerEchoes``):
      closed-loop clients (a sync loop, perf_analyzer) send their next request one round trip
      after their answer, so nothing can join a batch held back while they wait, and the rate
      meter's rate promises joiners they never send. The echo share compares the rows that
      arrive right after a batch's answer (anchored at the batch's end as its backend reports
      it, the profile's finish until the report comes, and at a per-GPU learned echo delay)
      with what a stream independent of the answers brings in the same span (the rows just
      before, or the rate times the span, whichever is more; a span that may hold another
      batch's echoes is not judged, nor a batch the rate fills while it runs); from
      ECHO_SHARE_MIN of the answered rows on the model does not defer, until the share falls
      below ECHO_SHARE_KEEP, and a report that turns it replans the waiting candidate. It
      needs no deferred window: a sync client is seen at its second request (before, its 2nd
      and 3rd waited to their aim, about 180 ms on the demo cluster, until the yield below had
      learned), and a Poisson stream's share is about 0 at
      any rate (Table 2 and the demo workload's open-loop runs are unchanged). The yield
      (DEFER_YIELD_MIN) stays: it covers what the echoes miss (answers later than
      ECHO_WINDOW_S, a model whose backends do not report and run far off its profile);
    - a model that shares its GPUs keeps an estimate of how often its deferred candidates lose
      their grant window (``defer_loss``: an EWMA, DEFER_LOSS_WEIGHT per deferred candidate,
      granted or lost) and starts at once while it is above DEFER_LOSS_MAX; each batch granted
      meanwhile decays it by DEFER_LOSS_DECAY / ``defer_backoff``, so the model tries deferring
      again after about 700 batches, and twice as late after each retry that soon loses again
      (DEFER_LOSS_RECENT, DEFER_BACKOFF_MAX). This is the decision's cost side: waiting buys the
      joiners expected before the aim, and costs the head whenever the window is lost. Only a
      batch that found a GPU free decays it: one started at once whose grant came later than it
      asked for one (``GRANT_WAITED_S``: every GPU was busy) says nothing about whether a
      deferred window would now be kept, and near saturation on shared GPUs each retry costs
      heads while the queue builds the batches anyway (the random family's r15, 2 GTX 1080 Ti
      models on 2 GPUs at 1,000 r/s, the GPUs 0.995 busy: MobileNet read 0.43% bad against
      eager's 0.27%, 0.27% with this rule, and the member's ratio went from 0.977 to 0.992).
      While the cluster has room (DEFER_ROOM_ALL_BUSY: its load run at once would find every
      GPU busy under 10% of the time, about u^G), a deferred window is rarely lost and the GPU
      time a wait saves is what a tight model finds free: the bars move to
      DEFER_ROOM_MIN_JOINERS and DEFER_ROOM_LOSS_MAX (one lost window no longer stops it);

    Below the contention bar a second rank trigger covers a loss that is certain: with a GPU
    idle, the rank projects the waiting candidates onto the GPUs in order of their exec times
    (each holds a GPU for its expected duration, ``CandidateUpdate.duration``); if one would
    find no GPU by its latest start, the next to start goes now.

    Why: deferring on shared GPUs has two costs, and the rescue and the loss estimate remove
    them. A deferred candidate enters the contest for a GPU only at its aim, with a window
    ``jitter + l(bs + 1) - l(bs)`` wide; with several models aiming into the same few
    milliseconds, a window closes with every GPU busy and the head is lost (frontrun drops
    1.9% of requests on the 10-model zoo subset at 5,300 r/s with the GPUs 0.91 busy); on one
    GPU shared by two models the other model's batch holds the GPU through the whole window
    (the eager-floor cell with beta/alpha 16 and SLO 4 l(1): 30 r/s against eager's 243
    without the loss estimate, 228 with it). And a GPU kept idle for an aim is capacity the
    cluster lacks a moment later. Measured by ``zserve experiment policy-grid``
    (docs/performance.md, "The policy grid").
``deferred-bl``
    The second Symphony paper's rule (section 4.3), the default before ``deferred`` above. A
    candidate waits for its frontrun moment ``d - l(bs + 1)`` only while

    - ``bs < max(beta*lambda, b*)`` for a staggered model (as above);
    - ``bs < beta*lambda - 1`` otherwise: the model shares GPUs with others, and waits only while
      at least one more whole request is expected within beta. Such a model also learns a
      margin from its own missed windows (DEFER_MISS_WIDEN_S per miss, up to DEFER_MISS_MAX_S,
      each granted batch gives DEFER_MISS_RELAX_S back).

    It keeps deferral at or above 0.95x eager on the eager-floor grid, but on shared GPUs it
    mostly turns deferral off (``beta*lambda - 1`` is below 1 for most A100-zoo models at their
    rates), so at light load the GPUs are busier than the load needs, and on the 10-model zoo
    subset it trails eager by 3%.
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
    The papers' Clockwork baseline: eager, under the ``alone`` drop (no target batch size: only
    what cannot finish even alone is dropped, and the batch is the largest feasible prefix), and a
    freed GPU goes to the waiting candidate whose head has the earliest deadline, across models
    (earliest deadline first, work-conserving; ``RankThread`` with ``deadline_order``). An
    explicit ``drop`` other than ``window`` overrides.
``eager-lsf``
    ``eager-edf`` with the rank's order of every other policy: a freed GPU goes to the waiting
    candidate whose latest start (deadline less its batch's run time) is earliest, least slack
    first (Clockwork's "earliest latest executable moment"). It favours long batches, which the
    deadline order makes wait behind short ones.
``timeout:F``
    TF-Serving/Triton style: ``exec = max(earliest, a + F * SLO)`` with ``a`` the earliest
    arrival in the batch, F a fraction of the SLO (``timeout:0.3``).

Every ``exec`` is clamped into ``[earliest, latest]`` so no batch starts after its latest moment.

Drop policies decide *which* requests leave the queue unserved (DESIGN section 3):

``window`` (default)
    Sliding window with a rate-driven target batch size: drop the head of the queue while keeping
    it would force a batch smaller than the target (relaxed by ``keep_tolerance``), then grow the
    batch past the target while the earliest deadline still holds ("free lunch"). The batch the
    head must finish in is ``min(target, queue length)``: the authors' 2021 rule.
``suffix``
    ``window`` with the rule of Symphony's public code since October 2022 (nexuslb
    ``batch_policy.cpp``): the head must finish in a batch of ``min(target, longest feasible
    suffix of the queue)``, the most requests at the queue's tail that could still run as one
    batch in time. It keeps a head that the queue behind it could not fill a target batch with
    anyway (a head that fits a batch of 14 while only 14 can still go stays at target 15, where
    ``window`` with no tolerance drops it). Requests of several rows fall back to ``window``.
    Measured against ``window`` on the policy grid (docs/performance.md, "The policy grid").
``alone``
    Drop only what cannot finish even alone; the batch is the largest feasible prefix (Clipper).
``fcfs``
    Deadline order with no early drops (only what cannot finish alone), and the batch is capped at
    the target size (no free lunch).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque

from zserve.config.profiles import LatencyProfile

__all__ = [
    "DEFER_BACKOFF_MAX",
    "DEFER_COLD_MIN_REQUESTS",
    "DEFER_LIGHT_LOAD",
    "DEFER_LOSS_DECAY",
    "DEFER_LOSS_MAX",
    "DEFER_LOSS_RECENT",
    "DEFER_LOSS_WEIGHT",
    "DEFER_MIN_JOINERS",
    "DEFER_MISS_MAX_S",
    "DEFER_MISS_RELAX_S",
    "DEFER_MISS_WIDEN_S",
    "DEFER_ROOM_ALL_BUSY",
    "DEFER_ROOM_LOSS_MAX",
    "DEFER_ROOM_MIN_JOINERS",
    "DEFER_STAGGER_ALONE_MIN_GPUS",
    "DEFER_STAGGER_MIN_GPUS",
    "DEFER_YIELD_BACKOFF_MAX",
    "DEFER_YIELD_DECAY",
    "DEFER_YIELD_KEPT_RESET",
    "DEFER_YIELD_MIN",
    "DEFER_YIELD_MIN_EXPECTED",
    "DEFER_YIELD_RETRY_BATCHES",
    "ECHO_ANCHOR",
    "ECHO_DECAY",
    "ECHO_DELAY_WEIGHT",
    "ECHO_ENDS_KEPT",
    "ECHO_FASTEST",
    "ECHO_SHARE_KEEP",
    "ECHO_SHARE_MIN",
    "ECHO_STALL_SHARE",
    "ECHO_WINDOW_S",
    "RESCUE_CONTENTION",
    "RESCUE_CONTENTION_EWMA",
    "RESCUE_SHARED_FLOOR",
    "RESCUE_SPACING_S_PER_CANDIDATE",
    "AnswerEchoes",
    "DeferralYield",
    "RpsMeter",
    "largest_batch_at_rate",
    "target_batch_size",
]

DEFER_STAGGER_MIN_GPUS = 2.0
"""``deferred`` and ``deferred-bl``: a model whose load needs at least this many GPUs (at its
target batch size) is treated as running staggered over GPUs of its own and defers at least to
its target batch size; below it the model shares GPUs (``deferred``: defers, rescued by the
rank; ``deferred-bl``: defers only while beta*lambda - 1 exceeds its batch)."""

DEFER_STAGGER_ALONE_MIN_GPUS = 1.0
"""``deferred`` and ``deferred-bl``: DEFER_STAGGER_MIN_GPUS for a model that has its GPUs to
itself (no other model is served on any of them). Above one GPU's worth of load its batches run
side by side on several GPUs, and the only batches its windows can meet are its own: spacing
them is the stagger, not contention. Counted as shared, its own candidates found its GPUs busy,
the rescue started them early and kept itself on: ResNet50 alone on 2 GPUs with d_ctrl 0.5 ms
(about 1.7 GPUs' worth at 1,050 r/s) ran batches of 6 with the GPUs 0.99 busy and read 1.2-2.2%
bad at 1,040 r/s over two seeds, as eager does, against frontrun's 1.0-1.6% with batches of 9
at 0.84 busy; staggered, it reads as frontrun. At or below one GPU's worth a lone model's batches
run one after another and the rescue keeps the GPU busy (one GPU, beta/alpha 0.25). The trade:
where batching gains little (the eager floor's one model on 2 GPUs, beta/alpha 1, SLO 4 and 8
l(1)) the stagger reads 0.967 and 0.950 of eager, against 1.000 and 0.983 counted as shared."""

RESCUE_SHARED_FLOOR = 0.5
"""``deferred``: a shared model's deferring candidate is ``early_ok`` (the rank may rescue it)
from this fraction of ``beta*lambda - 1`` requests on; a staggered model's from the whole of it.
Below it a rescued batch costs more GPU time per request than waiting would, and at overload
the lost throughput is everyone's: on the flat-top mix (4 zoo models, 24 GPUs) at 31,904 r/s,
rescue at any size left the worst model 7.2% bad (DenseNet121's batch fell from 54 to 30),
against 1.25% for frontrun; the whole of beta*lambda - 1 gave 1.43% but left the 10-model Zipf
mix 3.4% bad at 11,670 r/s (eager passes there); half of it gave 1.76% and 0.96%."""

DEFER_MIN_JOINERS = math.log(2.0)
"""``deferred``: a shared model's candidate waits for its aim only while at least this many
requests are expected to join it before then (lambda * (aim - now)): ln 2 is an even chance
that one does. Below it waiting buys nothing but latency and a GPU held later (a lone request at
light load starts at once, on a GPU that is idle anyway)."""

DEFER_LIGHT_LOAD = 0.3
"""``deferred``: while every model's load started at once (each arrival run alone: its rate over the
rows an arrival brings, times l of those rows) would keep less than this fraction of the GPUs busy,
a shared model with a metered rate starts at once (``CandidateSizing.light``, set by a
``SchedulerCore`` that schedules every model its GPUs serve: ``shards = 0``). A wait buys GPU time,
and at that load the GPUs have it to spare: batches of one queue behind each other for about a fifth
of a run on average (M/D/1 at 0.3), while a deferred batch waits tens of ms. On a three-stage app at
20 r/s on 2 GPUs (0.12 of them at once) the stages deferred into the app's SLO, which the answers
then met at 60-75 ms p50 with no room for a host stall (docs/apps.md, "Result"). The estimate reads
rates, not the batches the decision makes, so it does not flip with them."""

DEFER_ROOM_ALL_BUSY = 0.1
"""``deferred``: the cluster has *room* while ``u ** G`` is below this, u the share of its G
GPUs that its models' load run at once keeps busy (as DEFER_LIGHT_LOAD reads it): about how
often a deferred candidate's grant window would find every GPU busy. With room, a lost window
is a rare event rather than a sign that waiting loses heads, and the GPU time a wait saves is
what a tight model sharing the GPUs finds free when it needs it (a lone request's few ms), so
shared models defer from DEFER_ROOM_MIN_JOINERS expected joiners on and stop only at
DEFER_ROOM_LOSS_MAX. On the random family's r11 (13 A100 models on 5 GPUs, u 0.48, u^5 0.025 at
318 r/s; MobileNet can wait 2.6 ms) the slack-rich models started batches of 1 for want of
joiners, or, deferring, lost one window early and started at once for ~700 batches: the
GPUs ran 0.45 busy against frontrun's 0.32 and MobileNet lost 1.5% against 0.5%. One GPU has
room only under u 0.1, where the light-load rule starts every model at once anyway: there a
deferred window is lost whenever another model's batch runs through it."""

DEFER_ROOM_MIN_JOINERS = 0.3
"""``deferred``: the joiner bar (DEFER_MIN_JOINERS) while the cluster has room
(DEFER_ROOM_ALL_BUSY): a wait pays from about one joiner in four expected."""

DEFER_ROOM_LOSS_MAX = 0.05
"""``deferred``: the window-loss bar (DEFER_LOSS_MAX) while the cluster has room
(DEFER_ROOM_ALL_BUSY): three windows lost close together (each within about a dozen kept ones
of the last two) stop the model's deferral, one or two do not (DEFER_LOSS_WEIGHT 0.02). On r11
over four arrival seeds MobileNet read 0.56-1.05% at 335 r/s (frontrun 1.03-1.24%) and
0.62-1.39% at 352 (frontrun 1.06-1.61%); at 3%, 0.66-1.90% and 0.62-1.94%."""


DEFER_COLD_MIN_REQUESTS = 2
"""``deferred``: before its rate meter's first sample (no rate: the joiner rule cannot count) a
model defers to its frontrun aim only once it has seen this many requests; until then its
candidate waits no later than that first sample. Deferral is worth its latency only when
requests arrive during the wait, and without a rate the model's own arrivals are the only
evidence that they will: a lone first request promises nothing, so it waits for a second one
only as long as the evidence takes to come (the meter's first bucket, 50 ms), not to 1 ms before
its last moment, where one host stall made it a DEADLINE (the demo cluster, SLO 200 ms: answered
at 175-180 ms before, 53-70 ms now). A second request, or a first chunk of several, is a stream,
and the stream defers as frontrun does until the first sample brings the joiner rule a rate
(Symphony's section 3.3 cold burst: its first batch is still the first four requests).

Starting the lone request at once would answer it sooner, but it moved the section 3.3 example's
first batch (a stream's first request has no company yet when it arrives) and every later one.
Capping every cold candidate's wait at the first sample, not only a lone request's, was tried
and reverted: it moved the cold candidates whose aim lay past 50 ms (37 in the seven probes of
the quick eager-floor cell with 1 GPU, 2 models, SLO 20 ms, all of them requests of a stream),
and that cell's search, whose probes sit on the 1% bar (0.83% against 1.25% bad at the same
rate), read 231.2 r/s instead of 262.5; over seeds 1-8 the cap changed that search only at seed
1, and unchanged code reads 243.8 there at seeds 4 and 5. The lone rule changes no decision of
a stream: the quick cells' searches are identical over those eight seeds, and Table 2 and the
eager-floor grid read as before."""

DEFER_MISS_WIDEN_S = 0.0005
"""``deferred-bl``, for a model that shares its GPUs: how much earlier it aims its deferred
candidates after each one that missed its grant window (the window closed with no GPU granted,
so its head request is lost or the batch shrinks). A deferred candidate is grantable only from
``d - jitter - l(bs + 1)`` to ``d - l(bs)``, about alpha + jitter wide; when other models'
batches hold every GPU through that window it misses. In the 10-model zoo subset on 16 GPUs,
DenseNet121 (alpha 0.05 ms) lost 1.5% of its requests this way at 4,900 r/s, where eager lost
0.08%. Each model learns its own margin from its own misses: a model that never misses keeps
the frontrun moment exactly, and a staggered model (a miss there is the stagger at work) learns
nothing."""

DEFER_MISS_MAX_S = 0.001
"""``deferred-bl``: the most a model's learned margin can reach (the grant window at most doubles
with the default 1 ms jitter). Aiming earlier means smaller batches, and when a model's own
load is what fills the GPUs (DenseNet121 on the flat-top workload, ~1.8 GPUs' worth) smaller
batches cause more misses: uncapped, its margin ran to beta and the flat top's goodput fell
from 32,401 to 29,265 r/s; capped at 2 ms, 31,878; at 1 ms, unchanged. Zoo subset
deferred/eager with 5 s warm-up and 10 s windows: 0.874 without a margin, 0.950 with the 2 ms
cap, 0.966 with 1 ms, 0.958 with 0.5 ms."""

DEFER_MISS_RELAX_S = DEFER_MISS_WIDEN_S / 200
"""``deferred-bl``: how much of the learned margin each granted batch gives back, so the margin
settles where about one deferred candidate in 200 misses its window (0.5% of batches, well
inside a 1% bad-rate budget), and shrinks again when the cluster has room."""

DEFER_LOSS_WEIGHT = 0.02
"""``deferred``: the weight of each deferred candidate of a model that shares its GPUs in the
model's estimate of how often such a candidate loses its grant window (``defer_loss``): a lost
window adds it towards 1, a granted one takes it towards 0."""

DEFER_LOSS_MAX = 0.01
"""``deferred``: a model that shares its GPUs starts its candidates at once while its
``defer_loss`` is above this. One lost window (DEFER_LOSS_WEIGHT) is enough: a lost window
costs a head, and with the small batches of shared models at moderate rates that is a large
share of a 1% bad-rate budget. On the eager-floor cell with one GPU, two models, beta/alpha 16
and SLO 4 l(1), deferred candidates lost 3.6% of their windows (1.2% of requests at 60 r/s)."""

DEFER_LOSS_RECENT = 0.25
"""``deferred``: a lost window while ``defer_loss`` is still above this fraction of
DEFER_LOSS_MAX comes soon after the previous one (within about 70 kept windows of it), and
doubles the model's ``defer_backoff``; kept windows that bring the estimate under it reset the
backoff to 1."""

DEFER_BACKOFF_MAX = 64
"""``deferred``: the most ``defer_backoff`` reaches: a model whose deferred windows keep being
lost tries deferring again after at most 64 x 693 batches."""

DEFER_LOSS_DECAY = 0.001
"""``deferred``: how much of ``defer_loss`` each batch a model starts at once (not deferred)
takes away, divided by the model's ``defer_backoff``: a model that stopped deferring after one
lost window tries again after ln(DEFER_LOSS_MAX / DEFER_LOSS_WEIGHT) / ln(1 - DEFER_LOSS_DECAY)
= 693 batches, and after twice, four times ... as many while its retries keep losing windows
soon (exponential backoff, DEFER_LOSS_RECENT). A short fixed period lets a model that should
not defer keep losing heads: retrying every 139 batches (0.005) left one GPU shared by two
models (beta/alpha 16, SLO 4 l(1)) at 0.4-1.0% bad from 60 to 230 r/s, and a goodput search
there at 116 r/s against eager's 243."""

RESCUE_CONTENTION = 0.1
"""``deferred``: the rank starts deferring (early_ok) candidates early, on a GPU that frees or is
idle, while more than this fraction of the shared models' candidates reaching their exec time
find every GPU busy (an EWMA over those moments, RESCUE_CONTENTION_EWMA each). A GPU that frees
with no candidate waiting for it counts as one that found its GPU free; otherwise the rescue,
once on, keeps itself on: its smaller batches keep the GPUs busy (at 0.8x of the 10-model zoo
subset's goodput the GPUs were 1.00 busy instead of 0.80; 0.05 keeps it on there). A staggered
model's candidates do not count: they find their GPUs busy at about 40% of their aims by design;
below saturation on shared GPUs the fraction is near 0 and deferral is left alone, so GPU use
stays proportional to load."""

RESCUE_CONTENTION_EWMA = 0.02
"""The weight of each candidate reaching its exec time in the rank's contention estimate
(about the last 50 such moments: tens of milliseconds on a busy cluster)."""

RESCUE_SPACING_S_PER_CANDIDATE = 2.5e-6
"""``deferred``: after the rank evaluates its rescue, it evaluates it again no sooner than this
times the candidates it holds later (events in between wait for that moment). The at-risk
projection sorts every waiting candidate and GPU, 0.25-0.5 us per candidate on this VM, and
ran at every candidate update: with 128 models on 128 GPUs at 20,000 r/s it took 1.8 of every 3
seconds, and one core no longer kept up at a third of the cluster's capacity. Five to ten
times the cost bounds the rescue to a fifth to a tenth of the rank's core at any rate, and
delays a decision by at most 5 us for 2 models, 0.32 ms for 128 (twice the spacing changed
nothing measurable at 128 models: the rest of the cost is per request)."""


DEFER_YIELD_MIN = 0.25
"""``deferred``: a model defers only while the rows that joined its deferred candidates after they
could have started are at least this fraction of what its metered rate promised for those waits
(``DeferralYield``). Under open-loop (Poisson) load the two agree (the yield is about 1); under
closed-loop clients, who send a request only once their last one is answered, nothing can join a
batch the scheduler holds back, and the yield is about 0: the whole wait is latency and GPU time
lost (the demo's CNN, SLO 200 ms: a sync client waited 191 ms a request against eager's 5)."""

DEFER_YIELD_DECAY = 0.05
"""The weight each deferred candidate's rows carry in a model's yield (decayed sums of joined and
expected rows over about its last 20 deferred candidates)."""

DEFER_YIELD_MIN_EXPECTED = 3.0
"""Expected rows the yield must have seen before it may stop deferral: below that, a Poisson
stream's joiners are too few to judge (three expected rows bring none 5% of the time)."""

DEFER_YIELD_RETRY_BATCHES = 200
"""``deferred``: a model that stopped deferring for want of joiners defers again after this many
batches started at once, times its backoff; a retry that finds no joiners either doubles the
backoff, up to DEFER_YIELD_BACKOFF_MAX (a retry costs one batch held to its aim)."""

DEFER_YIELD_BACKOFF_MAX = 128

DEFER_YIELD_KEPT_RESET = 50
"""Deferred candidates in a row that keep the yield up reset the backoff to 1."""


class DeferralYield:
    """Whether deferral pays for one model, measured rather than assumed (``deferred``): what its
    deferred candidates gained by waiting (rows that arrived after the moment the candidate could
    have started, and joined it) against what the metered rate promised for the wait. Deferral
    stops while the gain falls short (DEFER_YIELD_MIN) and is retried with exponential backoff,
    as the window-loss estimate does for shared GPUs. Pure; O(1) per batch."""

    __slots__ = ("_kept", "backoff", "expected", "joined", "paused_for")

    def __init__(self) -> None:
        self.joined = 0.0  # decayed sums of rows (DEFER_YIELD_DECAY)
        self.expected = 0.0
        self.paused_for = 0  # batches still to start at once before deferring again
        self.backoff = 1
        self._kept = 0

    @property
    def pays(self) -> bool:
        return self.paused_for == 0

    def note_deferred(self, joined_rows: float, expected_rows: float) -> None:
        """A candidate that deferred was granted: ``joined_rows`` arrived after it could have
        started, ``expected_rows`` were promised for its wait (rate x wait)."""
        keep = 1.0 - DEFER_YIELD_DECAY
        self.joined = keep * self.joined + joined_rows
        self.expected = keep * self.expected + expected_rows
        if (self.expected >= DEFER_YIELD_MIN_EXPECTED
                and self.joined < DEFER_YIELD_MIN * self.expected):
            self.paused_for = DEFER_YIELD_RETRY_BATCHES * self.backoff
            self.backoff = min(2 * self.backoff, DEFER_YIELD_BACKOFF_MAX)
            self.joined = self.expected = 0.0  # the retry judges afresh
            self._kept = 0
            return
        self._kept += 1
        if self._kept >= DEFER_YIELD_KEPT_RESET:
            self.backoff = 1

    def note_at_once(self) -> None:
        """A batch started without deferring."""
        if self.paused_for:
            self.paused_for -= 1

ECHO_WINDOW_S = 0.05
"""``deferred``: how long after a batch's expected finish (``AnswerEchoes``) its answers' echoes
are looked for at most: a closed-loop client's next request reaches the scheduler one round trip
after its answer (0.5-2 ms on the demo host, more when a stalled host answers late). The window
ends sooner, at as many rows as the batch answered, so its length adapts to the rate."""

ECHO_SHARE_MIN = 0.6
"""``deferred``: a model starts its batches at once while at least this share of its answered
rows came back as echoes (``AnswerEchoes.closed_loop``): its arrivals are its own answers'
consequences, and waiting for them only delays them. A Poisson stream's share is about 0."""

ECHO_STREAM_SHARE = 0.1
ECHO_STREAM_JUDGED = 4
"""``deferred``: a window does not turn a model's verdict to closed-loop while the other window
has judged at least ECHO_STREAM_JUDGED batches and reads a share below ECHO_STREAM_SHARE (a
stream: a Poisson stream reads about 0, closed loops' windows 0.2 and up even where their
batches tangle). Two judged finish windows of a Poisson stream read 0.68 by chance (the policy
grid's mix3 x4 at 208 r/s: InceptionResNetV2, whose other finish windows were all drowned,
while its learned window read 0.03 over 14) and held the verdict for good: batches of 1, the
GPUs 0.49 busy against a load-proportional 0.23."""

ECHO_SHARE_KEEP = 0.25
"""``deferred``: once its arrivals were found to be echoes, a model keeps starting at once until
its echo share falls below this (hysteresis): every verdict that flips back costs the closed
loop's clients one wait to the aim."""

ECHO_DECAY = 0.05
"""The weight each looked-at batch carries in a model's echo share (decayed sums over about its
last 20 such batches)."""

ECHO_ANCHOR = 0.75
"""Where a looked-at batch's window starts (``AnswerEchoes``): this fraction of the model's echo
delay past the batch's exec time. The echo delay is learned: the time from a looked-at batch's
exec time to the first arrival after it (ECHO_DELAY_WEIGHT), the profile's l(b) before the first.
A closed loop's echoes come at the delay itself, a quarter of it into the window, however much
faster or slower than its profile the backend runs (a profile measured on a loaded host is
slow); a stream that does not depend on the answers is as likely to arrive anywhere."""

ECHO_FASTEST = 0.5
"""The earliest a learned window starts, as a fraction of the batch's l(b) by its profile: no
answer comes before its batch has run, and a backend is not taken to run more than twice as
fast as its profile. Without it a stream whose arrivals lock in phase with at-once batches (one
every 2 ms, each batch planned as its request came, l(1) 6 ms) passed for a closed loop: its next
arrival always came 2 ms after an exec time."""

ECHO_DELAY_WEIGHT = 0.25
"""The weight of each looked-at batch's echo delay in the model's estimate (an EWMA)."""

ECHO_ENDS_KEPT = 32
"""How many of a model's latest reported batch ends ``AnswerEchoes`` keeps to tell whether a
finish window is tangled (``AnswerEchoes._tangled``)."""

ECHO_STALL_ROWS = 8.0
"""``deferred``: a deferring candidate whose model has no batch in flight and whose arrivals
stopped for as long as its metered rate brings this many rows in is taken for a closed loop
stalled on the wait (``AnswerEchoes.note_stall``): every client waits in the queue, so nothing
more can come. Only where echoes were seen (ECHO_STALL_SHARE): a Poisson
stream leaves such a gap after a given arrival or batch end with probability exp(-8) = 0.03%,
and a stream's share stays about 0."""

ECHO_STALL_SHARE = 0.1
"""``deferred``: a stall counts (``AnswerEchoes.note_stall``) where either window's share is at
ECHO_SHARE_KEEP, or at this share while neither window reads a stream (ECHO_STREAM_SHARE over
ECHO_STREAM_JUDGED batches, the veto's bar): a stream's windows read about 0, closed loops'
0.15 and up. At ECHO_SHARE_KEEP alone, 2 clients on two GPUs 4x faster than their profile (a
profile measured on a loaded host) read 0.15-0.2 once their windows tangled and lost the
verdict; the yield's retry gathered both clients into one deferred candidate with nothing in
flight, which waited to its aim (183 ms): 0.94 of eager."""

_ECHO_TRIM_MIN = 64  # arrivals kept before the old ones are cut away


class _EchoWindow:
    """One way of anchoring ``AnswerEchoes``' windows, and the echo share it measured: at the
    batch's finish (``learned`` False: its real end once its backend reported it, by its profile
    until then), or ECHO_ANCHOR of the learned echo delay past its exec time (``learned``
    True)."""

    __slots__ = ("_delay_s", "_gpu", "_timing", "anchor", "answered", "echo", "finished",
                 "judged", "kept", "learned", "rows", "start_at")

    def __init__(self, learned: bool) -> None:
        self.learned = learned
        self.anchor = math.inf  # where the looked-at batch's window starts (inf: none)
        self.start_at = -math.inf  # and the batch's exec time
        self.finished = False  # the anchor is the batch's reported end (not its profile's)
        self.rows = 0
        self._timing = math.inf  # the exec time, until the first arrival after it
        self._gpu = 0  # the looked-at batch's GPU
        self._delay_s: dict[int, float] = {}  # the echo delay's estimate, by GPU
        self.echo = 0.0  # decayed sums (ECHO_DECAY): rows after less rows expected
        self.answered = 0.0  # and the looked-at batches' rows
        self.judged = 0  # the looked-at batches judged so far
        self.kept = False  # its own share made the verdict (ECHO_SHARE_KEEP keeps it)

    def look_at(self, exec_at: float, run_s: float, rows: int, gpu_id: int) -> None:
        if self.anchor == math.inf:
            delay = run_s
            if self.learned:  # no sooner than the fastest a batch is taken to run
                known = self._delay_s.get(gpu_id)
                delay = ECHO_FASTEST * run_s  # none learned yet: as early as a batch may end
                if known is not None and ECHO_ANCHOR * known > delay:
                    delay = ECHO_ANCHOR * known
            self._gpu = gpu_id
            self.start_at = self._timing = exec_at
            self.anchor = exec_at + delay
            self.rows = rows
            self.finished = False

    def looks_at(self, exec_at: float, gpu_id: int) -> bool:
        """Whether the looked-at batch is the one planned at ``exec_at`` on GPU ``gpu_id``."""
        return self.anchor != math.inf and self.start_at == exec_at and self._gpu == gpu_id

    def time_delay(self, now: float) -> None:
        """An arrival at ``now``: the first after the looked-at batch's exec time times the
        echo delay."""
        if now >= self._timing:
            delay = now - self._timing
            known = self._delay_s.get(self._gpu)
            self._delay_s[self._gpu] = (
                delay if known is None else known + ECHO_DELAY_WEIGHT * (delay - known))
            self._timing = math.inf

    def fold(self, echo: float) -> None:
        """The looked-at window is over: its ``echo`` goes into the sums."""
        keep = 1.0 - ECHO_DECAY
        self.echo = keep * self.echo + echo
        self.answered = keep * self.answered + self.rows
        self.anchor = math.inf
        self.judged += 1

    def stalled(self, rows: int) -> None:
        """A deferring candidate of ``rows`` rows waited with no arrival for ECHO_STALL_ROWS of
        the rate (``AnswerEchoes.note_stall``): a window whose rows all echoed."""
        keep = 1.0 - ECHO_DECAY
        self.echo = keep * self.echo + rows
        self.answered = keep * self.answered + rows
        self.judged += 1
        self.kept = True


class AnswerEchoes:
    """Whether a model's arrivals come right after its answers (closed-loop clients), from the
    timing alone, without a single deferred window (``deferred``).

    For a batch of k rows executed at x, a window starts at an anchor a: the batch's end, as its
    backend reports it (``note_finish``: ``BatchStats.finished_at``, which the backend sends the
    shard that planned the batch; the simulator replays it at the simulated end), its expected
    finish x + l(k) by its profile while no report has come (a model whose backends never
    reported, ``bench-scheduler``, or a report ECHO_WINDOW_S late), and, in a second window,
    x + ECHO_ANCHOR times the learned echo delay of the batch's GPU (the time from a looked-at
    batch's exec time to the first arrival after it; backends differ: on a loaded host a sync
    client's answers alternated between 6 and 16 ms, one backend each; ECHO_FASTEST of l(k) at
    the earliest). It counts the rows
    that arrive from a on, until k have come or ECHO_WINDOW_S has passed (a span tau), against
    what a stream that does not depend on the answers brings in tau: the rows that arrived in
    the span tau before a (clipped at x, since the batch's own rows came before it, and scaled
    back up to tau), or the metered rate times tau, whichever is more (before the
    meter's first sample, the rate of the arrivals kept here). A Poisson (open-loop) stream
    brings as many in expectation at any rate (a is fixed before the rows come, and tau is a
    stopping time: the count after it is the rate times its mean length, and so is the count
    before); closed-loop clients are waiting during the span before (their requests are in the
    batch) and send one round trip after their answer. Each window's echo share is the decayed
    sum of (after - expected), each capped at k, over the decayed sum of k; from ECHO_SHARE_MIN
    on the model's arrivals are its answers' echoes and it does not defer (``closed_loop``),
    until the share falls below ECHO_SHARE_KEEP. Either window's verdict is enough: the
    reported end is exact however fast the backend runs (many clients, whose echoes overlap
    other batches' runs, confuse the learned delay, and an anchor off the real end puts the
    other GPU's echoes into the span before it: a backend twice as slow as its profile read a
    sync loop as a stream), the learned delay covers a model whose ends are not reported. A
    finish window whose span before the end may hold another batch's echoes is not judged
    (``_tangled``), nor one whose batch the metered rate fills while it runs (``_drowned``).
    Taking the larger of the two expectations keeps a gap in a stream just
    before an anchor from passing for an echo (Symphony section 3.3's three missing requests: a
    stream at 1,333 r/s, none in the 2.25 ms before a finish and four after). One batch is
    looked at a time per window (the next one planned once its last window closed, or judged
    when a batch is planned after it is over): O(log n + ECHO_ENDS_KEPT) per arrival chunk and
    per decision. Pure."""

    __slots__ = ("_busy_until", "_closed", "_cum", "_ends", "_judged_at", "_reported", "_times",
                 "_windows")

    def __init__(self) -> None:
        self._times: list[float] = []  # arrival times of recent chunks, in order
        self._cum: list[int] = [0]  # _cum[i]: the rows of the chunks before _times[i]
        self._windows = (_EchoWindow(learned=False), _EchoWindow(learned=True))
        self._reported = False  # the model's backends report when their batches end
        self._ends: deque[float] = deque(maxlen=ECHO_ENDS_KEPT)  # the latest reported ends
        self._closed = False  # the last verdict (ECHO_SHARE_KEEP keeps it)
        self._judged_at = (0, 0)  # each window's judged count when the verdict turned closed
        self._busy_until = -math.inf  # the latest end of a planned batch (profile or report)

    def note_finish(self, now: float, exec_at: float, finished_at: float, gpu_id: int,
                    rate: float) -> None:
        """The batch planned at ``exec_at`` on GPU ``gpu_id`` ended at ``finished_at``, as its
        backend reported at ``now`` (``BatchStats``): the finish window's anchor moves there from
        the profile's guess, and the window is judged as far as the arrivals kept here have
        come (the report may come after the answer's echoes)."""
        self._reported = True
        self._ends.append(finished_at)
        self._busy_until = max(self._busy_until, finished_at)
        window = self._windows[0]
        if window.looks_at(exec_at, gpu_id) and not window.finished:
            window.anchor = finished_at
            window.finished = True
            if now >= finished_at:
                self._span(window, now, rate, close=True)

    def _open(self, window: _EchoWindow, now: float) -> bool:
        """Whether ``window``'s span has begun at ``now``: past its anchor, and, for the finish
        window of a model whose backends report their ends, once that report came (or the
        profile's guess is ECHO_WINDOW_S behind: none will)."""
        anchor = window.anchor
        if now < anchor:
            return False
        return (window.learned or window.finished or not self._reported
                or now >= anchor + ECHO_WINDOW_S)

    @property
    def echo(self) -> float:
        """The profile-anchored window's decayed echoed rows."""
        return self._windows[0].echo

    @property
    def answered(self) -> float:
        """The profile-anchored window's decayed answered rows."""
        return self._windows[0].answered

    def note_answer(self, exec_at: float, run_s: float, rows: int, rate: float,
                    gpu_id: int = 0) -> None:
        """A batch of ``rows`` rows was planned at ``exec_at`` on GPU ``gpu_id``, to run
        ``run_s`` by its profile: looked at by each window not looking at one already, or whose
        looked-at window is over (no arrival closed it: a deferred batch's)."""
        self._busy_until = max(self._busy_until, exec_at + run_s)
        for window in self._windows:
            over = window.anchor + ECHO_WINDOW_S
            if over <= exec_at:
                self._span(window, over, rate, close=True)
            window.look_at(exec_at, run_s, rows, gpu_id)

    def note_arrivals(self, now: float, rows: int, rate: float) -> None:
        """``rows`` rows arrived at ``now`` (not before the last call's ``now``); ``rate``: the
        model's metered rate in rows/s (inf: none yet)."""
        times = self._times
        times.append(now)
        self._cum.append(self._cum[-1] + rows)
        for window in self._windows:
            window.time_delay(now)
            if self._open(window, now):
                self._span(window, now, rate, close=True)
        # what a window can still need: from ECHO_WINDOW_S before an anchor at most that far back
        if len(times) >= _ECHO_TRIM_MIN and times[0] < now - 2 * ECHO_WINDOW_S:
            cut = bisect_left(times, now - 2 * ECHO_WINDOW_S)
            if 2 * cut >= len(times):  # cut a long prefix at once: amortized O(1)
                base = self._cum[cut]
                del times[:cut]
                self._cum = [total - base for total in self._cum[cut:]]

    def stall_at(self, rate: float) -> float:
        """When a deferring candidate is taken for a stalled closed loop if nothing arrives
        before (``note_stall``): ECHO_STALL_ROWS of the metered ``rate`` past the last arrival
        and the end of the model's last planned batch (its answers' echoes may still come);
        inf without a rate, or while the windows' shares show no echoes (``_echoed``: a stall
        would be no evidence, ``note_stall``)."""
        if not self._times or rate == math.inf or rate <= 0.0 or not self._echoed():
            return math.inf
        quiet_from = self._times[-1]
        quiet_from = self._busy_until if self._busy_until > quiet_from else quiet_from
        return quiet_from + ECHO_STALL_ROWS / rate

    def _echoed(self) -> bool:
        """Whether either window's share is at ECHO_SHARE_KEEP, or at ECHO_STALL_SHARE while
        neither window reads a stream (the veto's bar, ECHO_STREAM_SHARE over at least
        ECHO_STREAM_JUDGED batches) (``note_stall``)."""
        windows = self._windows
        if any(w.answered > 0.0 and w.echo >= ECHO_SHARE_KEEP * w.answered for w in windows):
            return True
        if any(w.judged >= ECHO_STREAM_JUDGED and w.echo < ECHO_STREAM_SHARE * w.answered
               for w in windows):
            return False
        return any(w.answered > 0.0 and w.echo >= ECHO_STALL_SHARE * w.answered
                   for w in windows)

    def note_stall(self, rows: int) -> bool:
        """A deferring candidate of ``rows`` rows saw its model's arrivals stop (``stall_at``
        passed): closed-loop clients all waiting in the queue, as their answers wait for the
        batch. When the windows' shares show echoes (``_echoed``), the stall counts as a
        window whose rows all echoed and the verdict is closed-loop again (True); with no
        such share it is no evidence (a stream's lull, or a load the windows never saw echo).
        On two GPUs, 4-16 clients answer in batches whose finish windows are mostly tangled or
        drowned; a share of 0.25-0.55, below ECHO_SHARE_MIN, was lost at one window's dip, and
        the loop paid up to its aim (180 ms) or the rank's rescue each round after."""
        if not self._echoed():
            return False
        for window in self._windows:
            window.stalled(rows)
        if not self._closed:
            self._judged_at = (self._windows[0].judged, self._windows[1].judged)
        self._closed = True
        return True

    def closed_loop(self, now: float, rate: float) -> bool:
        """Whether either window's echo share is at or above the bar at ``now``, its looked-at
        batch's window as far as it has come counted in (its rows in full: one early echo of a
        large batch does not decide). The bar is ECHO_SHARE_MIN; while the last verdict was
        closed-loop it is ECHO_SHARE_KEEP for the window whose share made it and for a window
        that has judged a batch since it was made: on two GPUs 16 clients' finish windows read
        0.5-0.56 and the learned ones 0.2-0.3, and a bar kept per window lost the verdict at the
        learned window's first dip. Sums that no judged window moved since the verdict do not
        keep it (under overload every finish window is drowned, and a share left from the cold
        start held a verdict the learned window made once)."""
        closed = False
        streams = [w.judged >= ECHO_STREAM_JUDGED and w.echo < ECHO_STREAM_SHARE * w.answered
                   for w in self._windows]
        for window, judged_at, other_streams in zip(self._windows, self._judged_at,
                                                    reversed(streams), strict=True):
            # the keep bar for a window whose own share made the verdict, or that has judged
            # a window since it was made (sums no window moved since are another load's)
            keeps = self._closed and (window.kept or window.judged > judged_at)
            bar = ECHO_SHARE_KEEP if keeps else ECHO_SHARE_MIN
            echo, answered = window.echo, window.answered
            if self._open(window, now):
                span_echo = self._span(window, now, rate, close=False)
                if span_echo is not None:
                    echo += span_echo
                    answered += window.rows
            window.kept = (answered > 0.0 and echo >= bar * answered
                           and (keeps or not other_streams))
            closed = window.kept or closed
        if closed and not self._closed:
            self._judged_at = (self._windows[0].judged, self._windows[1].judged)
        self._closed = closed
        return closed

    def _tangled(self, window: _EchoWindow, start: float, span_s: float) -> bool:
        """Whether the finish window's span before its reported end (from ``start``) may hold
        the echoes of another batch: one reported to end less than ``span_s`` before ``start``,
        or within it. Such a window is not judged, and the verdict stays as it was.
        Closed-loop clients on several GPUs (perf_analyzer from concurrency 2 on) answer in
        batches that interleave: the other GPU's echoes arrive while this batch runs, the span
        before counts them as a stream's, and at 4-16 clients on two GPUs, with answers spread
        over 2-4 ms, the share fell below ECHO_SHARE_KEEP and batches waited to their aim (on
        the pure core, 46-87 of 3,000-5,000 requests, 180 ms each). A lone client's windows, a
        cold burst's and a deferred batch's are not tangled, so the verdict is made there; an
        open stream's untangled windows keep its share about 0."""
        if not window.finished:
            return False
        anchor, since = window.anchor, start - span_s
        return any(since < end < anchor for end in self._ends)

    @staticmethod
    def _drowned(window: _EchoWindow, rate: float) -> bool:
        """Whether the finish window's batch is so small against the metered ``rate`` that a
        stream at that rate brings its rows while it runs (rate x run >= rows): its echoes,
        a round trip past its end, cannot stand out from the rate's expectation and read as
        none. Such a window is not judged, as a tangled one is not: closed-loop clients on two
        GPUs (7 on the pure core, round trips of 4-8 ms, 1-2 rows a batch) had a few untangled
        windows judged so, their share fell below ECHO_SHARE_KEEP, and every client waited to
        its aim (65 of 2,900 requests). It depends only on what is known before the anchor, so
        a stream's judged windows keep its share about 0."""
        return (window.finished and rate != math.inf
                and rate * (window.anchor - window.start_at) >= window.rows)

    def _span(self, window: _EchoWindow, now: float, rate: float, *,
              close: bool) -> float | None:
        """``window``'s looked-at echo at ``now``: the rows after its anchor less those before
        (or the metered ``rate`` times its span, when more); with ``close``, fold it into the
        window's sums once it is over (k rows came, or ECHO_WINDOW_S). None, and with ``close``
        the window dropped unjudged once over, when it is tangled (``_tangled``)."""
        anchor = window.anchor
        end = anchor + ECHO_WINDOW_S
        end = now if now < end else end
        times, cum, cap = self._times, self._cum, window.rows
        at_anchor = cum[bisect_left(times, anchor)]
        after = cum[bisect_right(times, end)] - at_anchor
        after = after if after < cap else cap
        # the span before, clipped at the exec time (the batch's own rows came before it), and
        # its rows scaled up to the full span
        start = anchor - (end - anchor)
        clipped = window.start_at if window.start_at > start else start
        over = after >= cap or now >= anchor + ECHO_WINDOW_S
        if self._tangled(window, clipped, end - anchor) or self._drowned(window, rate):
            if close and over:
                window.anchor = math.inf  # not judged: the next planned batch is looked at
            return None
        before = float(at_anchor - cum[bisect_left(times, clipped)])
        if clipped > start and before:
            before *= (end - anchor) / (anchor - clipped)
        if rate == math.inf:  # no metered rate yet: the arrivals kept here, n - 1 over their span
            span = times[-1] - times[0]
            rate = (cum[-1] - cum[1]) / span if span > 0.0 else 0.0
        expected = max(before, rate * (end - anchor))
        echo = after - (expected if expected < cap else cap)
        if close and over:
            window.fold(echo)
        return echo


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

    def first_sample_at(self) -> float:
        """When the first bucket ends (its count becomes the first sample, sealed by the next
        arrival from then on): the first arrival plus ``bucket_s``; ``-inf`` before any arrival,
        ``inf`` once a bucket was sealed."""
        return self._bucket_end if self._filled == 0 else math.inf

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
