"""Multi-node jobs (nnodes > 1): gangs of node slots.

Each claim by a worker that advertises an address takes one slot (``job_nodes``) of
the attempt being formed; the claim that takes the last slot starts the attempt.
Until then the job stays queued and its slots hold their workers' CPU slots or GPUs.
Slots not all held within the gang timeout are released (``expire_gangs``). Each node
has its own lease (lost.expire_nodes); losing any node, or any node's failure, ends
the attempt for all of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, NamedTuple

from sqlalchemy import JSON, and_, bindparam, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from ddpq.messages import GangReply
from service.db import Database
from service.models import Attempt, Job, JobNode, JobStatus, UTCDateTime, utcnow
from service.queue import quotas, states
from service.queue.books import Capacity
from service.queue.rules import (
    FORMING,
    ORDER,
    SQL,
    checkpoint_dir_of,
    fits_bound,
    forming,
    j,
    jn,
    jobs,
    live_worker,
    nodes,
    notify_claimers,
    order_key,
    policy_of,
    quota_free,
    ready,
    resolve,
    resume_from,
    rowcount,
    started,
    w,
    workers,
)
from service.queue.states import Event, may, new_attempt, new_node, start_values


@functools.cache
def _pick(dialect: str, worker_has_gpus: bool) -> Any:
    """The first queued multi-node job, in queue order, with a node slot free that fits
    this worker and that this worker does not already hold (a worker is one node)."""
    slots = and_(jn.job_id == j.id, jn.attempt == j.attempt + 1)
    held = select(func.count()).select_from(nodes).where(slots).scalar_subquery()
    mine = select(jn.id).where(slots, jn.worker == bindparam("worker")).exists()
    # No slot is held while fewer workers are alive than the job has nodes: it could
    # only sit idle until the gang timeout. (A bridge's jobs hold no slots here.)
    live = (
        select(func.count())
        .select_from(workers)
        .where(
            live_worker(bindparam("live_since", type_=UTCDateTime)),
            w.cluster.is_(None),  # a bridge is no node: it takes whole jobs
        )
        .scalar_subquery()
    )
    pick = (
        select(j.id, j.priority, j.share, j.attempt, j.nnodes, j.spec, j.device, j.nproc_per_node)
        .add_columns(j.owner)  # whose cache its ranks use (worker.files.caches)
        .where(
            j.status == JobStatus.QUEUED,
            j.nnodes > 1,
            ready(),
            fits_bound(worker_has_gpus, "free_cpu", "free_gpus"),
            ~mine,
            held < j.nnodes,
            live >= j.nnodes,
            quota_free(worker_has_gpus),
        )
        .order_by(*ORDER)
        .limit(1)
    )
    if dialect == "postgresql":
        pick = pick.with_for_update(skip_locked=True, of=jobs)
    return pick


def pick(conn: Connection, db: Database, has_gpus: bool, params: dict[str, Any], head: Any) -> Any:
    """The gang this worker may take a node slot of, or None; never one behind ``head``,
    a starving job."""
    live_since = params["now"] - timedelta(seconds=db.policy.lease_s)
    gang = conn.execute(_pick(db.dialect, has_gpus), {**params, "live_since": live_since}).first()
    if (
        gang is not None
        and head is not None
        and order_key(gang.priority, gang.share, gang.id)
        > order_key(head.priority, head.share, head.id)
    ):
        return None  # behind a starving job: it may not start here
    return gang


_FORMING_NODES = (
    select(jn.node_rank, jn.worker, jn.gpus, jn.token_hash, jn.checkpoint_dir, jn.device)
    .where(jn.job_id == bindparam("job_id"), jn.attempt == bindparam("number"))
    .order_by(jn.node_rank)
)
_START_GANG = (
    update(jobs)
    .where(
        j.id == bindparam("job_id"),
        may(Event.START, j.status, SQL),
        j.attempt == bindparam("number") - 1,
    )
    .values(
        # The node slots hold the workers' slots (job_nodes); the job row holds none.
        start_values(
            attempt=bindparam("number"), held_cpu_slots=0, gpus=bindparam("gpus", type_=JSON)
        )
    )
)


@dataclass
class Offer:
    """A claiming worker, as a node: its free slots, token and rendezvous address."""

    worker: str
    capacity: Capacity
    token_hash: str
    addr: str
    port: int
    now: datetime


class NodeSlot(NamedTuple):
    """The node slot a claim took."""

    attempt: int
    node_rank: int
    device: Literal["cpu", "cuda"]
    gpus: list[int]
    checkpoint_dir: str


def take_node(conn: Connection, gang: Any, offer: Offer) -> NodeSlot | None:
    """Hold one node slot of ``gang``'s forming attempt; start the attempt if it was the
    last. None if the gang is full, already has this worker, or uses another backend."""
    job_id, number, nnodes, nproc = gang.id, gang.attempt + 1, gang.nnodes, gang.nproc_per_node
    resolved = resolve(gang.device, bool(offer.capacity.gpus))
    # Read again in this transaction: the pick's snapshot may predate a claim that
    # committed while this one waited for the job's row.
    held = conn.execute(_FORMING_NODES, {"job_id": job_id, "number": number}).all()
    if len(held) >= nnodes or any(n.worker == offer.worker for n in held):
        return None
    if held and held[0].device != resolved:
        # One process group, one backend: a `device: auto` gang whose first node went to
        # a GPU worker (nccl) cannot take a CPU worker's node (gloo), nor the reverse.
        return None
    node_rank = min(set(range(nnodes)) - {n.node_rank for n in held})
    gpus = offer.capacity.free_gpus[:nproc] if resolved == "cuda" else []
    checkpoint_dir = checkpoint_dir_of(offer.capacity.checkpoint_root, job_id)
    new_node(
        conn,
        {
            "job_id": job_id,
            "attempt": number,
            "node_rank": node_rank,
            "worker": offer.worker,
            "addr": offer.addr,
            "port": offer.port,
            "device": resolved,
            "gpus": gpus,
            "held_cpu_slots": nproc if resolved == "cpu" else 0,
            "token_hash": offer.token_hash,
            "checkpoint_dir": checkpoint_dir,
            "claimed_at": offer.now,
            "heartbeat_at": offer.now,
            "log_bytes": 0,
        },
    )
    if len(held) + 1 == nnodes:
        mine = (node_rank, offer.worker, gpus, offer.token_hash, checkpoint_dir)
        _start(conn, job_id, number, [*held, mine], offer.now)
    # Gang waiters (and claimers that skipped the locked row) look again.
    notify_claimers(conn)
    return NodeSlot(number, node_rank, resolved, gpus, checkpoint_dir)


def _start(conn: Connection, job_id: int, number: int, slots: list[Any], now: datetime) -> None:
    """The gang is complete: the attempt starts now, on node 0's worker's books. Every
    node writes checkpoints where node 0's worker does (shared storage on a real
    cluster), so any node's rank 0 can register and resume them."""
    _, worker, gpus, token_hash, gang_dir = next(s for s in slots if s[0] == 0)[:5]
    params = {"job_id": job_id, "number": number, "worker": worker, "now": now, "gpus": gpus}
    if rowcount(conn.execute(_START_GANG, params)) != 1:
        raise RuntimeError(f"job {job_id} changed under its row lock")
    new_attempt(conn, job_id, number, worker, token_hash, gpus, gang_dir, now)
    owner = conn.execute(select(j.owner).where(j.id == job_id)).scalar()
    quotas.settle_start(conn, owner, bool(gpus))  # what its owner holds grew: within limits?


