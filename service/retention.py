"""History retention: what of an ended job's history stays as it ages.

A year of finished jobs must not cost the database what they cost while they ran
(bench/history.py measures it). Three rules, run by the API's sweeper in bounded
transactions (none deletes more than BATCH_ROWS rows, so no lock is held long):

- metrics (DDPQ_METRICS_DOWNSAMPLE_AFTER after the job ended): each series longer than
  DDPQ_METRICS_DOWNSAMPLE_POINTS keeps the points the API's own downsampling would
  answer for that many (service.metrics: each bucket's lowest and highest point, the
  first and the last), the rest are deleted, as Prometheus-style rollups keep min and
  max: a chart of the job looks as it did, a spike or a NaN still shows. The job counts
  the points removed (``metrics_downsampled``). Going over a series again picks the same
  points (its ends and every bucket's extremes are among those kept), so a sweep cut
  short, or two API processes sweeping at once, never lose more.
- logs (DDPQ_LOG_RETENTION after the job ended): the job's log chunks are deleted and the
  job marked in the same transaction; reading its log then answers a line saying so.

- jobs (DDPQ_JOB_RETENTION after the job ended; never by default): the job is deleted
  with every row that hangs off it (metric points, GPU samples, log chunks, checkpoint
  rows, node slots, attempts), the large ones first in transactions of at most
  BATCH_ROWS rows, then the job's row. Never a job whose checkpoints are still on a
  worker's disk (service.checkpoints.settled) or whose directory is still kept
  (service.outputs.expired: DDPQ_WORKDIR_RETENTION, and each user's newest ended jobs,
  DDPQ_WORKDIR_KEEP_NEWEST, kept with no end). A round cut short leaves a due job with
  part of its rows; the next round picks the same jobs first and goes on. The audit
  trail keeps its rows naming the job: it says who did what, and must not lose that
  because the subject went. The code and directory snapshots the job named are collected
  by code collection (service.code.collect) like any other no job needs.
- the audit trail (DDPQ_AUDIT_RETENTION after a row was written; never by default): its
  rows are deleted by their own age, oldest first (ix_audit_events_at), BATCH_ROWS a
  transaction, whether or not their job is still there: an audit trail is kept for a
  period of its own (a compliance rule's), not as long as its subjects.

GPU samples need no rule of their own: a job keeps O(log(its age)) of them per GPU
(service.gpus).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    Row,
    case,
    delete,
    exists,
    select,
    text,
    true,
    tuple_,
    update,
)
from sqlalchemy.orm import InstrumentedAttribute

from service.checkpoints import settled
from service.db import Database
from service.metrics import pick_steps, series_names
from service.models import (
    TERMINAL,
    Attempt,
    AuditEvent,
    Checkpoint,
    GpuSample,
    Job,
    JobNode,
    LogChunk,
    MetricPoint,
    utcnow,
)
from service.outputs import expired
from service.schemas import OutputsLimits

# Rows one transaction deletes at most.
BATCH_ROWS = 20_000
# Log bytes one transaction deletes at most (at least one job's: a log is capped).
BATCH_LOG_BYTES = 16 * 1024 * 1024
# Jobs one transaction marks at most (or one batch of the purge deletes).
BATCH_JOBS = 500


# Whether a job holds more than n - 1 points, counting no further than n.
_MORE_THAN = text(
    "SELECT count(*) FROM (SELECT 1 FROM metric_points WHERE job_id = :job_id LIMIT :n) AS x"
)


@dataclass
class Swept:
    points: int = 0  # metric points deleted
    jobs: int = 0  # jobs whose series were gone over
    logs: int = 0  # jobs whose log was deleted
    done: bool = True  # nothing left that is due (False: the budget ran out first)
    purged: int = 0  # jobs deleted (the job purge)
    audit: int = 0  # audit trail rows deleted


def _due(column: InstrumentedAttribute[datetime | None], cutoff: datetime) -> ColumnElement[bool]:
    # The partial indexes' predicate (models: ix_jobs_metrics_due, ix_jobs_log_due) and
    # the cutoff; the status test is for safety only (an ended job has a finished_at).
    return (
        Job.finished_at.is_not(None)
        & column.is_(None)
        & (Job.finished_at < cutoff)
        & Job.status.in_(TERMINAL)
    )


def sweep(db: Database, budget_s: float = 1.0, outputs: OutputsLimits | None = None) -> Swept:
    """One round of retention, for about ``budget_s`` of work. The job purge runs only
    given ``outputs`` (Settings.outputs_limits): it never purges a directory still kept."""
    policy = db.policy
    deadline = time.monotonic() + budget_s
    out = Swept()
    now = utcnow()
    # The audit trail first: a short range of its index, which no backlog of the job
    # rules below (a purge of a year of jobs) should hold up.
    if policy.audit_retention_s is not None:
        cutoff = now - timedelta(seconds=policy.audit_retention_s)
        out.done &= _drop_audit(db, cutoff, deadline, out)
    # The purge next: whatever it deletes, the rules below need not go over.
    if policy.job_retention_s is not None and outputs is not None:
        cutoff = now - timedelta(seconds=policy.job_retention_s)
        out.done &= _purge(db, cutoff, outputs, deadline, out)
        if not out.done:
            return out  # the rest waits: it would go over jobs the next round purges
    if policy.log_retention_s is not None:
        out.done &= _drop_logs(db, now - timedelta(seconds=policy.log_retention_s), deadline, out)
    if policy.metrics_downsample_after_s is not None:
        cutoff = now - timedelta(seconds=policy.metrics_downsample_after_s)
        out.done &= _thin_metrics(db, cutoff, policy.metrics_downsample_points, deadline, out)
    return out


def _within_log_bytes(rows: Sequence[Row[int, int]]) -> list[int]:
    """The first of the (job id, log bytes) rows whose logs together one transaction
    deletes: at most BATCH_LOG_BYTES, and at least one job's."""
    ids: list[int] = []
    nbytes = 0
    for job_id, size in rows:
        if ids and nbytes + size > BATCH_LOG_BYTES:
            break
        ids.append(job_id)
        nbytes += size
    return ids


