"""Accounting's rollup by hour and by day

``usage_hours`` and ``usage_days``: each owner's ended attempts and jobs added up per hour
and per day (service.rollup), so a window's totals are sums of days and hours, not a
read of every attempt in it. ``rolled`` on jobs and attempts: what the rollup has added; existing rows start unrolled and the
sweeper adds them a batch at a time (accounting counts what is not yet rolled from the
rows themselves meanwhile, so its figures never change). ``ix_attempts_started_at``: a
window's attempts, newest first, and those that started in an edge hour.

Revision ID: 0036
Revises: 0035
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0036"
down_revision: str | None = "0035"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INTS = (
    "alive", "alive_gpus", "alive_cpus", "alive_preempted", "started", "started_preempted",
    "jobs_alive", "jobs_made",
)  # fmt: skip


def upgrade() -> None:
    op.create_table(
        "usage_hours",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=False) for name in ("seconds", "gpu_s", "cpu_s")),
        *(sa.Column(name, sa.Integer(), nullable=False) for name in _INTS),
        sa.PrimaryKeyConstraint("hour", "owner"),
    )
    op.create_table(
        "usage_days",
        sa.Column("day", sa.DateTime(timezone=True), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=False) for name in ("seconds", "gpu_s", "cpu_s")),
        *(
            sa.Column(name, sa.Integer(), nullable=False)
            for name in ("started", "started_preempted", "jobs_made")
        ),
        sa.PrimaryKeyConstraint("day", "owner"),
    )
    for table in ("jobs", "attempts"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("rolled", sa.Boolean(), nullable=False, server_default=sa.false())
            )
        due = sa.text("rolled = false") if op.get_bind().dialect.name == "postgresql" else None
        due = due if due is not None else sa.text("rolled = 0")
        op.create_index(
            f"ix_{table}_unrolled", table, ["id"], postgresql_where=due, sqlite_where=due
        )
    op.create_index("ix_attempts_started_at", "attempts", ["started_at"])


def downgrade() -> None:
    op.drop_index("ix_attempts_started_at", table_name="attempts")
    for table in ("attempts", "jobs"):
        op.drop_index(f"ix_{table}_unrolled", table_name=table)
        with op.batch_alter_table(table) as batch:
            batch.drop_column("rolled")
    op.drop_table("usage_days")
    op.drop_table("usage_hours")
