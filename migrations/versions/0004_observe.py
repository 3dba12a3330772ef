"""Observing jobs: metric_points.seq and jobs.metrics_seq (the events stream's cursor),
attempts.reason (GET /jobs/{id}/attempts), and on SQLite metric_points WITHOUT ROWID
(a series is one contiguous range: downsampling a million points reads it in one pass)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("metrics_seq", sa.BigInteger(), server_default="0", nullable=False)
        )
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reason", sa.Text(), nullable=True))
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table(
        "metric_points",
        schema=None,
        # SQLite cannot drop a table's rowid in place: batch mode copies it into a new one.
        recreate="always" if sqlite else "auto",
        table_kwargs={"sqlite_with_rowid": False} if sqlite else {},
    ) as batch_op:
        batch_op.add_column(sa.Column("seq", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.create_index("ix_metric_points_job_seq", ["job_id", "seq"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("metric_points", schema=None) as batch_op:
        batch_op.drop_index("ix_metric_points_job_seq")
        batch_op.drop_column("seq")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("reason")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("metrics_seq")
