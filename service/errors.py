"""The service's errors, one tree under ``ServiceError`` (the client's and the worker's
are ``ddpq.errors``): the domain errors raised below the routes, which app.py maps each
to its HTTP status (``responses`` documents a route's own ones), and those of starting
up and of the database (service.db, service.config, service.auth)."""

from typing import Any

from service.schemas import Error


def not_utf8_json(cause: Exception) -> dict[str, Any]:
    """The 422 detail item for a body that is not UTF-8 JSON, worded alike for every
    route (FastAPI's body reader, and the metrics route that parses its own body)."""
    return {
        "loc": ["body"],
        "msg": f"the body is not valid UTF-8 JSON: {cause}"[:300],
        "type": "json_invalid",
    }


class ServiceError(Exception):
    """Every error the service raises on purpose."""


class DomainError(ServiceError):
    """Raised below the routes; answered with ``status_code`` and the detail."""

    status_code = 400

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Forbidden(DomainError):
    """The token is good, but its user may not do this (another member's job)."""

    status_code = 403


class NotFound(DomainError):
    status_code = 404


class Conflict(DomainError):
    status_code = 409


class UnknownWorker(NotFound):
    """A worker that is not registered claimed or heartbeat: it registers again."""

    def __init__(self, worker: str) -> None:
        super().__init__(f"worker {worker} is not registered")
        self.worker = worker


class WorkerHasLeft(Conflict):
    """A worker that left (POST /workers/leave) claimed: it is handed nothing until it
    registers again (the claim route answers its long-poll 204)."""

    def __init__(self, worker: str) -> None:
        super().__init__(f"worker {worker} has left: it registers again to take jobs")
        self.worker = worker


class TooMany(DomainError):
    """Over a limit the user may lift by waiting (a quota of queued jobs)."""

    status_code = 429


class Invalid(DomainError):
    """A request that passed the schema but breaks a rule that needs the database."""

    status_code = 422

    def __init__(self, loc: tuple[str | int, ...], detail: str) -> None:
        super().__init__(detail)
        self.loc = loc


def responses(errors: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """A route's own error answers, by status, for its OpenAPI document. Those that
    follow from the route's kind alone are added for it: 401 and 403 with a token, 413
    with a body, 503 with the database (app._openapi), 422 with parameters (FastAPI)."""
    return {status: {"model": Error, "description": words} for status, words in errors.items()}