# ---- releasing and timing out ----------------------------------------------------------


def release_nodes(db: Database, *where: Any) -> int:
    """Delete the forming node slots that match ``where``; they hold nothing then."""
    which = select(jn.id, jn.job_id, jn.attempt).where(FORMING, *where)
    with db.read() as s:
        if s.execute(which.limit(1)).first() is None:
            return 0
    released = 0
    with db.write() as s:
        rows = s.execute(which).all()
        for job_id, number in {(r.job_id, r.attempt) for r in rows}:
            if not _still_forming(s, job_id, number):
                continue  # the gang completed meanwhile: its slots run now
            gone = [r.id for r in rows if r.job_id == job_id and r.attempt == number]
            states.release(s, JobNode.id.in_(gone))
            released += len(gone)
    return released


def _still_forming(s: Session, job_id: int, number: int) -> bool:
    """Lock the job's row (the claim that completes a gang holds it) and check that
    attempt ``number`` is still gathering its nodes."""
    row = s.execute(
        select(Job.status, Job.attempt).where(Job.id == job_id).with_for_update()
    ).first()
    return row is not None and bool(forming(row.status, row.attempt, number))


def expire_gangs(db: Database, timeout_s: float, backoff_s: float) -> list[int]:
    """Release the slots of gangs not complete ``timeout_s`` after their first slot was
    held; the job waits ``backoff_s`` (its slots' workers run other jobs meanwhile)
    and says why."""
    now = utcnow()
    cutoff = now - timedelta(seconds=timeout_s)
    late = (
        select(j.id, j.attempt, j.nnodes, func.count(jn.id))
        .where(FORMING)
        .group_by(j.id, j.attempt, j.nnodes)
        .having(func.min(jn.claimed_at) < bindparam("cutoff", type_=UTCDateTime))
    )
    with db.read() as s:
        if not s.execute(late, {"cutoff": cutoff}).first():
            return []
    changed: list[int] = []
    with db.write() as s:
        for job_id, number, nnodes, held in s.execute(late, {"cutoff": cutoff}).all():
            if not _still_forming(s, job_id, number + 1):
                continue  # completed (or cancelled) since the look
            states.release(s, JobNode.job_id == job_id, JobNode.attempt == number + 1)
            reason = (
                f"waiting for {nnodes} nodes: {held} of {nnodes} held, gang timed out after "
                f"{timeout_s:g} s; retrying" + (f" in {backoff_s:g} s" if backoff_s else "")
            )
            s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == JobStatus.QUEUED, Job.attempt == number)
                .values(reason=reason, not_before=now + timedelta(seconds=backoff_s))
            )
            changed.append(job_id)
    return changed


