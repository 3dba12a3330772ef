"""The service's books of what each worker has and what of it is held.

One definition, ``holdings``, says what holds a worker's slots: an active job's row
(its CPU slots, or its GPUs) and a live node slot of a multi-node job. A GPU stays
held until the worker reports the job's processes gone. The claim reads it for one
worker in a single statement on its hot path; the overview reads it for every worker
(``capacities``), the reasons a summary of it grouped in SQL (``summary``).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Integer,
    bindparam,
    case,
    false,
    func,
    literal_column,
    null,
    select,
    union_all,
)
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from service.db import Database
from service.models import JobStatus, utcnow
from service.queue.quotas import quotas_table
from service.queue.rules import NODE_LIVE, SQL, is_active, j, jn, live_worker, w, workers


@dataclass(frozen=True)
class Partition:
    """A bridge's Slurm partition, as it registered it (schemas.ClusterShape)."""

    name: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    max_pending: int


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
    # A bridge's partition (schemas.ClusterShape as a dict): Slurm holds its jobs'
    # resources, so its cpu_slots and gpus are none and hold nothing.
    cluster: dict[str, Any] | None = None

    @functools.cached_property
    def partition(self) -> Partition | None:
        """The bridge's partition, read once from ``cluster``; None for a worker."""
        return _partition(self.cluster)


def _partition(shape: dict[str, Any] | None) -> Partition | None:
    if shape is None:
        return None
    return Partition(
        str(shape["partition"]),
        int(shape["nodes"]),
        int(shape["cpus_per_node"]),
        int(shape.get("gpus_per_node", 0)),
        int(shape.get("max_pending", 1)),
    )


@functools.cache
def holdings(one_worker: bool) -> Any:
    """(worker, cpu, gpus) rows of everything holding slots; of the worker bound as
    ``worker`` only, or of every worker."""
    here_job = [j.worker == bindparam("worker")] if one_worker else []
    here_node = [jn.worker == bindparam("worker")] if one_worker else []
    return union_all(
        select(j.worker.label("worker"), j.held_cpu_slots.label("cpu"), j.gpus.label("gpus")).where(
            *here_job, is_active(j.status, SQL)
        ),
        select(jn.worker, jn.held_cpu_slots, jn.gpus).where(*here_node, NODE_LIVE),
    ).subquery("holdings")


def _free(cpu_slots: int, gpus: list[int], used_cpu: int, held: set[int]) -> tuple[int, list[int]]:
    return max(0, cpu_slots - used_cpu), [g for g in gpus if g not in held]


# ---- one worker, for the claim ---------------------------------------------------------

_HERE = holdings(True)
# The worker's row, the CPU slots held on it, the oldest queued job's wait (the
# starvation probe runs only when that job has waited long enough), and whether any
# multi-node job is queued (the gang pick runs only then), and whether any quota is set
# (the quota flags' refresh runs only then), and whether it left (claim.leave: read with
# no lock, which would cost every idle poll's claim a commit to disk on Postgres; a claim
# that takes a job reads it again, locked: claim._still_here).
_WORKER_BOOKS = select(
    w.cpu_slots,
    w.gpus,
    w.checkpoint_root,
    w.cluster,
    w.left_at,
    select(func.coalesce(func.sum(_HERE.c.cpu), 0)).scalar_subquery().label("used_cpu"),
    select(func.min(j.queued_at)).where(j.status == JobStatus.QUEUED).scalar_subquery(),
    select(j.id).where(j.status == JobStatus.QUEUED, j.nnodes > 1).exists().label("gangs"),
    select(quotas_table.c.owner).exists().label("quotas"),
).where(w.name == bindparam("worker"))
_HELD_GPUS = select(_HERE.c.gpus)


@dataclass
class WorkerBooks:
    capacity: Capacity
    oldest_queued: datetime | str | None
    gangs_queued: bool
    # Whether any quota is set: with none, a start changes no quota flag, and the claim
    # skips their refresh (a round trip). A quota set while the claim runs refreshes every
    # owner's flags as it commits, not counting a start not yet committed: as when the
    # refresh ran and did not see that quota yet.
    quotas_set: bool
    # It left (POST /workers/leave) and has not registered since: it is handed nothing.
    left: bool = False


def of_worker(conn: Connection, worker: str) -> WorkerBooks | None:
    """One worker's books, or None if it never registered."""
    row = conn.execute(_WORKER_BOOKS, {"worker": worker}).first()
    if row is None:
        return None
    cpu_slots, gpus, checkpoint_root, cluster, left_at, used_cpu, oldest, gangs, quotas = row
    held: set[int] = set()
    if gpus:  # a CPU-only worker holds no GPUs: skip the query on the hot path
        for (taken,) in conn.execute(_HELD_GPUS, {"worker": worker}):
            held.update(taken or ())
    free_cpu, free_gpus = _free(cpu_slots, gpus, int(used_cpu), held)
    capacity = Capacity(
        worker, cpu_slots, list(gpus), free_cpu, free_gpus, True, checkpoint_root, cluster
    )
    return WorkerBooks(capacity, oldest, bool(gangs), bool(quotas), left_at is not None)


