"""The claim: hand a worker the best queued job that fits its free slots.

A claim is one transaction: pick the best queued job that fits (priority desc, then
submission order) and mark it running, returning it, with its attempt row and hashed
job token written alongside. On Postgres the pick is ``FOR UPDATE SKIP LOCKED`` so
concurrent claimers pass over each other's rows; on SQLite the write transaction is
``BEGIN IMMEDIATE`` (see db.py), which serialises claimers.

A worker that stops says so first (``leave``): from that commit on nothing is claimed
for it until it registers again. The claim reads the mark with the worker's books; one
that takes a job reads it again under a share lock on the worker's row (Postgres), which
the leave's update waits for: either the leave committed first and the claim is undone,
or the claim commits first and its long-poll, which the leaving worker keeps open until
it answers, hands it the job (which it hands straight back). Only a claim that takes a
job locks: a lock would make every idle poll's claim a transaction that commits to disk.
SQLite's claims and leaves are serialised whole (``BEGIN IMMEDIATE``).

Building a Core statement and its cache key cost more than running it on SQLite; the
claim is every worker's hot path, so its statements are built once per shape and
reused (a statement's cache key is memoised on the object).
"""

from __future__ import annotations

import functools
import time
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import Field
from sqlalchemy import JSON, bindparam, case, func, or_, select, update
from sqlalchemy.engine import Connection

from ddpq.messages import ClaimedJob
from service.db import Database
from service.errors import Conflict, ServiceError, UnknownWorker, WorkerHasLeft
from service.models import JobStatus, UTCDateTime, utcnow
from service.queue import books, gangs, quotas
from service.queue.memo import Probe
from service.queue.rules import (
    ORDER,
    QUEUED_SINGLE,
    SQL,
    as_utc,
    at_or_ahead,
    checkpoint_dir_of,
    fits_bound,
    fits_partition,
    j,
    jn,
    jobs,
    notify_claimers,
    order_key,
    quota_free,
    ready,
    resolve,
    resume_from,
    w,
    workers,
)
from service.queue.states import Event, may, new_attempt, start_values
from service.wakeup import Wake


class Claim(ClaimedJob):
    """A ClaimedJob as the queue hands it out: the route adds the job token it minted
    (the queue stores only its hash)."""

    token: str = ""
    # When the job entered the queue: its wait, for the metrics (not sent to the worker).
    queued_at: datetime | None = Field(default=None, exclude=True)

    def wire(self, token: str) -> ClaimedJob:
        """What the worker is sent: the claim with the attempt's job token."""
        return self.model_copy(update={"token": token})


@functools.cache
def _making_room(worker_has_gpus: bool) -> Any:
    """The job room is being made for on this worker (preemption), while its owner's
    limits let it start here: one they came to hold back since (another of their jobs
    started) would hold the freed room for nothing until its mark went stale."""
    return (
        select(j.id, j.priority, j.share)
        .where(
            j.status == JobStatus.QUEUED,
            j.preempting_on == bindparam("worker"),
            quota_free(worker_has_gpus),
        )
        .order_by(*ORDER)
        .limit(1)
    )


_SET_GPUS = (
    update(jobs).where(j.id == bindparam("job_id")).values(gpus=bindparam("gpus", type_=JSON))
)


@functools.cache
def _starving_probe(worker_has_gpus: bool) -> Any:
    """The first job in queue order that has waited past the limit and that this
    worker could ever run."""
    return (
        select(j.id, j.priority, j.share)
        .where(
            QUEUED_SINGLE,
            j.queued_at < bindparam("starved_before", type_=UTCDateTime),
            fits_bound(worker_has_gpus, "total_cpu", "total_gpus"),
            quota_free(worker_has_gpus),  # one its owner's limits hold back halts no one
        )
        .order_by(*ORDER)
        .limit(1)
    )


def _fitting(worker_has_gpus: bool) -> Any:
    """The queued single-node jobs that fit the room bound as free_cpu and free_gpus."""
    return select(j.id).where(
        QUEUED_SINGLE,
        ready(),
        fits_bound(worker_has_gpus, "free_cpu", "free_gpus"),
        quota_free(worker_has_gpus),
    )


