"""What people and their scripts call, with the user token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from service import checkpoints, gpus, jobs, logs, metrics, outputs, secrets, streams
from service.auth import CurrentUser, UserAuth, Watched
from service.deps import DB, JobId, SettingsDep, cursor_of, gone, owner_of, states_of
from service.errors import Invalid, responses
from service.models import JobStatus
from service.schemas import (
    INT64_MAX,
    MAX_METRIC_NAMES,
    MAX_NAME_CHARS,
    AttemptsPublic,
    CheckpointPublic,
    CheckpointsPublic,
    IdempotencyKey,
    JobGpusPublic,
    JobPublic,
    JobSpec,
    JobsPublic,
    MetricsPublic,
    OutputsPublic,
)

router = APIRouter(dependencies=[UserAuth], tags=["jobs"])
NO_JOB = {404: "no such job"}


@router.post(
    "/jobs",
    status_code=201,
    response_model=JobPublic,
    responses=responses(
        {
            409: "the Idempotency-Key was used with another body, or strict=true and no "
            "registered worker could ever run the job",
            403: "a member asked for a priority above their cap (quota max_priority)",
            429: "its owner has as many jobs queued as their quota allows",
        }
    ),
)
async def submit_job(
    spec: JobSpec,
    db: DB,
    me: CurrentUser,
    idempotency_key: Annotated[
        IdempotencyKey | None,
        Header(
            description="1 to 200 printable ASCII characters: a repeat with the same body "
            "answers the first job, one with another body 409"
        ),
    ] = None,
    strict: Annotated[
        bool, Query(description="refuse (409) a job no registered worker could ever run")
    ] = False,
) -> JobPublic:
    """Queue a job."""
    if spec.secrets:  # its owner's own, by name (422 naming one they do not have)
        await run_in_threadpool(secrets.require, db, me.name, spec.secrets)
    # Claimers are woken as it commits (queue.notify_claimers).
    return await run_in_threadpool(
        jobs.submit_job, db, spec, idempotency_key, strict, me.name, me.admin
    )


@router.get("/jobs", response_model=JobsPublic)
def list_jobs(
    db: DB,
    me: CurrentUser,
    status: Annotated[
        str | None, Query(max_length=200, description="comma-separated states")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=40)] = None,
    name: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=200,
            description="only jobs whose name or program (recipe or entrypoint) contains "
            "this, in any case",
        ),
    ] = None,
    user: Annotated[
        str | None, Query(min_length=1, max_length=64, description="only this user's jobs")
    ] = None,
    mine: Annotated[bool, Query(description="only the jobs of the token's user")] = False,
) -> JobsPublic:
    """List jobs, newest first."""
    statuses = states_of(status, (s.value for s in JobStatus))
    owner = owner_of(me.name, mine, user, "jobs")
    items, next_cursor = jobs.list_jobs(db, statuses, limit, cursor_of(cursor), name, owner)
    return JobsPublic(items=items, next_cursor=next_cursor)


@router.get("/jobs/{job_id}", response_model=JobPublic, responses=responses(NO_JOB))
async def get_job(job_id: JobId, db: DB) -> Response:
    """One job, with its latest metrics and checkpoint."""
    # Serialised once, here: a returned model is validated again and then encoded
    # (the most polled route: dashboards, `ddpq watch`, scripts).
    if db.dialect == "sqlite":
        # On the event loop: a WAL reader never waits for a writer, and the hop to a
        # worker thread cost more than these few primary-key reads (bench/api.py:
        # ~750 -> ~1,600 requests/s on 2 cores). Postgres reads cross the network.
        job = jobs.get_job(db, job_id)
    else:
        job = await run_in_threadpool(jobs.get_job, db, job_id)
    return Response(job.model_dump_json(), media_type="application/json")


@router.post(
    "/jobs/{job_id}/cancel",
    status_code=202,
    response_model=JobPublic,
    responses=responses(
        {
            **NO_JOB,
            403: "another member's job (a member cancels only its own)",
            409: "the job has already ended",
        }
    ),
)
async def cancel_job(job_id: JobId, db: DB, me: CurrentUser) -> JobPublic:
    """Cancel a job: at once while queued; once its processes are gone while running.
    A member may cancel its own jobs, an admin any."""
    # A queued job's cancel wakes claimers as it commits (jobs.cancel_job).
    return await run_in_threadpool(jobs.cancel_job, db, job_id, me)


@router.get(
    "/jobs/{job_id}/metrics",
    response_model=MetricsPublic,
    responses={200: {"description": "one item per step, oldest first"}, **responses(NO_JOB)},
)
async def get_job_metrics(
    job_id: JobId,
    db: DB,
    name: Annotated[
        list[str] | None,
        Query(description="a metric name; repeat the parameter for several (no comma lists)"),
    ] = None,
    since_step: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None,
    max_points: Annotated[
        int | None,
        Query(
            ge=2,
            le=metrics.MAX_POINTS,
            description="downsample: at most this many points per metric, each bucket's "
            "minimum and maximum kept, and the first and last point",
        ),
    ] = None,
) -> Response:
    """The job's metric history: one item per step, each with the attempt that reported it."""
    names = name or []
    if len(names) > MAX_METRIC_NAMES:
        raise Invalid(("query", "name"), f"at most {MAX_METRIC_NAMES} names")
    for n in names:
        # Printable: a NUL would reach Postgres (which refuses it with an error, a 500).
        if not 0 < len(n) <= MAX_NAME_CHARS or not n.isprintable():
            raise Invalid(
                ("query", "name"), f"a name has 1 to {MAX_NAME_CHARS} printable characters"
            )
    items, series = await run_in_threadpool(
        metrics.history, db, job_id, names, since_step, max_points
    )
    # Serialised here, not through MetricsPublic: the same shape, seconds faster for 10^5 points.
    return Response(metrics.to_json(items, series), media_type="application/json")


