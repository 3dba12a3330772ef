"""The claim and lease SQL: the one module that moves jobs between workers.

A claim is one statement: pick the best queued job that fits the worker's free
slots (priority desc, then submission order) and mark it running, returning it.
On Postgres the pick is ``FOR UPDATE SKIP LOCKED`` so concurrent claimers pass
over each other's rows; on SQLite the write transaction is ``BEGIN IMMEDIATE``
(see db.py), which serialises claimers. The attempt row, with its hashed job
token, is written in the same transaction.

Leases: a worker heartbeats its running attempts; an attempt whose heartbeat is
older than the lease is lost and its job requeued (or failed when its attempts
are spent) by ``expire_leases``, which every API process runs periodically.

Multi-node jobs (nnodes > 1) are claimed as a gang of node slots (``job_nodes``):
each claim by a worker that advertises an address takes one slot of the attempt
being formed; the claim that takes the last slot starts the attempt. Until then the
job stays queued and its slots hold their workers' CPU slots or GPUs. Slots not all
held within the gang timeout are released (``expire_gangs``). Each node has its own
lease; losing any node, or any node's failure, ends the attempt for all of them.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    JSON,
    Table,
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    or_,
    select,
    text,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from service.db import STALL_S, Database, Policy
from service.errors import Conflict
from service.models import (
    ACTIVE,
    Attempt,
    Checkpoint,
    Job,
    JobNode,
    JobStatus,
    UTCDateTime,
    Worker,
    utcnow,
)

RESUME_CANDIDATES = 5  # newest checkpoints offered; the worker takes the first on disk
NOTIFY_CHANNEL = "ddpq_jobs"


@dataclass
class Claim:
    job_id: int
    attempt: int
    spec: dict[str, Any]
    device: str
    nproc_per_node: int
    gpus: list[int]
    checkpoint_dir: str
    resume_from: list[str]
    # A node slot of a multi-node job: the worker waits for the gang (gang_status)
    # before it starts torchrun.
    nnodes: int = 1
    node_rank: int = 0
    # When the job entered the queue: its wait, for the metrics (not sent to the worker).
    queued_at: datetime | None = None


def _rowcount(result: Any) -> int:
    """Rows an UPDATE touched (Session.execute is typed as returning a plain Result)."""
    return int(result.rowcount)


def notify_claimers(s: Session | Connection) -> None:
    """Wake long-polling claimers (and gang waiters) in every API process once this
    transaction commits."""
    dialect = s.dialect.name if isinstance(s, Connection) else s.get_bind().dialect.name
    if dialect == "postgresql":
        s.execute(text("SELECT pg_notify(:channel, '')"), {"channel": NOTIFY_CHANNEL})


@dataclass
class Capacity:
    """What a worker has, and what of it no running job holds."""

    name: str
    cpu_slots: int
    gpus: list[int]
    free_cpu: int
    free_gpus: list[int]
    live: bool
    checkpoint_root: str


def _capacities(s: Session, lease_s: float) -> list[Capacity]:
    """Every worker's slots minus those its active jobs hold (the service's own books:
    a GPU stays held until the worker reports the job's processes gone). The claim keeps
    the same books for one worker in _WORKER_BOOKS, a single statement on its hot path."""
    workers = select(
        Worker.name, Worker.cpu_slots, Worker.gpus, Worker.last_heartbeat, Worker.checkpoint_root
    )
    active = Job.status.in_(list(ACTIVE))
    # CPU jobs: one sum per worker. GPU jobs: their rows (a worker has few GPUs).
    cpu_q = select(Job.worker, func.sum(Job.held_cpu_slots)).where(active).group_by(Job.worker)
    gpu_q = select(Job.worker, Job.gpus).where(active, Job.held_cpu_slots == 0)
    node_cpu_q = (
        select(_jn.worker, func.sum(_jn.held_cpu_slots)).where(_NODE_LIVE).group_by(_jn.worker)
    )
    node_gpu_q = select(_jn.worker, _jn.gpus).where(_NODE_LIVE)
    conn = s.connection()
    rows = conn.execute(workers).all()
    if not rows:
        return []
    used_cpu: dict[str, int] = {w: int(n or 0) for w, n in conn.execute(cpu_q) if w is not None}
    for w, n in conn.execute(node_cpu_q):
        used_cpu[w] = used_cpu.get(w, 0) + int(n or 0)
    used_gpus: dict[str, set[int]] = {}
    # CPU-only workers hold no GPU jobs: skip that query on the hot path.
    gpu_rows = (
        [*conn.execute(gpu_q).all(), *conn.execute(node_gpu_q).all()]
        if any(r.gpus for r in rows)
        else []
    )
    for worker, gpus in gpu_rows:
        if worker is not None and gpus:
            used_gpus.setdefault(worker, set()).update(gpus)
    cutoff = utcnow() - timedelta(seconds=lease_s)
    out = []
    for w in rows:
        held = used_gpus.get(w.name, set())
        out.append(
            Capacity(
                name=w.name,
                cpu_slots=w.cpu_slots,
                gpus=list(w.gpus),
                free_cpu=max(0, w.cpu_slots - used_cpu.get(w.name, 0)),
                free_gpus=[g for g in w.gpus if g not in held],
                live=w.last_heartbeat >= cutoff,
                checkpoint_root=w.checkpoint_root,
            )
        )
    return out


# ---- the claim: statements built once --------------------------------------------------
#
# Building a Core statement and its cache key cost more than running it on SQLite; the
# claim is every worker's hot path, so its statements are built once per shape and
# reused (a statement's cache key is memoised on the object).

_jobs = cast(Table, Job.__table__)  # Core, not ORM: no ORM compile step on the hot path
_j = _jobs.c
_QUEUED = and_(_j.status == JobStatus.QUEUED, _j.nnodes == 1)
_nodes = cast(Table, JobNode.__table__)
_jn = _nodes.c
# The node slots of the attempt a queued multi-node job is gathering.
_FORMING = and_(_jn.job_id == _j.id, _j.status == JobStatus.QUEUED, _jn.attempt == _j.attempt + 1)
# A node slot holds its worker's slots while its attempt forms or runs, until that
# node's worker reports its processes gone.
_NODE_LIVE = and_(
    _jn.job_id == _j.id,
    _jn.ended_at.is_(None),
    or_(
        and_(_j.status == JobStatus.QUEUED, _jn.attempt == _j.attempt + 1),
        and_(
            or_(*(_j.status == status for status in sorted(ACTIVE))),
            _jn.attempt == _j.attempt,
        ),
    ),
)
_NODES_HERE = and_(_jn.worker == bindparam("worker"), _NODE_LIVE)
_ORDER = (_j.priority.desc(), _j.id)
# Equalities, not IN: an IN list is an "expanding" parameter, re-rendered every execution.
_ACTIVE_HERE = and_(
    _j.worker == bindparam("worker"),
    or_(*(_j.status == status for status in sorted(ACTIVE))),
)


def _ready() -> Any:
    """Queued jobs whose retry backoff, if any, is over."""
    return or_(_j.not_before.is_(None), _j.not_before <= bindparam("now", type_=UTCDateTime))


# The worker's row, the CPU slots its active jobs hold, and the oldest queued job's
# wait: the starvation probe below runs only when that job has waited long enough.
_WORKER_BOOKS = select(
    Worker.__table__.c.cpu_slots,
    Worker.__table__.c.gpus,
    Worker.__table__.c.checkpoint_root,
    select(func.coalesce(func.sum(_j.held_cpu_slots), 0))
    .where(_ACTIVE_HERE)
    .scalar_subquery()
    .label("used_cpu"),
    select(func.min(_j.queued_at)).where(_j.status == JobStatus.QUEUED).scalar_subquery(),
    select(func.coalesce(func.sum(_jn.held_cpu_slots), 0))
    .where(_NODES_HERE)
    .scalar_subquery()
    .label("node_cpu"),
    # Whether any multi-node job is queued (from ix_jobs_status_nnodes alone): the gang
    # pick runs only then.
    select(_j.id)
    .where(_j.status == JobStatus.QUEUED, _j.nnodes > 1)
    .exists()
    .label("gangs_queued"),
).where(Worker.__table__.c.name == bindparam("worker"))
_HELD_GPUS = union_all(
    select(_j.gpus).where(_ACTIVE_HERE, _j.held_cpu_slots == 0),
    select(_jn.gpus).where(_NODES_HERE),
)


def _fits_bound(worker_has_gpus: bool, cpu: str, gpus: str) -> Any:
    """Queued jobs that fit in the free slots bound as ``cpu`` and ``gpus``."""
    cpu_fit = _j.nproc_per_node <= bindparam(cpu)
    if not worker_has_gpus:
        return and_(or_(_j.device == "cpu", _j.device == "auto"), cpu_fit)
    return or_(
        and_(or_(_j.device == "cuda", _j.device == "auto"), _j.nproc_per_node <= bindparam(gpus)),
        and_(_j.device == "cpu", cpu_fit),
    )


@functools.cache
def _starving_probe(worker_has_gpus: bool) -> Any:
    """The first job in queue order that has waited past the limit and that this
    worker could ever run."""
    return (
        select(_j.id, _j.priority)
        .where(
            _QUEUED,
            _j.queued_at < bindparam("starved_before", type_=UTCDateTime),
            _fits_bound(worker_has_gpus, "total_cpu", "total_gpus"),
        )
        .order_by(*_ORDER)
        .limit(1)
    )


@functools.cache
def _take(dialect: str, worker_has_gpus: bool, guarded: bool) -> Any:
    """Mark the best queued job that fits running, in one statement, and return it."""
    pick = select(_j.id).where(
        _QUEUED, _ready(), _fits_bound(worker_has_gpus, "free_cpu", "free_gpus")
    )
    if guarded:  # a job starves: nothing behind it in queue order may start
        pick = pick.where(
            or_(
                _j.priority > bindparam("head_priority"),
                and_(_j.priority == bindparam("head_priority"), _j.id <= bindparam("head_id")),
            )
        )
    pick = pick.order_by(*_ORDER).limit(1)
    if dialect == "postgresql":
        pick = pick.with_for_update(skip_locked=True)
    # A CPU job holds its ranks' CPU slots; a GPU job its GPUs (set after the pick).
    held_cpu = (
        case((_j.device == "cpu", _j.nproc_per_node), else_=0)
        if worker_has_gpus
        else _j.nproc_per_node
    )
    return (
        update(_jobs)
        .where(_j.id == pick.scalar_subquery(), _j.status == JobStatus.QUEUED)
        .values(
            status=JobStatus.RUNNING,
            attempt=_j.attempt + 1,
            worker=bindparam("worker"),
            started_at=func.coalesce(_j.started_at, bindparam("now", type_=UTCDateTime)),
            reason=None,
            exit_code=None,
            not_before=None,
            held_cpu_slots=held_cpu,
            gpus=bindparam("no_gpus", type_=JSON),
        )
        .returning(_j.id, _j.attempt, _j.spec, _j.device, _j.nproc_per_node, _j.queued_at)
    )


@functools.cache
def _gang_pick(dialect: str, worker_has_gpus: bool) -> Any:
    """The first queued multi-node job, in queue order, with a node slot free that fits
    this worker and that this worker does not already hold (a worker is one node)."""
    forming = and_(_jn.job_id == _j.id, _jn.attempt == _j.attempt + 1)
    held = select(func.count()).select_from(_nodes).where(forming).scalar_subquery()
    mine = select(_jn.id).where(forming, _jn.worker == bindparam("worker")).exists()
    # No slot is held while fewer workers are alive than the job has nodes: it could
    # only sit idle until the gang timeout.
    live = (
        select(func.count())
        .select_from(Worker.__table__)
        .where(Worker.__table__.c.last_heartbeat >= bindparam("live_since", type_=UTCDateTime))
        .scalar_subquery()
    )
    pick = (
        select(_j.id, _j.priority, _j.attempt, _j.nnodes, _j.spec, _j.device, _j.nproc_per_node)
        .where(
            _j.status == JobStatus.QUEUED,
            _j.nnodes > 1,
            _ready(),
            _fits_bound(worker_has_gpus, "free_cpu", "free_gpus"),
            ~mine,
            held < _j.nnodes,
            live >= _j.nnodes,
        )
        .order_by(*_ORDER)
        .limit(1)
    )
    if dialect == "postgresql":
        pick = pick.with_for_update(skip_locked=True, of=_jobs)
    return pick


_FORMING_NODES = (
    select(_jn.node_rank, _jn.worker, _jn.gpus, _jn.token_hash, _jn.checkpoint_dir, _jn.device)
    .where(_jn.job_id == bindparam("job_id"), _jn.attempt == bindparam("number"))
    .order_by(_jn.node_rank)
)
_START_GANG = (
    update(_jobs)
    .where(
        _j.id == bindparam("job_id"),
        _j.status == JobStatus.QUEUED,
        _j.attempt == bindparam("number") - 1,
    )
    .values(
        status=JobStatus.RUNNING,
        attempt=bindparam("number"),
        worker=bindparam("worker"),
        started_at=func.coalesce(_j.started_at, bindparam("now", type_=UTCDateTime)),
        reason=None,
        exit_code=None,
        not_before=None,
        # The node slots hold the workers' slots (job_nodes); the job row holds none.
        held_cpu_slots=0,
        gpus=bindparam("gpus", type_=JSON),
    )
)


def _resolve(device: str, worker_has_gpus: bool) -> str:
    """The device a claimed job runs on here: `auto` takes the worker's GPUs if it has any."""
    return "cuda" if device == "cuda" or (device == "auto" and worker_has_gpus) else "cpu"


