"""Quotas: how much each user may hold and queue at once.

A limit per user (the quotas row of their name) or for everyone without one (the row
named ``*``): GPUs at once, jobs running at once, jobs queued at once (None: no limit).
Over the queued limit a submit is refused (429, naming it). The running limits hold a
user's queued jobs back through two flags on each (``jobs.quota_running``: its owner
runs as many jobs as they may; ``jobs.quota_gpus``: on GPUs it would take its owner past
their GPUs), set whenever what the owner holds or may hold changes (a job of theirs
starts or ends or is submitted, a limit changes: ``refresh``). The claim reads them like
any other column (rules.quota_free), so the reason a held job shows and the claim agree,
and a user without limits costs the claim one primary-key read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, and_, case, func, literal, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from service.models import Quota
from service.queue.rules import SQL, is_active, j, jobs
from service.queue.shares import held

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


_LIMITS = select(q.owner, q.max_gpus, q.max_running, q.max_queued)


def limits(s: Executor, owner: str | None) -> Limits:
    """``owner``'s limits: their own row, else everyone's default, else none."""
    if owner is None:
        return Limits()
    rows = {r.owner: r for r in s.execute(_LIMITS.where(q.owner.in_([owner, DEFAULT])))}
    row = rows.get(owner) or rows.get(DEFAULT)
    if row is None:
        return Limits()
    return Limits(row.max_gpus, row.max_running, row.max_queued)


def holdings(s: Executor, owner: str) -> tuple[int, int]:
    """What ``owner``'s active jobs hold: (jobs, GPUs)."""
    rows = s.execute(
        select(j.device, j.gpus, j.nproc_per_node, j.nnodes).where(
            j.owner == owner, is_active(j.status, SQL)
        )
    ).all()
    return len(rows), sum(held(r.device, r.gpus, r.nproc_per_node, r.nnodes)[0] for r in rows)


def queued(s: Executor, owner: str) -> int:
    return int(
        s.execute(
            select(func.count()).select_from(jobs).where(j.owner == owner, j.status == "queued")
        ).scalar()
        or 0
    )


def refresh(s: Executor, owner: str | None) -> None:
    """Set the flags of ``owner``'s queued jobs from their limits and what they hold."""
    if owner is None:
        return
    lim = limits(s, owner)
    mine = and_(j.owner == owner, j.status == "queued")
    if not lim.holds_back:
        # Nothing to hold back: clear what an earlier limit set (mostly nothing).
        s.execute(
            update(jobs)
            .where(mine, (j.quota_running == True) | (j.quota_gpus == True))  # noqa: E712
            .values(quota_running=False, quota_gpus=False)
        )
        return
    running, gpus = holdings(s, owner)
    at_running = lim.max_running is not None and running >= lim.max_running
    over_gpus: Any = literal(False)
    if lim.max_gpus is not None:
        room = lim.max_gpus - gpus
        over_gpus = case((j.device == "cpu", False), else_=j.nproc_per_node * j.nnodes > room)
    s.execute(update(jobs).where(mine).values(quota_running=at_running, quota_gpus=over_gpus))


def refresh_all(s: Executor) -> None:
    """Every owner with queued jobs (the default limits changed)."""
    owners = s.execute(
        select(j.owner).where(j.status == "queued", j.owner.is_not(None)).distinct()
    ).scalars()
    for owner in list(owners):
        refresh(s, owner)
