"""The schema. It changes only through Alembic migrations (migrations/versions)."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
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
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class JobStatus(enum.StrEnum):
    QUEUED = "queued"  # waiting for a worker with room for it
    RUNNING = "running"  # an attempt holds slots on a worker
    CANCELLING = "cancelling"  # cancel asked; the worker is stopping its processes
    SUCCEEDED = "succeeded"  # the program exited 0
    FAILED = "failed"  # the program failed, timed out, or its attempts ran out
    CANCELLED = "cancelled"  # cancelled, and no process of it is left


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
    # Copies of spec fields the queue filters and orders on.
    priority: Mapped[int] = mapped_column(Integer, default=0)
    nnodes: Mapped[int] = mapped_column(Integer, default=1)
    nproc_per_node: Mapped[int] = mapped_column(Integer)
    device: Mapped[str] = mapped_column(String(8))
    max_attempts: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # When it last entered the queue (submitted or requeued): how long it has waited.
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
    # CPU slots an active CPU job holds on its worker (0 for GPU jobs): the claim sums these.
    held_cpu_slots: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    latest_metrics: Mapped[dict[str, Any] | None]
    # Bytes of log stored so far: the offset the next chunk must start at.
    log_size: Mapped[int] = mapped_column(BigInteger, default=0)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    request_hash: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        # What runs on a worker and the CPU slots it holds: the claim's books, read
        # from the index alone.
        Index("ix_jobs_worker_status", "worker", "status", "held_cpu_slots"),
        # The oldest queued job (the starvation guard's cheap first look).
        Index("ix_jobs_status_queued_at", "status", "queued_at"),
    )


# The claim takes queued jobs in (priority desc, id asc) order. The index must have that
# mixed order itself: an all-ascending one makes the database sort every queued job of
# equal priority on every claim.
Index("ix_jobs_status_priority_id", Job.status, Job.priority.desc(), Job.id)


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
    exit_code: Mapped[int | None] = mapped_column(Integer)
    # Bytes of this attempt's own output stored so far (the worker's resend check).
    log_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # running, succeeded, failed, cancelled, lost, requeued
    outcome: Mapped[str] = mapped_column(String(16), default="running")

    __table_args__ = (UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),)


class Worker(Base):
    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    cpu_slots: Mapped[int] = mapped_column(Integer)
    gpus: Mapped[list[int]]
    checkpoint_root: Mapped[str] = mapped_column(Text)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)


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


class LogChunk(Base):
    """A piece of a job's combined output; ``start`` is its byte offset in the whole log."""

    __tablename__ = "log_chunks"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    start: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)

    __table_args__ = (Index("ix_log_chunks_job_start", "job_id", "start"),)
