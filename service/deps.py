"""Annotated dependencies the route handlers share.

They are ``async def`` although they never await: FastAPI runs a plain ``def``
dependency on its thread pool, a thread hop per dependency per request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Path, Request

from service.config import Settings
from service.db import Database
from service.schemas import INT64_MAX
from service.wakeup import Wakeup


async def _db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _wakeup(request: Request) -> Wakeup:
    wakeup: Wakeup = request.app.state.wakeup
    return wakeup


def gone(request: Request) -> Callable[[], Awaitable[bool]]:
    """Whether a long answer (a stream, a long-poll) should end now: its client left, or
    this process is stopping (uvicorn waits for open answers before it exits; the
    client goes on with another process)."""
    stopping = request.app.state.stopping

    async def check() -> bool:
        return bool(stopping.is_set() or await request.is_disconnected())

    return check


DB = Annotated[Database, Depends(_db)]
SettingsDep = Annotated[Settings, Depends(_settings)]
WakeupDep = Annotated[Wakeup, Depends(_wakeup)]
JobId = Annotated[int, Path(ge=1, le=INT64_MAX, description="the job's id")]
