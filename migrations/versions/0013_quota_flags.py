"""Quotas hold queued jobs back: jobs.quota_running and jobs.quota_gpus

Set on a queued job whenever what its owner holds or may hold changes
(service.queue.quotas): quota_running, its owner runs as many jobs as they may;
quota_gpus, run on GPUs it would take its owner past their GPUs. The claim passes over
a job so flagged; its reason says which limit holds it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("quota_running", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(
            sa.Column("quota_gpus", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("quota_gpus")
        batch.drop_column("quota_running")
