"""Checkpoint retention: which worker holds each checkpoint, and whether it is kept

checkpoints.worker: the worker whose disk holds the file (its attempt's), the one asked
to delete it; keep: marked by save_checkpoint(keep=True); bytes, mtime_ns: the file as
rank 0 saw it; state, note, pruned_at: kept, pruning, pruned or refused, why, and when.

The worker is filled in only for the checkpoints of jobs still live at the upgrade: those
of jobs that had already ended were registered under the promise that nothing deletes
them, so they keep no worker and ddpq never deletes them (docs/checkpoints.md).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("worker", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("keep", sa.Boolean(), server_default=sa.false(), nullable=False))
        batch.add_column(sa.Column("bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("mtime_ns", sa.BigInteger(), nullable=True))
        batch.add_column(
            sa.Column("state", sa.String(length=16), server_default="kept", nullable=False)
        )
        batch.add_column(sa.Column("note", sa.Text(), nullable=True))
        batch.add_column(
            sa.Column("pruned_at", service.models.UTCDateTime(timezone=True), nullable=True)
        )
        batch.create_index("ix_checkpoints_worker_state", ["worker", "state"])
    op.execute(
        "UPDATE checkpoints SET worker = (SELECT attempts.worker FROM attempts"
        " WHERE attempts.job_id = checkpoints.job_id AND attempts.number = checkpoints.attempt)"
        " WHERE job_id IN (SELECT id FROM jobs"
        " WHERE status NOT IN ('succeeded', 'failed', 'cancelled'))"
    )


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_index("ix_checkpoints_worker_state")
        batch.drop_column("pruned_at")
        batch.drop_column("note")
        batch.drop_column("state")
        batch.drop_column("mtime_ns")
        batch.drop_column("bytes")
        batch.drop_column("keep")
        batch.drop_column("worker")
