"""History retention: what of an ended job's history stays as it ages.

A year of finished jobs must not cost the database what they cost while they ran
(bench/history.py measures it). Two rules, run by the API's sweeper in bounded
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

GPU samples need no rule here: a job keeps O(log(its age)) of them per GPU (service.gpus).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, delete, select, text, true, update
from sqlalchemy.orm import InstrumentedAttribute

from service.db import Database
from service.metrics import pick_steps, series_names
from service.models import TERMINAL, Job, LogChunk, MetricPoint, utcnow

# Rows one transaction deletes at most.
BATCH_ROWS = 20_000
# Log bytes one transaction deletes at most (at least one job's: a log is capped).
BATCH_LOG_BYTES = 16 * 1024 * 1024
# Jobs one transaction marks at most.
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


def _due(column: InstrumentedAttribute[datetime | None], cutoff: datetime) -> ColumnElement[bool]:
    # The partial indexes' predicate (models: ix_jobs_metrics_due, ix_jobs_log_due) and
    # the cutoff; the status test is for safety only (an ended job has a finished_at).
    return (
        Job.finished_at.is_not(None)
        & column.is_(None)
        & (Job.finished_at < cutoff)
        & Job.status.in_(TERMINAL)
    )


def sweep(db: Database, budget_s: float = 1.0) -> Swept:
    """One round of retention, for about ``budget_s`` of work."""
    policy = db.policy
    deadline = time.monotonic() + budget_s
    out = Swept()
    now = utcnow()
    if policy.log_retention_s is not None:
        out.done &= _drop_logs(db, now - timedelta(seconds=policy.log_retention_s), deadline, out)
    if policy.metrics_downsample_after_s is not None:
        cutoff = now - timedelta(seconds=policy.metrics_downsample_after_s)
        out.done &= _thin_metrics(db, cutoff, policy.metrics_downsample_points, deadline, out)
    return out


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
            ids: list[int] = []
            nbytes = 0
            for job_id, size in rows:
                if ids and nbytes + size > BATCH_LOG_BYTES:
                    break
                ids.append(job_id)
                nbytes += size
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
            kept, whole = pick_steps(s, job_id, name, 0, max_points)
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
