"""The rules the claim, the books, the leases and the reasons share, each written once.

A rule that both SQL and Python must apply (does a job fit a worker, is a node slot
forming or live) is a function over its operands and a combinator: given columns
and ``and_``/``or_`` it builds the SQL predicate the claim runs; given values and
``all``/``any`` it decides one row in Python. So the reason a job shows and the
claim that takes it cannot drift apart.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, cast

from sqlalchemy import Table, and_, bindparam, false, or_, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from service.db import Policy, after_commit
from service.models import (
    ACTIVE,
    Attempt,
    Checkpoint,
    Job,
    JobNode,
    JobStatus,
    UTCDateTime,
    Worker,
)
from service.wakeup import EVERYONE, Wake

NOTIFY_CHANNEL = "ddpq_jobs"
RESUME_CANDIDATES = 5  # newest checkpoints offered; the worker takes the first on disk

# Core tables, not ORM entities: no ORM compile step on the claim's hot path.
jobs = cast(Table, Job.__table__)
j = jobs.c
nodes = cast(Table, JobNode.__table__)
jn = nodes.c
workers = cast(Table, Worker.__table__)
w = workers.c
attempts = cast(Table, Attempt.__table__)
checkpoints = cast(Table, Checkpoint.__table__)

# The claim order: priority desc; among equals, the job whose owner used the hosts least
# lately (its share: service.queue.shares, fair share), then the oldest.
ORDER = (j.priority.desc(), j.share, j.id)


def order_key(priority: int, share: float, job_id: int) -> tuple[int, float, int]:
    """A queued job's place in ORDER, in Python: smaller is sooner."""
    return (-priority, share, job_id)


def at_or_ahead(priority: Any, share: Any, job_id: Any) -> Any:
    """SQL: queued jobs at or ahead of the job (priority, share, id) in ORDER."""
    return or_(
        j.priority > priority,
        and_(j.priority == priority, or_(j.share < share, and_(j.share == share, j.id <= job_id))),
    )


DEVICES = ("cuda", "cpu", "auto")


@dataclass(frozen=True)
class Logic:
    """How a rule combines its terms: SQL expressions or Python truth values."""

    all_: Callable[..., Any]
    any_: Callable[..., Any]
    false: Any  # what a false flag equals


PY = Logic(lambda *terms: all(terms), lambda *terms: any(terms), False)
SQL = Logic(and_, or_, false())


# ---- quotas: may a job start, as far as its owner's limits go ---------------------------


def quota_lets(
    worker_has_gpus: bool, device: Any, at_running: Any, over_gpus: Any, logic: Logic = PY
) -> Any:
    """Whether its owner's limits let a queued job start on such a worker (the flags
    ``at_running``, ``over_gpus``: service.queue.quotas sets them): its owner is not at
    their running limit, and, where the job would take GPUs (any job but a CPU one, on a
    worker with GPUs: ``unit``), it does not take them past their GPUs. The claim runs it
    (``quota_free``); the preemption pass and the reasons decide a row by it, so none of
    them lets a job start that another holds back."""
    free = at_running == logic.false
    if worker_has_gpus:
        return logic.all_(free, logic.any_(device == "cpu", over_gpus == logic.false))
    return free


def quota_free(worker_has_gpus: bool) -> Any:
    """SQL: queued jobs their owner's limits let start on such a worker (``quota_lets``)."""
    return quota_lets(worker_has_gpus, j.device, j.quota_running, j.quota_gpus, SQL)


# ---- devices: what a job counts on a worker ------------------------------------------


def unit(device: str, worker_has_gpus: bool) -> str | None:
    """What a job of ``device`` counts on a worker: "gpu", "cpu", or None (it cannot
    run there). ``auto`` takes the GPUs of a worker that has any."""
    if device == "cuda":
        return "gpu" if worker_has_gpus else None
    if device == "cpu":
        return "cpu"
    return "gpu" if worker_has_gpus else "cpu"


