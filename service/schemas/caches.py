"""Users' caches on the workers (service.caches), as people list and clear them. (What a
worker's heartbeat reports of them and of the clear orders it did is the worker
protocol's: ddpq.messages.)"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field

from ddpq.messages import CacheUser, Strict


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
