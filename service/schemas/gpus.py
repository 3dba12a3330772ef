"""GPUs as NVML names them and their use: what a worker registers (its devices), what its
heartbeats carry (samples of its running jobs' GPUs), and the views of both (a job's
system metrics, a worker's GPUs with their holders). Absent, not empty-but-present,
where a worker has no NVML: every list defaults to none."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field

from service.schemas.common import Label, Strict

GpuIndex = Annotated[int, Field(strict=True, ge=0, le=1023)]
# Bytes of device memory: far past any GPU's (2**53: exact as a JSON number anywhere).
GpuBytes = Annotated[int, Field(strict=True, ge=0, le=2**53)]
MAX_GPUS = 1024
# Samples one heartbeat may carry for one attempt: a worker that could not reach the
# API for a while sends what it kept (worker.gpuuse keeps a few per GPU).
MAX_SAMPLES_PER_ATTEMPT = 8192


class GpuDevice(Strict):
    """One GPU of a worker, as NVML names it."""

    index: GpuIndex
    uuid: Annotated[str, Field(min_length=1, max_length=96, pattern=r"^[A-Za-z0-9_.:-]+$")]
    name: Annotated[Label, Field(min_length=1, max_length=200)]
    memory_total: GpuBytes


class GpuSampleIn(Strict):
    """One GPU's use at one moment, as NVML reported it to the worker."""

    gpu: GpuIndex
    # How long before the heartbeat it was taken: the service dates it by its own clock,
    # so a worker's skewed clock cannot put a sample in the future.
    ago_s: Annotated[float, Field(strict=True, ge=0, le=3600, allow_inf_nan=False)] = 0.0
    utilization: Annotated[float, Field(strict=True, ge=0, le=100, allow_inf_nan=False)]
    memory_used: GpuBytes
    memory_total: GpuBytes


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
