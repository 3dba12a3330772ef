"""Checkpoint retention: which of a job's registered checkpoints stay, what each worker
is asked to delete, what it says it did, and a job's list of them.

The API owns which checkpoints are registered and which of them are kept; the worker
whose disk holds a file (its attempt's worker: node 0's for a gang) owns the file, and
deletes it only when its heartbeat's reply asks (worker.files.checkpoints), reporting back on
the next heartbeat. A checkpoint is a file or a directory (``kind``: a framework's, as
ddpq.train.register_checkpoint registers it), never inside another of the job's nor
holding one, so that deleting one never takes or changes another. Two rules choose what
goes:

- keep_last (the spec's, else DDPQ_KEEP_LAST; 0 keeps all): as each checkpoint
  registers, the job's kept ones beyond its newest ``keep_last`` (by registration) are
  marked ``pruning``, except those saved with keep=True and the one a resume would use
  (queue.rules.resume_key: the highest step), so a resume never loses its checkpoint.
- checkpoint retention (DDPQ_CHECKPOINT_RETENTION, None for never): once a job has been
  over that long, the worker that holds its checkpoints removes the job's whole
  checkpoint directory (files the API never heard of included: a save cut off by a
  kill, a program's own files) and its rows are marked pruned.

A file is never deleted while it may still be written: only registered files are pruned
(save_checkpoint writes under a temporary name, renames, then registers), a row whose
path is registered again is superseded instead of pruned, and the worker checks that the
file is still the one registered (size and mtime) before it deletes it. Rows whose
worker is None (jobs that had ended before migration 0015) are never deleted.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, bindparam, exists, literal, null, select, union_all, update
from sqlalchemy.orm import Session, aliased

from ddpq.messages import ClaimedJob, PruneOrder, SendOrder
from service.db import Database, Policy
from service.errors import Conflict, Invalid, NotFound
from service.models import TERMINAL, Attempt, Checkpoint, Job, utcnow
from service.queue import as_utc, ask_checkpoint, checkpoints_sent, fork_source
from service.queue.forks import LIVE, SENDING, is_sending, sending
from service.queue.rules import resume_key
from service.schemas import (
    CheckpointIn,
    CheckpointPruned,
    CheckpointPublic,
    CheckpointsDropped,
    CheckpointSent,
    metric_in,
    metric_out,
)

MAX_ORDERS = 1000  # checkpoints one heartbeat reply asks to delete; the rest next time
MAX_DROPS = 100  # ended jobs' directories one reply asks to remove
MAX_SENDS = 20  # checkpoints one reply asks to send (each may be large)


@dataclass(frozen=True)
class Held:
    """A kept checkpoint as keep_last weighs it."""

    id: int
    step: int
    keep: bool


def to_prune(kept: Sequence[Held], keep_last: int) -> list[int]:
    """Of a job's kept checkpoints, those keep_last lets go: all but the newest
    ``keep_last`` by registration, those marked keep, and the one a resume would use."""
    if keep_last <= 0 or len(kept) <= keep_last:
        return []
    newest = {c.id for c in sorted(kept, key=lambda c: c.id, reverse=True)[:keep_last]}
    resume = max(kept, key=lambda c: resume_key(c.step, c.id)).id
    return sorted(c.id for c in kept if c.id not in newest and c.id != resume and not c.keep)


def keep_last_of(spec: dict[str, Any], policy: Policy) -> int:
    """The job's keep_last: its spec's, else the server's."""
    value = spec.get("keep_last")
    return policy.keep_last if value is None else int(value)


# ---- a checkpoint registers ----------------------------------------------------------


