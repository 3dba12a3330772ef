"""A job's combined output: storing it under a cap, reading it from an offset, following it.

Offsets are positions in the stored byte stream of the whole job (every attempt, in
order), counting the bytes the cap later dropped: an offset a reader was given stays
valid however much is cut after it. The cap keeps the head (HEAD_SHARE of
DDPQ_LOG_MAX_BYTES: how the job started) and the newest bytes (how it is going, or why
it ended) and drops whole chunks in between, so the stored chunks have one gap. A read
that crosses the gap gets a marker line saying how much was cut and where the output
resumes; the marker is not part of the stored stream and counts for no offset.

The ranks' lines arrive marked with their rank (torchrun's ``[rank0]: `` prefix, set by
the worker); the worker's own lines start with ``[ddpq]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from ddpq.wire import cut_marker
from service import queue
from service.db import Database
from service.errors import Conflict, Invalid, NotFound
from service.models import TERMINAL, Attempt, Job, JobNode, LogChunk, Worker

HEAD_SHARE = 0.25
# One answer carries at most this many stored bytes; X-Next-Offset says where to go on.
MAX_LOG_RESPONSE_BYTES = 8 * 1024 * 1024
# How often a follower looks for new output. It sleeps on the event loop between looks:
# no database connection and no thread is held while a follower waits.
FOLLOW_POLL_S = 0.25
# Chunks fetched per round trip while reading (a server-side cursor on Postgres).
_FETCH_CHUNKS = 64


def head_bytes(cap: int) -> int:
    return int(cap * HEAD_SHARE)


# ---- writing ----------------------------------------------------------------------------


def append(db: Database, job_id: int, number: int, worker: str, offset: int, data: bytes) -> int:
    """Append a chunk of attempt ``number``'s output; returns the bytes of it stored.

    ``offset`` is where the chunk starts in this attempt's own output, so a chunk resent
    after a lost answer is recognised and stored once.
    """
    cap = db.policy.log_max_bytes
    with db.write() as s:
        # Lock the job row first (Postgres): two API processes handed the same resent
        # chunk then store it once, and chunk starts never collide.
        row = s.execute(
            select(Job.id, Job.log_size, Job.attempt, Job.nnodes)
            .where(Job.id == job_id)
            .with_for_update()
        ).first()
        if row is None:
            raise NotFound(f"no job {job_id}")
        # Each node of a multi-node attempt ships its own stream into the one log.
        attempt, node = queue.workers_attempt(s, row, number, worker)
        stream: Attempt | JobNode = node if node is not None else attempt
        have = stream.log_bytes
        stream.log_bytes = have + _write(s, row, number, have, offset, data, cap)
        return stream.log_bytes


def append_node(
    db: Database, attempt_id: int, job_id: int, number: int, node: int, offset: int, data: bytes
) -> int:
    """Append a chunk of node ``node``'s own output of attempt ``number``, sent with the
    attempt's job token (a Slurm attempt's nodes ship their own); returns the bytes of
    that node's stream stored. Refused once the attempt no longer acts for its job."""
    cap = db.policy.log_max_bytes
    with db.write() as s:
        row = s.execute(
            select(Job.id, Job.log_size, Job.attempt, Job.nnodes, Job.status)
            .where(Job.id == job_id)
            .with_for_update()
        ).first()
        attempt = s.get(Attempt, attempt_id)
        if row is None or attempt is None:
            raise NotFound(f"no job {job_id}")
        stale = queue.fenced(number, attempt.ended_at is not None, row.attempt, row.status)
        if stale:
            raise Conflict(stale)
        if s.scalar(select(Worker.cluster).where(Worker.name == attempt.worker)) is None:
            # A worker ships its attempts' output itself; only a bridge's nodes do.
            raise Conflict(f"attempt {number} runs on worker {attempt.worker}, which ships its log")
        if node >= row.nnodes:
            raise Invalid(("query", "node"), f"this job has {row.nnodes} node(s), numbered from 0")
        streams = dict(attempt.node_log_bytes or {})
        have = int(streams.get(str(node), 0))
        streams[str(node)] = have + _write(s, row, number, have, offset, data, cap)
        attempt.node_log_bytes = streams  # a new dict: the ORM sees the change
        return int(streams[str(node)])


def _write(s: Session, row: Any, number: int, have: int, offset: int, data: bytes, cap: int) -> int:
    """Store what of a chunk starting at ``offset`` of a stream that has ``have`` bytes
    stored is new (a resent chunk is stored once); returns the new bytes' count."""
    if offset > have:
        raise Conflict(f"log gap: this attempt has {have} bytes stored, chunk starts at {offset}")
    fresh = data[have - offset :]
    if not fresh:
        return 0
    new = len(fresh)
    if have == 0 and row.log_size > 0 and not _ends_line(s, row.id):
        # An earlier attempt (or another node) stopped mid-line: this stream starts on a
        # line of its own, as every line must start with its [rankN] or [ddpq] mark.
        fresh = b"\n" + fresh
    _store(s, row.id, number, row.log_size, fresh, cap)
    return new


def _ends_line(s: Session, job_id: int) -> bool:
    last = s.scalar(
        select(func.substr(LogChunk.data, func.length(LogChunk.data), 1))
        .where(LogChunk.job_id == job_id)
        .order_by(LogChunk.start.desc())
        .limit(1)
    )
    return last is None or bytes(last) == b"\n"


