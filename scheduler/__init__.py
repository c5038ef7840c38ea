"""Scheduling logic (pure) and the shard/rank processes that host it.

Pure scheduling objects (no I/O, no clock; hosted alike by the simulator and the processes):

- ``zserve.scheduler.model_thread.ModelThread``: one model's queue and batch candidate.
- ``zserve.scheduler.rank_thread.RankThread``: GPU free times and model-GPU matchmaking.
- ``zserve.scheduler.common``: timer slack and the per-model cut of request metadata (the
  hosting contract, ``now``, outbox, ``wake_at``/``on_timer``, is ``zserve.hosting``).
- ``zserve.scheduler.policy``: what each batch policy does, the rate meter, the target batch size
  (policy names: ``zserve.policies``; latency profiles: ``zserve.profiles``).
- ``zserve.scheduler.bounds``: analytic staggered/uncoordinated bounds.

Hosts: the shard/rank processes, ``zserve.scheduler.bench`` (``zserve bench-scheduler``), and the
discrete-event simulator ``zserve.loadgen.sim`` (``zserve sim``), which sits above every role
because it hosts the pure cores of all of them.
"""