def register(
    s: Session, job: Job, attempt: Attempt, path: str, body: CheckpointIn, policy: Policy
) -> Checkpoint:
    """Record a checkpoint of ``attempt`` (its job's row locked, the attempt checked
    current) and mark what keep_last lets go. Invalid when it would nest with another."""
    _refuse_nesting(s, job.id, attempt.worker, path, body.kind)
    now = utcnow()
    c = Checkpoint(
        job_id=job.id,
        attempt=attempt.number,
        path=path,
        step=body.step,
        epoch=metric_in(body.epoch) if body.epoch is not None else None,
        metrics={k: metric_out(metric_in(v)) for k, v in body.metrics.items()},
        created_at=now,
        worker=attempt.worker,
        keep=body.keep,
        bytes=body.bytes,
        mtime_ns=body.mtime_ns,
        kind=body.kind,
        state="kept",
    )
    # The same file registered again (a step saved twice, after a resume): the older
    # rows name what is now this one's file, which must not be deleted on their account.
    s.execute(
        update(Checkpoint)
        .where(
            Checkpoint.job_id == job.id,
            Checkpoint.worker == attempt.worker,
            Checkpoint.path == path,
            Checkpoint.state.in_(LIVE),
        )
        .values(
            state="pruned", pruned_at=now, note=f"written again: the checkpoint of step {body.step}"
        )
    )
    s.add(c)
    s.flush()
    keep_last = keep_last_of(job.spec, policy)
    if keep_last == 0:
        return c
    kept = [
        # One being sent (a fork wants it: service.queue.forks) stays till it is sent.
        Held(r.id, r.step, r.keep or r.sending)
        for r in s.execute(
            select(Checkpoint.id, Checkpoint.step, Checkpoint.keep, SENDING.label("sending")).where(
                Checkpoint.job_id == job.id,
                Checkpoint.state == "kept",
                Checkpoint.worker.is_not(None),
            )
        )
    ]
    going = to_prune(kept, keep_last)
    if going:
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.id.in_(going), Checkpoint.state == "kept")
            .values(state="pruning", note=f"keep_last {keep_last}: newer checkpoints kept")
        )
    return c


def _refuse_nesting(s: Session, job_id: int, worker: str, path: str, kind: str) -> None:
    """A checkpoint is one file or one directory, never inside another of the job's still
    on that worker's disk, nor holding one: deleting either would delete or change the
    other (a directory's stamp covers everything under it)."""
    live = (Checkpoint.job_id == job_id, Checkpoint.worker == worker, Checkpoint.state.in_(LIVE))
    above = []
    parent = posixpath.dirname(path)
    while parent not in ("", "/"):
        above.append(parent)
        parent = posixpath.dirname(parent)
    holder = s.scalar(
        select(Checkpoint.path)
        .where(*live, Checkpoint.kind == "dir", Checkpoint.path.in_(above))
        .limit(1)
    )
    if holder is not None:
        raise Invalid(("body", "path"), f"inside the registered checkpoint directory {holder}")
    if kind == "dir":
        held = s.scalar(
            select(Checkpoint.path)
            .where(*live, Checkpoint.path.startswith(path + "/", autoescape=True))
            .limit(1)
        )
        if held is not None:
            raise Invalid(("body", "path"), f"holds the registered checkpoint {held}")


# ---- a worker's heartbeat --------------------------------------------------------------


# What a heartbeat's reply asks its worker to do, in one statement built once (each
# heartbeat of every worker asks, and most find nothing): checkpoints keep_last let go
# (kind "p"), checkpoints a fork wants sent (kind "s"), and ended jobs whose retention
# ran out (kind "d", their job ids), unless one of their checkpoints is being sent.
def _checkpoint_orders(kind: str, limit: int, *where: ColumnElement[bool]) -> Any:
    return (
        select(
            literal(kind).label("kind"),
            Checkpoint.id,
            Checkpoint.job_id,
            Checkpoint.path,
            Checkpoint.bytes,
            Checkpoint.mtime_ns,
            Checkpoint.kind.label("what"),
        )
        .where(Checkpoint.worker == bindparam("worker"), *where)
        .order_by(Checkpoint.id)
        .limit(limit)
    )


