"""Preemption: the running job asked to hand its slots back, and the job it makes room for

jobs.preempted_by: a running job whose worker is asked (by its heartbeat) to hand it back
for the job of that id, which outranks it; it is requeued without counting a failure,
its reason naming who took its slots. jobs.preempting_on and preempting_since: a queued
job for which others on that worker were asked to make room; until it starts there, no
job behind it starts on that worker.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("preempted_by", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("preempting_on", sa.String(length=200), nullable=True))
        batch.add_column(
            sa.Column("preempting_since", service.models.UTCDateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("preempting_since")
        batch.drop_column("preempting_on")
        batch.drop_column("preempted_by")
