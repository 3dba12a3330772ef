"""Every setting of the API process, read once from ``DDPQ_*`` variables.

Tokens are resolved here too: on a loopback address with none configured, ddpq
generates them into ``DDPQ_DATA_DIR`` (mode 0600) so that ``make run`` works on a
laptop; anywhere else it refuses to start rather than run an open job launcher.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from ddpq.snapshot import Limits
from service.db import Policy
from service.errors import ServiceError

API_TOKEN_FILE = "api-token"  # noqa: S105 - a file name, not a secret
WORKER_TOKEN_FILE = "worker-token"  # noqa: S105
MIN_TOKEN_CHARS = 16
# Words of placeholder values (.env.example's "replace-me-with-a-random-token"):
# a token containing one was copied from an example, not generated.
PLACEHOLDER_WORDS = ("replace-me", "replace_me", "changeme", "change-me", "example", "your-")
MIN_DISTINCT_CHARS = 8  # "aaaaaaaaaaaaaaaa" is long enough and still guessable

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
NEVER = ("never", "forever")


def duration_s(value: object) -> float | None:
    """A duration setting as seconds: ``90``, ``90s``, ``30m``, ``12h``, ``7d``, ``2w``;
    ``never`` for no limit (None)."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("a duration is not negative")
        return float(value)
    text = str(value).strip().lower()
    if text in NEVER:
        return None
    m = _DURATION.fullmatch(text)
    if m is None:
        raise ValueError(
            f"{str(value)[:50]!r} is not a duration: a number with s, m, h, d or w "
            "(90s, 30m, 12h, 7d, 2w; seconds without one), or never"
        )
    return float(m[1]) * _UNIT_S[m[2] or "s"]


# Seconds (None: never), from a number or words such as "7d" (duration_s).
Duration = Annotated[float | None, BeforeValidator(duration_s)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DDPQ_", extra="ignore")

    data_dir: Path = Path("./var")
    database_url: str | None = None
    api_token: SecretStr | None = None
    worker_token: SecretStr | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # A running attempt whose worker has not heart-beaten for this long is lost.
    lease_s: float = Field(default=30.0, gt=0)
    # Once the first job in the queue has waited this long, later jobs stop
    # starting ahead of it (backfill) on workers that could ever run it.
    starvation_s: float = Field(default=600.0, ge=0)
    # How often workers are asked to heartbeat (they also learn of cancels then).
    heartbeat_s: float = Field(default=2.0, gt=0)
    # Longest a worker's claim request is held open waiting for a job.
    max_claim_wait_s: float = Field(default=30.0, ge=0)
    # How often an idle long-poll re-checks the database (covers jobs submitted
    # through another API process until LISTEN/NOTIFY wakes it first).
    claim_recheck_s: float = Field(default=1.0, gt=0)
    max_body_bytes: int = 1024 * 1024
    # A failed attempt that is retried waits this long, doubling with each further
    # failure of the job, up to the cap (a crash loop must not hog the queue).
    retry_backoff_s: float = Field(default=10.0, ge=0)
    retry_backoff_max_s: float = Field(default=600.0, ge=0)
    # A multi-node job's node slots are held as they are claimed; if they are not all
    # held within this long, the held ones are released (their workers may run other
    # jobs) and the job waits for retry_backoff_s before it gathers again.
    gang_timeout_s: float = Field(default=120.0, gt=0)
    # Fair share: among queued jobs of one priority, the user who used the hosts least
    # lately goes first; what was used a half-life ago counts half. A CPU slot counts
    # this much of a GPU.
    fairshare_half_life_s: float = Field(default=86400.0, gt=0)
    cpu_slot_weight: float = Field(default=0.125, ge=0)
    # Preemption: a queued job that outranks running ones and has no room may take
    # theirs; they hand back (requeued, no failure counted) and resume from their last
    # checkpoint. off; priority (a higher priority outranks); fair-share (so does, at
    # one priority, an owner who used less lately). Never a job run less than the minimum.
    preemption: Literal["off", "priority", "fair-share"] = "off"
    preempt_min_run_s: float = Field(default=60.0, ge=0)
    # Stored output per job: past it the middle is dropped, keeping the first quarter
    # (how it started) and the newest three quarters (how it is going or how it ended).
    log_max_bytes: int = Field(default=32 * 1024 * 1024, ge=4096)
    # How often a GET /jobs/{id}/events stream looks for a status change or new points.
    events_poll_s: float = Field(default=0.5, gt=0, le=60)
    # Code snapshots (service.code): what one may hold, and how long what no job needs
    # is kept (a snapshot stays while a job of it is queued or running, and for this
    # long after its last job ended, for `ddpq resubmit` and `ddpq code`).
    code_max_files: int = Field(default=20_000, ge=1)
    code_max_bytes: int = Field(default=1024**3, ge=1)
    code_max_file_bytes: int = Field(default=100 * 1024**2, ge=1)
    code_retention_s: float = Field(default=7 * 24 * 3600.0, ge=0)
    # Checkpoint retention (service.checkpoints; docs/checkpoints.md). keep_last: how
    # many of a job's newest checkpoints stay while it runs, for jobs whose spec does not
    # say (0: all); older ones are deleted on their worker as new ones register, except
    # those saved with keep=True and the one a resume would use. checkpoint_retention:
    # how long an ended job's checkpoints stay (a duration: 7d, 12h, 0; never), after
    # which the worker that holds them deletes the job's checkpoint directory.
    keep_last: int = Field(default=3, ge=0, le=1_000_000)
    checkpoint_retention: Duration = 7 * 24 * 3600.0

    def code_limits(self) -> Limits:
        return Limits(self.code_max_files, self.code_max_bytes, self.code_max_file_bytes)

    def policy(self) -> Policy:
        return Policy(
            lease_s=self.lease_s,
            starvation_s=self.starvation_s,
            retry_backoff_s=self.retry_backoff_s,
            retry_backoff_max_s=self.retry_backoff_max_s,
            gang_timeout_s=self.gang_timeout_s,
            log_max_bytes=self.log_max_bytes,
            fairshare_half_life_s=self.fairshare_half_life_s,
            cpu_slot_weight=self.cpu_slot_weight,
            preemption=self.preemption,
            preempt_min_run_s=self.preempt_min_run_s,
            keep_last=self.keep_last,
            checkpoint_retention_s=self.checkpoint_retention,
        )

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'ddpq.db').resolve()}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TokenError(ServiceError, RuntimeError):
    """The service cannot start with the tokens it was given."""


