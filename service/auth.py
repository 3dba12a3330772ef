"""The kinds of bearer token, and the gate that demands them.

user:   a person's (or their script's) token, one per user (service.users): every
        /jobs, /code and /recipes route. The route knows who asks (``CurrentUser``).
admin:  a user token whose user is an admin: /users and /audit.
worker: DDPQ_WORKER_TOKEN, only the /workers routes
job:    minted per attempt at claim time and handed to the ranks; valid only for
        that job's report routes while that attempt is live.
Only the sha256 of a user or job token is stored, so the database never holds a usable
one; every check reads it, so a revoked token is refused at once by every API process.
A long answer (a log follow, an event stream) checks its token again while it stays open
(``TokenWatch``): a token revoked or rotated meanwhile ends it within
DDPQ_STREAM_RECHECK_S, and the client's reconnection is refused by the gate.

A route says which token it takes by depending on ``UserAuth`` (or ``CurrentUser``),
``AdminAuth``, ``WorkerAuth`` or ``JobAttempt``. ``TokenGate``, an ASGI middleware,
reads that off the matched route and checks the token *before* FastAPI reads the body
or validates a parameter: a request without the right token learns nothing (401/403,
never 422) and changes nothing. Closed by default: a route that declares no token kind
and is not in ``OPEN_PATHS`` answers 401 to everyone, so a route added without
thinking about auth fails safe.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, get_args

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.dependencies.models import Dependant
from sqlalchemy import select
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.types import ASGIApp, Receive, Scope, Send

from service import queue, users
from service.db import Database
from service.deps import DB
from service.errors import ServiceError
from service.models import Attempt, Job, JobNode, User
from service.tokens import JOB_TOKEN_PREFIX, hash_token, mint
from service.users import Principal

log = logging.getLogger("ddpq.service")

# Open to anyone: liveness, and the dashboard's static shell and the API's own
# description (no data in either; the page fetches its data with a token).
OPEN_PATHS = frozenset({"/healthz", "/", "/openapi.json"})
OPEN_PREFIXES = ("/static/",)
KIND_ATTR = "ddpq_token_kind"


def mint_job_token() -> tuple[str, str]:
    """A fresh job token and the hash that is stored in its place."""
    return mint(JOB_TOKEN_PREFIX)


class Refusal(ServiceError):
    def __init__(self, status: int, detail: str, who: Principal | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.who = who  # a known user refused (a member on an admin route): audited


def _bearer(headers: dict[bytes, bytes]) -> str:
    raw = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = raw.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Refusal(401, "missing bearer token: send 'Authorization: Bearer <token>'")
    return token


def _same(a: str, b: str) -> bool:
    # Constant time: how long a comparison takes says nothing about how much matched.
    return hmac.compare_digest(a.encode("utf-8", "surrogateescape"), b.encode())


async def _principal(db: Database, token: str) -> Principal | None:
    """The live user whose token this is, or None."""
    return await _live(db, hash_token(token))


async def _live(db: Database, digest: str) -> Principal | None:
    """The live user whose token hashes to ``digest``, or None."""
    if db.dialect == "sqlite":
        # On the event loop, as GET /jobs/{id} reads: a WAL reader never waits for a
        # writer, and the hop to a thread costs more than this one indexed read.
        return users.authenticate(db, digest)
    return await run_in_threadpool(users.authenticate, db, digest)


async def _kind_of(token: str, worker_token: str, db: Database) -> tuple[str, Principal | None]:
    """What a token is: worker, job (by its shape: looked up only on a report route),
    user (with who), or unknown."""
    if _same(token, worker_token):
        return "worker", None
    if token.startswith(JOB_TOKEN_PREFIX):
        return "job", None
    who = await _principal(db, token)
    return ("user", who) if who is not None else ("unknown", None)


def _wrong_kind(kind: str, wanted: str) -> Refusal:
    if kind == "unknown":
        return Refusal(401, "invalid token (revoked, rotated, or never issued)")
    takes = "a user token" if wanted in ("user", "admin") else f"the {wanted} token"
    return Refusal(403, f"a {kind} token cannot use this route; it takes {takes}")


async def check_token(token: str, wanted: str, worker_token: str, db: Database) -> Principal | None:
    """Refusal unless ``token`` is of the ``wanted`` kind (user, admin or worker); who
    it is for a user token."""
    kind, who = await _kind_of(token, worker_token, db)
    if wanted == "admin" and kind == "user":
        assert who is not None
        if not who.admin:
            raise Refusal(403, f"this route is for admins; {who.name} is a {who.role}", who)
        return who
    if kind != wanted:
        raise _wrong_kind(kind, wanted)
    return who


_JOB_ID = re.compile(r"[1-9][0-9]{0,18}")  # fullmatch: "$" also matches before a "\n"


def _check_job(db: Any, token: str, raw_job_id: str | None) -> Attempt:
    """The live attempt of the path's job that ``token`` was minted for."""
    with db.read() as s:
        digest = hash_token(token)
        attempt = s.scalar(select(Attempt).where(Attempt.token_hash == digest))
        if attempt is None:
            # Each node of a multi-node attempt has its own token (minted when it
            # claimed its slot); they all report for the one attempt.
            attempt = s.scalar(
                select(Attempt)
                .join(
                    JobNode,
                    (JobNode.job_id == Attempt.job_id) & (JobNode.attempt == Attempt.number),
                )
                .where(JobNode.token_hash == digest)
            )
        if attempt is None:
            raise Refusal(401, "invalid token")
        job_id = int(raw_job_id) if raw_job_id and _JOB_ID.fullmatch(raw_job_id) else None
        if attempt.job_id != job_id:
            raise Refusal(403, "this job token belongs to another job")
        job = s.execute(select(Job.attempt, Job.status).where(Job.id == job_id)).first()
        s.expunge(attempt)
    # Fencing: a newer attempt owns the job (the old one's ranks must stop), or it ended.
    current, status = (job.attempt, job.status) if job is not None else (None, None)
    stale = queue.fenced(attempt.number, attempt.ended_at is not None, current, status)
    if stale:
        raise Refusal(403, f"{stale}; its token is no longer valid")
    return attempt


