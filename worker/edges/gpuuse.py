"""The GPU use of a worker's running attempts: sampled every few seconds (the service's
gpu_sample_s) through worker.edges.nvml, kept until the next heartbeat carries them (the
jobs' system metrics), a bounded few per GPU (a heartbeat that cannot get through
must not let them pile up)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from ddpq.messages import AttemptKey
from worker.edges import nvml

# Samples kept per GPU of an attempt until a heartbeat takes them: with a heartbeat every
# 2 s and a sample every 5 s it holds one; more only while a heartbeat hangs (one that
# fails loses what it carried: a gap in the job's system metrics, nothing more).
KEEP_PER_GPU = 12


class GpuUseLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[AttemptKey, deque[tuple[float, nvml.GpuUse]]] = {}

    def sample(self, attempts: list[tuple[int, int, list[int]]]) -> None:
        """Sample the GPUs of each (job, attempt, GPUs) now; forget the attempts that
        are no longer listed."""
        taken = [(job, attempt, gpus, nvml.sample(gpus)) for job, attempt, gpus in attempts if gpus]
        now = time.monotonic()
        with self._lock:
            live = {AttemptKey(job, attempt) for job, attempt, _ in attempts}
            for key in [k for k in self._kept if k not in live]:
                del self._kept[key]
            for job, attempt, gpus, uses in taken:
                kept = self._kept.setdefault(
                    AttemptKey(job, attempt), deque(maxlen=KEEP_PER_GPU * len(gpus))
                )
                kept.extend((now, use) for use in uses)

    def take(self) -> dict[AttemptKey, list[dict[str, Any]]]:
        """What was sampled since the last take, as a heartbeat carries it (each with how
        long ago it was taken: the service dates it by its own clock)."""
        now = time.monotonic()
        with self._lock:
            kept, self._kept = self._kept, {}
        return {
            key: [
                {
                    "gpu": use.index,
                    "ago_s": round(min(3600.0, max(0.0, now - at)), 3),
                    "utilization": min(100.0, max(0.0, use.utilization)),
                    "memory_used": use.memory_used,
                    "memory_total": use.memory_total,
                }
                for at, use in samples
            ]
            for key, samples in kept.items()
            if samples
        }