def _take_node(
    conn: Connection,
    gang: Any,
    worker: str,
    resolved: str,
    offered_gpus: list[int],
    checkpoint_root: str,
    token_hash: str,
    addr: str,
    port: int,
    now: datetime,
) -> Claim | None:
    """Hold one node slot of ``gang``'s forming attempt; start the attempt if it was the last."""
    job_id, number, nnodes, nproc = gang.id, gang.attempt + 1, gang.nnodes, gang.nproc_per_node
    # Read again in this transaction: the pick's snapshot may predate a claim that
    # committed while this one waited for the job's row.
    held = conn.execute(_FORMING_NODES, {"job_id": job_id, "number": number}).all()
    if len(held) >= nnodes or any(n.worker == worker for n in held):
        return None
    if held and held[0].device != resolved:
        # One process group, one backend: a `device: auto` gang whose first node went to
        # a GPU worker (nccl) cannot take a CPU worker's node (gloo), nor the reverse.
        return None
    node_rank = min(set(range(nnodes)) - {n.node_rank for n in held})
    gpus = offered_gpus[:nproc] if resolved == "cuda" else []
    checkpoint_dir = f"{checkpoint_root.rstrip('/')}/job-{job_id}"
    conn.execute(
        insert(_nodes),
        {
            "job_id": job_id,
            "attempt": number,
            "node_rank": node_rank,
            "worker": worker,
            "addr": addr,
            "port": port,
            "device": resolved,
            "gpus": gpus,
            "held_cpu_slots": nproc if resolved == "cpu" else 0,
            "token_hash": token_hash,
            "checkpoint_dir": checkpoint_dir,
            "claimed_at": now,
            "heartbeat_at": now,
            "log_bytes": 0,
        },
    )
    if len(held) + 1 == nnodes:
        # The gang is complete: the attempt starts now, on node 0's worker's books.
        # Every node writes checkpoints where node 0's worker does (shared storage
        # on a real cluster), so any node's rank 0 can register and resume them.
        node0 = next((n for n in held if n.node_rank == 0), None)
        if node0 is None:  # this claim took rank 0 (an earlier node 0 was released)
            node0_worker, node0_gpus = worker, gpus
            node0_token, gang_dir = token_hash, checkpoint_dir
        else:
            node0_worker, node0_gpus = node0.worker, node0.gpus
            node0_token, gang_dir = node0.token_hash, node0.checkpoint_dir
        started = conn.execute(
            _START_GANG,
            {
                "job_id": job_id,
                "number": number,
                "worker": node0_worker,
                "now": now,
                "gpus": node0_gpus,
            },
        )
        if _rowcount(started) != 1:
            raise RuntimeError(f"job {job_id} changed under its row lock")
        conn.execute(
            _NEW_ATTEMPT,
            {
                "job_id": job_id,
                "number": number,
                "worker": node0_worker,
                "token_hash": node0_token,
                "gpus": node0_gpus,
                "checkpoint_dir": gang_dir,
                "started_at": now,
                "heartbeat_at": now,
                "outcome": "running",
                "log_bytes": 0,
            },
        )
    # Gang waiters (and claimers that skipped the locked row) look again.
    notify_claimers(conn)
    return Claim(
        job_id, number, gang.spec, resolved, nproc, gpus, checkpoint_dir, [], nnodes, node_rank
    )


