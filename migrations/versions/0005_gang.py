"""job_nodes: the node slots of multi-node (nnodes > 1) jobs, claimed as a gang; the
index that finds queued multi-node jobs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_nodes",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("addr", sa.String(length=255), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(length=8), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("held_cpu_slots", sa.Integer(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("checkpoint_dir", sa.Text(), nullable=False),
        sa.Column("claimed_at", service.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", service.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("ended_at", service.models.UTCDateTime(timezone=True), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("log_bytes", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "attempt", "node_rank", name="uq_job_nodes_rank"),
        sa.UniqueConstraint("job_id", "attempt", "worker", name="uq_job_nodes_worker"),
        sa.UniqueConstraint("token_hash"),
    )
    with op.batch_alter_table("job_nodes", schema=None) as batch_op:
        batch_op.create_index("ix_job_nodes_worker", ["worker", "ended_at"], unique=False)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_status_nnodes", ["status", "nnodes"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_status_nnodes")
    with op.batch_alter_table("job_nodes", schema=None) as batch_op:
        batch_op.drop_index("ix_job_nodes_worker")
    op.drop_table("job_nodes")
