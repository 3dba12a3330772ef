"""Forks: a job that starts from another job's checkpoint (``from_checkpoint: {job: 12,
step: 400}``, ``ddpq submit --from-checkpoint 12:400``), however job 12 ended, on any
worker.

A checkpoint lies on the disk of the worker that ran its attempt. A fork's submit
(``check``, then ``record``) picks the checkpoint (the kept one at that step, or the
newest kept one) and, if the API does not hold it yet, asks its worker to send it: the
worker's heartbeat replies carry the order (``orders``, folded into the checkpoints'
one statement: service.checkpoints), the worker sends the file or directory as a code
snapshot, as it sends a job's outputs, and a later heartbeat reports it (``sent``).
Until then the fork counts one more in ``waits_on``, which no claim takes (rules.ready),
and its reason says what it waits for. Once sent, every fork waiting for it is
released (and the claimers woken); a checkpoint that could not be sent fails them,
with why, as a dependency that can never be met does (and what waited for them in
turn). A claim of a fork carries the snapshot (``source``): its worker writes it into
the fork's own checkpoint directory, and the ranks resume from it until they saved a
checkpoint of their own. A checkpoint asked for is neither pruned by keep_last nor
removed by retention while it is being sent; its snapshot is kept while the checkpoint
is, or while a fork of it may still start.

Locks, Postgres: a submit reads the checkpoint FOR UPDATE after the jobs it depends on
(service.queue.deps) and before the owner's lock; a report locks the checkpoint row,
then the forks waiting for it, in id order. A fork submitted while its checkpoint is
reported sent is seen by that report, or sees the snapshot.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, exists, or_, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from ddpq.messages import ForkSource
from ddpq.rules import checkpoint_words
from service.errors import Conflict, Invalid
from service.models import TERMINAL, Checkpoint, CodeSnapshot, Job, JobStatus
from service.queue.rules import notify_claimers
from service.queue.states import Event, enter, settle_dependents

LIVE = ("kept", "pruning")  # the file is there as far as the API knows
WHERE = ("body", "from_checkpoint")
MAX_STEPS_NAMED = 10


def sending(c: Any = Checkpoint) -> ColumnElement[bool]:
    """SQL: checkpoint ``c`` (the table, or an alias of it) is one its worker is to send:
    asked, neither sent nor refused. ``is_sending`` is the same rule in Python."""
    return and_(c.send_asked_at.is_not(None), c.snapshot.is_(None), c.send_problem.is_(None))


def is_sending(c: Any) -> bool:
    return c.send_asked_at is not None and c.snapshot is None and c.send_problem is None


SENDING = sending()


def check(s: Session, given: Any) -> Checkpoint | None:
    """The checkpoint a job being submitted starts from, its row locked (Postgres); None
    for a job that starts from none. Invalid (422, naming ``from_checkpoint.job`` or
    ``.step``) for a job that does not exist or has no such checkpoint kept; Conflict
    (409) for one its worker could not send, or whose worker is not known."""
    if given is None:
        return None
    if s.scalar(select(Job.id).where(Job.id == given.job)) is None:
        raise Invalid((*WHERE, "job"), f"no job {given.job} to start from")
    pick = select(Checkpoint).where(Checkpoint.job_id == given.job, Checkpoint.state == "kept")
    if given.step is not None:
        pick = pick.where(Checkpoint.step == given.step)
    found = s.scalars(
        pick.order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(1)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()
    if found is None:
        steps = list(
            s.scalars(
                select(Checkpoint.step)
                .where(Checkpoint.job_id == given.job, Checkpoint.state == "kept")
                .order_by(Checkpoint.step.desc())
                .limit(MAX_STEPS_NAMED)
            )
        )
        kept = ", ".join(map(str, sorted(set(steps)))) if steps else "none"
        at = f" at step {given.step}" if given.step is not None else ""
        field = "step" if given.step is not None else "job"
        raise Invalid(
            (*WHERE, field),
            f"job {given.job} has no checkpoint{at} kept (steps kept: {kept}; pruned ones "
            "are gone: `ddpq checkpoints` lists them)",
        )
    if found.send_problem is not None:
        raise Conflict(
            f"from_checkpoint: {checkpoint_words(found.job_id, found.step)} could not be sent "
            f"by its worker: {found.send_problem}"
        )
    if found.worker is None and found.snapshot is None:
        raise Conflict(
            f"from_checkpoint: {checkpoint_words(found.job_id, found.step)} was saved before ddpq "
            "recorded which worker holds a checkpoint: it cannot be fetched"
        )
    return found


def record(s: Session, job: Job, source: Checkpoint | None, now: datetime) -> None:
    """``job`` (just inserted) starts from ``source``: it waits while the API lacks it,
    whose worker is asked to send it."""
    if source is None:
        return
    job.fork_checkpoint_id = source.id
    if source.snapshot is None:
        job.waits_on += 1
        if source.send_asked_at is None:
            source.send_asked_at = now


def ask(s: Session, checkpoint_id: int, now: datetime) -> Checkpoint | None:
    """Ask for checkpoint ``checkpoint_id`` to be sent (a download's), its row locked;
    None if it is not live."""
    c = s.scalars(
        select(Checkpoint)
        .where(Checkpoint.id == checkpoint_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()
    if c is None or c.state not in LIVE:
        return None
    if c.snapshot is None and c.send_problem is None and c.send_asked_at is None:
        c.send_asked_at = now
    return c


def sent(s: Session, worker: str, reports: Any, now: datetime) -> None:
    """What ``worker`` did with the checkpoints it was asked to send: each one sent
    releases the forks that waited for it; one it could not send fails them."""
    woken = False
    for r in sorted(reports, key=lambda r: r.id):
        c = s.scalars(
            select(Checkpoint)
            .where(Checkpoint.id == r.id, Checkpoint.worker == worker, SENDING)
            .with_for_update()
            .execution_options(populate_existing=True)
        ).first()
        if c is None:
            continue  # not this worker's, or told already
        snapshot: str | None = r.snapshot
        why = r.why or "it said nothing of it"
        if snapshot is not None and s.get(CodeSnapshot, snapshot) is None:
            why = f"the snapshot it named ({snapshot[:16]}) is not stored"
            snapshot = None
        if snapshot is not None:
            c.snapshot = snapshot
        else:
            c.send_problem = why[:500]
        for fork in s.scalars(
            select(Job)
            .where(Job.fork_checkpoint_id == c.id, Job.status == JobStatus.QUEUED)
            .order_by(Job.id)
            .with_for_update()
            .execution_options(populate_existing=True)
        ):
            if c.snapshot is not None:
                fork.waits_on = max(0, fork.waits_on - 1)
                woken = woken or fork.waits_on == 0
                continue
            reason = (
                f"from_checkpoint: {checkpoint_words(c.job_id, c.step)} could not be sent: {why}"
            )
            enter(fork, Event.UNMET, now, reason[:1000])
            settle_dependents(s, fork.id, JobStatus.FAILED, now)
    s.flush()
    if woken:
        notify_claimers(s)


def source(s: Session, job_id: int) -> ForkSource | None:
    """What a claim of fork ``job_id`` carries, or None."""
    row = s.execute(
        select(Checkpoint.job_id, Checkpoint.step, Checkpoint.snapshot, Checkpoint.path)
        .add_columns(Checkpoint.kind)
        .join(Job, Job.fork_checkpoint_id == Checkpoint.id)
        .where(Job.id == job_id, Checkpoint.snapshot.is_not(None))
    ).first()
    if row is None:
        return None
    name = row.path.rstrip("/").rsplit("/", 1)[-1]
    return ForkSource(
        job_id=row.job_id, step=row.step, snapshot=row.snapshot, name=name, kind=row.kind
    )


def waiting(s: Session, job_ids: list[int]) -> dict[int, tuple[int, int, str | None]]:
    """Of ``job_ids``, those waiting for their checkpoint to be sent: (its job, its step,
    the worker asked)."""
    if not job_ids:
        return {}
    rows = s.execute(
        select(Job.id, Checkpoint.job_id, Checkpoint.step, Checkpoint.worker)
        .join(Checkpoint, Checkpoint.id == Job.fork_checkpoint_id)
        .where(Job.id.in_(job_ids), Checkpoint.snapshot.is_(None))
    )
    return {int(j): (int(src), int(step), w) for j, src, step, w in rows}


def kept() -> ColumnElement[bool]:
    """For code collection (service.code.collect): the snapshot holds a checkpoint that is
    still kept, or one a fork not yet ended starts from."""
    live = exists().where(Checkpoint.snapshot == CodeSnapshot.id, Checkpoint.state.in_(LIVE))
    forked = exists().where(
        Checkpoint.snapshot == CodeSnapshot.id,
        Job.fork_checkpoint_id == Checkpoint.id,
        Job.status.not_in(sorted(TERMINAL)),
    )
    return or_(live, forked)