# ---- what each route takes --------------------------------------------------------------


def _calls(dependant: Dependant) -> Iterator[Any]:
    for sub in dependant.dependencies:
        yield sub.call
        yield from _calls(sub)


@dataclass(frozen=True)
class RouteRule:
    """One route as the gate sees it: where it is and which token it takes."""

    path: str  # the path format, e.g. /jobs/{job_id}
    regex: re.Pattern[str]
    methods: frozenset[str] | None  # None: any (a mount)
    kind: str  # user, worker, job, open, or closed (declares nothing and is not open)
    # It reads the database (its handler takes DB, or the gate looks its job token up):
    # only such a route can answer 503 when the database is down.
    uses_database: bool


_DATABASE = get_args(DB)[1].dependency


def _kind(path: str, dependant: Dependant | None) -> str:
    if dependant is not None:
        for call in _calls(dependant):
            kind = getattr(call, KIND_ATTR, None)
            if kind:
                return str(kind)
    if path in OPEN_PATHS or any(path.startswith(p) for p in OPEN_PREFIXES):
        return "open"
    return "closed"


def route_rules(app: FastAPI) -> list[RouteRule]:
    """Every route of the app, in routing order, with the routers' own dependencies
    (FastAPI >= 0.16x keeps included routers nested; iter_route_contexts flattens them)."""
    try:
        from fastapi.routing import iter_route_contexts

        contexts: list[Any] = list(iter_route_contexts(app.router.routes))
    except ImportError:  # older FastAPI flattens included routers itself
        contexts = list(app.router.routes)
    rules = []
    for ctx in contexts:
        regex = getattr(ctx, "path_regex", None)
        if regex is None:
            continue
        path = getattr(ctx, "path_format", None) or getattr(ctx, "path", "") or ""
        dependant = getattr(ctx, "dependant", None)
        methods = getattr(ctx, "methods", None)
        kind = _kind(path, dependant if isinstance(dependant, Dependant) else None)
        # A job, user or admin token is looked up in the database.
        uses_database = kind in ("job", "user", "admin") or (
            isinstance(dependant, Dependant)
            and any(call is _DATABASE for call in _calls(dependant))
        )
        rules.append(
            RouteRule(
                path=path,
                regex=regex,
                methods=frozenset(methods) if methods else None,
                kind=kind,
                uses_database=uses_database,
            )
        )
    return rules


