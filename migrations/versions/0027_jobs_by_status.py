"""Jobs of one state, newest first

`GET /jobs?status=failed` (`ddpq ls --status`, the dashboard's filter) with no user
given: without an index on (status, id), SQLite, which keeps no statistics, read every
job of that state through (status, queued_at) and sorted them all to answer a page of
50 (0.5 s with 135,000 failed jobs of a million, bench/history.py --backend sqlite).
With it a page is a range of the index on both databases.

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-26
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_status_id", "jobs", ["status", "id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_status_id", table_name="jobs")
