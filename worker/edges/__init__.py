"""The worker's one way to each thing outside its code: the API (its HTTP client),
NVIDIA's NVML (the GPUs, their use sampled for heartbeats), the kernel's processes (found
and killed by launch id or uid) and its OOM killer's records.

The ground room: it imports no other room of the worker.
"""