def leave_gang(db: Database, worker: str, job_id: int, number: int) -> bool:
    """Give back ``worker``'s slot of a forming gang (a worker shutting down)."""
    return bool(release_nodes(db, jn.job_id == job_id, jn.attempt == number, jn.worker == worker))


# ---- where a gang stands ---------------------------------------------------------------


def gang_status(db: Database, worker: str, job_id: int, number: int) -> GangReply:
    """Where ``worker``'s node slot of attempt ``number`` stands: forming (the gang is
    not complete), ready (start torchrun with this rendezvous), or released."""
    with db.read() as s:
        job = s.get(Job, job_id)
        slots = nodes_of(s, job_id, number)
        mine = next((n for n in slots if n.worker == worker), None)
        if job is None or mine is None:
            why = (job.reason if job is not None else None) or "the node slot was released"
            return GangReply(state="released", reason=why)
        if forming(job.status, job.attempt, number):
            return GangReply(state="forming", held=len(slots), nnodes=job.nnodes)
        if started(job.status, job.attempt, number):
            return _ready(s, job, number, slots, mine)
        return GangReply(state="released", reason=job.reason or f"job {job_id} is {job.status}")


def _ready(s: Session, job: Job, number: int, slots: list[JobNode], mine: JobNode) -> GangReply:
    attempt = s.scalar(select(Attempt).where(Attempt.job_id == job.id, Attempt.number == number))
    assert attempt is not None
    host = slots[0]
    addr = f"[{host.addr}]" if ":" in host.addr else host.addr
    return GangReply(
        state="ready",
        nnodes=job.nnodes,
        node_rank=mine.node_rank,
        rdzv_endpoint=f"{addr}:{host.port}",
        # Unique to the attempt: a late node of an earlier attempt can never join
        # this one's rendezvous.
        rdzv_id=f"ddpq-{job.id}-{number}",
        rdzv_host=mine.node_rank == 0,
        join_timeout_s=policy_of(s).gang_timeout_s,
        checkpoint_dir=attempt.checkpoint_dir,
        resume_from=resume_from(s, job.id, number),
        workers=[n.worker for n in slots],
    )


def node_of(s: Session, job_id: int, number: int, worker: str) -> JobNode | None:
    """``worker``'s node slot of a multi-node attempt."""
    return s.scalar(
        select(JobNode).where(
            JobNode.job_id == job_id, JobNode.attempt == number, JobNode.worker == worker
        )
    )


def nodes_of(s: Session, job_id: int, number: int) -> list[JobNode]:
    return list(
        s.scalars(
            select(JobNode)
            .where(JobNode.job_id == job_id, JobNode.attempt == number)
            .order_by(JobNode.node_rank)
        )
    )
