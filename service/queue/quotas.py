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
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, and_, bindparam, case, func, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from service.models import Quota
from service.queue import shares
from service.queue.rules import SQL, is_active, j, jobs

DEFAULT = "*"  # the quotas row that holds everyone's default
quotas_table: Table = Quota.__table__  # type: ignore[assignment]
q = quotas_table.c

Executor = Connection | Session


@dataclass(frozen=True)
class Limits:
    """One user's limits (None: none)."""

    max_gpus: int | None = None
    max_running: int | None = None
    max_queued: int | None = None

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


_LIMIT_COLUMNS = (_limit(q.max_gpus), _limit(q.max_running), _limit(q.max_queued))
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
            select(func.count()).select_from(jobs).where(j.owner == owner, j.status == "queued")
        ).scalar()
        or 0
    )


def _refresh_statement() -> Any:
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
    at_running = case((max_running.is_(None), False), else_=running >= max_running)
    over_gpus = case(
        (or_(max_gpus.is_(None), j.device == "cpu"), False),
        else_=j.nproc_per_node * j.nnodes + gpus > max_gpus,
    )
    changed = or_(j.quota_running != at_running, j.quota_gpus != over_gpus)
    return (
        update(jobs)
        .where(j.owner == owner, j.status == "queued", changed)
        .values(quota_running=at_running, quota_gpus=over_gpus)
        .returning(j.id)  # counted: SQLite's rowcount of an UPDATE led by WITH is -1
    )


# Built once: each claim runs it, and building it cost more than running it.
_REFRESH = _refresh_statement()


def refresh(s: Executor, owner: str | None) -> int:
    """Set the flags of ``owner``'s queued jobs from their limits and what they hold, in
    one statement (each claim runs it): the limits and what they hold are read in it, and
    only the rows whose flags change are written (nearly always none: a row not written
    is a row no other claimer waits for). How many rows changed."""
    if owner is None:
        return 0
    return len(s.execute(_REFRESH, {"quota_owner": owner}).all())


def refresh_all(s: Executor) -> None:
    """Every owner with queued jobs (the default limits changed)."""
    owners = s.execute(
        select(j.owner).where(j.status == "queued", j.owner.is_not(None)).distinct()
    ).scalars()
    for owner in list(owners):
        refresh(s, owner)
