"""Sweeps, with the user token: submit one, list them, read one with its trials ranked,
cancel it, export its table. What a sweep decides is service.sweeps'; the views,
service.sweepviews'."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from service import secrets, sweeps, sweepviews
from service.auth import CurrentUser, UserAuth
from service.deps import DB, cursor_of, owner_of, states_of
from service.errors import responses
from service.schemas import INT64_MAX, SweepPublic, SweepSpec, SweepsPublic

router = APIRouter(dependencies=[UserAuth], tags=["sweeps"])
NO_SWEEP = {404: "no such sweep"}
SweepId = Annotated[int, Path(ge=1, le=INT64_MAX, description="the sweep's id")]
STATUSES = ("running", "done", "cancelled")


@router.post(
    "/sweeps",
    status_code=201,
    response_model=SweepPublic,
    responses=responses(
        {
            403: "a member asked for a priority above their cap (quota max_priority)",
        }
    ),
)
async def submit_sweep(spec: SweepSpec, db: DB, me: CurrentUser) -> SweepPublic:
    """Start a sweep: its first trials are queued at once (up to max_concurrent), the
    next ones as trials end, until max_trials; early stopping stops the losers."""
    if spec.job.secrets:  # its owner's own, by name (422 naming one they do not have)
        await run_in_threadpool(secrets.require, db, me.name, spec.job.secrets)
    return await run_in_threadpool(sweeps.create, db, spec, me)


@router.get("/sweeps", response_model=SweepsPublic)
async def list_sweeps(
    db: DB,
    me: CurrentUser,
    status: Annotated[
        str | None, Query(max_length=100, description="comma-separated: running, done, cancelled")
    ] = None,
    user: Annotated[
        str | None, Query(min_length=1, max_length=64, description="only this user's sweeps")
    ] = None,
    mine: Annotated[bool, Query(description="only the sweeps of the token's user")] = False,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=40)] = None,
) -> SweepsPublic:
    """List sweeps, newest first, with their trials' counts and best trial."""
    statuses = states_of(status, STATUSES)
    owner = owner_of(me.name, mine, user, "sweeps")
    items, next_cursor = await run_in_threadpool(
        sweepviews.list_sweeps, db, statuses, owner, limit, cursor_of(cursor)
    )
    return SweepsPublic(items=items, next_cursor=next_cursor)


@router.get("/sweeps/{sweep_id}", response_model=SweepPublic, responses=responses(NO_SWEEP))
async def get_sweep(sweep_id: SweepId, db: DB) -> SweepPublic:
    """One sweep with its trials ranked by its metric: their parameters, state and reason."""
    return await run_in_threadpool(sweepviews.get_sweep, db, sweep_id)


@router.post(
    "/sweeps/{sweep_id}/cancel",
    status_code=202,
    response_model=SweepPublic,
    responses=responses(
        {
            **NO_SWEEP,
            403: "another member's sweep (a member cancels only its own)",
            409: "the sweep has already ended",
        }
    ),
)
async def cancel_sweep(sweep_id: SweepId, db: DB, me: CurrentUser) -> SweepPublic:
    """Cancel a sweep and its trials: queued ones at once, running ones once their
    workers stop them. Its owner or an admin."""
    return await run_in_threadpool(sweeps.cancel, db, sweep_id, me)


@router.get(
    "/sweeps/{sweep_id}/export",
    response_class=Response,
    responses={
        200: {
            "description": "one row per trial, ranked: a column per parameter",
            "content": {
                "text/csv": {"schema": {"type": "string"}},
                "application/json": {"schema": {"type": "object"}},
            },
        },
        **responses(NO_SWEEP),
    },
)
async def export_sweep(
    sweep_id: SweepId,
    db: DB,
    format: Annotated[Literal["csv", "json"], Query(description="csv or json")] = "csv",
) -> Response:
    """The sweep's table (its trials, ranked, with their parameters, metric, state and
    reason) as CSV or JSON."""
    body, media = await run_in_threadpool(sweepviews.export, db, sweep_id, format)
    return Response(body, media_type=media)
