"""Sweeps

``sweeps`` holds one row per sweep (service.sweeps): its spec, the seed its draws come
from, how many trials it made, where it stands and its best trial. ``sweep_trials`` holds
one row per trial: its job (an ordinary job of the sweep's owner; NULL once the job is
purged, the row keeping the record), its parameters, and what the sweep recorded of it.

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import service.models

revision: str = "0032"
down_revision: str | None = "0031"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

When = service.models.UTCDateTime(timezone=True)
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("trials_made", sa.Integer(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("best_trial", sa.Integer(), nullable=True),
        sa.Column("best_value", sa.Float(), nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("finished_at", When, nullable=True),
    )
    op.create_index("ix_sweeps_status", "sweeps", ["status"])
    op.create_index("ix_sweeps_owner_id", "sweeps", ["owner", "id"])
    op.create_table(
        "sweep_trials",
        sa.Column(
            "sweep_id",
            Id,
            sa.ForeignKey("sweeps.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("number", sa.Integer(), primary_key=True),
        sa.Column(
            "job_id", sa.BigInteger(), sa.ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True
        ),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("rungs", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("finished_at", When, nullable=True),
    )
    op.create_index("ix_sweep_trials_job_id", "sweep_trials", ["job_id"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_sweep_trials_job_id", table_name="sweep_trials")
    op.drop_table("sweep_trials")
    op.drop_index("ix_sweeps_owner_id", table_name="sweeps")
    op.drop_index("ix_sweeps_status", table_name="sweeps")
    op.drop_table("sweeps")
