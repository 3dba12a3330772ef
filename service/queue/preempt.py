"""Preemption: a queued job that outranks running ones, with no room anywhere, takes
theirs.

Off by default (``DDPQ_PREEMPTION``). ``priority``: a job outranks those of lower
priority; ``fair-share``: also those of its own priority whose owner used the hosts more
lately (service.queue.shares). A pass (at each submit, and in the sweeper) takes the
queued single-node jobs in claim order; for the first that fits no worker's free slots
now, it looks for a live worker where it would fit once some outranked jobs there hand
back: only as many as it needs (the lowest ranked first: lowest priority, then the
most used owner, then the newest), none that has run less than ``DDPQ_PREEMPT_MIN_RUN_S``
on this attempt, none of several nodes, none on a Slurm bridge (Slurm preempts its own),
and only where freeing them is enough and its owner's limits let it start (never to
start a job that would not start anyway: rules.quota_lets, the claim's own rule).
They are marked (``jobs.preempted_by``); their worker learns it from its next heartbeat
and hands them back as it does at shutdown (SIGTERM, the grace period, requeued without
counting a failure), and they resume from their last checkpoint. Their reason says
``preempted by job 57 (bob, priority 10)``. The job they make room for is marked too
(``preempting_on``): until it starts there, no job behind it starts on that worker (the
claim takes it as its head, as it does a starving job, while its owner's limits let it
start), so the room goes to it. One preemption at a time per worker; a mark that
outlives a few leases is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from service.db import Database
from service.models import Attempt, AuditEvent, Job, JobStatus, utcnow
from service.queue import rules
from service.queue.books import Capacity, capacities
from service.queue.rules import QUEUED_SINGLE, policy_of, ready
from service.queue.shares import usage_of

CANDIDATES = 20  # queued jobs a pass looks at, best first


@dataclass(frozen=True)
class _Running:
    id: int
    owner: str | None
    priority: int
    units: int  # GPUs or CPU slots it holds, in the unit the waiting job needs
    started: datetime  # this attempt's start
    usage: float  # its owner's (scaled) usage


def _room(cap: Capacity, unit: str) -> tuple[int, int]:
    """(total, free) of ``unit`` on ``cap``."""
    if unit == "gpu":
        return len(cap.gpus), len(cap.free_gpus)
    return cap.cpu_slots, cap.free_cpu


def words(s: Session, by: int) -> str:
    """What a preempted job's reason says of who took its slots."""
    row = s.execute(select(Job.owner, Job.priority).where(Job.id == by)).first()
    if row is None:
        return f"preempted by job {by}"
    who = f"{row.owner}, " if row.owner else ""
    return f"preempted by job {by} ({who}priority {row.priority})"


def sweep(db: Database) -> list[int]:
    """A pass of its own (the sweeper's): the jobs asked to hand back."""
    if db.policy.preemption == "off":
        return []
    with db.write() as s:
        marked = preempt(s, utcnow())
        if marked:
            rules.notify_claimers(s)
        return marked


def preempt(s: Session, now: datetime) -> list[int]:
    """One pass (in the caller's write transaction): the jobs asked to hand back."""
    policy = policy_of(s)
    if policy.preemption == "off":
        return []
    stale = now - timedelta(seconds=3 * policy.lease_s + policy.preempt_min_run_s)
    s.execute(
        update(Job)
        .where(Job.status == JobStatus.QUEUED, Job.preempting_since < stale)
        .values(preempting_on=None, preempting_since=None)
    )
    caps = [c for c in capacities(s, policy.lease_s) if c.live and c.partition is None]
    if not caps:
        return []
    busy = set(
        s.scalars(
            select(Job.preempting_on).where(
                Job.status == JobStatus.QUEUED, Job.preempting_on.is_not(None)
            )
        )
    )
    # Only jobs their owner's limits let start on some live worker: one they hold back
    # everywhere would take no slot freed for it (the claim's own rule, rules.quota_free).
    kinds = {bool(c.gpus) for c in caps}
    waiting = s.execute(
        select(
            Job.id, Job.priority, Job.share, Job.owner, Job.device, Job.nproc_per_node,
            Job.quota_running, Job.quota_gpus,
        )
        .where(
            QUEUED_SINGLE,
            ready(),
            or_(*(rules.quota_free(k) for k in kinds)),
            Job.preempting_on.is_(None),
        )
        .order_by(*rules.ORDER)
        .limit(CANDIDATES),
        {"now": now},
    ).all()  # fmt: skip
    marked: list[int] = []
    for job in waiting:
        # The workers a claim would start it on, as far as its owner's limits go: a job
        # at its owner's GPU limit may still start on a CPU-only worker, and only there.
        open_to = [c for c in caps if _may_start(c, job)]
        if any(_fits_free(c, job) for c in open_to):
            continue  # a claim takes it without anyone's slots
        for cap in open_to:
            if cap.name in busy:
                continue
            victims = _victims(s, cap, job, now)
            if victims:
                marked += _mark(s, job, victims, cap.name, now)
                busy.add(cap.name)
                break
    return marked