# ---- every worker ----------------------------------------------------------------------

_ALL = holdings(False)
_USED_CPU = select(_ALL.c.worker, func.sum(_ALL.c.cpu)).group_by(_ALL.c.worker)
_HELD = select(_ALL.c.worker, _ALL.c.gpus)


def live_count(db: Database, lease_s: float) -> int:
    """How many workers heartbeat within the lease (service.pace sets the fleet's
    heartbeat interval from it)."""
    cutoff = utcnow() - timedelta(seconds=lease_s)
    with db.read() as s:
        return int(s.scalar(select(func.count()).where(w.last_heartbeat >= cutoff)) or 0)


def capacities(s: Session, lease_s: float) -> list[Capacity]:
    """Every worker's slots and what of them is free; live if it heartbeat within the lease
    and has not left."""
    conn = s.connection()
    cutoff = utcnow() - timedelta(seconds=lease_s)
    # Live decided in SQL: turning every worker's last heartbeat into a datetime cost a
    # tenth of the API's time with 500 hosts (this runs for every queued job's reason).
    rows = conn.execute(
        select(
            w.name,
            w.cpu_slots,
            w.gpus,
            live_worker(cutoff).label("live"),
            w.checkpoint_root,
            w.cluster,
        )
    ).all()
    if not rows:
        return []
    used_cpu = {name: int(n or 0) for name, n in conn.execute(_USED_CPU) if name is not None}
    held: dict[str, set[int]] = {}
    if any(r.gpus for r in rows):
        for name, gpus in conn.execute(_HELD):
            if name is not None and gpus:
                held.setdefault(name, set()).update(gpus)
    out = []
    nothing: set[int] = set()
    for r in rows:
        free_cpu, free_gpus = _free(
            r.cpu_slots, r.gpus, used_cpu.get(r.name, 0), held.get(r.name, nothing)
        )
        live = bool(r.live)
        out.append(
            Capacity(
                r.name,
                r.cpu_slots,
                list(r.gpus),
                free_cpu,
                free_gpus,
                live,
                r.checkpoint_root,
                r.cluster,
            )
        )
    return out


# ---- a summary of every worker, for the reasons -----------------------------------------


@dataclass
class Shape:
    """``count`` workers alike in all the reasons read of one: its CPU slots and GPUs,
    how many of each are free, whether it is live. A bridge is a shape of its own, by
    name (the reasons name it), with its partition."""

    count: int
    cpu_slots: int
    gpus: int
    free_cpu: int
    free_gpus: int
    live: bool
    name: str | None = None
    partition: Partition | None = None


def _order(shapes: list[Shape]) -> list[Shape]:
    """One order for the summary and the per-worker view, as the reasons pick the first
    of several that fit (a bridge, the unit a gang's words name): bridges by name, then
    the workers with the most GPUs and slots."""
    return sorted(
        shapes,
        key=lambda c: (c.name is None, c.name or "", -c.gpus, -c.cpu_slots, -c.free_gpus,
                       -c.free_cpu, not c.live),
    )  # fmt: skip


def shapes(caps: list[Capacity]) -> list[Shape]:
    """The per-worker view as shapes: one per worker (what ``summary`` groups)."""
    return _order(
        [
            Shape(
                1,
                c.cpu_slots,
                len(c.gpus),
                c.free_cpu,
                len(c.free_gpus),
                c.live,
                c.name if c.partition is not None else None,
                c.partition,
            )
            for c in caps
        ]
    )


def _length(dialect: str, array: Any) -> Any:
    """The length of a JSON array column. A job's ``gpus`` may be the JSON ``null``
    (the column keeps Python None so), whose length Postgres refuses: it counts as
    none (SQLite's json_array_length says 0 of it)."""
    if dialect == "postgresql":
        return case((func.json_typeof(array) == "array", func.json_array_length(array)))
    return func.json_array_length(array)


