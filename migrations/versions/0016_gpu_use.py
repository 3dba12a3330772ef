"""GPU use per job: each worker's GPUs as NVML names them (workers.gpu_devices), and the
samples of a job's GPUs while it runs (gpu_samples), its system metrics

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("gpu_devices", sa.JSON(none_as_null=True), nullable=True))
    sqlite = op.get_bind().dialect.name == "sqlite"
    op.create_table(
        "gpu_samples",
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("gpu", sa.Integer(), nullable=False),
        sa.Column("slot", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("at", service.models.UTCDateTime(timezone=True), nullable=False),
        sa.Column("utilization", sa.Float(), nullable=False),
        sa.Column("memory_used", sa.BigInteger(), nullable=False),
        sa.Column("memory_total", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "worker", "gpu", "slot"),
        **({"sqlite_with_rowid": False} if sqlite else {}),
    )


def downgrade() -> None:
    op.drop_table("gpu_samples")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("gpu_devices")
