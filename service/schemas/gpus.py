"""GPUs as NVML names them and their use, as people read them: a job's system metrics, a
worker's GPUs with their holders. (What a worker registers and its heartbeats carry,
its devices and samples, is the worker protocol's: ddpq.messages.) Absent, not
empty-but-present, where a worker has no NVML: every list defaults to none."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class GpuUse(BaseModel):
    """One sample of a GPU: when, its utilisation (%), its memory in use (bytes)."""

    time: datetime
    utilization: float
    memory_used: int
    memory_total: int


class JobGpu(BaseModel):
    """One GPU a job held, its latest sample and its history (oldest first)."""

    worker: str
    gpu: int
    # As its worker registered it (absent if the worker registered none since).
    uuid: str | None = None
    name: str | None = None
    attempt: int  # of the latest sample
    latest: GpuUse
    samples: list[GpuUse]


class JobGpusPublic(BaseModel):
    """GET /jobs/{id}/gpus: the job's system metrics, one item per GPU (none without NVML)."""

    items: list[JobGpu]


class WorkerGpu(BaseModel):
    """One GPU of a worker: what it is, who holds it, and its use while a job does."""

    index: int
    uuid: str
    name: str
    memory_total: int
    job_id: int | None = None  # the job holding it
    owner: str | None = None  # that job's owner
    use: GpuUse | None = None  # its latest sample while that job runs