def resolve(device: str, worker_has_gpus: bool) -> Literal["cpu", "cuda"]:
    """The device a claimed job runs on: the torch device its unit names."""
    return "cuda" if unit(device, worker_has_gpus) == "gpu" else "cpu"


def fits_bound(worker_has_gpus: bool, cpu: str, gpus: str) -> Any:
    """SQL: jobs whose ranks fit in the CPU slots bound as ``cpu`` or the GPUs bound as
    ``gpus`` of a worker with or without GPUs, by ``unit``."""
    bound: dict[str | None, Any] = {"cpu": bindparam(cpu), "gpu": bindparam(gpus)}
    terms = []
    for device in DEVICES:
        counted = unit(device, worker_has_gpus)
        if counted is not None:
            terms.append(and_(j.device == device, j.nproc_per_node <= bound[counted]))
    return or_(*terms)


def room_fits(device: str, nproc: int, has_gpus: bool, cpu: int, gpus: int) -> bool:
    """``fits_bound`` in Python: a node of ``nproc`` ranks of ``device`` fits ``cpu`` free
    CPU slots or ``gpus`` free GPUs of a worker with or without GPUs, by ``unit``."""
    counted = unit(device, has_gpus)
    if counted is None:
        return False
    return nproc <= (gpus if counted == "gpu" else cpu)


def fits_partition(
    nodes_have_gpus: bool,
    nnodes: Any,
    device: Any,
    nproc: Any,
    nodes: Any,
    node_cpus: Any,
    node_gpus: Any,
    logic: Logic = PY,
) -> Any:
    """A job fits a bridge's Slurm partition: no more nodes than it has, and each node's
    ranks within one node's GPUs or CPUs, by ``unit``. (Slurm, not ddpq, decides when.)"""
    terms = []
    for d in DEVICES:
        counted = unit(d, nodes_have_gpus)
        if counted is not None:
            bound = node_gpus if counted == "gpu" else node_cpus
            terms.append(logic.all_(device == d, nproc <= bound))
    return logic.all_(nnodes <= nodes, logic.any_(*terms))


# ---- job and node states ---------------------------------------------------------------


def is_active(status: Any, logic: Logic = PY) -> Any:
    """Running or cancelling: the job holds its slots. Equalities, not IN: an IN list
    is an "expanding" parameter, re-rendered on every execution."""
    return logic.any_(*(status == s for s in sorted(ACTIVE)))


def forming(status: Any, job_attempt: Any, number: Any, logic: Logic = PY) -> Any:
    """Attempt ``number`` is gathering its node slots: the job is queued, one behind."""
    return logic.all_(status == JobStatus.QUEUED, job_attempt + 1 == number)


def started(status: Any, job_attempt: Any, number: Any, logic: Logic = PY) -> Any:
    """Attempt ``number`` is the job's current one and runs (or is being cancelled)."""
    return logic.all_(is_active(status, logic), job_attempt == number)


# The node slots of the attempt a queued multi-node job is gathering.
FORMING = and_(jn.job_id == j.id, forming(j.status, j.attempt, jn.attempt, SQL))
# A node slot holds its worker's slots while its attempt forms or runs, until that
# node's worker reports its processes gone.
NODE_LIVE = and_(
    jn.job_id == j.id,
    jn.ended_at.is_(None),
    or_(
        forming(j.status, j.attempt, jn.attempt, SQL),
        started(j.status, j.attempt, jn.attempt, SQL),
    ),
)


def live_worker(since: Any) -> Any:
    """SQL: a worker that may take jobs: it heartbeat at or after ``since`` (a lease ago)
    and has not left (POST /workers/leave: a leaving worker heartbeats while its attempts
    stop, but takes nothing)."""
    return and_(w.last_heartbeat >= since, w.left_at.is_(None))


