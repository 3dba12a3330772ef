"""workers.left_at: when a stopping worker said it was leaving (POST /workers/leave)

From then on no job is claimed for it (service.queue.claim reads the mark in the claim's
own transaction) until it registers again, which clears it; its attempts' heartbeats and
finish reports go on while they stop.

Revision ID: 0040
Revises: 0039
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0040"
down_revision: str | None = "0039"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(
            sa.Column("left_at", service.models.UTCDateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("left_at")
