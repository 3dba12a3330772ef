"""Users' caches on the workers (service.caches): what a worker's heartbeat reports of
them and of the clear orders it did, and what people list and clear."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from service.schemas.common import INT64_MAX, Strict

# A user's name as service.users.NAME has it: the worker's directory of their cache.
CacheUser = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
# The caches one heartbeat reports (worker.caches.MAX_REPORTED: the most recently used).
MAX_CACHES = 1000
MAX_IDLE_S = 10 * 366 * 86400
Count = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]


class CacheUsage(Strict):
    """One user's cache on the reporting worker, as its last attempt left it."""

    user: CacheUser
    bytes: Count
    files: Count
    # How long before the heartbeat it was last used (an attempt gave it back): the
    # service dates it by its own clock, as it does GPU samples.
    idle_s: Annotated[float, Field(strict=True, ge=0, le=MAX_IDLE_S, allow_inf_nan=False)]


class CacheCleared(Strict):
    """What a worker did with a clear order (HeartbeatReply.clear): cleared, or missing
    (it held no cache of that user)."""

    id: Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
    outcome: Literal["cleared", "missing"]


class CacheClearIn(Strict):
    """POST /caches/clear: whose caches (the token's user's when absent; an admin may name
    anyone), on which worker (every worker holding one when absent)."""

    user: CacheUser | None = None
    worker: (
        Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")] | None
    ) = None


class CachePublic(BaseModel):
    """One user's cache on one worker, as that worker last reported it."""

    worker: str
    user: str
    bytes: int
    files: int
    last_used: datetime
    reported_at: datetime
    # A clear was asked and the worker has not done it yet (at its next heartbeat, or
    # when the attempt that holds the cache ends).
    clearing: bool = False


class CachesPublic(BaseModel):
    items: list[CachePublic]


class CachesCleared(BaseModel):
    """POST /caches/clear: the caches asked to be cleared (none: none was known)."""

    items: list[CachePublic]
