"""The job state machine: submit, read, cancel, finish, and what ranks report.

Route handlers stay thin and call these; each function is one transaction.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import signal
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import queue
from service.db import Database
from service.errors import Conflict, Invalid, NotFound
from service.models import (
    TERMINAL,
    Attempt,
    Checkpoint,
    Job,
    JobStatus,
    LogChunk,
    MetricPoint,
    utcnow,
)
from service.schemas import (
    CheckpointIn,
    CheckpointPublic,
    FinishRequest,
    JobPublic,
    JobSpec,
    LatestMetrics,
    MetricItemPublic,
    MetricsIn,
    metric_in,
    metric_out,
)

MAX_LOG_RESPONSE_BYTES = 8 * 1024 * 1024


# ---- reading -----------------------------------------------------------------------


def _checkpoint_public(c: Checkpoint) -> CheckpointPublic:
    return CheckpointPublic(
        id=c.id,
        path=c.path,
        step=c.step,
        epoch=metric_out(c.epoch) if c.epoch is not None else None,
        attempt=c.attempt,
        created_at=c.created_at,
        metrics=c.metrics or {},
    )


def _queue_positions(s: Session, jobs: list[Job]) -> dict[int, int]:
    """1-based places in the claim order (priority desc, then submission) of queued jobs."""
    queued = [j for j in jobs if j.status == JobStatus.QUEUED]
    if len(queued) > 1:
        # One pass over the queue instead of one count per job on a page.
        order = func.row_number().over(order_by=(Job.priority.desc(), Job.id))
        ranked = select(Job.id, order.label("pos")).where(Job.status == JobStatus.QUEUED).subquery()
        wanted = [j.id for j in queued]
        rows = s.execute(select(ranked.c.id, ranked.c.pos).where(ranked.c.id.in_(wanted)))
        return {job_id: int(pos) for job_id, pos in rows}
    positions: dict[int, int] = {}
    for job in queued:
        ahead = s.scalar(
            select(func.count())
            .select_from(Job)
            .where(
                Job.status == JobStatus.QUEUED,
                or_(
                    Job.priority > job.priority,
                    and_(Job.priority == job.priority, Job.id < job.id),
                ),
            )
        )
        positions[job.id] = (ahead or 0) + 1
    return positions


def _with_history(pending: str | None, stored: str | None) -> str | None:
    """A queued job's live reason, with why it was requeued when it was."""
    if pending is None:
        return stored
    return f"{pending} ({stored})" if stored else pending


def _publics(s: Session, jobs: list[Job]) -> list[JobPublic]:
    if not jobs:
        return []
    ids = [j.id for j in jobs]
    newest = (
        select(func.max(Checkpoint.id))
        .where(Checkpoint.job_id.in_(ids))
        .group_by(Checkpoint.job_id)
    )
    checkpoints = {
        c.job_id: c for c in s.scalars(select(Checkpoint).where(Checkpoint.id.in_(newest)))
    }
    positions = _queue_positions(s, jobs)
    pending = queue.pending_reasons(s, [j for j in jobs if j.status == JobStatus.QUEUED], positions)
    out = []
    for j in jobs:
        c = checkpoints.get(j.id)
        out.append(
            JobPublic(
                id=j.id,
                name=j.name,
                status=j.status,
                spec=j.spec,
                created_at=j.created_at,
                started_at=j.started_at,
                finished_at=j.finished_at,
                attempt=j.attempt,
                exit_code=j.exit_code,
                reason=_with_history(pending.get(j.id), j.reason),
                worker=j.worker,
                gpus=j.gpus,
                latest_metrics=LatestMetrics(**j.latest_metrics) if j.latest_metrics else None,
                latest_checkpoint=_checkpoint_public(c) if c else None,
                queue_position=positions.get(j.id),
            )
        )
    return out


def _get(s: Session, job_id: int) -> Job:
    job = s.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def get_job(db: Database, job_id: int) -> JobPublic:
    with db.read() as s:
        return _publics(s, [_get(s, job_id)])[0]


def list_jobs(
    db: Database, statuses: list[str], limit: int, cursor: int | None
) -> tuple[list[JobPublic], str | None]:
    """Newest first; ``cursor`` is the id the previous page ended at."""
    q = select(Job).order_by(Job.id.desc()).limit(limit + 1)
    if statuses:
        q = q.where(Job.status.in_(statuses))
    if cursor is not None:
        q = q.where(Job.id < cursor)
    with db.read() as s:
        jobs = list(s.scalars(q))
        more = len(jobs) > limit
        jobs = jobs[:limit]
        next_cursor = str(jobs[-1].id) if more and jobs else None
        return _publics(s, jobs), next_cursor