def _ordered(worker_has_gpus: bool, guarded: bool) -> Any:
    """The best queued job that fits: the first in queue order (behind the head when
    ``guarded``: a job starves, or a gang is picked, and nothing behind it may start)."""
    pick = _fitting(worker_has_gpus)
    if guarded:
        pick = pick.where(
            at_or_ahead(bindparam("head_priority"), bindparam("head_share"), bindparam("head_id"))
        )
    return pick.order_by(*ORDER).limit(1)


@functools.cache
def _best_fit(worker_has_gpus: bool, guarded: bool) -> Any:
    """The best queued job that fits, locked or not: SKIP LOCKED passes over the rows other
    transactions hold (a claim being made, a job being moved), so a claim that found
    nothing on Postgres found nothing for all (NothingFits) only if this finds none."""
    return _ordered(worker_has_gpus, guarded)


@functools.cache
def _take(dialect: str, worker_has_gpus: bool, guarded: bool, wait: bool = False) -> Any:
    """Mark the best queued job that fits running, in one statement, and return it.
    On Postgres the pick passes over rows other transactions hold; with ``wait``, it
    waits for the one job bound as ``pick_id`` instead (if it still fits then)."""
    pick = _ordered(worker_has_gpus, guarded)
    if wait:
        pick = pick.where(j.id == bindparam("pick_id"))
    if dialect == "postgresql":
        pick = pick.with_for_update(skip_locked=not wait)
    # A CPU job holds its ranks' CPU slots; a GPU job its GPUs (set after the pick).
    held_cpu = (
        case((j.device == "cpu", j.nproc_per_node), else_=0)
        if worker_has_gpus
        else j.nproc_per_node
    )
    return (
        update(jobs)
        .where(j.id == pick.scalar_subquery(), may(Event.START, j.status, SQL))
        .values(
            start_values(
                attempt=j.attempt + 1,
                held_cpu_slots=held_cpu,
                gpus=bindparam("no_gpus", type_=JSON),
            )
        )
        .returning(j.id, j.attempt, j.spec, j.device, j.nproc_per_node, j.queued_at, j.owner)
    )


@functools.cache
def _take_whole(dialect: str, nodes_have_gpus: bool) -> Any:
    """A bridge's claim: mark the best queued job that fits its partition running, as
    one attempt of all its nodes. Slurm holds the resources, so the job row holds
    none; a multi-node job whose node slots workers have begun to gather is theirs."""
    gathering = select(jn.id).where(jn.job_id == j.id, jn.attempt == j.attempt + 1).exists()
    pick = (
        select(j.id)
        .where(
            j.status == JobStatus.QUEUED,
            ready(),
            fits_partition(
                nodes_have_gpus,
                j.nnodes,
                j.device,
                j.nproc_per_node,
                bindparam("nodes"),
                bindparam("node_cpu"),
                bindparam("node_gpus"),
                SQL,
            ),
            ~gathering,
            quota_free(nodes_have_gpus),
        )
        .order_by(*ORDER)
        .limit(1)
    )
    if dialect == "postgresql":
        pick = pick.with_for_update(skip_locked=True, of=jobs)
    return (
        update(jobs)
        .where(j.id == pick.scalar_subquery(), may(Event.START, j.status, SQL))
        .values(
            start_values(
                attempt=j.attempt + 1, held_cpu_slots=0, gpus=bindparam("no_gpus", type_=JSON)
            )
        )
        .returning(
            j.id, j.attempt, j.spec, j.device, j.nproc_per_node, j.queued_at, j.nnodes, j.owner
        )
    )


# Claims undone for a limit another claim reached first, before this one answers "none"
# (the worker asks again): each try settles the owner's flags, so a second nearly always
# finds the job held.
OVER_LIMIT_TRIES = 5


class _GangFirst(ServiceError):
    """A bridge's claim met a gang of workers' slots for the same attempt: rolled back."""


_SLOT_TAKEN = select(jn.id).where(
    jn.job_id == bindparam("job_id"), jn.attempt == bindparam("number")
)