_SET_GPUS = (
    update(_jobs).where(_j.id == bindparam("job_id")).values(gpus=bindparam("gpus", type_=JSON))
)
_NEW_ATTEMPT = insert(cast(Table, Attempt.__table__))
_RESUME_FROM = (
    select(Checkpoint.__table__.c.path)
    .where(Checkpoint.__table__.c.job_id == bindparam("job_id"))
    .order_by(Checkpoint.__table__.c.step.desc(), Checkpoint.__table__.c.id.desc())
    .limit(RESUME_CANDIDATES)
)


def claim_next_job(
    db: Database,
    worker: str,
    free_cpu_slots: int,
    free_gpus: list[int],
    token_hash: str,
    advertise_addr: str | None = None,
    rdzv_port: int | None = None,
) -> Claim | None:
    """Claim the next job that fits on ``worker`` now, or return None.

    Order: priority desc, then submission. A later job that fits may start while
    an earlier one waits for more slots (backfill), unless an earlier job this
    worker could ever run has waited longer than the starvation limit: then only
    that job, or ones ahead of it, may start here.

    A worker that gives an address other nodes reach it at (and a free port for a
    rendezvous) may be given a node slot of a multi-node job instead: a Claim with
    ``nnodes`` > 1, whose attempt starts once every slot is held.
    """
    now = utcnow()
    with db.write_conn() as conn:
        books = conn.execute(_WORKER_BOOKS, {"worker": worker}).first()
        if books is None:
            raise LookupError(worker)
        cpu_slots, worker_gpus, checkpoint_root, used_cpu, oldest_queued, node_cpu, gangs = books
        used_cpu = int(used_cpu) + int(node_cpu)
        has_gpus = bool(worker_gpus)
        held: set[int] = set()
        if has_gpus:
            for (gpus,) in conn.execute(_HELD_GPUS, {"worker": worker}):
                held.update(gpus or ())
        # The worker's view may lag (a job it is still stopping); the books may too
        # (a finish in flight). Only slots free in both are offered.
        reported = set(free_gpus)
        offered_gpus = sorted(g for g in worker_gpus if g not in held and g in reported)
        params: dict[str, Any] = {
            "worker": worker,
            "now": now,
            "free_cpu": min(max(0, cpu_slots - int(used_cpu)), free_cpu_slots),
            "free_gpus": len(offered_gpus),
            "no_gpus": None if has_gpus else [],
        }
        starved_before = now - timedelta(seconds=db.policy.starvation_s)
        guarded = False
        if oldest_queued is not None and as_utc(oldest_queued) < starved_before:
            head = conn.execute(
                _starving_probe(has_gpus),
                {
                    "starved_before": starved_before,
                    "total_cpu": cpu_slots,
                    "total_gpus": len(worker_gpus),
                },
            ).first()
            if head is not None:
                guarded = True
                params.update(head_id=head.id, head_priority=head.priority)
        gang = None
        if gangs and advertise_addr and rdzv_port:
            live_since = now - timedelta(seconds=db.policy.lease_s)
            gang = conn.execute(
                _gang_pick(db.dialect, has_gpus), {**params, "live_since": live_since}
            ).first()
            head_key = (-params["head_priority"], params["head_id"]) if guarded else None
            if gang is not None and head_key is not None and (-gang.priority, gang.id) > head_key:
                gang = None  # behind a starving job: it may not start here
            if gang is not None:
                # A single-node job may start here only if it is ahead of the gang.
                guarded = True
                params.update(head_id=gang.id, head_priority=gang.priority)
        row = conn.execute(_take(db.dialect, has_gpus, guarded), params).first()
        if row is None:
            if gang is None:
                return None
            resolved = _resolve(gang.device, has_gpus)
            assert advertise_addr is not None and rdzv_port is not None
            return _take_node(
                conn,
                gang,
                worker,
                resolved,
                offered_gpus,
                checkpoint_root,
                token_hash,
                advertise_addr,
                rdzv_port,
                now,
            )
        job_id, number, spec, device, nproc, queued_at = row
        resolved = _resolve(device, has_gpus)
        gpus = offered_gpus[:nproc] if resolved == "cuda" else []
        if has_gpus:
            conn.execute(_SET_GPUS, {"job_id": job_id, "gpus": gpus})
        checkpoint_dir = f"{checkpoint_root.rstrip('/')}/job-{job_id}"
        conn.execute(
            _NEW_ATTEMPT,
            {
                "job_id": job_id,
                "number": number,
                "worker": worker,
                "token_hash": token_hash,
                "gpus": gpus,
                "checkpoint_dir": checkpoint_dir,
                "started_at": now,
                "heartbeat_at": now,
                "outcome": "running",
                "log_bytes": 0,
            },
        )
        resume: list[str] = []
        if number > 1:  # a first attempt has no checkpoints to resume from
            resume = list(conn.scalars(_RESUME_FROM, {"job_id": job_id}))
        return Claim(
            job_id, number, spec, resolved, nproc, gpus, checkpoint_dir, resume, queued_at=queued_at
        )


