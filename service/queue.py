"""The claim and lease SQL: the one module that moves jobs between workers.

A claim is one statement: pick the best queued job that fits the worker's free
slots (priority desc, then submission order) and mark it running, returning it.
On Postgres the pick is ``FOR UPDATE SKIP LOCKED`` so concurrent claimers pass
over each other's rows; on SQLite the write transaction is ``BEGIN IMMEDIATE``
(see db.py), which serialises claimers. The attempt row, with its hashed job
token, is written in the same transaction.

Leases: a worker heartbeats its running attempts; an attempt whose heartbeat is
older than the lease is lost and its job requeued (or failed when its attempts
are spent) by ``expire_leases``, which every API process runs periodically.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from service.db import Database
from service.models import ACTIVE, Attempt, Checkpoint, Job, JobStatus, LogChunk, Worker, utcnow

RESUME_CANDIDATES = 5  # newest checkpoints offered; the worker takes the first on disk


@dataclass
class Claim:
    job_id: int
    attempt: int
    spec: dict[str, Any]
    device: str
    nproc_per_node: int
    gpus: list[int]
    checkpoint_dir: str
    resume_from: list[str]


def _rowcount(result: Any) -> int:
    """Rows an UPDATE touched (Session.execute is typed as returning a plain Result)."""
    return int(result.rowcount)


def _fits(worker_has_gpus: bool, free_cpu_slots: int, free_gpus: int) -> Any:
    cpu_fit = Job.nproc_per_node <= free_cpu_slots
    if not worker_has_gpus:
        return and_(Job.device.in_(["cpu", "auto"]), cpu_fit)
    gpu_fit = Job.nproc_per_node <= free_gpus
    return or_(
        and_(Job.device.in_(["cuda", "auto"]), gpu_fit),
        and_(Job.device == "cpu", cpu_fit),
    )


def claim_next_job(
    db: Database,
    worker: str,
    free_cpu_slots: int,
    free_gpus: list[int],
    token_hash: str,
) -> Claim | None:
    """Claim the next job that fits on ``worker`` now, or return None."""
    now = utcnow()
    with db.write() as s:
        w = s.get(Worker, worker)
        if w is None:
            raise LookupError(worker)
        has_gpus = bool(w.gpus)
        pick = (
            select(Job.id)
            .where(
                Job.status == JobStatus.QUEUED,
                Job.nnodes == 1,
                _fits(has_gpus, free_cpu_slots, len(free_gpus)),
            )
            .order_by(Job.priority.desc(), Job.id)
            .limit(1)
        )
        if db.dialect == "postgresql":
            pick = pick.with_for_update(skip_locked=True)
        row = s.execute(
            update(Job)
            .where(Job.id == pick.scalar_subquery(), Job.status == JobStatus.QUEUED)
            .values(
                status=JobStatus.RUNNING,
                attempt=Job.attempt + 1,
                worker=worker,
                started_at=func.coalesce(Job.started_at, now),
                reason=None,
                exit_code=None,
            )
            .returning(Job.id, Job.attempt, Job.spec, Job.device, Job.nproc_per_node)
        ).first()
        if row is None:
            return None
        job_id, number, spec, device, nproc = row
        resolved = "cuda" if device == "cuda" or (device == "auto" and has_gpus) else "cpu"
        gpus = sorted(free_gpus)[:nproc] if resolved == "cuda" else []
        checkpoint_dir = f"{w.checkpoint_root.rstrip('/')}/job-{job_id}"
        s.execute(update(Job).where(Job.id == job_id).values(gpus=gpus))
        s.add(
            Attempt(
                job_id=job_id,
                number=number,
                worker=worker,
                token_hash=token_hash,
                gpus=gpus,
                checkpoint_dir=checkpoint_dir,
                started_at=now,
                heartbeat_at=now,
            )
        )
        banner = (
            f"[ddpq] attempt {number} on worker {worker}: {nproc} rank(s) on "
            f"{'GPUs ' + ','.join(map(str, gpus)) if gpus else 'CPU'}\n"
        )
        _append_log(s, job_id, number, banner.encode())
        resume = list(
            s.scalars(
                select(Checkpoint.path)
                .where(Checkpoint.job_id == job_id)
                .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
                .limit(RESUME_CANDIDATES)
            )
        )
        return Claim(job_id, number, spec, resolved, nproc, gpus, checkpoint_dir, resume)


def _append_log(s: Session, job_id: int, attempt: int, data: bytes) -> int:
    """Append to a job's log inside the caller's write transaction; returns the new size."""
    size = s.scalar(select(Job.log_size).where(Job.id == job_id)) or 0
    s.add(LogChunk(job_id=job_id, attempt=attempt, start=size, data=data))
    s.execute(update(Job).where(Job.id == job_id).values(log_size=size + len(data)))
    return size + len(data)


def record_heartbeat(
    db: Database, worker: str, running: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Extend the leases of a worker's attempts.

    Returns (cancel, abandon): attempts a user cancelled, and attempts that are no
    longer this worker's to run (lost and requeued, or ended); the worker stops both.
    """
    now = utcnow()
    cancel: list[tuple[int, int]] = []
    abandon: list[tuple[int, int]] = []
    with db.write() as s:
        touched = _rowcount(
            s.execute(update(Worker).where(Worker.name == worker).values(last_heartbeat=now))
        )
        if touched == 0:
            raise LookupError(worker)
        if not running:
            return cancel, abandon
        job_ids = [job_id for job_id, _ in running]
        jobs = {
            j.id: j
            for j in s.execute(
                select(Job.id, Job.attempt, Job.status, Job.worker).where(Job.id.in_(job_ids))
            )
        }
        live: list[tuple[int, int]] = []
        for job_id, number in running:
            job = jobs.get(job_id)
            if (
                job is None
                or job.attempt != number
                or job.worker != worker
                or job.status not in ACTIVE
            ):
                abandon.append((job_id, number))
                continue
            live.append((job_id, number))
            if job.status == JobStatus.CANCELLING:
                cancel.append((job_id, number))
        for job_id, number in live:
            s.execute(
                update(Attempt)
                .where(
                    Attempt.job_id == job_id,
                    Attempt.number == number,
                    Attempt.ended_at.is_(None),
                )
                .values(heartbeat_at=now)
            )
    return cancel, abandon


