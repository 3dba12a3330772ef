"""Holds, and the indexes accounting reads a window by

``jobs.held_by`` is who held a job (status ``held``): a member releases only their own
holds, an admin any (service.holds). ``ix_jobs_created_at`` and ``ix_attempts_ended_at``:
the jobs submitted, and the attempts that ran, in a window (service.accounting).

Revision ID: 0035
Revises: 0034
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0035"
down_revision: str | None = "0034"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("held_by", sa.String(64), nullable=True))
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_index("ix_attempts_ended_at", "attempts", ["ended_at"])


def downgrade() -> None:
    op.drop_index("ix_attempts_ended_at", table_name="attempts")
    op.drop_index("ix_jobs_created_at", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("held_by")
