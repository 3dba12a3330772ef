"""Workers, their heartbeats, and how attempts end.

A worker heartbeats its running attempts; an attempt whose heartbeat is older than
the lease is lost and its job requeued (or failed when its attempts are spent) by
``queue.lost.expire_leases``, which the sweeper runs as the soonest lease runs out. An
attempt also ends when its worker reports it (``end_attempt``, called by
jobs.finish_attempt). Which event either way is (``reported``, ``lost``), and the
fencing check that every report of an attempt passes, are here.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Update, and_, bindparam, or_, select, tuple_, update
from sqlalchemy.orm import Session

from service import gpus
from service.db import Database, Policy
from service.errors import Conflict, UnknownWorker
from service.models import (
    ACTIVE,
    Attempt,
    Job,
    JobNode,
    JobStatus,
    Worker,
    utcnow,
)
from service.queue import preempt, states
from service.queue.gangs import node_of, nodes_of
from service.queue.rules import (
    as_utc,
    forming,
    is_active,
    j,
    rowcount,
    started,
    w,
    workers,
)
from service.queue.states import Event
from service.schemas import FinishRequest, GpuSampleIn


class NameTaken(Conflict):
    """Another process holds this worker name: 409, saying which host."""


# ---- fencing: is this attempt still the job's? -----------------------------------------


def fenced(number: int, ended: bool, current: int | None, status: str | None) -> str | None:
    """Why attempt ``number`` may no longer act for its job, or None while it may. A
    newer attempt owns the job (its old ranks must stop), or this one has ended."""
    if current is not None and current != number:
        return f"attempt {number} was superseded by attempt {current}"
    if ended or (status is not None and not is_active(status)):
        return f"attempt {number} has ended"
    return None


def workers_attempt(
    s: Session, job: Any, number: int, worker: str
) -> tuple[Attempt, JobNode | None]:
    """Attempt ``number`` of ``job`` (a row with id, attempt and nnodes) as ``worker``
    runs it, and its node slot if the job is multi-node; Conflict if that worker has no
    such attempt or a newer attempt owns the job."""
    attempt = s.scalar(select(Attempt).where(Attempt.job_id == job.id, Attempt.number == number))
    # Each node of a multi-node attempt reports for the one attempt.
    node = node_of(s, job.id, number, worker) if job.nnodes > 1 else None
    if attempt is None or (attempt.worker != worker and node is None):
        raise Conflict(f"job {job.id} has no attempt {number} on worker {worker}")
    if job.attempt != number:
        raise Conflict(f"attempt {number} was superseded by attempt {job.attempt}")
    return attempt, node


# ---- how an attempt ends ---------------------------------------------------------------


@dataclass
class Ending:
    """How an attempt's end moves its job (service.queue.states): the event, the job's
    new reason, and the columns the event leaves to its decider (a retry's backoff)."""

    event: Event
    reason: str | None
    columns: dict[str, Any] = field(default_factory=dict)


def lost(status: str, number: int, failures: int, max_attempts: int, words: str) -> Ending:
    """An attempt whose worker was lost: the worker, not the program, failed, so the job
    is requeued at once (no backoff) while attempts remain."""
    if status == JobStatus.CANCELLING:
        return Ending(Event.LOSE, f"cancelled; {words} before it confirmed")
    if failures + 1 < max_attempts:
        reason = (
            f"{words}; requeued for attempt {number + 1} "
            f"({failures + 1} of {max_attempts} attempts used)"
        )
        return Ending(Event.LOSE, reason)
    return Ending(Event.LOSE_LAST, f"{words}; all {max_attempts} attempts used")


def exit_words(code: int | None, oom: bool | None = None) -> str:
    """An exit status as a person reads it; codes >= 128 are death by signal 128+n.
    ``oom``: whether the kernel's log says its OOM killer sent a SIGKILL (the worker
    looked: worker.edges.oom); unknown, a SIGKILL is only asked about."""
    if code is None:
        return "ended without an exit code"
    if code >= 128:
        n = code - 128
        try:
            name = signal.Signals(n).name
        except ValueError:
            name = f"signal {n}"
        hint = ""
        if n == signal.SIGKILL and oom is None:
            hint = " (out of memory?)"
        elif n == signal.SIGKILL and oom:
            hint = ": out of memory (the kernel's OOM killer)"
        return f"killed by {name}{hint}, exit code {code}"
    return f"exited with code {code}"


def reported(
    job: Job, report: FinishRequest, where: str, worker: str, policy: Policy, now: datetime
) -> Ending:
    """What a worker's report of how an attempt ended does to the job.

    Retry policy: an attempt killed by a signal (exit code >= 128: OOM killer,
    preemption) is retried; a program's own error (1..127) fails the job unless its
    spec sets ``retry_on_error``; a timeout or a worker-side error never retries.
    Retries wait out an exponential backoff and count against ``max_attempts``; an
    attempt handed back by a worker that shuts down is requeued at once, uncounted.
    """
    code = report.exit_code
    if report.outcome == "requeue" and job.status == JobStatus.RUNNING:
        # A worker hands back what it stops when it shuts down; a bridge also what Slurm
        # would not take for now, and says so.
        handed = report.reason if report.reason not in (None, "worker shut down") else None
        why = f"{handed} (worker {worker})" if handed else f"worker {worker} shut down"
        return Ending(Event.HAND_BACK, f"{why}; requeued, not counted as a failure")
    if job.status == JobStatus.CANCELLING or report.outcome == "cancelled":
        # Who asked, in the words service.jobs.cancel kept (a worker's own cancel, from
        # a job of an earlier version, says only that).
        return Ending(Event.STOP, f"cancelled by {job.cancelled_by or 'user'}")
    if report.outcome == "timeout":
        return Ending(Event.FAIL, report.reason or f"timeout after {job.spec.get('timeout_s')} s")
    if report.outcome == "exited" and code == 0:
        # A success's reason, when the worker gives one, says what happened on the way
        # out (a rank torch crashed after its program finished: worker.tee).
        return Ending(Event.SUCCEED, report.reason)
    retryable = report.outcome == "exited" and code is not None and code != 0
    if retryable and code is not None and code < 128:
        # A multi-node attempt is retried whatever a node's exit code: when one node
        # is lost, the ranks of the others fail with their own error.
        retryable = bool(job.spec.get("retry_on_error")) or job.nnodes > 1
    # The worker sends the program's last error line; the words for the exit are ours.
    what = exit_words(code, report.oom) if report.outcome == "exited" else "failed to start"
    what += where
    if report.reason:
        what += f": {report.reason}"
    if code is not None and 0 < code < 128 and not retryable:
        what += " (a program error: not retried unless the spec sets retry_on_error)"
    failures = job.failures + 1
    if retryable and failures < job.max_attempts:
        delay = min(policy.retry_backoff_s * 2 ** (failures - 1), policy.retry_backoff_max_s)
        reason = (
            f"attempt {report.attempt} {what}; retrying as attempt {job.attempt + 1} "
            f"({failures} of {job.max_attempts} attempts used) after {delay:g} s"
        )
        return Ending(Event.RETRY, reason, {"not_before": now + timedelta(seconds=delay)})
    spent = f"; all {job.max_attempts} attempts used" if retryable else ""
    return Ending(Event.FAIL, f"{what}{spent}")


def end_attempt(s: Session, job: Job, worker: str, report: FinishRequest, policy: Policy) -> None:
    """Record, on ``job``'s row locked by the caller, how ``worker``'s attempt ended and
    move the job on. Safe to repeat: a retried report changes nothing."""
    now = utcnow()
    attempt, node = workers_attempt(s, job, report.attempt, worker)
    if attempt.outcome == "lost":
        raise Conflict(f"attempt {report.attempt} was declared lost: {job.reason}")
    if node is not None:
        states.node_ends(s, node, now, report.outcome, report.exit_code)
    if attempt.ended_at is not None:
        return  # a retried report, or a node that stopped after its attempt ended
    if node is not None and _other_nodes_run_on(s, job, report, node):
        return  # this node ended well (or stopped on cancel): the others go on
    where = f" on node {node.node_rank} (worker {worker})" if node is not None else ""
    if report.outcome == "lost":  # its scheduler ended it (a bridge's attempt)
        words = report.reason or f"attempt {report.attempt} was lost"
        ending = lost(job.status, job.attempt, job.failures, job.max_attempts, words)
    else:
        ending = reported(job, report, where, worker, policy, now)
    if job.pausing is not None and job.status == JobStatus.RUNNING:
        # Its sweep paused it (service.sweeps): however its processes ended after that
        # (its own SIGTERM handler's exit 0, a signal, its worker's hand-back), it waits
        # held with its checkpoint, uncounted, until the sweep promotes it.
        ending = Ending(Event.PAUSE, job.pausing, {"held_by": job.owner})
    reason = ending.reason
    requeues = states.move(job.id, job.status, ending.event).target == JobStatus.QUEUED
    if job.preempted_by is not None and requeues:  # handed back: its reason says for whom
        reason = f"{preempt.words(s, job.preempted_by)}; it resumes when room is free"
    states.end(
        s, job, attempt, ending.event, now, reason, report.exit_code,
        reported=report.outcome != "lost", **ending.columns,
    )  # fmt: skip


def _other_nodes_run_on(s: Session, job: Job, report: FinishRequest, node: JobNode) -> bool:
    """Whether a multi-node attempt waits for its other nodes after ``node`` ended: it
    does when this node succeeded or stopped on a cancel and another has not ended.
    A failure (or a shutdown handback) ends the attempt for every node at once."""
    cancelling = job.status == JobStatus.CANCELLING or report.outcome == "cancelled"
    succeeded = report.outcome == "exited" and report.exit_code == 0
    if not (cancelling or succeeded):
        return False
    others = [n for n in nodes_of(s, job.id, report.attempt) if n.id != node.id]
    return any(n.ended_at is None for n in others)


# ---- workers and their heartbeats ------------------------------------------------------


def register_worker(
    db: Database,
    name: str,
    identity: str | None,
    hostname: str,
    cpu_slots: int,
    gpus: list[int],
    checkpoint_root: str,
    cluster: dict[str, Any] | None = None,
    gpu_devices: list[dict[str, Any]] | None = None,
) -> None:
    """Record a worker and what it has (a bridge: the partition it hands jobs to; a
    worker with NVML: its GPUs as NVML names them).

    The same identity (or none, from a worker of an earlier version) is the same
    worker starting again; another identity is refused while the name's heartbeats are
    fresh (a second process would take the first one's jobs), and takes the name over
    once they have been silent for a lease."""
    now = utcnow()
    with db.write() as s:
        w = s.scalars(select(Worker).where(Worker.name == name).with_for_update()).first()
        if w is None:
            w = Worker(name=name, registered_at=now)
            s.add(w)
        elif identity and w.identity and w.identity != identity:
            silent = (now - as_utc(w.last_heartbeat)).total_seconds()
            if silent < db.policy.lease_s:
                raise NameTaken(
                    f"worker name {name} is in use by a running worker on host {w.hostname} "
                    f"(last heartbeat {silent:.0f} s ago): give this one another --name, or "
                    "stop that one first"
                )
        w.identity = identity
        w.hostname = hostname
        w.cpu_slots = cpu_slots
        w.gpus = sorted(set(gpus))
        w.checkpoint_root = checkpoint_root
        w.cluster = cluster
        w.gpu_devices = gpu_devices or None
        w.last_heartbeat = now
        w.left_at = None  # it takes jobs again (service.queue.claim.leave)


def held_attempts(db: Database, worker: str) -> list[tuple[int, int, str | None, Any]]:
    """(job, attempt, external id, timeout_s) of the attempts the books give ``worker``
    that have not ended: what a restarted bridge re-adopts."""
    with db.read() as s:
        rows = s.execute(
            select(Attempt.job_id, Attempt.number, Attempt.external_id, Job.spec)
            .join(Job, and_(Job.id == Attempt.job_id, Job.attempt == Attempt.number))
            .where(
                Attempt.worker == worker,
                Attempt.ended_at.is_(None),
                Job.status.in_(list(ACTIVE)),
            )
            .order_by(Attempt.job_id)
        )
        return [(r.job_id, r.number, r.external_id, r.spec.get("timeout_s")) for r in rows]


# A worker's own heartbeat, built once (every host sends one every 2 s) and run on a bare
# connection: through the ORM's bulk update it cost more than the UPDATE itself.
_TOUCH = (
    update(workers).where(w.name == bindparam("b_worker")).values(last_heartbeat=bindparam("b_now"))
)
# Only while no other process has taken the name over (NameTaken below).
_TOUCH_MINE = _TOUCH.where(or_(w.identity.is_(None), w.identity == bindparam("b_identity")))
_HOLDER = select(w.hostname).where(w.name == bindparam("b_worker"))


def _touch(worker: str, identity: str | None, now: datetime) -> tuple[Update, dict[str, Any]]:
    """The worker's own heartbeat: the statement and its parameters."""
    if identity:
        return _TOUCH_MINE, {"b_worker": worker, "b_identity": identity, "b_now": now}
    return _TOUCH, {"b_worker": worker, "b_now": now}


def _untouched(worker: str, holder: str | None) -> Exception:
    """Why a heartbeat touched no row: NameTaken if another process (on host ``holder``)
    took the name over, UnknownWorker if there is no such worker."""
    if holder is not None:
        return NameTaken(
            f"worker name {worker} was taken over by another process (host {holder}) "
            "after this one's heartbeats went silent; its jobs run there now"
        )
    return UnknownWorker(worker)


@dataclass(frozen=True)
class Elsewhere:
    """What a bridge says of an attempt it handed to another scheduler: that scheduler's
    id for it, and why it holds it pending (None once it runs)."""

    external_id: str | None = None
    pending: str | None = None


def record_heartbeat(
    db: Database,
    worker: str,
    running: list[tuple[int, int]],
    identity: str | None = None,
    elsewhere: dict[tuple[int, int], Elsewhere] | None = None,
    gpu_samples: dict[tuple[int, int], list[GpuSampleIn]] | None = None,
    gpu_sample_s: float = 5.0,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int, str]]]:
    """Extend the leases of a worker's attempts (a bridge's: with their Slurm job ids
    and pending reasons, ``elsewhere``).

    Returns (cancel, abandon, preempt): attempts a user cancelled, attempts that are no
    longer this worker's to run (lost and requeued, or ended), which the worker stops;
    and attempts it is to hand back for a job that outranks them (service.queue.preempt)
    or because their sweep paused them (service.sweeps), with why. Raises NameTaken
    when another process has taken the name over.
    """
    now = utcnow()
    elsewhere = elsewhere or {}
    touch, params = _touch(worker, identity, now)
    # Not durable: a heartbeat a crash of the database loses is sent again 2 s later, and
    # a thousand hosts' heartbeats each waiting for the disk was what they waited on.
    if not running:
        # An idle host's: one statement, on Postgres one round trip (Database.write_one).
        if db.write_one(touch, params, durable=False) == 0:
            found = db.read_one(_HOLDER, {"b_worker": worker})
            raise _untouched(worker, found[0] if found else None)
        return [], [], []
    with db.write() as s:
        # The touch turns synchronous_commit off for the whole transaction (not_durable).
        if rowcount(s.connection().execute(db.not_durable(touch), params)) == 0:
            raise _untouched(worker, s.scalar(_HOLDER, {"b_worker": worker}))
        beat = _sort_out(s, worker, running)
        if beat.slots:
            s.execute(update(JobNode).where(JobNode.id.in_(beat.slots)).values(heartbeat_at=now))
        # A worker's attempts renewed in one statement, not one per attempt (a host of 8
        # GPUs heartbeats 8 of them every 2 s): the rows locked in job order, as below.
        plain = sorted(k for k in beat.live if k not in elsewhere)
        if plain:
            s.execute(_RENEW, {"now": now, "keys": plain})
        for job_id, number in sorted(k for k in beat.live if k in elsewhere):  # by job id
            there = elsewhere[(job_id, number)]
            values: dict[str, Any] = {"heartbeat_at": now}
            # The job's row before its attempt's, as every other writer locks them.
            _pending_reason(s, job_id, number, there.pending)
            if there.external_id:
                values["external_id"] = there.external_id
            s.execute(
                update(Attempt)
                .where(
                    Attempt.job_id == job_id,
                    Attempt.number == number,
                    Attempt.ended_at.is_(None),
                )
                .values(**values)
            )
        if gpu_samples:
            # Only the attempts still this worker's: a late sample of one moved on is
            # nobody's system metric.
            mine = {k: v for k, v in gpu_samples.items() if k in set(beat.live)}
            gpus.store(s, worker, now, gpu_sample_s, mine)
        handback = [(j, n, preempt.words(s, by)) for j, n, by in beat.preempt] + beat.pause
    return beat.cancel, beat.abandon, handback


