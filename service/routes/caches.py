"""Users' caches on the workers (user token): list them, ask for them to be cleared. The
rule (who may see and clear whose) is service.caches'; the workers do the clearing."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool

from service import caches
from service.auth import CurrentUser, UserAuth
from service.deps import DB
from service.errors import responses
from service.schemas import CacheClearIn, CachesCleared, CachesPublic

router = APIRouter(dependencies=[UserAuth], tags=["caches"])

NOT_YOURS = {403: "a member named another user's caches"}


async def _orders(request: Request) -> caches.Orders:
    orders: caches.Orders = request.app.state.cache_orders
    return orders


Orders = Annotated[caches.Orders, Depends(_orders)]
UserQuery = Annotated[
    str | None,
    Query(
        pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$",
        description="whose (a member: their own; an admin: anyone's, everyone's when absent)",
    ),
]
WorkerQuery = Annotated[
    str | None,
    Query(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$", description="one worker's"),
]


@router.get("/caches", response_model=CachesPublic, responses=responses(NOT_YOURS))
async def list_caches(
    db: DB, me: CurrentUser, user: UserQuery = None, worker: WorkerQuery = None
) -> Any:
    """Each user's caches on each worker (inductor, Triton, Hugging Face, torch hub,
    matplotlib: kept across that user's jobs there), as the worker last reported them:
    bytes, files, when last used, and whether a clear is on its way."""
    return {"items": await run_in_threadpool(caches.listing, db, me, user, worker)}


@router.post(
    "/caches/clear",
    status_code=202,
    response_model=CachesCleared,
    responses=responses(NOT_YOURS),
)
async def clear_caches(body: CacheClearIn, db: DB, me: CurrentUser, orders: Orders) -> Any:
    """Ask the workers to clear a user's caches (yours unless an admin names another): each
    worker that reported one does it at its next heartbeat, or when the job that uses it
    now ends. The answer lists the caches asked for (none: no worker has one). A worker
    or user that does not exist is a 422 naming the field."""
    items = await run_in_threadpool(caches.clear, db, orders, me, body.user, body.worker)
    return {"items": items}
