"""The job purge: ended jobs by when they ended

The purge (service.retention, DDPQ_JOB_RETENTION) deletes the jobs that ended longer
than the retention ago, oldest first: a range of this index, never a walk of every job.

Revision ID: 0025
Revises: 0021
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0025"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
