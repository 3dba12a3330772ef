"""What a job wrote in its working directory, and how long its directory is kept.

When an attempt ends, its worker sends the job's directory as it is then: a code
snapshot (service.code: the contents the API lacks, then the manifest) holding the
job's code and everything it wrote there, within the outputs limits; what it could not
send is named (``left``). ``record`` links that snapshot to the job; ``listing`` answers
what the job wrote that was not in the snapshot it ran (``ddpq outputs``);
``ddpq resubmit --resume`` runs a new job with that snapshot as its code, in a copy of
the old directory on whichever worker claims it.

One rule, owned here, says how long a directory is kept, both the worker's copy
(``due``, which the heartbeat answers) and the API's (``kept``, which code collection
keeps), and what the job purge waits for (``expired``): while its job is active, for
``DDPQ_WORKDIR_RETENTION`` after it ended, and with no end while it is one of its
owner's newest ``DDPQ_WORKDIR_KEEP_NEWEST`` ended jobs (docs/outputs.md says why, after
SkyPilot and Ray). ``_newest`` and ``_newest_sql`` are that last clause, for Python and
for SQL.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, exists, false, or_, select, update
from sqlalchemy.orm import Session, aliased

from service import queue
from service.code import TooLarge
from service.db import Database
from service.errors import NotFound
from service.models import TERMINAL, CodeSnapshot, Job, utcnow
from service.schemas import OutputFile, OutputLeft, OutputsIn, OutputsLimits, OutputsPublic


def _job(s: Session, job_id: int, lock: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    if lock:
        query = query.with_for_update()
    job = s.scalars(query).first()
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def _manifest(s: Session, sid: str | None) -> dict[str, dict[str, Any]] | None:
    if sid is None:
        return None
    row = s.get(CodeSnapshot, sid)
    return None if row is None else {e["path"]: e for e in row.manifest}


def written(
    code: dict[str, dict[str, Any]] | None, directory: dict[str, dict[str, Any]]
) -> tuple[list[OutputFile], int]:
    """What the directory holds that the code did not, or holds changed; and how many
    of the code's files it no longer holds."""
    base = code or {}
    items = []
    for path in sorted(directory):
        e = directory[path]
        was = base.get(path)
        if was is not None and _same(was, e):
            continue
        items.append(
            OutputFile(
                path=path,
                change="new" if was is None else "changed",
                size=e.get("size"),
                digest=e.get("digest"),
                executable=bool(e.get("executable", False)),
                symlink=e.get("symlink"),
            )
        )
    removed = sum(1 for p in base if p not in directory)
    return items, removed


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("digest", "symlink", "executable")
    return all(a.get(k) == b.get(k) for k in keys)


def record(db: Database, job_id: int, body: OutputsIn, limits: OutputsLimits) -> None:
    """Link the directory an attempt of the job left (a stored snapshot) to the job. Only
    the worker running the job's current attempt may (Conflict); what the job wrote must
    keep the outputs limits (TooLarge), as the worker already saw to."""
    with db.write() as s:
        job = _job(s, job_id, lock=True)
        queue.workers_attempt(s, job, body.attempt, body.worker)
        directory = _manifest(s, body.directory)
        if directory is None:
            raise NotFound(
                f"no code snapshot {body.directory[:16]}: send the directory first "
                "(POST /workers/code/snapshots)"
            )
        items, _ = written(_manifest(s, job.code), directory)
        files = [i for i in items if i.symlink is None]
        size = sum(i.size or 0 for i in files)
        if len(items) > limits.max_files or size > limits.max_bytes:
            raise TooLarge(
                ("body", "directory"),
                f"the job wrote {len(items)} files, {size} bytes: over the outputs limits "
                f"({limits.max_files} files, DDPQ_OUTPUTS_MAX_FILES; {limits.max_bytes} "
                "bytes, DDPQ_OUTPUTS_MAX_BYTES)",
            )
        s.execute(
            update(CodeSnapshot).where(CodeSnapshot.id == body.directory).values(used_at=utcnow())
        )
        job.outputs = body.directory
        job.outputs_left = [x.model_dump() for x in body.left]
        if body.left_more:
            job.outputs_left.append(
                {"path": "(more)", "size": None, "why": f"{body.left_more} more, not named"}
            )
        job.workdir = body.workdir
        job.outputs_attempt = body.attempt


