"""History retention: an ended job's long metric series downsampled, its log deleted

jobs.metrics_swept_at: when retention went over the job's series (NULL: not yet);
jobs.metrics_thinned: the points that removed; jobs.log_dropped_at: when its log was
deleted. Two partial indexes list what is left to do, oldest first.

A user's jobs newest first (`ddpq ls --user/--mine`) come from an index with the id:
(owner, id) and (owner, status, id) replace (owner, status), with which Postgres walked
every job backwards for a user of few (bench/history.py: 3 s for a million jobs).

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("metrics_swept_at", service.models.UTCDateTime(timezone=True), nullable=True)
        )
        batch.add_column(
            sa.Column("metrics_thinned", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch.add_column(
            sa.Column("log_dropped_at", service.models.UTCDateTime(timezone=True), nullable=True)
        )
    for name, column in (
        ("ix_jobs_metrics_due", "metrics_swept_at"),
        ("ix_jobs_log_due", "log_dropped_at"),
    ):
        where = sa.text(f"finished_at IS NOT NULL AND {column} IS NULL")
        op.create_index(name, "jobs", ["finished_at"], postgresql_where=where, sqlite_where=where)

    op.create_index("ix_jobs_owner_id", "jobs", ["owner", "id"])
    op.create_index("ix_jobs_owner_status_id", "jobs", ["owner", "status", "id"])
    op.drop_index("ix_jobs_owner_status", table_name="jobs")


def downgrade() -> None:
    op.create_index("ix_jobs_owner_status", "jobs", ["owner", "status"])
    op.drop_index("ix_jobs_owner_status_id", table_name="jobs")
    op.drop_index("ix_jobs_owner_id", table_name="jobs")
    op.drop_index("ix_jobs_log_due", table_name="jobs")
    op.drop_index("ix_jobs_metrics_due", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("log_dropped_at")
        batch.drop_column("metrics_thinned")
        batch.drop_column("metrics_swept_at")
