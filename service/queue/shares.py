"""Fair share: who used the hosts lately, and the order it gives jobs of one priority.

A user's usage is what their attempts held, for how long, in GPU-equivalent seconds (a
GPU for a second counts 1; a CPU slot, ``Policy.cpu_slot_weight``), decayed with a
half-life (``DDPQ_FAIRSHARE_HALF_LIFE_S``): what was used a half-life ago counts half,
as Slurm's fair-share factor does with PriorityDecayHalfLife.

Decay without rewriting: a use of ``a`` at time ``t`` is stored as ``a * 2^((t - t0) /
half_life)``, scaled to the epoch ``t0`` (fairshare_epoch). Every usage decays at the
same rate, so scaled usages compare as the decayed ones do, at any time: nothing is
decayed again, and a job's share (``jobs.share``, its owner's scaled usage when it was
set) stays comparable with every other. The usage now is the scaled one times
``2^-((now - t0) / half_life)``. Before the scale could overflow, the sweeper moves the
epoch to now and scales every usage and share down with it (``rebase``).

Each second of an attempt is counted once: the sweeper counts running attempts up to
now (``count_running``), an attempt's end counts the rest (``count_end``), each moving
``attempts.counted_until`` on in the transaction that adds to the usage, conditionally
on what it read, so two API processes never count a second twice.

A queued job carries its owner's usage as its share, set at its submission and
refreshed as that usage grows: among jobs of one priority the claim takes the least
used owner's first, then the oldest (rules.ORDER), and the index holds that order, so
fair share costs the claim nothing. Jobs of no one's (from before users existed) have a
share of 0. A refresh rewrites every queued job of the owner, so it is made only once
the usage has grown by ``SHARE_STEP`` past the share they carry (``user_usage.shared``),
not at every attempt's end and every count: as Slurm recomputes priorities each
PriorityCalcPeriod rather than at each job's end. A share is then at most that fraction
below its owner's usage, which only ever orders two owners within it of each other
differently. At 5,000 hosts, 20 users and a deep queue, a refresh at every end rewrote
hundreds of rows per finish and grew the jobs table by 556 MB per 1,000 jobs
(docs/benchmarks.md, "How it grows").
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, and_, bindparam, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.db import Database, Policy
from service.models import Attempt, FairshareEpoch, Job, JobStatus, UserUsage, utcnow
from service.queue.rules import SQL, as_utc, is_active, lock_owner, policy_of, postgres

usage_table = cast(Table, UserUsage.__table__)
epoch_table = cast(Table, FairshareEpoch.__table__)
REBASE_AFTER = 256  # half-lives since the epoch (2^256 is far from a float's limit)
# Running attempts' use is counted by the sweep (count_running), each attempt's row
# rewritten (counted_until) as it is: at most this many a second. At 5,000 hosts every
# 5-s sweep rewrote ~11,000 of them (13 MB of attempts per 1,000 jobs); at that size an
# attempt's use is now counted once a minute, as Slurm's PriorityCalcPeriod is minutes.
COUNTS_PER_S = 200
# How far a usage grows past the share its owner's queued jobs carry before they are
# rewritten. A first use always is (from 0); later ones at most every few per cent.
SHARE_STEP = 0.02


def held(device: str, gpus: list[int] | None, nproc: int, nnodes: int) -> tuple[int, int]:
    """What an attempt holds: (GPUs, CPU slots). Its GPUs are on its row (per node); a
    Slurm bridge's attempt has none there (Slurm holds them) and a cuda job's ranks
    are its GPUs."""
    if gpus:
        return len(gpus) * nnodes, 0
    if device == "cuda":
        return nproc * nnodes, 0
    return 0, nproc * nnodes


def units(device: str, gpus: list[int] | None, nproc: int, nnodes: int, policy: Policy) -> float:
    """What an attempt holds in GPUs: its GPUs, and its CPU slots at their weight."""
    g, cpu = held(device, gpus, nproc, nnodes)
    return g + cpu * policy.cpu_slot_weight


def _insert(s: Session) -> Any:
    return postgresql.insert if s.get_bind().dialect.name == "postgresql" else sqlite.insert


_T0 = select(epoch_table.c.t0).where(epoch_table.c.id == 1)
_T0_SHARED, _T0_ALONE = _T0.with_for_update(read=True), _T0.with_for_update()
# A submit's read of its owner's usage, with the epoch held (shared) in the same statement
# (quotas.usage_and_limits adds the owner's limits to it).
USAGE_OF = (
    select(
        epoch_table.c.t0,
        select(usage_table.c.usage)
        .where(usage_table.c.owner == bindparam("owner"))
        .scalar_subquery(),
    )
    .where(epoch_table.c.id == 1)
    .with_for_update(read=True, of=epoch_table)
)


def _epoch(s: Session, now: datetime, lock: bool = False) -> datetime:
    """The time usages are scaled to (made now, the first time). Read under a shared
    lock where usage is added, so that a rebase (an exclusive one) never runs between."""
    q = _T0_ALONE if lock else _T0_SHARED
    t0: datetime | None = s.execute(q).scalar()
    if t0 is None:  # the first time (another transaction making it at once: theirs holds)
        s.execute(_insert(s)(epoch_table).values(id=1, t0=now).on_conflict_do_nothing())
        t0 = s.execute(q).scalar_one()
    return t0


def _scale(at: datetime, t0: datetime, half_life_s: float) -> float:
    return math.pow(2.0, (at - t0).total_seconds() / half_life_s)


def usage_of(s: Session, owner: str | None, now: datetime) -> float:
    """``owner``'s scaled usage: what its queued jobs' share is (0 for none). In a write
    transaction: the epoch is held (shared) until it commits, as a rebase scales the
    shares of the jobs queued before it."""
    if owner is None:
        return 0.0
    row = s.execute(USAGE_OF, {"owner": owner}).first()
    if row is None:  # no epoch yet: nobody has used anything
        _epoch(s, now)
        return 0.0
    return float(row[1] or 0.0)


def _add(s: Session, owner: str, amount: float, now: datetime, t0: datetime | None = None
         ) -> tuple[float, float | None]:  # fmt: skip
    """Add a use of ``amount`` at ``now`` to ``owner``'s usage; the new scaled usage and
    the share their queued jobs carry (None: never written). One upsert that adds in
    the database: the row it changes stays locked until the transaction ends, so two
    transactions adding at once both count. ``t0``: the epoch, read (shared) by the
    caller already."""
    t0 = t0 or _epoch(s, now)
    scaled = amount * _scale(now, t0, policy_of(s).fairshare_half_life_s)
    ins = _insert(s)(usage_table).values(owner=owner, usage=scaled, updated_at=now)
    upsert = ins.on_conflict_do_update(
        index_elements=["owner"],
        set_={"usage": usage_table.c.usage + ins.excluded.usage, "updated_at": now},
    ).returning(usage_table.c.usage, usage_table.c.shared)
    usage, shared = s.execute(upsert).one()
    return float(usage), shared


_QUEUED = cast(Table, Job.__table__).alias("queued")


def _refresh(s: Session, owner: str, usage: float) -> None:
    """The share of ``owner``'s queued jobs: its scaled usage. Under the owner's lock
    (the caller's), so a row another transaction holds is one being claimed or
    cancelled: skipped, never waited for (service.queue.quotas says why)."""
    which: Any = and_(Job.owner == owner, Job.status == JobStatus.QUEUED)
    if postgres(s):
        q = _QUEUED.c
        which = Job.id.in_(
            select(q.id)
            .where(q.owner == owner, q.status == JobStatus.QUEUED)
            .with_for_update(skip_locked=True)
        )
    s.execute(update(Job).where(which).values(share=usage))


def _add_locked(s: Session, owner: str, amount: float, now: datetime) -> None:
    """Add a use to ``owner``'s usage and their queued jobs' share, under their lock,
    taken after the epoch (shared): a rebase holds the epoch while it rewrites every
    queued job's share, so one who waited for it holding an owner's lock could close a
    circle of waits through a claim."""
    t0 = _epoch(s, now)
    lock_owner(s, owner)
    usage, shared = _add(s, owner, amount, now, t0)
    if shared is None or usage > shared * (1 + SHARE_STEP):
        _refresh(s, owner, usage)
        s.execute(update(UserUsage).where(UserUsage.owner == owner).values(shared=usage))


def _count(s: Session, attempt_id: int, counted_until: datetime | None, started: datetime,
           now: datetime) -> float:  # fmt: skip
    """Move an attempt's counted_until on to now; the seconds this transaction counts.
    The update is conditional on what was read: if a sweep counted some meanwhile, what
    it left is read again and counted."""
    for _ in range(3):
        seconds = (now - (counted_until or started)).total_seconds()
        if seconds <= 0:
            return 0.0
        unchanged = (
            Attempt.counted_until.is_(None)
            if counted_until is None
            else Attempt.counted_until == counted_until
        )
        moved = s.execute(
            update(Attempt).where(Attempt.id == attempt_id, unchanged).values(counted_until=now)
        )
        if getattr(moved, "rowcount", 0) == 1:
            return seconds
        counted_until = s.execute(
            select(Attempt.counted_until).where(Attempt.id == attempt_id)
        ).scalar()
    return 0.0


def count_end(s: Session, job: Job, attempt: Attempt, now: datetime) -> bool:
    """An attempt ends (in the caller's transaction, before the job moves on, the job's
    row locked): count the rest of its use, and refresh its owner's queued jobs. Whether
    it took the owner's lock (it does when it counts anything). The attempt as loaded
    may be behind a sweep that counted since: ``_count`` reads it again then."""
    if job.owner is None:
        return False
    seconds = _count(s, attempt.id, attempt.counted_until, attempt.started_at, now)
    if not seconds:
        return False
    use = units(job.device, attempt.gpus, job.nproc_per_node, job.nnodes, policy_of(s))
    _add_locked(s, job.owner, use * seconds, now)
    return True


def sweep(db: Database) -> int:
    """Count running attempts' use, if there are any (nearly every sweep of an idle API
    looks and writes nothing), and move the epoch on when it is due; how many attempts
    it counted. Each attempt's use is counted once every ``running / COUNTS_PER_S``
    seconds (at most every sweep)."""
    running = (
        select(func.count())
        .select_from(Job)
        .where(Job.owner.is_not(None), is_active(Job.status, SQL))
    )
    due = select(FairshareEpoch.t0).where(
        FairshareEpoch.t0 < utcnow() - timedelta(seconds=REBASE_AFTER * _half_life(db))
    )
    with db.read() as s:
        n = s.execute(running).scalar_one()
        if not n and s.execute(due).first() is None:
            return 0
    # Two transactions: a rebase locks the epoch exclusively, and holding that while
    # count_running waits for an ending attempt's row (which waits for the epoch, shared,
    # to add its use) would deadlock.
    with db.write() as s:
        rebase(s, utcnow())
    with db.write() as s:
        return count_running(s, utcnow(), every_s=n / COUNTS_PER_S)


def _half_life(db: Database) -> float:
    return db.policy.fairshare_half_life_s


def rebase(s: Session, now: datetime) -> bool:
    """Move the epoch to now once it lies REBASE_AFTER half-lives back, scaling every
    usage and queued share down with it (their order stays); True if it moved. The
    epoch is locked exclusively only when a rebase is due: every sweep taking that lock
    would queue each ending attempt behind it."""
    half_life = policy_of(s).fairshare_half_life_s
    due = now - timedelta(seconds=REBASE_AFTER * half_life)
    if s.execute(select(FairshareEpoch.t0).where(FairshareEpoch.t0 < due)).first() is None:
        return False
    t0 = _epoch(s, now, lock=True)
    if (now - t0).total_seconds() < REBASE_AFTER * half_life:
        return False  # another API process moved it meanwhile
    factor = 1.0 / _scale(now, t0, half_life)
    s.execute(
        update(UserUsage).values(usage=UserUsage.usage * factor, shared=UserUsage.shared * factor)
    )
    s.execute(update(Job).where(Job.status == JobStatus.QUEUED).values(share=Job.share * factor))
    s.execute(update(FairshareEpoch).where(FairshareEpoch.id == 1).values(t0=now))
    return True


def count_running(s: Session, now: datetime, every_s: float = 0.0) -> int:
    """Count every running attempt's use up to now, of those last counted (or started)
    ``every_s`` or more before; how many attempts it counted."""
    policy = policy_of(s)
    since = now - timedelta(seconds=every_s)
    counted_before = or_(
        Attempt.counted_until <= since,
        and_(Attempt.counted_until.is_(None), Attempt.started_at <= since),
    )
    # Locked as read (Postgres): an attempt ending meanwhile counts what this leaves.
    rows = s.execute(
        select(
            Attempt.id, Attempt.counted_until, Attempt.started_at, Job.owner, Job.device,
            Attempt.gpus, Job.nproc_per_node, Job.nnodes,
        )
        .join(Job, and_(Job.id == Attempt.job_id, Job.attempt == Attempt.number))
        .where(
            Attempt.ended_at.is_(None),
            is_active(Job.status, SQL),
            Job.owner.is_not(None),
            counted_before,
        )
        # Job order, as every writer of several attempts locks them (heartbeats too:
        # leases._RENEW): in the attempts' own id order a sweep and a heartbeat deadlocked.
        .order_by(Attempt.job_id, Attempt.id)
        .with_for_update(of=Attempt)
    ).all()  # fmt: skip
    added: dict[str, float] = {}
    counted = []
    for r in rows:
        seconds = (now - (r.counted_until or r.started_at)).total_seconds()
        if seconds > 0 and r.owner is not None:
            counted.append(r.id)
            use = units(r.device, r.gpus, r.nproc_per_node, r.nnodes, policy)
            added[r.owner] = added.get(r.owner, 0.0) + use * seconds
    for part in range(0, len(counted), 500):  # one statement, not one per attempt
        ids = counted[part : part + 500]
        s.execute(update(Attempt).where(Attempt.id.in_(ids)).values(counted_until=now))
    for owner in sorted(added):  # one order of the owners' locks
        _add_locked(s, owner, added[owner], now)
    return len(counted)


def share_to_gpu_s(s: Session, now: datetime) -> float:
    """What a queued job's share is multiplied by to read as its owner's usage now, in
    GPU-equivalent seconds (decayed)."""
    t0 = s.execute(select(FairshareEpoch.t0).where(FairshareEpoch.id == 1)).scalar()
    return 1.0 if t0 is None else 1.0 / _scale(now, t0, policy_of(s).fairshare_half_life_s)


def usage_now(s: Session, now: datetime) -> tuple[float, dict[str, float]]:
    """``share_to_gpu_s`` and every user's fair-share usage now, in GPU-equivalent
    seconds (decayed), from one read of the epoch."""
    t0 = s.execute(select(FairshareEpoch.t0).where(FairshareEpoch.id == 1)).scalar()
    if t0 is None:
        return 1.0, {}
    down = 1.0 / _scale(now, t0, policy_of(s).fairshare_half_life_s)
    rows = s.execute(select(UserUsage.owner, UserUsage.usage))
    return down, {r.owner: r.usage * down for r in rows}


def decayed_usage(s: Session, now: datetime) -> dict[str, float]:
    """Every user's fair-share usage now, in GPU-equivalent seconds (decayed)."""
    return usage_now(s, now)[1]


