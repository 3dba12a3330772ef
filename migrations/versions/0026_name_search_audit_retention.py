"""A trigram index for the search by name (Postgres), and audit_events by time

``GET /jobs?name=x`` (service.jobs.list_jobs) filters by ``ILIKE '%x%'`` on two
expressions, the job's name and its program: no b-tree serves a substring, so Postgres
walked every job until it had a page (over 9 s for a rare name among a million jobs,
docs/benchmarks.md). A GIN index of pg_trgm's trigrams on both expressions answers it
from the index for patterns of 3 characters or more. Each expression below is written
exactly as the query's compiles (with its constants, which a custom plan folds in:
list_jobs asks for one), or the planner would not match it to the index.

pg_trgm ships with Postgres (contrib) and is a trusted extension since 13, so a
database owner may create it; where it is not installed on the server, or this role
may not create it, the index is skipped with a warning and the search works as before,
walking the jobs. The index is built in the migration's transaction, holding off
writes to jobs meanwhile (a few seconds per 100,000 jobs); then jobs is analysed, for
the expressions' statistics the planner weighs a pattern's matches with.

audit_events.at: the audit retention (service.retention, DDPQ_AUDIT_RETENTION) deletes
the rows older than a cutoff, oldest first, a range of this index.

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-28
"""

import logging
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("ddpq.migrations")

SEARCH_INDEX = "ix_jobs_name_search"
# service.jobs.list_jobs's two name= expressions as Postgres compiles them.
SEARCH_EXPRESSIONS = (
    "(coalesce(name, ''::varchar))",
    "(coalesce((spec ->> 'recipe')::varchar, (spec ->> 'entrypoint')::varchar, ''::varchar))",
)


def upgrade() -> None:
    op.create_index("ix_audit_events_at", "audit_events", ["at"])
    if op.get_bind().dialect.name == "postgresql":
        _search_index()


def _search_index() -> None:
    bind = op.get_bind()
    if (
        bind.execute(
            sa.text("SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm'")
        ).first()
        is None
    ):
        log.warning(
            "pg_trgm is not installed on this Postgres server (the contrib package): "
            "no trigram index, GET /jobs?name= walks the jobs"
        )
        return
    try:
        # A savepoint: a refused CREATE EXTENSION must not abort the migration's transaction.
        with bind.begin_nested():
            bind.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_trgm"))
    except sa.exc.DBAPIError as exc:
        log.warning(
            "cannot create the pg_trgm extension (%s): no trigram index, GET /jobs?name= "
            "walks the jobs. To add it later, as a role that may: CREATE EXTENSION pg_trgm; "
            "CREATE INDEX %s ON jobs USING gin (%s)",
            str(exc.orig).strip().splitlines()[0],
            SEARCH_INDEX,
            ", ".join(f"{e} gin_trgm_ops" for e in SEARCH_EXPRESSIONS),
        )
        return
    # The operator class where the extension lives, which need not be on the search path.
    schema = bind.execute(
        sa.text(
            "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace "
            "WHERE e.extname = 'pg_trgm'"
        )
    ).scalar_one()
    opclass = f"{bind.dialect.identifier_preparer.quote_identifier(schema)}.gin_trgm_ops"
    columns = ", ".join(f"{e} {opclass}" for e in SEARCH_EXPRESSIONS)
    bind.execute(sa.text(f"CREATE INDEX {SEARCH_INDEX} ON jobs USING gin ({columns})"))
    bind.execute(sa.text("ANALYZE jobs"))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # The extension stays: other databases' objects, or an operator's, may use it.
        op.execute(f"DROP INDEX IF EXISTS {SEARCH_INDEX}")
    op.drop_index("ix_audit_events_at", table_name="audit_events")
