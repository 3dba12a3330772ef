"""The box at a glance: accounting over any window, the queue in order, and holding,
releasing and changing a queued job."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from fastapi.concurrency import run_in_threadpool

from service import accounting, holds, queueview
from service.auth import CurrentUser, UserAuth
from service.deps import DB, JobId, cursor_of, states_of
from service.errors import Invalid, responses
from service.models import JobStatus, utcnow
from service.schemas import JobChange, JobPublic
from service.schemas.accounting import AccountingPublic, QueuePublic

router = APIRouter(dependencies=[UserAuth])

# A window asked without its start: the 30 days before its end.
DEFAULT_WINDOW = timedelta(days=30)


def _aware(t: datetime) -> datetime:
    """A time given without a zone is UTC's."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


@router.get("/accounting", tags=["box"], response_model=AccountingPublic)
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
) -> Response:
    """What each job (or attempt) ran and held in a window, newest first: elapsed,
    queued time, GPU- and CPU-slot-hours inside the window, exit and reason, attempts
    and preemptions; and each user's totals over every matching row (``ddpq acct``). A
    job is in the window if it was in ddpq's hands in it (submitted before its end, not
    ended before its start); an attempt, if it ran in it."""
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
    # Serialised once, here (as GET /jobs/{id}): a returned model is validated again,
    # then encoded; a page of 100 rows cost 5-10 ms more that way.
    report = await run_in_threadpool(accounting.report, db, q)
    return Response(report.model_dump_json(), media_type="application/json")


@router.get("/queue", tags=["box"], response_model=QueuePublic)
async def get_queue(
    db: DB,
    user: Annotated[
        str | None, Query(min_length=1, max_length=64, description="only this user's jobs")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**7)] = 0,
) -> Response:
    """The queued jobs in the order the claims try them (``ddpq queue``): each one's
    place, priority, its owner's recent usage, why it is ahead of the next, what it
    waits for, and when it would start if every job ran to its time limit."""
    view = await run_in_threadpool(queueview.view, db, limit, offset, user)
    return Response(view.model_dump_json(), media_type="application/json")  # once


# ---- hold, release, change ------------------------------------------------------------

_MINE = {
    404: "no such job",
    403: "another member's job (a member holds, releases and changes only their own), or "
    "a hold an admin placed",
}


@router.post(
    "/jobs/{job_id}/hold",
    tags=["jobs"],
    response_model=JobPublic,
    responses=responses({**_MINE, 409: "the job is not queued"}),
)
async def hold_job(job_id: JobId, db: DB, me: CurrentUser) -> JobPublic:
    """Hold a queued job back (`ddpq hold`): no worker takes it until it is released; it
    keeps its id and its place, and counts against its owner's queued limit."""
    return await run_in_threadpool(holds.hold, db, job_id, me)


@router.post(
    "/jobs/{job_id}/release",
    tags=["jobs"],
    response_model=JobPublic,
    responses=responses({**_MINE, 409: "the job is not held"}),
)
async def release_job(job_id: JobId, db: DB, me: CurrentUser) -> JobPublic:
    """Release a held job (`ddpq release`): it waits again in its place."""
    return await run_in_threadpool(holds.release, db, job_id, me)


@router.patch(
    "/jobs/{job_id}",
    tags=["jobs"],
    response_model=JobPublic,
    responses=responses({**_MINE, 409: "the job is neither queued nor held"}),
)
async def change_job(job_id: JobId, body: JobChange, db: DB, me: CurrentUser) -> JobPublic:
    """Change a queued or held job (`ddpq update`): its priority (a member within their
    cap), time limit (0: none) or world size. It keeps its id; a new priority moves it."""
    change = holds.Change(body.priority, body.timeout_s, body.world_size)
    return await run_in_threadpool(holds.update, db, job_id, me, change)