WINDOWS = (("1d", timedelta(days=1)), ("7d", timedelta(days=7)))


def overview(s: Session, now: datetime) -> list[dict[str, Any]]:
    """Each user's running and queued jobs, GPU-hours and CPU-slot-hours over the last
    day and week (not decayed: what their attempts held, for how long), and the decayed
    usage fair share orders by; most used first."""
    since = now - WINDOWS[-1][1]
    attempts = s.execute(
        select(
            Job.owner, Job.device, Attempt.gpus, Job.nproc_per_node, Job.nnodes,
            Attempt.started_at, Attempt.ended_at,
        )
        .join(Job, Job.id == Attempt.job_id)
        .where(Job.owner.is_not(None), or_(Attempt.ended_at.is_(None), Attempt.ended_at > since))
    ).all()  # fmt: skip
    waiting_or_active = or_(Job.status == JobStatus.QUEUED, is_active(Job.status, SQL))
    counts = s.execute(
        select(Job.owner, Job.status, func.count())
        .where(Job.owner.is_not(None), waiting_or_active)
        .group_by(Job.owner, Job.status)
    ).all()
    people: dict[str, dict[str, Any]] = {}

    def person(name: str) -> dict[str, Any]:
        return people.setdefault(
            name,
            {"user": name, "running": 0, "queued": 0, "usage_gpu_s": 0.0}
            | {f"gpu_hours_{w}": 0.0 for w, _ in WINDOWS}
            | {f"cpu_slot_hours_{w}": 0.0 for w, _ in WINDOWS},
        )

    for owner, status, n in counts:
        if owner is not None:
            key = "queued" if status == JobStatus.QUEUED else "running"
            person(owner)[key] += int(n)
    for a in attempts:
        gpus, cpu = held(a.device, a.gpus, a.nproc_per_node, a.nnodes)
        for window, span in WINDOWS:
            start = max(as_utc(a.started_at), now - span)
            seconds = ((as_utc(a.ended_at) if a.ended_at else now) - start).total_seconds()
            if seconds > 0 and a.owner is not None:
                p = person(a.owner)
                p[f"gpu_hours_{window}"] += gpus * seconds / 3600
                p[f"cpu_slot_hours_{window}"] += cpu * seconds / 3600
    for name, usage in decayed_usage(s, now).items():
        person(name)["usage_gpu_s"] = usage
    return sorted(people.values(), key=lambda p: (-p["usage_gpu_s"], p["user"]))
