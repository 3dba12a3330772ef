"""The FastAPI application: routers, limits, error mapping, background lease sweeps."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import code as code_store
from service import outputs, queue, retention, telemetry
from service.auth import TokenGate, route_rules
from service.config import Settings
from service.db import Database, Policy, libpq_conninfo
from service.errors import DomainError, Invalid, not_utf8_json
from service.routes import code, jobs, meta, reports, ui, users, workers
from service.schemas import Error
from service.telemetry import RequestMetrics, Telemetry
from service.wakeup import Wakeup

log = logging.getLogger("ddpq.service")


class LingeringClose:
    """Reads and discards the rest of a request body the app answered without reading,
    up to ``DRAIN_BYTES`` or ``DRAIN_S``, before the answer goes out (nginx's "lingering
    close"). A server that answers and closes while the client is still sending makes the
    kernel reset the connection, and the client sees `Connection reset by peer` instead of
    the answer: issue 30 saw it for 27 of 40 POSTs of 2 MiB that got a 413, and a wrong
    token's 401 on a code upload lost the same way. It sits outside the token gate, so
    every early answer (401, 413, 404) arrives. A client that waits for `100 Continue`
    and was never asked for its body has sent nothing: it is answered at once."""

    DRAIN_BYTES = 64 * 1024 * 1024
    DRAIN_S = 5.0

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        asked = False  # the app called receive (so a 100-continue client is sending)
        body_read = False  # the app has the whole body, or the client is gone

        async def tracked_receive() -> Message:
            nonlocal asked, body_read
            asked = True
            message = await receive()
            body_read = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def draining_send(message: Message) -> None:
            early = message["type"] == "http.response.start" and not body_read
            if early and (asked or not _expects_continue(scope)):
                await self._drain(receive)
            await send(message)

        await self.app(scope, tracked_receive, draining_send)

    async def _drain(self, receive: Receive) -> None:
        """Read and drop the rest of the request body, within the bounds."""
        left = self.DRAIN_BYTES
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.DRAIN_S):
                while left > 0:
                    message = await receive()
                    if message["type"] != "http.request":
                        return
                    left -= len(message.get("body", b""))
                    if not message.get("more_body", False):
                        return


class BodyLimit:
    """413 for request bodies over the limit, whether declared or streamed. Paths under
    a prefix of ``larger`` take that prefix's limit instead (code uploads). The rest of
    an oversize body is read and dropped by LingeringClose, outside, so the 413 arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}

    def _limit(self, path: str) -> int:
        for prefix, limit in self.larger.items():
            if path.startswith(prefix):
                return limit
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope.get("path", ""))
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(send, limit)
                    return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await self._reject(send, limit)

    async def _reject(self, send: Send, limit: int) -> None:
        body = json.dumps({"detail": _too_large(limit)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(HTTPException):
    """An HTTPException, so FastAPI's body reader passes it on (it turns any other
    exception while reading a body into a 400) and the app answers 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large(max_bytes))


def _has_body(scope: Scope) -> bool:
    """A request that declares a body: a length over 0, or chunked."""
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            return value.strip() not in (b"", b"0")
        if key == b"transfer-encoding":
            return True
    return False


def _expects_continue(scope: Scope) -> bool:
    return any(
        key == b"expect" and value.lower() == b"100-continue"
        for key, value in scope.get("headers", [])
    )


def _too_large(limit: int) -> str:
    return f"request body is larger than {limit} bytes"


def _body_limits(settings: Settings) -> dict[str, int]:
    """The larger bodies code uploads take: one file's content, and a manifest (or its
    list of digests) of the most files a snapshot may hold (a job's directory: its code
    and its outputs)."""
    manifest = max(settings.max_body_bytes, settings.code_max_files * MANIFEST_ENTRY_BYTES)
    directory = max(
        manifest, (settings.code_max_files + settings.outputs_max_files) * MANIFEST_ENTRY_BYTES
    )
    return {
        "/code/blobs/": settings.code_max_file_bytes,
        "/code/packs": settings.pack_limits()[0],
        "/code/snapshots": manifest,
        "/code/missing": manifest,
        # A worker sends a job's directory as it ended (service.outputs): its code and
        # what it wrote.
        "/workers/code/blobs/": settings.code_max_file_bytes,
        "/workers/code/snapshots": directory,
        "/workers/code/missing": directory,
    }


# Room for one manifest entry in JSON: a long path, a digest, a size and a mode.
MANIFEST_ENTRY_BYTES = 512


def begin_shutdown(app: FastAPI) -> None:
    """The process is about to stop: open claim long-polls answer at once (uvicorn
    waits for them before it exits), and the lease sweeper stands down, since the
    worker heartbeats that keep leases alive no longer reach a process that stops
    accepting connections."""
    app.state.stopping.set()
    app.state.wakeup.notify()


# A retention round works for at most this long (its transactions each delete at most
# service.retention.BATCH_ROWS rows); with nothing due, the next looks this much later,
# or sooner when the retention periods are short (a quarter of the shortest, from 1 s).
RETENTION_BUDGET_S = 1.0
RETENTION_IDLE_S = 60.0


def _retention_every(policy: Policy) -> float:
    periods = [
        p for p in (policy.metrics_downsample_after_s, policy.log_retention_s) if p is not None
    ]
    return min([RETENTION_IDLE_S, *(max(p / 4, 1.0) for p in periods)])


# The advisory lock whose holder sweeps (SweepTurn): "ddsw" in ASCII. Not "ddpq", the
# migrations' (migrations/env.py): a sweeper holds its lock for its whole life, and a
# second `ddpq serve` would wait on it forever to migrate. Advisory locks are per
# database, so two ddpq databases on one server do not share it.
SWEEP_LOCK = 0x64647377
SWEEP_APPLICATION = "ddpq-sweep"  # the holder's connection, as pg_stat_activity names it


class SweepTurn:
    """Whether this process sweeps leases, gangs, usage and code this round.

    Every API process on a database (``ddpq serve --workers N``, or several hosts) runs
    the sweeper loop, but on Postgres only the one holding a session advisory lock does
    the work: the sweeps are safe side by side (each change is a guarded UPDATE), yet N
    of them would do every scan N times for nothing. The lock lives on a connection of
    its own, so it goes with the process: when the holder dies or loses the database,
    the next process to try takes over within a round. SQLite has one process."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._conn: Any = None  # a psycopg connection, autocommit
        self._held = False

    def mine(self) -> bool:
        """Blocking (run it on a thread)."""
        if self.db.dialect != "postgresql":
            return True
        import psycopg  # here: an API on SQLite never loads the Postgres driver

        try:
            if self._conn is None or self._conn.closed:
                self._held = False
                self._conn = psycopg.connect(
                    libpq_conninfo(self.db.url),
                    autocommit=True,
                    connect_timeout=5,
                    application_name=SWEEP_APPLICATION,
                )
            if self._held:
                self._conn.execute("SELECT 1")  # the connection, and so the lock, lives
            else:
                row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (SWEEP_LOCK,))
                self._held = bool(row.fetchone()[0])
            return self._held
        except psycopg.Error as exc:
            log.warning("sweep lock connection lost (%s); trying again next round", exc)
            self.close()
            return False

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None
        self._held = False


