"""The migrations produce exactly the models' schema, on SQLite and on Postgres."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from service.db import upgrade
from service.models import Base


def test_migrations_match_models(db_url: str) -> None:
    upgrade(db_url)  # a no-op on the Postgres template clone; creates the SQLite file
    engine = create_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(
            MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
        )
    engine.dispose()
    assert diff == []
