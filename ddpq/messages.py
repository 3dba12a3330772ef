"""The typed messages the service sends a worker, defined once for both sides.

The service answers with these models (they are the OpenAPI schema's shapes); the
worker parses the answers into them and never handles the protocol as raw dicts.
What a worker sends is validated by the service's own request models
(service.schemas), which carry the limits a client must keep to.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


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
    spec: dict[str, Any]
    device: Literal["cpu", "cuda"]
    nproc_per_node: int
    gpus: list[int]
    checkpoint_dir: str
    # Newest first; the worker gives ranks the first one whose file exists.
    resume_from: list[str]
    # A node slot of a multi-node job: wait for the gang (POST /workers/gang) first.
    nnodes: int = 1
    node_rank: int = 0
    # Who submitted it: whose cache on the worker its ranks use (worker.caches). None
    # from an API of an earlier version, or for a job from before users: no cache kept.
    owner: str | None = None
    # The values of the secrets the spec names (spec["secrets"]), its owner's as they are
    # at this claim (service.secrets.for_claim): for the ranks' environment alone
    # (worker.torchrun.environment), never logged, written to a file or shown; left out of
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
    # How often to sample the GPUs of running jobs (sent with the heartbeats); a service
    # of an earlier version sends none: the default.
    gpu_sample_s: float = 5.0
    # A bridge's attempts that have not ended (empty for a worker).
    held: list[HeldAttempt] = []


class CodeSnapshot(BaseModel):
    """GET /workers/code/snapshots/{id}: a job's code as a manifest (ddpq.snapshot), each
    entry checked again by the worker before it writes anything."""

    id: str
    files: int
    bytes: int
    manifest: list[dict[str, Any]]
