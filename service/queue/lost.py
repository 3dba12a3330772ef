"""Attempts lost: a lease that ran out (``expire_leases``, ``expire_nodes``, run by the
sweeper of the API process holding the turn, at ``lease_due``), a worker that registered
again without them (``release_worker``). Each loss decides on rows locked as it is made
(``_lose``): a finish, a cancel or a heartbeat may have committed since the look.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, tuple_
from sqlalchemy.orm import Session

from service.db import STALL_S, Database
from service.models import ACTIVE, Attempt, Job, JobNode, JobStatus, utcnow
from service.queue import states
from service.queue.gangs import release_nodes
from service.queue.leases import lost
from service.queue.rules import NODE_LIVE, as_utc, j, jn, started

# A job's current attempt, still running: what a lease sweep may lose.
_CURRENT = and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt)
_HELD = (Job.status.in_(list(ACTIVE)), Attempt.ended_at.is_(None))
# The soonest lease of such an attempt or of a live node slot: the rows the sweeps below
# look at (_FIND_CURRENT, expire_nodes).
_SOONEST = (
    select(func.min(Attempt.heartbeat_at)).join(Job, _CURRENT).where(*_HELD).scalar_subquery(),
    select(func.min(jn.heartbeat_at)).where(NODE_LIVE).scalar_subquery(),
)


def lease_due(db: Database, lease_s: float, now: datetime | None = None) -> float | None:
    """Seconds from ``now`` until the soonest lease held runs out (0 or less: it had by
    then); None when no lease is held. Heartbeats only move it later, so the sweeper
    sleeps until then."""
    with db.read() as s:
        held = [as_utc(t) for t in s.execute(select(*_SOONEST)).one() if t is not None]
    if not held:
        return None
    return (min(held) + timedelta(seconds=lease_s) - (now or utcnow())).total_seconds()


def expire_leases(db: Database, lease_s: float, now: datetime | None = None) -> list[int]:
    """Mark attempts without a heartbeat for ``lease_s`` (by ``now``) lost; requeue or
    fail their jobs."""
    cutoff = (now or utcnow()) - timedelta(seconds=lease_s)
    return _lose_attempts(
        db,
        Attempt.heartbeat_at < cutoff,
        lambda worker: f"worker {worker} lost (no heartbeat for {lease_s:g} s)",
        lambda: db.health.up_for(lease_s),
    )


def release_worker(db: Database, worker: str, keep: list[tuple[int, int]]) -> list[int]:
    """Lose the attempts the books give ``worker`` except those it says it still runs
    (a multi-node attempt with a node on it too), and release its forming node slots."""
    its_nodes = select(JobNode.job_id, JobNode.attempt).where(
        JobNode.worker == worker, JobNode.ended_at.is_(None)
    )
    which = or_(Attempt.worker == worker, tuple_(Attempt.job_id, Attempt.number).in_(its_nodes))
    if keep:
        which = and_(which, tuple_(Attempt.job_id, Attempt.number).not_in(keep))
    changed = _lose_attempts(db, which, lambda _: f"worker {worker} restarted without it")
    forming_here = [jn.worker == worker]
    if keep:
        forming_here.append(tuple_(jn.job_id, jn.attempt).not_in(keep))
    release_nodes(db, *forming_here)
    return changed


def expire_nodes(db: Database, lease_s: float, now: datetime | None = None) -> list[int]:
    """Node slots without a heartbeat for ``lease_s`` (by ``now``): a running attempt is
    lost as a whole (its other nodes are told to stop at their next heartbeat); a forming
    slot is released."""
    cutoff = (now or utcnow()) - timedelta(seconds=lease_s)
    changed: list[int] = []
    running_stale = select(jn.job_id, jn.attempt, jn.worker, jn.node_rank, j.nnodes).where(
        NODE_LIVE, j.status != JobStatus.QUEUED, jn.heartbeat_at < cutoff
    )
    with db.read() as s:
        stale = s.execute(running_stale).all()
    for job_id, number, worker, rank, nnodes in stale:
        words = f"worker {worker} (node {rank} of {nnodes}) lost (no heartbeat for {lease_s:g} s)"
        changed += _lose_attempts(
            db,
            and_(Attempt.job_id == job_id, Attempt.number == number),
            lambda _, words=words: words,  # type: ignore[misc]
            lambda: db.health.up_for(lease_s),
        )
    release_nodes(db, jn.heartbeat_at < cutoff)
    return changed


_FIND_CURRENT = (
    select(Job.id, Job.attempt, Attempt.worker, Attempt.id)
    .join(Attempt, _CURRENT)
    .where(*_HELD)
    .order_by(Job.id)  # the lock order: job rows by ascending id
)


def _lose_attempts(
    db: Database,
    which: Any,
    why: Callable[[str], str],
    settled: Callable[[], bool] | None = None,
) -> list[int]:
    """Mark the current attempts that match ``which`` lost; requeue or fail their jobs.
    ``settled`` is asked again inside the write transaction, and a transaction that
    stalled to get there (it waited out an outage) acts on nothing: the heartbeats the
    outage held up have not arrived yet."""
    find_stale = _FIND_CURRENT.where(which)
    # Look first without the write lock: nearly every sweep finds nothing.
    with db.read() as s:
        stale = s.execute(find_stale).all()
    changed: list[int] = []
    # Each in a transaction of its own: losing one takes its owner's lock (states.end),
    # and a finish holding the next one's job row may be waiting for that very lock.
    for job_id, number, worker, attempt_id in stale:
        began = time.monotonic()
        with db.write() as s:
            if settled is not None and (time.monotonic() - began > STALL_S or not settled()):
                return changed
            if _lose(s, job_id, number, attempt_id, which, why(worker)):
                changed.append(job_id)  # states.end woke the claimers
    return changed


def _lose(s: Session, job_id: int, number: int, attempt_id: int, which: Any, words: str) -> bool:
    """Lose one attempt, deciding on rows locked now, not on the look: a finish, a cancel
    or a heartbeat may have committed since. Job row first, then its attempt,
    re-checking ``which`` (Postgres re-reads a row it waited for)."""
    job = s.scalars(
        select(Job)
        .where(Job.id == job_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()
    if job is None or not started(job.status, job.attempt, number):
        return False
    attempt = s.scalars(
        select(Attempt)
        .where(Attempt.id == attempt_id, Attempt.ended_at.is_(None), which)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()
    if attempt is None:
        return False
    ending = lost(job.status, number, job.failures, job.max_attempts, words)
    states.end(s, job, attempt, ending.event, utcnow(), ending.reason)
    return True
