"""Every error ddpq raises on the client's and the worker's side, in one tree (as httpx's):

    DdpqError                   catch this for any of them
    ├── ApiError                a request to the API did not do what was asked: ``method``
    │   │                       and ``url`` say what was asked, ``status`` and ``detail``
    │   │                       what was answered (no answer: ``status`` None, ``detail``
    │   │                       why); the client, the worker and ddpq.train raise these
    │   ├── ApiUnavailable      try again later: 5xx or 429 (ddpq.wire.retryable)...
    │   │   └── ApiUnreachable  ...or no answer at all (refused connection, timeout)
    │   ├── ApiRefused          4xx: the same request will not do better
    │   └── ApiBadAnswer        an answer that is not the ddpq API's (not its JSON)
    ├── ConfigError             the config file, or what it does not hold (ddpq.config)
    ├── CodeError               a directory that cannot be sent as code (ddpq.codepack)
    ├── SnapshotError           a code manifest breaks a rule (ddpq.snapshot; a ValueError)
    └── WorkerError             the worker's own
        ├── SettingsError       a setting it cannot start with (a ValueError;
        │                       worker.executors.settings)
        ├── DataDirBusy         another worker holds the --data-dir (worker.files.datadir)
        ├── WallsError          jobs cannot be walled as asked (worker.walled.walls)
        ├── SlurmError          a Slurm command failed, or its answer will not do
        │                       (worker.executors.bridge, worker.executors.slurm: a
        │                       partition with no nodes)
        ├── JobError            this attempt cannot run: it fails with the message
        ├── RequirementsRefused a job's requirements break the policy
        │                       (worker.starting.requirements)
        └── Stopped             asked to stop while a job was being readied: no failure

Each message says what was asked and what was answered. ``ddpq.cli.base`` maps the tree
to the CLI's exit codes, in one place. Standard library only (and ddpq.wire): ddpq.train,
which every rank imports, raises these. The service's own errors are service/errors.py.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from ddpq.wire import retryable

# What of an answer that is not the API's JSON (a proxy's error page) a message quotes.
MAX_ANSWER_CHARS = 500


class DdpqError(Exception):
    """The base of every error ddpq raises to its users (not the service's)."""


# ---- talking to the API ------------------------------------------------------------------


class ApiError(DdpqError):
    """A request to the API that did not do what was asked.

    ``method`` and ``url`` are what was asked (``path``: the URL's path); ``status`` and
    ``detail`` what was answered: the HTTP status and the API's ``detail`` (FastAPI's
    validation errors are a list; ``format_detail`` says them in a line), or, when
    nothing was answered, None and why not."""

    def __init__(self, method: str, url: str, status: int | None, detail: Any) -> None:
        self.method = method
        self.url = url
        self.status = status
        self.detail = detail
        super().__init__(self._message())

    @property
    def path(self) -> str:
        return urlsplit(self.url).path or self.url

    @property
    def asked(self) -> str:
        """``GET /jobs/3``: what was asked, in words."""
        return f"{self.method} {self.path}"

    @property
    def answered(self) -> str:
        """``HTTP 404: job 3 not found``, or why nothing was answered."""
        if self.status is None:
            return f"no answer ({format_detail(self.detail)})"
        return f"HTTP {self.status}: {format_detail(self.detail)}"

    def _message(self) -> str:
        return f"{self.asked}: {self.answered}"

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (a log handler, a queue) as made
        return (type(self), (self.method, self.url, self.status, self.detail))


class ApiUnavailable(ApiError):
    """Not now: the API answered 5xx or 429, or nothing; the same request may do later."""


class ApiUnreachable(ApiUnavailable):
    """Nothing was answered: the API could not be reached, or the connection broke."""

    def _message(self) -> str:
        return f"{self.method} {self.url}: {self.answered}"


class ApiRefused(ApiError):
    """The API answered 4xx: asking the same again will not do better."""


class ApiBadAnswer(ApiError):
    """An answer that is not what the ddpq API sends (a proxy's page instead of its
    JSON): the URL is likely not the ddpq API."""


def format_detail(detail: Any) -> str:
    """An answer's detail in a line: FastAPI's validation errors as 'field: reason'."""
    if isinstance(detail, list):
        parts = []
        for e in detail:
            if isinstance(e, dict):
                loc = ".".join(
                    str(x) for x in e.get("loc", []) if x not in ("body", "query", "path")
                )
                parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
            else:
                parts.append(str(e))
        return "; ".join(parts)
    return str(detail)


def answer_error(method: str, url: str, status: int, body: str) -> ApiUnavailable | ApiRefused:
    """The error for an answer of ``status`` (400 or more) with ``body``: unavailable
    when it may do later (ddpq.wire.retryable), else refused; its detail the API's
    ``detail`` when the body is the API's JSON, else the body's text (cut)."""
    detail: Any = body if len(body) <= MAX_ANSWER_CHARS else body[:MAX_ANSWER_CHARS] + "..."
    try:
        parsed = json.loads(body)
    except ValueError:
        pass
    else:
        if isinstance(parsed, dict) and "detail" in parsed:
            detail = parsed["detail"]
    kind = ApiUnavailable if retryable(status) else ApiRefused
    return kind(method, url, status, detail)


def no_answer(method: str, url: str, exc: BaseException) -> ApiUnreachable:
    """The error for a request that got no answer (``exc``: the transport's error)."""
    words = " ".join(str(exc).split())
    why = f"{type(exc).__name__}: {words}" if words else type(exc).__name__
    return ApiUnreachable(method, url, None, why)


def bad_answer(method: str, url: str, status: int, body: str) -> ApiBadAnswer:
    """The error for an answer that is not the ddpq API's JSON."""
    quoted = body[:100] + ("..." if len(body) > 100 else "")
    return ApiBadAnswer(method, url, status, f"not the ddpq API's JSON: {quoted!r}")


# ---- the client's own -------------------------------------------------------------------


class ConfigError(DdpqError):
    """The config file cannot be read or does not hold what was asked (a usage error)."""


class CodeError(DdpqError):
    """The directory cannot be sent as it is (over a limit, a name that cannot be)."""


class SnapshotError(DdpqError, ValueError):
    """A code snapshot's manifest breaks a rule of ddpq.snapshot: nothing of it is
    written. The message names the entry and the rule."""


# ---- the worker's own -------------------------------------------------------------------


class WorkerError(DdpqError):
    """The worker's own errors (``ddpq worker``, the Slurm bridge, an attempt)."""


class SettingsError(WorkerError, ValueError):
    """Settings a worker cannot start with (worker.executors.settings): what is wrong with each bad
    value, naming its flag and variable, on one line (joined by "; ")."""


class DataDirBusy(WorkerError):
    """Another worker holds the --data-dir (its lock): the message names its pid."""


class WallsError(WorkerError):
    """The worker cannot wall its jobs as asked: the message says why and what to do."""


class SlurmError(WorkerError):
    """A Slurm command failed (its error output says why), or answered what the bridge
    cannot use (sinfo naming no node of the partition)."""


class JobError(WorkerError):
    """The attempt cannot start (bad entrypoint, unknown recipe, code or requirements
    refused): fail it with this reason."""


class RequirementsRefused(WorkerError):
    """The job's requirements break this worker's policy or cannot be read: str() says
    where, why and what would do, in words for the job's author."""


class Stopped(WorkerError):
    """The attempt was asked to stop while its code or requirements were being readied
    (not a failure: the attempt ends as its stop says)."""
