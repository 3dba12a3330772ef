"""Holding, releasing and changing a queued job (Slurm's ``scontrol hold/release/update``).

A hold is a move of the state table (service.queue.states: queued -> held -> queued): a
held job keeps its id, no claim takes it, and it still counts against its owner's queued
limit. Released, it is back in its place: the queue is ordered by priority, its owner's
recent usage (refreshed now) and its id, none of which the hold changed; its wait for
the starvation guard starts again. A member holds, releases and changes only their own
jobs, and releases only their own holds (an admin's hold is the admin's to lift); an
admin, any. A change (priority within the member's cap, time limit, world size) is made
only while the job waits, queued or held. Each is audited, and so is each refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from service import jobs, queue, users
from service.db import Database
from service.errors import Conflict, Forbidden, Invalid
from service.models import Job, JobStatus, utcnow
from service.queue import states
from service.queue.states import Event
from service.schemas import JobPublic
from service.users import Principal


@dataclass(frozen=True)
class Change:
    """PATCH /jobs/{id}: the fields to change (None: left as it is; ``timeout_s`` 0:
    no time limit)."""

    priority: int | None = None
    timeout_s: int | None = None
    world_size: int | None = None


def _refuse(db: Database, by: Principal, action: str, job_id: int, why: str) -> Forbidden:
    users.audit_refused(db, by.name, action, f"job {job_id}", why)
    return Forbidden(why)


def hold(db: Database, job_id: int, by: Principal) -> JobPublic:
    with db.write() as s:
        job = jobs.lock(s, job_id)
        refused = jobs.not_theirs(job, by, "hold")
        if refused is None:
            who = f"{by.name} (admin)" if by.admin and job.owner != by.name else by.name
            states.enter(job, Event.HOLD, utcnow(), f"held by {who}: `ddpq release {job.id}`")
            job.held_by = by.name
            job.preempting_on = job.preempting_since = None  # it needs no room now
            users.audit(s, by.name, "hold", f"job {job.id}")
            return jobs.public(s, job)
    raise _refuse(db, by, "hold", job_id, refused)


def release(db: Database, job_id: int, by: Principal) -> JobPublic:
    with db.write() as s:
        job = jobs.lock(s, job_id)
        refused = jobs.not_theirs(job, by, "release")
        if refused is None and not by.admin and job.held_by not in (None, by.name):
            refused = (
                f"job {job.id} was held by {job.held_by}: only they or an admin may release it"
            )
        if refused is None:
            _release(s, job)
            users.audit(s, by.name, "release", f"job {job.id}")
            return jobs.public(s, job)
    raise _refuse(db, by, "release", job_id, refused)


def _release(s: Session, job: Job) -> None:
    now = utcnow()
    states.enter(job, Event.RELEASE, now, None)
    job.held_by = None
    job.queued_at = now  # the starvation guard counts its wait from here
    job.share = queue.share_of(s, job.owner, now)  # its owner's usage now
    queue.refresh_quota_flags(s, job.owner)  # it counts against their limits again
    queue.notify_claimers(s)


# ---- a sweep's trials (service.sweeps: ASHA's pause mode) ---------------------------------


def pause_locked(s: Session, job_id: int, why: str) -> bool:
    """Ask running job ``job_id`` (its row locked here, in the caller's transaction) to
    pause: its ranks stop (its reporter at once, its worker at its next heartbeat), and
    its attempt ends held (queue.leases.end_attempt), its checkpoint kept. False if it is
    not running (a trial that ended, or is being cancelled, meanwhile)."""
    job = jobs.lock(s, job_id)
    if job.status != JobStatus.RUNNING:
        return False
    job.pausing = why
    return True


def promote_locked(s: Session, job_id: int) -> bool:
    """Release a paused trial's job (locked here) so that it resumes from its checkpoint.
    False if it is not held (its owner released or cancelled it meanwhile)."""
    job = jobs.lock(s, job_id)
    if job.status != JobStatus.HELD:
        return False
    _release(s, job)
    return True


def update(db: Database, job_id: int, by: Principal, change: Change) -> JobPublic:
    try:
        with db.write() as s:
            job = jobs.lock(s, job_id)
            refused = jobs.not_theirs(job, by, "change")
            if refused is None:
                if job.status not in (JobStatus.QUEUED, JobStatus.HELD):
                    raise Conflict(
                        f"job {job.id} is {job.status}: only a queued or held job may be changed"
                    )
                done = _apply(s, job, by, change)
                users.audit(s, by.name, "update", f"job {job.id}", done)
                queue.notify_claimers(s)  # its place (priority) or its fit (size) moved
                return jobs.public(s, job)
    except Forbidden as over:
        # A priority over the member's cap (jobs.within_priority_cap): the change was
        # rolled back whole, and the refusal is audited as every other one is.
        refused = over.detail
    raise _refuse(db, by, "update", job_id, refused)


def _apply(s: Session, job: Job, by: Principal, change: Change) -> dict[str, object]:
    """Change ``job``'s row and spec; what changed, from what to what."""
    spec = dict(job.spec)
    done: dict[str, object] = {}
    if change.priority is not None and change.priority != job.priority:
        if not by.admin:
            _, limits = queue.usage_and_limits(s, job.owner, utcnow())
            jobs.within_priority_cap(change.priority, job.owner, limits)
        done["priority"] = [job.priority, change.priority]
        job.priority = spec["priority"] = change.priority
    if change.timeout_s is not None:
        limit = change.timeout_s or None
        done["timeout_s"] = [spec.get("timeout_s"), limit]
        spec["timeout_s"] = limit
    if change.world_size is not None and change.world_size != job.nproc_per_node * job.nnodes:
        if change.world_size % job.nnodes:
            raise Invalid(
                ("body", "world_size"), f"must be a multiple of the job's nnodes ({job.nnodes})"
            )
        done["world_size"] = [job.nproc_per_node * job.nnodes, change.world_size]
        job.nproc_per_node = change.world_size // job.nnodes
        spec["world_size"] = change.world_size
    job.spec = spec  # a new dict: the JSON column is written
    return done
