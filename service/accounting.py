"""Accounting: what jobs and their attempts held, and for how long, over a window (Slurm's
``sacct``; GET /accounting, ``ddpq acct``).

A job is in a window if it was in ddpq's hands in it: submitted before the window's end,
and not ended before its start (queued, held or running in it, or ended in it), as
sacct selects jobs in any state during its window; an attempt, if it ran in it. What is
counted is the time its attempts ran inside the window, and what each held for that
time (service.queue.shares.held: its GPUs, else its ranks' CPU slots), so the rows of
consecutive windows (a month, then the next) add up to the whole. An attempt still
running counts up to now. Rows come newest first, a page at a time. The totals are over
every row the query matches, not only the page shown: from the hourly rollup
(service.rollup) for a window asked for by user only, and otherwise added up by the
database from the rows themselves.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Float, Integer, Text, and_, bindparam, case, cast, func, or_, select, tuple_

from service import rollup
from service.db import Database
from service.models import Attempt, Job, UTCDateTime, utcnow
from service.schemas.accounting import AccountingPublic, AccountingRow, AccountingTotal
from service.sweeptables import SweepTrial


@dataclass(frozen=True)
class Query:
    """What GET /accounting asks (service.routes checked each field)."""

    since: datetime
    until: datetime
    per: str = "job"  # or "attempt"
    user: str | None = None
    states: tuple[str, ...] = ()
    worker: str | None = None
    sweep: int | None = None
    limit: int = 100
    cursor: int | None = None  # the last job id (per=job) or attempt id of the page before


def _ran_in(q: Query) -> list[Any]:
    """SQL: attempts that ran in the window (on the worker asked for)."""
    where = rollup.ran_in(q.since, q.until)
    if q.worker is not None:
        where.append(Attempt.worker == q.worker)
    return where


def _jobs_of(q: Query) -> list[Any]:
    """SQL: the jobs the query asks for (their user, state and sweep)."""
    where = []
    if q.user is not None:
        where.append(Job.owner == q.user)
    if q.states:
        where.append(Job.status.in_(q.states))
    if q.sweep is not None:
        where.append(Job.id.in_(select(SweepTrial.job_id).where(SweepTrial.sweep_id == q.sweep)))
    return where


def _in_window(q: Query) -> Any:
    """SQL: jobs in ddpq's hands in the window (asked for a worker: that ran on it there)."""
    if q.worker is not None:
        return Job.id.in_(select(Attempt.job_id).where(*_ran_in(q)))
    return rollup.alive_in(q.since, q.until)


# SQL: 1 for an attempt handed back for another job (queue.leases), else 0.
_PREEMPTED = case((Attempt.reason.like(rollup.PREEMPTED), 1), else_=0)


@functools.cache
def _use(dialect: str) -> tuple[Any, Any, Any]:
    """SQL: an attempt's seconds run inside the window (bound ``since`` and ``end``: the
    window's end, or now if sooner), and the GPU-hours and CPU-slot-hours it held for
    them (what it holds: service.queue.shares.held, in SQL: a claim gives a GPU job one
    GPU a rank). The one place each figure is computed, for rows and totals alike."""
    since = bindparam("since", type_=UTCDateTime)
    end = bindparam("end", type_=UTCDateTime)
    seconds: Any
    if dialect == "postgresql":
        last = func.least(func.coalesce(Attempt.ended_at, end), end)
        seconds = func.extract("epoch", last - func.greatest(Attempt.started_at, since))
    else:  # SQLite: the same, on its datetimes as text (one format, so min/max compare)
        last = func.min(func.coalesce(Attempt.ended_at, end), end)
        seconds = _sqlite_seconds(func.max(Attempt.started_at, since), last)
    seconds = case((seconds > 0, seconds), else_=0.0)
    has_gpus = and_(Attempt.gpus.is_not(None), cast(Attempt.gpus, Text).not_in(("[]", "null")))
    ranks = Job.nproc_per_node * Job.nnodes
    gpus = case(
        (has_gpus, func.json_array_length(Attempt.gpus) * Job.nnodes),
        (Job.device == "cuda", ranks),
        else_=0,
    )
    cpus = case((or_(has_gpus, Job.device == "cuda"), 0), else_=ranks)
    return seconds, seconds * gpus / 3600.0, seconds * cpus / 3600.0


def _sqlite_seconds(a: Any, b: Any) -> Any:
    """SQL: seconds from ``a`` to ``b``, SQLite datetimes as text ('2026-11-29
    12:00:00.123456'), to the microsecond as Python and Postgres count them (the
    rollup's hours and a row's own must agree): whole seconds from strftime('%s'), the
    fraction from the text. julianday() was off by up to half a millisecond."""
    # strftime of the text without its fraction: SQLite rounds a fraction to milliseconds
    # first, and .9996 s made a whole second more.
    whole = cast(func.strftime("%s", func.substr(b, 1, 19)), Integer) - cast(
        func.strftime("%s", func.substr(a, 1, 19)), Integer
    )
    return whole + (cast(func.substr(b, 20), Float) - cast(func.substr(a, 20), Float))


