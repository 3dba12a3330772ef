"""What every resource's bodies share: the bounds, the Strict base of every request
body (unknown fields refused, no NUL or lone surrogate anywhere), a label people read,
the error answers, and the small answers several routes give."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ddpq import rules
from ddpq.rules import unsafe_char

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_NAME_CHARS = rules.MAX_NAME_CHARS
MAX_PATH_CHARS = 4096

StrictPosInt = Annotated[int, Field(strict=True, ge=1)]


def _shows_as_text(v: str) -> str:
    bad = unsafe_char(v)
    if bad is not None:
        raise ValueError(
            f"must not contain control or format characters (found {bad!r} at index"
            f" {v.index(bad)}): they act on the terminals that show it"
        )
    return v


# A label people read in tables and terminals: any length-bounded text without
# characters that act on a terminal (ddpq.rules.unsafe_char).
Label = Annotated[str, AfterValidator(_shows_as_text)]


_NUL_OR_SURROGATE = re.compile("[\x00\ud800-\udfff]")


def _no_nul_or_surrogate(value: Any, where: str = "") -> None:
    """Refuse NUL (Postgres text cannot hold it; C code truncates at it) and lone
    surrogates (not encodable as UTF-8: a database write or answer would fail) in
    every string of a request body, keys included."""
    if isinstance(value, str):
        bad = _NUL_OR_SURROGATE.search(value)
        if bad:
            what = "a NUL character" if bad.group() == "\x00" else "a lone surrogate (not UTF-8)"
            raise ValueError(f"{where or 'a string'} contains {what}")
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_nul_or_surrogate(k, f"a key in {where or 'the body'}")
            _no_nul_or_surrogate(v, f"{where}.{k}" if where else str(k)[:100])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_nul_or_surrogate(v, f"{where}[{i}]")


class Strict(BaseModel):
    """Every request body: unknown fields refused, no NUL or lone surrogate anywhere."""

    model_config = ConfigDict(extra="forbid")
    # True where every string field is already held to printable characters or a
    # literal, which refuses NUL and surrogates too: the metric ingest path skips the
    # walk (and it would otherwise run once per nested item).
    _strings_checked: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _clean_strings(cls, data: Any) -> Any:
        if not cls._strings_checked:
            _no_nul_or_surrogate(data)
        return data


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
