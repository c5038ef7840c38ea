"""Scheduling logic (pure), shard/rank processes and the discrete-event simulator."""
