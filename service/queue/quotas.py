"""Quotas: how much each user may hold and queue at once.

A limit per user (the quotas row of their name) or for everyone without one (the row
named ``*``): GPUs at once, jobs running at once, jobs queued at once (None: no limit).
Over the queued limit a submit is refused (429, naming it). The running limits hold a
user's queued jobs back through two flags on each (``jobs.quota_running``: its owner
runs as many jobs as they may; ``jobs.quota_gpus``: on GPUs it would take its owner past
their GPUs), set whenever what the owner holds or may hold changes (a job of theirs
starts or ends or is submitted, a limit changes: ``refresh``). The claim reads them like
any other column (rules.quota_free), so the reason a held job shows and the claim agree.
While no quota is set at all, neither a claim nor a submit refreshes them (the worker's
books and the submit's read of its owner say so); a submit under no running or GPU limit
does not either.

Races (Postgres: SQLite serialises writers, and each sees the last one's commit). The
flags and the queued count are read under READ COMMITTED, where two transactions each
miss the other's uncommitted start or submit. So every transaction that counts or
changes what an owner holds or queues takes the **owner's lock** (``lock``: a
transaction advisory lock keyed by the name) and reads what it decides on after it, in
statements of their own (a statement's snapshot is taken before it waits):

- a submit under a queued limit counts the owner's queued jobs under it (``lock``, then
  the count: 24 submits at once queued 4-8 of a limit of 3 without it);
- a claim (a worker's, a gang's last node, a bridge's), having marked a job running,
  takes it and checks the owner is still within their limits with that job
  (``settle_start``: two claims at once each saw the other's job still queued), or
  is undone (``OverLimit``) and the flags refreshed (``settle``);
- an attempt's end, a usage count (fair share's share column) and a limit set take it
  before they write the owner's queued rows.

The lock is taken after the rows a transaction locks first (a job being claimed or
ending, its attempt), and while it is held no transaction waits for another's queued
row: the flags' refresh skips rows another holds (``SKIP LOCKED``). Those are jobs being
claimed, which leave the queue or are undone and settled again, or cancelled; every
other writer of an owner's queued rows holds the owner's lock, so it is never skipped.
Hence no cycle of waits: a claim never fails for ddpq's own lock order (two claims under
``max_running 1`` deadlocked in the refresh, each waiting for the row the other took).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, and_, bindparam, case, func, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from service.errors import ServiceError
from service.models import Quota
from service.queue import shares
from service.queue.rules import SQL, is_active, j, jobs, lock_owner, postgres

DEFAULT = "*"  # the quotas row that holds everyone's default
quotas_table: Table = Quota.__table__  # type: ignore[assignment]
q = quotas_table.c

Executor = Connection | Session

# The owner's lock (this module's docstring): rules.lock_owner, here as ``lock``.
lock = lock_owner


class OverLimit(ServiceError):
    """A claim took a job its owner's limits no longer let start (another claim of
    theirs committed first): the claim is undone, the flags refreshed (``settle``)."""

    def __init__(self, owner: str) -> None:
        super().__init__(f"{owner} is at their limits")
        self.owner = owner


@dataclass(frozen=True)
class Limits:
    """One user's limits (None: none). ``max_priority``: the highest priority a member
    may give a job (admins have none), field by field: their own row's, else the
    default row's, else 0 (a member may lower their jobs' priority, not raise it)."""

    max_gpus: int | None = None
    max_running: int | None = None
    max_queued: int | None = None
    max_priority: int | None = None

    @property
    def holds_back(self) -> bool:
        return self.max_gpus is not None or self.max_running is not None


def _limit(column: Any) -> Any:
    """One of the limits of the owner bound as ``owner``: their own row wins whole (a
    null there included), else everyone's default, else no row and no limit."""
    return (
        select(column)
        .where(or_(q.owner == bindparam("owner"), q.owner == DEFAULT))
        .order_by(q.owner == DEFAULT)
        .limit(1)
        .scalar_subquery()
    )


