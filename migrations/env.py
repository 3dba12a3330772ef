"""Alembic environment: runs migrations against the URL ddpq gives it."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool, text

import service.deptables
import service.rolluptables
import service.sweeptables  # noqa: F401  (its tables are Base's too)
from service.models import Base

config = context.config
target_metadata = Base.metadata
# Several `ddpq serve` processes may start together on one Postgres; this lock
# makes them migrate one after another.
PG_MIGRATION_LOCK = 0x64647071  # "ddpq"


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        is_pg = connection.dialect.name == "postgresql"
        if is_pg:
            connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": PG_MIGRATION_LOCK})
            connection.commit()
        try:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=connection.dialect.name == "sqlite",
                compare_type=True,
            )
            with context.begin_transaction():
                context.run_migrations()
        finally:
            if is_pg:
                connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": PG_MIGRATION_LOCK})
                connection.commit()
    engine.dispose()


run_migrations_online()