# The attempts a heartbeat names that have not ended, locked in job order (the order every
# writer of several of them keeps: _lose_attempts), then their leases renewed.
_RENEW = (
    update(Attempt)
    .where(
        Attempt.id.in_(
            select(Attempt.id)
            .where(
                tuple_(Attempt.job_id, Attempt.number).in_(bindparam("keys", expanding=True)),
                Attempt.ended_at.is_(None),
            )
            .order_by(Attempt.job_id)
            .with_for_update()
            .scalar_subquery()
        )
    )
    .values(heartbeat_at=bindparam("now"))
    .execution_options(synchronize_session=False)
)


def _pending_reason(s: Session, job_id: int, number: int, pending: str | None) -> None:
    """A running job's reason is why Slurm holds it pending, and none once it runs (a
    cancelling job keeps its own); written only when it changes."""
    s.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.attempt == number,
            Job.status == JobStatus.RUNNING,
            Job.reason.is_distinct_from(pending),
        )
        .values(reason=pending)
    )


@dataclass
class _Beat:
    live: list[tuple[int, int]]  # attempts whose leases this heartbeat renews
    slots: list[int]  # node slots (forming or running) whose leases it renews
    cancel: list[tuple[int, int]]
    abandon: list[tuple[int, int]]
    preempt: list[tuple[int, int, int]] = field(default_factory=list)  # job, attempt, for
    pause: list[tuple[int, int, str]] = field(default_factory=list)  # job, attempt, why