_ORDERS = _checkpoint_orders("p", MAX_ORDERS, Checkpoint.state == "pruning")
_SENDS = _checkpoint_orders("s", MAX_SENDS, Checkpoint.state == "kept", SENDING)
_sending = aliased(Checkpoint)
_DROPS = (
    select(Checkpoint.job_id)
    .join(Job, Job.id == Checkpoint.job_id)
    .where(
        Checkpoint.worker == bindparam("worker"),
        Checkpoint.state.in_(LIVE),
        Job.status.in_(sorted(TERMINAL)),
        Job.finished_at < bindparam("ended_before"),
        ~exists().where(_sending.job_id == Checkpoint.job_id, sending(_sending)),
    )
    .distinct()
    .order_by(Checkpoint.job_id)
    .limit(MAX_DROPS)
    .subquery()
)
_ORDERS_AND_SENDS = union_all(select(_ORDERS.subquery()), select(_SENDS.subquery()))
_ORDERS_AND_DROPS = union_all(
    select(_ORDERS.subquery()),
    select(_SENDS.subquery()),
    select(literal("d"), null(), _DROPS.c.job_id, null(), null(), null(), null()),
)


def worker_round(
    db: Database,
    worker: str,
    pruned: Sequence[CheckpointPruned],
    dropped: Sequence[CheckpointsDropped],
    sent: Sequence[CheckpointSent] = (),
) -> tuple[list[PruneOrder], list[int], list[SendOrder]]:
    """Record what ``worker`` did with earlier orders; return what it is to do now:
    checkpoints keep_last let go, ended jobs whose retention ran out, checkpoints forks
    want sent."""
    now = utcnow()
    retention = db.policy.checkpoint_retention_s
    if pruned or dropped:
        with db.write() as s:
            _record(s, worker, pruned, dropped, now, retention)
    if sent:  # its own transaction: it locks forks (service.queue.forks)
        with db.write() as s:
            checkpoints_sent(s, worker, sent, now)
    # One lone SELECT, outside any transaction (a read Session around two SELECTs cost a
    # third of an idle heartbeat's CPU in the API).
    if retention is None:
        rows = db.read_all(_ORDERS_AND_SENDS, {"worker": worker})
    else:
        since = now - timedelta(seconds=retention)
        rows = db.read_all(_ORDERS_AND_DROPS, {"worker": worker, "ended_before": since})
    orders = [
        PruneOrder(
            id=r.id, job_id=r.job_id, path=r.path, bytes=r.bytes, mtime_ns=r.mtime_ns, kind=r.what
        )
        for r in rows
        if r.kind == "p"
    ]
    drops = [r.job_id for r in rows if r.kind == "d"]
    sends = [
        SendOrder(
            id=r.id, job_id=r.job_id, path=r.path, bytes=r.bytes, mtime_ns=r.mtime_ns, kind=r.what
        )
        for r in rows
        if r.kind == "s"
    ]
    return orders, drops, sends


def _record(
    s: Session,
    worker: str,
    pruned: Sequence[CheckpointPruned],
    dropped: Sequence[CheckpointsDropped],
    now: datetime,
    retention: float | None,
) -> None:
    """A worker's reports, for its own rows only (a report for a row another worker
    holds, or no longer pruning, changes nothing)."""
    for p in pruned:
        values: dict[str, Any] = {"pruned_at": now, "state": "pruned"}
        if p.outcome == "refused":
            values.update(state="refused", note=f"not deleted by {worker}: {p.why or 'refused'}")
        elif p.outcome == "missing":
            values["note"] = "gone before its worker came to delete it"
        s.execute(
            update(Checkpoint)
            .where(
                Checkpoint.id == p.id,
                Checkpoint.worker == worker,
                Checkpoint.state == "pruning",
            )
            .values(**values)
        )
    ended = set(
        s.scalars(
            select(Job.id).where(
                Job.id.in_([d.job_id for d in dropped]), Job.status.in_(sorted(TERMINAL))
            )
        )
    )
    after = f"{duration_words(retention)} after its end" if retention else "at its end"
    for d in dropped:
        if d.job_id not in ended:
            continue  # never for a live job, whatever a report says
        note = f"retention: the job's checkpoint directory was removed {after}"
        state = "pruned"
        if d.outcome == "refused":
            state, note = "refused", f"not deleted by {worker}: {d.why or 'refused'}"
        s.execute(
            update(Checkpoint)
            .where(
                Checkpoint.job_id == d.job_id,
                Checkpoint.worker == worker,
                Checkpoint.state.in_(LIVE),
            )
            .values(state=state, note=note, pruned_at=now)
        )