def listing(db: Database, job_id: int, limits: OutputsLimits) -> OutputsPublic:
    """What the job wrote in its directory that was not in its snapshot, and until when
    it is kept."""
    with db.read() as s:
        job = _job(s, job_id)
        directory = _manifest(s, job.outputs)
        items, removed = written(_manifest(s, job.code), directory or {})
        newest = job.id in _newest(s, [job.owner], limits.keep_newest)
        ended = job.status in TERMINAL and job.finished_at is not None
        until = None
        if ended and not newest and job.finished_at is not None:
            until = job.finished_at + timedelta(seconds=limits.retention_s)
        left = [OutputLeft.model_validate(x) for x in job.outputs_left or []]
        return OutputsPublic(
            job_id=job.id,
            code=job.code,
            directory=job.outputs if directory is not None else None,
            attempt=job.outputs_attempt,
            worker=job.worker,
            workdir=job.workdir,
            items=items,
            bytes=sum(i.size or 0 for i in items),
            removed=removed,
            left=left,
            kept_until=until,
            kept_newest=ended and newest,
        )


def _newest(s: Session, owners: Iterable[str | None], n: int) -> set[int]:
    """The ids of each owner's newest ``n`` ended jobs."""
    out: set[int] = set()
    if n <= 0:
        return out
    for owner in set(owners):
        mine = Job.owner.is_(None) if owner is None else Job.owner == owner
        out.update(
            s.scalars(
                select(Job.id)
                .where(mine, Job.status.in_(sorted(TERMINAL)))
                .order_by(Job.id.desc())
                .limit(n)
            )
        )
    return out


def due(db: Database, job_ids: list[int], limits: OutputsLimits) -> list[int]:
    """Of the jobs whose directories a worker keeps, those whose directories may go: gone,
    or ended longer than the retention ago and not among their owner's newest."""
    cutoff = utcnow() - timedelta(seconds=limits.retention_s)
    with db.read() as s:
        rows = s.execute(
            select(Job.id, Job.owner, Job.status, Job.finished_at).where(Job.id.in_(job_ids))
        ).all()
        ended = [r for r in rows if r.status in TERMINAL]
        newest = _newest(s, [r.owner for r in ended], limits.keep_newest)
    known = {r.id for r in rows}
    past = {
        r.id
        for r in ended
        if r.id not in newest and (r.finished_at is None or _aware(r.finished_at) < cutoff)
    }
    return sorted((set(job_ids) - known) | past)


def _aware(t: datetime) -> datetime:
    return queue.as_utc(t)


def kept(limits: OutputsLimits) -> ColumnElement[bool]:
    """For code collection (service.code.collect): the snapshot is the directory of a
    job whose directory is still kept, or its code (what it wrote is told from that)."""
    return exists().where(
        or_(
            Job.outputs == CodeSnapshot.id,
            and_(Job.code == CodeSnapshot.id, Job.outputs.is_not(None)),
        ),
        _kept_sql(limits),
    )


def expired(limits: OutputsLimits) -> ColumnElement[bool]:
    """For the job purge (service.retention): the job of the enclosing statement has
    ended and its directory is no longer kept, on its worker or in the API."""
    return and_(Job.status.in_(sorted(TERMINAL)), Job.finished_at.is_not(None), ~_kept_sql(limits))


def _kept_sql(limits: OutputsLimits) -> ColumnElement[bool]:
    """The rule, in SQL: the job of the enclosing statement's directory is still kept
    (active, ended within the retention, or one of its owner's newest ended jobs)."""
    cutoff = utcnow() - timedelta(seconds=limits.retention_s)
    return or_(
        Job.status.not_in(sorted(TERMINAL)),
        Job.finished_at >= cutoff,
        _newest_sql(limits.keep_newest),
    )


def _newest_sql(n: int) -> ColumnElement[bool]:
    """``_newest`` in SQL: the job of the enclosing statement is one of its owner's
    newest ``n`` ended jobs. A probe of (owner, id) per job, not a ranking of every
    ended job. The owner-less jobs (from before users) are one owner, as in ``_newest``,
    kept apart so that the probe stays an equality the index answers."""
    if n <= 0:
        return false()
    other = aliased(Job)

    def newest(same: ColumnElement[bool]) -> Select[int]:
        return (
            select(other.id)
            .where(same, other.status.in_(sorted(TERMINAL)))
            .order_by(other.id.desc())
            .limit(n)
        )

    return or_(
        and_(Job.owner.is_not(None), Job.id.in_(newest(other.owner == Job.owner))),
        and_(Job.owner.is_(None), Job.id.in_(newest(other.owner.is_(None)))),
    )
