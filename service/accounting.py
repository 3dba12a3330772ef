"""Accounting: what jobs and their attempts held, and for how long, over a window (Slurm's
``sacct``; GET /accounting, ``ddpq acct``).

A job is in a window if it was submitted in it or one of its attempts ran in it. What is
counted is the time its attempts ran inside the window, and what each held for that
time (service.queue.shares.held: its GPUs, else its ranks' CPU slots), so the rows of
consecutive windows (a month, then the next) add up to the whole. An attempt still
running counts up to now. The totals are over every row the query matches, not only
the page shown: one read of the window's attempts, added up here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Text, and_, bindparam, case, cast, func, or_, select, union

from service.db import Database
from service.models import Attempt, Job, UTCDateTime, utcnow
from service.schemas.accounting import AccountingPublic, AccountingRow, AccountingTotal
from service.sweeptables import SweepTrial

PREEMPTED = "preempted by%"  # an attempt handed back for another job (queue.leases)


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
    where = [
        Attempt.started_at < q.until,
        or_(Attempt.ended_at.is_(None), Attempt.ended_at > q.since),
    ]
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


def _in_window(q: Query, counting: bool = False) -> Any:
    """SQL: jobs submitted in the window or that ran in it (asked for a worker: ran on it).
    ``counting``: as a union of two index ranges (jobs.created_at, attempts.ended_at),
    which counts them in half the time of the OR; a page's walk by id is faster on the
    OR (bench/history.py)."""
    ran = select(Attempt.job_id).where(*_ran_in(q))
    if q.worker is not None:
        return Job.id.in_(ran)
    if counting:
        made = select(Job.id).where(Job.created_at >= q.since, Job.created_at < q.until)
        return Job.id.in_(union(made, ran))
    return or_(and_(Job.created_at >= q.since, Job.created_at < q.until), Job.id.in_(ran))


# SQL: 1 for an attempt handed back for another job (queue.leases), else 0.
_PREEMPTED = case((Attempt.reason.like(PREEMPTED), 1), else_=0)


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
        span = func.julianday(last) - func.julianday(func.max(Attempt.started_at, since))
        seconds = span * 86400.0
    seconds = case((seconds > 0, seconds), else_=0.0)
    has_gpus = and_(Attempt.gpus.is_not(None), cast(Attempt.gpus, Text).not_in(("[]", "null")))
    ranks = Job.nproc_per_node * Job.nnodes
    on_gpus = or_(Job.device == "cuda", has_gpus)
    gpus, cpus = case((on_gpus, ranks), else_=0), case((on_gpus, 0), else_=ranks)
    return seconds, seconds * gpus / 3600.0, seconds * cpus / 3600.0


def _params(q: Query, now: datetime) -> dict[str, Any]:
    return {"since": q.since, "end": min(q.until, now)}


def _sums(dialect: str) -> list[Any]:
    """SQL aggregates over attempts: how many, seconds, GPU-hours, CPU-slot-hours,
    preempted."""
    return [
        func.count(Attempt.id),
        *(func.coalesce(func.sum(figure), 0.0) for figure in _use(dialect)),
        func.coalesce(func.sum(_PREEMPTED), 0),
    ]


def report(db: Database, q: Query) -> AccountingPublic:
    """The window's rows (a page of them) and every user's totals, added up by the
    database: a month of a busy year's attempts is never read row by row."""
    now = utcnow()
    params = _params(q, now)
    with db.read() as s:
        sums = s.execute(
            select(Job.owner, *_sums(db.dialect))
            .join(Job, Job.id == Attempt.job_id)
            .where(*_ran_in(q), *_jobs_of(q))
            .group_by(Job.owner),
            params,
        ).all()
        counted = s.execute(
            select(Job.owner, func.count())
            .where(_in_window(q, counting=True), *_jobs_of(q))
            .group_by(Job.owner)
        ).all()
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
        totals=_totals(sums, {owner: int(n) for owner, n in counted}),
    )


def _sweeps_of(s: Any, job_ids: list[int]) -> dict[int, int]:
    if not job_ids:
        return {}
    rows = s.execute(
        select(SweepTrial.job_id, SweepTrial.sweep_id).where(SweepTrial.job_id.in_(job_ids))
    )
    return {int(job_id): int(sweep_id) for job_id, sweep_id in rows}