async def _sweep_leases(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    db: Database = app.state.db
    interval = max(0.5, min(settings.lease_s / 3, settings.gang_timeout_s / 3, 5.0))
    # Code no job needs is collected every quarter of its retention period (1 s to 10 min).
    code_every = min(max(settings.code_retention_s / 4, 1.0), 600.0)
    code_swept = asyncio.get_running_loop().time()
    turn = SweepTurn(db)
    retention_at = 0.0  # the next retention round (service.retention), by the loop's clock
    try:
        while True:
            await asyncio.sleep(interval)
            if app.state.stopping.is_set():
                return
            if await run_in_threadpool(turn.mine):
                now = asyncio.get_running_loop().time()
                if now >= retention_at:
                    retention_at = now + await _retention_round(db)
                code_swept = await _sweep_once(app, code_swept, code_every)
    finally:
        await run_in_threadpool(turn.close)


async def _retention_round(db: Database) -> float:
    """One round of history retention (service.retention); returns how long until the next."""
    try:
        swept = await run_in_threadpool(retention.sweep, db, RETENTION_BUDGET_S)
        if swept.points or swept.logs:
            log.info(
                "retention: %d metric point(s) of %d job(s) downsampled away, "
                "the logs of %d job(s) deleted",
                swept.points,
                swept.jobs,
                swept.logs,
            )
        # A backlog (an upgrade, a retention shortened) goes on each round.
        return 0.0 if not swept.done else _retention_every(db.policy)
    except Exception:
        log.exception("retention sweep failed")
        return RETENTION_IDLE_S


async def _sweep_once(app: FastAPI, code_swept: float, code_every: float) -> float:
    """One round of the sweeper; returns when code was last collected."""
    settings: Settings = app.state.settings
    db: Database = app.state.db
    if asyncio.get_running_loop().time() - code_swept >= code_every:
        code_swept = asyncio.get_running_loop().time()
        try:
            keep = outputs.kept(settings.outputs_limits())
            gone = await run_in_threadpool(code_store.collect, db, settings.code_retention_s, keep)
            if any(gone):
                log.info("collected %d code snapshot(s) and %d content(s)", *gone)
        except Exception:
            log.exception("code collection failed")
    try:
        # Gangs time out by the clock alone, not by heartbeats: no lease wait here.
        released = await run_in_threadpool(
            queue.expire_gangs, db, settings.gang_timeout_s, settings.retry_backoff_s
        )
        if released:
            log.warning("gangs timed out for jobs %s", released)
            app.state.wakeup.notify()
    except Exception:
        log.exception("gang sweep failed")
    # Heartbeats could not arrive while this process was down or the database was
    # unreachable, whichever query noticed it: leases expire only once the database
    # has answered for a full lease since it last recovered (service.db.Health).
    if not db.health.up_for(settings.lease_s):
        return code_swept
    try:
        changed = await run_in_threadpool(queue.expire_leases, db, settings.lease_s)
        changed += await run_in_threadpool(queue.expire_nodes, db, settings.lease_s)
        if changed:
            log.warning("leases expired for jobs %s", changed)
            app.state.wakeup.notify()
    except Exception:  # the sweep must outlive a database outage
        log.exception("lease sweep failed")
    try:
        await run_in_threadpool(queue.count_usage, db)  # fair share: running use
        if await run_in_threadpool(queue.preempt_sweep, db):
            app.state.wakeup.notify()
    except Exception:
        log.exception("usage or preemption sweep failed")
    return code_swept


def _listen_for_jobs(url: str, wakeup: Wakeup, stop: threading.Event) -> None:
    """Postgres LISTEN: wake this process's claimers when any API process queues or
    frees something (the in-process wakeup covers only requests it served itself)."""
    import psycopg  # here: an API on SQLite never loads the Postgres driver

    conninfo = libpq_conninfo(url)
    while not stop.is_set():
        try:
            with psycopg.connect(
                conninfo, autocommit=True, connect_timeout=5, application_name="ddpq-listen"
            ) as conn:
                conn.execute(f"LISTEN {queue.NOTIFY_CHANNEL}")
                while not stop.is_set():
                    for _ in conn.notifies(timeout=1.0, stop_after=1):
                        wakeup.notify()
        except psycopg.Error as exc:
            log.warning("LISTEN connection lost (%s); reconnecting", exc)
            stop.wait(1.0)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.wakeup.bind(asyncio.get_running_loop())
    sweeper = asyncio.create_task(_sweep_leases(app))
    stop_listening = threading.Event()
    if app.state.db.dialect == "postgresql":
        threading.Thread(
            target=_listen_for_jobs,
            args=(app.state.db.url, app.state.wakeup, stop_listening),
            name="pg-listen",
            daemon=True,
        ).start()
    try:
        yield
    finally:
        stop_listening.set()
        sweeper.cancel()
        app.state.db.dispose()


def create_app(
    settings: Settings, api_token: str, worker_token: str, db: Database | None = None
) -> FastAPI:
    app = FastAPI(
        title="ddpq",
        version="0.1.0",
        description="A queue for PyTorch distributed training jobs.",
        lifespan=_lifespan,
        # No Swagger UI or ReDoc: both load their scripts from a CDN, on the origin where
        # the dashboard keeps the user token. The OpenAPI document stays at /openapi.json.
        docs_url=None,
        redoc_url=None,
        generate_unique_id_function=_operation_id,
    )
    app.state.settings = settings
    app.state.api_token = api_token
    app.state.worker_token = worker_token
    app.state.db = db or Database(
        settings.resolved_database_url,
        settings.policy(),
    )
    app.state.wakeup = Wakeup()
    # Idle long-polls that would find nothing wait for the next wake-up without asking
    # the database; for at most half a re-check, so a change that wakes nobody (a retry's
    # backoff running out) is still seen within 1.5 re-checks.
    app.state.nothing_fits = queue.NothingFits(settings.claim_recheck_s / 2)
    app.state.telemetry = Telemetry(app.state.db)
    app.state.stopping = threading.Event()
    app.add_exception_handler(DomainError, _domain_error)  # type: ignore[arg-type]
    app.add_exception_handler(OperationalError, _database_down)
    app.add_exception_handler(InterfaceError, _database_down)
    app.add_exception_handler(IntegrityError, _lost_race)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.include_router(meta.router)
    app.include_router(jobs.router)
    app.include_router(reports.router)
    app.include_router(workers.router)
    app.include_router(code.router)
    app.include_router(code.workers_router)
    app.include_router(users.router)
    app.include_router(users.admin_router)
    app.include_router(telemetry.router)
    app.include_router(ui.router)  # the dashboard's open static shell; its data needs the token
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, larger=_body_limits(settings))
    # No token, no further (not even the body limit or the router's 422).
    app.add_middleware(TokenGate, fastapi_app=app)
    # Outside the gate: every early answer, the gate's 401 included, reaches a client
    # that is still sending its body.
    app.add_middleware(LingeringClose)
    # Outermost: it times whole requests, those the gate refuses included (their route
    # is not matched yet: they count as "unmatched").
    app.add_middleware(RequestMetrics, telemetry=app.state.telemetry)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _operation_id(route: APIRoute) -> str:
    """An operation's id is its route's name, the handler's own unless the route names
    itself: what a generated client calls its function (submit_job, not FastAPI's
    submit_job_jobs_post). Ids are stable and unique (tests/test_openapi_client.py)."""
    return route.name