@functools.cache
def _summary_statement(dialect: str, with_books: bool) -> Any:
    """One row per shape of plain workers (with its count) and one per bridge, all
    decided in SQL: what crosses into Python grows with the kinds of workers, not
    with the workers or the jobs they run. Without ``with_books``, only their
    totals: no holdings read, free and live left 0 and false."""
    n_gpus = func.json_array_length(w.gpus, type_=Integer)
    if with_books:
        # One pass over what holds slots, per worker: the CPU slots and the GPUs held.
        # The GPUs are counted, not gathered as a set (capacities' lists): the claim
        # hands out only GPUs the books have free, so none is held twice on a worker,
        # and a count is all a reason reads. (Testing each held GPU against the
        # worker's own list in SQL, for a worker that registered again with other GPUs
        # while its old jobs still hold theirs, cost twice this pass on SQLite and ten
        # times on Postgres: such a worker shows fewer free here until those end.)
        held = (
            select(
                _ALL.c.worker,
                func.sum(_ALL.c.cpu).label("cpu"),
                func.sum(_length(dialect, _ALL.c.gpus)).label("gpus"),
            )
            .group_by(_ALL.c.worker)
            .subquery("held")
        )
        used_cpu = func.coalesce(held.c.cpu, 0)
        free_cpu: Any = case((w.cpu_slots > used_cpu, w.cpu_slots - used_cpu), else_=0)
        held_gpus = func.coalesce(held.c.gpus, 0)
        free_gpus: Any = case((n_gpus > held_gpus, n_gpus - held_gpus), else_=0)
        live: Any = live_worker(bindparam("cutoff"))
        source: Any = workers.outerjoin(held, held.c.worker == w.name)
    else:
        free_cpu = free_gpus = literal_column("0", Integer)
        live = false()
        source = workers
    per = (
        select(
            w.name,
            w.cluster,
            w.cpu_slots,
            n_gpus.label("gpus"),
            free_cpu.label("free_cpu"),
            free_gpus.label("free_gpus"),
            live.label("live"),
        )
        .select_from(source)
        .cte("per_worker")
    )
    kind = (per.c.cpu_slots, per.c.gpus, per.c.free_cpu, per.c.free_gpus, per.c.live)
    bridges = select(literal_column("1", Integer), *kind, per.c.name, per.c.cluster).where(
        per.c.cluster.is_not(None)
    )
    plain = (
        select(func.count(), *kind, null(), null()).where(per.c.cluster.is_(None)).group_by(*kind)
    )
    # The bridges first: the union's columns take their types (the cluster's JSON).
    return union_all(bridges, plain)


def _shapes_of(s: Session, with_books: bool, params: dict[str, Any]) -> list[Shape]:
    conn = s.connection()
    rows = conn.execute(_summary_statement(conn.dialect.name, with_books), params)
    return _order(
        [
            Shape(int(n), cpu, int(gpus), int(free_cpu), int(free_gpus), bool(live),
                  name, _partition(cluster))
            for n, cpu, gpus, free_cpu, free_gpus, live, name, cluster in rows
        ]
    )  # fmt: skip


def summary(s: Session, lease_s: float) -> list[Shape]:
    """Every worker's books as the reasons read them: the same as ``shapes(capacities())``
    but for the order of workers of one shape, grouped in SQL."""
    return _shapes_of(s, True, {"cutoff": utcnow() - timedelta(seconds=lease_s)})


def totals(s: Session) -> list[Shape]:
    """Every worker's slots and GPUs and every bridge's partition, grouped: what could
    ever run where (no holdings are read; free and live are 0 and false)."""
    return _shapes_of(s, False, {})


def overview(db: Database) -> list[dict[str, Any]]:
    """Each worker: its slots, what is free, what runs on it, its last heartbeat, when it
    left (if it did)."""
    with db.read() as s:
        caps = {c.name: c for c in capacities(s, db.policy.lease_s)}
        running: dict[str, list[dict[str, Any]]] = {}
        single = (
            select(j.id, j.name, j.status, j.attempt, j.nproc_per_node, j.gpus, j.worker, j.owner)
            .where(is_active(j.status, SQL), j.nnodes == 1)
            .order_by(j.id)
        )
        # A multi-node job shows on every worker holding one of its node slots.
        node_slots = (
            select(
                j.id, j.name, j.status, jn.attempt, j.nproc_per_node, jn.gpus, jn.worker, j.owner
            )
            .where(NODE_LIVE)
            .order_by(j.id, jn.node_rank)
        )
        for r in itertools.chain(s.execute(single), s.execute(node_slots)):
            running.setdefault(r.worker or "", []).append(
                {
                    "job_id": r.id,
                    "name": r.name,
                    "status": r.status,
                    "attempt": r.attempt,
                    "nproc_per_node": r.nproc_per_node,
                    "gpus": r.gpus or [],
                    "owner": r.owner,
                }
            )
        rows = s.execute(
            select(
                w.name,
                w.hostname,
                w.gpus,
                w.cpu_slots,
                w.last_heartbeat,
                w.registered_at,
                w.left_at,
                w.gpu_devices,
            )
            .select_from(workers)
            .order_by(w.name)
        )
        return [
            {
                "name": r.name,
                "hostname": r.hostname,
                "cpu_slots": r.cpu_slots,
                "gpus": r.gpus,
                "free_cpu_slots": caps[r.name].free_cpu,
                "free_gpus": caps[r.name].free_gpus,
                "alive": caps[r.name].live,
                "cluster": caps[r.name].cluster,
                "last_heartbeat": r.last_heartbeat,
                "registered_at": r.registered_at,
                "left_at": r.left_at,
                "running": running.get(r.name, []),
                # As registered (service.gpus adds each one's holder and use).
                "gpu_devices": r.gpu_devices or [],
            }
            for r in rows
        ]
