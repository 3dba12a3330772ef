"""jobs.not_before (retry backoff) and jobs.failures (what counts against max_attempts); the claim's indexes: queue order with priority
descending, the oldest queued job, and the CPU slots held per worker from the index alone

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("not_before", service.models.UTCDateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(sa.Column("failures", sa.Integer(), server_default="0", nullable=False))
        batch_op.create_index("ix_jobs_status_queued_at", ["status", "queued_at"], unique=False)
        batch_op.drop_index("ix_jobs_status_priority_id")
        batch_op.create_index(
            "ix_jobs_status_priority_id", ["status", sa.text("priority DESC"), "id"], unique=False
        )
        batch_op.drop_index("ix_jobs_worker_status")
        batch_op.create_index(
            "ix_jobs_worker_status", ["worker", "status", "held_cpu_slots"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_worker_status")
        batch_op.create_index("ix_jobs_worker_status", ["worker", "status"], unique=False)
        batch_op.drop_index("ix_jobs_status_priority_id")
        batch_op.create_index(
            "ix_jobs_status_priority_id", ["status", "priority", "id"], unique=False
        )
        batch_op.drop_index("ix_jobs_status_queued_at")
        batch_op.drop_column("failures")
        batch_op.drop_column("not_before")