@router.get("/jobs/{job_id}/gpus", response_model=JobGpusPublic, responses=responses(NO_JOB))
async def get_job_gpus(
    job_id: JobId,
    db: DB,
    max_points: Annotated[
        int,
        Query(
            ge=0,
            le=10_000,
            description="at most this many samples of each GPU's history, evenly spread, "
            "the latest kept (0: the latest sample only)",
        ),
    ] = 500,
) -> JobGpusPublic:
    """The job's system metrics: each GPU its attempts held, its utilisation and memory
    as its worker sampled them (NVML), latest and history; none without NVML."""
    return JobGpusPublic(items=await run_in_threadpool(gpus.history, db, job_id, max_points))


@router.get("/jobs/{job_id}/attempts", response_model=AttemptsPublic, responses=responses(NO_JOB))
async def list_job_attempts(job_id: JobId, db: DB) -> AttemptsPublic:
    """Every attempt of the job, oldest first: worker, GPUs, start, end, exit code, why."""
    return AttemptsPublic(items=await run_in_threadpool(metrics.attempts, db, job_id))


@router.get(
    "/jobs/{job_id}/events",
    response_class=StreamingResponse,
    description=streams.__doc__,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "server-sent events: job, metrics, end (then the stream "
            "closes); revoked when its token stops working meanwhile (then it closes)",
        },
        **responses(NO_JOB),
    },
)
async def get_job_events(
    job_id: JobId,
    request: Request,
    db: DB,
    settings: SettingsDep,
    watch: Watched,
    since: Annotated[
        str | None,
        Query(max_length=40, description="resume after this event id (or 0: every point)"),
    ] = None,
    last_event_id: Annotated[str | None, Header(max_length=40)] = None,
) -> StreamingResponse:
    """Status changes and new metric points as server-sent events, until the job ends."""
    cursor = streams.parse_cursor(last_event_id, ("header", "Last-Event-ID"))
    if cursor is None:
        cursor = streams.parse_cursor(since, ("query", "since"))
    first = await run_in_threadpool(streams.poll, db, job_id, cursor.seq if cursor else None)
    return StreamingResponse(
        streams.events(
            db,
            job_id,
            first,
            cursor.job if cursor else None,
            settings.events_poll_s,
            gone(request),
            watch.refused,
        ),
        media_type="text/event-stream",
        headers=_STREAM_HEADERS,
    )


