"""What every resource's bodies share: the error answers and the small answers several
routes give. (The Strict base of every request body, unknown fields refused and no NUL
or lone surrogate anywhere, the bounds and a label people read are ddpq.messages', which
the worker's requests share.)"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from ddpq import rules

MAX_NAME_CHARS = rules.MAX_NAME_CHARS

StrictPosInt = Annotated[int, Field(strict=True, ge=1)]


class Accepted(BaseModel):
    accepted: int


class MetricsAccepted(Accepted):
    # Why the job is to stop, when its sweep pruned it on this request's points (asked
    # with ``judge``): its reporter stops the program; the job is being cancelled with
    # this reason. None otherwise.
    stop: str | None = None


class LogAppended(BaseModel):
    next_offset: int


# ---- errors -----------------------------------------------------------------------------


class ErrorItem(BaseModel):
    """One invalid field: where (body, query, path or header, then its name), why, and
    pydantic's error type."""

    loc: list[str | int]
    msg: str
    type: str


class Error(BaseModel):
    """An error answer (a 422 has FastAPI's HTTPValidationError instead): what went
    wrong, in words, or, for a code snapshot over a limit (413), the field as a 422
    names it."""

    detail: str | list[ErrorItem]
