"""The worker protocol, both ways, defined once for both sides.

The replies (the first half): the service answers with these models (they are the
OpenAPI schema's shapes); the worker parses the answers into them and never handles the
protocol as raw dicts. The requests (the second half, from ``Strict``: register, claim,
gang, heartbeat, finish, leave, and what they carry): the service's routes validate bodies with
them (service.schemas re-exports them), and the worker's client (worker.edges.api) validates
what it sends with the same models before it sends it, so the two cannot drift: a field
added to the heartbeat is one edit here. ``Strict`` is every request body's base, the
API's other routes' too.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    model_validator,
)

from ddpq.jobspec import ClaimedSpec
from ddpq.rules import unsafe_char


class ForkSource(BaseModel):
    """Another job's checkpoint, as a code snapshot (service.forks): the worker writes it
    as ``<checkpoint_dir>/<dirname>/<name>`` (a file, or a framework's directory) and its
    ranks resume from that path until they saved one of their own."""

    job_id: int
    step: int
    snapshot: str
    name: str
    kind: Literal["file", "dir"] = "file"

    @property
    def dirname(self) -> str:
        return f"fork-of-job-{self.job_id}-step-{self.step}"


class ClaimedJob(BaseModel):
    """POST /workers/claim: one attempt of a job (or one node slot of it) to run."""

    job_id: int
    attempt: int
    token: str
    # The job's spec as stored, keys and all (ddpq.jobspec: the worker reads it typed).
    spec: ClaimedSpec
    device: Literal["cpu", "cuda"]
    nproc_per_node: int
    gpus: list[int]
    checkpoint_dir: str
    # Newest first; the worker gives ranks the first one whose file exists.
    resume_from: list[str]
    # A node slot of a multi-node job: wait for the gang (POST /workers/gang) first.
    nnodes: int = 1
    node_rank: int = 0
    # Who submitted it: whose cache on the worker its ranks use (worker.files.caches). None
    # from an API of an earlier version, or for a job from before users: no cache kept.
    owner: str | None = None
    # The values of the secrets the spec names (spec.secrets), its owner's as they are
    # at this claim (service.secrets.for_claim): for the ranks' environment alone
    # (worker.starting.torchrun.environment), never logged, written to a file or shown; left out of
    # the model's repr. Empty when it names none.
    secrets: dict[str, str] = Field(default_factory=dict, repr=False)
    # Why they could not be given (one deleted since the submit, or stored under a key
    # this API does not have): the worker ends the attempt as an error with these words
    # before it starts anything, so the job fails naming the secret.
    secrets_problem: str | None = None
    # The checkpoint a fork starts from (spec.from_checkpoint), sent to the API by the
    # worker that held it: written into ``checkpoint_dir`` here, and offered to the ranks
    # after the job's own (resume_from). None for any other job.
    fork_from: ForkSource | None = None


class GangReply(BaseModel):
    """POST /workers/gang: where a held node slot of a multi-node attempt stands."""

    # forming: not every node slot is held yet; ready: start torchrun with this
    # rendezvous; released: the slot is gone (gang timeout, cancel): stand down.
    state: Literal["forming", "ready", "released"]
    held: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_host: bool | None = None
    join_timeout_s: float | None = None
    checkpoint_dir: str | None = None
    resume_from: list[str] = []
    workers: list[str] = []
    reason: str | None = None


class AttemptKey(NamedTuple):
    """One attempt of one job, as the worker keys what it keeps per attempt: a tuple
    still (equal to, hashed and unpacked as ``(job_id, attempt)``), its parts named."""

    job_id: int
    attempt: int


class AttemptRef(BaseModel):
    job_id: int
    attempt: int


class HandBack(AttemptRef):
    """An attempt to hand back to the queue (preempted): why, in words for its log."""

    reason: str


class PruneOrder(BaseModel):
    """A registered checkpoint this worker holds that its job no longer keeps (keep_last):
    delete the file, if it is still a regular file inside the job's checkpoint directory
    here and, when rank 0 reported them, of the size and mtime it was registered with;
    a ``dir`` the same way, as a directory whose stamp (ddpq.wire.tree_stamp) they are."""

    id: int
    job_id: int
    path: str
    bytes: int | None = None
    mtime_ns: int | None = None
    kind: Literal["file", "dir"] = "file"  # an API before migration 0030 sends files only


class SendOrder(PruneOrder):
    """A registered checkpoint this worker holds that a fork (or a download) wants: send
    it to the API as a code snapshot, if it is still what was registered (read as a
    deletion reads it: from the job's checkpoint directory, no link followed); reported
    on a later heartbeat (Heartbeat.sent)."""


class CacheClearOrder(BaseModel):
    """A user's cache this worker is to clear (``ddpq cache clear``): now, or when the
    attempt that holds it ends; reported done on a later heartbeat (Heartbeat.cleared)."""

    id: int
    user: str


class HeartbeatReply(BaseModel):
    """POST /workers/heartbeat: attempts the worker must stop, cancelled by a user or
    no longer theirs to run, or hand back (preempted by a job that outranks them)."""

    cancel: list[AttemptRef]
    abandon: list[AttemptRef]
    preempt: list[HandBack] = []
    # Of the jobs whose working directories the worker keeps (Heartbeat.kept), those
    # whose directories may be removed: gone, or ended and past their retention
    # (service.outputs.due).
    ended: list[int] = []
    # Checkpoints to delete (asked again until a heartbeat reports them: Heartbeat.pruned),
    # and ended jobs whose checkpoint retention ran out: remove their checkpoint
    # directories here (Heartbeat.dropped).
    prune: list[PruneOrder] = []
    drop: list[int] = []
    # Checkpoints to send (asked again until a heartbeat reports them: Heartbeat.sent).
    send: list[SendOrder] = []
    # Users' caches to clear (asked again until a heartbeat reports them: Heartbeat.cleared).
    clear: list[CacheClearOrder] = []
    # When to heartbeat next, the lease now, and how long a claim long-poll may be held
    # (service.pace: they grow with the fleet); a service of an earlier version sends
    # none: the registration's stand.
    heartbeat_s: float | None = None
    lease_s: float | None = None
    claim_wait_s: float | None = None


class HeldAttempt(BaseModel):
    """An attempt the books give a bridge, which a restarted bridge re-adopts: the
    Slurm job id it was given, if the bridge recorded one before it stopped."""

    job_id: int
    attempt: int
    external_id: str | None = None
    timeout_s: float | None = None  # the job's, which the bridge enforces


class WorkerRegistered(BaseModel):
    """POST /workers/register: the heartbeat interval and lease the service keeps."""

    name: str
    heartbeat_s: float
    lease_s: float
    # How long a claim long-poll may be held (HeartbeatReply.claim_wait_s); a service of
    # an earlier version sends none: CLAIM_WAIT_S.
    claim_wait_s: float | None = None
    # How often to sample the GPUs of running jobs (sent with the heartbeats); a service
    # of an earlier version sends none: the default.
    gpu_sample_s: float = 5.0
    # A bridge's attempts that have not ended (empty for a worker).
    held: list[HeldAttempt] = []


class WorkerLeft(BaseModel):
    """POST /workers/leave: from ``left_at`` on no job is claimed for this worker (its open
    claim long-poll answers 204 at once) until it registers again; its attempts'
    heartbeats and finish reports go on as before."""

    name: str
    left_at: datetime


class CodeSnapshot(BaseModel):
    """GET /workers/code/snapshots/{id}: a job's code as a manifest (ddpq.snapshot), each
    entry checked again by the worker before it writes anything."""

    id: str
    files: int
    bytes: int
    manifest: list[dict[str, Any]]


# ---- the requests ---------------------------------------------------------------------

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_PATH_CHARS = 4096


def _shows_as_text(v: str) -> str:
    bad = unsafe_char(v)
    if bad is not None:
        raise ValueError(
            f"must not contain control or format characters (found {bad!r} at index"
            f" {v.index(bad)}): they act on the terminals that show it"
        )
    return v


# A label people read in tables and terminals: any length-bounded text without
# characters that act on a terminal (ddpq.rules.unsafe_char).
Label = Annotated[str, AfterValidator(_shows_as_text)]


_NUL_OR_SURROGATE = re.compile("[\x00\ud800-\udfff]")


def _no_nul_or_surrogate(value: Any, where: str = "") -> None:
    """Refuse NUL (Postgres text cannot hold it; C code truncates at it) and lone
    surrogates (not encodable as UTF-8: a database write or answer would fail) in
    every string of a request body, keys included."""
    if isinstance(value, str):
        bad = _NUL_OR_SURROGATE.search(value)
        if bad:
            what = "a NUL character" if bad.group() == "\x00" else "a lone surrogate (not UTF-8)"
            raise ValueError(f"{where or 'a string'} contains {what}")
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_nul_or_surrogate(k, f"a key in {where or 'the body'}")
            _no_nul_or_surrogate(v, f"{where}.{k}" if where else str(k)[:100])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_nul_or_surrogate(v, f"{where}[{i}]")


class Strict(BaseModel):
    """Every request body: unknown fields refused, no NUL or lone surrogate anywhere."""

    model_config = ConfigDict(extra="forbid")
    # True where every string field is already held to printable characters or a
    # literal, which refuses NUL and surrogates too: the metric ingest path skips the
    # walk (and it would otherwise run once per nested item).
    _strings_checked: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _clean_strings(cls, data: Any) -> Any:
        if not cls._strings_checked:
            _no_nul_or_surrogate(data)
        return data


# A sha256, as code snapshots and their contents are named.
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="sha256, lower-case hex")]


GpuIndex = Annotated[int, Field(strict=True, ge=0, le=1023)]
# Bytes of device memory: far past any GPU's (2**53: exact as a JSON number anywhere).
GpuBytes = Annotated[int, Field(strict=True, ge=0, le=2**53)]
MAX_GPUS = 1024
# Samples one heartbeat may carry for one attempt: a worker that could not reach the
# API for a while sends what it kept (worker.edges.gpuuse keeps a few per GPU).
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


# A user's name as service.users.NAME has it: the worker's directory of their cache.
CacheUser = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
# The caches one heartbeat reports (worker.files.caches.MAX_REPORTED: the most recently used).
MAX_CACHES = 1000
MAX_IDLE_S = 10 * 366 * 86400
Count = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]


class CacheUsage(Strict):
    """One user's cache on the reporting worker, as its last attempt left it."""

    user: CacheUser
    bytes: Count
    files: Count
    # How long before the heartbeat it was last used (an attempt gave it back): the
    # service dates it by its own clock, as it does GPU samples.
    idle_s: Annotated[float, Field(strict=True, ge=0, le=MAX_IDLE_S, allow_inf_nan=False)]


class CacheCleared(Strict):
    """What a worker did with a clear order (HeartbeatReply.clear): cleared, or missing
    (it held no cache of that user)."""

    id: Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
    outcome: Literal["cleared", "missing"]


# A host name or an IPv4/IPv6 address (no scheme, no port).
HOST = r"^[A-Za-z0-9.:_%-]+$"
WorkerName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")]


JobIdIn = Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
AttemptNumber = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]
# How long a long-poll may wait for something to happen.
WaitS = Annotated[float, Field(strict=True, ge=0, le=60, allow_inf_nan=False)]
# How long a worker holds its claim long-poll open until the service says otherwise
# (WorkerRegistered.claim_wait_s: a larger fleet's polls are held longer, service.pace).
CLAIM_WAIT_S = 5.0


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


# worker.files.datadir's identity: 32 hex digits, kept in the worker's data dir.
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
    # Its users' caches (worker.files.caches), all of them, sent only when they changed since
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


class FinishBody(FinishRequest):
    """POST /workers/jobs/{id}/finish's body: how an attempt ended, and whose it was."""

    worker: WorkerName


class WorkerLeave(Strict):
    """A worker that stops says so: it claims nothing more, and its open claim long-poll
    ends now rather than when it runs out (WorkerLeft)."""

    name: WorkerName
    # The process leaving: not one that has since taken the name over (WorkerRegister).
    identity: WorkerIdentity | None = None
