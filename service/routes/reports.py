"""What a job's rank 0 sends, with the job token of its attempt."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from service import ingest, jobs, logs, sweeps
from service.auth import JobAttempt
from service.db import Database
from service.deps import DB, LOG_CHUNK_BODY, LOG_CHUNK_TOO_BIG, JobId, log_chunk
from service.errors import not_utf8_json, responses
from service.models import Attempt
from service.schemas import (
    MAX_WORLD_SIZE,
    CheckpointIn,
    CheckpointPublic,
    LogAppended,
    MetricsAccepted,
    MetricsIn,
)

router = APIRouter(tags=["reports"])
# The token names the attempt; it may end (a finish, a lost lease) between the gate's
# check and the write.
FENCED = {409: "the token's attempt is no longer the job's current one"}


def _standalone(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema with its local ``$defs`` references written out in place."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    result: dict[str, Any] = resolve(schema)
    return result


# The body is read raw and validated by pydantic's JSON parser, so the schema is
# declared here for /docs and the OpenAPI document.
_METRICS_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _standalone(MetricsIn.model_json_schema())}},
    }
}


def _ingest(db: Database, attempt: Attempt, raw: bytes) -> tuple[int, int | None]:
    """Store the body's points: how many items, and the newest step among them."""
    # Straight from JSON: a batch of 1000 items parsed by json.loads and validated as
    # Python objects (FastAPI's way) cost more than storing it (bench/api.py). The
    # shape ddpq.train sends is read without a model per item (ingest.parse_points);
    # anything else, malformed bodies included, goes through MetricsIn and its errors.
    points = ingest.parse_points(raw)
    if points is None:
        try:
            body = MetricsIn.model_validate_json(raw)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                errors = [not_utf8_json(bad)]
            raise RequestValidationError(errors) from None
        points = ingest.points_of(body)
    return ingest.store_points(db, attempt, points), max(points.steps, default=None)


@router.post(
    "/jobs/{job_id}/metrics",
    status_code=202,
    response_model=MetricsAccepted,
    openapi_extra=_METRICS_BODY,
    responses=responses(FENCED),
)
async def report_metrics(
    job_id: JobId,
    request: Request,
    attempt: JobAttempt,
    db: DB,
    judge: Annotated[
        bool,
        Query(
            description="the points reach a rung of the job's sweep (its spec's `rungs`): "
            "judge the trial now; the answer's `stop` says if it was pruned"
        ),
    ] = False,
) -> MetricsAccepted:
    """Add metric points (at most 1000 items a request)."""
    raw = await request.body()
    accepted, newest = await run_in_threadpool(_ingest, db, attempt, raw)
    stop = None
    if judge and newest is not None:
        stop = await run_in_threadpool(sweeps.judge, db, attempt.job_id, newest)
    return MetricsAccepted(accepted=accepted, stop=stop)


@router.post(
    "/jobs/{job_id}/checkpoints",
    status_code=201,
    response_model=CheckpointPublic,
    responses=responses(FENCED),
)
def report_checkpoint(
    job_id: JobId, body: CheckpointIn, attempt: JobAttempt, db: DB
) -> CheckpointPublic:
    """Register a checkpoint file written inside the job's checkpoint directory."""
    return jobs.register_checkpoint(db, attempt, body)


@router.post(
    "/jobs/{job_id}/logs",
    status_code=202,
    response_model=LogAppended,
    openapi_extra=LOG_CHUNK_BODY,
    responses=responses(
        {
            **LOG_CHUNK_TOO_BIG,
            # (422, as a validation error, also when node is not one of the job's nodes)
            409: "the token's attempt is no longer the job's current one, or the chunk "
            "starts past what is stored of this node's output",
        }
    ),
)
async def report_log(
    job_id: JobId,
    request: Request,
    attempt: JobAttempt,
    db: DB,
    node: Annotated[int, Query(ge=0, lt=MAX_WORLD_SIZE)],
    offset: Annotated[int, Query(ge=0, le=2**62)],
) -> LogAppended:
    """Append raw output bytes of one node of the token's attempt, starting at
    ``offset`` of that node's own stream (each node of a Slurm attempt ships its own;
    the lines carry their global rank)."""
    data = await log_chunk(request)
    stored = await run_in_threadpool(
        logs.append_node, db, attempt.id, job_id, attempt.number, node, offset, data
    )
    return LogAppended(next_offset=stored)
