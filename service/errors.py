"""Domain errors raised below the routes; app.py maps each to its HTTP status."""

from typing import Any


def not_utf8_json(cause: Exception) -> dict[str, Any]:
    """The 422 detail item for a body that is not UTF-8 JSON, worded alike for every
    route (FastAPI's body reader, and the metrics route that parses its own body)."""
    return {
        "loc": ["body"],
        "msg": f"the body is not valid UTF-8 JSON: {cause}"[:300],
        "type": "json_invalid",
    }


class DomainError(Exception):
    status_code = 400

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class NotFound(DomainError):
    status_code = 404


class Conflict(DomainError):
    status_code = 409


class Invalid(DomainError):
    """A request that passed the schema but breaks a rule that needs the database."""

    status_code = 422

    def __init__(self, loc: tuple[str, str], detail: str) -> None:
        super().__init__(detail)
        self.loc = loc
