"""The job state machine: submit, read, cancel, finish, and what ranks report.

Route handlers stay thin and call these; each function is one transaction.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any, cast

from sqlalchemy import Table, bindparam, func, or_, select, text, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import checkpoints, code, queue, users
from service.db import Database, Policy
from service.errors import Conflict, Forbidden, Invalid, NotFound, TooMany
from service.models import (
    TERMINAL,
    Attempt,
    Checkpoint,
    Job,
    JobStatus,
    utcnow,
)
from service.queue import states
from service.queue.rules import policy_of
from service.queue.states import Event
from service.schemas import (
    CheckpointIn,
    CheckpointPublic,
    FinishRequest,
    JobPublic,
    JobSpec,
    JobSpecPublic,
    LatestMetrics,
)
from service.users import Principal
from service.wakeup import Wake

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


# Queued jobs ahead of one (a submit's answer, GET /jobs/{id} of a queued job).
_AHEAD = (
    select(func.count())
    .select_from(_JOBS)
    .where(
        _JOBS.c.status == JobStatus.QUEUED,
        queue.at_or_ahead(bindparam("priority"), bindparam("share"), bindparam("job_id")),
        _JOBS.c.id != bindparam("job_id"),
    )
)


# ---- reading -----------------------------------------------------------------------


def _queue_positions(s: Session, jobs: list[Job]) -> dict[int, int]:
    """1-based places in the claim order (queue.rules.ORDER) of queued jobs."""
    queued = [j for j in jobs if j.status == JobStatus.QUEUED]
    if len(queued) > 1:
        # One pass over the queue instead of one count per job on a page.
        order = func.row_number().over(order_by=queue.ORDER)
        ranked = select(Job.id, order.label("pos")).where(Job.status == JobStatus.QUEUED).subquery()
        wanted = [j.id for j in queued]
        rows = s.execute(select(ranked.c.id, ranked.c.pos).where(ranked.c.id.in_(wanted)))
        return {job_id: int(pos) for job_id, pos in rows}
    positions: dict[int, int] = {}
    for job in queued:
        params = {"priority": job.priority, "share": job.share, "job_id": job.id}
        ahead = s.connection().execute(_AHEAD, params).scalar()
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
    checkpoints: dict[int, Any] = {}
    started = [j for j in jobs if j.attempt]  # a job never started has no checkpoint
    if len(started) == 1:  # GET /jobs/{id} and every state change: the prebuilt statement
        c = s.connection().execute(_NEWEST_CHECKPOINT, {"job_id": started[0].id}).first()
        checkpoints = {c.job_id: c} if c else {}
    elif started:
        newest = (
            select(func.max(Checkpoint.id))
            .where(Checkpoint.job_id.in_([j.id for j in started]))
            .group_by(Checkpoint.job_id)
        )
        checkpoints = {
            c.job_id: c for c in s.scalars(select(Checkpoint).where(Checkpoint.id.in_(newest)))
        }
    policy = policy_of(s)
    positions = _queue_positions(s, jobs)
    pending = queue.pending_reasons(s, [j for j in jobs if j.status == JobStatus.QUEUED], positions)
    snapshots = code.summaries(s, (j.code for j in jobs))
    external = _external_ids(s, jobs)
    out = []
    for j in jobs:
        c = checkpoints.get(j.id)
        out.append(
            JobPublic(
                id=j.id,
                name=j.name,
                status=JobStatus(j.status),
                spec=JobSpecPublic.model_validate(j.spec),
                created_at=j.created_at,
                started_at=j.started_at,
                finished_at=j.finished_at,
                attempt=j.attempt,
                exit_code=j.exit_code,
                reason=_with_history(pending.get(j.id), j.reason),
                worker=j.worker,
                gpus=j.gpus,
                latest_metrics=LatestMetrics(**j.latest_metrics) if j.latest_metrics else None,
                latest_checkpoint=_latest(c, j, policy) if c else None,
                queue_position=positions.get(j.id),
                metrics_dropped=j.metrics_dropped or 0,
                metrics_downsampled=j.metrics_thinned or 0,
                metrics_downsampled_at=j.metrics_swept_at if j.metrics_thinned else None,
                log_dropped_at=j.log_dropped_at,
                owner=j.owner,
                priority=j.priority,
                code=snapshots.get(j.code) if j.code else None,
                total_steps=j.total_steps,
                external_id=external.get(j.id),
            )
        )
    return out


def _latest(c: Any, job: Job, policy: Policy) -> CheckpointPublic:
    return checkpoints.public(c, checkpoints.expires_at(c, job.status, job.finished_at, policy))


def _external_ids(s: Session, jobs: list[Job]) -> dict[int, str]:
    """The scheduler's id (a Slurm job id) of each job's current attempt, where a bridge
    gave it one."""
    current = [(j.id, j.attempt) for j in jobs if j.attempt > 0]
    if not current:
        return {}
    # The job ids beside the (job, number) pairs: SQLite reads a row-value IN through no
    # index and scanned every attempt (160-185 ms a page with 1.12 M of them,
    # bench/history.py); with job_id IN (...) it searches (job_id, number).
    rows = s.execute(
        select(Attempt.job_id, Attempt.external_id).where(
            Attempt.job_id.in_([job_id for job_id, _ in current]),
            tuple_(Attempt.job_id, Attempt.number).in_(current),
            Attempt.external_id.is_not(None),
        )
    )
    return {job_id: str(external) for job_id, external in rows}


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


def lock(s: Session, job_id: int) -> Job:
    """The job's row, locked for a move (``_get`` says the lock order); NotFound if none."""
    return _get(s, job_id, lock=True)