def expire_leases(db: Database, lease_s: float) -> list[int]:
    """Mark attempts without a heartbeat for ``lease_s`` lost; requeue or fail their jobs."""
    now = utcnow()
    cutoff = now - timedelta(seconds=lease_s)
    changed: list[int] = []
    find_stale = (
        select(Job.id, Job.attempt, Job.max_attempts, Job.status, Attempt.worker, Attempt.id)
        .join(Attempt, and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt))
        .where(
            Job.status.in_(list(ACTIVE)),
            Attempt.ended_at.is_(None),
            Attempt.heartbeat_at < cutoff,
        )
    )
    # Look first without the write lock: nearly every sweep finds nothing.
    with db.read() as s:
        if s.execute(find_stale.limit(1)).first() is None:
            return changed
    with db.write() as s:
        stale = s.execute(find_stale).all()
        for job_id, number, max_attempts, status, worker, attempt_id in stale:
            lost = f"worker {worker} lost (no heartbeat for {lease_s:g} s)"
            if status == JobStatus.CANCELLING:
                values: dict[str, Any] = {
                    "status": JobStatus.CANCELLED,
                    "reason": f"cancelled; {lost} before it confirmed",
                    "finished_at": now,
                }
            elif number < max_attempts:
                values = {
                    "status": JobStatus.QUEUED,
                    "reason": f"{lost}; requeued for attempt {number + 1} of {max_attempts}",
                    "worker": None,
                    "gpus": None,
                }
            else:
                values = {
                    "status": JobStatus.FAILED,
                    "reason": f"{lost}; all {max_attempts} attempts used",
                    "finished_at": now,
                }
            done = _rowcount(
                s.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.attempt == number, Job.status == status)
                    .values(**values)
                )
            )
            if done:
                s.execute(
                    update(Attempt)
                    .where(Attempt.id == attempt_id)
                    .values(ended_at=now, outcome="lost")
                )
                changed.append(job_id)
    return changed