# A single-node job that may be claimed (a multi-node one is claimed by node slots).
QUEUED_SINGLE = and_(j.status == JobStatus.QUEUED, j.nnodes == 1)


def ready() -> Any:
    """SQL: queued jobs whose retry backoff, if any, is over at the bound ``now``, and
    that wait for no other job (service.queue.deps)."""
    return and_(
        or_(j.not_before.is_(None), j.not_before <= bindparam("now", type_=UTCDateTime)),
        j.waits_on == 0,
    )


# ---- small shared helpers --------------------------------------------------------------


def rowcount(result: Any) -> int:
    """Rows an UPDATE touched (Session.execute is typed as returning a plain Result)."""
    return int(result.rowcount)


_NOTIFY = text("SELECT pg_notify(:channel, :payload)")


def notify_claimers(s: Session | Connection, wake: Wake = EVERYONE) -> None:
    """Wake long-polling claimers (and gang waiters) once this transaction commits: this
    process's at the commit (``db.after_commit``), every other API process's through
    NOTIFY. ``wake``: for everyone, or only one worker's claims (service.wakeup)."""
    after_commit(wake)
    if postgres(s):
        s.execute(_NOTIFY, {"channel": NOTIFY_CHANNEL, "payload": wake.payload()})


def postgres(ex: Session | Connection) -> bool:
    bind = ex.get_bind() if isinstance(ex, Session) else ex
    return bind.dialect.name == "postgresql"


# The owner's lock (service.queue.quotas says who takes it and why): a transaction
# advisory lock of this class ("ddqu"), keyed by the owner's name, its crc32 (two names
# that share a key only wait for each other).
OWNER_LOCK_CLASS = 0x64647175
_OWNER_LOCK = text("SELECT pg_advisory_xact_lock(:lock_class, :lock_key)")


def owner_lock_key(owner: str) -> int:
    """The owner's lock's key: a signed 32-bit integer, as the advisory lock takes."""
    return int.from_bytes(zlib.crc32(owner.encode()).to_bytes(4, "big"), "big", signed=True)


def lock_owner(ex: Session | Connection, owner: str | None) -> None:
    """Hold ``owner``'s lock until the transaction ends; SQLite: nothing (its writers are
    serialised)."""
    if owner is not None and postgres(ex):
        ex.execute(_OWNER_LOCK, {"lock_class": OWNER_LOCK_CLASS, "lock_key": owner_lock_key(owner)})


def as_utc(value: datetime | str) -> datetime:
    """A scalar subquery's datetime comes back without the column's type processing."""
    if isinstance(value, str):  # SQLite hands back the stored text
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def checkpoint_dir_of(root: str, job_id: int) -> str:
    """Where a job's checkpoints go under a worker's checkpoint root."""
    return f"{root.rstrip('/')}/job-{job_id}"


# Only kept checkpoints: one chosen to go (service.checkpoints) may be deleted any moment.
_RESUME_FROM = (
    select(checkpoints.c.path)
    .where(checkpoints.c.job_id == bindparam("job_id"), checkpoints.c.state == "kept")
    .order_by(checkpoints.c.step.desc(), checkpoints.c.id.desc())
    .limit(RESUME_CANDIDATES)
)


def resume_key(step: int, checkpoint_id: int) -> tuple[int, int]:
    """_RESUME_FROM's order in Python: the checkpoint a resume takes first has the
    largest key (the one keep_last never lets go, service.checkpoints)."""
    return (step, checkpoint_id)


def resume_from(conn: Connection | Session, job_id: int, number: int) -> list[str]:
    """The checkpoints attempt ``number`` may resume from, newest first (a first
    attempt has none)."""
    if number <= 1:
        return []
    return list(conn.scalars(_RESUME_FROM, {"job_id": job_id}))


def policy_of(s: Session) -> Policy:
    """The service's policy, which Database puts on every session it opens."""
    policy: Policy = s.info.get("policy") or Policy()
    return policy
