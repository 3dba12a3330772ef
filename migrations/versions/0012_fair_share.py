"""Fair share and quotas: each user's decayed usage, the share a queued job is ordered
by, how far each attempt's use is counted, and per-user limits

user_usage holds each user's recent use of the hosts in GPU-equivalent seconds (a CPU
slot counts a fraction of a GPU), decayed with a half-life: stored scaled to the time
in fairshare_epoch, so that usages and shares compare without being decayed again. A queued
job carries its owner's usage as jobs.share: the claim takes, among jobs of one
priority, the one whose owner used least (then the oldest), and the index holds that
order. attempts.counted_until says up to when an attempt's use is in its owner's usage
(the sweeper counts running attempts as they go; the end counts the rest). quotas holds
per-user limits, the row named '*' the default for all.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

When = service.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("share", sa.Float(), nullable=False, server_default="0"))
    # Outside the batch: SQLite's batch mode cannot copy an index on an expression.
    op.drop_index("ix_jobs_status_priority_id", table_name="jobs")
    op.create_index(
        "ix_jobs_status_priority_share_id",
        "jobs",
        ["status", sa.text("priority DESC"), "share", "id"],
        unique=False,
    )
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("counted_until", When, nullable=True))
    op.create_table(
        "user_usage",
        sa.Column("owner", sa.String(length=64), primary_key=True),
        sa.Column("usage", sa.Float(), nullable=False),
        sa.Column("updated_at", When, nullable=False),
    )
    op.create_table(
        "fairshare_epoch",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("t0", When, nullable=False),
    )
    op.create_table(
        "quotas",
        sa.Column("owner", sa.String(length=64), primary_key=True),
        sa.Column("max_gpus", sa.Integer(), nullable=True),
        sa.Column("max_running", sa.Integer(), nullable=True),
        sa.Column("max_queued", sa.Integer(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("quotas")
    op.drop_table("fairshare_epoch")
    op.drop_table("user_usage")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("counted_until")
    op.drop_index("ix_jobs_status_priority_share_id", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("share")
    op.create_index(
        "ix_jobs_status_priority_id",
        "jobs",
        ["status", sa.text("priority DESC"), "id"],
        unique=False,
    )