@router.get(
    "/jobs/{job_id}/checkpoints", response_model=CheckpointsPublic, responses=responses(NO_JOB)
)
def list_job_checkpoints(job_id: JobId, db: DB) -> CheckpointsPublic:
    """Checkpoints the job registered, oldest first, each kept, pruning, pruned or refused."""
    return CheckpointsPublic(items=checkpoints.list_checkpoints(db, job_id))


@router.post(
    "/jobs/{job_id}/checkpoints/{checkpoint_id}/send",
    status_code=202,
    response_model=CheckpointPublic,
    responses=responses(
        {404: "no such job, or no such checkpoint of it kept", 409: "its worker is not known"}
    ),
)
def send_job_checkpoint(
    job_id: JobId,
    checkpoint_id: Annotated[int, Path(ge=1, le=INT64_MAX, description="the checkpoint's id")],
    db: DB,
) -> CheckpointPublic:
    """Ask for a kept checkpoint to be sent to the API by the worker that holds it (at
    its next heartbeat): once ``snapshot`` is set, GET /code/snapshots/{id} lists its
    files (a download), or ``send_problem`` says why not. A fork (``from_checkpoint``)
    asks by itself."""
    return checkpoints.ask_send(db, job_id, checkpoint_id)


@router.get("/jobs/{job_id}/outputs", response_model=OutputsPublic, responses=responses(NO_JOB))
def list_job_outputs(job_id: JobId, db: DB, settings: SettingsDep) -> OutputsPublic:
    """What the job wrote in its directory that was not in its code, and until when it is
    kept (each file's content: GET /code/blobs/{digest})."""
    return outputs.listing(db, job_id, settings.outputs_limits())


# No caching, and no buffering by a proxy (nginx honours X-Accel-Buffering).
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.get(
    "/jobs/{job_id}/logs",
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "the log from offset; with follow=true, streamed until the job "
            "ends (or its token stops working: a last line [ddpq] says so)",
            "headers": {
                "X-Next-Offset": {
                    "description": "where to resume (absent when following)",
                    "schema": {"type": "integer"},
                },
                "X-Job-Status": {
                    "description": "the job's status when the answer started",
                    "schema": {"type": "string", "enum": [s.value for s in JobStatus]},
                },
            },
        },
        **responses(NO_JOB),
    },
)
async def get_job_logs(
    job_id: JobId,
    request: Request,
    db: DB,
    watch: Watched,
    offset: Annotated[
        int, Query(ge=0, le=2**63 - 1, description="a byte offset: 0, or an X-Next-Offset")
    ] = 0,
    follow: Annotated[
        bool, Query(description="stream new output as it arrives, until the job ends")
    ] = False,
) -> Response:
    """The job's combined output (every line marked [rankN] or [ddpq]) from byte ``offset``."""
    if not follow:
        got = await run_in_threadpool(logs.read, db, job_id, offset)
        return Response(
            content=got.data,
            media_type="text/plain; charset=utf-8",
            headers={"X-Next-Offset": str(got.next_offset), "X-Job-Status": got.status},
        )
    first = await run_in_threadpool(logs.read, db, job_id, offset, past_end_ok=True)
    return StreamingResponse(
        logs.follow(db, job_id, first, gone(request), watch.refused),
        media_type="text/plain; charset=utf-8",
        headers={**_STREAM_HEADERS, "X-Job-Status": first.status},
    )
