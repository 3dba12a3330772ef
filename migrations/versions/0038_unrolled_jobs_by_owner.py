"""Accounting's count of the jobs not yet in its rollup, by owner

``ix_jobs_unrolled_owner``: the jobs the rollup has not added (queued, running, ended
since its last round), by owner, with when each was submitted and ended, so that a
window's totals count them from the index alone (service.rollup): with 10,000 jobs queued
GET /accounting read and sorted them all on each request, and one user's a range of
every job that ended in the window.

Revision ID: 0038
Revises: 0037
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0038"
down_revision: str | None = "0037"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    due = sa.text("rolled = false") if op.get_bind().dialect.name == "postgresql" else None
    due = due if due is not None else sa.text("rolled = 0")
    op.create_index(
        "ix_jobs_unrolled_owner",
        "jobs",
        ["owner", "created_at", "finished_at"],
        postgresql_where=due,
        sqlite_where=due,
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_unrolled_owner", table_name="jobs")