def as_utc(value: datetime) -> datetime:
    """A scalar subquery's datetime comes back without the column's type processing."""
    if isinstance(value, str):  # SQLite hands back the stored text
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def workers_overview(db: Database) -> list[dict[str, Any]]:
    """Each worker: its slots, what is free, what runs on it, its last heartbeat."""
    with db.read() as s:
        caps = {c.name: c for c in _capacities(s, db.policy.lease_s)}
        running: dict[str, list[dict[str, Any]]] = {}
        single = (
            select(
                Job.id, Job.name, Job.status, Job.attempt, Job.nproc_per_node, Job.gpus, Job.worker
            )
            .where(Job.status.in_(list(ACTIVE)), Job.nnodes == 1)
            .order_by(Job.id)
        )
        # A multi-node job shows on every worker holding one of its node slots.
        nodes = (
            select(_j.id, _j.name, _j.status, _jn.attempt, _j.nproc_per_node, _jn.gpus, _jn.worker)
            .where(_NODE_LIVE)
            .order_by(_j.id, _jn.node_rank)
        )
        for j in itertools.chain(s.execute(single), s.execute(nodes)):
            running.setdefault(j.worker or "", []).append(
                {
                    "job_id": j.id,
                    "name": j.name,
                    "status": j.status,
                    "attempt": j.attempt,
                    "nproc_per_node": j.nproc_per_node,
                    "gpus": j.gpus or [],
                }
            )
        out = []
        for w in s.scalars(select(Worker).order_by(Worker.name)):
            cap = caps[w.name]
            out.append(
                {
                    "name": w.name,
                    "hostname": w.hostname,
                    "cpu_slots": w.cpu_slots,
                    "gpus": w.gpus,
                    "free_cpu_slots": cap.free_cpu,
                    "free_gpus": cap.free_gpus,
                    "alive": cap.live,
                    "last_heartbeat": w.last_heartbeat,
                    "registered_at": w.registered_at,
                    "running": running.get(w.name, []),
                }
            )
        return out


