"""What people and their scripts call, with the user token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from service import jobs
from service.auth import UserAuth
from service.deps import DB, JobId, WakeupDep
from service.errors import Invalid
from service.models import JobStatus
from service.schemas import (
    CheckpointsPublic,
    JobPublic,
    JobSpec,
    JobsPublic,
    MetricsPublic,
)

router = APIRouter(dependencies=[UserAuth], tags=["jobs"])


@router.post("/jobs", status_code=201, response_model=JobPublic)
async def submit_job(
    spec: JobSpec,
    db: DB,
    wakeup: WakeupDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    strict: Annotated[
        bool, Query(description="refuse (409) a job no registered worker could ever run")
    ] = False,
) -> JobPublic:
    """Queue a job."""
    job = await run_in_threadpool(jobs.submit_job, db, spec, idempotency_key, strict)
    wakeup.notify()
    return job


@router.get("/jobs", response_model=JobsPublic)
def list_jobs(
    db: DB,
    status: Annotated[
        str | None, Query(max_length=200, description="comma-separated states")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=40)] = None,
) -> JobsPublic:
    """List jobs, newest first."""
    statuses = [s.strip() for s in status.split(",") if s.strip()] if status else []
    valid = {s.value for s in JobStatus}
    for s in statuses:
        if s not in valid:
            raise Invalid(
                ("query", "status"), f"unknown state {s[:40]!r}; one of {', '.join(sorted(valid))}"
            )
    after: int | None = None
    if cursor is not None:
        if not cursor.isdigit() or not 0 < int(cursor) < 2**63:
            raise Invalid(
                ("query", "cursor"), "malformed cursor; pass next_cursor from the previous page"
            )
        after = int(cursor)
    items, next_cursor = jobs.list_jobs(db, statuses, limit, after)
    return JobsPublic(items=items, next_cursor=next_cursor)


@router.get("/jobs/{job_id}", response_model=JobPublic)
def get_job(job_id: JobId, db: DB) -> JobPublic:
    """One job, with its latest metrics and checkpoint."""
    return jobs.get_job(db, job_id)


@router.post("/jobs/{job_id}/cancel", status_code=202, response_model=JobPublic)
async def cancel_job(job_id: JobId, db: DB, wakeup: WakeupDep) -> JobPublic:
    """Cancel a job: at once while queued; once its processes are gone while running."""
    job = await run_in_threadpool(jobs.cancel_job, db, job_id)
    wakeup.notify()
    return job


@router.get("/jobs/{job_id}/metrics", response_model=MetricsPublic)
def job_metrics(
    job_id: JobId,
    db: DB,
    name: Annotated[list[str] | None, Query(max_length=100)] = None,
    since_step: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None,
) -> MetricsPublic:
    """The job's metric history: one point per step, each with the attempt that reported it."""
    return MetricsPublic(items=jobs.metric_history(db, job_id, name or [], since_step))


@router.get("/jobs/{job_id}/checkpoints", response_model=CheckpointsPublic)
def job_checkpoints(job_id: JobId, db: DB) -> CheckpointsPublic:
    """Checkpoints the job registered, oldest first."""
    return CheckpointsPublic(items=jobs.list_checkpoints(db, job_id))


@router.get(
    "/jobs/{job_id}/logs",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "the log from offset"}},
)
def job_logs(
    job_id: JobId,
    db: DB,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> Response:
    """The job's combined output from byte ``offset``; X-Next-Offset says where to resume."""
    data, next_offset, status = jobs.read_log(db, job_id, offset)
    return Response(
        content=data,
        media_type="text/plain; charset=utf-8",
        headers={"X-Next-Offset": str(next_offset), "X-Job-Status": status},
    )