# ---- submitting and cancelling -----------------------------------------------------


def _request_hash(spec: JobSpec) -> str:
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def submit_job(
    db: Database, spec: JobSpec, idempotency_key: str | None, strict: bool = False
) -> JobPublic:
    digest = _request_hash(spec) if idempotency_key else None
    if idempotency_key:
        existing = _replay(db, idempotency_key, digest)
        if existing is not None:
            return existing
    now = utcnow()
    job = Job(
        name=spec.name,
        status=JobStatus.QUEUED,
        spec=spec.model_dump(mode="json"),
        priority=spec.priority,
        nnodes=spec.nnodes,
        nproc_per_node=spec.world_size // spec.nnodes,
        device=spec.device,
        max_attempts=spec.max_attempts,
        created_at=now,
        queued_at=now,
        idempotency_key=idempotency_key,
        request_hash=digest,
    )
    try:
        with db.write() as s:
            if strict:
                problem = queue.unschedulable(s, job)
                if problem:
                    raise Conflict(f"{problem} (strict=true: not queued)")
            s.add(job)
            s.flush()
            queue.notify_claimers(s)
            return _publics(s, [job])[0]
    except IntegrityError:
        # Another request with the same key won the race; answer with its job.
        if idempotency_key:
            existing = _replay(db, idempotency_key, digest)
            if existing is not None:
                return existing
        raise


def _replay(db: Database, key: str, digest: str | None) -> JobPublic | None:
    with db.read() as s:
        job = s.scalar(select(Job).where(Job.idempotency_key == key))
        if job is None:
            return None
        if job.request_hash != digest:
            raise Conflict(
                f"Idempotency-Key {key!r} was already used for job {job.id} with a different body"
            )
        return _publics(s, [job])[0]


def cancel_job(db: Database, job_id: int) -> JobPublic:
    """Queued jobs are cancelled at once; running ones once their worker confirms."""
    now = utcnow()
    with db.write() as s:
        job = _get(s, job_id)
        if job.status == JobStatus.QUEUED:
            job.status = JobStatus.CANCELLED
            job.reason = "cancelled by user before it started"
            job.finished_at = now
        elif job.status == JobStatus.RUNNING:
            job.status = JobStatus.CANCELLING
            job.reason = "cancel requested; stopping its processes"
        elif job.status in TERMINAL:
            raise Conflict(f"job {job_id} is already {job.status}")
        s.flush()
        return _publics(s, [job])[0]


# ---- the worker's side ----------------------------------------------------------------


def _live_attempt(s: Session, job_id: int, number: int, worker: str) -> tuple[Job, Attempt]:
    job = _get(s, job_id)
    attempt = s.scalar(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == number))
    if attempt is None or attempt.worker != worker:
        raise Conflict(f"job {job_id} has no attempt {number} on worker {worker}")
    if job.attempt != number:
        raise Conflict(f"attempt {number} was superseded by attempt {job.attempt}")
    return job, attempt


def append_log(
    db: Database, job_id: int, number: int, worker: str, offset: int, data: bytes
) -> int:
    """Append a chunk of an attempt's output.

    ``offset`` is where the chunk starts in this attempt's own output, so a chunk
    resent after a lost answer is recognised and stored once.
    """
    with db.write() as s:
        _, attempt = _live_attempt(s, job_id, number, worker)
        have = attempt.log_bytes
        if offset > have:
            raise Conflict(
                f"log gap: this attempt has {have} bytes stored, chunk starts at {offset}"
            )
        fresh = data[have - offset :]
        if fresh:
            queue._append_log(s, job_id, number, fresh)
            attempt.log_bytes = have + len(fresh)
        return attempt.log_bytes


def _exit_words(code: int | None) -> str:
    """An exit status as a person reads it; codes >= 128 are death by signal 128+n."""
    if code is None:
        return "ended without an exit code"
    if code >= 128:
        n = code - 128
        try:
            name = signal.Signals(n).name
        except ValueError:
            name = f"signal {n}"
        hint = " (out of memory?)" if n == signal.SIGKILL else ""
        return f"killed by {name}{hint}, exit code {code}"
    return f"exited with code {code}"