def _may_start(cap: Capacity, job: Any) -> bool:
    """Whether its owner's limits let ``job`` start on ``cap`` (the claim's rule)."""
    return bool(rules.quota_lets(bool(cap.gpus), job.device, job.quota_running, job.quota_gpus))


def _fits_free(cap: Capacity, job: Any) -> bool:
    unit = rules.unit(job.device, bool(cap.gpus))
    return unit is not None and _room(cap, unit)[1] >= job.nproc_per_node


def _victims(s: Session, cap: Capacity, job: Any, now: datetime) -> list[_Running]:
    """The fewest jobs on ``cap`` outranked by ``job`` whose slots, with the free ones,
    make room for it; none if that is not possible."""
    unit = rules.unit(job.device, bool(cap.gpus))
    if unit is None:
        return []
    total, free = _room(cap, unit)
    if total < job.nproc_per_node:
        return []  # it would not fit even on an empty worker
    policy = policy_of(s)
    ran_before = now - timedelta(seconds=policy.preempt_min_run_s)
    rows = s.execute(
        select(
            Job.id, Job.owner, Job.priority, Job.device, Job.gpus, Job.held_cpu_slots,
            Job.nproc_per_node, Attempt.started_at,
        )
        .join(Attempt, and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt))
        .where(
            Job.worker == cap.name,
            Job.status == JobStatus.RUNNING,
            Job.nnodes == 1,
            Job.preempted_by.is_(None),
            Attempt.ended_at.is_(None),
            Attempt.started_at <= ran_before,
        )
    ).all()  # fmt: skip
    usage = {o: usage_of(s, o, now) for o in {r.owner for r in rows} | {job.owner}}
    mine = usage.get(job.owner, 0.0)
    pool = []
    for r in rows:
        held = len(r.gpus or []) if unit == "gpu" else r.held_cpu_slots
        if not held:
            continue  # it holds none of what the job needs
        theirs = usage.get(r.owner, 0.0)
        outranked = r.priority < job.priority or (
            policy.preemption == "fair-share" and r.priority == job.priority and theirs > mine
        )
        if outranked:
            pool.append(_Running(r.id, r.owner, r.priority, held, r.started_at, theirs))
    pool.sort(key=lambda v: (v.priority, -v.usage, -v.started.timestamp()))
    chosen: list[_Running] = []
    for v in pool:
        if free >= job.nproc_per_node:
            break
        chosen.append(v)
        free += v.units
    return chosen if free >= job.nproc_per_node else []


def _mark(s: Session, job: Any, victims: list[_Running], worker: str, now: datetime) -> list[int]:
    ids = [v.id for v in victims]
    s.execute(
        update(Job)
        .where(Job.id.in_(ids), Job.status == JobStatus.RUNNING, Job.preempted_by.is_(None))
        .values(preempted_by=job.id)
    )
    s.execute(
        update(Job).where(Job.id == job.id).values(preempting_on=worker, preempting_since=now)
    )
    for v in victims:
        s.add(
            AuditEvent(
                at=now,
                actor="ddpq",
                action="preempt",
                target=f"job {v.id}",
                detail={"for": job.id, "worker": worker, "owner": v.owner},
            )
        )
    return ids