class TokenGate:
    """Refuses a request without the token its route takes, before anything reads it."""

    def __init__(self, app: ASGIApp, fastapi_app: FastAPI) -> None:
        self.app = app
        self.fastapi_app = fastapi_app
        self._rules: list[RouteRule] | None = None

    def _match(self, scope: Scope) -> tuple[RouteRule | None, dict[str, str], set[str]]:
        """The route the request is for, its path parameters, and, when its path is
        known but not its method, every method that path takes."""
        if self._rules is None:  # built at the first request, when every route is in
            self._rules = route_rules(self.fastapi_app)
        path = scope.get("path", "")
        partial: tuple[RouteRule | None, dict[str, str]] = (None, {})
        allowed: set[str] = set()
        for rule in self._rules:
            m = rule.regex.match(path)
            if m is None:
                continue
            if rule.methods is None or scope.get("method") in rule.methods:
                return rule, m.groupdict(), set()
            allowed |= rule.methods
            if partial[0] is None:
                partial = (rule, m.groupdict())
        return partial[0], partial[1], allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rule, params, allowed = self._match(scope)
        kind = "open" if rule is None else rule.kind  # no route at all: the router's 404
        if kind != "open":
            try:
                await self._check(scope, kind, params)
            except Refusal as refusal:
                if refusal.who is not None:
                    await self._audit(scope, refusal)
                await _refuse(send, refusal)
                return
            except (OperationalError, InterfaceError) as exc:
                log.warning("database error during a token check: %s", exc)
                await _refuse(send, Refusal(503, "the database is unavailable; retry shortly"))
                return
        if allowed:
            # A known path with another method, answered after the token check. Here
            # and not by the router: routes of one path live in several routers (GET
            # and POST /jobs/{id}/metrics), and Allow must list all of their methods.
            await _refuse(send, Refusal(405, "method not allowed"), allow=sorted(allowed))
            return
        await self.app(scope, receive, send)

    async def _audit(self, scope: Scope, refusal: Refusal) -> None:
        """A known user refused: who tried which route, in the audit trail (its own
        transaction). An audit that cannot be written leaves the refusal as it was."""
        assert refusal.who is not None
        target = f"{scope.get('method', '')} {scope.get('path', '')}"
        try:
            await run_in_threadpool(
                users.audit_refused,
                self.fastapi_app.state.db,
                refusal.who.name,
                "route",
                target,
                refusal.detail,
            )
        except (OperationalError, InterfaceError) as exc:
            log.warning("could not audit a refused request: %s", exc)

    async def _check(self, scope: Scope, kind: str, params: dict[str, str]) -> None:
        if kind == "closed":
            raise Refusal(401, "this route takes no token ddpq knows of")
        token = _bearer(dict(scope.get("headers", [])))
        state = self.fastapi_app.state
        if kind in ("user", "admin", "worker"):
            who = await check_token(token, kind, state.worker_token, state.db)
            if who is not None:
                recorded = scope.setdefault("state", {})
                recorded["principal"] = who
                # Its hash too: a long answer looks the token up again while open (TokenWatch).
                recorded["token_hash"] = hash_token(token)
            return
        # kind == "job"
        found, _ = await _kind_of(token, state.worker_token, state.db)
        if found in ("user", "worker"):
            raise Refusal(403, f"a {found} token cannot report for a job; ranks use DDPQ_JOB_TOKEN")
        if found == "unknown":
            raise Refusal(401, "invalid token")
        attempt = await run_in_threadpool(_check_job, state.db, token, params.get("job_id"))
        scope.setdefault("state", {})["job_attempt"] = attempt