def _claim_whole(
    conn: Connection,
    db: Database,
    cap: books.Capacity,
    token_hash: str,
    now: datetime,
    quotas_set: bool,
) -> Claim | None:
    """The next job a bridge hands to its partition, whole (every node in one attempt),
    or None. The bridge asks only while it has room for another pending job."""
    part = cap.partition
    assert part is not None
    has_gpus = part.gpus_per_node > 0
    params = {
        "worker": cap.name,
        "now": now,
        "nodes": part.nodes,
        "node_cpu": part.cpus_per_node,
        "node_gpus": part.gpus_per_node,
        "no_gpus": [],
    }
    row = conn.execute(_take_whole(db.dialect, has_gpus), params).first()
    if row is None:
        return None
    job_id, number, _, device, _, _, nnodes, owner = row
    # Read again now that the row is ours (Postgres): a worker's node slot committed
    # after this statement's snapshot, under a lock that changed nothing on the row, is
    # not seen by the pick. The gang came first; this claim is undone.
    if nnodes > 1 and conn.execute(_SLOT_TAKEN, {"job_id": job_id, "number": number}).first():
        raise _GangFirst()
    checkpoint_dir = checkpoint_dir_of(cap.checkpoint_root, job_id)
    new_attempt(conn, job_id, number, cap.name, token_hash, [], checkpoint_dir, now)
    if quotas_set:  # what its owner holds grew: still within their limits?
        quotas.settle_start(conn, owner, device != "cpu")  # Slurm holds an auto job's GPUs
    return _claimed(conn, row, resolve(device, has_gpus), [], checkpoint_dir, nnodes=nnodes)


def _head(conn: Connection, db: Database, mine: books.WorkerBooks, now: datetime) -> Any:
    """The starving job this worker must not start anything behind, if any: the first in
    queue order that has waited past the limit and that this worker could ever run."""
    starved_before = now - timedelta(seconds=db.policy.starvation_s)
    if mine.oldest_queued is None or as_utc(mine.oldest_queued) >= starved_before:
        return None
    cap = mine.capacity
    return conn.execute(
        _starving_probe(bool(cap.gpus)),
        {"starved_before": starved_before, "total_cpu": cap.cpu_slots, "total_gpus": len(cap.gpus)},
    ).first()


def claim_next_job(
    db: Database,
    worker: str,
    free_cpu_slots: int,
    free_gpus: list[int],
    token_hash: str,
    advertise_addr: str | None = None,
    rdzv_port: int | None = None,
    probe: Probe | None = None,
) -> Claim | None:
    """Claim the next job that fits on ``worker`` now, or return None (``probe``, when
    given, says what was looked at: NothingFits).

    Order: priority desc, then submission. A later job that fits may start while
    an earlier one waits for more slots (backfill), unless an earlier job this
    worker could ever run has waited longer than the starvation limit: then only
    that job, or ones ahead of it, may start here.

    A worker that gives an address other nodes reach it at (and a free port for a
    rendezvous) may be given a node slot of a multi-node job instead: a Claim with
    ``nnodes`` > 1, whose attempt starts once every slot is held.

    A bridge to a Slurm partition is handed whole jobs, multi-node ones too, that fit
    its partition's nodes (``_claim_whole``); Slurm decides when they start.
    """
    probe = probe or Probe()
    for _ in range(OVER_LIMIT_TRIES):
        try:
            return _claim(
                db,
                worker,
                free_cpu_slots,
                free_gpus,
                token_hash,
                advertise_addr,
                rdzv_port,
                utcnow(),
                probe,
            )
        except _GangFirst:
            return None
        except quotas.OverLimit as over:
            # Another claim of that owner's committed first: this one is undone, the
            # flags it read are refreshed, and the claim looks again (another job).
            quotas.settle(db, over.owner)
    probe.general = False  # it found something each time: not "nothing fits"
    return None


def _claim(
    db: Database,
    worker: str,
    free_cpu_slots: int,
    free_gpus: list[int],
    token_hash: str,
    advertise_addr: str | None,
    rdzv_port: int | None,
    now: datetime,
    probe: Probe,
) -> Claim | None:
    with db.write_conn() as conn:
        probe.at = time.monotonic()
        mine = books.of_worker(conn, worker)
        if mine is None:
            raise UnknownWorker(worker)
        if mine.left:
            raise WorkerHasLeft(worker)
        if mine.capacity.partition is not None:
            claim = _claim_whole(conn, db, mine.capacity, token_hash, now, mine.quotas_set)
        else:
            claim = _claim_here(
                conn, db, mine, free_cpu_slots, free_gpus, token_hash, advertise_addr,
                rdzv_port, now, probe,
            )  # fmt: skip
        if claim is not None and db.dialect == "postgresql":
            _still_here(conn, worker)
        return claim


