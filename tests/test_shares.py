"""Fair share's share column is rewritten only once a usage has grown past it by
SHARE_STEP: an owner's queued jobs are not rewritten at every count and every end (at
5,000 hosts that rewrote hundreds of rows per finish), and a share is never further
behind its owner's usage than that. Cheap: no server; the service's functions on both
databases.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select, update

from service import jobs, queue
from service.db import Database
from service.models import Attempt, FairshareEpoch, Job, JobStatus, UserUsage, utcnow
from service.queue import shares
from service.queue.rules import as_utc
from service.schemas import JobSpec

QUEUED = 3


def _state(db: Database) -> tuple[float, float | None, set[float]]:
    """Alice's usage, the share recorded as her queued jobs', and theirs."""
    with db.read() as s:
        usage, shared = s.execute(
            select(UserUsage.usage, UserUsage.shared).where(UserUsage.owner == "alice")
        ).one()
        carried = s.scalars(
            select(Job.share).where(Job.owner == "alice", Job.status == JobStatus.QUEUED)
        ).all()
    return usage, shared, set(carried)


def _one_running(db: Database, queued: int = 0) -> tuple[int, datetime]:
    """One job of Alice's running on a 1-slot worker, ``queued`` more behind it: its id
    and when it started."""
    queue.register_worker(db, "w", None, "host", 1, [], "/c")
    spec = JobSpec(entrypoint="x.py", device="cpu")
    jobs.submit_job(db, spec, None, owner="alice", admin=True)
    claim = queue.claim_next_job(db, "w", 1, [], "0" * 64)
    assert claim is not None
    for _ in range(queued):
        jobs.submit_job(db, spec, None, owner="alice", admin=True)
    with db.read() as s:
        started = s.scalars(select(Job.started_at).where(Job.id == claim.job_id)).one()
    return claim.job_id, started


def test_a_share_is_rewritten_only_once_usage_grows_past_it_by_a_step(db: Database) -> None:
    _, started = _one_running(db, QUEUED)

    def count(after_s: float) -> tuple[float, float | None, set[float]]:
        with db.write() as s:
            queue.count_running(s, started + timedelta(seconds=after_s))
        return _state(db)

    # The first use: from a share of 0, every queued job carries it.
    usage, shared, carried = count(100)
    assert usage > 0 and shared == usage and carried == {usage}
    # Half a step more: counted, and the queued jobs are left as they are.
    grown, still, carried = count(100 * (1 + shares.SHARE_STEP / 2))
    assert grown > usage and still == usage and carried == {usage}
    # Past a step: every queued job carries the usage now.
    grown, shared, carried = count(100 * (1 + 2 * shares.SHARE_STEP))
    assert grown > usage * (1 + shares.SHARE_STEP) and shared == grown and carried == {grown}

    # A rebase scales the recorded share with the usage and the jobs', in step.
    due = timedelta(seconds=db.policy.fairshare_half_life_s * shares.REBASE_AFTER)
    with db.write() as s:
        s.execute(update(FairshareEpoch).values(t0=utcnow() - due - timedelta(seconds=1)))
    with db.write() as s:
        assert shares.rebase(s, utcnow())
    usage, shared, carried = _state(db)
    assert shared is not None and shared < grown and carried == {shared}


def test_the_sweep_counts_each_running_attempt_once_per_its_period(db: Database) -> None:
    """count_running's ``every_s``: an attempt counted (or started) less than that long
    ago is left for a later sweep, so a large fleet's sweep rewrites a bounded number of
    attempt rows a second (shares.COUNTS_PER_S); none of its use is lost, only counted
    later."""
    job_id, started = _one_running(db)

    def count(after_s: float, every_s: float) -> int:
        with db.write() as s:
            return queue.count_running(s, started + timedelta(seconds=after_s), every_s)

    assert count(10, every_s=60) == 0  # started 10 s before: not due
    assert count(70, every_s=60) == 1  # 70 s of use, counted
    assert count(100, every_s=60) == 0  # counted 30 s before
    assert count(100, every_s=0) == 1  # every sweep: the 30 s since
    with db.read() as s:  # every second up to the last count, once
        until = s.scalars(select(Attempt.counted_until).where(Attempt.job_id == job_id))
        assert as_utc(until.one()) == as_utc(started) + timedelta(seconds=100)