def public(s: Session, job: Job) -> JobPublic:
    """A job as the API shows it, read in the caller's transaction."""
    s.flush()
    return _publics(s, [job])[0]


def get_job(db: Database, job_id: int) -> JobPublic:
    with db.read() as s:
        row = s.connection().execute(_JOB_ROW, {"job_id": job_id}).first()
        if row is None:
            # No tombstone is kept of a purged job (a row per job would grow as the jobs
            # did): with the purge on, a missing job is told how it may have gone.
            purge = db.policy.job_retention_s
            if purge is None:
                raise NotFound(f"no job {job_id}")
            raise NotFound(
                f"no job {job_id}: it may have been purged (jobs that ended more than "
                f"DDPQ_JOB_RETENTION={checkpoints.duration_words(purge)} ago are deleted)"
            )
        return _publics(s, [cast(Job, row)])[0]


_CUSTOM_PLAN = text("SET LOCAL plan_cache_mode = force_custom_plan")


def list_jobs(
    db: Database,
    statuses: list[str],
    limit: int,
    cursor: int | None,
    name: str | None = None,
    owner: str | None = None,
) -> tuple[list[JobPublic], str | None]:
    """Newest first; ``cursor`` is the id the previous page ended at; ``name``, a text
    the job's name or program (recipe or entrypoint) contains, in any case; ``owner``,
    whose jobs."""
    q = select(Job).order_by(Job.id.desc()).limit(limit + 1)
    if statuses:
        q = q.where(Job.status.in_(statuses))
    if owner is not None:
        q = q.where(Job.owner == owner)
    if name:
        program = func.coalesce(
            Job.spec["recipe"].as_string(), Job.spec["entrypoint"].as_string(), ""
        )
        q = q.where(
            or_(
                func.coalesce(Job.name, "").icontains(name, autoescape=True),
                program.icontains(name, autoescape=True),
            )
        )
    if cursor is not None:
        q = q.where(Job.id < cursor)
    with db.read() as s:
        if name and db.dialect == "postgresql":
            # Plan for this pattern, never a generic plan of a prepared statement (psycopg
            # prepares a query on its 5th run): in one, the filter's constants ('', the
            # spec's keys) are parameters, so it matches no expression of the trigram
            # index (migration 0026), and a rare name and a common one need opposite
            # plans (the index, or a walk of the newest jobs until a page is full).
            s.execute(_CUSTOM_PLAN)
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
    db: Database,
    spec: JobSpec,
    idempotency_key: str | None,
    strict: bool = False,
    owner: str | None = None,
    admin: bool = False,
) -> JobPublic:
    """Queue ``spec`` as ``owner``'s (an ``admin`` has no priority cap). Forbidden (and
    audited) for a priority above a member's cap; TooMany past their queued limit."""
    try:
        return _submit(db, spec, idempotency_key, strict, owner, admin)
    except Forbidden as refused:
        users.audit_refused(db, owner, "submit", "job", str(refused))
        raise