def _store(s: Session, job_id: int, attempt: int, size: int, data: bytes, cap: int) -> None:
    head = head_bytes(cap)
    pieces = [(size, data)]
    if size < head < size + len(data):
        # Split at the head's end: the head is then exactly the chunks starting before it.
        k = head - size
        pieces = [(size, data[:k]), (head, data[k:])]
    for start, piece in pieces:
        s.add(LogChunk(job_id=job_id, attempt=attempt, start=start, data=piece))
    new_size = size + len(data)
    s.execute(update(Job).where(Job.id == job_id).values(log_size=new_size))
    if new_size > cap:
        # Drop every chunk after the head that lies wholly before the newest
        # (cap - head) bytes. Earlier cuts are gone already, so the index range
        # holds only what this append pushed out (and at most one straddling chunk).
        keep_from = new_size - (cap - head)
        s.execute(
            delete(LogChunk).where(
                LogChunk.job_id == job_id,
                LogChunk.start >= head,
                LogChunk.start < keep_from,
                LogChunk.start + func.length(LogChunk.data) <= keep_from,
            )
        )


def dropped_marker(size: int, at: datetime, retention_s: float | None) -> bytes:
    """The line a read of a log deleted by the retention answers."""
    kept = f"DDPQ_LOG_RETENTION={_days(retention_s)}" if retention_s is not None else "retention"
    return (
        f"[ddpq] this job's log ({size} bytes) was deleted on {at:%Y-%m-%d %H:%M} UTC: "
        f"a job's log is kept for {kept} after it ended\n"
    ).encode()


def stream_end_line(why: str, in_line: bool = False) -> bytes:
    """The last line of a follow its token no longer allows (a line of its own)."""
    start = b"\n" if in_line else b""
    return start + f"[ddpq] stopped following: {why}\n".encode()


def _days(seconds: float) -> str:
    return f"{seconds / 86400:g}d" if seconds >= 86400 else f"{seconds:g}s"


# ---- reading ----------------------------------------------------------------------------


@dataclass
class LogSlice:
    data: bytes  # stored bytes from the offset, with a marker line where a cut was crossed
    next_offset: int  # where the next read starts (stored-byte coordinates)
    size: int  # the stored stream's length (its end offset)
    status: str  # the job's status, read in the same transaction


def read(
    db: Database,
    job_id: int,
    offset: int,
    limit: int = MAX_LOG_RESPONSE_BYTES,
    past_end_ok: bool = False,
) -> LogSlice:
    """The log from ``offset``: at most ``limit`` stored bytes, plus a cut marker if crossed.

    ``past_end_ok``: an offset past the end reads from the end. Followers count the bytes
    they received to resume, and a marker they received counts for no offset.
    """
    cap = db.policy.log_max_bytes
    with db.read() as s:
        row = s.execute(
            select(Job.status, Job.log_size, Job.log_dropped_at).where(Job.id == job_id)
        ).first()
        if row is None:
            raise NotFound(f"no job {job_id}")
        status, size, dropped_at = row
        if dropped_at is not None and offset < size:
            # Deleted by the log retention (service.retention): said, never an empty log.
            return LogSlice(
                dropped_marker(size, dropped_at, db.policy.log_retention_s), size, size, status
            )
        if offset > size and past_end_ok:
            offset = size
        if offset > size:
            raise Invalid(
                ("query", "offset"),
                f"offset {offset} is past the end of the log ({size} bytes so far); "
                "resume from X-Next-Offset",
            )
        if offset == size:
            return LogSlice(b"", offset, size, status)
        first = s.scalar(
            select(func.max(LogChunk.start)).where(
                LogChunk.job_id == job_id, LogChunk.start <= offset
            )
        )
        q = (
            select(LogChunk.start, LogChunk.data)
            .where(LogChunk.job_id == job_id, LogChunk.start >= (first or 0))
            .order_by(LogChunk.start)
            .execution_options(yield_per=_FETCH_CHUNKS)
        )
        out = bytearray()
        pos = offset
        taken = 0
        for start, data in s.execute(q):
            if start + len(data) <= pos:
                continue  # the head's last chunk, when the offset lies in the cut
            if start > pos:
                if out and not out.endswith(b"\n"):
                    out += b"\n"  # the marker is a line of its own
                out += cut_marker(start - pos, cap, start)
                pos = start
            piece = data[pos - start : pos - start + limit - taken]
            out += piece
            pos += len(piece)
            taken += len(piece)
            if taken >= limit:
                break
        return LogSlice(bytes(out), pos, size, status)


async def follow(
    db: Database,
    job_id: int,
    first: LogSlice,
    disconnected: Callable[[], Awaitable[bool]],
    refused: Callable[[], Awaitable[str | None]],
    poll_s: float = FOLLOW_POLL_S,
) -> AsyncIterator[bytes]:
    """``first`` (read by the handler, so a bad request is answered before the stream
    starts), then new output as it arrives, until the job has ended and all of it is
    sent, or the client has gone, or ``refused()`` says why the token it was opened with
    no longer stands (service.auth.TokenWatch): then a last line ``[ddpq] ...`` says so.

    State comes from the database alone, so any API process can serve a follower.
    """
    got = first
    in_line = False  # the last byte sent ended no line
    while True:
        if got.data:
            yield got.data
            in_line = not got.data.endswith(b"\n")
        why = await refused()
        if why is not None:
            yield stream_end_line(why, in_line)
            return
        if got.next_offset >= got.size:
            if got.status in TERMINAL:
                return  # the worker sends all output before it reports the end
            if await disconnected():
                return
            await asyncio.sleep(poll_s)
        got = await run_in_threadpool(read, db, job_id, got.next_offset)
