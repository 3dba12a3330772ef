"""Slurm bridges: workers.cluster, attempts.external_id and attempts.node_log_bytes

A worker may be a bridge to a Slurm partition (workers.cluster: the shape of its
nodes). An attempt it hands to Slurm keeps the Slurm job id (attempts.external_id),
and the nodes of such an attempt ship their output themselves, each its own stream
(attempts.node_log_bytes: bytes stored per node rank).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("cluster", sa.JSON(), nullable=True))
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("external_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("node_log_bytes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("node_log_bytes")
        batch.drop_column("external_id")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("cluster")