def _submit(
    db: Database,
    spec: JobSpec,
    idempotency_key: str | None,
    strict: bool,
    owner: str | None,
    admin: bool,
) -> JobPublic:
    digest = _request_hash(spec) if idempotency_key is not None else None
    if idempotency_key is not None:
        existing = _replay(db, idempotency_key, digest, owner)
        if existing is not None:
            return existing
    try:
        with db.write() as s:
            job = queue_job(s, spec, owner, admin, strict, idempotency_key, digest)
            public = _publics(s, [job])[0]
    except IntegrityError:
        # Another request with the same key won the race; answer with its job.
        if idempotency_key is not None:
            existing = _replay(db, idempotency_key, digest, owner)
            if existing is not None:
                return existing
        raise
    if db.policy.preemption != "off":
        # Room made for it at once, if it outranks and may: a transaction of its own,
        # which marks other owners' running jobs, never under this owner's lock.
        queue.preempt_sweep(db)
    return public


def queue_job(
    s: Session,
    spec: JobSpec,
    owner: str | None,
    admin: bool,
    strict: bool = False,
    idempotency_key: str | None = None,
    digest: str | None = None,
) -> Job:
    """Insert ``spec`` queued as ``owner``'s in the caller's write transaction (a submit's,
    or a sweep's as it makes a trial: service.sweeps), audited, its claimers woken as it
    commits. Forbidden over a member's priority cap, TooMany past their queued limit. It
    takes the owner's lock when they have limits: the caller locks no job row after it
    (service.queue.quotas)."""
    now = utcnow()
    # What it waits for, first: those rows are read FOR SHARE before any other lock,
    # then the checkpoint it starts from, FOR UPDATE (service.queue.forks).
    unmet = queue.dependencies_unmet(s, spec.after)
    source = queue.fork_source_of(s, spec.from_checkpoint)
    if source is not None and spec.from_checkpoint is not None:
        # Stored with the step it starts from, whichever way it was asked for.
        spec = spec.model_copy(
            update={
                "from_checkpoint": spec.from_checkpoint.model_copy(update={"step": source.step})
            }
        )
    job = Job(
        name=spec.name,
        **states.submitted(),
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
        code=spec.code,
        owner=owner,
    )
    # Fair share (its place among equals) and its owner's quota, read at once.
    job.share, limits = queue.usage_and_limits(s, owner, now)
    if limits.max_queued is not None or limits.holds_back:
        # Counted, and flagged, under the owner's lock: two submits at once each
        # counted without the other's job (service.queue.quotas).
        queue.lock_owner(s, owner)
    if not admin:
        within_priority_cap(spec.priority, owner, limits)
    _within_queued_limit(s, owner, limits)
    if spec.code is not None:
        code.use(s, spec.code, spec.entrypoint)
    if strict:
        problem = queue.unschedulable(s, job)
        if problem:
            raise Conflict(f"{problem} (strict=true: not queued)")
    s.add(job)
    s.flush()
    queue.record_dependencies(s, job, unmet)
    queue.record_fork(s, job, source, now)
    program = spec.recipe or spec.entrypoint
    users.audit(s, owner, "submit", f"job {job.id}", {"program": program})
    if limits.holds_back:  # held back from the start if it must be
        # (With no running limit, every queued job of the owner's is unflagged
        # already: a limit set or lifted refreshes them all. A round trip saved.)
        queue.refresh_quota_flags(s, owner, locked=True)
    # Shaped: only polls with room for it are woken, and no other's memory that nothing
    # fits it is forgotten for it (service.wakeup).
    shape = Wake(device=job.device, nproc=job.nproc_per_node, nnodes=job.nnodes, job=job.id)
    queue.notify_claimers(s, shape)
    return job


