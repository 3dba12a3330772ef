"""Dependencies: a job that starts after others

``job_deps`` holds each dependency a queued job still waits for (service.queue.deps): the
job waited for (no foreign key: it may be purged once it has settled this row) and when
it counts as met (ok: it succeeded; any: it ended). ``jobs.waits_on`` counts a job's
unmet ones, which the claim reads (rules.ready) as it reads a retry's backoff.

Revision ID: 0033
Revises: 0032
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0033"
down_revision: str | None = "0032"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "job_deps",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("job_id", Id, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("on_job", sa.BigInteger(), nullable=False),
        sa.Column("when", sa.String(8), nullable=False),
    )
    op.create_index("ix_job_deps_on_job", "job_deps", ["on_job"])
    op.create_index("ix_job_deps_job_id", "job_deps", ["job_id"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("waits_on", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("waits_on")
    op.drop_index("ix_job_deps_job_id", table_name="job_deps")
    op.drop_index("ix_job_deps_on_job", table_name="job_deps")
    op.drop_table("job_deps")
