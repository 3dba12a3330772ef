"""Accounting's hourly rollup: a window's totals from sums of hours, not a read of every
attempt in it (a month of a busy year is 80,000 attempts: 1.6 s on Postgres read one by
one, bench/history.py).

The sweeper adds each ended attempt and each ended job to ``usage_hours`` once
(``roll``): per owner and hour of UTC, the seconds its attempts ran in that hour and what
they held for them (service.queue.shares.held), the attempts and jobs that started in it,
and those running (in ddpq's hands) as it began. It marks them ``rolled`` in the same
transaction, so nothing is added twice, and never changes a row it added.

A window's totals (``totals``) are then exact, with no row read twice:

- its whole hours: sums of their rows, read as whole months' and days' rows (the sums of
  their hours', written in the same transaction) where those are fewer (``_spans``);
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

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    Table,
    and_,
    bindparam,
    false,
    func,
    literal_column,
    or_,
    select,
    text,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.db import Database
from service.models import Attempt, Job, UTCDateTime
from service.queue.shares import held
from service.rolluptables import UsageDay, UsageHour, UsageMonth

HOUR = timedelta(hours=1)
BATCH = 2000  # attempts (jobs) a roll transaction adds
PREEMPTED = "preempted by%"  # an attempt handed back for another job (queue.leases)
NO_ONE = ""  # the owner key of jobs of no one (from before users existed)

_table = cast(Table, UsageHour.__table__)
_days = cast(Table, UsageDay.__table__)
_months = cast(Table, UsageMonth.__table__)
DAY = timedelta(days=1)
_COUNTS = (
    "seconds", "gpu_s", "cpu_s", "alive", "alive_gpus", "alive_cpus", "alive_preempted",
    "started", "started_preempted", "jobs_alive", "jobs_made",
)  # fmt: skip


def floor_hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _seconds(a: datetime, b: datetime) -> float:
    return max(0.0, (b - a).total_seconds())


def _next_month(t: datetime) -> datetime:
    return (t.replace(day=28) + timedelta(days=4)).replace(day=1)


@dataclass(frozen=True)
class _Level:
    """A table of the rollup: its unit (``floor`` of a time, the ``next`` unit's start)."""

    table: Table
    key: str
    floor: Callable[[datetime], datetime]
    next: Callable[[datetime], datetime]

    @property
    def column(self) -> Any:
        return self.table.c[self.key]


_HOUR = _Level(_table, "hour", floor_hour, lambda t: t + HOUR)
_DAY = _Level(_days, "day", lambda t: t.replace(hour=0), lambda t: t + DAY)
_MONTH = _Level(_months, "month", lambda t: t.replace(day=1, hour=0), _next_month)
_LEVELS = (_HOUR, _DAY, _MONTH)  # finest first

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


def ran_in(since: Any, until: Any) -> list[Any]:
    """SQL: attempts that ran in [since, until) (started before its end, not ended
    before its start): the one rule, for the rollup's rows and service.accounting's.
    ``since`` and ``until``: datetimes, or bound parameters of them."""
    return [
        Attempt.started_at < until,
        or_(Attempt.ended_at.is_(None), Attempt.ended_at > since),
    ]


def alive_in(since: Any, until: Any) -> Any:
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
    _add(s, insert, _HOUR, _COUNTS, adds)
    # The days' and the months' rows: the sums of their hours', in the same transaction.
    for level in (_DAY, _MONTH):
        sums: _Adds = defaultdict(lambda: dict.fromkeys(_DAILY, 0.0))
        for (h, o), v in adds.items():
            added = sums[(level.floor(h), o)]
            for name in _DAILY:
                added[name] += v[name]
        _add(s, insert, level, _DAILY, sums)
    if attempts:
        ids = [row.id for row in attempts]
        s.execute(update(Attempt).where(Attempt.id.in_(ids)).values(rolled=True))
    if jobs:
        ids = [job.id for job in jobs]
        s.execute(update(Job).where(Job.id.in_(ids)).values(rolled=True))
    return len(attempts) + len(jobs)


def _add(s: Session, insert: Any, level: _Level, names: tuple[str, ...], sums: _Adds) -> None:
    """Add ``sums`` (by unit and owner) to ``level``'s rows, making those missing."""
    q = insert(level.table)
    q = q.on_conflict_do_update(
        index_elements=[level.key, "owner"],
        set_={name: level.table.c[name] + q.excluded[name] for name in names},
    )
    # In one order: two API processes' rounds never wait on each other in a circle.
    s.execute(q, [{level.key: t, "owner": o, **v} for (t, o), v in sorted(sums.items())])


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


# A window's bounds, bound per request: its statements are built once (each shape), so a
# request builds none and SQLAlchemy's compiled cache always hits. h1/b1 is the window's
# first part hour (h1 on the hour, b1 within its hour), h2/b2 its last (or an empty one).
_H1, _B1, _H2, _B2, _SINCE, _UNTIL, _LO, _HI = (
    bindparam(name, type_=UTCDateTime)
    for name in ("h1", "b1", "h2", "b2", "since", "until", "lo", "hi")
)
_USER: Any = bindparam("user")


def _edge_ran(h: Any, b: Any) -> Any:
    """SQL: attempts that started in [h, b), or were running at h and ended before b:
    two index ranges of at most an hour."""
    return or_(
        and_(Attempt.started_at >= h, Attempt.started_at < b),
        and_(Attempt.ended_at > h, Attempt.ended_at < b, Attempt.started_at < h),
    )


def _edge_jobs(h: Any, b: Any) -> Any:
    """SQL: jobs submitted in [h, b), or in ddpq's hands at h and ended before b."""
    return or_(
        and_(Job.created_at >= h, Job.created_at < b),
        and_(Job.finished_at > h, Job.finished_at < b, Job.created_at < h),
    )


@functools.cache
def _read_ran(mine: bool) -> Any:
    """Rolled attempts of the first (k 1) and the last (k 2) part hour, and those the
    rollup has not added yet that ran in the window (k 0: running ones, and those ended
    since its last round, a range of its partial index), in one round trip."""
    owned = [Job.owner == _USER] if mine else []

    def part(k: int, *where: Any) -> Any:
        rows: Any = select(literal_column(str(k)).label("k"), *_RAN_COLUMNS)
        return rows.join(Job, Job.id == Attempt.job_id).where(*where, *owned)

    return union_all(
        part(1, _edge_ran(_H1, _B1), Attempt.rolled == true()),
        part(2, _edge_ran(_H2, _B2), Attempt.rolled == true()),
        part(0, Attempt.rolled == false(), *ran_in(_SINCE, _UNTIL)),
    )


@functools.cache
def _read_jobs(mine: bool) -> Any:
    """Rolled jobs of the first (k 1) and the last (k 2) part hour."""
    owned = [Job.owner == _USER] if mine else []

    def part(k: int, h: Any, b: Any) -> Any:
        which: Any = literal_column(str(k)).label("k")
        rows = select(which, Job.owner, Job.created_at, Job.finished_at)
        return rows.where(_edge_jobs(h, b), Job.rolled == true(), *owned)

    return union_all(part(1, _H1, _B1), part(2, _H2, _B2))


@functools.cache
def _read_hours(mine: bool) -> Any:
    """The rows of the first and the last part hour."""
    owned = [UsageHour.owner == _USER] if mine else []
    return select(*_table.c).where(UsageHour.hour.in_([_H1, _H2]), *owned)


@functools.cache
def _read_unrolled_jobs(mine: bool) -> Any:
    """Jobs the rollup has not added yet in the window (active ones, and those ended
    since its last round), counted by owner: ix_jobs_unrolled_owner, index only."""
    owned = [Job.owner == _USER] if mine else []
    q = select(Job.owner, func.count()).where(Job.rolled == false(), alive_in(_SINCE, _UNTIL))
    return q.where(*owned).group_by(Job.owner)


_Life = tuple[str, datetime, datetime]  # a job's owner key, submitted, ended


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


# What adds up over whole hours, days and months (what was running as each began does not).
_DAILY = ("seconds", "gpu_s", "cpu_s", "started", "started_preempted", "jobs_made")


_Span = tuple[int, datetime, datetime, int]  # a level (_LEVELS' index), [lo, hi), a sign


def _spans(a: datetime, b: datetime, sign: int = 1, level: int = 2) -> list[_Span]:
    """The whole hours [a, b) (on the hour) as ranges of months', days' and hours' rows,
    each added (1) or taken off (-1): a unit's parts more than half of it are its row
    less its other parts (its row is the sum of theirs, in the same snapshot). So a year
    of 200 users reads 2,400 months' rows and at most half a month of days and half a
    day of hours at each end, not 73,000 days' rows; a month at most 12 hours' rows an
    edge, not 23."""
    if a >= b:
        return []
    if level == 0:
        return [(0, a, b, sign)]
    unit, fine = _LEVELS[level], level - 1
    lo = a if unit.floor(a) == a else unit.next(unit.floor(a))  # the first whole unit
    hi = unit.floor(b)
    if lo > hi:  # inside one unit
        u0 = unit.floor(a)
        u1 = unit.next(u0)
        if (b - a) * 2 <= u1 - u0:
            return _spans(a, b, sign, fine)
        return [(level, u0, u1, sign), *_spans(u0, a, -sign, fine), *_spans(b, u1, -sign, fine)]
    out = [(level, lo, hi, sign)] if lo < hi else []
    if a < lo:
        u0 = unit.floor(a)
        if (lo - a) * 2 > lo - u0:
            out += [(level, u0, lo, sign), *_spans(u0, a, -sign, fine)]
        else:
            out += _spans(a, lo, sign, fine)
    if hi < b:
        u1 = unit.next(hi)
        if (b - hi) * 2 > u1 - hi:
            out += [(level, hi, u1, sign), *_spans(b, u1, -sign, fine)]
        else:
            out += _spans(hi, b, sign, fine)
    return _merged(out)


def _merged(spans: list[_Span]) -> list[_Span]:
    """Adjacent ranges of the same days' or months' rows and sign as one."""
    out: list[_Span] = []
    for span in sorted(spans, key=lambda x: (x[0], x[3], x[1])):
        level, lo, hi, sign = span
        if out and level and out[-1][0] == level and out[-1][3] == sign and out[-1][2] == lo:
            out[-1] = (level, out[-1][1], hi, sign)
        else:
            out.append(span)
    return out


@functools.cache
def _read_whole(shape: tuple[tuple[int, int], ...], mine: bool) -> Any:
    """Each owner's sums over ranges of rows (``shape``: each range's level and sign),
    bound as lo0/hi0, lo1/hi1 ...: one statement."""
    parts: list[Any] = []
    for i, (level, sign) in enumerate(shape):
        unit = _LEVELS[level]
        lo, hi = (bindparam(f"{edge}{i}", type_=UTCDateTime) for edge in ("lo", "hi"))
        owner = unit.table.c.owner
        figures = (unit.table.c[n] if sign > 0 else (-unit.table.c[n]).label(n) for n in _DAILY)
        rows = select(owner, *figures).where(unit.column >= lo, unit.column < hi)
        parts.append(rows.where(owner == _USER) if mine else rows)
    both: Any = union_all(*parts) if len(parts) > 1 else parts[0]
    sub = both.subquery()
    return select(sub.c.owner, *(func.sum(sub.c[name]) for name in _DAILY)).group_by(sub.c.owner)


def _whole(s: Session, a: datetime, b: datetime, user: str | None) -> list[Any]:
    """Each owner's sums over the whole hours [a, b) (a < b): one statement."""
    spans = _spans(a, b)
    params: dict[str, Any] = {"user": user}
    for i, (_, lo, hi, _) in enumerate(spans):
        params[f"lo{i}"], params[f"hi{i}"] = lo, hi
    q = _read_whole(tuple((level, sign) for level, _, _, sign in spans), user is not None)
    return list(s.execute(q, params))


def totals(s: Session, since: datetime, until: datetime, user: str | None) -> dict[str, Figures]:
    """Every owner's totals in [since, until) (``user``'s only, when given), by owner key
    (NO_ONE for jobs of no one): rolled rows from the rollup, the rest one by one. Six
    statements, whatever the window."""
    per: dict[str, Figures] = defaultdict(Figures)
    if since >= until:
        return per
    hs = floor_hour(since)
    first_end = min(until, hs + HOUR)
    hu = floor_hour(until)
    last = until > hs + HOUR and until > hu  # a last part hour, after the first
    mine = user is not None
    if s.get_bind().dialect.name == "postgresql":
        s.execute(_SERIAL)  # for the rest of the transaction: its page's reads are small too
    params = {
        "h1": hs, "b1": first_end, "h2": hu if last else hs, "b2": until if last else hs,
        "since": since, "until": until, "user": user,
    }  # fmt: skip
    hours: dict[datetime, dict[str, Any]] = defaultdict(dict)
    for row in s.execute(_read_hours(mine), params):
        hours[row.hour][row.owner] = row
    ran: dict[int, list[Ran]] = {0: [], 1: [], 2: []}
    for row in s.execute(_read_ran(mine), params):
        ran[row.k].append(_ran(row))
    jobs: dict[int, list[_Life]] = {1: [], 2: []}
    for k, owner, made, end in s.execute(_read_jobs(mine), params):
        if end is not None:
            jobs[k].append((owner or NO_ONE, made, end))
    rows = hours.get(hs, {})
    _part_hour(per, rows, ran[1], hs, since, first_end)
    # Running (in ddpq's hands) at `since`: as the hour began, less those that ended
    # before `since`, plus those that started in the hour before it.
    for owner, row in rows.items():
        per[owner].attempts += row.alive
        per[owner].preempted += row.alive_preempted
        per[owner].jobs += row.jobs_alive
    for r in ran[1]:
        assert r.ended is not None
        running_at_h, running_at_since = r.started < hs, r.started < since < r.ended
        if running_at_h != running_at_since:
            sign = 1 if running_at_since else -1
            per[r.owner].attempts += sign
            per[r.owner].preempted += sign * r.preempted
    for owner, made, ended in jobs[1]:
        if (made < hs) != (made < since < ended):
            per[owner].jobs += 1 if made < since < ended else -1
    # Started (submitted) in the window: its first part hour, its whole hours, its last.
    edges: list[tuple[list[Ran], list[_Life], datetime, datetime]]
    edges = [(ran[1], jobs[1], since, first_end)]
    if hs + HOUR < hu:
        for owner, sec, g, c, started, pre, made in _whole(s, hs + HOUR, hu, user):
            f = per[owner]
            f.seconds += sec
            f.gpu_s += g
            f.cpu_s += c
            f.attempts += started
            f.preempted += pre
            f.jobs += made
    if last:
        _part_hour(per, hours.get(hu, {}), ran[2], hu, hu, until)
        edges.append((ran[2], jobs[2], hu, until))
    for ran_in, jobs_in, a, b in edges:
        for r in ran_in:
            if a <= r.started < b and (r.ended is None or r.ended > since):
                per[r.owner].attempts += 1
                per[r.owner].preempted += r.preempted
        for owner, made, ended in jobs_in:
            if a <= made < b and ended > since:
                per[owner].jobs += 1
    # What the rollup has not added yet, one by one (its attempts) and counted (its jobs).
    for r in ran[0]:
        f = per[r.owner]
        f.ran(r, since, until)
        f.attempts += 1
        f.preempted += r.preempted
    for owner, n in s.execute(_read_unrolled_jobs(mine), params):
        per[owner or NO_ONE].jobs += n
    return per


# A window's totals are statements of hundreds to thousands of rows each: on fresh
# statistics Postgres planned several of them over parallel workers, whose start cost
# more than the work (5-30 ms a statement on 2 busy cores, against 1-5 ms done by one).
# Not for a filtered window's sums of every attempt (service.accounting._counted): 80,000
# of them took 0.5 s with workers, 1.3 s without.
_SERIAL = text("SET LOCAL max_parallel_workers_per_gather = 0")


def snapshot(s: Session) -> None:
    """Make ``s``'s reads one snapshot on Postgres: a roll committing between two of them
    would count its attempts twice or not at all. Its level is set on its connection
    before the first statement, so psycopg says it in the BEGIN it sends anyway (a SET
    TRANSACTION was a round trip of its own). SQLite's read transaction is one snapshot
    already."""
    if s.get_bind().dialect.name == "postgresql":
        s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
