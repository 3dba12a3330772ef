"""People: users and their tokens (shown once), who a token is, the audit trail, what
each user holds and used, and their quotas."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from service.schemas.common import Strict

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
    revoked_at: datetime | None


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
    # submit, cancel, user.add, user.revoke, user.rotate
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


class QuotaIn(Strict):
    """PUT /quotas/{name}: a user's limits (null: no limit)."""

    max_gpus: QuotaLimit = None
    max_running: QuotaLimit = None
    max_queued: QuotaLimit = None


class QuotaPublic(BaseModel):
    # A user's name, or "*": everyone's default (a user's own row wins whole)
    user: str
    max_gpus: int | None
    max_running: int | None
    max_queued: int | None


class QuotasPublic(BaseModel):
    items: list[QuotaPublic]