def _drop_logs(db: Database, cutoff: datetime, deadline: float, out: Swept) -> bool:
    # Each loop below does at least one transaction's work before it looks at the clock,
    # so a round always moves on, however short its budget.
    while True:
        with db.write() as s:
            rows = s.execute(
                select(Job.id, Job.log_size)
                .where(_due(Job.log_dropped_at, cutoff))
                .order_by(Job.finished_at)
                .limit(BATCH_JOBS)
            ).all()
            if not rows:
                return True
            ids = _within_log_bytes(rows)
            s.execute(delete(LogChunk).where(LogChunk.job_id.in_(ids)))
            s.execute(update(Job).where(Job.id.in_(ids)).values(log_dropped_at=utcnow()))
            out.logs += len(ids)
        if time.monotonic() >= deadline:
            return False


def _thin_metrics(
    db: Database, cutoff: datetime, max_points: int, deadline: float, out: Swept
) -> bool:
    while True:
        with db.read() as s:
            job_ids = list(
                s.scalars(
                    select(Job.id)
                    .where(_due(Job.metrics_swept_at, cutoff))
                    .order_by(Job.finished_at)
                    .limit(BATCH_JOBS)
                )
            )
        if not job_ids:
            return True
        # Most jobs hold no series longer than max_points: those with no more points
        # than that in all are marked at once, one short index probe each.
        with db.read() as s:
            many = [
                j
                for j in job_ids
                if s.scalar(_MORE_THAN, {"job_id": j, "n": max_points + 1}) > max_points
            ]
        few = sorted(set(job_ids) - set(many))
        if few:
            with db.write() as s:
                s.execute(update(Job).where(Job.id.in_(few)).values(metrics_swept_at=utcnow()))
            out.jobs += len(few)
        for job_id in many:
            if not _thin_job(db, job_id, max_points, deadline, out):
                return False  # the budget ran out inside the job: the next round goes on
            with db.write() as s:
                s.execute(update(Job).where(Job.id == job_id).values(metrics_swept_at=utcnow()))
            out.jobs += 1
            if time.monotonic() >= deadline:
                return False
        if time.monotonic() >= deadline:
            return False


def _thin_job(db: Database, job_id: int, max_points: int, deadline: float, out: Swept) -> bool:
    """Downsample each of the job's series; False if the budget ran out first. The job
    counts the points removed in the transaction that removes them."""
    with db.read() as s:
        names = series_names(s, job_id)
    for name in names:
        with db.read() as s:
            kept, whole, _ = pick_steps(s, job_id, name, 0, max_points)
        if whole:
            continue  # short enough: kept whole
        series = (MetricPoint.job_id == job_id, MetricPoint.name == name)
        # Key ranges of at most BATCH_ROWS points, each deleted in its own transaction.
        after = -1
        while True:
            with db.write() as s:
                end = s.scalar(
                    select(MetricPoint.step)
                    .where(*series, MetricPoint.step > after)
                    .order_by(MetricPoint.step)
                    .offset(BATCH_ROWS - 1)
                    .limit(1)
                )
                upto = MetricPoint.step <= end if end is not None else true()
                keep = [k for k in kept if k > after and (end is None or k <= end)]
                gone = s.execute(
                    delete(MetricPoint).where(
                        *series, MetricPoint.step > after, upto, MetricPoint.step.not_in(keep)
                    )
                )
                removed = max(0, cast(CursorResult[Any], gone).rowcount or 0)
                if removed:
                    s.execute(
                        update(Job)
                        .where(Job.id == job_id)
                        .values(metrics_thinned=Job.metrics_thinned + removed)
                    )
                out.points += removed
            if end is None:
                break
            after = end
            if time.monotonic() >= deadline:
                return False
    return True