def duration_words(seconds: float) -> str:
    """A duration setting as an operator would write it: ``7d``, ``12h``, ``90s``."""
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size:g}{unit}"
    return f"{seconds:g}s"


def settled() -> ColumnElement[bool]:
    """For the job purge (service.retention): no checkpoint of the job of the enclosing
    statement is still on a worker's disk waiting to be deleted (kept or pruning, with a
    worker to ask). Pruned and refused rows are final (a refusal is not asked again),
    and rows with no worker (jobs that ended before migration 0015) are never deleted
    by ddpq: none of them holds a purge back. With DDPQ_CHECKPOINT_RETENTION=never, a
    job whose checkpoints are kept is never purged."""
    return ~exists().where(
        Checkpoint.job_id == Job.id,
        Checkpoint.state.in_(LIVE),
        Checkpoint.worker.is_not(None),
    )


# ---- reading ------------------------------------------------------------------------------


def expires_at(
    c: Any, status: str, finished_at: datetime | None, policy: Policy
) -> datetime | None:
    """When an ended job's live checkpoint goes (None: its job runs, it is gone already,
    no worker holds it, or the retention is forever)."""
    retention = policy.checkpoint_retention_s
    if (
        retention is None
        or status not in TERMINAL
        or finished_at is None
        or c.state not in LIVE
        or c.worker is None
    ):
        return None
    return as_utc(finished_at) + timedelta(seconds=retention)


def public(c: Any, expires: datetime | None = None) -> CheckpointPublic:
    """A checkpoint's view (``c``: an ORM row or a Core row of the table)."""
    return CheckpointPublic(
        id=c.id,
        path=c.path,
        step=c.step,
        epoch=metric_out(c.epoch) if c.epoch is not None else None,
        attempt=c.attempt,
        created_at=c.created_at,
        metrics=c.metrics or {},
        keep=bool(c.keep),
        bytes=c.bytes,
        state=c.state,
        note=c.note,
        pruned_at=c.pruned_at,
        expires_at=expires,
        worker=c.worker,
        kind=c.kind,
        snapshot=c.snapshot,
        sending=is_sending(c),
        send_problem=c.send_problem,
    )


def list_checkpoints(db: Database, job_id: int) -> list[CheckpointPublic]:
    """A job's checkpoints, oldest first, each with where it stands."""
    with db.read() as s:
        job = s.execute(select(Job.status, Job.finished_at).where(Job.id == job_id)).first()
        if job is None:
            raise NotFound(f"no job {job_id}")
        rows = s.scalars(
            select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id)
        )
        return [public(c, expires_at(c, job.status, job.finished_at, db.policy)) for c in rows]


def for_claim(db: Database, claim: ClaimedJob) -> ClaimedJob:
    """A fork's claim with the checkpoint it starts from (service.queue.forks: sent, or
    no claim would have taken it; None only if its rows went meanwhile, which the worker
    refuses to start without)."""
    with db.read() as s:
        return claim.model_copy(update={"fork_from": fork_source(s, claim.job_id)})


def ask_send(db: Database, job_id: int, checkpoint_id: int) -> CheckpointPublic:
    """Ask for a job's kept checkpoint to be sent to the API (``ddpq checkpoints
    --download``): its worker does at its next heartbeat; the answer says where it
    stands (``snapshot`` once sent)."""
    with db.write() as s:
        job = s.execute(select(Job.status, Job.finished_at).where(Job.id == job_id)).first()
        c = ask_checkpoint(s, checkpoint_id, utcnow())
        if job is None or c is None or c.job_id != job_id:
            raise NotFound(f"no kept checkpoint {checkpoint_id} of job {job_id}")
        if c.worker is None and c.snapshot is None:
            raise Conflict(
                f"checkpoint {checkpoint_id} was saved before ddpq recorded which worker "
                "holds a checkpoint: it cannot be fetched"
            )
        return public(c, expires_at(c, job.status, job.finished_at, db.policy))
