"""The FastAPI application: its routers and middleware, the one map of errors to HTTP
statuses, the OpenAPI document, and its lifespan (what runs beside the requests is
service.sweeper; what is done with request bodies, service.bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service import caches, queue, sweeper, telemetry
from service.auth import TokenGate, route_rules
from service.bodies import BodyLimit, LingeringClose, body_limits
from service.config import Settings
from service.db import Database
from service.errors import DomainError, Invalid, not_utf8_json
from service.pace import Pace
from service.routes import box, code, jobs, meta, reports, secrets, sweeps, ui, users, workers
from service.routes import caches as caches_routes
from service.schemas import Error
from service.secrets import Keyring
from service.telemetry import RequestMetrics, Telemetry
from service.wakeup import Wakeup

log = logging.getLogger("ddpq.service")


def begin_shutdown(app: FastAPI) -> None:
    """The process is about to stop: open claim long-polls answer at once (uvicorn
    waits for them before it exits), and the lease sweeper stands down, since the
    worker heartbeats that keep leases alive no longer reach a process that stops
    accepting connections."""
    app.state.stopping.set()
    app.state.wakeup.notify()


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.wakeup.bind(asyncio.get_running_loop())
    app.state.db.on_commit = app.state.wakeup.committed
    sweeping = asyncio.create_task(sweeper.run(app))
    stop_listening = threading.Event()
    if app.state.db.dialect == "postgresql":
        threading.Thread(
            target=sweeper.listen_for_jobs,
            args=(app.state.db.url, app.state.wakeup, stop_listening),
            name="pg-listen",
            daemon=True,
        ).start()
    try:
        yield
    finally:
        stop_listening.set()
        sweeping.cancel()
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
    # The keys users' secrets are sealed with (resolved with the tokens: service.main).
    app.state.keyring = Keyring.of(settings)
    app.state.db = db or Database(
        settings.resolved_database_url,
        settings.policy(),
    )
    app.state.wakeup = Wakeup(queue.room_fits)
    # The heartbeat interval and lease the fleet's size sets (service.pace): the sweeper
    # keeps it, and the lease in force is the policy's (db.policy.lease_s).
    app.state.pace = Pace(settings.heartbeat_s, settings.lease_s, settings.max_heartbeats_per_s)
    # Idle long-polls that would find nothing wait for the next wake-up without asking
    # the database; for at most half a re-check, so a change that wakes nobody (a retry's
    # backoff running out) is still seen within 1.5 re-checks (the sweeper keeps it in
    # step with the fleet's re-checks: service.pace).
    app.state.nothing_fits = queue.NothingFits(settings.claim_recheck_s / 2)
    app.state.telemetry = Telemetry(app.state.db)
    # The clear orders of users' caches heartbeats carry, read at most every few seconds.
    app.state.cache_orders = caches.Orders()
    app.state.stopping = threading.Event()
    app.add_exception_handler(DomainError, _domain_error)  # type: ignore[arg-type]
    app.add_exception_handler(OperationalError, _database_down)
    app.add_exception_handler(ClientDisconnect, _client_gone)  # type: ignore[arg-type]
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
    app.include_router(secrets.router)
    app.include_router(secrets.job_router)
    app.include_router(caches_routes.router)
    app.include_router(sweeps.router)
    app.include_router(box.router)
    app.include_router(telemetry.router)
    app.include_router(ui.router)  # the dashboard's open static shell; its data needs the token
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, larger=body_limits(settings))
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


async def _client_gone(request: Request, _: ClientDisconnect) -> Response:
    # The client hung up while its body was read (a rank killed mid-report when its
    # job is cancelled or pruned): nothing happened and nobody reads the answer. Not a
    # server error, so not logged as one.
    log.info("%s %s: the client hung up before its body was read", request.method, request.url.path)
    return Response(status_code=400)


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
        "description": "DDPQ_JOB_TOKEN: minted per attempt, this job's report routes only "
        "(and a Slurm attempt's nodes, its secrets)",
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
            if "requestBody" in op:  # bodies.BodyLimit; GET /code/limits has those of code uploads
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
