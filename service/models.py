"""The schema. It changes only through Alembic migrations (migrations/versions)."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from typing_extensions import TypeAliasType


class JobStatus(enum.StrEnum):
    QUEUED = "queued"  # waiting for a worker with room for it
    RUNNING = "running"  # an attempt holds slots on a worker
    CANCELLING = "cancelling"  # cancel asked; the worker is stopping its processes
    SUCCEEDED = "succeeded"  # the program exited 0
    FAILED = "failed"  # the program failed, timed out, or its attempts ran out
    CANCELLED = "cancelled"  # cancelled, and no process of it is left
    HELD = "held"  # queued but held back (ddpq hold) until released: no claim takes it


# How an attempt stands or ended: running, succeeded, failed, cancelled, lost (its worker
# stopped answering), requeued (handed back by a worker that shut down). A named alias:
# the OpenAPI document shows it as one enum, and mypy holds queue.leases to its values.
AttemptOutcome = TypeAliasType(
    "AttemptOutcome",
    Literal["running", "succeeded", "failed", "cancelled", "lost", "requeued"],
)

TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
ACTIVE = frozenset({JobStatus.RUNNING, JobStatus.CANCELLING})


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every dialect (SQLite keeps no zone of its own)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        if value is not None and dialect.name == "sqlite":
            return value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


# SQLite needs INTEGER (not BIGINT) for an auto-incrementing rowid primary key.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[int]: JSON}


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, Any]]
    priority: Mapped[int] = mapped_column(Integer, default=0)
    nnodes: Mapped[int] = mapped_column(Integer, default=1)
    nproc_per_node: Mapped[int] = mapped_column(Integer)
    device: Mapped[str] = mapped_column(String(8))
    max_attempts: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # When it last entered the queue (submitted or requeued).
    queued_at: Mapped[datetime | None]
    # A retried job waits out its backoff: no claim takes it before this time.
    not_before: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    # Attempts that count against max_attempts: failed or lost, not handed back.
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    exit_code: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str | None] = mapped_column(Text)
    worker: Mapped[str | None] = mapped_column(String(200))
    gpus: Mapped[list[int] | None]
    # CPU slots an active CPU job holds on its worker (0 for GPU jobs).
    held_cpu_slots: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    latest_metrics: Mapped[dict[str, Any] | None]
    # Metric points its ranks reported that were never stored (schemas.MetricsIn.dropped).
    metrics_dropped: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # How many steps the run takes, the latest its program reported (a property of the
    # job, never a metric series): the progress bar's end. A new attempt keeps it.
    total_steps: Mapped[int | None] = mapped_column(BigInteger)
    # Bytes of log stored so far: the offset the next chunk must start at.
    log_size: Mapped[int] = mapped_column(BigInteger, default=0)
    # Metric batches ingested so far; each point carries the batch that last wrote it,
    # so the events stream sends what is new since a cursor, in commit order.
    metrics_seq: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # The code snapshot the program runs among (spec.code): kept while the job needs it.
    code: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("code_snapshots.id", ondelete="SET NULL"), index=True
    )
    # Who submitted it (a user's name; None for jobs from before users existed).
    owner: Mapped[str | None] = mapped_column(String(64))
    # While queued: its owner's recent usage (service.queue.shares), which orders jobs
    # of one priority (fair share): the least used owner's first, then the oldest.
    share: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    # While queued: held back by its owner's limits (service.queue.quotas): they run as
    # many jobs as they may; on GPUs it would take them past their GPUs.
    quota_running: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    quota_gpus: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Preemption (service.queue.preempt): running, asked to hand its slots back for the
    # job of this id; queued, others on this worker were asked to make room for it (since).
    preempted_by: Mapped[int | None] = mapped_column(BigInteger)
    preempting_on: Mapped[str | None] = mapped_column(String(200))
    preempting_since: Mapped[datetime | None]
    # Who cancelled it, as its reason names them ("alice (admin): bob's account was
    # closed", service.jobs.cancel_job); its final reason once its worker confirms.
    cancelled_by: Mapped[str | None] = mapped_column(String(300))
    # While held: who held it (a member releases only their own holds; an admin, any).
    held_by: Mapped[str | None] = mapped_column(String(64))
    # While running: why its sweep paused it (service.sweeps): held once its attempt ends.
    pausing: Mapped[str | None] = mapped_column(Text)
    # While queued: how many of its dependencies (service.deptables.JobDep) are unmet,
    # and 1 more while the checkpoint it forks from is not yet sent (service.forks).
    waits_on: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The checkpoint it starts from (spec.from_checkpoint, resolved at its submit): its
    # ranks resume from a copy of it until they have one of their own (service.forks).
    fork_checkpoint_id: Mapped[int | None] = mapped_column(BigInteger)
    # What the job's working directory held when its last attempt ended (service.outputs):
    # a code snapshot (its code and what it wrote), kept for the workdir retention; what
    # was not sent ([{path, size, why}]); the directory on its worker.
    outputs: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("code_snapshots.id", ondelete="SET NULL"), index=True
    )
    outputs_left: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    workdir: Mapped[str | None] = mapped_column(Text)
    outputs_attempt: Mapped[int | None] = mapped_column(Integer)
    # History retention (service.retention), once the job has ended: when its metric
    # series were gone over (downsampled where longer than the retention keeps; NULL:
    # not yet), how many points that removed, and when its log was deleted.
    metrics_swept_at: Mapped[datetime | None]
    metrics_thinned: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    log_dropped_at: Mapped[datetime | None]
    rolled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # rollup

    __table_args__ = (
        # A user's jobs, newest first, of any state or of one, and what each user holds
        # (quotas): ranges of the index. Without the id, a year of jobs (bench/history.py)
        # made a user of few jobs cost a scan of all of them (3 s for a million).
        Index("ix_jobs_owner_id", "owner", "id"),
        Index("ix_jobs_owner_status_id", "owner", "status", "id"),
        # What runs on a worker and the CPU slots it holds: the claim's books, index-only.
        Index("ix_jobs_worker_status", "worker", "status", "held_cpu_slots"),
        # Jobs of one state, newest first (ls --status): a range, not a sort of them all.
        Index("ix_jobs_status_id", "status", "id"),
        # The oldest queued job (the starvation guard's cheap first look).
        Index("ix_jobs_status_queued_at", "status", "queued_at"),
        # Queued multi-node jobs, looked for apart (never a scan to find there are none).
        Index("ix_jobs_status_nnodes", "status", "nnodes"),
        # The job purge (service.retention): ended jobs, oldest first, a range of it.
        Index("ix_jobs_finished_at", "finished_at"),
        # The forks of a checkpoint, released (or failed) once it is sent (service.forks).
        Index("ix_jobs_fork_checkpoint_id", "fork_checkpoint_id"),
        Index("ix_jobs_created_at", "created_at"),  # accounting: submitted in a window
    )


# The claim takes queued jobs in (priority desc, share asc, id asc) order (rules.ORDER):
# the index has that mixed order, or the database sorts every queued job on each claim.
Index("ix_jobs_status_priority_share_id", Job.status, Job.priority.desc(), Job.share, Job.id)

# What the retention sweep has still to do (service.retention): ended jobs not yet gone
# over, oldest first. Partial: once gone over, a job leaves the index, so the sweep never
# walks the years it has done.
_ENDED = Job.finished_at.is_not(None)
for _name, _column in (
    ("ix_jobs_metrics_due", Job.metrics_swept_at),
    ("ix_jobs_log_due", Job.log_dropped_at),
):
    _due = _ENDED & _column.is_(None)
    Index(_name, Job.finished_at, postgresql_where=_due, sqlite_where=_due)


class UserRole(enum.StrEnum):
    ADMIN = "admin"  # everything: manages users, cancels any job, reads the audit trail
    MEMBER = "member"  # submits, sees every job, cancels and changes only its own


class User(Base):
    """A person (or a script of theirs) the API knows, by the sha256 of their token."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    # sha256 of the token; the token itself is shown once and never stored.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # The token's first characters, to tell tokens apart in a listing.
    token_hint: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    token_created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # When the account was closed (its token refused from then on), and by which admin.
    # The row stays: the audit trail and the usage history name it, and the name is
    # never given to another user silently (service.users).
    revoked_at: Mapped[datetime | None]
    deactivated_by: Mapped[str | None] = mapped_column(String(64))