def _weak(token: str) -> str | None:
    if len(token) < MIN_TOKEN_CHARS:
        return f"shorter than {MIN_TOKEN_CHARS} characters"
    lower = token.lower()
    # Short defaults ("secret", "changeme") fail the length check above.
    if any(w in lower for w in PLACEHOLDER_WORDS):
        return "a well-known default or an example's placeholder"
    if len(set(token)) < MIN_DISTINCT_CHARS:
        return f"made of fewer than {MIN_DISTINCT_CHARS} distinct characters"
    return None


def _read_or_create(path: Path) -> str:
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL + mode 0600 from the first byte: the token is never world-readable.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def resolve_tokens(settings: Settings, host: str) -> tuple[str, str]:
    """Return (api_token, worker_token), generating them on loopback when unset."""
    loopback = is_loopback(host)
    found: dict[str, str] = {}
    for var, secret, filename in (
        ("DDPQ_API_TOKEN", settings.api_token, API_TOKEN_FILE),
        ("DDPQ_WORKER_TOKEN", settings.worker_token, WORKER_TOKEN_FILE),
    ):
        if secret is not None and secret.get_secret_value().strip():
            token = secret.get_secret_value().strip()
            problem = _weak(token)
            if problem and not loopback:
                raise TokenError(
                    f"{var} is {problem}; on a non-loopback address ({host}) set it to a "
                    "random value: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
                )
            found[var] = token
        elif loopback:
            found[var] = _read_or_create(settings.data_dir / filename)
        else:
            raise TokenError(
                f"{var} is not set. ddpq runs code on GPU hosts, so it will not listen on "
                f"{host} without tokens: set DDPQ_API_TOKEN and DDPQ_WORKER_TOKEN "
                "(two different random values), or listen on 127.0.0.1."
            )
    if found["DDPQ_API_TOKEN"] == found["DDPQ_WORKER_TOKEN"]:
        raise TokenError("DDPQ_API_TOKEN and DDPQ_WORKER_TOKEN must differ")
    return found["DDPQ_API_TOKEN"], found["DDPQ_WORKER_TOKEN"]