# The job rows of the attempts a heartbeat names, built once.
_NAMED_JOBS = select(
    j.id, j.attempt, j.status, j.worker, j.nnodes, j.preempted_by, j.pausing
).where(j.id.in_(bindparam("ids", expanding=True)))


def _sort_out(s: Session, worker: str, running: list[tuple[int, int]]) -> _Beat:
    """Which of the attempts a worker says it runs are still its own, by the job rows."""
    job_ids = [job_id for job_id, _ in running]
    jobs = {r.id: r for r in s.connection().execute(_NAMED_JOBS, {"ids": job_ids})}
    slots: dict[tuple[int, int], int] = {}
    if any(r.nnodes > 1 for r in jobs.values()):
        held = select(JobNode.id, JobNode.job_id, JobNode.attempt).where(
            JobNode.worker == worker, JobNode.job_id.in_(job_ids)
        )
        slots = {(n.job_id, n.attempt): n.id for n in s.execute(held)}
    beat = _Beat([], [], [], [])
    for job_id, number in running:
        job = jobs.get(job_id)
        slot = slots.get((job_id, number))
        # A node slot: ours while its attempt forms or runs and we hold it. (A bridge's
        # multi-node attempt has no node slots: it is the bridge's whole, as below.)
        if job is not None and job.nnodes > 1 and (slot is not None or job.worker != worker):
            gathering = forming(job.status, job.attempt, number)
            if slot is None or not (gathering or started(job.status, job.attempt, number)):
                beat.abandon.append((job_id, number))
                continue
            beat.slots.append(slot)
            if gathering:
                continue
        elif job is None or job.worker != worker or not started(job.status, job.attempt, number):
            beat.abandon.append((job_id, number))
            continue
        beat.live.append((job_id, number))
        if job.status == JobStatus.CANCELLING:
            beat.cancel.append((job_id, number))
        elif job.pausing is not None and job.status == JobStatus.RUNNING:
            beat.pause.append((job_id, number, job.pausing))
        elif job.preempted_by is not None and job.status == JobStatus.RUNNING:
            beat.preempt.append((job_id, number, job.preempted_by))
    return beat