def _params(q: Query, now: datetime) -> dict[str, Any]:
    return {"since": q.since, "end": min(q.until, now)}


@functools.cache
def _sums(dialect: str) -> tuple[Any, ...]:
    """SQL aggregates over attempts: how many, seconds, GPU-hours, CPU-slot-hours,
    preempted (built once: its expressions are bound, not literal)."""
    return (
        func.count(Attempt.id),
        *(func.coalesce(func.sum(figure), 0.0) for figure in _use(dialect)),
        func.coalesce(func.sum(_PREEMPTED), 0),
    )


def report(db: Database, q: Query) -> AccountingPublic:
    """The window's rows (a page of them) and every user's totals: a month of a busy
    year's attempts is never read row by row for them."""
    now = utcnow()
    params = _params(q, now)
    with db.read() as s:
        rollup.snapshot(s)
        if q.states or q.worker is not None or q.sweep is not None:
            per = _counted(s, db.dialect, q, params)
        else:  # by user or no one: what the rollup adds up
            found = rollup.totals(s, q.since, params["end"], q.user)
            per = {owner or None: f for owner, f in found.items()}
        if q.per == "attempt":
            items, more = _attempt_rows(s, db.dialect, q, params)
        else:
            items, more = _job_rows(s, db.dialect, q, params, now)
    return AccountingPublic(
        since=q.since,
        until=q.until,
        per=q.per,  # type: ignore[arg-type]
        items=items,
        next_cursor=more,
        totals=_totals(per),
    )


def _counted(
    s: Any, dialect: str, q: Query, params: dict[str, Any]
) -> dict[str | None, rollup.Figures]:
    """Every user's totals under a filter the rollup does not keep (a state, a worker, a
    sweep), added up by the database from the rows themselves."""
    per: dict[str | None, rollup.Figures] = defaultdict(rollup.Figures)
    sums = s.execute(
        select(Job.owner, *_sums(dialect))
        .join(Job, Job.id == Attempt.job_id)
        .where(*_ran_in(q), *_jobs_of(q))
        .group_by(Job.owner),
        params,
    )
    for owner, n, seconds, gpu_h, cpu_h, preempted in sums:
        f = per[owner]
        f.attempts, f.seconds, f.preempted = int(n), float(seconds), int(preempted)
        f.gpu_s, f.cpu_s = float(gpu_h) * 3600.0, float(cpu_h) * 3600.0
    jobs = select(Job.owner, func.count()).where(_in_window(q), *_jobs_of(q))
    for owner, n in s.execute(jobs.group_by(Job.owner)):
        per[owner].jobs = int(n)
    return per


# A page's jobs: what a row shows of each, not the whole job (its spec, its latest
# metrics: JSON decoded for nothing, 100 ORM objects built), and its sweep, if it is a
# trial (ix_sweep_trials_job_id is unique: a lookup a row, not a round trip more).
_PAGE_COLUMNS = (
    Job.id, Job.name, Job.owner, Job.status, Job.reason, Job.exit_code, Job.device,
    Job.nproc_per_node, Job.nnodes, Job.created_at, Job.finished_at,
    SweepTrial.sweep_id.label("sweep"),
)  # fmt: skip
_TRIAL = SweepTrial.job_id == Job.id


def _job_rows(
    s: Any, dialect: str, q: Query, params: dict[str, Any], now: datetime
) -> tuple[list[AccountingRow], str | None]:
    after: list[Any] = []  # the page before's last job, newest first
    if q.cursor is not None:
        at = select(Job.created_at).where(Job.id == q.cursor).scalar_subquery()
        after = [tuple_(Job.created_at, Job.id) < tuple_(at, q.cursor)]
    page = list(
        s.execute(
            select(*_PAGE_COLUMNS)
            .outerjoin(SweepTrial, _TRIAL)
            .where(_in_window(q), *_jobs_of(q), *after)
            .order_by(Job.created_at.desc(), Job.id.desc())
            .limit(q.limit + 1)
        )
    )
    more = str(page[q.limit - 1].id) if len(page) > q.limit else None
    page = page[: q.limit]
    ids = [job.id for job in page]
    # Every attempt of the page's jobs, in one statement: its first start, how many and
    # preempted are of all of them; what ran in the window (its figures, its workers) of
    # those that ran in it.
    first: dict[int, datetime] = {}
    count: dict[int, int] = defaultdict(int)
    preemptions: dict[int, int] = defaultdict(int)
    ran: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    workers: dict[int, set[str]] = defaultdict(set)
    if ids:
        rows = s.execute(
            select(
                Attempt.job_id, Attempt.started_at, Attempt.worker, _PREEMPTED,
                case((and_(*_ran_in(q)), 1), else_=0), *_use(dialect),
            )
            .join(Job, Job.id == Attempt.job_id)
            .where(Attempt.job_id.in_(ids)),
            params,
        )  # fmt: skip
        for job_id, started, worker, preempted, inside, seconds, gpu_h, cpu_h in rows:
            first[job_id] = min(first.get(job_id, started), started)
            count[job_id] += 1
            preemptions[job_id] += preempted
            if inside:
                figures = ran[job_id]  # Postgres' seconds are numeric: Decimal
                figures[0] += float(seconds)
                figures[1] += float(gpu_h)
                figures[2] += float(cpu_h)
                workers[job_id].add(worker)
    items = []
    for job in page:
        seconds, gpu_h, cpu_h = ran.get(job.id, (0.0, 0.0, 0.0))
        started = first.get(job.id)
        waited_until = started or min(job.finished_at or now, q.until, now)
        items.append(
            AccountingRow(
                job_id=job.id,
                attempt=None,
                name=job.name,
                user=job.owner,
                state=job.status,
                reason=job.reason,
                exit_code=job.exit_code,
                device=job.device,
                world_size=job.nproc_per_node * job.nnodes,
                workers=sorted(workers.get(job.id, ())),
                sweep=job.sweep,
                created_at=job.created_at,
                started_at=started,
                finished_at=job.finished_at,
                queued_s=max(0.0, (waited_until - job.created_at).total_seconds()),
                elapsed_s=float(seconds),
                gpu_hours=float(gpu_h),
                cpu_slot_hours=float(cpu_h),
                attempts=count.get(job.id, 0),
                preemptions=preemptions.get(job.id, 0),
            )
        )
    return items, more


