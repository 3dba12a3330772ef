"""Code snapshots: a content's digest, a manifest's entries (stored ones hold every
rule of ddpq.snapshot), what a snapshot still lacks, and the limits on one."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from ddpq.messages import INT64_MAX, Digest, Strict
from ddpq.snapshot import MAX_PATH_BYTES, entry_problem


class CodeSummary(BaseModel):
    """A code snapshot: its id (the manifest's sha256), how many files, how many bytes."""

    id: str
    files: int
    bytes: int


class ManifestEntry(Strict):
    """A file (digest, size, executable) or a symlink (target) of a code snapshot."""

    # In characters, a bound before the rules (entry_problem) count the bytes.
    path: Annotated[str, Field(max_length=MAX_PATH_BYTES)]
    digest: Digest | None = None
    size: Annotated[int | None, Field(strict=True, ge=0, le=INT64_MAX)] = None
    executable: Annotated[bool, Field(strict=True)] = False
    symlink: Annotated[str | None, Field(max_length=MAX_PATH_BYTES)] = None


class ManifestEntryIn(ManifestEntry):
    """An entry of a manifest being stored: it keeps every rule of ddpq.snapshot. (An
    answer is not checked again: a snapshot stored before a rule was added is served as
    it is, and the worker, which checks every entry before it writes, refuses it.)"""

    @model_validator(mode="after")
    def _file_or_symlink(self) -> ManifestEntryIn:
        problem = entry_problem(self.model_dump(exclude_none=True))
        if problem:
            raise ValueError(problem)
        return self


class SnapshotIn(Strict):
    """POST /code/snapshots: a manifest whose contents are all uploaded."""

    files: Annotated[list[ManifestEntryIn], Field(min_length=1, max_length=1_000_000)]


class SnapshotPublic(CodeSummary):
    manifest: list[ManifestEntry]


class MissingRequest(Strict):
    """POST /code/missing: the contents a snapshot will need."""

    digests: Annotated[list[Digest], Field(max_length=1_000_000)]


class MissingReply(BaseModel):
    missing: list[str]


class PackLimits(BaseModel):
    """How POST /code/packs takes contents (ddpq.pack): the largest body (compressed, as
    sent), the most bytes its contents may hold uncompressed, and the encodings known."""

    max_body_bytes: int
    max_content_bytes: int
    encodings: list[str]


class PackReply(BaseModel):
    """What a pack stored: contents new to the API, and those it held already."""

    stored: int
    known: int


class CodeLimits(BaseModel):
    """What one snapshot may hold (DDPQ_CODE_MAX_FILES, _BYTES, _FILE_BYTES)."""

    max_files: int
    max_bytes: int
    max_file_bytes: int
