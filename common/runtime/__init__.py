"""Processes: the worker base (loop, heartbeats, drain), the local launcher, offline run-batch."""
