"""The FastAPI application: routers, limits, error mapping, background lease sweeps."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InterfaceError, OperationalError

from service import queue
from service.config import Settings
from service.db import Database
from service.errors import DomainError, Invalid
from service.routes import jobs, meta, reports, workers
from service.wakeup import Wakeup

log = logging.getLogger("ddpq.service")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    """413 for request bodies over the limit, whether declared or streamed."""

    def __init__(
        self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(send)
                    return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
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
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = f'{{"detail":"request body is larger than {self.max_bytes} bytes"}}'.encode()
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


class _TooLarge(Exception):
    pass


def begin_shutdown(app: FastAPI) -> None:
    """The process is about to stop: open claim long-polls answer at once (uvicorn
    waits for them before it exits), and the lease sweeper stands down, since the
    worker heartbeats that keep leases alive no longer reach a process that stops
    accepting connections."""
    app.state.stopping.set()
    app.state.wakeup.notify()


async def _sweep_leases(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    interval = max(0.5, min(settings.lease_s / 3, 5.0))
    # Heartbeats could not arrive while this process was down or the database was
    # unreachable: a lease expires only after a full lease of the service being up,
    # so a restart or an outage never declares every running job lost.
    up_since = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        if app.state.stopping.is_set():
            return
        if time.monotonic() - up_since < settings.lease_s:
            continue
        try:
            changed = await run_in_threadpool(queue.expire_leases, app.state.db, settings.lease_s)
            if changed:
                log.warning("leases expired for jobs %s", changed)
                app.state.wakeup.notify()
        except Exception:  # the sweep must outlive a database outage
            log.exception("lease sweep failed")
            up_since = time.monotonic()


def _listen_for_jobs(url: str, wakeup: Wakeup, stop: threading.Event) -> None:
    """Postgres LISTEN: wake this process's claimers when any API process queues or
    frees something (the in-process wakeup covers only requests it served itself)."""
    conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    while not stop.is_set():
        try:
            with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f"LISTEN {queue.NOTIFY_CHANNEL}")
                while not stop.is_set():
                    for _ in conn.notifies(timeout=1.0, stop_after=1):
                        wakeup.notify()
        except psycopg.Error as exc:
            log.warning("LISTEN connection lost (%s); reconnecting", exc)
            stop.wait(1.0)


def create_app(
    settings: Settings, api_token: str, worker_token: str, db: Database | None = None
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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

    app = FastAPI(
        title="ddpq",
        version="0.1.0",
        description="A queue for PyTorch distributed training jobs.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.api_token = api_token
    app.state.worker_token = worker_token
    app.state.db = db or Database(
        settings.resolved_database_url,
        settings.policy(),
    )
    app.state.wakeup = Wakeup()
    app.state.stopping = threading.Event()

    @app.exception_handler(DomainError)
    async def _domain_error(_: Request, exc: DomainError) -> JSONResponse:
        if isinstance(exc, Invalid):
            content: Any = {
                "detail": [{"loc": list(exc.loc), "msg": exc.detail, "type": "value_error"}]
            }
        else:
            content = {"detail": exc.detail}
        return JSONResponse(content, status_code=exc.status_code)

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    async def _database_down(_: Request, exc: Exception) -> JSONResponse:
        # A dropped connection is the database's trouble, not the client's: retry later.
        log.warning("database error: %s", exc)
        return JSONResponse(
            {"detail": "the database is unavailable; retry shortly"},
            status_code=503,
            headers={"Retry-After": "2"},
        )

    @app.exception_handler(RequestValidationError)
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
            errors.append(e)
        return JSONResponse({"detail": errors}, status_code=422)

    app.include_router(meta.router)
    app.include_router(jobs.router)
    app.include_router(reports.router)
    app.include_router(workers.router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    return app