def _priority_cap() -> Any:
    """The owner bound as ``owner``'s priority cap (Limits.max_priority)."""
    own = select(q.max_priority).where(q.owner == bindparam("owner")).scalar_subquery()
    default = select(q.max_priority).where(q.owner == DEFAULT).scalar_subquery()
    return func.coalesce(own, default, 0)


_LIMIT_COLUMNS = (
    _limit(q.max_gpus),
    _limit(q.max_running),
    _limit(q.max_queued),
    _priority_cap(),
)
_LIMITS = select(*_LIMIT_COLUMNS)
# A submit reads both of its owner, in one statement (a round trip less on its path).
_USAGE_AND_LIMITS = shares.USAGE_OF.add_columns(*_LIMIT_COLUMNS)


def limits(s: Executor, owner: str | None) -> Limits:
    """``owner``'s limits: their own row, else everyone's default, else none."""
    if owner is None:
        return Limits()
    return Limits(*s.execute(_LIMITS, {"owner": owner}).one())


def usage_and_limits(s: Session, owner: str | None, now: datetime) -> tuple[float, Limits]:
    """``owner``'s fair-share usage (shares.usage_of: the epoch held until the
    transaction ends) and their limits."""
    if owner is None:
        return 0.0, Limits()
    row = s.execute(_USAGE_AND_LIMITS, {"owner": owner}).first()
    if row is None:  # no epoch yet: the first use of fair share (made there)
        return shares.usage_of(s, owner, now), limits(s, owner)
    _, usage, *limited = row
    return float(usage or 0.0), Limits(*limited)


_held = jobs.alias("held")
h = _held.c
# The GPUs an active job holds: a job that holds no CPU slots and is no CPU job holds its
# ranks' GPUs (rules.unit; a Slurm bridge's auto job counts so too).
_GPUS_HELD = case(
    (and_(h.held_cpu_slots == 0, h.device != "cpu"), h.nproc_per_node * h.nnodes), else_=0
)


def _active(owner: Any) -> Any:
    return and_(h.owner == owner, is_active(h.status, SQL))


def holdings(s: Executor, owner: str) -> tuple[int, int]:
    """What ``owner``'s active jobs hold: (jobs, GPUs)."""
    row = s.execute(
        select(func.count(), func.coalesce(func.sum(_GPUS_HELD), 0)).where(_active(owner))
    ).one()
    return int(row[0]), int(row[1])


def queued(s: Executor, owner: str) -> int:
    return int(
        s.execute(
            select(func.count())
            .select_from(jobs)
            .where(j.owner == owner, j.status.in_(("queued", "held")))  # held: queued too
        ).scalar()
        or 0
    )


@dataclass(frozen=True)
class _Refresh:
    """The flags' refresh, built once per backend (each claim under a quota runs it, and
    building it cost more than running it): ``flags`` sets them and returns the ids it
    changed; ``settle`` (Postgres) does the same and also returns what the owner holds
    and may hold, for a claim's check (``settle_start``)."""

    flags: Any
    settle: Any