# ---- why a job waits -------------------------------------------------------------------


def _unit(device: str, gpu_worker: bool) -> str | None:
    """What a job counts on a worker: GPUs, CPU slots, or nothing it can use."""
    if device == "cuda":
        return "gpu" if gpu_worker else None
    if device == "cpu":
        return "cpu"
    return "gpu" if gpu_worker else "cpu"


def _total(cap: Capacity, unit: str) -> int:
    return len(cap.gpus) if unit == "gpu" else cap.cpu_slots


def _free(cap: Capacity, unit: str) -> int:
    return len(cap.free_gpus) if unit == "gpu" else cap.free_cpu


def _words(n: int, unit: str) -> str:
    if unit == "gpu":
        return f"{n} GPU" + ("" if n == 1 else "s")
    return f"{n} CPU slot" + ("" if n == 1 else "s")


def _unschedulable_on(caps: list[Capacity], job: Job) -> str | None:
    if job.nnodes > 1:
        return None  # multi-node placement is not decided per worker
    best = {"gpu": 0, "cpu": 0}
    for cap in caps:
        unit = _unit(job.device, bool(cap.gpus))
        if unit is None:
            continue
        if _total(cap, unit) >= job.nproc_per_node:
            return None
        best[unit] = max(best[unit], _total(cap, unit))
    if not caps:
        return None  # no worker yet: it waits for one
    n = job.nproc_per_node
    units = {_unit(job.device, bool(c.gpus)) for c in caps} - {None}
    if units == {"gpu", "cpu"}:  # an auto job, with GPU and CPU-only workers about
        return (
            f"unschedulable: needs {_words(n, 'gpu')} on one GPU worker or {_words(n, 'cpu')} "
            f"on one CPU-only worker; the largest have {_words(best['gpu'], 'gpu')} and "
            f"{_words(best['cpu'], 'cpu')}"
        )
    unit = "cpu" if units == {"cpu"} else "gpu"
    return (
        f"unschedulable: needs {_words(n, unit)} on one worker; the largest worker has "
        f"{_words(best[unit], unit)}"
    )


def _policy(s: Session) -> Policy:
    policy: Policy = s.info.get("policy") or Policy()
    return policy


def unschedulable(s: Session, job: Job) -> str | None:
    """Why no registered worker could ever run ``job``, or None if one could."""
    return _unschedulable_on(_capacities(s, _policy(s).lease_s), job)