# ---- errors: what a client may send never answers 500 ----------------------------------


async def _domain_error(_: Request, exc: DomainError) -> JSONResponse:
    if isinstance(exc, Invalid):
        content: Any = {
            "detail": [{"loc": list(exc.loc), "msg": exc.detail, "type": "value_error"}]
        }
    else:
        content = {"detail": exc.detail}
    return JSONResponse(content, status_code=exc.status_code)


async def _database_down(_: Request, exc: Exception) -> JSONResponse:
    # A dropped connection is the database's trouble, not the client's: retry later.
    log.warning("database error: %s", exc)
    return JSONResponse(
        {"detail": "the database is unavailable; retry shortly"},
        status_code=503,
        headers={"Retry-After": "2"},
    )


async def _lost_race(_: Request, exc: IntegrityError) -> JSONResponse:
    # A unique row that a concurrent request inserted first (two first registrations
    # of one worker name, say): the loser's to retry, not a server error. Routes that
    # can answer better (an Idempotency-Key replay) catch it themselves.
    log.warning("integrity error (a concurrent request won): %s", exc.orig)
    return JSONResponse(
        {"detail": "a concurrent request changed the same record first; retry"},
        status_code=409,
    )


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = []
    for e in exc.errors():
        e = dict(e)
        e.pop("ctx", None)  # may hold the exception object, which is not JSON
        e.pop("url", None)
        try:  # echo the input only when it is small and valid JSON (no NaN)
            if len(json.dumps(e.get("input"), allow_nan=False)) > 1000:
                e.pop("input", None)
        except (TypeError, ValueError):
            e.pop("input", None)
        errors.append(_utf8_safe(e))
    return JSONResponse({"detail": errors}, status_code=422)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    # FastAPI answers 400 "error parsing the body" for any failure to read a body,
    # invalid UTF-8 included: that is a malformed document like bad JSON, so 422.
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError | ValueError):
        return JSONResponse({"detail": [not_utf8_json(exc.__cause__)]}, status_code=422)
    return await http_exception_handler(request, exc)


