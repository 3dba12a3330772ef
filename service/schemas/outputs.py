"""What a job wrote in its working directory: what a worker reports of it, what a user
reads, and the limits on it (service.outputs)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from ddpq.messages import INT32_MAX, INT64_MAX, Digest, Strict
from ddpq.snapshot import MAX_PATH_BYTES

MAX_LEFT = 1000  # files named as not sent: more are counted, not named


class OutputsLimits(BaseModel):
    """GET /workers/outputs/limits: what a worker may send of a job's directory, and how
    long it keeps it (DDPQ_OUTPUTS_MAX_FILES, DDPQ_OUTPUTS_MAX_BYTES,
    DDPQ_CODE_MAX_FILE_BYTES, DDPQ_WORKDIR_RETENTION, DDPQ_WORKDIR_KEEP_NEWEST)."""

    max_files: int
    max_bytes: int
    max_file_bytes: int
    retention_s: float
    keep_newest: int


class OutputLeft(Strict):
    """A file the job wrote that was not sent: its path as written (or as much of it as
    can be shown), its size, and why (over a limit, a link leading out, a special file)."""

    path: Annotated[str, Field(max_length=MAX_PATH_BYTES)]
    size: Annotated[int | None, Field(strict=True, ge=0, le=INT64_MAX)] = None
    why: Annotated[str, Field(min_length=1, max_length=500)]


class OutputsIn(Strict):
    """POST /workers/jobs/{id}/outputs: the job's directory as its attempt ended, sent
    as a code snapshot (POST /workers/code/snapshots) first."""

    worker: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")]
    attempt: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]
    directory: Digest
    workdir: Annotated[str, Field(min_length=1, max_length=MAX_PATH_BYTES)]
    left: Annotated[list[OutputLeft], Field(max_length=MAX_LEFT)] = []
    left_more: Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)] = 0


class OutputFile(BaseModel):
    """A file (size, digest) or a symlink (target) the job wrote or changed."""

    path: str
    change: Literal["new", "changed"]
    size: int | None = None
    digest: str | None = None
    executable: bool = False
    symlink: str | None = None


class OutputsPublic(BaseModel):
    """GET /jobs/{id}/outputs: what the job wrote that was not in its snapshot."""

    job_id: int
    # The snapshot it ran, and its directory as its last attempt ended (a code snapshot:
    # `ddpq resubmit --resume` runs a new job in a copy of it); null until an attempt
    # ended on a worker that sent it.
    code: str | None
    directory: str | None
    attempt: int | None
    worker: str | None
    workdir: str | None
    items: list[OutputFile]
    bytes: int
    removed: int  # files of the snapshot the job deleted
    # What the job wrote that was not sent (it stays on its worker only), and why; past
    # MAX_LEFT named, one last entry counts the rest.
    left: list[OutputLeft]
    # When the directory goes (on the worker and here): null while the job runs, and
    # while it is among its owner's newest ended jobs (kept_newest says so).
    kept_until: datetime | None
    kept_newest: bool
