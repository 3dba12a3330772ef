"""The migrations produce exactly the models' schema, on SQLite and on Postgres, and
move the data they promise to."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, insert, select, text, update
from sqlalchemy.orm import Session

import service.deptables
import service.rolluptables
import service.sweeptables  # noqa: F401  (the sweeps' tables are Base's too)
from service.db import alembic_config, upgrade
from service.models import Base, Job, MetricPoint
from service.rolluptables import UsageMonth

# Made by migration 0026 only where Postgres has pg_trgm, so no model declares it
# (tests/test_name_search.py checks it instead).
NOT_IN_MODELS = {"ix_jobs_name_search"}


def _in_models(obj: Any, name: str | None, kind: str, reflected: bool, other: Any) -> bool:
    return not (kind == "index" and reflected and name in NOT_IN_MODELS)


def test_migrations_match_models(db_url: str) -> None:
    upgrade(db_url)  # a no-op on the copy of a migrated template (conftest.db_url)
    engine = create_engine(db_url)
    with engine.connect() as conn:
        opts = {"compare_type": True, "include_object": _in_models}
        diff = compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
    engine.dispose()
    assert diff == []


def test_total_steps_moves_from_a_series_to_the_job(db_url: str) -> None:
    upgrade(db_url)
    engine = create_engine(db_url)
    with Session(engine) as s, s.begin():
        jobs = [
            Job(status="running", spec={}, nproc_per_node=1, device="cpu", max_attempts=1)
            for _ in range(3)
        ]
        s.add_all(jobs)
        s.flush()
        ids = [j.id for j in jobs]
    command.downgrade(alembic_config(db_url), "0008")  # as a database of before it was
    now = datetime.now(UTC)

    def point(job_id: int, name: str, step: int, value: float | None) -> dict[str, object]:
        return dict(job_id=job_id, name=name, step=step, value=value, attempt=1, time=now, seq=1)

    latest = {"step": 5, "epoch": None, "values": {"loss": 0.5, "total_steps": 120.0}}
    with engine.begin() as conn:
        conn.execute(
            insert(MetricPoint),
            [
                # Sent twice; the newest is the job's, as a whole number.
                point(ids[0], "total_steps", 1, 100.0),
                point(ids[0], "total_steps", 5, 120.0),
                point(ids[0], "loss", 1, 2.0),
                point(ids[0], "loss", 5, 0.5),
                # A total that cannot be one (NaN) is not kept.
                point(ids[1], "total_steps", 1, None),
                point(ids[1], "loss", 1, 1.0),
            ],
        )
        conn.execute(update(Job).where(Job.id == ids[0]).values(latest_metrics=latest))
    upgrade(db_url)
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(Job.id, Job.total_steps, Job.latest_metrics))}
        names = conn.execute(select(MetricPoint.job_id, MetricPoint.name, MetricPoint.step))
        left = sorted(tuple(r) for r in names)
    engine.dispose()
    assert rows[ids[0]].total_steps == 120
    assert rows[ids[0]].latest_metrics == {"step": 5, "epoch": None, "values": {"loss": 0.5}}
    assert rows[ids[1]].total_steps is None and rows[ids[2]].total_steps is None
    assert rows[ids[2]].latest_metrics is None
    assert left == [(ids[0], "loss", 1), (ids[0], "loss", 5), (ids[1], "loss", 1)]


def test_the_months_of_the_rollup_are_the_sums_of_its_days(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Migration 0039 fills usage_months from usage_days: each owner's month is the sum of
    its days of UTC, whatever the database's time zone."""
    upgrade(db_url)
    command.downgrade(alembic_config(db_url), "0038")
    engine = create_engine(db_url)
    days = [
        (datetime(2026, 1, 31, tzinfo=UTC), "alice", 10.0, 1),
        (datetime(2026, 2, 1, tzinfo=UTC), "alice", 20.0, 2),
        (datetime(2026, 2, 28, tzinfo=UTC), "alice", 30.0, 3),
        (datetime(2026, 2, 3, tzinfo=UTC), "", 5.0, 1),
    ]
    with engine.begin() as conn:
        for day, owner, gpu_s, made in days:
            conn.execute(
                text(
                    "INSERT INTO usage_days (day, owner, seconds, gpu_s, cpu_s, started,"
                    " started_preempted, jobs_made) VALUES (:d, :o, 1, :g, 0, 1, 0, :m)"
                ),
                {"d": day if engine.dialect.name == "postgresql" else day.replace(tzinfo=None),
                 "o": owner, "g": gpu_s, "m": made},
            )  # fmt: skip
    # The migration's session in a zone where midnight UTC is the day before (libpq's PGTZ).
    monkeypatch.setenv("PGTZ", "America/Los_Angeles")
    upgrade(db_url)
    with Session(engine) as s:
        months = s.scalars(select(UsageMonth))
        got = {(m.month, m.owner): (m.seconds, m.gpu_s, m.jobs_made) for m in months}
    engine.dispose()
    jan, feb = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 2, 1, tzinfo=UTC)
    assert got == {
        (jan, "alice"): (1.0, 10.0, 1),
        (feb, "alice"): (2.0, 50.0, 5),
        (feb, ""): (1.0, 5.0, 1),
    }