def within_priority_cap(priority: int, owner: str | None, limits: queue.Limits) -> None:
    """Forbidden (403) if a member asks for a priority above their cap: with preemption
    on, a member's priority is how far they may push others' jobs out, so raising it is
    an admin's grant (as Slurm's QOS is), never the member's own pick."""
    cap = limits.max_priority
    if owner is None or cap is None or priority <= cap:
        return
    raise Forbidden(
        f"priority {priority} is above {owner}'s cap of {cap} (quota max_priority): a "
        f"member may lower a job's priority freely and raise it up to the cap an admin "
        f"sets (ddpq quota set {owner} --max-priority N)"
    )


def _within_queued_limit(s: Session, owner: str | None, limits: queue.Limits) -> None:
    """TooMany (429) if ``owner`` has as many jobs queued as their ``limits`` allow."""
    limit = limits.max_queued
    if owner is None or limit is None:
        return
    waiting = queue.queued_count(s, owner)
    if waiting >= limit:
        raise TooMany(
            f"{owner} has {waiting} jobs queued, their limit (quota max_queued {limit}): "
            "submit more once some have started, or ask an admin to raise it"
        )


def _replay(db: Database, key: str, digest: str | None, owner: str | None) -> JobPublic | None:
    with db.read() as s:
        job = s.scalar(select(Job).where(Job.idempotency_key == key))
        if job is None:
            return None
        if job.owner != owner:
            # Keys are one space for the whole API: another user's is not a replay.
            raise Conflict(f"Idempotency-Key {key!r} was already used by another user")
        if job.request_hash != digest:
            raise Conflict(
                f"Idempotency-Key {key!r} was already used for job {job.id} with a different body"
            )
        return _publics(s, [job])[0]


def canceller(by: Principal | None, owner: str | None) -> str:
    """Who cancels a job, as its reason names them: ``bob`` (its owner), ``alice
    (admin)`` (anyone else's), ``ddpq`` (nobody's request)."""
    if by is None:
        return "ddpq"
    return by.name if by.name == owner else f"{by.name} ({by.role})"


def cancel_job(db: Database, job_id: int, by: Principal | None = None) -> JobPublic:
    """Queued jobs are cancelled at once; running ones once their worker confirms. A
    member cancels only its own jobs (Forbidden, naming the owner, and audited); an
    admin, any."""
    now = utcnow()
    refused: Forbidden | None = None
    with db.write() as s:
        job = _get(s, job_id, lock=True)
        why = not_theirs(job, by, "cancel") if by is not None else None
        if why is not None:
            refused = Forbidden(why)
        else:
            cancel(s, job, by, now)
            s.flush()
            return _publics(s, [job])[0]
    # Audited in a transaction of its own: the refusal changes nothing else.
    users.audit_refused(db, by.name if by else None, "cancel", f"job {job_id}", str(refused))
    raise refused


def not_theirs(job: Job, by: Principal, action: str) -> str | None:
    """Why ``by`` may not ``action`` ``job`` (a member acts on their own jobs only; an
    admin on any), or None."""
    if by.admin or job.owner == by.name:
        return None
    whose = f"{job.owner}'s" if job.owner else "from before users existed"
    return (
        f"job {job.id} is {whose}: only its owner or an admin may {action} it "
        f"({by.name} is a member)"
    )


