"""The papers' baseline systems as pure cores, for the simulator to host beside Symphony's
scheduler: Nexus (``nexus_plan``: squishy bin packing and the epoch controller;
``nexus_gpu``: a GPU's round-robin executor with the sliding-window early drop, and the
frontends' deficit round robin) and Shepherd's Flex (``flex``). Clockwork is ``eager-edf``, a
policy of the scheduler itself (``zserve.scheduler.policy``)."""
