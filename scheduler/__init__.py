"""Scheduling logic (pure) and the shard/rank processes that host it.

Pure scheduling objects (no I/O, no clock; hosted alike by the simulator and the processes):

- ``zserve.scheduler.core.SchedulerCore``: a shard's ModelThreads (and the RankThread when it is
  embedded) behind one core: the metadata split, refusals, the dispatch loop between them, one
  ``wake_at``. Every host below hosts this core.
- ``zserve.scheduler.model_thread.ModelThread``: one model's queue and batch candidate.
- ``zserve.scheduler.rank_thread.RankThread``: GPU free times and model-GPU matchmaking.
- ``zserve.scheduler.shard_acks.ShardPlanAcks`` (over ``sent_plans.SentPlans``): the plans a
  shard sent, their acknowledgements, and what becomes of a lost backend's plans.
- ``zserve.scheduler.common``: timer slack and the per-model cut of request metadata (the
  hosting contract, ``now``, outbox, ``wake_at``/``on_timer``, is ``zserve.core.hosting``).
- ``zserve.scheduler.policy``: what each batch policy does, the rate meter, the target batch size
  (policy names: ``zserve.config.policy_names``; latency profiles: ``zserve.config.profiles``).
- ``zserve.scheduler.bounds``: analytic staggered/uncoordinated bounds.

Hosts: the shard/rank processes, ``zserve.scheduler.bench.throughput`` (``zserve
bench-scheduler``), and the discrete-event simulator ``zserve.loadgen.sim.simulator`` (``zserve
sim``), which sits above every role because it hosts the pure cores of all of them.
"""
