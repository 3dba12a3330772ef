"""The worker protocol's requests (register, claim, gang, heartbeat, finish), with the
names, identities and shapes they carry (a Slurm bridge's partition), and the views of
workers. (The replies a worker reads are ddpq.messages.)"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictBool, model_validator

from service.models import JobStatus
from service.schemas.caches import MAX_CACHES, CacheCleared, CacheUsage
from service.schemas.code import Digest
from service.schemas.common import INT32_MAX, INT64_MAX, MAX_PATH_CHARS, Label, Strict
from service.schemas.gpus import (
    MAX_GPUS,
    MAX_SAMPLES_PER_ATTEMPT,
    GpuDevice,
    GpuIndex,
    GpuSampleIn,
    WorkerGpu,
)

# A host name or an IPv4/IPv6 address (no scheme, no port).
HOST = r"^[A-Za-z0-9.:_%-]+$"
WorkerName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")]


JobIdIn = Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
AttemptNumber = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]
# How long a long-poll may wait for something to happen.
WaitS = Annotated[float, Field(strict=True, ge=0, le=60, allow_inf_nan=False)]


# An id another scheduler gave an attempt (a Slurm job id, "81234" or "81234_7").
ExternalId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:+-]+$")]


class RunningAttempt(Strict):
    job_id: JobIdIn
    attempt: AttemptNumber
    # A bridge's attempt: the id its scheduler gave it (stored on the attempt at once,
    # what a restarted bridge re-adopts), and while that scheduler holds it pending,
    # why, in words (the job's reason until it starts).
    external_id: ExternalId | None = None
    pending: Annotated[str | None, Field(min_length=1, max_length=500)] = None
    # Samples of the attempt's GPUs on this worker since the last heartbeat (NVML): the
    # job's system metrics. None from a worker without NVML.
    gpu_samples: Annotated[list[GpuSampleIn], Field(max_length=MAX_SAMPLES_PER_ATTEMPT)] = []


class ClusterShape(Strict):
    """What a bridge to another scheduler hands jobs to: a Slurm partition's nodes (the
    largest node's CPUs and GPUs, as sinfo reports them). A job fits it when each of
    its nodes fits one node and it asks no more nodes than the partition has; Slurm,
    not ddpq, decides when it starts."""

    kind: Literal["slurm"] = "slurm"
    partition: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")]
    nodes: Annotated[int, Field(strict=True, ge=1, le=1_000_000)]
    cpus_per_node: Annotated[int, Field(strict=True, ge=1, le=100_000)]
    gpus_per_node: Annotated[int, Field(strict=True, ge=0, le=1024)] = 0
    # How many of its jobs the bridge lets wait in Slurm at once: the rest wait in
    # ddpq's queue, in ddpq's order.
    max_pending: Annotated[int, Field(strict=True, ge=1, le=100_000)] = 1


# worker.datadir's identity: 32 hex digits, kept in the worker's data dir.
WorkerIdentity = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class WorkerRegister(Strict):
    name: WorkerName
    # Optional for workers of earlier versions, which get no protection from a twin.
    identity: WorkerIdentity | None = None
    hostname: Annotated[Label, Field(max_length=255)]
    cpu_slots: Annotated[int, Field(strict=True, ge=0, le=100_000)]
    gpus: Annotated[list[GpuIndex], Field(max_length=MAX_GPUS)]
    # Each GPU of `gpus` as NVML names it; none from a worker without NVML (or of an
    # earlier version, or told its GPUs by --gpus on a host without NVML).
    gpu_devices: Annotated[list[GpuDevice], Field(max_length=MAX_GPUS)] = []
    checkpoint_root: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    # What this worker process still runs (empty when it has just started): any other
    # attempt the service has on its books for this name died with an earlier process.
    running: Annotated[list[RunningAttempt], Field(max_length=10_000)] = []
    # A bridge to a Slurm partition instead of a worker that runs jobs itself. A bridge
    # keeps its attempts across its restarts (they run in Slurm, not in its process):
    # the reply lists them for it to re-adopt, and `running` releases nothing.
    cluster: ClusterShape | None = None

    @model_validator(mode="after")
    def _each_gpu_once(self) -> WorkerRegister:
        indices = [d.index for d in self.gpu_devices]
        if len(set(indices)) != len(indices):
            raise ValueError("gpu_devices: each GPU index at most once")
        return self


class ClaimRequest(Strict):
    name: WorkerName
    free_cpu_slots: Annotated[int, Field(strict=True, ge=0, le=100_000)]
    free_gpus: Annotated[list[GpuIndex], Field(max_length=1024)]
    wait_s: WaitS = 20.0
    # Where the other nodes of a multi-node job reach this worker, and a port free on
    # it for torchrun's rendezvous store should it be node 0. Without both, the worker
    # is offered single-node jobs only.
    advertise_addr: Annotated[str | None, Field(min_length=1, max_length=255, pattern=HOST)] = None
    rdzv_port: Annotated[int | None, Field(strict=True, ge=1, le=65535)] = None


class GangRequest(Strict):
    name: WorkerName
    job_id: JobIdIn
    attempt: AttemptNumber
    wait_s: WaitS = 20.0
    # Give the slot back instead (a worker shutting down while the gang forms).
    leave: Annotated[bool, Field(strict=True)] = False


# What a worker did with a checkpoint (or an ended job's checkpoint directory) the API
# asked it to delete: deleted; missing (already gone); refused (not a regular file inside
# the job's checkpoint directory here, or written again since it was registered: ``why``).
PruneOutcome = Literal["deleted", "missing", "refused"]
Why = Annotated[str | None, Field(max_length=500)]


class CheckpointPruned(Strict):
    id: Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
    outcome: PruneOutcome
    why: Why = None


class CheckpointsDropped(Strict):
    job_id: JobIdIn
    outcome: PruneOutcome
    why: Why = None


class CheckpointSent(Strict):
    """What became of a checkpoint a reply asked this worker to send (HeartbeatReply.send):
    the code snapshot that holds it, or why it was not sent."""

    id: Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
    snapshot: Digest | None = None
    why: Why = None


class Heartbeat(Strict):
    name: WorkerName
    identity: WorkerIdentity | None = None
    running: Annotated[list[RunningAttempt], Field(max_length=10_000)] = []
    # Jobs whose working directories the worker keeps: the reply says which have ended.
    kept: Annotated[list[JobIdIn], Field(max_length=10_000)] = []
    # What became of the checkpoints (HeartbeatReply.prune) and the ended jobs' checkpoint
    # directories (HeartbeatReply.drop) earlier replies asked this worker to delete.
    pruned: Annotated[list[CheckpointPruned], Field(max_length=10_000)] = []
    dropped: Annotated[list[CheckpointsDropped], Field(max_length=10_000)] = []
    sent: Annotated[list[CheckpointSent], Field(max_length=10_000)] = []
    # Its users' caches (worker.caches), all of them, sent only when they changed since
    # the last heartbeat answered (None: unchanged); what it did with the clear orders
    # earlier replies carried (HeartbeatReply.clear).
    caches: Annotated[list[CacheUsage], Field(max_length=MAX_CACHES)] | None = None
    cleared: Annotated[list[CacheCleared], Field(max_length=MAX_CACHES)] = []


class FinishRequest(Strict):
    attempt: AttemptNumber
    exit_code: Annotated[int | None, Field(strict=True, ge=-255, le=INT32_MAX)] = None
    # exited: the program ended by itself; cancelled: the worker stopped it on request;
    # timeout: it ran past timeout_s; requeue: the worker is shutting down; lost: the
    # scheduler a bridge hands jobs to ended it (node failure, preemption, a cancel from
    # outside ddpq): as when a worker is lost, it is retried at once while attempts remain.
    outcome: Literal["exited", "cancelled", "timeout", "requeue", "error", "lost"] = "exited"
    reason: Annotated[str | None, Field(max_length=4000)] = None
    # A rank SIGKILL ended: whether the kernel's log says its OOM killer did (the worker
    # looked); absent when it could not look (the reason then asks "out of memory?").
    oom: StrictBool | None = None


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
    alive: bool  # heart-beaten within the lease
    last_heartbeat: datetime
    registered_at: datetime
    running: list[WorkerJob]
    # A Slurm bridge: the partition it hands jobs to.
    cluster: ClusterShape | None = None
    # Its GPUs as NVML names them, each with its holder and use (none without NVML).
    gpu_devices: list[WorkerGpu] = []


class WorkersPublic(BaseModel):
    items: list[WorkerPublic]