def pending_reasons(s: Session, jobs: list[Job], positions: dict[int, int]) -> dict[int, str]:
    """Why each queued job is not running, in words a person understands."""
    if not jobs:
        return {}
    policy = _policy(s)
    caps = _capacities(s, policy.lease_s)
    live = [c for c in caps if c.live]
    now = utcnow()
    reasons: dict[int, str] = {}
    gangs = [j for j in jobs if j.nnodes > 1]
    held: dict[int, int] = {}
    if gangs:
        held = dict(
            s.execute(
                select(_j.id, func.count(_jn.id))
                .where(_FORMING, _j.id.in_([j.id for j in gangs]))
                .group_by(_j.id)
            ).all()
        )
    for job in jobs:
        if job.nnodes > 1:
            reasons[job.id] = _gang_reason(job, held.get(job.id, 0), live, now)
            continue
        problem = _unschedulable_on(caps, job)
        if problem:
            reasons[job.id] = problem
            continue
        if job.not_before is not None and job.not_before > now:
            wait = (job.not_before - now).total_seconds()
            reasons[job.id] = f"waiting out its retry backoff: {wait:.0f} s left"
            continue
        if not caps:
            reasons[job.id] = "waiting for a worker: none has registered"
            continue
        if not live:
            reasons[job.id] = (
                f"waiting for a worker: none has sent a heartbeat in the last {policy.lease_s:g} s"
            )
            continue
        best_free = {"gpu": 0, "cpu": 0}
        fits_now = False
        for cap in live:
            unit = _unit(job.device, bool(cap.gpus))
            if unit is None or _total(cap, unit) < job.nproc_per_node:
                continue
            best_free[unit] = max(best_free[unit], _free(cap, unit))
            fits_now = fits_now or _free(cap, unit) >= job.nproc_per_node
        ahead = positions.get(job.id, 1) - 1
        if not fits_now:
            if job.device == "cpu" or (job.device == "auto" and not any(c.gpus for c in live)):
                unit = "cpu"
            else:
                unit = "gpu"
            reasons[job.id] = (
                f"waiting for {_words(job.nproc_per_node, unit)}; the most free on one "
                f"worker is {best_free[unit]}"
            )
        elif ahead:
            reasons[job.id] = f"waiting for its turn: {ahead} job(s) ahead in the queue"
        else:
            reasons[job.id] = "waiting for a worker to claim it"
        waited = (now - (job.queued_at or job.created_at)).total_seconds()
        if not fits_now and waited > policy.starvation_s:
            reasons[job.id] += (
                f"; it has waited over {policy.starvation_s:g} s, so later jobs no longer "
                "start ahead of it"
            )
    return reasons


def _gang_reason(job: Job, held: int, live: list[Capacity], now: datetime) -> str:
    """Why a multi-node job waits: its slots so far, and how many workers could be a node."""
    if job.not_before is not None and job.not_before > now:
        wait = (job.not_before - now).total_seconds()
        return f"waiting out its retry backoff: {wait:.0f} s left"
    n, per_node = job.nnodes, job.nproc_per_node
    fit = 0
    unit = "cpu"
    for cap in live:
        u = _unit(job.device, bool(cap.gpus))
        if u is not None and _total(cap, u) >= per_node:
            fit += 1
            unit = u if fit == 1 else unit
    words = f"waiting for {n} nodes: {held} of {n} held"
    if fit < n:
        words += (
            f"; {fit} live worker(s) can run a node of {_words(per_node, unit)}, "
            f"each node needs its own worker"
        )
    return words


class NameTaken(Conflict):
    """Another process holds this worker name: 409, saying which host."""


def register_worker(
    db: Database,
    name: str,
    identity: str | None,
    hostname: str,
    cpu_slots: int,
    gpus: list[int],
    checkpoint_root: str,
) -> None:
    """Record a worker and what it has. The same identity (or none, from a worker of an
    earlier version) is the same worker starting again; another identity is refused
    while the name's heartbeats are fresh (a second process would take the first one's
    jobs), and takes the name over once they have been silent for a lease."""
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
        w.last_heartbeat = now


