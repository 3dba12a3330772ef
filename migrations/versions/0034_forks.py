"""Forks: a job that starts from another job's checkpoint

``jobs.fork_checkpoint_id`` is the checkpoint a job starts from (no foreign key: the
checkpoint row goes with its job's purge, and the fork keeps its copy). A checkpoint
some fork or download wants is asked of its worker (``send_asked_at``), which sends it
to the API as a code snapshot (``snapshot``) or says why it could not
(``send_problem``): service.forks.

Revision ID: 0034
Revises: 0033
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0034"
down_revision: str | None = "0033"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

When = service.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("fork_checkpoint_id", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("send_asked_at", When, nullable=True))
        batch.add_column(sa.Column("snapshot", sa.String(64), nullable=True))
        batch.add_column(sa.Column("send_problem", sa.Text(), nullable=True))
    # Which jobs wait for a checkpoint being sent; which checkpoints a worker must send.
    op.create_index("ix_jobs_fork_checkpoint_id", "jobs", ["fork_checkpoint_id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_fork_checkpoint_id", table_name="jobs")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("send_problem")
        batch.drop_column("snapshot")
        batch.drop_column("send_asked_at")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("fork_checkpoint_id")
