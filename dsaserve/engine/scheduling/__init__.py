"""Scheduling: which sequences run each step, their KV blocks, and the SchedulerOutput handed to the workers."""