def record_heartbeat(
    db: Database, worker: str, running: list[tuple[int, int]], identity: str | None = None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Extend the leases of a worker's attempts.

    Returns (cancel, abandon): attempts a user cancelled, and attempts that are no
    longer this worker's to run (lost and requeued, or ended); the worker stops both.
    Raises NameTaken when another process has taken the name over.
    """
    now = utcnow()
    cancel: list[tuple[int, int]] = []
    abandon: list[tuple[int, int]] = []
    with db.write() as s:
        mine = Worker.name == worker
        if identity:
            mine = and_(mine, or_(Worker.identity.is_(None), Worker.identity == identity))
        touched = _rowcount(s.execute(update(Worker).where(mine).values(last_heartbeat=now)))
        if touched == 0:
            holder = s.scalar(select(Worker.hostname).where(Worker.name == worker))
            if holder is not None:
                raise NameTaken(
                    f"worker name {worker} was taken over by another process (host {holder}) "
                    "after this one's heartbeats went silent; its jobs run there now"
                )
            raise LookupError(worker)
        if not running:
            return cancel, abandon
        job_ids = [job_id for job_id, _ in running]
        jobs = {
            j.id: j
            for j in s.execute(
                select(Job.id, Job.attempt, Job.status, Job.worker, Job.nnodes).where(
                    Job.id.in_(job_ids)
                )
            )
        }
        nodes: dict[tuple[int, int], int] = {}
        if any(j.nnodes > 1 for j in jobs.values()):
            nodes = {
                (n.job_id, n.attempt): n.id
                for n in s.execute(
                    select(JobNode.id, JobNode.job_id, JobNode.attempt).where(
                        JobNode.worker == worker, JobNode.job_id.in_(job_ids)
                    )
                )
            }
        live: list[tuple[int, int]] = []
        live_nodes: list[int] = []
        for job_id, number in running:
            job = jobs.get(job_id)
            if job is not None and job.nnodes > 1:
                # A node slot: ours while its attempt forms or runs and we hold it.
                node = nodes.get((job_id, number))
                forming = job.status == JobStatus.QUEUED and job.attempt + 1 == number
                started = job.status in ACTIVE and job.attempt == number
                if node is None or not (forming or started):
                    abandon.append((job_id, number))
                    continue
                live_nodes.append(node)
                if forming:
                    continue
            elif (
                job is None
                or job.attempt != number
                or job.worker != worker
                or job.status not in ACTIVE
            ):
                abandon.append((job_id, number))
                continue
            live.append((job_id, number))
            if job.status == JobStatus.CANCELLING:
                cancel.append((job_id, number))
        if live_nodes:
            s.execute(update(JobNode).where(JobNode.id.in_(live_nodes)).values(heartbeat_at=now))
        for job_id, number in sorted(live):  # the lock order: by job id
            s.execute(
                update(Attempt)
                .where(
                    Attempt.job_id == job_id,
                    Attempt.number == number,
                    Attempt.ended_at.is_(None),
                )
                .values(heartbeat_at=now)
            )
    return cancel, abandon


def requeued(now: datetime, reason: str) -> dict[str, Any]:
    """A job's columns when it goes back to the queue: it waits anew and holds nothing."""
    return {
        "status": JobStatus.QUEUED,
        "queued_at": now,
        "reason": reason,
        "worker": None,
        "gpus": None,
        "held_cpu_slots": 0,
    }


def expire_leases(db: Database, lease_s: float) -> list[int]:
    """Mark attempts without a heartbeat for ``lease_s`` lost; requeue or fail their jobs."""
    cutoff = utcnow() - timedelta(seconds=lease_s)
    return _lose_attempts(
        db,
        Attempt.heartbeat_at < cutoff,
        lambda worker: f"worker {worker} lost (no heartbeat for {lease_s:g} s)",
        lambda: db.health.up_for(lease_s),
    )


def release_worker(db: Database, worker: str, keep: list[tuple[int, int]]) -> list[int]:
    """Lose the attempts the books give ``worker`` except those it says it still runs
    (a multi-node attempt with a node on it too), and release its forming node slots."""
    its_nodes = select(JobNode.job_id, JobNode.attempt).where(
        JobNode.worker == worker, JobNode.ended_at.is_(None)
    )
    which = or_(Attempt.worker == worker, tuple_(Attempt.job_id, Attempt.number).in_(its_nodes))
    if keep:
        which = and_(which, tuple_(Attempt.job_id, Attempt.number).not_in(keep))
    changed = _lose_attempts(db, which, lambda _: f"worker {worker} restarted without it")
    forming = [_jn.worker == worker]
    if keep:
        forming.append(tuple_(_jn.job_id, _jn.attempt).not_in(keep))
    _release_nodes(db, *forming)
    return changed


def _release_nodes(db: Database, *where: Any) -> int:
    """Delete the forming node slots that match ``where``; they hold nothing then."""
    which = select(_jn.id, _jn.job_id, _jn.attempt).where(_FORMING, *where)
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
            s.execute(delete(JobNode).where(JobNode.id.in_(gone)))
            released += len(gone)
        if released:
            notify_claimers(s)
    return released


def _still_forming(s: Session, job_id: int, number: int) -> bool:
    """Lock the job's row (the claim that completes a gang holds it) and check that
    attempt ``number`` is still gathering its nodes."""
    row = s.execute(
        select(Job.status, Job.attempt).where(Job.id == job_id).with_for_update()
    ).first()
    return row is not None and row.status == JobStatus.QUEUED and row.attempt + 1 == number


def expire_nodes(db: Database, lease_s: float) -> list[int]:
    """Node slots without a heartbeat for ``lease_s``: a running attempt is lost as a
    whole (its other nodes are told to stop at their next heartbeat); a forming slot
    is released."""
    cutoff = utcnow() - timedelta(seconds=lease_s)
    stale = and_(_jn.heartbeat_at < bindparam("cutoff", type_=UTCDateTime))
    changed: list[int] = []
    running_stale = select(_jn.job_id, _jn.attempt, _jn.worker, _jn.node_rank, _j.nnodes).where(
        _NODE_LIVE, _j.status != JobStatus.QUEUED, stale
    )
    with db.read() as s:
        lost = s.execute(running_stale, {"cutoff": cutoff}).all()
    for job_id, number, worker, rank, nnodes in lost:
        words = f"worker {worker} (node {rank} of {nnodes}) lost (no heartbeat for {lease_s:g} s)"
        changed += _lose_attempts(
            db,
            and_(Attempt.job_id == job_id, Attempt.number == number),
            lambda _, words=words: words,  # type: ignore[misc]
            lambda: db.health.up_for(lease_s),
        )
    _release_nodes(db, _jn.heartbeat_at < cutoff)
    return changed


def expire_gangs(db: Database, timeout_s: float, backoff_s: float) -> list[int]:
    """Release the slots of gangs not complete ``timeout_s`` after their first slot was
    held; the job waits ``backoff_s`` (its slots' workers run other jobs meanwhile)
    and says why."""
    now = utcnow()
    cutoff = now - timedelta(seconds=timeout_s)
    late = (
        select(_j.id, _j.attempt, _j.nnodes, func.count(_jn.id))
        .where(_FORMING)
        .group_by(_j.id, _j.attempt, _j.nnodes)
        .having(func.min(_jn.claimed_at) < bindparam("cutoff", type_=UTCDateTime))
    )
    with db.read() as s:
        if not s.execute(late, {"cutoff": cutoff}).first():
            return []
    changed: list[int] = []
    with db.write() as s:
        for job_id, number, nnodes, held in s.execute(late, {"cutoff": cutoff}).all():
            if not _still_forming(s, job_id, number + 1):
                continue  # completed (or cancelled) since the look
            s.execute(
                delete(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == number + 1)
            )
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
        if changed:
            notify_claimers(s)
    return changed


def gang_status(db: Database, worker: str, job_id: int, number: int) -> dict[str, Any]:
    """Where ``worker``'s node slot of attempt ``number`` stands: forming (the gang is
    not complete), ready (start torchrun with this rendezvous), or released."""
    with db.read() as s:
        job = s.get(Job, job_id)
        nodes = nodes_of(s, job_id, number)
        mine = next((n for n in nodes if n.worker == worker), None)
        if job is None or mine is None:
            why = (job.reason if job is not None else None) or "the node slot was released"
            return {"state": "released", "reason": why}
        if job.status == JobStatus.QUEUED and job.attempt + 1 == number:
            return {"state": "forming", "held": len(nodes), "nnodes": job.nnodes}
        if job.status in ACTIVE and job.attempt == number:
            attempt = s.scalar(
                select(Attempt).where(Attempt.job_id == job_id, Attempt.number == number)
            )
            assert attempt is not None
            host = nodes[0]
            addr = f"[{host.addr}]" if ":" in host.addr else host.addr
            resume = list(s.scalars(_RESUME_FROM, {"job_id": job_id})) if number > 1 else []
            return {
                "state": "ready",
                "nnodes": job.nnodes,
                "node_rank": mine.node_rank,
                "rdzv_endpoint": f"{addr}:{host.port}",
                # Unique to the attempt: a late node of an earlier attempt can never
                # join this one's rendezvous.
                "rdzv_id": f"ddpq-{job_id}-{number}",
                "rdzv_host": mine.node_rank == 0,
                "join_timeout_s": _policy(s).gang_timeout_s,
                "checkpoint_dir": attempt.checkpoint_dir,
                "resume_from": resume,
                "workers": [n.worker for n in nodes],
            }
        return {"state": "released", "reason": job.reason or f"job {job_id} is {job.status}"}


def leave_gang(db: Database, worker: str, job_id: int, number: int) -> bool:
    """Give back ``worker``'s slot of a forming gang (a worker shutting down)."""
    return bool(
        _release_nodes(db, _jn.job_id == job_id, _jn.attempt == number, _jn.worker == worker)
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


def _lose_attempts(
    db: Database,
    which: Any,
    why: Callable[[str], str],
    settled: Callable[[], bool] | None = None,
) -> list[int]:
    """Mark the current attempts that match ``which`` lost; requeue or fail their jobs.
    ``settled`` is asked again inside the write transaction, and a transaction that
    stalled to get there (it waited out an outage) acts on nothing: the heartbeats the
    outage held up have not arrived yet."""
    now = utcnow()
    changed: list[int] = []
    find_stale = (
        select(
            Job.id,
            Job.attempt,
            Job.max_attempts,
            Job.failures,
            Job.status,
            Attempt.worker,
            Attempt.id,
        )
        .join(Attempt, and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt))
        .where(Job.status.in_(list(ACTIVE)), Attempt.ended_at.is_(None), which)
        .order_by(Job.id)  # the lock order: job rows by ascending id
    )
    # Look first without the write lock: nearly every sweep finds nothing.
    with db.read() as s:
        if s.execute(find_stale.limit(1)).first() is None:
            return changed
    started = time.monotonic()
    with db.write() as s:
        stale = s.execute(find_stale).all()
        if settled is not None and (time.monotonic() - started > STALL_S or not settled()):
            return changed
        for job_id, number, max_attempts, _, _, worker, attempt_id in stale:
            # Decide on rows locked now, not on the look: a finish, a cancel or a
            # heartbeat may have committed since. Job row first, then its attempt,
            # re-checking ``which`` (Postgres re-reads a row it waited for).
            job = s.execute(
                select(Job.status, Job.attempt, Job.failures)
                .where(Job.id == job_id)
                .with_for_update()
            ).first()
            if job is None or job.attempt != number or job.status not in ACTIVE:
                continue
            still = s.execute(
                select(Attempt.id)
                .where(Attempt.id == attempt_id, Attempt.ended_at.is_(None), which)
                .with_for_update()
            ).first()
            if still is None:
                continue
            status, failures = job.status, job.failures
            lost = why(worker)
            if status == JobStatus.CANCELLING:
                values: dict[str, Any] = {
                    "status": JobStatus.CANCELLED,
                    "reason": f"cancelled; {lost} before it confirmed",
                    "finished_at": now,
                }
            elif failures + 1 < max_attempts:
                # The worker, not the program, failed: requeued at once, no backoff.
                values = {
                    **requeued(
                        now,
                        f"{lost}; requeued for attempt {number + 1} "
                        f"({failures + 1} of {max_attempts} attempts used)",
                    ),
                    "failures": failures + 1,
                }
            else:
                values = {
                    "status": JobStatus.FAILED,
                    "reason": f"{lost}; all {max_attempts} attempts used",
                    "finished_at": now,
                    "failures": failures + 1,
                }
            s.execute(update(Job).where(Job.id == job_id).values(**values))
            s.execute(
                update(Attempt)
                .where(Attempt.id == attempt_id)
                .values(ended_at=now, outcome="lost", reason=values["reason"])
            )
            changed.append(job_id)
        if changed:
            notify_claimers(s)
    return changed