def _refresh_statements(pg: bool) -> _Refresh:
    owner: Any = bindparam("quota_owner")
    # The owner's limits and what their active jobs hold, each read once for the whole
    # statement (two one-row CTEs) rather than in a subquery at every place the flags'
    # expressions name them: that statement planned a score of subplans per claim and
    # cost the claim a quarter of its CPU under a default quota (bench/claim.py).
    # Their own row wins whole, a null there included; else everyone's default; else no
    # row, and no limit.
    limit = (
        select(q.max_running, q.max_gpus)
        .where(or_(q.owner == owner, q.owner == DEFAULT))
        .order_by(q.owner == DEFAULT)
        .limit(1)
        .cte("quota_limit")
    )
    held = (
        select(
            func.count().label("running"),
            func.coalesce(func.sum(_GPUS_HELD), 0).label("gpus"),
        )
        .where(_active(owner))
        .cte("quota_held")
    )
    max_running = select(limit.c.max_running).scalar_subquery()
    max_gpus = select(limit.c.max_gpus).scalar_subquery()
    running = select(held.c.running).scalar_subquery()
    gpus = select(held.c.gpus).scalar_subquery()

    def flags(t: Any) -> tuple[Any, Any, Any]:
        """(at its running limit, over its GPUs, a flag differs) for jobs table ``t``."""
        at_running = case((max_running.is_(None), False), else_=running >= max_running)
        over_gpus = case(
            (or_(max_gpus.is_(None), t.device == "cpu"), False),
            else_=t.nproc_per_node * t.nnodes + gpus > max_gpus,
        )
        changed = or_(t.quota_running != at_running, t.quota_gpus != over_gpus)
        return at_running, over_gpus, changed

    at_running, over_gpus, changed = flags(j)
    which = and_(j.owner == owner, j.status == "queued", changed)
    if pg:
        # Rows another transaction holds are skipped, never waited for, under the
        # owner's lock (the module docstring says why that is safe).
        picked = jobs.alias("picked")
        p = picked.c
        pick = (
            select(p.id)
            .where(p.owner == owner, p.status == "queued", flags(p)[2])
            .with_for_update(skip_locked=True)
        )
        which = j.id.in_(pick)
    statement = (
        update(jobs)
        .where(which)
        .values(quota_running=at_running, quota_gpus=over_gpus)
        .returning(j.id)  # counted: SQLite's rowcount of an UPDATE led by WITH is -1
    )
    if not pg:
        return _Refresh(statement, None)
    changed_rows = statement.cte("quota_flagged")
    settle = select(
        select(func.count()).select_from(changed_rows).scalar_subquery(),
        running,
        gpus,
        max_running,
        max_gpus,
    )
    return _Refresh(statement, settle)


_REFRESH = {False: _refresh_statements(False), True: _refresh_statements(True)}


def refresh(s: Executor, owner: str | None, locked: bool = False) -> int:
    """Set the flags of ``owner``'s queued jobs from their limits and what they hold,
    under the owner's lock (taken here unless the caller has: ``locked``), in one
    statement: the
    limits and what they hold are read in it, and only the rows whose flags change are
    written (nearly always none: a row not written is a row no other claimer waits
    for). How many rows changed."""
    if owner is None:
        return 0
    if not locked:
        lock(s, owner)
    return len(s.execute(_REFRESH[postgres(s)].flags, {"quota_owner": owner}).all())


def settle_start(conn: Connection, owner: str | None, holds_gpus: bool) -> None:
    """A claim marked a job of ``owner``'s running (in this transaction): take the
    owner's lock, check they are within their limits with it, and refresh the flags
    of their queued jobs. OverLimit (to undo the claim) if another claim of theirs
    committed first and this one takes them past a limit."""
    if owner is None:
        return
    if not postgres(conn):  # serialised: the flags the claim read were current
        conn.execute(_REFRESH[False].flags, {"quota_owner": owner}).all()
        return
    lock(conn, owner)
    row = conn.execute(_REFRESH[True].settle, {"quota_owner": owner}).one()
    _, running, gpus, max_running, max_gpus = row
    over_running = max_running is not None and running > max_running
    over_gpus = holds_gpus and max_gpus is not None and gpus > max_gpus
    if over_running or over_gpus:
        raise OverLimit(owner)


def settle(db: Any, owner: str) -> None:
    """The flags of ``owner``'s queued jobs refreshed in a transaction of its own (after
    a claim was undone: OverLimit)."""
    with db.write_conn() as conn:
        refresh(conn, owner)


def refresh_all(s: Executor) -> None:
    """Every owner with queued jobs (the default limits changed)."""
    owners = s.execute(
        select(j.owner).where(j.status == "queued", j.owner.is_not(None)).distinct()
    ).scalars()
    for owner in sorted(owners):  # one lock order: two of these never wait in a circle
        refresh(s, owner)