def _claim_here(
    conn: Connection,
    db: Database,
    mine: books.WorkerBooks,
    free_cpu_slots: int,
    free_gpus: list[int],
    token_hash: str,
    advertise_addr: str | None,
    rdzv_port: int | None,
    now: datetime,
    probe: Probe,
) -> Claim | None:
    """A worker's claim, in its transaction: a single-node job that fits its room, or a
    node slot of a gang."""
    cap, worker = mine.capacity, mine.capacity.name
    has_gpus = bool(cap.gpus)
    # The worker's view may lag (a job it is still stopping); the books may too
    # (a finish in flight). Only slots free in both are offered.
    reported = set(free_gpus)
    cap.free_gpus = [g for g in cap.free_gpus if g in reported]
    cap.free_cpu = min(cap.free_cpu, free_cpu_slots)
    params: dict[str, Any] = {
        "worker": worker,
        "now": now,
        "free_cpu": cap.free_cpu,
        "free_gpus": len(cap.free_gpus),
        "no_gpus": None if has_gpus else [],
    }
    head = _head(conn, db, mine, now)
    if db.policy.preemption != "off":
        # Room is being made here for a job: nothing behind it starts here meanwhile.
        making = conn.execute(_making_room(has_gpus), {"worker": worker}).first()
        if making is not None and (
            head is None
            or order_key(making.priority, making.share, making.id)
            < order_key(head.priority, head.share, head.id)
        ):
            head = making
    gang = None
    if mine.gangs_queued and advertise_addr and rdzv_port:
        gang = gangs.pick(conn, db, has_gpus, params, head)
        if gang is not None:
            head = gang  # a single-node job may start here only if it is ahead of it
    if head is not None:
        params.update(head_id=head.id, head_priority=head.priority, head_share=head.share)
    probe.has_gpus, probe.cpu, probe.gpus = has_gpus, cap.free_cpu, len(cap.free_gpus)
    probe.general = head is None and not mine.gangs_queued
    row = conn.execute(_take(db.dialect, has_gpus, head is not None), params).first()
    if row is None and db.dialect == "postgresql":
        row = _take_waiting(conn, db, has_gpus, head is not None, gang is None, params, probe)
    if row is not None:
        return _start(conn, row, cap, token_hash, now, mine.quotas_set)
    if gang is None:
        return None
    assert advertise_addr is not None and rdzv_port is not None
    offer = gangs.Offer(worker, cap, token_hash, advertise_addr, rdzv_port, now)
    return _node_of(gang, gangs.take_node(conn, gang, offer))


def _take_waiting(
    conn: Connection, db: Database, has_gpus: bool, guarded: bool, may_wait: bool,
    params: dict[str, Any], probe: Probe,
) -> Any:  # fmt: skip
    """SKIP LOCKED passed over every row that fits, or none fits. Rows are held by claims
    being made and also by a share refresh rewriting all of an owner's queued jobs:
    answering "none" then would idle a worker while jobs wait. So if one fits, wait for
    the best one's lock, and that row's alone: a pick that waits as it walks the queue
    keeps the lock of each row it passes that another claim took meanwhile (Postgres
    keeps a row's lock when it no longer matches), and two such walks deadlocked
    (bench/fleet.py, 1,000 hosts). Waiting, this transaction holds no row (a gang's
    claim does not wait), so no lock cycle passes through it."""
    best = conn.execute(_best_fit(has_gpus, guarded), params).first()
    probe.general = probe.general and best is None
    if best is None or not may_wait:
        return None
    waited = {**params, "pick_id": best.id}
    row = conn.execute(_take(db.dialect, has_gpus, guarded, wait=True), waited).first()
    if row is None:  # another claim took it first: another free one, without waiting
        row = conn.execute(_take(db.dialect, has_gpus, guarded), params).first()
    return row


def _node_of(gang: Any, slot: gangs.NodeSlot | None) -> Claim | None:
    """The Claim of a node slot taken of ``gang``."""
    if slot is None:
        return None
    return Claim(
        job_id=gang.id,
        attempt=slot.attempt,
        spec=gang.spec,
        device=slot.device,
        nproc_per_node=gang.nproc_per_node,
        gpus=slot.gpus,
        checkpoint_dir=slot.checkpoint_dir,
        resume_from=[],
        nnodes=gang.nnodes,
        node_rank=slot.node_rank,
        owner=gang.owner,
    )


