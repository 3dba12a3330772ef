"""The three kinds of bearer token, and the dependencies that demand them.

user:   DDPQ_API_TOKEN, for people and their scripts (every /jobs and /recipes route)
worker: DDPQ_WORKER_TOKEN, only the /workers routes
job:    minted per attempt at claim time and handed to the ranks; valid only for
        that job's report routes while that attempt is live. Only its sha256 is
        stored, so the database never holds a usable job token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from sqlalchemy import select

from service.models import Attempt, Job

JOB_TOKEN_PREFIX = "ddpqj_"  # noqa: S105 - a prefix, not a secret


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def mint_job_token() -> tuple[str, str]:
    """A fresh job token and the hash that is stored in its place."""
    token = JOB_TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, hash_token(token)


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(
            401,
            "missing bearer token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token.strip()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _kind(request: Request, token: str) -> str:
    state = request.app.state
    if _same(token, state.api_token):
        return "user"
    if _same(token, state.worker_token):
        return "worker"
    if token.startswith(JOB_TOKEN_PREFIX):
        return "job"
    return "unknown"


def _require(wanted: str) -> Callable[[Request], Awaitable[None]]:
    # async: it does no I/O, and a plain def would cost a thread-pool hop per request.
    async def dependency(request: Request) -> None:
        kind = _kind(request, _bearer(request))
        if kind == wanted:
            return
        if kind != "unknown":
            raise HTTPException(
                403, f"a {kind} token cannot use this route; it takes the {wanted} token"
            )
        raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})

    return dependency


require_user = _require("user")
require_worker = _require("worker")


def require_job_attempt(job_id: int, request: Request) -> Attempt:
    """The live attempt of ``job_id`` that the request's job token was minted for."""
    token = _bearer(request)
    kind = _kind(request, token)
    if kind in ("user", "worker"):
        raise HTTPException(
            403, f"a {kind} token cannot report for a job; ranks use DDPQ_JOB_TOKEN"
        )
    db = request.app.state.db
    with db.read() as s:
        attempt = s.scalar(select(Attempt).where(Attempt.token_hash == hash_token(token)))
        if attempt is None:
            raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
        if attempt.job_id != job_id:
            raise HTTPException(403, "this job token belongs to another job")
        current = s.scalar(select(Job.attempt).where(Job.id == job_id))
    if current is not None and current != attempt.number:
        # Fencing: a newer attempt owns the job; the old one's ranks must stop.
        raise HTTPException(409, f"attempt {attempt.number} was superseded by attempt {current}")
    if attempt.ended_at is not None:
        raise HTTPException(
            403, f"attempt {attempt.number} has ended; its token is no longer valid"
        )
    return attempt


UserAuth = Depends(require_user)
WorkerAuth = Depends(require_worker)
JobAttempt = Annotated[Attempt, Depends(require_job_attempt)]