class AuditEvent(Base):
    """Who did what, to what, and when."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(32))  # submit, cancel, user.add, ...
    target: Mapped[str] = mapped_column(String(200))  # "job 7", "user alice"
    detail: Mapped[dict[str, Any] | None]

    # The audit retention (service.retention): the rows older than a cutoff, oldest
    # first, a range of it.
    __table_args__ = (Index("ix_audit_events_at", "at"),)


class UserUsage(Base):
    """A user's recent use of the hosts, in GPU-equivalent seconds decayed with a
    half-life, stored scaled to the epoch (service.queue.shares)."""

    __tablename__ = "user_usage"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    usage: Mapped[float] = mapped_column(Float)
    shared: Mapped[float | None] = mapped_column(Float)  # its queued jobs' (shares.SHARE_STEP)
    updated_at: Mapped[datetime]


class FairshareEpoch(Base):
    """The time usages are scaled to (service.queue.shares): one row, id 1."""

    __tablename__ = "fairshare_epoch"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    t0: Mapped[datetime]


class Quota(Base):
    """A user's limits (None: none); the row named '*' is every user's default."""

    __tablename__ = "quotas"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    max_gpus: Mapped[int | None] = mapped_column(Integer)  # GPUs at once
    max_running: Mapped[int | None] = mapped_column(Integer)  # jobs running at once
    max_queued: Mapped[int | None] = mapped_column(Integer)  # jobs waiting at once
    # The highest priority a member may give a job; null: the default row's, else 0 (a
    # member may lower their jobs' priority, never raise it: Slurm's QOS is the admin's).
    max_priority: Mapped[int | None] = mapped_column(Integer)


class Attempt(Base):
    """One run of a job on a worker; its token is valid while it is live."""

    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(200))
    # sha256 of the job token; the token itself is never stored.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    gpus: Mapped[list[int] | None]
    checkpoint_dir: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    # Up to when its use (its GPUs or CPU slots, for its time) is counted in its owner's
    # usage (service.queue.shares): the sweeper counts it as it runs, its end the rest.
    counted_until: Mapped[datetime | None]
    exit_code: Mapped[int | None] = mapped_column(Integer)
    # Bytes of this attempt's own output stored so far (the worker's resend check).
    log_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    outcome: Mapped[str] = mapped_column(String(16), default="running")  # AttemptOutcome
    # Why it ended as it did, in words (the job's reason keeps only the latest).
    reason: Mapped[str | None] = mapped_column(Text)
    # Another scheduler's id for it (Slurm's job id): what a restarted bridge re-adopts.
    external_id: Mapped[str | None] = mapped_column(String(64))
    # Bytes stored of each node's own stream, by node rank (a Slurm attempt's ranks).
    node_log_bytes: Mapped[dict[str, Any] | None]
    rolled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # rollup

    __table_args__ = (
        UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),
        Index("ix_attempts_ended_at", "ended_at"),  # accounting: what ran in a window
    )


class JobNode(Base):
    """One node slot of a multi-node job's attempt (nnodes > 1), held by one worker.

    The slots of attempt n are claimed while the job is still queued (attempt n - 1
    on the job); the job starts, attempt n, once all nnodes are held (a gang). Node 0
    is the first claimer: its worker hosts torchrun's c10d rendezvous store on the
    port it offered. A slot holds its worker's CPU slots or GPUs while the attempt
    forms or runs and until its worker reports that node's processes gone.
    """

    __tablename__ = "job_nodes"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node_rank: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(200))
    # Where the other nodes reach this node's worker, and the rendezvous port it offered (node 0).
    addr: Mapped[str] = mapped_column(String(255))
    port: Mapped[int] = mapped_column(Integer)
    device: Mapped[str] = mapped_column(String(8))
    gpus: Mapped[list[int]]
    held_cpu_slots: Mapped[int] = mapped_column(Integer, default=0)
    # sha256 of this node's job token (its ranks report with it); never the token.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    checkpoint_dir: Mapped[str] = mapped_column(Text)
    claimed_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Set when this node's worker reports its torchrun gone (finish).
    ended_at: Mapped[datetime | None]
    exit_code: Mapped[int | None] = mapped_column(Integer)
    outcome: Mapped[str | None] = mapped_column(String(16))
    # Bytes of this node's own output stored so far (the worker's resend check).
    log_bytes: Mapped[int] = mapped_column(BigInteger, default=0)

    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "node_rank", name="uq_job_nodes_rank"),
        # A worker never holds two node slots of one attempt.
        UniqueConstraint("job_id", "attempt", "worker", name="uq_job_nodes_worker"),
        # The claim's books: what a worker's slots hold.
        Index("ix_job_nodes_worker", "worker", "ended_at"),
    )


class Worker(Base):
    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    cpu_slots: Mapped[int] = mapped_column(Integer)
    gpus: Mapped[list[int]]
    checkpoint_root: Mapped[str] = mapped_column(Text)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)
    # When it left (POST /workers/leave): no job is claimed for it until it registers again.
    left_at: Mapped[datetime | None]
    # The random id a worker keeps in its data dir (worker.files.datadir): a registration with
    # another one while this one heartbeats is a second process under the same name.
    identity: Mapped[str | None] = mapped_column(String(32), default=None)
    # A bridge to another scheduler (a Slurm partition): the shape of the nodes it hands
    # jobs to (ddpq.messages.ClusterShape); None for a worker that runs jobs itself.
    # none_as_null: a worker's is SQL NULL, which the gang pick's `IS NULL` looks for
    # (a JSON column stores Python None as the JSON text 'null' otherwise).
    cluster: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), default=None)
    # Each of its GPUs as NVML names it (schemas.GpuDevice: index, uuid, name, memory_total),
    # as it last registered; None from a worker without NVML or of an earlier version.
    gpu_devices: Mapped[list[dict[str, Any]] | None] = mapped_column(
        JSON(none_as_null=True), default=None
    )


class WorkerCache(Base):
    """One user's cache on one worker (worker.files.caches), as the worker last reported it: a
    report is whole, and replaces the worker's rows (service.caches)."""

    __tablename__ = "worker_caches"

    worker: Mapped[str] = mapped_column(String(200), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    files: Mapped[int] = mapped_column(BigInteger)
    last_used: Mapped[datetime]
    reported_at: Mapped[datetime]

    __table_args__ = (Index("ix_worker_caches_owner", "owner"),)


class CacheClear(Base):
    """A clear order (``ddpq cache clear``) its worker has not reported done: heartbeat
    replies carry it until then; the row goes when it is (service.caches)."""

    __tablename__ = "cache_clears"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    worker: Mapped[str] = mapped_column(String(200))
    owner: Mapped[str] = mapped_column(String(64))
    asked_by: Mapped[str] = mapped_column(String(64))
    asked_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (Index("ix_cache_clears_worker_owner", "worker", "owner"),)


class MetricPoint(Base):
    """One value of one metric at one step: a job's history is one series per name."""

    __tablename__ = "metric_points"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    # NULL stands for NaN: SQLite turns a stored NaN into NULL, so both dialects agree on it.
    value: Mapped[float | None] = mapped_column(Float)
    epoch: Mapped[float | None] = mapped_column(Float)
    attempt: Mapped[int] = mapped_column(Integer)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    # The job's metrics_seq of the batch that last wrote this point (the events cursor).
    seq: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")

    __table_args__ = (
        Index("ix_metric_points_job_seq", "job_id", "seq"),
        # SQLite: store rows in primary-key order (no rowid), so one series is read
        # as one contiguous range instead of an index walk plus a lookup per point.
        {"sqlite_with_rowid": False},
    )


class GpuSample(Base):
    """A GPU's use while a job held it (its worker samples NVML): the job's system metrics,
    a family apart from what its ranks report (docs/architecture.md says why).

    One row per time slot of one GPU: ``slot`` is the slot's start (Unix seconds), the
    slot as wide as the service's sampling interval while the job is young and twice as
    wide each time its age doubles past an hour's worth of slots (service.gpus), so a job
    keeps O(log(its age)) rows per GPU. A slot keeps its latest sample."""

    __tablename__ = "gpu_samples"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    # Where the GPU is: a multi-node job's workers each have a GPU 0.
    worker: Mapped[str] = mapped_column(String(200), primary_key=True)
    gpu: Mapped[int] = mapped_column(Integer, primary_key=True)  # its index on the worker (NVML's)
    slot: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime]  # when the sample was taken (the service's clock)
    utilization: Mapped[float] = mapped_column(Float)  # percent, over NVML's sample period
    memory_used: Mapped[int] = mapped_column(BigInteger)  # bytes, whoever uses them
    memory_total: Mapped[int] = mapped_column(BigInteger)

    # SQLite: one GPU's series is one contiguous range of the primary key (no rowid).
    __table_args__ = ({"sqlite_with_rowid": False},)


