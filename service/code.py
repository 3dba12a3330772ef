"""Code snapshots: file contents stored once by digest, manifests, and their collection.

A client sends a job's code as a manifest (ddpq.snapshot) and the contents the API
lacks (``missing``, then ``put_pack`` for packs of them, compressed where that pays
(ddpq.pack), or ``put_blob`` for each, as older clients do), then creates the snapshot; a job names
it in ``spec.code`` and every worker that runs the job fetches it from any API process.

The contents live in the database (``code_blobs``), not on the API's disk: every API
process serves every blob with no shared filesystem to set up, an upload is
transactional (a blob is stored whole or not at all), and collection is one query
over the same rows that say what is in use. What that costs is measured by
bench/code.py (README, "Your code").

Collection (``collect``, run by the API's sweeper): a snapshot goes once no job of it
is queued or running, its last job ended longer than the retention period ago, and it
has not been used for that long; a blob goes once no snapshot lists it and it has not
been asked for (``missing``) or linked for the retention period, so an upload in
progress keeps what it found already stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import ColumnElement, delete, exists, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ddpq import pack
from ddpq.snapshot import Entry, Limits, limit_problem, manifest_problem, snapshot_id
from service.db import Database
from service.errors import Invalid, NotFound
from service.models import (
    TERMINAL,
    CodeBlob,
    CodeSnapshot,
    CodeSnapshotBlob,
    Job,
    utcnow,
)
from service.schemas import CodeSummary, SnapshotPublic


class TooLarge(Invalid):
    """A snapshot or a blob over a limit: 413, naming the limit and the largest files."""

    status_code = 413


# ---- contents ----------------------------------------------------------------------------


def missing(db: Database, digests: list[str]) -> list[str]:
    """Which of ``digests`` the API does not hold. Those it holds are marked used now, so
    collection leaves them be while the client goes on to create its snapshot."""
    wanted = sorted(set(digests))
    have: set[str] = set()
    with db.write() as s:
        for part in _chunks(wanted, 500):
            have.update(s.scalars(select(CodeBlob.digest).where(CodeBlob.digest.in_(part))))
            s.execute(update(CodeBlob).where(CodeBlob.digest.in_(part)).values(used_at=utcnow()))
    return [d for d in wanted if d not in have]


def put_blob(db: Database, digest: str, data: bytes) -> None:
    """Store ``data`` as the content of ``digest`` (a repeat changes nothing)."""
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise Invalid(
            ("path", "digest"),
            f"the body's sha256 is {actual}, not {digest}: the upload was damaged or misnamed",
        )
    now = utcnow()
    stmt = _upsert(db)(CodeBlob).values(
        digest=digest, size=len(data), data=data, created_at=now, used_at=now
    )
    with db.write() as s:
        # Two clients uploading the same content race harmlessly: the second is a no-op.
        s.execute(stmt.on_conflict_do_nothing(index_elements=["digest"]))


def put_pack(db: Database, body: bytes, max_size: int, max_total: int) -> tuple[int, int]:
    """Store every content of a pack (ddpq.pack), each checked against its digest after
    decompressing: (stored now, held already). One bad frame refuses the pack (Invalid,
    naming the frame's field) and stores nothing. A content that came compressed is
    stored compressed (``encoding`` "zstd"): text shrinks to a third or so, in the
    database and on its way to a worker that takes zstd (``blob``)."""
    try:
        frames = pack.read(body, max_size, max_total)
    except pack.PackError as exc:
        raise Invalid(("body", exc.field), exc.message) from None
    now = utcnow()
    rows = [
        {
            "digest": f.digest,
            "size": f.size,
            "data": f.data if f.stored is None else f.stored,
            "encoding": None if f.stored is None else pack.ZSTD,
            "created_at": now,
            "used_at": now,
        }
        for f in frames
    ]
    with db.write() as s:
        digests = [f.digest for f in frames]  # each once (pack.read)
        have = set(s.scalars(select(CodeBlob.digest).where(CodeBlob.digest.in_(digests))))
        new = [r for r in rows if r["digest"] not in have]
        if new:
            # A content another upload stored meanwhile is left as it is (DO NOTHING).
            s.connection().execute(
                _upsert(db)(CodeBlob).on_conflict_do_nothing(index_elements=["digest"]), new
            )
    return len(new), len(have)


def _upsert(db: Database) -> Any:
    """The dialect's INSERT, which has ON CONFLICT DO NOTHING."""
    return postgresql.insert if db.dialect == "postgresql" else sqlite.insert


def blob(db: Database, digest: str, zstd_ok: bool = False) -> tuple[bytes, str | None]:
    """A content's bytes, and their encoding: as stored ("zstd") if ``zstd_ok`` (the
    asker takes zstd), else uncompressed (None)."""
    with db.read() as s:
        row = s.execute(
            select(CodeBlob.data, CodeBlob.size, CodeBlob.encoding).where(CodeBlob.digest == digest)
        ).first()
    if row is None:
        raise NotFound(f"no code content {digest}")
    data, size, encoding = bytes(row.data), int(row.size), row.encoding
    if encoding is None or zstd_ok:
        return data, encoding
    return pack.decompress(data, size), None


# ---- snapshots ---------------------------------------------------------------------------


def create_snapshot(db: Database, entries: list[Entry], limits: Limits) -> CodeSummary:
    """Store a manifest whose contents are all uploaded; the same manifest again is the
    same snapshot. Invalid (422) names what is wrong; TooLarge (413) what is too big."""
    problem = manifest_problem(entries)
    if problem:
        raise Invalid(("body", "files"), problem)
    problem = limit_problem(entries, limits)
    if problem:
        raise TooLarge(("body", "files"), problem)
    files = sorted(entries, key=lambda e: e.path)
    sid = snapshot_id(files)
    declared = {e.digest: e.size for e in files if e.digest is not None}
    now = utcnow()
    with db.write() as s:
        stored = _sizes(s, list(declared))
        absent = [d for d in declared if d not in stored]
        if absent:
            named = ", ".join(e.path for e in files if e.digest in set(absent[:5]))[:500]
            raise Invalid(
                ("body", "files"),
                f"{len(absent)} content(s) not uploaded (PUT /code/blobs/{{digest}} first): "
                f"{named}",
            )
        wrong = [e.path for e in files if e.digest is not None and stored[e.digest] != e.size]
        if wrong:
            raise Invalid(("body", "files"), f"size differs from the uploaded content: {wrong[0]}")
        for part in _chunks(list(declared), 500):
            s.execute(update(CodeBlob).where(CodeBlob.digest.in_(part)).values(used_at=now))
        # Two submits of one tree at once (a sweep script) race harmlessly: the second
        # insert does nothing, and both name the same snapshot.
        added = s.execute(
            _upsert(db)(CodeSnapshot)
            .values(
                id=sid,
                files=len(files),
                bytes=sum(declared.values()),
                manifest=[e.wire() for e in files],
                created_at=now,
                used_at=now,
            )
            .on_conflict_do_nothing(index_elements=["id"])
        )
        if cast(CursorResult[Any], added).rowcount and declared:
            s.execute(
                _upsert(db)(CodeSnapshotBlob).on_conflict_do_nothing(),
                [{"snapshot_id": sid, "digest": d} for d in declared],
            )
        else:
            s.execute(update(CodeSnapshot).where(CodeSnapshot.id == sid).values(used_at=now))
        row = s.get(CodeSnapshot, sid)
        assert row is not None
        return CodeSummary(id=row.id, files=row.files, bytes=row.bytes)


def _sizes(s: Session, digests: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in _chunks(digests, 500):
        rows = s.execute(select(CodeBlob.digest, CodeBlob.size).where(CodeBlob.digest.in_(part)))
        out.update({d: int(n) for d, n in rows})
    return out


def snapshot(db: Database, sid: str) -> SnapshotPublic:
    with db.read() as s:
        row = s.get(CodeSnapshot, sid)
        if row is None:
            raise NotFound(f"no code snapshot {sid}")
        return SnapshotPublic.model_validate(
            {"id": row.id, "files": row.files, "bytes": row.bytes, "manifest": row.manifest}
        )


def use(s: Session, sid: str, entrypoint: str | None) -> None:
    """For a job being submitted with snapshot ``sid``: it exists (marked used now, so
    collection cannot take it from under the job) and holds the entrypoint as a file."""
    touched = s.execute(update(CodeSnapshot).where(CodeSnapshot.id == sid).values(used_at=utcnow()))
    if cast(CursorResult[Any], touched).rowcount == 0:
        raise Invalid(
            ("body", "code"),
            f"no code snapshot {sid[:16]}: upload it first (POST /code/snapshots), or it "
            "was collected after its retention period",
        )
    if entrypoint is not None:
        row = s.get(CodeSnapshot, sid)
        assert row is not None
        if not any(e["path"] == entrypoint and "digest" in e for e in row.manifest):
            raise Invalid(
                ("body", "entrypoint"),
                f"{entrypoint[:200]!r} is not a file of code snapshot {sid[:12]} "
                f"({row.files} files)",
            )


def summaries(s: Session, ids: Iterable[str | None]) -> dict[str, CodeSummary]:
    """The file count and size of each snapshot named (for the jobs that run them)."""
    wanted = sorted({i for i in ids if i})
    if not wanted:
        return {}
    rows = s.execute(
        select(CodeSnapshot.id, CodeSnapshot.files, CodeSnapshot.bytes).where(
            CodeSnapshot.id.in_(wanted)
        )
    )
    return {r.id: CodeSummary(id=r.id, files=r.files, bytes=r.bytes) for r in rows}


# ---- collection --------------------------------------------------------------------------


def collect(
    db: Database, retention_s: float, keep: ColumnElement[bool] | None = None
) -> tuple[int, int]:
    """Delete what no job needs and nobody used for ``retention_s``: (snapshots, blobs).
    ``keep``: the snapshots kept for another reason (a job's directory as it ended,
    service.outputs.kept)."""
    cutoff = utcnow() - timedelta(seconds=retention_s)
    needed: ColumnElement[bool] = exists().where(
        Job.code == CodeSnapshot.id,
        Job.status.not_in(sorted(TERMINAL)) | (Job.finished_at >= cutoff),
    )
    if keep is not None:
        needed = needed | keep
    linked = exists().where(CodeSnapshotBlob.digest == CodeBlob.digest)
    with db.write() as s:
        gone = s.execute(delete(CodeSnapshot).where(CodeSnapshot.used_at < cutoff, ~needed))
        snapshots = cast(CursorResult[Any], gone).rowcount
    try:
        with db.write() as s:
            gone = s.execute(delete(CodeBlob).where(CodeBlob.used_at < cutoff, ~linked))
            blobs = cast(CursorResult[Any], gone).rowcount
    except IntegrityError:
        # A snapshot linked one of them meanwhile (Postgres): nothing is deleted this
        # round; the next one decides on what is committed by then.
        blobs = 0
    return int(snapshots), int(blobs)


def _chunks(items: list[Any], n: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]
