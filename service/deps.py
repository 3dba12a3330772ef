"""Annotated dependencies the route handlers share.

They are ``async def`` although they never await: FastAPI runs a plain ``def``
dependency on its thread pool, a thread hop per dependency per request.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Annotated

from fastapi import Depends, Path, Request

from service.config import Settings
from service.db import Database
from service.errors import DomainError, Invalid
from service.schemas import INT64_MAX
from service.secrets import Keyring
from service.wakeup import Wakeup


async def _db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _keyring(request: Request) -> Keyring:
    keys: Keyring = request.app.state.keyring
    return keys


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
# The keys users' secrets are sealed with (service.secrets; the settings' DDPQ_SECRETS_KEY).
Keys = Annotated[Keyring, Depends(_keyring)]
JobId = Annotated[int, Path(ge=1, le=INT64_MAX, description="the job's id")]


# A log chunk: raw output bytes, read whole (the worker's stream, or a Slurm node's).
MAX_LOG_CHUNK_BYTES = 1024 * 1024
# The body is read raw, so routes that take a chunk declare it for the OpenAPI document.
LOG_CHUNK_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
LOG_CHUNK_TOO_BIG = {400: f"the chunk is larger than {MAX_LOG_CHUNK_BYTES} bytes"}


async def log_chunk(request: Request) -> bytes:
    """A request's raw body as a log chunk, refused when over the limit."""
    data = await request.body()
    if len(data) > MAX_LOG_CHUNK_BYTES:
        raise DomainError(f"a log chunk is at most {MAX_LOG_CHUNK_BYTES} bytes")
    return data


# ---- a listing's query: states, a page's cursor, whose -------------------------------------


def states_of(status: str | None, valid: Iterable[str]) -> list[str]:
    """A listing's ``status`` query (comma-separated), each one of ``valid``; 422 naming
    the first that is not."""
    known = sorted(valid)
    states = [s.strip() for s in status.split(",") if s.strip()] if status else []
    for s in states:
        if s not in known:
            raise Invalid(
                ("query", "status"), f"unknown state {s[:40]!r}; one of {', '.join(known)}"
            )
    return states


def cursor_of(cursor: str | None) -> int | None:
    """A page's ``cursor`` query: the id the previous page ended at (its next_cursor)."""
    if cursor is None:
        return None
    # [0-9] and not isdigit(): "²".isdigit() is True and int("²") raises.
    if not re.fullmatch(r"[0-9]{1,19}", cursor) or not 0 < int(cursor) < 2**63:
        raise Invalid(
            ("query", "cursor"), "malformed cursor; pass next_cursor from the previous page"
        )
    return int(cursor)


def owner_of(me: str, mine: bool, user: str | None, what: str) -> str | None:
    """Whose ``what`` a listing asks for: ``mine`` (the token's user's) or ``user``'s (or
    everyone's); 422 for both naming different users."""
    if mine and user is not None and user != me:
        raise Invalid(("query", "mine"), f"mine=true is {me}'s {what}, not user={user}'s")
    return me if mine else user
