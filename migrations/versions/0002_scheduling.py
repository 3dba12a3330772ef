"""jobs.queued_at (the starvation guard's clock), jobs.held_cpu_slots and a worker index

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("queued_at", service.models.UTCDateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(
            sa.Column("held_cpu_slots", sa.Integer(), server_default="0", nullable=False)
        )
        batch_op.create_index("ix_jobs_worker_status", ["worker", "status"], unique=False)
    op.execute("UPDATE jobs SET queued_at = created_at")
    # Running CPU jobs from before this column hold their ranks' slots.
    op.execute(
        "UPDATE jobs SET held_cpu_slots = nproc_per_node "
        "WHERE status IN ('running', 'cancelling') AND (gpus IS NULL OR CAST(gpus AS TEXT) = '[]')"
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_worker_status")
        batch_op.drop_column("held_cpu_slots")
        batch_op.drop_column("queued_at")
