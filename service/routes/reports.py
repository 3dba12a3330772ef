"""What a job's rank 0 sends, with the job token of its attempt."""

from __future__ import annotations

from fastapi import APIRouter

from service import jobs
from service.auth import JobAttempt
from service.deps import DB, JobId
from service.schemas import Accepted, CheckpointIn, CheckpointPublic, MetricsIn

router = APIRouter(tags=["reports"])


@router.post("/jobs/{job_id}/metrics", status_code=202, response_model=Accepted)
def report_metrics(job_id: JobId, body: MetricsIn, attempt: JobAttempt, db: DB) -> Accepted:
    """Add metric points (at most 1000 items a request)."""
    return Accepted(accepted=jobs.ingest_metrics(db, attempt, body))


@router.post("/jobs/{job_id}/checkpoints", status_code=201, response_model=CheckpointPublic)
def report_checkpoint(
    job_id: JobId, body: CheckpointIn, attempt: JobAttempt, db: DB
) -> CheckpointPublic:
    """Register a checkpoint file written inside the job's checkpoint directory."""
    return jobs.register_checkpoint(db, attempt, body)