def _job_rows(
    s: Any, dialect: str, q: Query, params: dict[str, Any], now: datetime
) -> tuple[list[AccountingRow], str | None]:
    page = list(
        s.scalars(
            select(Job)
            .where(_in_window(q), *_jobs_of(q), Job.id > (q.cursor or 0))
            .order_by(Job.id)
            .limit(q.limit + 1)
        )
    )
    more = str(page[q.limit - 1].id) if len(page) > q.limit else None
    page = page[: q.limit]
    ids = [job.id for job in page]
    ran: dict[int, Any] = {}  # what its attempts ran in the window
    whole: dict[int, Any] = {}  # of all its attempts: its first start, how many, preempted
    workers: dict[int, set[str]] = defaultdict(set)
    if ids:
        for row in s.execute(
            select(Attempt.job_id, *_sums(dialect))
            .where(Attempt.job_id.in_(ids), *_ran_in(q))
            .join(Job, Job.id == Attempt.job_id)
            .group_by(Attempt.job_id),
            params,
        ):
            ran[int(row[0])] = row
        for row in s.execute(
            select(Attempt.job_id, func.min(Attempt.started_at), func.count(), func.sum(_PREEMPTED))
            .where(Attempt.job_id.in_(ids))
            .group_by(Attempt.job_id)
        ):
            whole[int(row[0])] = row
        for job_id, worker in s.execute(
            select(Attempt.job_id, Attempt.worker).where(Attempt.job_id.in_(ids), *_ran_in(q))
        ):
            workers[int(job_id)].add(worker)
    sweeps = _sweeps_of(s, ids)
    items = []
    for job in page:
        _, _, seconds, gpu_h, cpu_h, _ = ran.get(job.id, (None, 0, 0.0, 0.0, 0.0, 0))
        first, count, preemptions = (None, 0, 0)
        if job.id in whole:
            _, first, count, preemptions = whole[job.id]
        waited_until = first or min(job.finished_at or now, q.until, now)
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
                sweep=sweeps.get(job.id),
                created_at=job.created_at,
                started_at=first,
                finished_at=job.finished_at,
                queued_s=max(0.0, (waited_until - job.created_at).total_seconds()),
                elapsed_s=float(seconds),
                gpu_hours=float(gpu_h),
                cpu_slot_hours=float(cpu_h),
                attempts=int(count),
                preemptions=int(preemptions or 0),
            )
        )
    return items, more


def _attempt_rows(
    s: Any, dialect: str, q: Query, params: dict[str, Any]
) -> tuple[list[AccountingRow], str | None]:
    seconds, gpu_hours, cpu_hours = _use(dialect)
    page = list(
        s.execute(
            select(
                Attempt.id, Attempt.job_id, Attempt.number, Attempt.worker, Attempt.started_at,
                Attempt.ended_at, Attempt.outcome, Attempt.reason, Attempt.exit_code, Job.owner,
                Job.name, Job.device, Job.nproc_per_node, Job.nnodes, Job.created_at,
                seconds.label("seconds"), gpu_hours.label("gpu_hours"),
                cpu_hours.label("cpu_hours"), _PREEMPTED.label("preempted"),
            )
            .join(Job, Job.id == Attempt.job_id)
            .where(*_ran_in(q), *_jobs_of(q), Attempt.id > (q.cursor or 0))
            .order_by(Attempt.id)
            .limit(q.limit + 1),
            params,
        )
    )  # fmt: skip
    more = str(page[q.limit - 1].id) if len(page) > q.limit else None
    page = page[: q.limit]
    sweeps = _sweeps_of(s, sorted({a.job_id for a in page}))
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
                sweep=sweeps.get(a.job_id),
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


def _totals(sums: Any, jobs: dict[str | None, int]) -> list[AccountingTotal]:
    """Per user, most GPU-hours (then CPU-slot-hours) first, then everyone's."""
    per = {
        owner: (int(n), float(sec), float(g), float(c), int(p)) for owner, n, sec, g, c, p in sums
    }
    for owner in jobs:  # a user with jobs in the window but no attempt there
        per.setdefault(owner, (0, 0.0, 0.0, 0.0, 0))
    out = [
        AccountingTotal(
            user=owner, jobs=jobs.get(owner, 0), attempts=n, elapsed_s=sec, gpu_hours=g,
            cpu_slot_hours=c, preemptions=p,
        )
        for owner, (n, sec, g, c, p) in per.items()
    ]  # fmt: skip
    out.sort(key=lambda t: (-t.gpu_hours, -t.cpu_slot_hours, t.user or ""))
    out.append(
        AccountingTotal(
            user=None,
            jobs=sum(jobs.values()),
            attempts=sum(t.attempts for t in out),
            elapsed_s=sum(t.elapsed_s for t in out),
            gpu_hours=sum(t.gpu_hours for t in out),
            cpu_slot_hours=sum(t.cpu_slot_hours for t in out),
            preemptions=sum(t.preemptions for t in out),
        )
    )
    return out
