"""The box at a glance: accounting over any window, and the queue in order."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool

from service import accounting, queueview
from service.auth import UserAuth
from service.deps import DB, cursor_of, states_of
from service.errors import Invalid
from service.models import JobStatus, utcnow
from service.schemas.accounting import AccountingPublic, QueuePublic

router = APIRouter(dependencies=[UserAuth], tags=["box"])

# A window asked without its start: the 30 days before its end.
DEFAULT_WINDOW = timedelta(days=30)


def _aware(t: datetime) -> datetime:
    """A time given without a zone is UTC's."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


@router.get("/accounting", response_model=AccountingPublic)
async def get_accounting(
    db: DB,
    since: Annotated[
        datetime | None,
        Query(
            description="the window's start (ISO 8601; UTC without a zone); default: "
            "30 days before its end"
        ),
    ] = None,
    until: Annotated[datetime | None, Query(description="the window's end (default: now)")] = None,
    per: Annotated[
        Literal["job", "attempt"], Query(description="a row per job, or per attempt")
    ] = "job",
    user: Annotated[
        str | None, Query(min_length=1, max_length=64, description="only this user's jobs")
    ] = None,
    status: Annotated[
        str | None, Query(max_length=200, description="only jobs in these states (comma-separated)")
    ] = None,
    worker: Annotated[
        str | None,
        Query(min_length=1, max_length=200, description="only attempts on this worker"),
    ] = None,
    sweep: Annotated[
        int | None, Query(ge=1, le=2**62, description="only this sweep's trials")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=40)] = None,
) -> AccountingPublic:
    """What each job (or attempt) ran and held in a window: elapsed, queued time, GPU-
    and CPU-slot-hours inside the window, exit and reason, attempts and preemptions; and
    each user's totals over every matching row (``ddpq acct``)."""
    end = _aware(until) if until is not None else utcnow()
    start = _aware(since) if since is not None else end - DEFAULT_WINDOW
    if start >= end:
        raise Invalid(("query", "since"), f"must be before the window's end ({end.isoformat()})")
    q = accounting.Query(
        since=start,
        until=end,
        per=per,
        user=user,
        states=tuple(states_of(status, (s.value for s in JobStatus))),
        worker=worker,
        sweep=sweep,
        limit=limit,
        cursor=cursor_of(cursor),
    )
    return await run_in_threadpool(accounting.report, db, q)


@router.get("/queue", response_model=QueuePublic)
async def get_queue(
    db: DB,
    user: Annotated[
        str | None, Query(min_length=1, max_length=64, description="only this user's jobs")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**7)] = 0,
) -> QueuePublic:
    """The queued jobs in the order the claims try them (``ddpq queue``): each one's
    place, priority, its owner's recent usage, why it is ahead of the next, what it
    waits for, and when it would start if every job ran to its time limit."""
    return await run_in_threadpool(queueview.view, db, limit, offset, user)