# Where a registered checkpoint's file stands (service.checkpoints): kept; pruning (the
# API chose it to go, its worker has not said it is gone yet); pruned (deleted, or found
# gone); refused (its worker would not delete it: not a regular file inside the job's
# checkpoint directory, or changed since it was registered; the note says which).
CheckpointState = TypeAliasType("CheckpointState", Literal["kept", "pruning", "pruned", "refused"])
# What a checkpoint is: a file (ddpq.train.save_checkpoint's, a framework's), or a
# directory a framework wrote (accelerate's save_state, a Trainer's checkpoint-<step>).
CheckpointKind = TypeAliasType("CheckpointKind", Literal["file", "dir"])


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    step: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The worker whose disk holds the file (its attempt's; node 0's for a gang): the one
    # asked to delete it. None for rows of jobs that had ended before retention existed
    # (migration 0015): those are never deleted by ddpq.
    worker: Mapped[str | None] = mapped_column(String(200))
    # save_checkpoint(keep=True): never pruned by keep_last (only by an ended job's retention).
    keep: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # The file as rank 0 saw it once written (size, and mtime as the worker's identity
    # check: a file written again under the same name since is not deleted); for a
    # directory its stamp (ddpq.wire.tree_stamp: its files' bytes, their newest mtime).
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    mtime_ns: Mapped[int | None] = mapped_column(BigInteger)
    # A CheckpointKind (migration 0030): its worker deletes a directory only as one.
    kind: Mapped[str] = mapped_column(String(8), default="file", server_default="file")
    # A CheckpointState; why it went (or was refused) in words; when its worker said so.
    state: Mapped[str] = mapped_column(String(16), default="kept", server_default="kept")
    note: Mapped[str | None] = mapped_column(Text)
    pruned_at: Mapped[datetime | None]
    # Sent to the API (service.forks): asked since (a fork of it, or a download, wants
    # it; its worker is told with its heartbeats, and keeps it till then), then the code
    # snapshot that holds it, or why its worker could not send it.
    send_asked_at: Mapped[datetime | None]
    snapshot: Mapped[str | None] = mapped_column(String(64))
    send_problem: Mapped[str | None] = mapped_column(Text)

    # A worker's heartbeat asks for its checkpoints to delete, every few seconds.
    __table_args__ = (Index("ix_checkpoints_worker_state", "worker", "state"),)


