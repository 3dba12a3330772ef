"""The job state machine: submit, read, cancel, finish, and what ranks report.

Route handlers stay thin and call these; each function is one transaction.
"""

from __future__ import annotations

import hashlib
import json
import operator
import posixpath
import signal
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, and_, bindparam, func, or_, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import logs, queue
from service.db import Database
from service.errors import Conflict, Invalid, NotFound
from service.models import (
    TERMINAL,
    Attempt,
    Checkpoint,
    Job,
    JobNode,
    JobStatus,
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
    MetricsIn,
    metric_in,
    metric_out,
)

# Statements of the hot paths (GET /jobs/{id}, every report), built once: building a
# statement and its cache key cost more than running it on SQLite (Session.get too
# builds its own on every call).
# Reads that change nothing take Core rows (which have the same attributes as the
# objects): the ORM's per-object bookkeeping cost more than the queries themselves.
_JOB_BY_ID = select(Job).where(Job.id == bindparam("job_id"))
_JOBS = cast(Table, Job.__table__)
_CHECKPOINTS = cast(Table, Checkpoint.__table__)
_JOB_ROW = select(_JOBS).where(_JOBS.c.id == bindparam("job_id"))
_NEWEST_CHECKPOINT = (
    select(_CHECKPOINTS)
    .where(_CHECKPOINTS.c.job_id == bindparam("job_id"))
    .order_by(_CHECKPOINTS.c.id.desc())
    .limit(1)
)


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
    checkpoints: dict[int, Any]
    if len(jobs) == 1:  # GET /jobs/{id} and every state change: the prebuilt statement
        c = s.connection().execute(_NEWEST_CHECKPOINT, {"job_id": jobs[0].id}).first()
        checkpoints = {c.job_id: c} if c else {}
    else:
        newest = (
            select(func.max(Checkpoint.id))
            .where(Checkpoint.job_id.in_([j.id for j in jobs]))
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
                metrics_dropped=j.metrics_dropped or 0,
            )
        )
    return out


def _get(s: Session, job_id: int, lock: bool = False) -> Job:
    """The job's row; ``lock`` reads it ``FOR UPDATE`` (Postgres; SQLite serialises
    writers anyway) so a transition decides on the row it changes: of two racing
    transitions (a cancel and a finish, a cancel and a claim) exactly one wins, and the
    other sees its result. Lock order everywhere: job rows by ascending id, then their
    attempts, then workers."""
    query = _JOB_BY_ID
    if lock:
        query = query.with_for_update().execution_options(populate_existing=True)
    job = s.scalars(query, {"job_id": job_id}).first()
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def get_job(db: Database, job_id: int) -> JobPublic:
    with db.read() as s:
        row = s.connection().execute(_JOB_ROW, {"job_id": job_id}).first()
        if row is None:
            raise NotFound(f"no job {job_id}")
        return _publics(s, [cast(Job, row)])[0]


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
    digest = _request_hash(spec) if idempotency_key is not None else None
    if idempotency_key is not None:
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
        if idempotency_key is not None:
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
        job = _get(s, job_id, lock=True)
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


def append_log(
    db: Database, job_id: int, number: int, worker: str, offset: int, data: bytes
) -> int:
    """Append a chunk of an attempt's output (service.logs: offsets, the cap)."""
    return logs.append(db, job_id, number, worker, offset, data)


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
        # The job row locked first: a cancel, a lost lease or another node's finish may
        # race this one, and the nodes of a multi-node attempt finish together (two
        # finishes that each saw the other node still running would leave the attempt
        # open until its lease ran out).
        job = _get(s, job_id, lock=True)
        attempt = s.scalar(
            select(Attempt).where(Attempt.job_id == job_id, Attempt.number == req.attempt)
        )
        node = queue.node_of(s, job_id, req.attempt, worker) if job.nnodes > 1 else None
        if attempt is None or (attempt.worker != worker and node is None):
            raise Conflict(f"job {job_id} has no attempt {req.attempt} on worker {worker}")
        if job.attempt != req.attempt:
            raise Conflict(f"attempt {req.attempt} was superseded by attempt {job.attempt}")
        if attempt.outcome == "lost":
            raise Conflict(f"attempt {req.attempt} was declared lost: {job.reason}")
        if node is not None and node.ended_at is None:
            node.ended_at = now
            node.exit_code = req.exit_code
            node.outcome = req.outcome
        if attempt.ended_at is not None:
            # A retried finish, or a node that stopped after its attempt ended.
            return _publics(s, [job])[0]
        if node is not None and _other_nodes_run_on(s, job, req, node):
            # A node that ended well (or stopped on cancel): the attempt goes on
            # until every node has.
            s.flush()
            return _publics(s, [job])[0]
        where = f" on node {node.node_rank} (worker {worker})" if node is not None else ""
        attempt.ended_at = now
        attempt.exit_code = req.exit_code
        job.exit_code = req.exit_code
        code = req.exit_code
        retryable = req.outcome == "exited" and code is not None and code != 0
        if retryable and code is not None and code < 128:
            # A multi-node attempt is retried whatever a node's exit code: when one
            # node is lost, the ranks of the others fail with their own error.
            retryable = bool(job.spec.get("retry_on_error")) or job.nnodes > 1
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
            what += where
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
        attempt.reason = job.reason  # kept per attempt: the job's reason moves on
        s.flush()
        queue.notify_claimers(s)  # its slots are free, or it is queued again
        return _publics(s, [job])[0]