def cancel_locked(s: Session, job_id: int, why: str, by: Principal | None = None) -> bool:
    """Cancel job ``job_id`` in the caller's transaction, its row locked here (a sweep's
    trial pruned, or its sweep cancelled: service.sweeps), for ``why``. False if it had
    ended or was being cancelled already."""
    job = _get(s, job_id, lock=True)
    if job.status in TERMINAL:
        return False
    return cancel(s, job, by, utcnow(), why)


def cancel(s: Session, job: Job, by: Principal | None, now: Any, why: str | None = None) -> bool:
    """Cancel ``job`` (its row locked by the caller) in the caller's transaction, in
    ``by``'s name and for ``why`` (both in its reason), audited. False if it was being
    cancelled already; Conflict (409) if it has ended."""
    move = states.move(job.id, job.status, Event.CANCEL)
    if move.source == move.target:
        return False  # asked again: nothing more to do
    who = canceller(by, job.owner)
    cancelled_by = f"{who}: {why}" if why else who
    if move.target == JobStatus.CANCELLED:
        # Not running: queued or held, which a job that ran may be again (a retry, a
        # trial its sweep paused).
        when = "before it started" if job.attempt == 0 else f"while {job.status}"
        reason = f"cancelled by {who} {when}" + (f": {why}" if why else "")
    else:  # its worker stops the processes; the reason it ends with: queue.leases
        reason = f"cancel requested by {cancelled_by}; stopping its processes"
    users.audit(
        s, who if by is None else by.name, "cancel", f"job {job.id}", {"status": job.status}
    )
    states.enter(job, Event.CANCEL, now, reason, cancelled_by=cancelled_by)
    if move.target == JobStatus.CANCELLED:  # what waited for it: met (any) or never (ok)
        states.settle_dependents(s, job.id, move.target, now)
    if move.source == JobStatus.QUEUED:
        # A queued job gone may let others start: one every worker had to wait behind
        # (a starving head, a gang's), or a gang's held node slots. Every API process's
        # claimers look again. A running job's slots are freed by its finish, which
        # wakes whom it concerns.
        queue.notify_claimers(s)
    return True


# ---- the worker's side ----------------------------------------------------------------


def finish_attempt(db: Database, job_id: int, worker: str, req: FinishRequest) -> JobPublic:
    """Record how an attempt ended and move the job on (queue.end_attempt). Safe to repeat."""
    with db.write() as s:
        # The job row locked first: a cancel, a lost lease or another node's finish may
        # race this one, and the nodes of a multi-node attempt finish together (two
        # finishes that each saw the other node still running would leave the attempt
        # open until its lease ran out).
        job = _get(s, job_id, lock=True)
        queue.end_attempt(s, job, worker, req, db.policy)
        s.flush()
        return _publics(s, [job])[0]


# ---- what ranks report ----------------------------------------------------------------


def current_job(s: Session, attempt: Attempt) -> Job:
    """The attempt's job, its row locked, while the attempt is still its current one
    (Conflict otherwise). Fencing is re-checked inside the write: the token was checked
    in an earlier transaction, and a finish committing meanwhile must not let reports
    in for an attempt that has ended."""
    job = _get(s, attempt.job_id, lock=True)
    stale = queue.fenced(attempt.number, False, job.attempt, job.status)
    if stale:
        raise Conflict(f"job {job.id}: {stale}")
    return job


def register_checkpoint(db: Database, attempt: Attempt, body: CheckpointIn) -> CheckpointPublic:
    """Record a checkpoint file; its path must lie inside the attempt's checkpoint
    directory. What it lets go is service.checkpoints'."""
    path = posixpath.normpath(body.path)
    root = posixpath.normpath(attempt.checkpoint_dir)
    if not path.startswith(root + "/"):
        raise Invalid(("body", "path"), f"must be inside the job's checkpoint directory {root}")
    with db.write() as s:
        job = current_job(s, attempt)
        return checkpoints.public(checkpoints.register(s, job, attempt, path, body, db.policy))