async def _refuse(send: Send, refusal: Refusal, allow: list[str] | None = None) -> None:
    body = json.dumps({"detail": refusal.detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if allow:
        headers.append((b"allow", ", ".join(allow).encode()))
    if refusal.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if refusal.status == 503:
        headers.append((b"retry-after", b"2"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---- the dependencies routes declare ------------------------------------------------------
# They mark the route for TokenGate and check again (cheaply) in case the gate is missing:
# an app built without it stays closed.


def _require(wanted: str) -> Callable[[Request], Awaitable[Principal | None]]:
    # async: a plain def would cost a thread-pool hop per request.
    async def dependency(request: Request) -> Principal | None:
        who = getattr(request.state, "principal", None)
        if isinstance(who, Principal) and (wanted != "admin" or who.admin):
            return who  # the gate checked it
        state = request.app.state
        try:
            token = _bearer(dict(request.scope.get("headers", [])))
            return await check_token(token, wanted, state.worker_token, state.db)
        except Refusal as refusal:
            raise HTTPException(refusal.status, refusal.detail) from None

    setattr(dependency, KIND_ATTR, wanted)
    return dependency


require_user = _require("user")
require_admin = _require("admin")
require_worker = _require("worker")


async def current_user(request: Request) -> Principal:
    """Who the request comes from (a user or admin route)."""
    who = await require_user(request)
    assert who is not None
    return who


setattr(current_user, KIND_ATTR, "user")


async def current_admin(request: Request) -> Principal:
    who = await require_admin(request)
    assert who is not None
    return who


setattr(current_admin, KIND_ATTR, "admin")


class TokenWatch:
    """The user token a long answer (a log follow, an event stream) was opened with,
    checked again while it stays open: the gate checked it once, at the start, and such
    an answer can last as long as its job (days).

    ``refused()`` is asked at every poll of the stream; it reads the database at most
    once per ``every_s`` (DDPQ_STREAM_RECHECK_S), the same lookup as the gate's, so a
    stream costs one indexed read per interval, never one per poll. State is the
    database's alone: a revocation through any API process ends streams on all of them.
    """

    def __init__(self, db: Database, who: Principal, token_hash: str, every_s: float) -> None:
        self.db = db
        self.who = who
        self.token_hash = token_hash
        self.every_s = every_s
        self._due = time.monotonic() + every_s  # the gate has just checked it

    async def refused(self) -> str | None:
        """Why the answer must end now (its token revoked or rotated, its user
        deactivated), in words; None while the token stands or is not due a check."""
        now = time.monotonic()
        if now < self._due:
            return None
        self._due = now + self.every_s
        if await _live(self.db, self.token_hash) is not None:
            return None
        return await run_in_threadpool(_why_refused, self.db, self.who.name)


def _why_refused(db: Database, name: str) -> str:
    """Why ``name``'s token no longer stands (read once, as its stream ends)."""
    with db.read() as s:
        row = s.execute(select(User.revoked_at).where(User.name == name)).first()
    if row is None:
        return f"token revoked: user {name} no longer exists"
    if row.revoked_at is not None:
        return f"token revoked: user {name} was deactivated"
    return f"token rotated: user {name} was given a new token"


async def token_watch(request: Request) -> TokenWatch:
    """The request's user token, to check again while its long answer stays open."""
    who = await current_user(request)
    digest = getattr(request.state, "token_hash", None)
    if not isinstance(digest, str):  # no gate in front (current_user checked the header)
        digest = hash_token(_bearer(dict(request.scope.get("headers", []))))
    state = request.app.state
    return TokenWatch(state.db, who, digest, state.settings.stream_recheck_s)


setattr(token_watch, KIND_ATTR, "user")


async def require_job_attempt(request: Request) -> Attempt:
    """The live attempt the request's job token was minted for (checked by TokenGate)."""
    attempt = getattr(request.state, "job_attempt", None)
    if not isinstance(attempt, Attempt):
        raise HTTPException(401, "invalid token")
    return attempt


setattr(require_job_attempt, KIND_ATTR, "job")

UserAuth = Depends(require_user)
AdminAuth = Depends(require_admin)
WorkerAuth = Depends(require_worker)
CurrentUser = Annotated[Principal, Depends(current_user)]
CurrentAdmin = Annotated[Principal, Depends(current_admin)]
JobAttempt = Annotated[Attempt, Depends(require_job_attempt)]
Watched = Annotated[TokenWatch, Depends(token_watch)]