def _start(
    conn: Connection,
    row: Any,
    cap: books.Capacity,
    token_hash: str,
    now: Any,
    quotas_set: bool,
) -> Claim:
    """The attempt row of a single-node job just marked running, and its Claim."""
    job_id, number, _, device, nproc, _, owner = row
    has_gpus = bool(cap.gpus)
    resolved = resolve(device, has_gpus)
    gpus = cap.free_gpus[:nproc] if resolved == "cuda" else []
    if has_gpus:
        conn.execute(_SET_GPUS, {"job_id": job_id, "gpus": gpus})
    checkpoint_dir = checkpoint_dir_of(cap.checkpoint_root, job_id)
    new_attempt(conn, job_id, number, cap.name, token_hash, gpus, checkpoint_dir, now)
    if quotas_set:  # what its owner holds grew: still within their limits?
        quotas.settle_start(conn, owner, bool(gpus))
    return _claimed(conn, row, resolved, gpus, checkpoint_dir)


def _claimed(
    conn: Connection,
    row: Any,
    device: Literal["cpu", "cuda"],
    gpus: list[int],
    checkpoint_dir: str,
    nnodes: int = 1,
) -> Claim:
    """The Claim of a job row a claim started (its id, attempt, spec, device, nproc,
    queued_at, owner, as the claim's statements select them; a whole multi-node job's
    row has its nnodes before the owner): what the attempt runs with, and what it
    resumes from."""
    job_id, number, spec, _, nproc, queued_at, *_, owner = row
    return Claim(
        job_id=job_id,
        attempt=number,
        spec=spec,
        device=device,
        nproc_per_node=nproc,
        gpus=gpus,
        checkpoint_dir=checkpoint_dir,
        resume_from=resume_from(conn, job_id, number),
        queued_at=queued_at,
        nnodes=nnodes,
        owner=owner,
    )


# ---- a worker that leaves ----------------------------------------------------------------

# The mark a claim that takes a job reads again, the worker's row share-locked until the
# claim commits (a leave's update waits for it; heartbeats, which touch the row, too).
_LEFT_LOCKED = select(w.left_at).where(w.name == bindparam("worker")).with_for_update(read=True)
# Marked only while no other process has taken the name over (as heartbeats: queue.leases);
# a leave said again keeps the first one's time.
_LEAVE = (
    update(workers)
    .where(w.name == bindparam("b_worker"))
    .values(left_at=func.coalesce(w.left_at, bindparam("b_now", type_=UTCDateTime)))
    .returning(w.left_at)
)
_LEAVE_MINE = _LEAVE.where(or_(w.identity.is_(None), w.identity == bindparam("b_identity")))
_HOLDER = select(w.hostname).where(w.name == bindparam("b_worker"))


def _still_here(conn: Connection, worker: str) -> None:
    """WorkerHasLeft, which undoes the claim, if ``worker`` left while it ran (Postgres)."""
    if conn.execute(_LEFT_LOCKED, {"worker": worker}).scalar() is not None:
        raise WorkerHasLeft(worker)


def leave(db: Database, worker: str, identity: str | None) -> datetime:
    """``worker`` stops: from this commit on nothing is claimed for it until it registers
    again (queue.leases.register_worker clears the mark), and its open long-polls, woken,
    end (service.wakeup). Its attempts' heartbeats and finish reports go on while they
    stop. When it left. UnknownWorker; Conflict if another process has taken the name
    over since (the mark is that one's to make)."""
    params = {"b_worker": worker, "b_identity": identity, "b_now": utcnow()}
    with db.write_conn() as conn:
        left_at = conn.execute(_LEAVE_MINE if identity else _LEAVE, params).scalar()
        if left_at is None:
            holder = conn.execute(_HOLDER, params).scalar()
            if holder is None:
                raise UnknownWorker(worker)
            raise Conflict(
                f"worker name {worker} was taken over by another process (host {holder}); "
                "this one's leave changes nothing"
            )
        notify_claimers(conn, Wake(everyone=False, worker=worker, left=True))
    return as_utc(left_at)
