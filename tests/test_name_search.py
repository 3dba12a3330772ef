"""The search by name (``GET /jobs?name=``) on Postgres: served by pg_trgm's trigram
index (migration 0026) instead of a walk of every job, planned for each pattern, and a
migration that still succeeds where the extension cannot be created. Its answers, on
both databases, are tests/test_api.py's test_list_filters_by_name_or_program_in_any_case."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from alembic import command
from sqlalchemy import event, text

from service import jobs
from service.db import Database, alembic_config, upgrade
from service.schemas import JobSpec
from tests.conftest import PG_ADMIN, _pg_url

INDEX = "ix_jobs_name_search"
JOBS = 20_000  # more than a page, and than one trigram can tell apart


def _fill(db: Database, rare: str) -> int:
    """JOBS jobs named run-N in SQL (as bench/history.py fills them), and one named
    ``rare`` through the API's own path; returns its id."""
    spec = JobSpec.model_validate({"entrypoint": "train.py", "device": "cpu"})
    job = jobs.submit_job(db, spec, None, owner="u")
    with db.write() as s:
        s.execute(text("UPDATE jobs SET name = :n WHERE id = :id"), {"n": rare, "id": job.id})
        s.execute(
            text(
                """INSERT INTO jobs (name, status, spec, priority, nnodes, nproc_per_node,
                    device, max_attempts, created_at, attempt, log_size, owner)
                SELECT 'run-' || g, 'succeeded', j.spec, 0, 1, 1, 'cpu', 3, now(), 1, 0, 'u'
                FROM generate_series(1, :n) g, jobs j WHERE j.id = :id"""
            ),
            {"n": JOBS, "id": job.id},
        )
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # VACUUM too: it moves the new rows from the GIN index's pending list (where
        # inserts go first, fastupdate) into the index proper, as autovacuum would.
        conn.execute(text("VACUUM ANALYZE jobs"))
    return job.id


def _names(db: Database, name: str) -> list[str | None]:
    return [j.name for j in jobs.list_jobs(db, [], 50, None, name=name)[0]]


def test_the_name_search_is_a_range_of_the_trigram_index(pg_url: str) -> None:
    db = Database(pg_url)
    try:
        rare = _fill(db, "Needle-Sweep")
        sent: list[tuple[str, Any]] = []

        def record(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
            if "ILIKE" in statement:
                sent.append((statement, params))

        event.listen(db.engine, "before_cursor_execute", record)
        page, _ = jobs.list_jobs(db, [], 50, None, name="needle-sw")
        event.remove(db.engine, "before_cursor_execute", record)
        assert [j.id for j in page] == [rare]
        # The very query list_jobs sent, as Postgres plans it (a table this small may
        # as well be read whole: bench/history.py's 200,000 jobs chose the index alone).
        (statement, params), *_ = sent
        with db.engine.connect() as conn:
            conn.exec_driver_sql("SET enable_seqscan = off")
            plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {statement}", params))
        assert INDEX in plan and "Bitmap Index Scan" in plan, plan
        assert plan.count(f"Bitmap Index Scan on {INDEX}") == 2, plan  # name and program

        # Asked again and again (psycopg prepares a query on its 5th run), each run is
        # planned for its pattern: a generic plan could not use the index at all. Even
        # where the server would always plan generically (Postgres picks one after five
        # runs when it costs no more than the custom ones did).
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            database = conn.exec_driver_sql("SELECT current_database()").scalar_one()
            conn.exec_driver_sql(
                f'ALTER DATABASE "{database}" SET plan_cache_mode = force_generic_plan'
            )
        db.engine.dispose()  # new connections, which take it
        for i in range(12):
            assert _names(db, "NEEDLE" if i % 2 else "run-1999") in (
                ["Needle-Sweep"],
                ["run-19999", "run-19998", "run-19997", "run-19996", "run-19995", "run-19994",
                 "run-19993", "run-19992", "run-19991", "run-19990", "run-1999"],
            )  # fmt: skip
        with db.read() as s:
            plans = s.execute(
                text(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                    "WHERE statement LIKE '%ILIKE%'"
                )
            ).all()
        assert plans, "the search was never prepared: this test no longer tests that"
        assert all(generic == 0 and custom > 0 for generic, custom in plans), plans
        # Shorter than a trigram: the index cannot narrow it, the answer is the same.
        assert _names(db, "le-") == ["Needle-Sweep"]
    finally:
        db.dispose()


@pytest.fixture
def unprivileged_url(pg_template: str) -> Iterator[str]:
    """An empty database, and a role that may create tables in it but not extensions
    (no CREATE on the database: pg_trgm is trusted, so that is what it takes)."""
    role = f"ddpq_r_{uuid.uuid4().hex[:10]}"
    name = f"ddpq_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
        conn.execute(f'CREATE DATABASE "{name}"')
    with psycopg.connect(f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}", autocommit=True) as conn:
        conn.execute(f'GRANT USAGE, CREATE ON SCHEMA public TO "{role}"')
    yield _pg_url(name).replace("://postgres@", f"://{role}@", 1)
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def _head() -> str:
    """The newest migration's revision."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return head


def _indexes(url: str) -> set[str]:
    db = Database(url)
    try:
        with db.read() as s:
            return set(s.scalars(text("SELECT indexname FROM pg_indexes")))
    finally:
        db.dispose()


def test_without_pg_trgm_the_migration_skips_the_index_and_says_why(
    unprivileged_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = unprivileged_url
    with caplog.at_level(logging.WARNING, logger="ddpq.migrations"):
        upgrade(url)
    assert "cannot create the pg_trgm extension" in caplog.text
    assert "permission denied" in caplog.text and f"CREATE INDEX {INDEX}" in caplog.text
    assert INDEX not in _indexes(url) and "ix_audit_events_at" in _indexes(url)
    db = Database(url)
    try:
        with db.read() as s:
            # Upgraded all the way, past the index it could not make.
            assert s.scalar(text("SELECT version_num FROM alembic_version")) == _head()
        rare = _fill(db, "needle")
        assert [j.id for j in jobs.list_jobs(db, [], 50, None, name="NEEDLE")[0]] == [rare]
    finally:
        db.dispose()

    # Once someone who may has created the extension, the migration makes the index;
    # going down drops it, and leaves the extension.
    admin_url = f"{PG_ADMIN.rsplit('/', 1)[0]}/{url.rsplit('/', 1)[1]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_trgm")
    command.downgrade(alembic_config(url), "0025")
    upgrade(url)
    assert INDEX in _indexes(url)
    command.downgrade(alembic_config(url), "0025")
    assert INDEX not in _indexes(url) and "ix_audit_events_at" not in _indexes(url)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        assert conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm'").fetchone()