def _utf8_safe(value: Any) -> Any:
    """The value with lone surrogates replaced: an error that quotes a client's
    invalid string must still be encodable as the UTF-8 of its answer."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_utf8_safe(k): _utf8_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_utf8_safe(v) for v in value]
    return value


SECURITY_SCHEMES = {
    "userToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "a user's token (ddpqu_...; DDPQ_API_TOKEN is the first admin's): "
        "people and their scripts",
    },
    "adminToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "an admin's user token: managing users, the audit trail",
    },
    "workerToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "DDPQ_WORKER_TOKEN: the /workers routes",
    },
    "jobToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "DDPQ_JOB_TOKEN: minted per attempt, this job's report routes only",
    },
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The generated document plus what TokenGate, the limits and the database add to
    a route by its kind alone: the token it takes, and the refusals that come with it.
    A route's own errors (404, 409, ...) are declared on the route (errors.responses)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    doc.setdefault("components", {}).setdefault("securitySchemes", {}).update(SECURITY_SCHEMES)
    _add_component(doc, Error)
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for rule in route_rules(app):
        paths = doc["paths"].get(rule.path, {})
        for method in rule.methods or ():
            op = paths.get(method.lower())
            if op is None:
                continue
            shared: dict[str, str] = {}
            if rule.kind != "open":
                op["security"] = [{f"{rule.kind}Token": []}] if rule.kind != "closed" else []
                shared["401"] = "no token, or not a token ddpq issued"
                shared["403"] = "a token of another kind, job or attempt"
            if "requestBody" in op:  # app.BodyLimit; GET /code/limits has those of code uploads
                shared["413"] = "the body is larger than the limit (1 MiB by default)"
            if rule.uses_database:
                shared["503"] = "the database is unavailable; retry shortly"
            responses = op.setdefault("responses", {})
            for status, description in shared.items():
                responses.setdefault(status, {"description": description, **error})
            op["responses"] = dict(sorted(responses.items()))
    app.openapi_schema = doc
    return doc


def _add_component(doc: dict[str, Any], model: type[BaseModel]) -> None:
    """``model``'s schema (and those it refers to) among the document's components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in {**schema.pop("$defs", {}), model.__name__: schema}.items():
        doc["components"].setdefault("schemas", {}).setdefault(name, definition)
