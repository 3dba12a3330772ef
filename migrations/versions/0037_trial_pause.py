"""A sweep's paused trials

``jobs.pausing``: why a running trial's sweep paused it at a rung (service.sweeps, its
early stopping's ``mode: pause``); the job is held with its checkpoint once its attempt
ends, and released when the sweep promotes it.

Revision ID: 0037
Revises: 0036
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0037"
down_revision: str | None = "0036"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("pausing", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("pausing")
