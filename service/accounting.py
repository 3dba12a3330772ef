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

from sqlalchemy import and_, case, func, or_, select

from service import queue
from service.db import Database
from service.models import Attempt, Job, utcnow
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


def _in_window(q: Query) -> Any:
    """SQL: jobs submitted in the window or that ran in it (asked for a worker: ran on it)."""
    ran = Job.id.in_(select(Attempt.job_id).where(*_ran_in(q)))
    if q.worker is not None:
        return ran
    return or_(and_(Job.created_at >= q.since, Job.created_at < q.until), ran)


@dataclass
class _Use:
    """What one attempt ran and held inside the window."""

    seconds: float
    gpu_hours: float
    cpu_slot_hours: float


def _use(row: Any, q: Query, now: datetime) -> _Use:
    end = min(row.ended_at or now, q.until, now)
    seconds = max(0.0, (end - max(row.started_at, q.since)).total_seconds())
    gpus, cpu = queue.attempt_holds(row.device, row.gpus, row.nproc_per_node, row.nnodes)
    return _Use(seconds, gpus * seconds / 3600, cpu * seconds / 3600)


_ATTEMPT_COLUMNS = (
    Attempt.id,
    Attempt.job_id,
    Attempt.number,
    Attempt.worker,
    Attempt.started_at,
    Attempt.ended_at,
    Attempt.outcome,
    Attempt.reason,
    Attempt.exit_code,
    Attempt.gpus,
    Job.owner,
    Job.name,
    Job.device,
    Job.nproc_per_node,
    Job.nnodes,
    Job.created_at,
)


def report(db: Database, q: Query) -> AccountingPublic:
    """The window's rows (a page of them) and every user's totals."""
    now = utcnow()
    with db.read() as s:
        attempts = list(s.execute(
            select(*_ATTEMPT_COLUMNS).join(Job, Job.id == Attempt.job_id)
            .where(*_ran_in(q), *_jobs_of(q))
            .order_by(Attempt.id)
        ))  # fmt: skip
        counted = s.execute(
            select(Job.owner, func.count()).where(_in_window(q), *_jobs_of(q)).group_by(Job.owner)
        ).all()
        if q.per == "attempt":
            items, more = _attempt_rows(s, q, attempts, now)
        else:
            items, more = _job_rows(s, q, attempts, now)
    uses = [(a, _use(a, q, now)) for a in attempts]
    return AccountingPublic(
        since=q.since,
        until=q.until,
        per=q.per,  # type: ignore[arg-type]
        items=items,
        next_cursor=more,
        totals=_totals(uses, {owner: int(n) for owner, n in counted}),
    )


def _sweeps_of(s: Any, job_ids: list[int]) -> dict[int, int]:
    if not job_ids:
        return {}
    rows = s.execute(
        select(SweepTrial.job_id, SweepTrial.sweep_id).where(SweepTrial.job_id.in_(job_ids))
    )
    return {int(job_id): int(sweep_id) for job_id, sweep_id in rows}


def _job_rows(
    s: Any, q: Query, attempts: list[Any], now: datetime
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
    # Of all its attempts, in or out of the window: its first start, how many, preempted.
    whole: dict[int, Any] = {}
    if ids:
        preempted = func.sum(case((Attempt.reason.like(PREEMPTED), 1), else_=0))
        for row in s.execute(
            select(Attempt.job_id, func.min(Attempt.started_at), func.count(), preempted)
            .where(Attempt.job_id.in_(ids))
            .group_by(Attempt.job_id)
        ):
            whole[int(row[0])] = row
    ran: dict[int, list[Any]] = defaultdict(list)
    for a in attempts:
        ran[a.job_id].append(a)
    sweeps = _sweeps_of(s, ids)
    items = []
    for job in page:
        mine = ran.get(job.id, [])
        uses = [_use(a, q, now) for a in mine]
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
                workers=sorted({a.worker for a in mine}),
                sweep=sweeps.get(job.id),
                created_at=job.created_at,
                started_at=first,
                finished_at=job.finished_at,
                queued_s=max(0.0, (waited_until - job.created_at).total_seconds()),
                elapsed_s=sum(u.seconds for u in uses),
                gpu_hours=sum(u.gpu_hours for u in uses),
                cpu_slot_hours=sum(u.cpu_slot_hours for u in uses),
                attempts=int(count),
                preemptions=int(preemptions or 0),
            )
        )
    return items, more


def _attempt_rows(
    s: Any, q: Query, attempts: list[Any], now: datetime
) -> tuple[list[AccountingRow], str | None]:
    page = [a for a in attempts if a.id > (q.cursor or 0)][: q.limit + 1]
    more = str(page[q.limit - 1].id) if len(page) > q.limit else None
    page = page[: q.limit]
    sweeps = _sweeps_of(s, sorted({a.job_id for a in page}))
    items = []
    for a in page:
        use = _use(a, q, now)
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
                elapsed_s=use.seconds,
                gpu_hours=use.gpu_hours,
                cpu_slot_hours=use.cpu_slot_hours,
                attempts=1,
                preemptions=int((a.reason or "").startswith(PREEMPTED[:-1])),
            )
        )
    return items, more


def _totals(uses: list[tuple[Any, _Use]], jobs: dict[str | None, int]) -> list[AccountingTotal]:
    """Per user, most GPU-hours (then CPU-slot-hours) first, then everyone's."""
    per: dict[str | None, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for a, use in uses:
        t = per[a.owner]
        t["attempts"] += 1
        t["elapsed_s"] += use.seconds
        t["gpu_hours"] += use.gpu_hours
        t["cpu_slot_hours"] += use.cpu_slot_hours
        t["preemptions"] += int((a.reason or "").startswith(PREEMPTED[:-1]))
    for owner in jobs:  # a user with jobs in the window but no attempt there
        per.setdefault(owner, defaultdict(float))
    everyone: dict[str, float] = defaultdict(float)
    out = []
    for owner, t in per.items():
        for k, v in t.items():
            everyone[k] += v
        out.append(_total(owner, jobs.get(owner, 0), t))
    out.sort(key=lambda t: (-t.gpu_hours, -t.cpu_slot_hours, t.user or ""))
    out.append(_total(None, sum(jobs.values()), everyone))
    return out


def _total(user: str | None, jobs: int, t: dict[str, float]) -> AccountingTotal:
    return AccountingTotal(
        user=user,
        jobs=jobs,
        attempts=int(t.get("attempts", 0)),
        elapsed_s=t.get("elapsed_s", 0.0),
        gpu_hours=t.get("gpu_hours", 0.0),
        cpu_slot_hours=t.get("cpu_slot_hours", 0.0),
        preemptions=int(t.get("preemptions", 0)),
    )