class LogChunk(Base):
    """A piece of a job's combined output; ``start`` is its byte offset in the whole log."""

    __tablename__ = "log_chunks"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    start: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)

    __table_args__ = (Index("ix_log_chunks_job_start", "job_id", "start"),)


class CodeBlob(Base):
    """One file's content, stored once by its sha256 (service.code)."""

    __tablename__ = "code_blobs"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    # How ``data`` is stored: None as uploaded, "zstd" one zstd frame (a content sent
    # compressed in a pack stays so: less to store, and to send to a worker that takes
    # zstd); ``size`` is always the uncompressed size, and the digest that of those bytes.
    encoding: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Last asked for or linked into a snapshot: unreferenced blobs are collected only
    # once this is older than the retention period (an upload in progress keeps them).
    used_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class CodeSnapshot(Base):
    """A manifest of paths, modes and blob digests; its id is the manifest's sha256."""

    __tablename__ = "code_snapshots"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    files: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    manifest: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    used_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class CodeSnapshotBlob(Base):
    """Which blobs a snapshot needs: a blob is collected only when no snapshot does."""

    __tablename__ = "code_snapshot_blobs"

    snapshot_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("code_snapshots.id", ondelete="CASCADE"), primary_key=True
    )
    digest: Mapped[str] = mapped_column(
        String(64), ForeignKey("code_blobs.digest"), primary_key=True, index=True
    )


class Secret(Base):
    """One of a user's secrets (service.secrets): its value only as AES-256-GCM
    ciphertext, bound to its owner and name (the associated data), with the id of the key
    that sealed it, so the key can be rotated (DDPQ_SECRETS_OLD_KEYS)."""

    __tablename__ = "secrets"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    # The variable the ranks get it as (ddpq.rules.secret_name_problem).
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(16))
    # The 12-byte nonce, then the ciphertext and its 16-byte tag.
    sealed: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
