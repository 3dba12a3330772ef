"""The views of workers. The worker protocol itself, its requests (register, claim, gang,
heartbeat, finish, leave) and its replies, is ddpq.messages', defined once for the service and
the worker (service.schemas re-exports the requests for the routes)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from ddpq.messages import ClusterShape
from service.models import JobStatus
from service.schemas.gpus import WorkerGpu


class WorkerJob(BaseModel):
    job_id: int
    name: str | None
    status: JobStatus
    attempt: int
    nproc_per_node: int
    gpus: list[int]
    owner: str | None = None  # who submitted it (None: from before users existed)


class WorkerPublic(BaseModel):
    name: str
    hostname: str
    cpu_slots: int
    gpus: list[int]
    free_cpu_slots: int
    free_gpus: list[int]
    alive: bool  # heart-beaten within the lease, and not left
    last_heartbeat: datetime
    registered_at: datetime
    # When it left (POST /workers/leave, as it stopped): it claims nothing until it registers
    # again; its attempts still in ``running`` are stopping. None while it takes jobs.
    left_at: datetime | None = None
    running: list[WorkerJob]
    # A Slurm bridge: the partition it hands jobs to.
    cluster: ClusterShape | None = None
    # Its GPUs as NVML names them, each with its holder and use (none without NVML).
    gpu_devices: list[WorkerGpu] = []


class WorkersPublic(BaseModel):
    items: list[WorkerPublic]
