"""user_usage.shared: the share its owner's queued jobs carry (service.queue.shares)

A usage that grows rewrites its owner's queued jobs' share only once it has moved past
that by SHARE_STEP; none yet (NULL) until then, so the first use after this revision
writes them.

Revision ID: 0041
Revises: 0040
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0041"
down_revision: str | None = "0040"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("user_usage") as batch:
        batch.add_column(sa.Column("shared", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("user_usage") as batch:
        batch.drop_column("shared")