def finish_attempt(db: Database, job_id: int, worker: str, req: FinishRequest) -> JobPublic:
    """Record how an attempt ended and move the job on. Safe to repeat.

    Retry policy: an attempt killed by a signal (exit code >= 128: OOM killer,
    preemption) is retried; a program's own error (1..127) fails the job unless its
    spec sets ``retry_on_error``; a timeout or a worker-side error never retries.
    Retries wait out an exponential backoff and count against ``max_attempts``; an
    attempt handed back by a worker that shuts down is requeued at once, uncounted.
    """
    now = utcnow()
    policy = db.policy
    with db.write() as s:
        job = _get(s, job_id)
        attempt = s.scalar(
            select(Attempt).where(Attempt.job_id == job_id, Attempt.number == req.attempt)
        )
        if attempt is None or attempt.worker != worker:
            raise Conflict(f"job {job_id} has no attempt {req.attempt} on worker {worker}")
        if job.attempt != req.attempt:
            raise Conflict(f"attempt {req.attempt} was superseded by attempt {job.attempt}")
        if attempt.outcome == "lost":
            raise Conflict(f"attempt {req.attempt} was declared lost: {job.reason}")
        if attempt.ended_at is not None:
            return _publics(s, [job])[0]  # a retried finish: already recorded
        attempt.ended_at = now
        attempt.exit_code = req.exit_code
        job.exit_code = req.exit_code
        code = req.exit_code
        retryable = req.outcome == "exited" and code is not None and code != 0
        if retryable and code is not None and code < 128:
            retryable = bool(job.spec.get("retry_on_error"))
        if req.outcome == "requeue" and job.status == JobStatus.RUNNING:
            _requeue(job, now, f"worker {worker} shut down; requeued, not counted as a failure")
            attempt.outcome = "requeued"
        elif job.status == JobStatus.CANCELLING or req.outcome == "cancelled":
            job.status = JobStatus.CANCELLED
            job.reason = "cancelled by user"
            attempt.outcome = "cancelled"
        elif req.outcome == "timeout":
            job.status = JobStatus.FAILED
            job.reason = req.reason or f"timeout after {job.spec.get('timeout_s')} s"
            attempt.outcome = "failed"
        elif req.outcome == "exited" and code == 0:
            job.status = JobStatus.SUCCEEDED
            job.reason = None
            attempt.outcome = "succeeded"
        else:
            attempt.outcome = "failed"
            # The worker sends the program's last error line; the words for the exit are ours.
            what = _exit_words(code) if req.outcome == "exited" else "failed to start"
            if req.reason:
                what += f": {req.reason}"
            if code is not None and 0 < code < 128 and not retryable:
                what += " (a program error: not retried unless the spec sets retry_on_error)"
            job.failures += 1
            if retryable and job.failures < job.max_attempts:
                delay = min(
                    policy.retry_backoff_s * 2 ** (job.failures - 1), policy.retry_backoff_max_s
                )
                _requeue(
                    job,
                    now,
                    f"attempt {req.attempt} {what}; retrying as attempt {job.attempt + 1} "
                    f"({job.failures} of {job.max_attempts} attempts used) after {delay:g} s",
                )
                job.not_before = now + timedelta(seconds=delay)
            else:
                job.status = JobStatus.FAILED
                spent = f"; all {job.max_attempts} attempts used" if retryable else ""
                job.reason = f"{what}{spent}"
        if job.status in TERMINAL:
            job.finished_at = now
        s.flush()
        queue.notify_claimers(s)  # its slots are free, or it is queued again
        return _publics(s, [job])[0]


def _requeue(job: Job, now: datetime, reason: str) -> None:
    for column, value in queue.requeued(now, reason).items():
        setattr(job, column, value)


# ---- what ranks report ----------------------------------------------------------------


def _still_current(job: Job, attempt: Attempt) -> None:
    """Fencing, re-checked inside the write: the token was checked in an earlier transaction."""
    if job.attempt != attempt.number:
        raise Conflict(f"attempt {attempt.number} was superseded by attempt {job.attempt}")
    if job.status not in (JobStatus.RUNNING, JobStatus.CANCELLING):
        raise Conflict(f"job {job.id} is {job.status}; attempt {attempt.number} has ended")


def _upsert(db: Database) -> Any:
    return pg_insert if db.dialect == "postgresql" else sqlite_insert


