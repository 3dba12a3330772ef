"""People: who am I, the users (admins manage them), and the audit trail."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from service import accounts, queue, users
from service.auth import AdminAuth, CurrentAdmin, CurrentUser, UserAuth
from service.deps import DB, cursor_of
from service.errors import responses
from service.models import utcnow
from service.schemas import (
    AccountClosed,
    AuditPublic,
    QuotaIn,
    QuotaPublic,
    QuotasPublic,
    UsagePublic,
    UserIn,
    UserPublic,
    UsersPublic,
    UserWithToken,
    WhoAmI,
)

router = APIRouter(dependencies=[UserAuth], tags=["users"])
admin_router = APIRouter(dependencies=[AdminAuth], tags=["users"])
UserNamePath = Annotated[str, Path(min_length=1, max_length=64)]
NO_USER = {404: "no such user"}


@router.get("/whoami", response_model=WhoAmI)
async def whoami(me: CurrentUser) -> WhoAmI:
    """Who the token belongs to, and their role."""
    return WhoAmI(name=me.name, role=me.role)  # type: ignore[arg-type]


@router.get("/usage", response_model=UsagePublic)
async def get_usage(db: DB) -> UsagePublic:
    """Each user's running and queued jobs, GPU- and CPU-slot-hours over the last day
    and week, and the decayed usage fair share orders by; most used first."""

    def read() -> list[dict[str, object]]:
        with db.read() as s:
            return queue.usage_overview(s, utcnow())

    return UsagePublic.model_validate({"items": await run_in_threadpool(read)})


@admin_router.get("/users", response_model=UsersPublic)
async def list_users(db: DB) -> UsersPublic:
    """Every user, closed accounts too (admins only)."""
    items = await run_in_threadpool(users.list_users, db)
    return UsersPublic.model_validate({"items": items})


@admin_router.post(
    "/users",
    status_code=201,
    response_model=UserWithToken,
    responses=responses({409: "a user of that name exists"}),
)
async def add_user(body: UserIn, db: DB, me: CurrentAdmin) -> UserWithToken:
    """Add a user; the answer holds its token, shown this once (admins only)."""
    user, token = await run_in_threadpool(users.add_user, db, me, body.name, body.role)
    return UserWithToken.model_validate({**user, "token": token})


JobsChoice = Annotated[
    accounts.JobsChoice,
    Query(
        description="what becomes of the user's jobs: cancel-queued (running ones finish), "
        "cancel-all, keep, or transfer (to another user: give to)"
    ),
]
HeirQuery = Annotated[
    str | None,
    Query(min_length=1, max_length=64, description="with jobs=transfer: whose they become"),
]


@admin_router.delete(
    "/users/{name}",
    response_model=AccountClosed,
    responses=responses({**NO_USER, 409: "already closed, or the last admin"}),
)
async def deactivate_user(
    name: UserNamePath, db: DB, me: CurrentAdmin, jobs: JobsChoice = "cancel-queued",
    to: HeirQuery = None,
) -> AccountClosed:  # fmt: skip
    """Close a user's account (admins only): its token is refused at once, every open
    stream of it ends, and its jobs are handled as ``jobs`` says. The account stays, for
    the audit trail and usage history; its name is not given to anyone else."""
    closed = await run_in_threadpool(accounts.deactivate, db, me, name, jobs, to)
    return AccountClosed.model_validate(dataclasses.asdict(closed))


@admin_router.post(
    "/users/{name}/revoke",
    response_model=UserPublic,
    responses=responses({**NO_USER, 409: "already closed, or the last admin"}),
)
async def revoke_user(
    name: UserNamePath, db: DB, me: CurrentAdmin, jobs: JobsChoice = "cancel-queued",
    to: HeirQuery = None,
) -> UserPublic:  # fmt: skip
    """Close a user's account, as DELETE /users/{name} does (its older name); answers
    the user (admins only)."""
    closed = await run_in_threadpool(accounts.deactivate, db, me, name, jobs, to)
    return UserPublic.model_validate(closed.user)


@admin_router.post(
    "/users/{name}/reactivate",
    response_model=UserWithToken,
    responses=responses({**NO_USER, 409: "the account is open"}),
)
async def reactivate_user(name: UserNamePath, db: DB, me: CurrentAdmin) -> UserWithToken:
    """Open a closed account again, with a new token shown this once (admins only)."""
    user, token = await run_in_threadpool(accounts.reactivate, db, me, name)
    return UserWithToken.model_validate({**user, "token": token})


@admin_router.post(
    "/users/{name}/rotate",
    response_model=UserWithToken,
    responses=responses({**NO_USER, 409: "the account is closed"}),
)
async def rotate_user(name: UserNamePath, db: DB, me: CurrentAdmin) -> UserWithToken:
    """A new token for a user, shown this once; the old one is refused at once."""
    user, token = await run_in_threadpool(users.rotate_user, db, me, name)
    return UserWithToken.model_validate({**user, "token": token})


@admin_router.get("/audit", response_model=AuditPublic)
async def get_audit(
    db: DB,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    cursor: Annotated[str | None, Query(max_length=40)] = None,
) -> AuditPublic:
    """Who did what and when, newest first (admins only)."""
    items, next_cursor = await run_in_threadpool(users.audit_trail, db, limit, cursor_of(cursor))
    return AuditPublic.model_validate({"items": items, "next_cursor": next_cursor})


QuotaName = Annotated[
    str, Path(min_length=1, max_length=64, description="a user's name, or * for everyone's")
]


@router.get("/quotas", response_model=QuotasPublic)
async def list_quotas(db: DB) -> QuotasPublic:
    """Every user's limits, and everyone's default (user "*")."""
    return QuotasPublic.model_validate({"items": await run_in_threadpool(users.list_quotas, db)})


@admin_router.put("/quotas/{name}", response_model=QuotaPublic)
async def set_quota(name: QuotaName, body: QuotaIn, db: DB, me: CurrentAdmin) -> QuotaPublic:
    """Set a user's limits, or everyone's default (*): GPUs and jobs at once, jobs
    queued; their queued jobs are held back or let go at once (admins only)."""
    limits = body.model_dump()
    await run_in_threadpool(users.set_quota, db, me, name, limits)
    return QuotaPublic.model_validate({"user": name, **limits})


@admin_router.delete(
    "/quotas/{name}", status_code=204, responses=responses({404: "no quota of that name"})
)
async def clear_quota(name: QuotaName, db: DB, me: CurrentAdmin) -> Response:
    """Remove a user's limits (the default applies again), or the default (admins only)."""
    await run_in_threadpool(users.clear_quota, db, me, name)
    return Response(status_code=204)
