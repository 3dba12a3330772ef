"""People: users and their tokens (shown once), who a token is, the audit trail, what
each user holds and used, and their quotas."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from ddpq.messages import Strict

UserName = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class UserIn(Strict):
    """POST /users: a new user (its name is checked by service.users.name_problem)."""

    name: UserName
    role: Literal["admin", "member"] = "member"


class UserPublic(BaseModel):
    name: str
    role: Literal["admin", "member"]
    # The token's first characters (never the token): to tell tokens apart.
    token_hint: str
    created_at: datetime
    # When the account was closed (its token refused from then on), and by which admin
    revoked_at: datetime | None
    state: Literal["active", "deactivated"] = "active"
    deactivated_by: str | None = None


class AccountClosed(BaseModel):
    """DELETE /users/{name}: the closed account, and what became of its jobs (ids)."""

    user: UserPublic
    # What the admin chose: cancel-queued (running ones finish), cancel-all, keep,
    # transfer (to: whose they became)
    jobs: Literal["cancel-queued", "cancel-all", "keep", "transfer"]
    to: str | None
    cancelled: list[int]  # queued: cancelled at once
    cancelling: list[int]  # running: their workers stop them
    transferred: list[int]
    kept: list[int]  # running as theirs (cancel-queued, keep), or being cancelled already


class UserWithToken(UserPublic):
    """A user and its token: the only answer that ever holds it (add, rotate)."""

    token: str


class UsersPublic(BaseModel):
    items: list[UserPublic]


class WhoAmI(BaseModel):
    name: str
    role: Literal["admin", "member"]


class AuditEventPublic(BaseModel):
    id: int
    at: datetime
    actor: str
    # submit, cancel, user.add, user.rotate, user.deactivate, user.reactivate, quota.set,
    # quota.clear, preempt, secret.set, secret.delete, refused.ACTION (a 403: who tried what)
    action: str
    target: str
    detail: dict[str, Any]


class AuditPublic(BaseModel):
    items: list[AuditEventPublic]
    next_cursor: str | None


class UserUsagePublic(BaseModel):
    """What one user holds and used (GET /usage)."""

    user: str
    running: int
    queued: int
    # GPU-hours and CPU-slot-hours their attempts held over the last day and week
    gpu_hours_1d: float
    gpu_hours_7d: float
    cpu_slot_hours_1d: float
    cpu_slot_hours_7d: float
    # What fair share orders by: GPU-equivalent seconds (a CPU slot counts
    # DDPQ_CPU_SLOT_WEIGHT of a GPU), decayed with DDPQ_FAIRSHARE_HALF_LIFE_S
    usage_gpu_s: float


class UsagePublic(BaseModel):
    items: list[UserUsagePublic]


QuotaLimit = Annotated[int | None, Field(strict=True, ge=0, le=1_000_000)]


# The highest priority a member may give a job (the bounds of a job's priority).
PriorityCap = Annotated[int | None, Field(strict=True, ge=-1_000_000, le=1_000_000)]


class QuotaIn(Strict):
    """PUT /quotas/{name}: a user's limits (null: no limit). ``max_priority``: the
    highest priority a member may give a job (null: the default row's, else 0; admins
    have no cap); lowering it lowers their jobs queued or running above it."""

    max_gpus: QuotaLimit = None
    max_running: QuotaLimit = None
    max_queued: QuotaLimit = None
    max_priority: PriorityCap = None


class QuotaPublic(BaseModel):
    # A user's name, or "*": everyone's default (a user's own row wins whole for the
    # three limits; max_priority falls back to the default's on its own, then 0)
    user: str
    max_gpus: int | None
    max_running: int | None
    max_queued: int | None
    max_priority: int | None = None


class QuotasPublic(BaseModel):
    items: list[QuotaPublic]