def _attempt_rows(
    s: Any, dialect: str, q: Query, params: dict[str, Any]
) -> tuple[list[AccountingRow], str | None]:
    seconds, gpu_hours, cpu_hours = _use(dialect)
    after: list[Any] = []  # the page before's last attempt, newest first
    if q.cursor is not None:
        at = select(Attempt.started_at).where(Attempt.id == q.cursor).scalar_subquery()
        after = [tuple_(Attempt.started_at, Attempt.id) < tuple_(at, q.cursor)]
    page = list(
        s.execute(
            select(
                Attempt.id, Attempt.job_id, Attempt.number, Attempt.worker, Attempt.started_at,
                Attempt.ended_at, Attempt.outcome, Attempt.reason, Attempt.exit_code, Job.owner,
                Job.name, Job.device, Job.nproc_per_node, Job.nnodes, Job.created_at,
                seconds.label("seconds"), gpu_hours.label("gpu_hours"),
                cpu_hours.label("cpu_hours"), _PREEMPTED.label("preempted"),
                SweepTrial.sweep_id.label("sweep"),
            )
            .join(Job, Job.id == Attempt.job_id)
            .outerjoin(SweepTrial, _TRIAL)
            .where(*_ran_in(q), *_jobs_of(q), *after)
            .order_by(Attempt.started_at.desc(), Attempt.id.desc())
            .limit(q.limit + 1),
            params,
        )
    )  # fmt: skip
    more = str(page[q.limit - 1].id) if len(page) > q.limit else None
    page = page[: q.limit]
    items = []
    for a in page:
        items.append(
            AccountingRow(
                job_id=a.job_id,
                attempt=a.number,
                name=a.name,
                user=a.owner,
                state=a.outcome,
                reason=a.reason,
                exit_code=a.exit_code,
                device=a.device,
                world_size=a.nproc_per_node * a.nnodes,
                workers=[a.worker],
                sweep=a.sweep,
                created_at=a.created_at,
                started_at=a.started_at,
                finished_at=a.ended_at,
                queued_s=None,
                elapsed_s=float(a.seconds),
                gpu_hours=float(a.gpu_hours),
                cpu_slot_hours=float(a.cpu_hours),
                attempts=1,
                preemptions=int(a.preempted),
            )
        )
    return items, more


def _totals(per: dict[str | None, rollup.Figures]) -> list[AccountingTotal]:
    """Per user, most GPU-hours (then CPU-slot-hours) first, then everyone's."""
    out = [
        AccountingTotal(
            user=owner, jobs=f.jobs, attempts=f.attempts, elapsed_s=f.seconds,
            gpu_hours=f.gpu_s / 3600.0, cpu_slot_hours=f.cpu_s / 3600.0,
            preemptions=f.preempted,
        )
        for owner, f in per.items()
        if f.jobs or f.attempts
    ]  # fmt: skip
    out.sort(key=lambda t: (-t.gpu_hours, -t.cpu_slot_hours, t.user or ""))
    out.append(
        AccountingTotal(
            user=None,
            jobs=sum(t.jobs for t in out),
            attempts=sum(t.attempts for t in out),
            elapsed_s=sum(t.elapsed_s for t in out),
            gpu_hours=sum(t.gpu_hours for t in out),
            cpu_slot_hours=sum(t.cpu_slot_hours for t in out),
            preemptions=sum(t.preemptions for t in out),
        )
    )
    return out
