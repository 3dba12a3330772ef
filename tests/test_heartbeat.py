"""A worker's heartbeat as the queue records it (service.queue.leases.record_heartbeat),
and the soonest lease the sweeper waits for (service.queue.lost.lease_due),
in process on both databases: it renews the worker's row only while the name is this
process's (NameTaken once another took it over, UnknownWorker for a name never
registered), whether the host is idle or runs attempts; and on Postgres an idle host's
is one statement, a non-durable transaction of its own (Database.write_one)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, select, update

from service import jobs
from service.db import Database
from service.errors import UnknownWorker
from service.models import Attempt, Worker, utcnow
from service.queue import (
    NameTaken,
    claim_next_job,
    expire_leases,
    lease_due,
    record_heartbeat,
    register_worker,
)
from service.queue.rules import as_utc
from service.schemas import JobSpec

MINE, THEIRS = "a" * 32, "b" * 32


def _register(db: Database, identity: str | None, host: str) -> None:
    register_worker(db, "w", identity, host, 2, [], "/ckpt")


def _silence(db: Database, seconds: float) -> datetime:
    """Set back the worker's last heartbeat by ``seconds``; the time it now says."""
    then = utcnow() - timedelta(seconds=seconds)
    with db.write() as s:
        s.execute(update(Worker).where(Worker.name == "w").values(last_heartbeat=then))
    return then


def _last(db: Database) -> datetime:
    with db.read() as s:
        return as_utc(s.scalar(select(Worker.last_heartbeat).where(Worker.name == "w")))


@pytest.mark.parametrize("identity", [MINE, None])
def test_a_heartbeat_renews_its_workers_row(db: Database, identity: str | None) -> None:
    _register(db, identity, "host-a")
    then = _silence(db, 10)
    assert record_heartbeat(db, "w", [], identity) == ([], [], [])
    assert _last(db) > then
    # A heartbeat naming attempts the worker no longer runs: renewed, and told to stop.
    then = _silence(db, 10)
    assert record_heartbeat(db, "w", [(12345, 1)], identity) == ([], [(12345, 1)], [])
    assert _last(db) > then


def test_a_name_taken_over_is_refused_idle_or_running(db: Database) -> None:
    _register(db, MINE, "host-a")
    _silence(db, 2 * db.policy.lease_s)
    _register(db, THEIRS, "host-b")  # silent for a lease: the name is free for another
    theirs = _silence(db, 10)
    for running in ([], [(12345, 1)]):
        with pytest.raises(NameTaken, match="taken over by another process \\(host host-b\\)"):
            record_heartbeat(db, "w", running, MINE)
        assert _last(db) == theirs  # the refused heartbeat touched nothing
    assert record_heartbeat(db, "w", [], THEIRS) == ([], [], [])
    assert _last(db) > theirs


def test_an_unknown_worker_is_told_to_register(db: Database) -> None:
    for running in ([], [(12345, 1)]):
        for identity in (MINE, None):
            with pytest.raises(UnknownWorker, match="worker nobody is not registered"):
                record_heartbeat(db, "nobody", running, identity)


def test_an_idle_heartbeat_is_one_non_durable_statement_on_postgres(pg_url: str) -> None:
    db = Database(pg_url)
    try:
        _register(db, MINE, "host-a")
        sent: list[tuple[str, bool]] = []
        used: list[Any] = []

        def seen(conn: Any, _cur: Any, statement: str, *_: Any) -> None:
            used.append(conn.connection.dbapi_connection)
            sent.append((statement, used[-1].autocommit))

        event.listen(db.engine, "before_cursor_execute", seen)
        record_heartbeat(db, "w", [], MINE)
        # One statement on an autocommit connection: no BEGIN, no SET LOCAL, no COMMIT.
        [(statement, autocommit)] = sent
        assert autocommit and statement.startswith("UPDATE workers"), sent
        assert "set_config('synchronous_commit', 'off', true)" in statement
        # A heartbeat with attempts: one transaction, the setting in its first statement.
        sent.clear()
        record_heartbeat(db, "w", [(12345, 1)], MINE)
        assert "set_config('synchronous_commit', 'off', true)" in sent[0][0]
        assert not any(autocommit for _, autocommit in sent), sent
        assert not any("SET LOCAL" in statement for statement, _ in sent), sent
        # Local to the transaction it ran in: the connections are durable again after.
        for raw in set(used):
            assert raw.execute("SHOW synchronous_commit").fetchone() == ("on",)
            raw.rollback()
    finally:
        db.dispose()


def test_the_sweeper_knows_when_the_soonest_lease_runs_out(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """queue.lease_due: what the sweeper sleeps until (service.sweeper), so a host that
    stops is lost as its lease ends, not a round later; heartbeats move it later, and an
    attempt lost at it is no longer counted."""
    lease = db.policy.lease_s
    _register(db, None, "host-a")
    assert lease_due(db, lease) is None  # nothing held: nothing to look at
    for name in ("a.py", "b.py"):
        spec = JobSpec(entrypoint=name, device="cpu")
        jobs.submit_job(db, spec, None, owner="alice", admin=True)
    first = claim_next_job(db, "w", 2, [], "1" * 64)
    second = claim_next_job(db, "w", 2, [], "2" * 64)
    assert first is not None and second is not None
    due = lease_due(db, lease)
    assert due is not None and lease - 5 < due <= lease
    with db.write() as s:  # the first attempt silent for a lease less 10 s, the other 1 s
        for claim, silent in ((first, lease - 10), (second, 1.0)):
            s.execute(
                update(Attempt)
                .where(Attempt.job_id == claim.job_id, Attempt.number == claim.attempt)
                .values(heartbeat_at=utcnow() - timedelta(seconds=silent))
            )
    due = lease_due(db, lease)
    assert due is not None and 5 < due <= 10
    record_heartbeat(db, "w", [(first.job_id, first.attempt), (second.job_id, second.attempt)])
    due = lease_due(db, lease)
    assert due is not None and lease - 5 < due <= lease  # renewed: later
    with db.write() as s:
        s.execute(
            update(Attempt)
            .where(Attempt.job_id == first.job_id)
            .values(heartbeat_at=utcnow() - timedelta(seconds=lease + 1))
        )
    assert lease_due(db, lease) <= 0  # type: ignore[operator]
    # As an API's that has reached the database for a lease already (service.db.Health).
    monkeypatch.setattr(db.health, "up_for", lambda seconds: True)
    assert expire_leases(db, lease) == [first.job_id]
    due = lease_due(db, lease)  # the lost attempt's lease counts no more
    assert due is not None and lease - 5 < due <= lease