# ---- the audit trail ----------------------------------------------------------------------


def _drop_audit(db: Database, cutoff: datetime, deadline: float, out: Swept) -> bool:
    removed, done = _delete_in_batches(
        db, AuditEvent, AuditEvent.at < cutoff, deadline, order_by=AuditEvent.at
    )
    out.audit += removed
    return done


# ---- the job purge ------------------------------------------------------------------------

# What hangs off a job, deleted before its row in transactions of at most BATCH_ROWS
# rows each (the foreign keys' ON DELETE CASCADE would do it in one, unbounded). Log
# chunks go apart, by bytes (_within_log_bytes), as the log rule deletes them.
_CHILDREN: tuple[type[Any], ...] = (MetricPoint, GpuSample, Checkpoint, JobNode, Attempt)


# Added to accounting's rollup (service.rollup), the job and each of its attempts: a
# purge never takes what the month's totals have still to count.
_ROLLED = Job.rolled.is_(True) & ~exists().where(
    Attempt.job_id == Job.id, Attempt.rolled.is_(False)
)


def _purgeable(cutoff: datetime, outputs: OutputsLimits) -> ColumnElement[bool]:
    return (
        Job.finished_at.is_not(None)
        & (Job.finished_at < cutoff)
        & Job.status.in_(TERMINAL)
        & expired(outputs)
        & settled()
        & _ROLLED
    )


def _purge(
    db: Database, cutoff: datetime, outputs: OutputsLimits, deadline: float, out: Swept
) -> bool:
    # Every condition of a due job stays true once true (an ended job's row no longer
    # changes; its checkpoints only go; a job outside its owner's newest stays outside,
    # and the purge deletes none of the newest), so deciding in one transaction and
    # deleting in the next ones is safe; the jobs' delete checks again all the same.
    while True:
        with db.read() as s:
            rows = s.execute(
                select(Job.id, case((Job.log_dropped_at.is_(None), Job.log_size), else_=0))
                .where(_purgeable(cutoff, outputs))
                .order_by(Job.finished_at, Job.id)
                .limit(BATCH_JOBS)
            ).all()
        if not rows:
            return True
        ids = _within_log_bytes(rows)
        with db.write() as s:
            s.execute(delete(LogChunk).where(LogChunk.job_id.in_(ids)))
        for model in _CHILDREN:
            if not _delete_children(db, model, ids, deadline):
                return False
        with db.write() as s:
            gone = s.execute(
                delete(Job).where(Job.id.in_(ids), _purgeable(cutoff, outputs)),
                execution_options={"synchronize_session": False},
            )
            out.purged += _count(gone)
        if time.monotonic() >= deadline:
            return False


def _delete_children(db: Database, model: type[Any], ids: list[int], deadline: float) -> bool:
    """Delete the rows of ``model`` of the jobs ``ids``, BATCH_ROWS a transaction; False
    if the budget ran out first."""
    return _delete_in_batches(db, model, model.job_id.in_(ids), deadline)[1]


def _delete_in_batches(
    db: Database,
    model: type[Any],
    where: ColumnElement[bool],
    deadline: float,
    order_by: Any = None,
) -> tuple[int, bool]:
    """Delete the rows of ``model`` that ``where`` holds for, BATCH_ROWS a transaction
    (in ``order_by``'s order, if given); how many went, and False if the budget ran out
    first."""
    key = list(model.__table__.primary_key.columns)
    total = 0
    while True:
        with db.write() as s:
            some = select(*key).where(where)
            if order_by is not None:
                some = some.order_by(order_by)
            some = some.limit(BATCH_ROWS)
            which = key[0].in_(some) if len(key) == 1 else tuple_(*key).in_(some)
            removed = _count(
                s.execute(
                    delete(model).where(which), execution_options={"synchronize_session": False}
                )
            )
        total += removed
        if removed < BATCH_ROWS:
            return total, True
        if time.monotonic() >= deadline:
            return total, False


def _count(result: Any) -> int:
    return max(0, cast(CursorResult[Any], result).rowcount or 0)