def _other_nodes_run_on(s: Session, job: Job, req: FinishRequest, node: JobNode) -> bool:
    """Whether a multi-node attempt waits for its other nodes after ``node`` ended: it
    does when this node succeeded or stopped on a cancel and another has not ended.
    A failure (or a shutdown handback) ends the attempt for every node at once."""
    cancelling = job.status == JobStatus.CANCELLING or req.outcome == "cancelled"
    succeeded = req.outcome == "exited" and req.exit_code == 0
    if not (cancelling or succeeded):
        return False
    # The others ended too (a node's failure would have ended the attempt at once,
    # so they ended well): this node's finish ends the attempt.
    others = [n for n in queue.nodes_of(s, job.id, req.attempt) if n.id != node.id]
    return any(n.ended_at is None for n in others)


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


_POINTS = cast(Table, MetricPoint.__table__)
_POINT_COLUMNS = ("job_id", "name", "step", "value", "epoch", "attempt", "time", "seq")
_points_upsert: dict[str, tuple[str, tuple[str, ...]]] = {}


def _points_upsert_sql(dialect: Dialect) -> tuple[str, tuple[str, ...]]:
    """The upsert of metric points as SQLite's driver takes it, compiled once, and the
    order of its positional parameters.

    A batch of 1000 items is thousands of rows: through SQLAlchemy's per-row
    parameter processing they cost several times SQLite's own work, so they go to
    the driver's executemany as plain values (see _upsert_points)."""
    cached = _points_upsert.get(dialect.name)
    if cached is None:
        insert = sqlite_insert(_POINTS)
        stmt = insert.on_conflict_do_update(
            index_elements=["job_id", "name", "step"],
            set_={
                "value": insert.excluded.value,
                "epoch": insert.excluded.epoch,
                "attempt": insert.excluded.attempt,
                "time": insert.excluded.time,
                "seq": insert.excluded.seq,
            },
            where=_POINTS.c.attempt <= insert.excluded.attempt,
        )
        compiled = stmt.compile(dialect=dialect, column_keys=list(_POINT_COLUMNS))
        order = tuple(compiled.positiontup or ())
        if set(order) != set(_POINT_COLUMNS):
            raise RuntimeError(f"unexpected parameters in the points upsert: {compiled.binds}")
        cached = _points_upsert.setdefault(dialect.name, (compiled.string, order))
    return cached


# Postgres: one statement over arrays (executemany would be a round trip per row).
_PG_POINTS_UPSERT = """
INSERT INTO metric_points (job_id, name, step, value, epoch, attempt, time, seq)
SELECT %(job_id)s, n, s, v, e, %(attempt)s, %(time)s, %(seq)s
FROM unnest(%(names)s::varchar[], %(steps)s::bigint[], %(values)s::float8[], %(epochs)s::float8[])
    AS t(n, s, v, e)
ON CONFLICT (job_id, name, step) DO UPDATE SET
    value = excluded.value, epoch = excluded.epoch, attempt = excluded.attempt,
    time = excluded.time, seq = excluded.seq
WHERE metric_points.attempt <= excluded.attempt
"""


def _upsert_points(
    s: Session,
    attempt: Attempt,
    now: datetime,
    seq: int,
    rows: list[tuple[str, int, float, float | None]],
) -> None:
    if not rows:
        return
    conn = s.connection()
    dialect = conn.dialect
    if dialect.name == "postgresql":
        names, steps, values, epochs = (list(column) for column in zip(*rows, strict=True))
        conn.exec_driver_sql(
            _PG_POINTS_UPSERT,
            {
                "job_id": attempt.job_id,
                "attempt": attempt.number,
                "time": now,
                "seq": seq,
                "names": names,
                "steps": steps,
                "values": values,
                "epochs": epochs,
            },
        )
        return
    sql, order = _points_upsert_sql(dialect)
    # The one column that needs converting (the timestamp, a string on SQLite) is the
    # same in every row: converted once. The rest are str, int, float and None.
    stamp = _POINTS.c.time.type.dialect_impl(dialect).bind_processor(dialect)
    stamped = stamp(now) if stamp else now
    job_id, number = attempt.job_id, attempt.number
    full = [
        (job_id, name, step, value, epoch, number, stamped, seq)
        for name, step, value, epoch in rows
    ]
    params: list[Any] = full
    if order != _POINT_COLUMNS:
        pick = operator.itemgetter(*(_POINT_COLUMNS.index(k) for k in order))
        params = [pick(row) for row in full]
    conn.exec_driver_sql(sql, params)


def ingest_metrics(db: Database, attempt: Attempt, body: MetricsIn) -> int:
    """Store metric points; a step reported again keeps the newest attempt's value.
    Points the sender says it dropped are counted on the job."""
    now = utcnow()
    rows: dict[tuple[str, int], tuple[str, int, float, float | None]] = {}
    for item in body.items:
        epoch = metric_in(item.epoch) if item.epoch is not None else None
        for name, value in item.values.items():
            rows[(name, item.step)] = (name, item.step, metric_in(value), epoch)
    with db.write() as s:
        # Locked before the check: a finish committing meanwhile would otherwise let
        # points in for an attempt that has ended, and latest_metrics is read-modify-write.
        job = _get(s, attempt.job_id, lock=True)
        _still_current(job, attempt)
        if body.dropped:
            job.metrics_dropped = (job.metrics_dropped or 0) + body.dropped
        if not rows:
            return 0
        # Number the batch in the database, so batches commit in seq order: the events
        # stream's cursor never skips one.
        seq = s.scalar(
            update(Job)
            .where(Job.id == job.id)
            .values(metrics_seq=Job.metrics_seq + 1)
            .returning(Job.metrics_seq)
        )
        _upsert_points(s, attempt, now, int(seq or 0), list(rows.values()))
        last = max(body.items, key=lambda i: i.step)
        latest_values = {
            name: metric_out(metric_in(v))
            for item in body.items
            if item.step == last.step
            for name, v in item.values.items()
        }
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
        _still_current(_get(s, attempt.job_id, lock=True), attempt)
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
