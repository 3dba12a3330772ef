"""What a submit and a claim send the database, in process on both databases: a submit
reads its owner's fair-share usage and quota limits in one statement, and the quota
flags are refreshed only where a limit can hold a job back (a submit: its owner has a
running or GPU limit; a claim: any quota is set). Each statement skipped is a round
trip off submit-to-running on Postgres (bench/claim.py --parts latency); the flags the
claim reads stay what the limits say."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event, select

from service import jobs, users
from service.db import Database
from service.models import Job, utcnow
from service.queue import claim_next_job, register_worker
from service.queue.quotas import limits, usage_and_limits
from service.schemas import JobSpec
from service.users import Principal

ADMIN = Principal("admin", "admin")
JOB = JobSpec(entrypoint="noop.py", device="cpu")


@contextmanager
def _sent(db: Database) -> Iterator[list[str]]:
    """The statements ``db`` sends inside the block."""
    sent: list[str] = []

    def seen(_conn: Any, _cur: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    event.listen(db.engine, "before_cursor_execute", seen)
    try:
        yield sent
    finally:
        event.remove(db.engine, "before_cursor_execute", seen)


def _refreshes(sent: list[str]) -> int:
    return sum("quota_limit" in s for s in sent)  # the flags' refresh (quotas.refresh)


def _held(db: Database, job_id: int) -> bool:
    with db.read() as s:
        return bool(s.scalar(select(Job.quota_running).where(Job.id == job_id)))


def test_a_submit_reads_usage_and_limits_at_once_and_refreshes_flags_only_under_a_limit(
    db: Database,
) -> None:
    jobs.submit_job(db, JOB, None, owner="alice")  # the fair-share epoch is made once
    with _sent(db) as sent:
        jobs.submit_job(db, JOB, None, owner="alice")
    assert sum("FROM quotas" in s for s in sent) == 1, sent
    assert sum("fairshare_epoch" in s for s in sent) == 1, sent
    assert _refreshes(sent) == 0, sent
    # A queued limit alone holds nothing back: still no refresh.
    users.set_quota(db, ADMIN, "alice", {"max_queued": 10})
    with _sent(db) as sent:
        jobs.submit_job(db, JOB, None, owner="alice")
    assert _refreshes(sent) == 0, sent
    # A running limit: the submit flags its job as it queues it.
    users.set_quota(db, ADMIN, "alice", {"max_running": 0})
    with _sent(db) as sent:
        held = jobs.submit_job(db, JOB, None, owner="alice")
    assert _refreshes(sent) == 1, sent
    assert _held(db, held.id)


def test_a_claim_refreshes_quota_flags_only_once_a_quota_is_set(db: Database) -> None:
    register_worker(db, "w", None, "host", 8, [], "/ckpt")
    first = jobs.submit_job(db, JOB, None, owner="alice")
    second = jobs.submit_job(db, JOB, None, owner="alice")
    with _sent(db) as sent:
        claimed = claim_next_job(db, "w", 8, [], "h" * 64)
    assert claimed is not None and claimed.job_id == first.id
    assert _refreshes(sent) == 0, sent
    # Everyone may run one job at once: alice's running one holds her queued one back...
    users.set_quota(db, ADMIN, "*", {"max_running": 1})
    assert _held(db, second.id)
    third = jobs.submit_job(db, JOB, None, owner="bob")
    with _sent(db) as sent:
        claimed = claim_next_job(db, "w", 8, [], "i" * 64)
    # ...so bob's starts, and the claim keeps bob's flags up to date.
    assert claimed is not None and claimed.job_id == third.id
    assert _refreshes(sent) == 1, sent
    fourth = jobs.submit_job(db, JOB, None, owner="bob")
    assert _held(db, fourth.id)
    assert claim_next_job(db, "w", 8, [], "j" * 64) is None


def test_an_owner_s_own_quota_wins_whole_over_everyone_s(db: Database) -> None:
    jobs.submit_job(db, JOB, None, owner="alice")  # the fair-share epoch
    users.set_quota(db, ADMIN, "*", {"max_running": 1, "max_queued": 5})
    users.set_quota(db, ADMIN, "alice", {"max_gpus": 2})  # her nulls win too
    for owner, expected in (
        ("alice", (2, None, None)),
        ("bob", (None, 1, 5)),
        (None, (None, None, None)),
    ):
        with db.write() as s:
            _, read = usage_and_limits(s, owner, utcnow())
            alone = limits(s, owner)
        assert read == alone, owner
        assert (alone.max_gpus, alone.max_running, alone.max_queued) == expected, owner
