"""GET /jobs/{id}/events: a job's status changes and new metric points as server-sent events.

Events, in this order on every poll of the database:

- ``event: job``: the Job (as GET /jobs/{id}) when what a person watches changed: its
  status, attempt, reason, worker, exit code, queue position or total_steps. Sent first
  on connect.
- ``event: metrics``: ``{"items": [...]}`` (GET /jobs/{id}/metrics's shape), the points
  written since the last event: new steps, and steps a later attempt reported again.
- ``event: end``: ``{"status": ...}`` once the job is terminal and everything is sent;
  then the server closes the stream.
- ``event: revoked``: ``{"reason": "token revoked: user alice was deactivated"}`` (or
  ``token rotated: ...``) when the token the stream was opened with stops working while
  it is open (checked every DDPQ_STREAM_RECHECK_S, 2 s); then the server closes the
  stream, and a reconnection with that token is refused (401), which ends an
  EventSource for good. A client that knows no ``revoked`` event meets that 401.

Every event has an ``id:`` ``<seq>-<job>``: ``seq`` counts the metric batches already
sent (jobs.metrics_seq), ``job`` fingerprints the Job last sent. A client that
reconnects with ``Last-Event-ID`` (browsers' EventSource do it by themselves) or
``?since=<id>`` gets only what it has not seen: points of later batches, and the Job
only if it changed meanwhile. ``since=0`` replays every point; without either, the
stream starts with the points written from now on. State comes from the database
only, so any API process can serve any stream.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import func, select

from service import jobs, metrics
from service.db import Database
from service.errors import Invalid
from service.models import TERMINAL, Job, MetricPoint
from service.schemas import JobPublic

KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing a quiet stream
MAX_POINTS_PER_EVENT = 20_000  # whole batches are sent together; a bigger backlog waits a poll
RETRY_MS = 2000  # how long EventSource waits before reconnecting

# fullmatch, and [0-9] rather than \d (which takes any script's digits).
_CURSOR = re.compile(r"([0-9]{1,19})(?:-([0-9a-f]{8}))?")


@dataclass
class Cursor:
    seq: int | None  # metric batches the client has; None: start from now
    job: str | None  # fingerprint of the Job it has; None: send the Job first


def parse_cursor(value: str | None, loc: tuple[str, str]) -> Cursor | None:
    if value is None:
        return None
    m = _CURSOR.fullmatch(value.strip())
    if not m or int(m.group(1)) > 2**63 - 1:
        raise Invalid(loc, f"{value[:40]!r} is not an event id (an id: line, or a number)")
    return Cursor(int(m.group(1)), m.group(2))


def fingerprint(job: JobPublic) -> str:
    watched = [
        job.status,
        job.attempt,
        job.reason,
        job.worker,
        job.exit_code,
        job.queue_position,
        job.total_steps,
    ]
    return f"{zlib.crc32(json.dumps(watched).encode()):08x}"


@dataclass
class Poll:
    job: JobPublic
    items: list[dict[str, Any]]  # points of batches (after, upto]
    upto: int  # the batches the client has once it got these items
    pending: bool  # more batches are stored than this poll carries


def poll(db: Database, job_id: int, after: int | None) -> Poll:
    """The job, then the points written after batch ``after`` (None: from now on).

    The job is read first: once it is terminal, every point its ranks reported is
    committed, so the read of the points that follows sees them all.
    """
    job = jobs.get_job(db, job_id)
    with db.read() as s:
        now = s.scalar(select(Job.metrics_seq).where(Job.id == job_id)) or 0
        if after is None or after >= now:
            return Poll(job, [], now if after is None else after, False)
        # Whole batches up to about MAX_POINTS_PER_EVENT points (at least one batch).
        sizes = s.execute(
            select(MetricPoint.seq, func.count())
            .where(MetricPoint.job_id == job_id, MetricPoint.seq > after, MetricPoint.seq <= now)
            .group_by(MetricPoint.seq)
            .order_by(MetricPoint.seq)
        )
        upto, total = after, 0
        for seq, count in sizes:
            if total and total + count > MAX_POINTS_PER_EVENT:
                break
            upto, total = seq, total + count
        else:
            upto = now  # batches whose points were all rewritten later have none left
        rows = s.execute(
            select(*metrics.COLUMNS)
            .where(
                MetricPoint.job_id == job_id,
                MetricPoint.seq > after,
                MetricPoint.seq <= upto,
            )
            .order_by(MetricPoint.step, MetricPoint.name)
        )
        return Poll(job, metrics.items(rows), upto, upto < now)


def _event(kind: str, data: str, event_id: str) -> bytes:
    return f"event: {kind}\nid: {event_id}\ndata: {data}\n\n".encode()


async def events(
    db: Database,
    job_id: int,
    first: Poll,
    sent_job: str | None,
    poll_s: float,
    disconnected: Callable[[], Awaitable[bool]],
    refused: Callable[[], Awaitable[str | None]],
    keepalive_s: float = KEEPALIVE_S,
) -> AsyncIterator[bytes]:
    """The stream, from ``first`` (polled by the handler, so a missing job is a 404),
    while ``refused()`` (the watch on its token: service.auth.TokenWatch) says nothing."""
    yield f"retry: {RETRY_MS}\n\n".encode()
    got = first
    last_sent = time.monotonic()
    while True:
        why = await refused()
        if why is not None:
            # No id: line: what the client has seen stays its Last-Event-ID.
            yield f"event: revoked\ndata: {json.dumps({'reason': why})}\n\n".encode()
            return
        fp = fingerprint(got.job)
        if fp != sent_job:
            sent_job = fp
            yield _event("job", got.job.model_dump_json(), f"{got.upto}-{fp}")
            last_sent = time.monotonic()
        if got.items:
            yield _event("metrics", metrics.to_json(got.items).decode(), f"{got.upto}-{fp}")
            last_sent = time.monotonic()
        if got.pending:
            got = await run_in_threadpool(poll, db, job_id, got.upto)
            continue
        if got.job.status in TERMINAL:
            end = json.dumps({"status": got.job.status, "reason": got.job.reason})
            yield _event("end", end, f"{got.upto}-{fp}")
            return
        if time.monotonic() - last_sent >= keepalive_s:
            yield b": keepalive\n\n"
            last_sent = time.monotonic()
        if await disconnected():
            return
        # Sleep on the event loop: no thread and no database connection is held meanwhile.
        await asyncio.sleep(poll_s)
        got = await run_in_threadpool(poll, db, job_id, got.upto)
