"""Accounting's hourly rollup: a window's totals from sums of hours, not a read of every
attempt in it (a month of a busy year is 80,000 attempts: 1.6 s on Postgres read one by
one, bench/history.py).

The sweeper adds each ended attempt and each ended job to ``usage_hours`` once
(``roll``): per owner and hour of UTC, the seconds its attempts ran in that hour and what
they held for them (service.queue.shares.held), the attempts and jobs that started in it,
and those running (in ddpq's hands) as it began. It marks them ``rolled`` in the same
transaction, so nothing is added twice, and never changes a row it added.

A window's totals (``totals``) are then exact, with no row read twice:

- its whole hours: sums of their rows;
- its first and last part hour: the hour's row says what was running as it began, and
  the few attempts (jobs) that started or ended inside it are read one by one;
- what was running at its start: the row of that hour, less those that ended in it
  before the start, plus those that started in it before;
- what is not rolled yet (running, or ended since the sweeper's last round; all of them
  after an upgrade, until the sweeper has gone through them): read one by one, as
  service.accounting always did.

An attempt (a job) is in a window when it ran (was in ddpq's hands) in it: started
(submitted) before its end, and not ended before its start. Jobs purged by the history
retention (DDPQ_JOB_RETENTION) stay in the totals of their hours, as slurmdbd's rollups
outlive its purged jobs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, and_, false, func, or_, select, text, true, union_all, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.db import Database
from service.models import Attempt, Job
from service.queue.shares import held
from service.rolluptables import UsageDay, UsageHour

HOUR = timedelta(hours=1)
BATCH = 2000  # attempts (jobs) a roll transaction adds
PREEMPTED = "preempted by%"  # an attempt handed back for another job (queue.leases)
NO_ONE = ""  # the owner key of jobs of no one (from before users existed)

_table = cast(Table, UsageHour.__table__)
_days = cast(Table, UsageDay.__table__)
DAY = timedelta(days=1)
_COUNTS = (
    "seconds", "gpu_s", "cpu_s", "alive", "alive_gpus", "alive_cpus", "alive_preempted",
    "started", "started_preempted", "jobs_alive", "jobs_made",
)  # fmt: skip


def floor_hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _seconds(a: datetime, b: datetime) -> float:
    return max(0.0, (b - a).total_seconds())


# ---- adding ended attempts and jobs ------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    """An attempt as the rollup sees it: when, whose, what it held (GPUs, CPU slots)."""

    started: datetime
    ended: datetime | None  # None: still running
    owner: str
    gpus: int
    cpus: int
    preempted: int  # 1 if it was handed back for another job


_Adds = dict[tuple[datetime, str], dict[str, float]]  # what to add, by (hour, owner)


def _adds_of_attempt(adds: _Adds, a: Ran) -> None:
    assert a.ended is not None
    first = floor_hour(a.started)
    row = adds[(first, a.owner)]
    row["started"] += 1
    row["started_preempted"] += a.preempted
    hour = first
    while hour < a.ended:
        row = adds[(hour, a.owner)]
        ran = _seconds(max(a.started, hour), min(a.ended, hour + HOUR))
        row["seconds"] += ran
        row["gpu_s"] += ran * a.gpus
        row["cpu_s"] += ran * a.cpus
        if a.started < hour:  # running as the hour began
            row["alive"] += 1
            row["alive_gpus"] += a.gpus
            row["alive_cpus"] += a.cpus
            row["alive_preempted"] += a.preempted
        hour += HOUR


def _adds_of_job(adds: _Adds, owner: str, made: datetime, ended: datetime) -> None:
    adds[(floor_hour(made), owner)]["jobs_made"] += 1
    hour = floor_hour(made) + HOUR
    while hour < ended:
        adds[(hour, owner)]["jobs_alive"] += 1
        hour += HOUR


def _ran(row: Any) -> Ran:
    g, c = held(row.device, row.gpus, row.nproc_per_node, row.nnodes)
    preempted = 1 if (row.reason or "").startswith(PREEMPTED[:-1]) else 0
    return Ran(row.started_at, row.ended_at, row.owner or NO_ONE, g, c, preempted)


_RAN_COLUMNS = (
    Attempt.id, Attempt.started_at, Attempt.ended_at, Attempt.reason, Attempt.gpus,
    Job.owner, Job.device, Job.nproc_per_node, Job.nnodes,
)  # fmt: skip


# What a roll adds: ended attempts and jobs not yet rolled (ranges of the partial indexes).
_ATTEMPTS_DUE = (Attempt.rolled == false(), Attempt.ended_at.is_not(None))
_JOBS_DUE = (Job.rolled == false(), Job.finished_at.is_not(None))


def ran_in(since: datetime, until: datetime) -> list[Any]:
    """SQL: attempts that ran in [since, until) (started before its end, not ended
    before its start): the one rule, for the rollup's rows and service.accounting's."""
    return [
        Attempt.started_at < until,
        or_(Attempt.ended_at.is_(None), Attempt.ended_at > since),
    ]


def alive_in(since: datetime, until: datetime) -> Any:
    """SQL: jobs in ddpq's hands in [since, until) (submitted before its end, not ended
    before its start), likewise."""
    return and_(Job.created_at < until, or_(Job.finished_at.is_(None), Job.finished_at > since))


def _roll_batch(s: Session, batch: int) -> int:
    """Add up to ``batch`` ended attempts and as many ended jobs; how many."""
    attempts = s.execute(
        select(*_RAN_COLUMNS)
        .join(Job, Job.id == Attempt.job_id)
        .where(*_ATTEMPTS_DUE)
        .order_by(Attempt.id)  # a range of ix_attempts_unrolled, in one lock order
        .limit(batch)
        .with_for_update(of=Attempt, skip_locked=True)
    ).all()
    jobs = s.execute(
        select(Job.id, Job.owner, Job.created_at, Job.finished_at)
        .where(*_JOBS_DUE)
        .order_by(Job.id)
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    if not attempts and not jobs:
        return 0
    adds: _Adds = defaultdict(lambda: dict.fromkeys(_COUNTS, 0.0))
    for row in attempts:
        _adds_of_attempt(adds, _ran(row))
    for job in jobs:
        _adds_of_job(adds, job.owner or NO_ONE, job.created_at, job.finished_at)
    insert = postgresql.insert if s.get_bind().dialect.name == "postgresql" else sqlite.insert
    q = insert(_table)
    q = q.on_conflict_do_update(
        index_elements=["hour", "owner"],
        set_={name: _table.c[name] + q.excluded[name] for name in _COUNTS},
    )
    # In one order: two API processes' rounds never wait on each other in a circle.
    rows = [{"hour": h, "owner": o, **v} for (h, o), v in sorted(adds.items())]
    s.execute(q, rows)
    days: _Adds = defaultdict(lambda: dict.fromkeys(_DAILY, 0.0))
    for (h, o), v in adds.items():
        day = days[(h.replace(hour=0), o)]
        for name in _DAILY:
            day[name] += v[name]
    q = insert(_days)
    q = q.on_conflict_do_update(
        index_elements=["day", "owner"],
        set_={name: _days.c[name] + q.excluded[name] for name in _DAILY},
    )
    s.execute(q, [{"day": d, "owner": o, **v} for (d, o), v in sorted(days.items())])
    if attempts:
        ids = [row.id for row in attempts]
        s.execute(update(Attempt).where(Attempt.id.in_(ids)).values(rolled=True))
    if jobs:
        ids = [job.id for job in jobs]
        s.execute(update(Job).where(Job.id.in_(ids)).values(rolled=True))
    return len(attempts) + len(jobs)


def roll(db: Database, budget_s: float = 1.0, batch: int = BATCH) -> int:
    """Add what ended since the last round (the sweeper's turn holder, each round): a
    transaction per batch, for at most ``budget_s``; how many attempts and jobs."""
    with db.read() as s:  # an idle API's round: two index lookups, no write lock taken
        if (
            s.execute(select(Attempt.id).where(*_ATTEMPTS_DUE).limit(1)).first() is None
            and s.execute(select(Job.id).where(*_JOBS_DUE).limit(1)).first() is None
        ):
            return 0
    done, deadline = 0, time.monotonic() + budget_s
    while True:
        with db.write() as s:
            n = _roll_batch(s, batch)
        done += n
        if n < batch or time.monotonic() >= deadline:
            return done


# ---- a window's totals ---------------------------------------------------------------------


@dataclass
class Figures:
    """One owner's totals in a window."""

    jobs: int = 0
    attempts: int = 0
    seconds: float = 0.0
    gpu_s: float = 0.0
    cpu_s: float = 0.0
    preempted: int = 0

    def ran(self, a: Ran, since: datetime, until: datetime, scale: float = 1.0) -> None:
        """Add ``a``'s time inside [since, until), ``scale`` times (-1: take it off)."""
        seconds = _seconds(max(a.started, since), min(a.ended or until, until)) * scale
        self.seconds += seconds
        self.gpu_s += seconds * a.gpus
        self.cpu_s += seconds * a.cpus


def _owned(column: Any, user: str | None) -> list[Any]:
    return [] if user is None else [column == user]


def _rolled_ran(s: Session, h: datetime, b: datetime, user: str | None) -> list[Ran]:
    """Rolled attempts that started in [h, b), or were running at h and ended before b
    (h on the hour, b within its hour): two index ranges of at most an hour, one
    statement."""
    started_in = and_(Attempt.started_at >= h, Attempt.started_at < b)
    ended_in = and_(Attempt.ended_at > h, Attempt.ended_at < b, Attempt.started_at < h)
    q = (
        select(*_RAN_COLUMNS)
        .join(Job, Job.id == Attempt.job_id)
        .where(or_(started_in, ended_in), Attempt.rolled == true(), *_owned(Job.owner, user))
    )
    return [_ran(row) for row in s.execute(q)]


_Life = tuple[str, datetime, datetime]  # a job's owner key, submitted, ended


def _rolled_jobs(s: Session, h: datetime, b: datetime, user: str | None) -> list[_Life]:
    """Rolled jobs submitted in [h, b), or in ddpq's hands at h and ended before b."""
    made_in = and_(Job.created_at >= h, Job.created_at < b)
    ended_in = and_(Job.finished_at > h, Job.finished_at < b, Job.created_at < h)
    q = select(Job.owner, Job.created_at, Job.finished_at).where(
        or_(made_in, ended_in), Job.rolled == true(), *_owned(Job.owner, user)
    )
    return [(owner or NO_ONE, made, end) for owner, made, end in s.execute(q) if end is not None]


def _hour_rows(s: Session, h: datetime, user: str | None) -> dict[str, Any]:
    q = select(*_table.c).where(UsageHour.hour == h, *_owned(UsageHour.owner, user))
    return {row.owner: row for row in s.execute(q)}


def _part_hour(
    per: dict[str, Figures], rows: dict[str, Any], ran: list[Ran], h: datetime, a: datetime,
    b: datetime,
) -> None:  # fmt: skip
    """Rolled attempts' time inside [a, b), a part of the hour h: those running as it
    began for all of it, less what those that ended in it did not run; then those that
    started in it."""
    for owner, row in rows.items():
        f = per[owner]
        f.seconds += row.alive * _seconds(a, b)
        f.gpu_s += row.alive_gpus * _seconds(a, b)
        f.cpu_s += row.alive_cpus * _seconds(a, b)
    for r in ran:
        if r.started < h:  # running as the hour began, ended before b
            assert r.ended is not None
            per[r.owner].ran(Ran(h, b, r.owner, r.gpus, r.cpus, 0), a, b, scale=-1.0)
        per[r.owner].ran(r, a, b)


# What adds up over whole hours and days (what was running as each began does not).
_DAILY = ("seconds", "gpu_s", "cpu_s", "started", "started_preempted", "jobs_made")


def _whole(s: Session, a: datetime, b: datetime, user: str | None) -> list[Any]:
    """Each owner's sums over the whole hours [a, b): its whole days' rows, and the
    hours' rows before the first and after the last (a month is 30 rows a user, and
    at most 46 hours' rows)."""
    d1 = a if a == a.replace(hour=0) else a.replace(hour=0) + DAY
    d2 = b.replace(hour=0)
    parts: list[Any] = []
    hours = UsageHour.hour
    if d1 < d2:
        days = select(UsageDay.owner, *(_days.c[name] for name in _DAILY))
        parts.append(days.where(UsageDay.day >= d1, UsageDay.day < d2))
        spans = [(a, d1), (d2, b)]
    else:
        spans = [(a, b)]
    for lo, hi in spans:
        if lo < hi:
            rows = select(UsageHour.owner, *(_table.c[name] for name in _DAILY))
            parts.append(rows.where(hours >= lo, hours < hi))
    if not parts:
        return []
    both: Any = union_all(*parts) if len(parts) > 1 else parts[0]
    sub = both.subquery()
    q = select(sub.c.owner, *(func.sum(sub.c[name]) for name in _DAILY)).group_by(sub.c.owner)
    if user is not None:
        q = q.where(sub.c.owner == user)
    return list(s.execute(q))


def totals(s: Session, since: datetime, until: datetime, user: str | None) -> dict[str, Figures]:
    """Every owner's totals in [since, until) (``user``'s only, when given), by owner key
    (NO_ONE for jobs of no one): rolled rows from the rollup, the rest one by one."""
    per: dict[str, Figures] = defaultdict(Figures)
    if since >= until:
        return per
    hs = floor_hour(since)
    first_end = min(until, hs + HOUR)
    rows = _hour_rows(s, hs, user)
    ran, jobs = _rolled_ran(s, hs, first_end, user), _rolled_jobs(s, hs, first_end, user)
    _part_hour(per, rows, ran, hs, since, first_end)
    # Running (in ddpq's hands) at `since`: as the hour began, less those that ended
    # before `since`, plus those that started in the hour before it.
    for owner, row in rows.items():
        per[owner].attempts += row.alive
        per[owner].preempted += row.alive_preempted
        per[owner].jobs += row.jobs_alive
    for r in ran:
        assert r.ended is not None
        running_at_h, running_at_since = r.started < hs, r.started < since < r.ended
        if running_at_h != running_at_since:
            sign = 1 if running_at_since else -1
            per[r.owner].attempts += sign
            per[r.owner].preempted += sign * r.preempted
    for owner, made, ended in jobs:
        if (made < hs) != (made < since < ended):
            per[owner].jobs += 1 if made < since < ended else -1
    # Started (submitted) in the window: its first part hour, its whole hours, its last.
    edges: list[tuple[list[Ran], list[_Life], datetime, datetime]]
    edges = [(ran, jobs, since, first_end)]
    if until > hs + HOUR:
        hu = floor_hour(until)
        for owner, sec, g, c, started, pre, made in _whole(s, hs + HOUR, hu, user):
            f = per[owner]
            f.seconds += sec
            f.gpu_s += g
            f.cpu_s += c
            f.attempts += started
            f.preempted += pre
            f.jobs += made
        if until > hu:
            last = (_rolled_ran(s, hu, until, user), _rolled_jobs(s, hu, until, user))
            _part_hour(per, _hour_rows(s, hu, user), last[0], hu, hu, until)
            edges.append((last[0], last[1], hu, until))
    for ran_in, jobs_in, a, b in edges:
        for r in ran_in:
            if a <= r.started < b and (r.ended is None or r.ended > since):
                per[r.owner].attempts += 1
                per[r.owner].preempted += r.preempted
        for owner, made, ended in jobs_in:
            if a <= made < b and ended > since:
                per[owner].jobs += 1
    _unrolled(s, per, since, until, user)
    return per


def _unrolled(
    s: Session, per: dict[str, Figures], since: datetime, until: datetime, user: str | None
) -> None:
    """What the rollup has not added yet, one by one: running attempts and active jobs,
    and those ended since its last round (a range of its partial indexes)."""
    ran = (
        select(*_RAN_COLUMNS)
        .join(Job, Job.id == Attempt.job_id)
        .where(Attempt.rolled == false(), *ran_in(since, until), *_owned(Job.owner, user))
    )
    for row in s.execute(ran):
        r = _ran(row)
        f = per[r.owner]
        f.ran(r, since, until)
        f.attempts += 1
        f.preempted += r.preempted
    jobs = (
        select(Job.owner, func.count())
        .where(Job.rolled == false(), alive_in(since, until), *_owned(Job.owner, user))
        .group_by(Job.owner)
    )
    for owner, n in s.execute(jobs):
        per[owner or NO_ONE].jobs += n


def snapshot(s: Session) -> None:
    """Make ``s``'s reads one snapshot on Postgres (the first statement of its
    transaction): a roll committing between two of them would count its attempts twice
    or not at all. SQLite's read transaction is one snapshot already."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