def ingest_metrics(db: Database, attempt: Attempt, body: MetricsIn) -> int:
    """Store metric points; a step reported again keeps the newest attempt's value."""
    now = utcnow()
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for item in body.items:
        epoch = metric_in(item.epoch) if item.epoch is not None else None
        for name, value in item.values.items():
            rows[(name, item.step)] = {
                "job_id": attempt.job_id,
                "name": name,
                "step": item.step,
                "value": metric_in(value),
                "epoch": epoch,
                "attempt": attempt.number,
                "time": now,
            }
    last = max(body.items, key=lambda i: i.step)
    latest_values = {
        name: metric_out(metric_in(v))
        for item in body.items
        if item.step == last.step
        for name, v in item.values.items()
    }
    insert = _upsert(db)(MetricPoint)
    stmt = insert.on_conflict_do_update(
        index_elements=["job_id", "name", "step"],
        set_={
            "value": insert.excluded.value,
            "epoch": insert.excluded.epoch,
            "attempt": insert.excluded.attempt,
            "time": insert.excluded.time,
        },
        where=MetricPoint.attempt <= insert.excluded.attempt,
    )
    with db.write() as s:
        job = _get(s, attempt.job_id)
        _still_current(job, attempt)
        s.execute(stmt, list(rows.values()))
        latest = job.latest_metrics
        if latest is None or last.step > latest["step"]:
            job.latest_metrics = {
                "step": last.step,
                "epoch": metric_out(metric_in(last.epoch)) if last.epoch is not None else None,
                "values": latest_values,
            }
        elif last.step == latest["step"]:
            job.latest_metrics = {**latest, "values": {**latest["values"], **latest_values}}
    return len(rows)


def metric_history(
    db: Database, job_id: int, names: list[str], since_step: int | None
) -> list[MetricItemPublic]:
    q = select(MetricPoint).where(MetricPoint.job_id == job_id)
    if names:
        q = q.where(MetricPoint.name.in_(names))
    if since_step is not None:
        q = q.where(MetricPoint.step >= since_step)
    q = q.order_by(MetricPoint.step, MetricPoint.name)
    items: list[MetricItemPublic] = []
    with db.read() as s:
        _get(s, job_id)
        for p in s.scalars(q):
            if not items or items[-1].step != p.step:
                items.append(
                    MetricItemPublic(
                        step=p.step,
                        epoch=metric_out(p.epoch) if p.epoch is not None else None,
                        attempt=p.attempt,
                        time=p.time,
                        values={},
                    )
                )
            items[-1].values[p.name] = metric_out(p.value)
            items[-1].attempt = max(items[-1].attempt, p.attempt)
    return items


def register_checkpoint(db: Database, attempt: Attempt, body: CheckpointIn) -> CheckpointPublic:
    """Record a checkpoint file; its path must lie inside the attempt's checkpoint directory."""
    path = posixpath.normpath(body.path)
    root = posixpath.normpath(attempt.checkpoint_dir)
    if not path.startswith(root + "/"):
        raise Invalid(("body", "path"), f"must be inside the job's checkpoint directory {root}")
    c = Checkpoint(
        job_id=attempt.job_id,
        attempt=attempt.number,
        path=path,
        step=body.step,
        epoch=metric_in(body.epoch) if body.epoch is not None else None,
        metrics={k: metric_out(metric_in(v)) for k, v in body.metrics.items()},
        created_at=utcnow(),
    )
    with db.write() as s:
        _still_current(_get(s, attempt.job_id), attempt)
        s.add(c)
        s.flush()
        return _checkpoint_public(c)


def list_checkpoints(db: Database, job_id: int) -> list[CheckpointPublic]:
    with db.read() as s:
        _get(s, job_id)
        rows = s.scalars(
            select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id)
        )
        return [_checkpoint_public(c) for c in rows]


def read_log(db: Database, job_id: int, offset: int) -> tuple[bytes, int, str]:
    """The log from ``offset`` (at most MAX_LOG_RESPONSE_BYTES), the next offset, the status."""
    with db.read() as s:
        job = _get(s, job_id)
        first = s.scalar(
            select(func.max(LogChunk.start)).where(
                LogChunk.job_id == job_id, LogChunk.start <= offset
            )
        )
        q = select(LogChunk.start, LogChunk.data).where(LogChunk.job_id == job_id)
        if first is not None:
            q = q.where(LogChunk.start >= first)
        out = bytearray()
        for start, data in s.execute(q.order_by(LogChunk.start)):
            piece = data[max(0, offset - start) :]
            out += piece[: MAX_LOG_RESPONSE_BYTES - len(out)]
            if len(out) >= MAX_LOG_RESPONSE_BYTES:
                break
        return bytes(out), offset + len(out), job.status
